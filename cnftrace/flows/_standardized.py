"""A flow over data in its own units: a per-coordinate standardisation in front of a
flow trained on the standardised data."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from equinox import AbstractVar
from jaxtyping import Array, Float

from ..estimators import AbstractEstimator
from ._base import AbstractFlow
from ._cnf import CNF
from ._distributions import AbstractBase


class AbstractStandardization(eqx.Module):
    """The map `y = (x - mean) / scale` from data to standardised units, coordinate
    by coordinate, with its inverse and log-determinant: what a
    [`StandardizedFlow`][cnftrace.StandardizedFlow] needs of a standardisation.

    The map is the flow's; its statistics are the data's: the final class,
    [`Standardization`][cnftrace.Standardization], lives with the data sets
    (`cnftrace.datasets`), which compute `mean` and `scale` from training rows.
    """

    mean: AbstractVar[Float[Array, "..."]]
    scale: AbstractVar[Float[Array, "..."]]

    def _host(self, *data) -> bool:
        """Whether the map is computed on the host in float64 NumPy: for `data` that
        is not a JAX array (nor a tracer), with constants that are not either."""
        values = (*data, self.mean, self.scale)
        return not any(isinstance(v, jax.Array) for v in values)

    @property
    def log_det(self) -> Float[Array, ""]:
        """`log|det dy/dx|` of the map, the same for every sample: `-sum(log scale)`
        (a float64 NumPy scalar for NumPy constants)."""
        if self._host():
            return -np.sum(np.log(np.asarray(self.scale, np.float64)))
        return -jnp.sum(jnp.log(jnp.asarray(self.scale)))

    def _arrays(self, x):
        """`(x, mean, scale)`: in float64 NumPy for host data (NumPy, lists), so that
        a large offset (times near 1.7e9, say) keeps its precision; else JAX arrays
        in `x`'s dtype, the constants shaped to broadcast against it."""
        if self._host(x):
            return tuple(np.asarray(v, np.float64) for v in (x, self.mean, self.scale))
        x = jnp.asarray(x)
        shape = (1,) * (x.ndim - jnp.ndim(self.mean)) + jnp.shape(self.mean)
        # Constants of the data, not parameters: a flow fine-tuned by `fit` keeps them.
        mean = jax.lax.stop_gradient(jnp.asarray(self.mean, x.dtype))
        scale = jax.lax.stop_gradient(jnp.asarray(self.scale, x.dtype))
        return x, mean.reshape(shape), scale.reshape(shape)

    def forward(self, x: Float[Array, "*batch event"]) -> Float[Array, "*batch event"]:
        """Data to standardised units: `(x - mean) / scale`, in float64 NumPy for host
        data, a JAX array in its own dtype."""
        x, mean, scale = self._arrays(x)
        return (x - mean) / scale

    def inverse(self, y: Float[Array, "*batch event"]) -> Float[Array, "*batch event"]:
        """Standardised units back to data: `mean + scale * y`, as `forward` does."""
        y, mean, scale = self._arrays(y)
        return mean + scale * y


def standardize_on_host(flow, x):
    """`(inner, y, log_det)` for host data `x` (not a JAX array) of floating dtype
    given to a [`StandardizedFlow`][cnftrace.StandardizedFlow]: its inner flow, `x`
    standardised in float64 on the host, and the map's log-determinant, so that
    `flow`'s log-density of `x` is `inner`'s of `y` plus `log_det`. Otherwise
    `(flow, x, 0.0)`: JAX arrays, other flows, and input the flow's own checks
    refuse (a wrong shape, integers) are left to them."""
    if not isinstance(flow, StandardizedFlow) or not flow.standardization._host(x):
        return flow, x, 0.0
    host = np.asarray(x)
    shape = tuple(flow.event_shape)
    if not (
        np.issubdtype(host.dtype, np.floating)
        and host.dtype.itemsize >= 4
        and shape in (host.shape, host.shape[1:])
    ):
        return flow, x, 0.0
    std = flow.standardization
    return flow.flow, std.forward(host), float(std.log_det)


