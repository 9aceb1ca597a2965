"""Training toward an unnormalised density: the reverse-KL objective's gradient
against the closed form of a linear flow (exact trace, Hutchinson, sticking the
landing), importance weights with the exact trace against Hutchinson's on a target
whose normaliser is known, the diagnostics against closed forms, `fit` with
checkpoints and resume, and bad input refused by name (float64)."""

import functools
import math
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg as jsl
import numpy as np
import optax
import pytest
import scipy.linalg
import scipy.stats

import cnftrace

# A linear field f(z) = A z over a span of 1: sampling maps z ~ N(0, I) to
# x = expm(-A) z, so the flow is exactly N(0, S) with S = M M^T, M = expm(-A).
A = jnp.array([[0.3, 0.6], [0.4, -0.2]])
LOG_Z = 0.7


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


class Linear(eqx.Module):
    a: jax.Array

    def __call__(self, t, z, args):
        return self.a @ z


def _linear_flow(a, tol=1e-10):
    return cnftrace.CNF(Linear(jnp.asarray(a)), 2, t1=1.0, rtol=tol, atol=tol)


def _gaussian_log_prob(x, cov):
    chol = jnp.linalg.cholesky(cov)
    white = jsl.solve_triangular(chol, x.T, lower=True).T
    log_det = jnp.sum(jnp.log(jnp.diagonal(chol)))
    return -0.5 * jnp.sum(white**2, axis=1) - log_det - math.log(2 * math.pi)


def _flow_cov(a):
    """S = M M^T for M = expm(-a), on the host (SciPy): no program to compile."""
    m = scipy.linalg.expm(-np.asarray(a))
    return m @ m.T


# The target of the gradient test: Z N(0, P) for a covariance P the flow is not at.
P = jnp.array([[1.5, 0.3], [0.3, 0.6]])


def _target(x):
    return LOG_Z + _gaussian_log_prob(x, P)


def _analytic_value_and_grad(a):
    """E_q[log q - log p~] = KL(q || p) - log Z for q = N(0, S(a)), p = N(0, P), and
    its gradient in `a`, on the host (SciPy: no programs to compile).

    With M = expm(-a): log det S = 2 tr(-a), so -log det S / 2 contributes the
    identity, and tr(P^-1 S) / 2 changes by tr(M^T P^-1 dM), where dM is the
    Frechet derivative of expm at -a in the direction -da."""
    a, p = np.asarray(a), np.asarray(P)
    m = scipy.linalg.expm(-a)
    s, inv = m @ m.T, np.linalg.inv(p)
    kl = 0.5 * (
        np.trace(inv @ s) - 2 + np.linalg.slogdet(p)[1] - np.linalg.slogdet(s)[1]
    )
    grad = np.eye(len(a))
    for i, j in np.ndindex(a.shape):
        direction = np.zeros_like(a)
        direction[i, j] = -1.0
        dm = scipy.linalg.expm_frechet(-a, direction, compute_expm=False)
        grad[i, j] += np.trace(m.T @ inv @ dm)
    return kl - LOG_Z, grad


@functools.partial(jax.jit, static_argnames=("estimator", "stl"))
def _value_and_grad(a, key, cov, *, estimator, stl):
    """The reverse-KL loss of the linear flow at `a` toward Z N(0, cov) on 2000
    draws, and its gradient in `a`. The target's covariance is an argument, so that
    the gradient test and the sticking-the-landing test share compiled programs."""
    est = cnftrace.Exact() if estimator == "exact" else cnftrace.Hutchinson()

    def target(x):
        return LOG_Z + _gaussian_log_prob(x, cov)

    objective = cnftrace.ReverseKL(
        target, estimator=est, stick_the_landing=stl, tolerance=None
    )
    placeholder = jnp.zeros((2000, 0))

    def loss(a):
        return objective.loss(_linear_flow(a), placeholder, None, key)[0]

    return jax.value_and_grad(loss)(a)


