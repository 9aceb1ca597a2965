"""The base class of trace estimators, and what every estimator shares."""

import abc
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import is_int
from .._custom_types import Key


class AbstractEstimator(eqx.Module):
    """Base class for trace estimators.

    Subclasses say whether they need random probes (`stochastic`), how to draw them
    ([`draw`][cnftrace.AbstractEstimator.draw]) and how to turn a linear map into a
    trace estimate given those probes
    ([`estimate`][cnftrace.AbstractEstimator.estimate]). Drawing and estimating are
    separate so that a CNF draws its probes once per ODE solve and reuses them at
    every evaluation of the vector field.

    Every function that takes an `estimator=` ([`divergence`][cnftrace.divergence],
    [`trace`][cnftrace.trace], [`CNF`][cnftrace.CNF], [`fit`][cnftrace.fit], ...)
    accepts any subclass.

    !!! example

        ```python
        est = cnftrace.Hutchinson(num_probes=2)
        y = jnp.ones(3)
        probes = est.draw(jr.key(0), y.shape, y.dtype)  # shape (2, 3)
        fy, div = est.estimate(jnp.sin, y, probes)      # d/dy sin(y) = cos(y)
        ```
    """

    stochastic: ClassVar[bool]

    @abc.abstractmethod
    def draw(
        self, key: Key | None, shape: tuple[int, ...], dtype, *, event_ndim: int = 1
    ) -> Float[Array, "..."] | None:
        """Draws the probes for a state of shape `(*batch, *event)`.

        **Arguments:**

        - `key`: a JAX PRNG key (ignored, and may be `None`, for deterministic
            estimators).
        - `shape`: `(*batch, *event)`; `event_ndim` trailing dimensions are the sample.
        - `dtype`: the floating dtype of the state; probes have this dtype.
        - `event_ndim`: how many trailing dimensions of `shape` make one sample.

        **Returns:**

        An array of shape `(*batch, num_probes, *event)`, or `None`.
        """

    @abc.abstractmethod
    def estimate(
        self,
        fn: Callable[[Float[Array, "*event"]], Float[Array, "*event"]],
        y: Float[Array, "*event"],
        probes: Float[Array, " probes *event"] | None,
    ) -> tuple[Float[Array, "*event"], Float[Array, ""]]:
        """Evaluates `fn(y)` and estimates the trace of its Jacobian, for one sample.

        **Arguments:**

        - `fn`: a function from `y`'s shape to the same shape.
        - `y`: one sample.
        - `probes`: what [`draw`][cnftrace.AbstractEstimator.draw] returned for this
            sample: shape `(num_probes, *y.shape)`, or `None`.

        **Returns:**

        `(fn(y), estimate of tr(d fn / d y))`.
        """

    def estimate_with_jacobian_norm(
        self,
        fn: Callable[[Float[Array, "*event"]], Float[Array, "*event"]],
        y: Float[Array, "*event"],
        probes: Float[Array, " probes *event"] | None,
    ) -> tuple[Float[Array, "*event"], Float[Array, ""], Float[Array, ""]]:
        """Like [`estimate`][cnftrace.AbstractEstimator.estimate], and also estimates
        the squared Frobenius norm of `J = d fn / d y` from the same Jacobian-vector
        products (no extra evaluations of `fn`): RNODE's Jacobian regulariser.

        **Returns:**

        `(fn(y), trace estimate, squared Frobenius norm estimate)`. Estimators that
        do not support the norm raise `NotImplementedError`.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not estimate the Jacobian's Frobenius norm; "
            "use `cnftrace.Exact()` or `cnftrace.Hutchinson()` for Jacobian "
            "regularisation."
        )


def check_estimator(estimator, name: str = "estimator") -> None:
    """A `TypeError` naming every trace estimator unless `estimator` is one."""
    if not isinstance(estimator, AbstractEstimator):
        raise TypeError(
            f"`{name}` must be a trace estimator: `cnftrace.Exact()`, "
            "`cnftrace.Hutchinson(...)`, `cnftrace.HutchPlusPlus(...)` or "
            f"`cnftrace.XTrace(...)`; got {type(estimator).__name__}."
        )


def check_settings(
    owner: str, name: str, count, sampler, samplers, minimum: int = 1, multiple: int = 1
) -> tuple[int, str]:
    """An estimator's number of vectors `count` (its argument `name`) as a Python
    `int`, and its `sampler`, after checking them; checked before assignment, since
    a JAX array must never become a static field."""
    if not is_int(count):
        raise ValueError(
            f"`{name}` of `{owner}` must be a Python int (it fixes array shapes, so it "
            f"cannot be a JAX array or a float); got {count!r} of type "
            f"{type(count).__name__}. Use e.g. `{owner}({name}={minimum * multiple})`."
        )
    if count < minimum or count % multiple != 0:
        lower = max(minimum, multiple * (count // multiple))
        rule = f"a multiple of {multiple} and at least" if multiple > 1 else "at least"
        raise ValueError(
            f"`{name}` of `{owner}` must be {rule} {minimum}; got {count}. Use e.g. "
            f"`{name}={lower}`."
        )
    if sampler not in samplers:
        raise ValueError(f"`sampler` must be one of {samplers}; got {sampler!r}.")
    return int(count), sampler


def need_probe_key(estimator, key, what: str) -> None:
    """A `ValueError` where a stochastic estimator that draws `what` has no key."""
    if key is None:
        raise ValueError(
            f"`{type(estimator).__name__}` draws {what} and needs a PRNG key; pass "
            "`key=jax.random.key(seed)`, or use `cnftrace.Exact()` for the exact "
            "trace."
        )


def check_floating(y: Array, name: str) -> None:
    if not jnp.issubdtype(y.dtype, jnp.inexact):
        raise TypeError(
            f"`{name}` has dtype {y.dtype}, but divergences and traces need a floating "
            f"dtype; convert it first, e.g. `{name}.astype(jnp.float32)`."
        )


# Up to this many tangents, `jvp_columns` applies the linearised function to each in
# turn rather than under `vmap`.
_UNROLL_TANGENTS = 4


def jvp_columns(fn, y, tangents):
    """`(fn(y), [J v for v in tangents])`: one forward-mode pass per tangent, with the
    primal output computed once.

    A few tangents (one probe, or the basis of a small state) go through one at a
    time: a `vmap` over them adds an axis that XLA meets with a transpose and a copy
    of every tangent activation, forward and backward, which made a training step
    slower. More tangents are batched with `vmap`."""

    def jvp(v):
        return jax.jvp(fn, (y,), (v,))

    n = tangents.shape[0]
    if n == 1:
        fy, jv = jvp(tangents[0])
        return fy, jv[None]
    if n <= _UNROLL_TANGENTS:
        fy, linear = jax.linearize(fn, y)
        return fy, jnp.stack([linear(tangents[i]) for i in range(n)])
    return jax.vmap(jvp, out_axes=(None, 0))(tangents)
