"""Hutch++ and XTrace: exactness on low-rank operators, unbiasedness, lower variance
than Hutchinson at the same budget, XTrace against a naive leave-one-out version,
static shapes, gradients, bad input, `divergence` and a CNF's term, and the variance
report. (docs/trace-estimators.md runs in test_docs_examples.py.)"""

import importlib.util
import math
import os

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest
from _paths import ROOT

import cnftrace

SAMPLERS = ["gaussian", "rademacher"]


def _estimator(name, budget, sampler="gaussian"):
    cls = {"hutch++": cnftrace.HutchPlusPlus, "xtrace": cnftrace.XTrace}[name]
    return cls(budget, sampler)


@eqx.filter_jit
def _draws_for_keys(operator, estimator, keys):
    return jax.vmap(lambda k: cnftrace.trace(operator, estimator=estimator, key=k))(
        keys
    )


def _draws(pairs, key, n=20_000):
    """`n` independent estimates of `cnftrace.trace` for each (operator, estimator).

    Compiling dominates these tests, so they share shapes (8 x 8 matrices, budget 6,
    20,000 keys) and thus compilations. One compilation per pair: jaxlib 0.10.2's
    batched QR and SVD kernels on CPU wait inside XLA's thread pool for work they
    queue on it, so two large batched decompositions running concurrently in one
    program can deadlock a 2-core machine (two XTraces over 5,000 keys in one `jit`).
    """
    keys = jr.split(key, n)
    return [_draws_for_keys(op, est, keys) for op, est in pairs]


def test_exact_for_low_rank_operators():
    # Hutch++ is exact for rank <= k = B/3, XTrace for rank <= m - 1 = B/2 - 1: here
    # rank 2 with B = 6. (With Rademacher vectors, two can coincide and the sketch
    # then misses part of the range; see the next test.)
    k1, k2 = jr.split(jr.key(0))
    matrix = jr.normal(k1, (8, 2)) @ jr.normal(k2, (2, 8))  # not symmetric
    op = lx.MatrixLinearOperator(matrix)
    pairs = [(op, cnftrace.HutchPlusPlus(6)), (op, cnftrace.XTrace(6))]
    for (_, est), draws in zip(pairs, _draws(pairs, jr.key(1))):
        np.testing.assert_allclose(
            draws, jnp.trace(matrix), rtol=0, atol=1e-10, err_msg=str(est)
        )