@pytest.mark.parametrize(
    "estimator, stl",
    [("exact", False), ("hutchinson", False), ("exact", True)],
    ids=["exact", "hutchinson", "stick-the-landing"],
)
def test_gradient_is_unbiased_against_the_closed_form(estimator, stl):
    batches = [
        _value_and_grad(A, jr.key(i), P, estimator=estimator, stl=stl) for i in range(8)
    ]
    values = np.array([float(v) for v, _ in batches])
    grads = np.stack([np.asarray(g) for _, g in batches])
    want_value, want_grad = _analytic_value_and_grad(A)
    se_value = values.std(ddof=1) / math.sqrt(len(values))
    se_grad = grads.std(axis=0, ddof=1) / math.sqrt(len(grads))
    assert abs(values.mean() - want_value) < 4 * se_value + 1e-3
    assert np.all(np.abs(grads.mean(axis=0) - want_grad) < 4 * se_grad + 1e-3), (
        grads.mean(axis=0),
        want_grad,
        se_grad,
    )
    assert np.abs(want_grad).max() > 0.1  # the test has something to find


def test_sticking_the_landing_vanishes_at_the_target():
    """Where q = p exactly, the STL gradient is zero sample by sample (solver error
    aside), while the plain estimator's is zero only in expectation. The programs
    are the gradient test's, toward the flow's own covariance."""
    cov = _flow_cov(A)
    norms = {}
    for stl in (True, False):
        _, grad = _value_and_grad(A, jr.key(0), cov, estimator="exact", stl=stl)
        norms[stl] = float(jnp.abs(grad).max())
    assert norms[True] < 1e-6 and norms[False] > 1e-2, norms


def test_forward_weight_adds_the_data_nll():
    """The forward-KL mix: the loss is the reverse term plus `w` times the data's
    NLL, which is the flow's own exact log-density of the batch."""
    flow = _linear_flow(A, tol=1e-9)
    x = jr.normal(jr.key(5), (64, 2))
    objective = cnftrace.ReverseKL(
        _target, estimator=cnftrace.Exact(), forward_weight=0.5, tolerance=None
    )
    assert objective.needs_data
    total, metrics = eqx.filter_jit(objective.loss)(flow, x, None, jr.key(0))
    gaussian = scipy.stats.multivariate_normal(np.zeros(2), _flow_cov(A))
    nll = -float(np.mean(gaussian.logpdf(np.asarray(x))))
    assert float(metrics["nll"]) == pytest.approx(nll, abs=1e-7)
    assert float(total) == pytest.approx(float(metrics["loss"]) + 0.5 * nll, abs=1e-7)


def test_exact_weights_are_unbiased_and_hutchinson_weights_are_not():
    """The target is the flow's own density times e^LOG_Z. With the exact trace
    every weight is e^LOG_Z; with one Rademacher probe, log q is off by
    e = eps1 eps2 (A12 + A21) = +-1, so the estimate of Z tends to
    Z cosh(A12 + A21) (Jensen), log Z + 0.434."""
    flow = _linear_flow(A, tol=1e-9)
    cov = _flow_cov(A)

    def target(x):
        return LOG_Z + _gaussian_log_prob(x, cov)

    exact = cnftrace.importance_weights(flow, target, 2000, key=jr.key(1))
    assert abs(exact.log_z - LOG_Z) < 1e-6
    assert exact.ess_fraction > 1 - 1e-9 and exact.nonfinite == 0
    noisy = cnftrace.importance_weights(
        flow, target, 2000, key=jr.key(1), estimator=cnftrace.Hutchinson()
    )
    c = float(A[0, 1] + A[1, 0])
    bias = math.log(math.cosh(c))
    # The mean of 2000 weights e^(+-c) has a standard deviation of sinh(c)/sqrt(n).
    sd = math.sinh(c) / math.sqrt(2000) / math.cosh(c)
    assert abs(noisy.log_z - (LOG_Z + bias)) < 4 * sd, (noisy.log_z, LOG_Z + bias)
    assert noisy.ess_fraction < 0.9


