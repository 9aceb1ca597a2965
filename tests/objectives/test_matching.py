"""Flow matching: the path, the OT pairing, the loss at its closed-form optimum, and
training to a closed-form likelihood."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from scipy.integrate import quad
from scipy.optimize import linear_sum_assignment

import cnftrace
from cnftrace.cli import main as cli_main


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def test_conditional_path_ends_and_velocity():
    kx, ke, ks = jr.split(jr.key(0), 3)
    x = jr.normal(kx, (5, 3))
    e = jr.normal(ke, (5, 3))
    sigma = 0.1
    start, _ = cnftrace.conditional_path(x, e, jnp.zeros(5), sigma)
    end, _ = cnftrace.conditional_path(x, e, jnp.ones(5), sigma)
    np.testing.assert_allclose(start, x + sigma * e, rtol=1e-14)
    np.testing.assert_allclose(end, e, rtol=1e-14)
    # The velocity is the derivative in s (central differences, exact for a line).
    s = jr.uniform(ks, (5,))
    h = 1e-4
    ahead, u = cnftrace.conditional_path(x, e, s + h, sigma)
    behind, _ = cnftrace.conditional_path(x, e, s - h, sigma)
    np.testing.assert_allclose((ahead - behind) / (2 * h), u, rtol=1e-8, atol=1e-8)


def test_ot_pairing_is_the_optimal_assignment():
    kx, ke = jr.split(jr.key(1))
    x = jr.normal(kx, (40, 3)) + 2.0
    e = jr.normal(ke, (40, 3))
    paired = jax.jit(cnftrace.ot_pairing)(x, e)
    # A permutation of the draws...
    order = np.lexsort(np.asarray(paired).T)
    np.testing.assert_array_equal(
        np.asarray(paired)[order], np.asarray(e)[np.lexsort(np.asarray(e).T)]
    )
    # ... with the least total squared distance (scipy on the cost matrix).
    cost = ((np.asarray(x)[:, None] - np.asarray(e)[None]) ** 2).sum(-1)
    rows, cols = linear_sum_assignment(cost)
    best = cost[rows, cols].sum()
    got = ((np.asarray(x) - np.asarray(paired)) ** 2).sum()
    np.testing.assert_allclose(got, best, rtol=1e-12)
    assert best < ((np.asarray(x) - np.asarray(e)) ** 2).sum()


# The Gaussian-to-Gaussian problem: data N(m, diag(s^2)) in two dimensions, the
# independent coupling, path width sigma. On path time u, with a = 1 - u,
# b = sigma + (1 - sigma) u, c = 1 - sigma, per dimension:
#   x_u = a x + b e,  target c e - x,  V = a^2 s^2 + b^2,  C = c b - a s^2,
#   E[target | x_u = y] = -m + C / V (y - a m),  irreducible loss = s^2 + c^2 - C^2/V.
M = np.array([1.5, -0.5])
S = np.array([0.7, 1.3])
SIGMA = 0.05
T0, T1 = 0.2, 0.7  # a span other than [0, 1], so the time scaling is exercised


class OptimalField(eqx.Module):
    """The minimiser of the flow-matching loss for the problem above, in model time,
    plus a perturbation `offset + slope * y` (zero at the optimum)."""

    offset: jax.Array
    slope: jax.Array

    def __call__(self, t, y, args):
        span = T1 - T0
        u = (t - T0) / span
        a, b, c = 1 - u, SIGMA + (1 - SIGMA) * u, 1 - SIGMA
        v, cov = a**2 * S**2 + b**2, c * b - a * S**2
        velocity = -M + cov / v * (y - a * M)
        return velocity / span + self.offset + self.slope * y


def _irreducible_loss() -> float:
    def per_dim(u, s):
        a, b, c = 1 - u, SIGMA + (1 - SIGMA) * u, 1 - SIGMA
        return s**2 + c**2 - (c * b - a * s**2) ** 2 / (a**2 * s**2 + b**2)

    return float(np.mean([quad(per_dim, 0, 1, args=(s,))[0] for s in S]))


def test_loss_is_minimal_at_the_analytic_field():
    field = OptimalField(jnp.zeros(2), jnp.zeros(2))
    flow = cnftrace.CNF(field, dim=2, t0=T0, t1=T1)
    objective = cnftrace.FlowMatching(sigma=SIGMA)

    def loss(perturbation, key):
        data_key, key = jr.split(key)
        x = M[None] + S[None] * jr.normal(data_key, (20000, 2))
        model = eqx.tree_at(lambda f: (f.vector_field.offset, f.vector_field.slope),
                            flow, (perturbation[:2], perturbation[2:]))  # fmt: skip
        return cnftrace.flow_matching_loss(model, x, key=key, objective=objective)

    value_and_grad = jax.jit(jax.value_and_grad(loss))
    zero = jnp.zeros(4)
    values, grads = zip(*(value_and_grad(zero, jr.key(i)) for i in range(40)))
    values, grads = np.array(values), np.array(grads)
    se = values.std(ddof=1) / np.sqrt(len(values))
    assert abs(values.mean() - _irreducible_loss()) < 4 * se + 1e-6
    grad_se = grads.std(axis=0, ddof=1) / np.sqrt(len(grads))
    assert np.all(np.abs(grads.mean(axis=0)) < 4 * grad_se)
    # The check can fail: an offset d in the field's first output (model time)
    # raises the loss by exactly (span d)^2 / 2 in expectation (a mean over two
    # elements; the cross term averages to zero at the optimum), and its gradient
    # is span^2 d. Compared on the same draws, so that most of the noise cancels.
    d, span = 0.3, T1 - T0
    offset = jnp.array([d, 0.0, 0.0, 0.0])
    worse, grad = zip(*(value_and_grad(offset, jr.key(i)) for i in range(40)))
    increase = np.mean(np.array(worse) - values)
    np.testing.assert_allclose(increase, (span * d) ** 2 / 2, rtol=0.1)
    np.testing.assert_allclose(np.mean(np.array(grad)[:, 0]), span**2 * d, rtol=0.1)


def _gaussian_data(key, n):
    chol = jnp.array([[1.0, 0.0], [0.6, 0.5]])
    return jnp.array([[1.0, -0.5]]) + jr.normal(key, (n, 2)) @ chol.T


def _train(objective, steps=2000, data=_gaussian_data, seed=0, batch_size=256):
    """Training in float32, as a user trains (twice as fast as float64 here); the
    tests' bars are hundredths of a nat, far above float32's rounding."""
    field = cnftrace.ConcatSquashMLP(2, 64, 3, key=jr.key(seed), dtype=jnp.float32)
    flow = cnftrace.CNF(field, dim=2, t1=1.0)
    optimizer = optax.adam(optax.cosine_decay_schedule(2e-3, steps, 0.05))
    return cnftrace.fit(
        flow,
        lambda key, n: data(key, n).astype(jnp.float32),
        key=jr.key(seed + 1),
        steps=steps,
        batch_size=batch_size,
        objective=objective,
        optimizer=optimizer,
        progress=False,
    )


@pytest.mark.optimized  # 2000 training steps and an exact-trace evaluation
def test_flow_matching_reaches_the_gaussian_likelihood():
    trained, history = _train("fm")
    assert history["nfe"][-1] == 1 and history["nfe_backward"][-1] == 1
    x = _gaussian_data(jr.key(7), 20000)
    nll = cnftrace.evaluate_nll(trained, x.astype(jnp.float32))  # exact trace
    cov = np.array([[1.0, 0.6], [0.6, 0.36 + 0.25]])
    diff = x - jnp.array([[1.0, -0.5]])
    true = 0.5 * (
        np.einsum("ni,ij,nj->n", diff, np.linalg.inv(cov), diff)
        + np.log(np.linalg.det(2 * np.pi * cov))
    )
    assert abs(nll.mean - true.mean()) < 0.02


@pytest.mark.optimized  # 3000 training steps
def test_ot_coupling_straightens_the_paths():
    def eight_gaussians(key, n):
        return cnftrace.datasets.toy_sample("8gaussians", key, n)

    # Batches of 128 take half the time of 256 and straighten the paths as well:
    # measured 62 against 80 here, with seeds 0 and 2 62 against 74 and 80 (with
    # batches of 256, 62 against 80 to 86).
    nfe = {}
    for objective in ("fm", "ot-fm"):
        trained, _ = _train(
            objective, steps=1500, data=eight_gaussians, seed=1, batch_size=128
        )
        _, stats = trained.sample(jr.key(3), 2000, return_stats=True)
        nfe[objective] = int(stats.total_nfe)
    assert nfe["ot-fm"] < 0.9 * nfe["fm"], nfe


def test_chain_splits_the_path_between_blocks():
    # Two blocks over [0, 1/2] and [1/2, 1] of the path: each block's optimal
    # field is the single block's, on its half, so the loss is the same.
    def half(lo):
        class Half(eqx.Module):
            def __call__(self, t, y, args):
                field = OptimalField(jnp.zeros(2), jnp.zeros(2))
                # This block's time t in [0, 1] is path time lo + t / 2.
                return field(T0 + (lo + t / 2) * (T1 - T0), y, None) * (T1 - T0) / 2

        return cnftrace.CNF(Half(), dim=2, t0=0.0, t1=1.0)

    chain = cnftrace.Chain([half(0.0), half(0.5)])
    single = cnftrace.CNF(OptimalField(jnp.zeros(2), jnp.zeros(2)), 2, t0=T0, t1=T1)
    objective = cnftrace.FlowMatching(sigma=SIGMA)
    x = M[None] + S[None] * jr.normal(jr.key(50), (40000, 2))
    # Each loss as one program (op by op, they compiled some eighty small ones).
    loss = eqx.filter_jit(cnftrace.flow_matching_loss)
    a = loss(chain, x, key=jr.key(6), objective=objective)
    b = loss(single, x, key=jr.key(6), objective=objective)
    assert abs(a - _irreducible_loss()) < 0.02 and abs(b - _irreducible_loss()) < 0.02


def test_bad_input_is_refused_clearly():
    field = cnftrace.ConcatSquashMLP(2, 8, 1, key=jr.key(0))
    data = jnp.zeros((16, 2))
    with pytest.raises(ValueError, match="objective"):
        cnftrace.fit(cnftrace.CNF(field, 2), data, key=jr.key(0), objective="nope")
    with pytest.raises(ValueError, match="learn_t1"):
        cnftrace.fit(
            cnftrace.CNF(field, 2, learn_t1=True), data, key=jr.key(0), objective="fm"
        )
    # RNODE's weights belong to `MaximumLikelihood`, not to flow matching.
    with pytest.raises(TypeError, match="kinetic_weight"):
        cnftrace.fit(
            cnftrace.CNF(field, 2),
            data,
            key=jr.key(0),
            objective="fm",
            kinetic_weight=0.1,
        )
    conditional = cnftrace.CNF(
        cnftrace.ConcatSquashMLP(2, 8, 1, context_dim=1, key=jr.key(0)),
        2,
        context_dim=1,
    )
    with pytest.raises(ValueError, match="ot-fm"):
        cnftrace.fit(
            conditional,
            data,
            key=jr.key(0),
            objective="ot-fm",
            context=jnp.zeros((16, 1)),
        )
    with pytest.raises(ValueError, match="sigma"):
        cnftrace.FlowMatching(sigma=1.0)
    with pytest.raises(ValueError, match="coupling"):
        cnftrace.FlowMatching(coupling="sinkhorn")
    images = cnftrace.MultiscaleFlow((1, 4, 4), hidden=(4,), key=jr.key(0))
    with pytest.raises(TypeError, match="mle"):
        cnftrace.flow_matching_loss(images, jnp.zeros((2, 1, 4, 4)), key=jr.key(0))


def test_command_line_trains_by_flow_matching(tmp_path, capsys):
    run = str(tmp_path / "run")
    args = ["train", "--run-dir", run, "--data", "8gaussians", "--steps", "500"]
    args += ["--objective", "ot-fm", "--fm-sigma", "0.01", "--no-progress"]
    assert cli_main(args) == 0
    assert cli_main(["eval", run, "--n", "2000"]) == 0
    out = capsys.readouterr().out
    gap = float(out.split("gap ")[1].split(";")[0])
    # Trained: measured 0.42 nats after these 500 steps (0.29 after 1500), where
    # the standard normal base is 3.1 nats from the entropy.
    assert gap < 0.6, out
    with pytest.raises(SystemExit, match="learn-t1"):
        cli_main(args[:5] + ["--objective", "fm", "--learn-t1"])
    with pytest.raises(SystemExit, match="fm-sigma"):
        cli_main(args[:5] + ["--objective", "fm", "--fm-sigma", "1.5"])
