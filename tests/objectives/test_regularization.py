"""RNODE regularisation: kinetic and Jacobian Frobenius integrals in the solve."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy as jsp
import numpy as np
import optax
import pytest
from _paths import EXPERIMENTS

import cnftrace

TIGHT = dict(rtol=1e-11, atol=1e-11, solver=diffrax.Dopri8())


class Linear(eqx.Module):
    matrix: jax.Array

    def __call__(self, t, z, args):
        return self.matrix @ z


def _kinetic_closed_form(a, x, t1, points=4001):
    """integral_0^t1 |A exp(A t) x|^2 dt by Simpson's rule on the matrix exponential."""
    ts = jnp.linspace(0.0, t1, points)
    f = jax.vmap(lambda t: a @ jsp.linalg.expm(t * a) @ x)(ts)
    sq = jnp.sum(f**2, axis=-1)
    h = ts[1] - ts[0]
    return h / 3 * (sq[0] + sq[-1] + 4 * sq[1:-1:2].sum() + 2 * sq[2:-1:2].sum())


def test_linear_field_integrals_match_closed_forms_exact_and_hutchinson():
    d, t1 = 3, 0.7
    a = 0.6 * jr.normal(jr.key(0), (d, d))
    x = jr.normal(jr.key(1), (4, d))
    flow = cnftrace.CNF(Linear(a), d, t1=t1, **TIGHT)
    logp, reg, stats = flow.log_prob_and_regularization(x)
    kinetic = jnp.stack([_kinetic_closed_form(a, xi, t1) for xi in x])
    np.testing.assert_allclose(reg.kinetic, kinetic, rtol=1e-9)
    # The Jacobian is A everywhere: the exact Frobenius integral is t1 |A|_F^2.
    np.testing.assert_allclose(reg.jacobian, t1 * jnp.sum(a**2), rtol=1e-10)
    np.testing.assert_allclose(logp, flow.log_prob(x), rtol=0, atol=1e-10)

    # With Hutchinson the estimate is t1 * mean_k |A eps_k|^2 for this solve's probes,
    # which are drawn from the key exactly as `CNFTerm.make_args` does.
    est = cnftrace.Hutchinson(3, "gaussian")
    flow_h = flow.with_estimator(est)
    key = jr.key(7)
    _, reg_h, _ = flow_h.log_prob_and_regularization(x, key=key)
    probes = est.draw(key, x.shape, x.dtype)  # (n, 3, d)
    expected = t1 * jnp.mean(jnp.sum((probes @ a.T) ** 2, axis=-1), axis=-1)
    np.testing.assert_allclose(reg_h.jacobian, expected, rtol=1e-10)
    np.testing.assert_allclose(reg_h.kinetic, kinetic, rtol=1e-9)


def test_regularised_solve_takes_the_same_steps_and_gives_the_same_density():
    field = cnftrace.ConcatSquashMLP(2, width=16, depth=2, key=jr.key(0))
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-6, atol=1e-6)
    x = 2.0 * jr.normal(jr.key(1), (32, 2))
    logp, stats = flow.log_prob(x, return_stats=True)
    logp_r, reg, stats_r = flow.log_prob_and_regularization(x)
    np.testing.assert_allclose(logp_r, logp, rtol=0, atol=1e-12)
    assert int(stats_r.num_steps[0]) == int(stats.num_steps[0])
    assert int(stats_r.nfe[0]) == int(stats.nfe[0])
    assert reg.kinetic.shape == reg.jacobian.shape == (32,)
    assert bool(jnp.all(reg.kinetic > 0)) and bool(jnp.all(reg.jacobian > 0))


def test_chain_sums_blocks_and_inverse_integrals_are_positive():
    d = 2
    a1 = 0.5 * jr.normal(jr.key(0), (d, d))
    a2 = 0.5 * jr.normal(jr.key(1), (d, d))
    b1 = cnftrace.CNF(Linear(a1), d, t1=0.4, **TIGHT)
    b2 = cnftrace.CNF(Linear(a2), d, t1=0.9, **TIGHT)
    x = jr.normal(jr.key(2), (3, d))
    z1 = x @ jsp.linalg.expm(0.4 * a1).T
    _, r1, _ = b1.log_prob_and_regularization(x)
    _, r2, _ = b2.log_prob_and_regularization(z1)
    _, r, _ = cnftrace.Chain([b1, b2]).log_prob_and_regularization(x)
    np.testing.assert_allclose(r.kinetic, r1.kinetic + r2.kinetic, rtol=1e-9)
    np.testing.assert_allclose(r.jacobian, r1.jacobian + r2.jacobian, rtol=1e-9)
    # The inverse map integrates backwards in time; the integrals stay positive and
    # along the same trajectory equal the forward ones. It starts from the forward
    # map's closed form (the solve's own end point is that to about 1e-11, far
    # inside the tolerances below), so that no forward solve is compiled for it;
    # and as one program (op by op, its first evaluation compiled dozens).
    inverse = eqx.filter_jit(
        lambda f, z: f.transform(
            z, inverse=True, log_det=True, key=None, regularize=True
        )
    )
    _, _, _, r_inv = inverse(b1, z1)
    assert np.all(np.asarray(r_inv.kinetic) > 0), r_inv.kinetic
    assert np.all(np.asarray(r_inv.jacobian) > 0), r_inv.jacobian
    np.testing.assert_allclose(r_inv.kinetic, r1.kinetic, rtol=1e-8)
    np.testing.assert_allclose(r_inv.jacobian, r1.jacobian, rtol=1e-9)


