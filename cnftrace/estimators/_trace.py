"""The trace of a square lineax operator, exact or estimated: a plain differentiable
function of the operator's `mv` (or of `lineax.diagonal`, for the exact trace)."""

import jax
import jax.flatten_util as jfu
import jax.numpy as jnp
import jax.tree_util as jtu
import lineax as lx
from jaxtyping import Array, Float

from .._custom_types import Key
from ._base import AbstractEstimator, check_estimator
from ._exact import Exact
from ._sketch import AbstractSketchEstimator


def _check_square(operator: lx.AbstractLinearOperator) -> None:
    in_struct, out_struct = operator.in_structure(), operator.out_structure()
    in_shapes = jtu.tree_map(lambda s: s.shape, in_struct)
    out_shapes = jtu.tree_map(lambda s: s.shape, out_struct)
    if jtu.tree_structure(in_struct) != jtu.tree_structure(out_struct) or (
        in_shapes != out_shapes
    ):
        raise ValueError(
            "`operator` must be square to have a trace: its input structure "
            f"{in_shapes} differs from its output structure {out_shapes}. "
            "(A trace needs inputs and outputs of the same shapes.)"
        )


def trace(
    operator: lx.AbstractLinearOperator,
    *,
    estimator: AbstractEstimator = Exact(),
    key: Key | None = None,
) -> Float[Array, ""]:
    """The trace of a square lineax operator.

    **Arguments:**

    - `operator`: any square `lineax.AbstractLinearOperator` (matrix, diagonal,
        function, Jacobian, pytree, composed ... operators). Input and output
        structures must match.
    - `estimator`: [`Exact`][cnftrace.Exact] (default) uses `lineax.diagonal`, which
        is cheap for structured operators and materialises the others;
        [`Hutchinson`][cnftrace.Hutchinson] costs `num_probes` calls of
        `operator.mv`; [`HutchPlusPlus`][cnftrace.HutchPlusPlus] and
        [`XTrace`][cnftrace.XTrace] cost `num_matvecs` calls (in two batched
        rounds; a `lineax.JacobianLinearOperator` is linearised once first) and
        need a real operator.
    - `key`: a PRNG key, required by stochastic estimators.

    **Returns:**

    A scalar. It is differentiable with respect to the arrays inside `operator`.

    !!! example

        ```python
        op = lineax.MatrixLinearOperator(jnp.eye(3))
        cnftrace.trace(op)  # 3.0
        # The Jacobian of a function at a point, estimated from 4 products:
        jac = lineax.JacobianLinearOperator(lambda x, args: jnp.sin(x), jnp.zeros(5))
        cnftrace.trace(jac, estimator=cnftrace.XTrace(4), key=jr.key(0))  # 5.0
        ```
    """
    if not isinstance(operator, lx.AbstractLinearOperator):
        raise TypeError(
            "`operator` must be a lineax linear operator, e.g. "
            f"`lineax.MatrixLinearOperator(matrix)`; got {type(operator).__name__}."
        )
    check_estimator(estimator)
    _check_square(operator)
    if not estimator.stochastic:
        return jnp.sum(lx.diagonal(operator))

    in_struct = operator.in_structure()
    dtypes = [s.dtype for s in jtu.tree_leaves(in_struct)]
    dtype = jnp.result_type(*dtypes)
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(
            f"`operator` acts on arrays of dtype {dtype}; a stochastic trace needs a "
            "floating dtype."
        )
    probe_dtype = jnp.finfo(dtype).dtype  # the real dtype of a complex operator
    zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), in_struct)
    _, unravel = jfu.ravel_pytree(zeros)
    size = operator.in_size()
    probes = estimator.draw(key, (size,), probe_dtype, event_ndim=1)
    sketch = isinstance(estimator, AbstractSketchEstimator)
    if sketch and probe_dtype != dtype:
        raise TypeError(
            f"`{type(estimator).__name__}` supports real operators only; `operator` "
            f"acts on arrays of dtype {dtype}. Use `cnftrace.Hutchinson` instead."
        )
    if sketch and isinstance(operator, lx.JacobianLinearOperator):
        operator = lx.linearise(operator)  # one primal pass for both rounds

    def flat_mv(v):
        av, _ = jfu.ravel_pytree(operator.mv(unravel(v)))
        return av

    if sketch:
        return estimator.trace_of_matvec(jax.vmap(flat_mv), probes)
    return jnp.mean(jax.vmap(lambda v: jnp.dot(v, flat_mv(v)))(probes))
