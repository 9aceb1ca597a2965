"""An explicit Runge-Kutta step whose stages run as one `lax.scan`.

diffrax runs a step's stages as equinox's checkpointed while loop, nested inside the
loop over the steps, and reverse mode traces every step's stages several times over;
a `lax.scan` is differentiated from its traced body, so a CNF's gradient traces
faster. Each stage's evaluation of the vector field is rematerialised
(`jax.checkpoint`), as in diffrax's stage loop. The arithmetic is diffrax's (the same
tableau, steps, error estimate and dense output); results differ from diffrax's own
loop only in the order of floating-point additions."""

import diffrax
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax


def _combine(coeffs, ks):
    """`sum_i coeffs[i] * ks[i]`: a step's stages combined into a state or an error
    estimate, in full precision. As a matrix product it would otherwise run in
    TensorFloat-32 on recent NVIDIA GPUs (JAX's default there), whose rounding, about
    1e-3 of the state, is far above the tolerances the controller holds it to."""
    return jnp.tensordot(coeffs, ks, axes=1, precision=lax.Precision.HIGHEST)


def scannable(solver) -> bool:
    """Whether `solver`'s step can run as `StageScan`: an explicit, first-same-as-last
    Runge-Kutta method with one tableau (Tsit5, Dopri5, Dopri8, Bosh3) whose stage
    loop is diffrax's default (`scan_kind=None`). Pass `scan_kind="checkpointed"` to
    keep diffrax's own loop."""
    if not isinstance(solver, diffrax.AbstractERK):
        return False
    tableau = getattr(solver, "tableau", None)
    return (
        isinstance(tableau, diffrax.ButcherTableau)
        and tableau.fsal
        and tableau.ssal
        and getattr(solver, "scan_kind", None) is None
    )


class StageScan(diffrax.AbstractAdaptiveSolver, diffrax.AbstractWrappedSolver):
    """`solver`'s step (see `scannable`) with its stages as one `lax.scan`.

    The solver state is the vector field at the start of the step, `f(t0, y0)`:
    `init` evaluates it, and each step hands on its last stage, `f(t1, y1)`.
    """

    solver: diffrax.AbstractERK

    @property
    def term_structure(self):
        return self.solver.term_structure

    @property
    def interpolation_cls(self):  # pyright: ignore
        return self.solver.interpolation_cls

    def order(self, terms):
        return self.solver.order(terms)

    def strong_order(self, terms):
        return self.solver.strong_order(terms)

    def error_order(self, terms):
        return self.solver.error_order(terms)

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)

    def init(self, terms, t0, t1, y0, args):
        return terms.vf(t0, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        tableau = self.solver.tableau
        if made_jump is False:  # diffrax resolves this while tracing where it can
            f0 = solver_state
        else:
            # After a jump the stored evaluation belongs to the other side of it.
            f0 = lax.cond(
                made_jump,
                lambda: terms.vf(t0, y0, args),
                lambda: solver_state,
            )
        stages = len(tableau.c) + 1
        # Row i holds stage i + 1's coefficients on the stages before it.
        a = np.zeros((stages - 1, stages))
        for i, row in enumerate(tableau.a_lower):
            a[i, : len(row)] = row
        control = terms.contr(t0, t1)
        k0 = terms.prod(f0, control)
        ks = jtu.tree_map(
            lambda k: jnp.zeros((stages,) + k.shape, k.dtype).at[0].set(k), k0
        )
        dt = t1 - t0
        time_dtype = jnp.result_type(dt)
        vf = jax.checkpoint(lambda t, y: terms.vf(t, y, args), prevent_cse=False)

        def stage(carry, x):
            ks, _, _ = carry
            index, coeffs, c = x
            y = jtu.tree_map(
                lambda y0_, k: y0_ + _combine(coeffs.astype(k.dtype), k),
                y0,
                ks,
            )
            f = vf(t0 + c * dt, y)
            k = terms.prod(f, control)
            ks = jtu.tree_map(
                lambda buf, k_: lax.dynamic_update_index_in_dim(buf, k_, index, 0),
                ks,
                k,
            )
            return (ks, y, f), None

        xs = (
            jnp.arange(1, stages),
            jnp.asarray(a),
            jnp.asarray(tableau.c, dtype=time_dtype),
        )
        # The last stage is evaluated at (t1, y1): its state is the step's result
        # and its evaluation the next step's first (first same as last).
        (ks, y1, f1), _ = lax.scan(stage, (ks, y0, f0), xs)
        b_error = np.asarray(tableau.b_error)
        y_error = jtu.tree_map(lambda k: _combine(jnp.asarray(b_error, k.dtype), k), ks)
        dense_info = dict(y0=y0, y1=y1, k=ks)
        return y1, y_error, dense_info, f1, diffrax.RESULTS.successful