def test_gradient_of_kinetic_energy_matches_closed_form():
    # Diagonal A: z(t) = exp(a t) x, K = sum_i a_i x_i^2 (exp(2 a_i T) - 1) / 2.
    t1 = 0.8
    a = jnp.array([0.7, -0.4])
    x = jnp.array([[1.5, -0.5]])

    def kinetic(a):
        flow = cnftrace.CNF(Linear(jnp.diag(a)), 2, t1=t1, **TIGHT)
        return flow.log_prob_and_regularization(x)[1].kinetic[0]

    def closed(a):
        return jnp.sum(a * x[0] ** 2 * (jnp.exp(2 * a * t1) - 1) / 2)

    # The value and the gradient from one program: op by op, they compiled three
    # solves and about a hundred small programs (1.8 s of the test's 6 s).
    value, grad = jax.jit(jax.value_and_grad(kinetic))(a)
    np.testing.assert_allclose(value, closed(a), rtol=1e-10)
    np.testing.assert_allclose(grad, jax.grad(closed)(a), rtol=1e-8)


def test_fit_with_regularisation_records_and_lowers_the_integrals():
    field = cnftrace.ConcatSquashMLP(
        2, width=16, depth=2, key=jr.key(0), dtype=jnp.float32
    )
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-4, atol=1e-4)
    data = jr.normal(jr.key(1), (256, 2), jnp.float32) * jnp.array([[2.0, 0.3]])
    runs, integrals = {}, {}
    for weight in (0.0, 1.0):
        trained, hist = cnftrace.fit(
            flow,
            data,
            key=jr.key(2),
            steps=40,
            batch_size=64,
            optimizer=optax.adam(1e-2),
            progress=False,
            objective=cnftrace.MaximumLikelihood(
                kinetic_weight=weight, jacobian_weight=weight
            ),
        )
        runs[weight] = hist
        _, reg, _ = trained.log_prob_and_regularization(data)
        integrals[weight] = (
            float(jnp.mean(reg.kinetic)),
            float(jnp.mean(reg.jacobian)),
        )
    assert "kinetic" not in runs[0.0]
    assert len(runs[1.0]["kinetic"]) == 40 and len(runs[1.0]["jacobian"]) == 40
    # The recorded integrals are those of the batch at each step's parameters.
    assert all(
        k > 0 and j > 0 for k, j in zip(runs[1.0]["kinetic"], runs[1.0]["jacobian"])
    )
    # Heavily weighted, both integrals end far below those of the plain fit of the
    # same anisotropic data.
    assert integrals[1.0][0] < 0.5 * integrals[0.0][0], integrals
    assert integrals[1.0][1] < 0.5 * integrals[0.0][1], integrals


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kinetic_weight=-1.0), "kinetic_weight"),
        (dict(jacobian_weight=float("nan")), "jacobian_weight"),
        (dict(kinetic_weight="0.1"), "kinetic_weight"),
    ],
)
def test_fit_refuses_bad_weights(kwargs, match):
    field = cnftrace.ConcatSquashMLP(2, width=4, depth=1, key=jr.key(0))
    flow = cnftrace.CNF(field, 2)
    with pytest.raises((ValueError, TypeError), match=match):
        objective = cnftrace.MaximumLikelihood(**kwargs)
        cnftrace.fit(
            flow, jnp.ones((8, 2)), key=jr.key(0), steps=1, objective=objective
        )


def test_estimator_without_frobenius_support_says_so():
    class Plain(cnftrace.Exact):
        def estimate_with_jacobian_norm(self, fn, y, probes):
            return cnftrace.AbstractEstimator.estimate_with_jacobian_norm(
                self, fn, y, probes
            )

    flow = cnftrace.CNF(Linear(jnp.eye(2)), 2, estimator=Plain())
    with pytest.raises(NotImplementedError, match="Frobenius"):
        flow.log_prob_and_regularization(jnp.ones((2, 2)))


def test_rnode_experiment_smoke(tmp_path):
    import importlib.util
    import json
    import os

    path = os.path.join(EXPERIMENTS, "rnode_toy.py")
    spec = importlib.util.spec_from_file_location("rnode_toy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--quick", "--weights", "0.1:0.2", "--out", str(tmp_path)])
    assert [(r["kinetic_weight"], r["jacobian_weight"]) for r in results] == [
        (0.0, 0.0),
        (0.1, 0.2),
    ]
    with open(tmp_path / "rnode_8gaussians_4.json") as f:
        saved = json.load(f)
    assert saved["results"][1]["eval_nfe"] > 0
    table = (tmp_path / "rnode_8gaussians_4.md").read_text()
    assert "| 0.1 | 0.2 |" in table and "Target" in table
