"""`divergence(fn, y)`: a function's value and the trace of its Jacobian, in one
forward-mode pass."""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._custom_types import Key
from ._base import AbstractEstimator, check_estimator, check_floating
from ._exact import Exact


def divergence(
    fn: Callable[[Float[Array, "*shape"]], Float[Array, "*shape"]],
    y: Float[Array, "*shape"],
    *,
    estimator: AbstractEstimator = Exact(),
    key: Key | None = None,
) -> tuple[Float[Array, "*shape"], Float[Array, ""]]:
    """Evaluates `fn(y)` and the divergence `tr(d fn / d y)` together.

    Both come from forward-mode Jacobian-vector products: one per basis vector for
    [`Exact`][cnftrace.Exact], one per probe for [`Hutchinson`][cnftrace.Hutchinson],
    `num_matvecs` for [`HutchPlusPlus`][cnftrace.HutchPlusPlus] and
    [`XTrace`][cnftrace.XTrace]; the primal `fn(y)` is computed once. It works under
    `jit`, `vmap` and `grad`.

    **Arguments:**

    - `fn`: a function from `y`'s shape to the same shape, e.g. `(d,) -> (d,)`.
    - `y`: the point, a floating array.
    - `estimator`: any estimator; [`Exact`][cnftrace.Exact] by default.
    - `key`: a PRNG key; required by stochastic estimators.

    **Returns:**

    `(fn(y), divergence)`, the divergence a scalar of `y`'s dtype.

    !!! example

        ```python
        fy, div = cnftrace.divergence(lambda y: jnp.tanh(y), jnp.ones(3))
        # A stochastic estimate, and its gradient with respect to the point:
        fy, div = cnftrace.divergence(
            jnp.tanh, jnp.ones(3), estimator=cnftrace.Hutchinson(), key=jr.key(0)
        )
        grad = jax.grad(lambda y: cnftrace.divergence(jnp.tanh, y)[1])(jnp.ones(3))
        ```
    """
    y = jnp.asarray(y)
    check_floating(y, "y")
    if y.size == 0:
        raise ValueError(
            f"`y` is empty (shape {y.shape}): a function of no variables has no "
            "Jacobian to take the trace of; pass a point with at least one entry."
        )
    check_estimator(estimator)
    out = jax.eval_shape(fn, y)
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != y.shape:
        got = out.shape if isinstance(out, jax.ShapeDtypeStruct) else out
        raise ValueError(
            f"`fn` must map an array of shape {y.shape} to the same shape (its "
            f"Jacobian must be square to have a trace); it returned {got}."
        )
    probes = estimator.draw(key, y.shape, y.dtype, event_ndim=y.ndim)
    return estimator.estimate(fn, y, probes)