def test_diagnostics_against_closed_forms():
    rng = np.random.default_rng(0)
    # Log-normal weights, log w ~ N(0, s^2): ESS / n -> exp(-s^2), log Z = s^2 / 2.
    s, n = 0.5, 200_000
    log_w = s * rng.standard_normal(n)
    weights = cnftrace.ImportanceWeights(np.zeros(n), log_w)
    assert abs(weights.ess_fraction - math.exp(-(s**2))) < 0.01
    assert abs(weights.log_z - s**2 / 2) < 4 * weights.log_z_stderr
    # The delta method: sd(w) / (mean(w) sqrt(n)) = sqrt((e^(s^2) - 1) / n).
    want = math.sqrt(math.expm1(s**2) / n)
    assert weights.log_z_stderr == pytest.approx(want, rel=0.05)
    assert weights.pareto_k < 0.3 and weights.reliable
    # Pareto weights of tail index 2: k = 1/2; of tail index 1.1: k = 0.91 (the
    # mean of five fits: one scatters by about 0.07).
    for alpha in (2.0, 1.1):
        fits = []
        for seed in range(5):
            heavy = np.log1p(np.random.default_rng(seed).pareto(alpha, 20_000))
            fits.append(cnftrace.pareto_khat(heavy))
        assert abs(np.mean(fits) - 1 / alpha) < 0.06, (alpha, fits)
    assert not cnftrace.ImportanceWeights(np.zeros(20_000), heavy).reliable
    # x ~ N(0, 1) weighted to 2 N(1, 1): E_p[x] = 1, log Z = log 2.
    x = rng.standard_normal(100_000)
    log_q = -0.5 * x**2
    weights = cnftrace.ImportanceWeights(log_q, math.log(2) - 0.5 * (x - 1) ** 2, x)
    mean, stderr = weights.expectation(lambda v: v)
    assert abs(mean - 1) < 4 * stderr and 0.001 < stderr < 0.02
    assert abs(weights.log_z - math.log(2)) < 4 * weights.log_z_stderr
    assert weights.elbo < weights.log_z


