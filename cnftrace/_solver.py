"""Explicit Runge--Kutta solvers with their stages written out as straight-line code.

diffrax's Runge--Kutta `step` runs the stages in a checkpointed while loop nested in
the solve's own loop, so that for large states reverse mode does not copy the
triangular stage buffer at every stage. A CNF state is small (a batch of points and
their log-densities), so those copies cost nothing, while the inner loop costs trace
and compile time and a little runtime per stage. The solvers here unroll the stages in
Python instead; they take the same steps as diffrax's, up to rounding.
"""

from collections.abc import Callable
from typing import ClassVar

import diffrax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax


def _combine(coefficients, ks):
    """`sum_j coefficients[j] * ks[j]` over pytrees, skipping zero coefficients.

    The coefficients become Python floats: weakly typed, so the stages keep their
    dtype (as diffrax casts its tableau to the dtype of the state)."""
    terms = [(float(c), k) for c, k in zip(coefficients, ks) if c != 0]
    if not terms:
        return jtu.tree_map(jnp.zeros_like, ks[0])

    def weighted_sum(*leaves):
        total = terms[0][0] * leaves[0]
        for (c, _), leaf in zip(terms[1:], leaves[1:]):
            total = total + c * leaf
        return total

    return jtu.tree_map(weighted_sum, *(k for _, k in terms))


class AbstractUnrolledERK(diffrax.AbstractERK):
    """An explicit Runge--Kutta solver whose `step` unrolls its stages.

    Subclasses give the class attributes `tableau` (a `diffrax.ButcherTableau`) and
    `interpolation_cls`, and the method `order`, exactly as for a `diffrax.AbstractERK`,
    which this is: `init`, `func` and the solver state come from diffrax, so a
    first-same-as-last solver keeps diffrax's state `(first_step, f0)` and accepts one
    passed to `diffeqsolve(..., solver_state=...)`. Only `step` differs; terms whose
    vector field diffrax calls expensive (it then works with vector field-control
    products) fall back to diffrax's `step`.

    Unrolling traces the vector field once per stage rather than once per step, so it
    suits small vector fields on small states. `scan_kind` is inherited from diffrax
    and must stay `None`: there is no stage loop to choose a kind for.
    """

    def __check_init__(self):
        if self.scan_kind is not None:
            raise ValueError(
                f"`{type(self).__name__}` unrolls its stages and has no stage loop; "
                f"leave `scan_kind` unset (got {self.scan_kind!r})."
            )

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        vf_expensive, fsal = self._common(terms, t0, t1, y0, args)
        if vf_expensive:
            return super().step(terms, t0, t1, y0, args, solver_state, made_jump)
        tableau = self.tableau
        control = terms.contr(t0, t1)

        def first_stage():
            return terms.vf(t0, y0, args)

        if fsal:
            # The previous step's last stage is this step's first, except on the first
            # step or after a jump in the vector field.
            first_step, f_last = solver_state
            redo = first_step | made_jump
            if redo is False:
                f = f_last
            else:
                f = lax.cond(redo, first_stage, lambda: f_last)
        else:
            f = first_stage()
        ks = [terms.prod(f, control)]
        for c, a in zip(tableau.c, tableau.a_lower):
            increment = _combine(a, ks)
            y = jtu.tree_map(lambda y0_, d: y0_ + d, y0, increment)
            t = t1 if c == 1 else t0 + float(c) * (t1 - t0)
            f = terms.vf(t, y, args)
            ks.append(terms.prod(f, control))
        if not tableau.ssal:
            increment = _combine(tableau.b_sol, ks)
            y = jtu.tree_map(lambda y0_, d: y0_ + d, y0, increment)
        y_error = _combine(tableau.b_error, ks)
        k = jtu.tree_map(lambda *stages: jnp.stack(stages), *ks)
        dense_info = dict(y0=y0, y1=y, k=k)
        new_state = (False, f) if fsal else None
        return y, y_error, dense_info, new_state, diffrax.RESULTS.successful


class UnrolledTsit5(AbstractUnrolledERK):
    """`diffrax.Tsit5` (Tsitouras' 5(4) pair, seven stages, first-same-as-last, fifth
    order interpolation) with its stages unrolled; see
    [`AbstractUnrolledERK`][cnftrace._solver.AbstractUnrolledERK]."""

    tableau: ClassVar[diffrax.ButcherTableau] = diffrax.Tsit5.tableau
    interpolation_cls: ClassVar[Callable] = diffrax.Tsit5.interpolation_cls

    def order(self, terms):
        return 5


__all__ = ["AbstractUnrolledERK", "UnrolledTsit5"]