class StandardizedFlow(AbstractFlow):
    """A flow in the data's own units: `flow` models the standardised data
    `standardization.forward(x)`, and this flow models `x` itself.

    `log_prob(x)` is `flow.log_prob((x - mean) / scale) - sum(log scale)`, the
    log-density in the data's units; `sample` maps the flow's samples back with
    `mean + scale * y`. Every other method of
    [`AbstractFlow`][cnftrace.AbstractFlow] works the same way.
    [`load`][cnftrace.load] returns one for a run trained on a standardised data
    file (`cnftrace train --data FILE`).

    **Arguments:**

    - `flow`: the flow of the standardised data.
    - `standardization`: a [`Standardization`][cnftrace.Standardization] whose
        shape is the flow's `event_shape`.

    !!! example

        ```python
        import numpy as np

        data = np.array([[1.0, 10.0], [3.0, 30.0], [5.0, 20.0]])
        inner = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
        flow = cnftrace.StandardizedFlow(
            inner, cnftrace.Standardization.from_data(data)
        )
        logp = flow.log_prob(jnp.asarray(data))    # in the data's units
        x = flow.sample(jr.key(1), 4)              # (4, 2), in the data's units
        ```
    """

    flow: AbstractFlow
    standardization: AbstractStandardization

    def __check_init__(self):
        if not isinstance(self.flow, AbstractFlow):
            raise TypeError(
                f"`flow` must be a cnftrace flow; got {type(self.flow).__name__}."
            )
        if not isinstance(self.standardization, AbstractStandardization):
            raise TypeError(
                "`standardization` must be a `cnftrace.Standardization`; got "
                f"{type(self.standardization).__name__}."
            )
        shape = tuple(jnp.shape(self.standardization.mean))
        if shape != tuple(self.flow.event_shape):
            raise ValueError(
                f"`standardization` has shape {shape}, but `flow` models samples of "
                f"shape {tuple(self.flow.event_shape)}."
            )

    @property
    def blocks(self) -> tuple[CNF, ...]:
        """The CNF blocks of the standardised flow."""
        return self.flow.blocks

    @property
    def event_shape(self) -> tuple[int, ...]:
        return self.flow.event_shape

    @property
    def context_dim(self) -> int | None:
        return self.flow.context_dim

    @property
    def base(self) -> AbstractBase:
        """The standardised flow's base (a distribution in standardised units)."""
        return self.flow.base

    def with_base(self, base: AbstractBase) -> "StandardizedFlow":
        """A copy whose standardised flow has another base (in standardised
        units)."""
        return StandardizedFlow(self.flow.with_base(base), self.standardization)

    def log_prob(self, x, *, context=None, key=None, return_stats=False):
        """As [`AbstractFlow.log_prob`][cnftrace.AbstractFlow.log_prob]. Host data
        (NumPy, lists) is standardised on the host in float64 first, then given to
        the inner flow, so that a large offset keeps its precision."""
        settings = dict(context=context, key=key, return_stats=return_stats)
        inner, y, log_det = standardize_on_host(self, x)
        if inner is self:
            return super().log_prob(x, **settings)
        out = inner.log_prob(y, **settings)
        if return_stats:
            return out[0] + log_det, out[1]
        return out + log_det

    def with_estimator(self, estimator: AbstractEstimator) -> "StandardizedFlow":
        return StandardizedFlow(
            self.flow.with_estimator(estimator), self.standardization
        )

    def transform(
        self,
        x,
        *,
        inverse,
        log_det,
        key,
        counter=None,
        context=None,
        regularize=False,
    ):
        settings = dict(
            inverse=inverse,
            log_det=log_det,
            key=key,
            counter=counter,
            context=context,
            regularize=regularize,
        )
        std = self.standardization
        if inverse:  # base -> standardised -> data
            y, ld, stats, reg = self.flow.transform(x, **settings)
            out = std.inverse(y)
            extra = -std.log_det
        else:  # data -> standardised -> base
            out, ld, stats, reg = self.flow.transform(std.forward(x), **settings)
            extra = std.log_det
        if ld is not None:
            ld = ld + extra.astype(ld.dtype)
        return out, ld, stats, reg
