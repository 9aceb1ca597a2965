"""`StageScan`: diffrax's explicit Runge-Kutta step with its stages as one `lax.scan`,
which a CNF uses under the default adjoint. It must reproduce diffrax's own stage
loop: the same steps, values, gradients, dense output and evaluation counts."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace
from cnftrace.ode._stages import StageScan, scannable


def test_which_solvers_run_their_stages_as_a_scan():
    assert scannable(diffrax.Tsit5())
    assert scannable(diffrax.Dopri5())
    assert scannable(diffrax.Bosh3())
    assert scannable(diffrax.Dopri8())
    # diffrax's own loop on request; no first-same-as-last; implicit; not Runge-Kutta.
    assert not scannable(diffrax.Tsit5(scan_kind="checkpointed"))
    assert not scannable(diffrax.Heun())
    assert not scannable(diffrax.Kvaerno5())
    assert not scannable(diffrax.Euler())


@pytest.mark.parametrize("solver", ["tsit5", "bosh3"])
def test_a_flow_matches_diffrax_own_stage_loop(solver):
    """log_prob, its gradient and the solve's counts, against the same flow with
    diffrax's stage loop (`scan_kind="checkpointed"`), in float64."""
    assert jax.config.jax_enable_x64
    ours = cnftrace.mlp_flow(
        2, key=jr.key(0), width=8, depth=1, solver=solver, t1=1.0,
        rtol=1e-8, atol=1e-8, estimator=cnftrace.Hutchinson(1),
    )  # fmt: skip
    theirs = eqx.tree_at(
        lambda f: f.solver, ours, type(ours.solver)(scan_kind="checkpointed")
    )
    x = jr.normal(jr.key(1), (16, 2))

    @eqx.filter_jit
    def value_grad_stats(flow):
        def loss(flow):
            lp, stats = flow.log_prob(x, key=jr.key(2), return_stats=True)
            return jnp.mean(lp), stats

        return eqx.filter_value_and_grad(loss, has_aux=True)(flow)

    (v1, s1), g1 = value_grad_stats(ours)
    (v2, s2), g2 = value_grad_stats(theirs)
    np.testing.assert_allclose(v1, v2, rtol=1e-13)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-13)
    assert int(s1.num_steps[0]) == int(s2.num_steps[0]) > 3
    assert int(s1.nfe[0]) == int(s2.nfe[0])


def test_a_jump_and_dense_output_match_diffrax():
    """A controller that steps onto a discontinuity makes diffrax pass a traced
    `made_jump`: the stored first evaluation is then recomputed. Dense output (`k`)
    interpolates as diffrax's does."""
    term = diffrax.ODETerm(lambda t, y, args: -y + jnp.where(t < 0.5, 1.0, -2.0))
    kwargs = dict(
        t0=0.0, t1=1.0, dt0=0.05, y0=jnp.array([1.0, -0.5]),
        saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 11)),
        stepsize_controller=diffrax.PIDController(
            rtol=1e-9, atol=1e-9, jump_ts=jnp.array([0.5])
        ),
    )  # fmt: skip
    ref = diffrax.diffeqsolve(term, diffrax.Tsit5(), **kwargs)
    sol = diffrax.diffeqsolve(term, StageScan(diffrax.Tsit5()), **kwargs)
    np.testing.assert_allclose(sol.ys, ref.ys, rtol=1e-13, atol=1e-15)
    assert int(sol.stats["num_steps"]) == int(ref.stats["num_steps"])
    # The closed form, to the solver's accuracy.
    y0 = np.asarray(kwargs["y0"])[None]
    ts = np.linspace(0.0, 1.0, 11)[:, None]
    before = 1 + (y0 - 1) * np.exp(-ts)
    at_half = 1 + (y0 - 1) * np.exp(-0.5)
    after = -2 + (at_half + 2) * np.exp(-(ts - 0.5))
    np.testing.assert_allclose(ref.ys, np.where(ts <= 0.5, before, after), atol=1e-7)