def test_nonfinite_target_values_are_counted_not_dropped():
    log_q = np.zeros(6)
    log_t = np.array([0.0, 1.0, -np.inf, 0.5, 0.0, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match=r"1 of 6 .*1 -inf"):
            cnftrace.ImportanceWeights(log_q, log_t)
    weights = cnftrace.ImportanceWeights(log_q, log_t, warn=False)
    # -inf is a weight of zero, still one of the n samples.
    want = math.log((1 + math.e + 0 + math.exp(0.5) + 1 + 1) / 6)
    assert weights.nonfinite == 1 and weights.log_z == pytest.approx(want, 1e-12)
    with pytest.warns(RuntimeWarning, match=r"1 NaN"):
        nan = cnftrace.ImportanceWeights(log_q, np.where(log_t == 1.0, np.nan, 0.0))
    assert math.isnan(nan.log_z) and math.isnan(nan.ess) and nan.nonfinite == 1


@pytest.fixture(scope="module")
def small_flow():
    with jax.enable_x64(True):
        field = cnftrace.MLPField(2, width=8, depth=1, key=jr.key(0))
        return cnftrace.CNF(field, 2, rtol=1e-5, atol=1e-5)


def _shifted(x):
    """N((1, -0.5), 0.6^2 I), unnormalised."""
    return -jnp.sum((x - jnp.array([[1.0, -0.5]])) ** 2, axis=1) / (2 * 0.36)


class _Holed(eqx.Module):
    """`_shifted`, NaN where x_0 > `edge` (nowhere for an edge of +inf). The edge is
    an array, which `fit`'s compiled step takes as an argument: the training runs
    toward the whole target and toward one with holes share one program."""

    edge: jax.Array

    def __call__(self, x):
        return jnp.where(x[:, 0] > self.edge, jnp.nan, _shifted(x))


# One optimiser object for both: its functions are part of the compiled step.
_ADAM = optax.adam(0.03)


def test_fit_trains_checkpoints_and_resumes(small_flow, tmp_path):
    target = _Holed(jnp.asarray(np.inf))
    objective = cnftrace.ReverseKL(target, estimator=cnftrace.Exact())
    settings = dict(
        key=jr.key(3),
        objective=objective,
        batch_size=32,
        optimizer=_ADAM,
        progress=False,
    )
    _, whole = cnftrace.fit(small_flow, steps=40, **settings)
    loss = np.array(whole["loss"])
    # E_q[log q - log p~] falls towards -log Z = -log(2 pi 0.36) = -0.81.
    assert loss[-8:].mean() < loss[:8].mean() - 0.3, loss
    assert whole["ess"][-1] > whole["ess"][0] and max(whole["target_nonfinite"]) == 0
    checkpoints = cnftrace.Checkpoints(str(tmp_path), every=10)
    cnftrace.fit(small_flow, steps=20, checkpoints=checkpoints, **settings)
    _, resumed = cnftrace.fit(small_flow, steps=40, checkpoints=checkpoints, **settings)
    np.testing.assert_array_equal(resumed["loss"], whole["loss"])
    # Another objective's checkpoints are not resumed from.
    other = cnftrace.ReverseKL(_target, estimator=cnftrace.Exact())
    with pytest.raises(cnftrace.CheckpointError, match="fit.target"):
        cnftrace.fit(
            small_flow,
            steps=41,
            checkpoints=checkpoints,
            **settings | {"objective": other},
        )


def test_nonfinite_target_in_training_is_counted_and_stops_it(small_flow):
    """The training step of the test above (same flow, optimiser and batch size),
    toward a target that is NaN on half the plane."""
    holes = _Holed(jnp.asarray(0.0))
    records = []
    with pytest.raises(cnftrace.TrainingError, match="non-finite"):
        cnftrace.fit(
            small_flow,
            key=jr.key(0),
            objective=cnftrace.ReverseKL(holes, estimator=cnftrace.Exact()),
            steps=5,
            batch_size=32,
            optimizer=_ADAM,
            max_failures=2,
            progress=False,
            on_log=records.append,
        )
    assert records[0]["target_nonfinite"] > 0 and records[0]["skipped"] == 1


def test_bad_input_is_refused_by_name(small_flow):
    data = jnp.zeros((16, 2))

    def run(**kw):
        return cnftrace.fit(small_flow, key=jr.key(0), steps=1, progress=False, **kw)

    def column(x):
        return _shifted(x)[:, None]

    with pytest.raises(ValueError, match=r"`log_target` must return one.*\(2,\)"):
        run(target=column)
    with pytest.raises(TypeError, match="`log_target` could not be traced"):
        run(target=lambda x: np.sum(np.asarray(x) ** 2, axis=1))

    def on_host(x):
        shape = jax.ShapeDtypeStruct(x.shape[:1], x.dtype)
        return jax.pure_callback(lambda v: -(v**2).sum(1), shape, x)

    with pytest.raises(TypeError, match="`log_target` is not differentiable"):
        run(target=on_host)
    with pytest.raises(TypeError, match="`log_target` must be a function"):
        cnftrace.ReverseKL(3.0)
    with pytest.raises(ValueError, match="forward_weight"):
        cnftrace.ReverseKL(_shifted, forward_weight=-1.0)
    with pytest.raises(ValueError, match="without `data`"):
        run(data=data, target=_shifted)
    with pytest.raises(ValueError, match="either `target=`"):
        run(target=_shifted, objective="fm")
    with pytest.raises(ValueError, match="`data` is None"):
        run()
    with pytest.raises(ValueError, match="would not use `data`"):
        run(data=data, objective=cnftrace.ReverseKL(_shifted))
    conditional = cnftrace.CNF(
        cnftrace.MLPField(2, width=8, depth=1, context_dim=1, key=jr.key(0)),
        2,
        context_dim=1,
    )
    with pytest.raises(ValueError, match="not conditional"):
        cnftrace.fit(conditional, key=jr.key(0), target=_shifted, progress=False)
    with pytest.raises(ValueError, match="`log_target` must return one"):
        cnftrace.importance_weights(small_flow, column, 10, key=jr.key(0))
    with pytest.raises(ValueError, match="`log_q` and `log_target`"):
        cnftrace.ImportanceWeights(np.zeros(3), np.zeros(4))