def test_exactly_singular_sketch_stays_finite_exact_and_unbiased():
    # Y = A W has exact zero rows, so R has exact zeros on its diagonal.
    diag = jnp.diag(jnp.array([3.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))
    estimators = [
        cnftrace.HutchPlusPlus(6, "gaussian"),
        cnftrace.XTrace(6, "gaussian"),
        cnftrace.XTrace(6, "rademacher"),
    ]
    ops = [lx.MatrixLinearOperator(diag), lx.MatrixLinearOperator(0 * diag)]
    pairs = [(op, est) for op in ops for est in estimators]
    for (op, est), draws in zip(pairs, _draws(pairs, jr.key(2))):
        exact = jnp.trace(op.matrix)
        assert jnp.all(jnp.isfinite(draws)), est
        if est.sampler == "gaussian":
            np.testing.assert_allclose(draws, exact, atol=1e-12, err_msg=str(est))
        # Rademacher vectors coincide (up to sign) on the operator's range in about
        # half the draws here: the sketch of the other vectors then misses part of
        # the range. Not exact, but unbiased (XTrace's leave-one-out projector must
        # not depend on the left-out vector even then).
        se = jnp.std(draws) / math.sqrt(draws.size)
        assert abs(jnp.mean(draws) - exact) <= 4 * se + 1e-12, (est, draws.mean(), se)


def test_unbiased_on_a_non_symmetric_matrix():
    matrix = jr.normal(jr.key(3), (8, 8)) + 2 * jnp.eye(8)
    op = lx.MatrixLinearOperator(matrix)
    pairs = [
        (op, _estimator(name, 6, sampler))
        for name in ["hutch++", "xtrace"]
        for sampler in SAMPLERS
    ]
    for (_, est), draws in zip(pairs, _draws(pairs, jr.key(4))):
        mean, se = jnp.mean(draws), jnp.std(draws) / math.sqrt(draws.size)
        assert se > 1e-3  # the estimator really is random here
        assert abs(mean - jnp.trace(matrix)) < 4 * se, (est, mean, se)


def test_lower_variance_than_hutchinson_on_low_rank_plus_noise():
    u, _ = jnp.linalg.qr(jr.normal(jr.key(5), (8, 2)))
    noise = jr.normal(jr.key(6), (8, 8)) / math.sqrt(8)
    matrix = (u * jnp.array([1.0, 0.5])[None, :]) @ u.T + 1e-2 * (noise + noise.T)
    op = lx.MatrixLinearOperator(matrix)
    names = ["hutchinson", "hutch++", "xtrace"]
    pairs = [
        (op, cnftrace.Hutchinson(6)),
        (op, cnftrace.HutchPlusPlus(6)),
        (op, cnftrace.XTrace(6)),
    ]
    variance = {}
    for name, draws in zip(names, _draws(pairs, jr.key(7))):
        variance[name] = float(jnp.var(draws))
        se = jnp.std(draws) / math.sqrt(draws.size)
        assert abs(jnp.mean(draws) - jnp.trace(matrix)) < 4 * se + 1e-12, name
    # Measured: Hutch++ about 1/20 and XTrace about 1/25 of Hutchinson's variance
    # (a sketch of k = rank vectors, no oversampling).
    assert variance["hutch++"] < variance["hutchinson"] / 5, variance
    assert variance["xtrace"] < variance["hutchinson"] / 5, variance


def _naive_xtrace(matrix, omega):
    """Leave-one-out XTrace by its definition: for each vector, an orthonormal basis of
    the other sketch vectors (from an SVD, so that a rank-deficient sketch gives the
    projector onto their span), then the Hutch++ formula with that vector as probe."""
    m = omega.shape[0]
    y = matrix @ omega.T
    estimates = []
    for i in range(m):
        u, sv, _ = jnp.linalg.svd(jnp.delete(y, i, axis=1), full_matrices=False)
        q = u * (sv > 1e-12 * sv[0])[None, :]  # drop the null directions
        w_perp = omega[i] - q @ (q.T @ omega[i])
        estimates.append(jnp.trace(q.T @ matrix @ q) + w_perp @ matrix @ w_perp)
    return jnp.mean(jnp.stack(estimates))


def _naive_hutchpp(matrix, probes):
    k = probes.shape[0] // 2
    q, _ = jnp.linalg.qr(matrix @ probes[:k].T)
    g_perp = probes[k:] - probes[k:] @ q @ q.T
    return jnp.trace(q.T @ matrix @ q) + jnp.trace(g_perp @ matrix @ g_perp.T) / k


def test_against_naive_implementations():
    matrix = jr.normal(jr.key(8), (10, 10))
    op = lx.MatrixLinearOperator(matrix)
    cases = [
        (cnftrace.XTrace(8, "gaussian"), _naive_xtrace),
        # m = n: Rademacher sketches are singular now and then.
        (cnftrace.XTrace(20, "rademacher"), _naive_xtrace),
        (cnftrace.HutchPlusPlus(9, "rademacher"), _naive_hutchpp),
    ]

    @jax.jit
    def both(key):
        return [
            (
                cnftrace.trace(op, estimator=est, key=key),
                naive(matrix, est.draw(key, (10,), matrix.dtype)),
            )
            for est, naive in cases
        ]

    for seed in range(3):
        for (est, _), (ours, reference) in zip(cases, both(jr.key(seed))):
            np.testing.assert_allclose(
                ours, reference, rtol=1e-10, atol=1e-10, err_msg=str(est)
            )


@pytest.mark.parametrize(
    "name,budget,num_vectors", [("hutch++", 6, 4), ("xtrace", 6, 3)]
)
def test_static_shapes(name, budget, num_vectors):
    est = _estimator(name, budget)
    assert est.num_vectors == num_vectors
    assert est.draw(jr.key(0), (5, 7), jnp.float32).shape == (5, num_vectors, 7)
    assert est.draw(jr.key(0), (2, 3, 4), jnp.float64, event_ndim=2).shape == (
        2,
        num_vectors,
        3,
        4,
    )
    assert est.draw(jr.key(0), (5, 7), jnp.float32).dtype == jnp.float32

    op = lx.MatrixLinearOperator(jr.normal(jr.key(1), (7, 7)))
    traces = []

    @jax.jit
    def f(key):
        traces.append(None)  # runs once per trace of `f`
        return cnftrace.trace(op, estimator=est, key=key)

    a, b = f(jr.key(2)), f(jr.key(3))
    assert len(traces) == 1 and a.shape == () and a != b
    out = eqx.filter_eval_shape(
        lambda k: cnftrace.trace(op, estimator=est, key=k), jr.key(0)
    )
    assert out.shape == () and out.dtype == jnp.float64


def _directional_fd(f, x, direction, eps=1e-6):
    return (f(x + eps * direction) - f(x - eps * direction)) / (2 * eps)


@pytest.mark.parametrize("name,budget", [("hutch++", 6), ("xtrace", 6)])
def test_gradient_wrt_matrix_matches_finite_differences(name, budget):
    est = _estimator(name, budget)
    key = jr.key(9)

    value_and_grad = jax.jit(
        jax.value_and_grad(
            lambda m: cnftrace.trace(lx.MatrixLinearOperator(m), estimator=est, key=key)
        )
    )

    def f(m):
        return value_and_grad(m)[0]

    m = jr.normal(jr.key(10), (6, 6))
    _, grad = value_and_grad(m)
    for seed in range(3):
        direction = jr.normal(jr.key(100 + seed), m.shape)
        np.testing.assert_allclose(
            jnp.sum(grad * direction), _directional_fd(f, m, direction), rtol=1e-6
        )


@pytest.mark.parametrize("name,budget", [("hutch++", 6), ("xtrace", 6)])
def test_gradient_wrt_jacobian_operator_parameters(name, budget):
    est = _estimator(name, budget)
    key = jr.key(11)
    params = {"w": jr.normal(jr.key(12), (5, 5)), "b": jr.normal(jr.key(13), (5,))}
    x = jr.normal(jr.key(14), (5,))

    def fn(x, p):
        return jnp.tanh(p["w"] @ x + p["b"]) + 0.1 * x * jnp.sum(x)

    value_and_grad = jax.jit(
        jax.value_and_grad(
            lambda p: cnftrace.trace(
                lx.JacobianLinearOperator(fn, x, p), estimator=est, key=key
            )
        )
    )

    def f(p):
        return value_and_grad(p)[0]

    _, grad = value_and_grad(params)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    gflat, _ = jax.flatten_util.ravel_pytree(grad)
    for seed in range(3):
        direction = jr.normal(jr.key(200 + seed), flat.shape)
        fd = _directional_fd(lambda v: f(unravel(v)), flat, direction)
        np.testing.assert_allclose(jnp.dot(gflat, direction), fd, rtol=1e-6)


@pytest.mark.parametrize("name", ["hutch++", "xtrace"])
def test_gradient_is_unbiased(name):
    # d tr(M) / dM = I; the estimators' gradients average to it.
    est = _estimator(name, 6)
    m = jr.normal(jr.key(15), (8, 8))

    def grad_for_key(k):
        return jax.grad(
            lambda m: cnftrace.trace(lx.MatrixLinearOperator(m), estimator=est, key=k)
        )(m)

    grads = jax.jit(jax.vmap(grad_for_key))(jr.split(jr.key(16), 4000))
    mean = jnp.mean(grads, axis=0)
    se = jnp.std(grads, axis=0) / math.sqrt(grads.shape[0])
    assert jnp.all(jnp.isfinite(grads))
    assert jnp.all(jnp.abs(mean - jnp.eye(8)) <= 4.5 * se + 1e-9), (mean, se)


def test_bad_budgets_are_errors():
    for bad in (4, 5, 0, -3, 2):
        with pytest.raises(ValueError, match="`num_matvecs` of `HutchPlusPlus`"):
            cnftrace.HutchPlusPlus(bad)
    for bad in (5, 2, 0, -4):
        with pytest.raises(ValueError, match="`num_matvecs` of `XTrace`"):
            cnftrace.XTrace(bad)
    for cls in (cnftrace.HutchPlusPlus, cnftrace.XTrace):
        for bad in (6.0, jnp.array(6), True, "6"):
            with pytest.raises(ValueError, match="`num_matvecs`.*Python int"):
                cls(bad)
        with pytest.raises(ValueError, match="`sampler`"):
            cls(6, "sphere")


def test_budget_too_large_for_operator_is_an_error():
    op = lx.MatrixLinearOperator(jnp.eye(4))
    for est in (cnftrace.XTrace(10), cnftrace.HutchPlusPlus(15)):
        with pytest.raises(ValueError, match=r"`num_matvecs=\d+` is too large.*Exact"):
            cnftrace.trace(op, estimator=est, key=jr.key(0))
        with pytest.raises(ValueError, match="too large"):
            cnftrace.divergence(jnp.sin, jnp.ones(4), estimator=est, key=jr.key(0))
    # The largest allowed budgets sketch the whole space.
    assert cnftrace.XTrace(8).draw(jr.key(0), (4,), jnp.float64).shape == (4, 4)
    assert cnftrace.HutchPlusPlus(12).draw(jr.key(0), (4,), jnp.float64).shape == (8, 4)


def test_missing_key_and_bad_probes_are_errors():
    op = lx.MatrixLinearOperator(jnp.eye(6))
    for est in (cnftrace.HutchPlusPlus(6), cnftrace.XTrace(6)):
        with pytest.raises(ValueError, match="key"):
            cnftrace.trace(op, estimator=est)
        with pytest.raises(ValueError, match="key"):
            cnftrace.divergence(jnp.sin, jnp.ones(6), estimator=est)
        with pytest.raises(ValueError, match="probes of shape"):
            est.estimate(jnp.sin, jnp.ones(6), jnp.ones((1, 6)))
        with pytest.raises(ValueError, match="probes"):
            est.trace_of_matvec(lambda v: v, jnp.ones((1, 6)))
    complex_op = lx.MatrixLinearOperator(jnp.eye(3, dtype=jnp.complex128))
    with pytest.raises(TypeError, match="real operators"):
        cnftrace.trace(complex_op, estimator=cnftrace.XTrace(4), key=jr.key(0))


def _field(y):
    # Nonlinear, any shape, with a non-symmetric Jacobian that varies with y.
    flat = y.reshape(-1)
    out = jnp.sin(flat) * jnp.roll(flat, 2) + jnp.tanh(flat) * jnp.mean(flat)
    return out.reshape(y.shape)


@pytest.mark.parametrize("est", [cnftrace.HutchPlusPlus(6), cnftrace.XTrace(6)])
def test_divergence(est):
    """`divergence` returns the field's value and, for every key, the estimate
    `trace` gives on the Jacobian; its mean over 20,000 keys is the exact
    divergence. One compiled program: both, under `vmap` over the keys."""
    y = jr.normal(jr.key(17), (6,))
    exact = jnp.trace(jax.jacfwd(_field)(y))

    def both(key):
        op = lx.JacobianLinearOperator(lambda x, _: _field(x), y)
        div = cnftrace.divergence(_field, y, estimator=est, key=key)
        return div, cnftrace.trace(op, estimator=est, key=key)

    keys = jr.split(jr.key(19), 20_000)
    (fy, samples), via_trace = jax.jit(jax.vmap(both))(keys)
    assert fy.shape == (20_000, 6)
    np.testing.assert_allclose(fy, jnp.tile(_field(y), (20_000, 1)), rtol=1e-14)
    # The same estimate as `trace` on the Jacobian, for the same key.
    np.testing.assert_allclose(samples, via_trace, rtol=1e-10)
    mean, se = jnp.mean(samples), jnp.std(samples) / math.sqrt(samples.size)
    assert se > 0
    assert abs(mean - exact) < 4 * se, (mean, exact, se)


def test_divergence_of_a_matrix_shaped_state():
    # The trace of the flattened Jacobian; with k = 8 = size, Hutch++ is exact.
    y = jr.normal(jr.key(20), (2, 4))
    _, div = jax.jit(
        lambda y: cnftrace.divergence(
            _field, y, estimator=cnftrace.HutchPlusPlus(24), key=jr.key(21)
        )
    )(y)
    np.testing.assert_allclose(
        div, jnp.trace(jax.jacfwd(_field)(y).reshape(8, 8)), rtol=1e-10
    )


def test_in_a_cnf_term():
    # A batch of samples in a CNF's diffrax term: with a sketch as large as the
    # state (k = d = 3), Hutch++ is exact, so it matches the exact term.
    field = cnftrace.ConcatSquashMLP(3, width=8, depth=1, key=jr.key(22))
    z = jr.normal(jr.key(23), (4, 3))
    out = {}
    for name, est in [
        ("exact", cnftrace.Exact()),
        ("hutch++", cnftrace.HutchPlusPlus(9)),
        ("xtrace", cnftrace.XTrace(4)),
    ]:
        term = cnftrace.CNFTerm(field, estimator=est)
        args = term.make_args(z, key=jr.key(24))
        assert est.stochastic == (args.probes is not None)
        out[name] = eqx.filter_jit(term.vf)(0.3, term.initial_state(z), args)
    for name in ("hutch++", "xtrace"):
        np.testing.assert_allclose(out[name][0], out["exact"][0], rtol=1e-14)
        assert out[name][1].shape == (4,)
    np.testing.assert_allclose(out["hutch++"][1], out["exact"][1], rtol=1e-10)
    assert not np.allclose(out["xtrace"][1], out["exact"][1])  # m - 1 < d: random


def _load_script():
    path = os.path.join(ROOT, "experiments", "trace_variance.py")
    spec = importlib.util.spec_from_file_location("trace_variance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variance_report_quick(tmp_path):
    report = _load_script().main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "trace_variance.md").read_text().startswith("| operator |")
    assert {row["operator"] for row in report["rows"]} == {
        "low-rank+noise",
        "flat",
        "digits-cnf@x0",
    }
    assert all(row["finite"] for row in report["rows"])
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
