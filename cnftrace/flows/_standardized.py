"""A flow over data in its own units: a per-coordinate standardisation in front of a
flow trained on the standardised data.

`StandardizedFlow(flow, Standardization(mean, scale))` models `x` through
`y = (x - mean) / scale`, so

    log p(x) = log p_flow(y) - sum(log scale)

and its samples are the flow's samples mapped back, `x = mean + scale * y`. The
command line trains `flow` on standardised data and `cnftrace.load` hands back this
wrapper, so that `log_prob` and `sample` work in the data's units.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..estimators import AbstractEstimator
from ._base import AbstractFlow
from ._cnf import CNF


class Standardization(eqx.Module):
    """The map `y = (x - mean) / scale` from data to standardised units, coordinate
    by coordinate, with its inverse and log-determinant.

    **Arguments:**

    - `mean`: the shift, one value per coordinate (shape `event_shape`).
    - `scale`: the positive scale, of the same shape.

    Build one from training data with
    [`Standardization.from_data`][cnftrace.Standardization.from_data], which refuses
    a column that does not vary (it cannot be standardised).

    !!! example

        ```python
        import numpy as np

        data = np.array([[1.0, 10.0], [3.0, 30.0], [5.0, 20.0]])
        std = cnftrace.Standardization.from_data(data)
        y = std.forward(data)                      # mean 0, standard deviation 1
        print(np.allclose(std.inverse(y), data), std.log_det)  # True, -sum(log scale)
        ```
    """

    mean: Float[Array, "..."]
    scale: Float[Array, "..."]

    def __check_init__(self):
        if jnp.shape(self.mean) != jnp.shape(self.scale):
            raise ValueError(
                f"`mean` and `scale` must have one shape; got {jnp.shape(self.mean)} "
                f"and {jnp.shape(self.scale)}."
            )

    @staticmethod
    def from_data(data, *, name: str = "data") -> "Standardization":
        """The mean and standard deviation of each coordinate of `data` (shape
        `(n, *event_shape)`, at least two rows), as a `Standardization`.

        A `ValueError` names the first coordinate whose standard deviation is zero
        (or not finite): it holds one value only, and has no density to learn.

        !!! example

            ```python
            import numpy as np

            std = cnftrace.Standardization.from_data(np.array([[0.0], [2.0]]))
            print(std.mean, std.scale)  # [1.] [1.]
            ```
        """
        data = np.asarray(data, dtype=np.float64)
        if data.ndim < 2 or data.shape[0] < 2:
            raise ValueError(
                f"`{name}` must hold at least two samples, shape (n, *event) with "
                f"n >= 2, to be standardised; got shape {data.shape}."
            )
        mean = data.mean(axis=0)
        scale = data.std(axis=0)
        bad = ~(np.isfinite(scale) & (scale > 0))
        if bad.any():
            where = np.unravel_index(int(np.flatnonzero(bad)[0]), bad.shape)
            index = where[0] if len(where) == 1 else where
            value = data[(0, *where)].item()  # a Python number, printed as one
            raise ValueError(
                f"column {index} of `{name}` is constant (it takes the value "
                f"{value!r} in all {data.shape[0]} rows), so it cannot be "
                "standardised: a zero standard deviation. Drop that column."
            )
        return Standardization(mean, scale)  # float64 NumPy: no precision lost

    @property
    def log_det(self) -> Float[Array, ""]:
        """`log|det dy/dx|` of the map, the same for every sample: `-sum(log scale)`."""
        return -jnp.sum(jnp.log(jnp.asarray(self.scale)))

    def _constants(self, x):
        shape = (1,) * (x.ndim - jnp.ndim(self.mean)) + jnp.shape(self.mean)
        # Constants of the data, not parameters: a flow fine-tuned by `fit` keeps them.
        mean = jax.lax.stop_gradient(jnp.asarray(self.mean, x.dtype))
        scale = jax.lax.stop_gradient(jnp.asarray(self.scale, x.dtype))
        return mean.reshape(shape), scale.reshape(shape)

    def forward(self, x: Float[Array, "*batch event"]) -> Float[Array, "*batch event"]:
        """Data to standardised units: `(x - mean) / scale`."""
        x = jnp.asarray(x)
        mean, scale = self._constants(x)
        return (x - mean) / scale

    def inverse(self, y: Float[Array, "*batch event"]) -> Float[Array, "*batch event"]:
        """Standardised units back to data: `mean + scale * y`."""
        y = jnp.asarray(y)
        mean, scale = self._constants(y)
        return mean + scale * y


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
    standardization: Standardization

    def __check_init__(self):
        if not isinstance(self.flow, AbstractFlow):
            raise TypeError(
                f"`flow` must be a cnftrace flow; got {type(self.flow).__name__}."
            )
        if not isinstance(self.standardization, Standardization):
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
