"""CNF blocks and chains: closed forms, round trips, adjoints, regressions, errors."""

import re

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy as jsp
import numpy as np
import pytest
from _flows import LOWERED, small_flow, traces_of

import cnftrace

TIGHT = dict(rtol=1e-12, atol=1e-12, solver=diffrax.Dopri8())


class Linear(eqx.Module):
    matrix: jax.Array

    def __call__(self, t, z, args):
        return self.matrix @ z


def _std_normal_logpdf(z):
    return jnp.sum(jsp.stats.norm.logpdf(z), axis=-1)


def test_linear_chain_matches_closed_form():
    d = 3
    k1, k2, k3 = jr.split(jr.key(0), 3)
    a1 = 0.5 * jr.normal(k1, (d, d))
    a2 = 0.5 * jr.normal(k2, (d, d))
    flow = cnftrace.Chain(
        [
            cnftrace.CNF(Linear(a1), d, t0=0.0, t1=0.7, **TIGHT),
            cnftrace.CNF(Linear(a2), d, t0=0.2, t1=1.0, **TIGHT),
        ]
    )
    x = jr.normal(k3, (6, d))
    z = x @ jsp.linalg.expm(0.7 * a1).T @ jsp.linalg.expm(0.8 * a2).T
    expected = _std_normal_logpdf(z) + 0.7 * jnp.trace(a1) + 0.8 * jnp.trace(a2)

    logp = flow.log_prob(x)
    assert logp.shape == (6,)
    np.testing.assert_allclose(logp, expected, rtol=0, atol=1e-8)
    single = flow.log_prob(x[2])
    assert single.shape == ()
    np.testing.assert_allclose(single, expected[2], rtol=0, atol=1e-8)
    np.testing.assert_allclose(flow.forward(x), z, rtol=0, atol=1e-9)

    # As many samples as x, so that forward() below reuses the programs compiled for x.
    samples, logq = flow.sample_and_log_prob(jr.key(1), 6)
    z_back = flow.forward(samples)
    expected_q = _std_normal_logpdf(z_back) + 0.7 * jnp.trace(a1) + 0.8 * jnp.trace(a2)
    np.testing.assert_allclose(logq, expected_q, rtol=0, atol=1e-8)


def _mlp_flow(key, d=2, **kwargs):
    return small_flow(key, d, width=16, depth=2, t1=0.5, **kwargs)


def test_a_float32_flow_under_x64_solves_in_float32():
    """With x64 on (as in these tests), a float32 flow's solve keeps float32 time and
    state: Python numbers for its span would make both float64 (with a given `dt0`
    the solve then failed on the mismatch)."""
    assert jax.config.jax_enable_x64
    d = 3
    a = 0.5 * jr.normal(jr.key(0), (d, d))
    x = jr.normal(jr.key(1), (5, d))
    z = x @ jsp.linalg.expm(0.8 * a).T
    want = _std_normal_logpdf(z) + 0.8 * jnp.trace(a)
    for dt0 in (None, 0.1):
        flow = cnftrace.CNF(
            Linear(a.astype(jnp.float32)), d, t0=0.2, t1=1.0, rtol=1e-6, atol=1e-6,
            dt0=dt0,
        )  # fmt: skip
        got = flow.log_prob(x.astype(jnp.float32))
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_round_trips():
    flow = cnftrace.Chain(
        [
            _mlp_flow(jr.key(0), rtol=1e-9, atol=1e-9),
            _mlp_flow(jr.key(1), rtol=1e-9, atol=1e-9),
        ]
    )
    x = jr.normal(jr.key(2), (8, 2))
    z = flow.forward(x)
    np.testing.assert_allclose(flow.inverse(z), x, atol=1e-7)

    samples, logq = flow.sample_and_log_prob(jr.key(3), 8)
    np.testing.assert_allclose(flow.log_prob(samples), logq, atol=1e-7)
    # sample() and sample_and_log_prob() draw the same base points for the same key.
    base_key, _ = jr.split(jr.key(3))
    np.testing.assert_allclose(
        flow.inverse(jr.normal(base_key, (8, 2))), samples, atol=1e-12
    )

    x, log_det = flow.forward_and_log_det(samples)
    np.testing.assert_allclose(_std_normal_logpdf(x) + log_det, logq, atol=1e-7)
    x_back, inv_log_det = flow.inverse_and_log_det(x)
    np.testing.assert_allclose(x_back, samples, atol=1e-7)
    np.testing.assert_allclose(inv_log_det, -log_det, atol=1e-7)


def test_batched_solve_meets_tolerance_for_every_sample():
    # One hard sample among easy ones: with the max-over-samples norm its log-density
    # in the batch is as accurate as when solved alone.
    flow = _mlp_flow(jr.key(4), rtol=1e-6, atol=1e-6)
    ref = _mlp_flow(jr.key(4), rtol=1e-12, atol=1e-12, solver=diffrax.Dopri8())
    x = jnp.concatenate([jnp.zeros((63, 2)), jnp.array([[6.0, -5.0]])])
    err = jnp.abs(flow.log_prob(x) - ref.log_prob(x))
    assert err[-1] < 1e-4
    alone = jnp.abs(flow.log_prob(x[-1]) - ref.log_prob(x[-1]))
    assert err[-1] < 10 * alone + 1e-7


def test_max_rms_norm():
    tree = (jnp.array([[3.0, 4.0], [0.0, 1.0]]), jnp.array([0.0, 2.0]))
    # sample 0: (9 + 16 + 0) / 3; sample 1: (0 + 1 + 4) / 3.
    np.testing.assert_allclose(cnftrace.max_rms_norm(tree), np.sqrt(25 / 3))


def test_nfe_counts_real_evaluations():
    counter = []

    class Counted(eqx.Module):
        inner: cnftrace.ConcatSquashMLP

        def __call__(self, t, z, args):
            # Fires once per evaluation of the batched vector field (sample 0 only).
            jax.debug.callback(
                lambda i: counter.append(1) if i == 0 else None, z[0] * 0
            )
            return self.inner(t, z, args)

    # Every pair of a solver, an adjoint and a start (the step-size heuristic, or a
    # first step of the whole span, which is rejected) occurs in one of these six
    # cases: each case is a program of its own, and the count depends on the pairs
    # (the solver's stages, the adjoint's start, its rejections).
    checkpoint, backsolve = (
        diffrax.RecursiveCheckpointAdjoint(),
        diffrax.BacksolveAdjoint(),
    )
    cases = [
        (diffrax.Tsit5(), checkpoint, None),
        (diffrax.Tsit5(), backsolve, 1.0),
        (diffrax.Dopri5(), checkpoint, 1.0),
        (diffrax.Dopri5(), backsolve, None),
        (diffrax.Bosh3(), checkpoint, None),
        (diffrax.Bosh3(), backsolve, 1.0),
    ]
    for solver, adjoint, dt0 in cases:
        field = Counted(cnftrace.ConcatSquashMLP(2, width=8, depth=1, key=jr.key(0)))
        flow = cnftrace.CNF(
            field, 2, t1=1.0, solver=solver, rtol=1e-7, atol=1e-7, dt0=dt0,
            adjoint=adjoint,
        )  # fmt: skip
        counter.clear()
        x = jnp.zeros((1, 2))
        _, stats = flow.log_prob(x, return_stats=True)
        jax.effects_barrier()
        nfe, real = int(stats.nfe[0]), len(counter)
        if dt0 is not None and adjoint is backsolve:
            # diffrax's own start re-evaluates f(t0) on each rejection of the
            # first step; documented as not counted there.
            assert 0 < real - nfe <= int(stats.num_rejected[0])
        else:
            assert nfe == real, (solver, adjoint, dt0)
        assert int(stats.num_steps[0]) > 2
        if dt0 is not None:
            assert int(stats.num_rejected[0]) > 0


def _loss(flow, x):
    return jnp.mean(flow.log_prob(x))


# The gradient of `_loss`, one function for the file's tests: the flow and data of
# `_adjoint_flow` get it compiled once, for the comparison of adjoints and for the
# backward counter's comparison.
_grad_loss = eqx.filter_jit(eqx.filter_grad(_loss))
_ADJOINT_X = jr.normal(jr.key(5), (4, 2))


def _adjoint_flow(adjoint):
    """A one-block flow solved tightly with Dopri5 through `adjoint`.

    The solve takes about a dozen steps; a step budget of 256 rather than the
    default 4096 leaves room to spare and makes `DirectAdjoint`'s gradient a smaller
    program (its loop nests ceil(log16(max_steps)) levels of checkpointed scans:
    two instead of three), which traces and compiles in about two thirds of the
    time and computes the same gradient."""
    return small_flow(
        jr.key(6), t1=0.5, adjoint=adjoint, rtol=1e-11, atol=1e-11,
        solver=diffrax.Dopri5(), max_steps=256,
    )  # fmt: skip


def test_gradients_agree_across_adjoints_and_finite_differences():
    x = _ADJOINT_X
    flows = {
        name: _adjoint_flow(adj)
        for name, adj in [
            ("checkpoint", diffrax.RecursiveCheckpointAdjoint()),
            ("direct", diffrax.DirectAdjoint()),
            ("backsolve", diffrax.BacksolveAdjoint()),
        ]
    }
    grads = {n: _grad_loss(f, x) for n, f in flows.items()}
    leaves = {n: jax.tree_util.tree_leaves(g) for n, g in grads.items()}
    for a, b in zip(leaves["checkpoint"], leaves["direct"]):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    for a, b in zip(leaves["checkpoint"], leaves["backsolve"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)

    # Central finite differences along random directions in parameter space.
    flow = flows["checkpoint"]
    params, static = eqx.partition(flow, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)
    g_flat, _ = jax.flatten_util.ravel_pytree(grads["checkpoint"])
    loss_flat = jax.jit(lambda p: _loss(eqx.combine(unravel(p), static), x))
    eps = 1e-4
    for i in range(3):
        v = jr.normal(jr.key(10 + i), flat.shape)
        v = v / jnp.linalg.norm(v)
        fd = (loss_flat(flat + eps * v) - loss_flat(flat - eps * v)) / (2 * eps)
        np.testing.assert_allclose(jnp.dot(g_flat, v), fd, rtol=1e-6, atol=1e-9)


def test_hutchinson_flow_needs_key_and_is_unbiased():
    flow = _mlp_flow(jr.key(7), rtol=1e-8, atol=1e-8)
    x = jr.normal(jr.key(8), (2, 2))
    hflow = flow.with_estimator(cnftrace.Hutchinson(sampler="gaussian"))
    with pytest.raises(ValueError, match="key"):
        hflow.log_prob(x)
    # The 400 estimates in one compiled program.
    estimates = eqx.filter_jit(
        lambda f, keys: jax.vmap(lambda k: f.log_prob(x, key=k))(keys)
    )(hflow, jr.split(jr.key(9), 400))
    exact = flow.log_prob(x)
    mean = jnp.mean(estimates, axis=0)
    se = jnp.std(estimates, axis=0) / jnp.sqrt(400.0)
    assert jnp.all(se > 0)
    assert jnp.all(jnp.abs(mean - exact) < 4 * se)


def test_regression_closure_over_traced_array_in_checkpointed_adjoint():
    # A conditioning input computed inside filter_jit and closed over by the field.
    net = eqx.nn.MLP(4, 2, 16, 2, activation=jnp.tanh, key=jr.key(10))
    x = jr.normal(jr.key(11), (5, 2))

    @eqx.filter_jit
    def loss(net, context):
        c = jnp.tanh(context) * 2.0  # a traced array made inside jit

        def field(t, z, args):
            return net(jnp.concatenate([z, c]))

        flow = cnftrace.CNF(field, 2, rtol=1e-8, atol=1e-8)
        return jnp.mean(flow.log_prob(x))

    context = jnp.array([0.3, -0.2])
    # Both gradients from one program (a gradient of the jitted `loss` taken outside
    # any `jit` compiles its forward and backward halves apart).
    g_net, g_ctx = eqx.filter_jit(eqx.filter_grad(lambda nc: loss(*nc)))((net, context))
    assert all(jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(g_net))
    eps = 1e-5
    for i in range(2):
        e = jnp.zeros(2).at[i].set(eps)
        fd = (loss(net, context + e) - loss(net, context - e)) / (2 * eps)
        np.testing.assert_allclose(g_ctx[i], fd, rtol=1e-5, atol=1e-8)


@eqx.filter_custom_jvp
def scaled_softplus(x, scale):
    return scale * jax.nn.softplus(x / scale)


@scaled_softplus.def_jvp
def _scaled_softplus_jvp(primals, tangents):
    x, scale = primals
    tx, tscale = tangents
    out = scaled_softplus(x, scale)
    s = jax.nn.sigmoid(x / scale)
    t_out = jnp.zeros_like(out)
    # A None tangent is a symbolic zero: branch on it, never compute with it.
    if tx is not None:
        t_out = t_out + s * tx
    if tscale is not None:
        t_out = t_out + (jax.nn.softplus(x / scale) - s * x / scale) * tscale
    return out, t_out


class CustomField(eqx.Module):
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    scale: jax.Array

    def __call__(self, t, z, args):
        return self.linear2(scaled_softplus(self.linear1(z), self.scale))


class PlainField(CustomField):
    def __call__(self, t, z, args):
        h = self.linear1(z)
        return self.linear2(self.scale * jax.nn.softplus(h / self.scale))


def test_regression_custom_jvp_with_symbolic_zero_tangents():
    k1, k2 = jr.split(jr.key(12))
    kwargs = dict(
        linear1=eqx.nn.Linear(2, 8, key=k1),
        linear2=eqx.nn.Linear(8, 2, key=k2),
        scale=jnp.array(1.5),
    )
    custom = CustomField(**kwargs)
    plain = PlainField(**kwargs)
    x = jr.normal(jr.key(13), (4, 2))

    def loss(field, x):
        return jnp.mean(cnftrace.CNF(field, 2, rtol=1e-9, atol=1e-9).log_prob(x))

    # Differentiate only with respect to linear2 (linear1 and scale get None tangents).
    def only_linear2(field):
        nothing = jax.tree_util.tree_map(lambda _: False, field)
        return eqx.tree_at(lambda f: f.linear2, nothing, True)

    def grad_linear2(field):
        diff, static = eqx.partition(field, only_linear2(field))
        return eqx.filter_jit(
            lambda d, s: eqx.filter_grad(lambda d: loss(eqx.combine(d, s), x))(d)
        )(diff, static)

    g_custom = grad_linear2(custom)
    # All inputs, including the scale that only the custom rule differentiates.
    g_all_c = eqx.filter_jit(eqx.filter_grad(loss))(custom, x)
    g_all_p = eqx.filter_jit(eqx.filter_grad(loss))(plain, x)
    # The plain field's gradient with respect to linear2 is the same whether the
    # other inputs are differentiated or not: take it from g_all_p (one gradient
    # program fewer to trace and compile).
    g_plain = eqx.filter(g_all_p, only_linear2(plain))
    for a, b in zip(
        jax.tree_util.tree_leaves(g_custom), jax.tree_util.tree_leaves(g_plain)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    for a, b in zip(
        jax.tree_util.tree_leaves(g_all_c), jax.tree_util.tree_leaves(g_all_p)
    ):
        np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
    # Nothing leaked: the jitted functions can be called again and give the same answer.
    again = grad_linear2(custom)
    for a, b in zip(
        jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(g_custom)
    ):
        np.testing.assert_array_equal(a, b)


# `log_prob` inside a caller's `jit`, one function for the file's tests: those that
# call it on the same flow settings and shapes share its compiled program.
_jitted_log_prob = eqx.filter_jit(lambda f, x: f.log_prob(x))


def test_bad_input():
    flow = _mlp_flow(jr.key(14))
    with pytest.raises(ValueError, match=r"shape \(5, 3\).*\(2,\)"):
        flow.log_prob(jnp.ones((5, 3)))
    with pytest.raises(ValueError, match="shape"):
        flow.log_prob(jnp.ones((2, 2, 2)))
    with pytest.raises(TypeError, match="dtype int"):
        flow.log_prob(jnp.ones((5, 2), dtype=jnp.int32))
    for bad in [jnp.nan, jnp.inf]:
        # Of the shape of test_methods_on_concrete_values_are_one_program_each's
        # batches: the jitted call is the program that test compiles.
        x = jnp.zeros((7, 2)).at[1, 0].set(bad)
        with pytest.raises(Exception, match="NaN or inf"):
            flow.log_prob(x)
        with pytest.raises(Exception, match="NaN or inf"):
            _jitted_log_prob(flow, x)
    with pytest.raises(ValueError, match="n"):
        flow.sample(jr.key(0), 0)


def test_a_key_that_is_not_a_key_is_named():
    """A number or a float array where a PRNG key goes (`flow.sample(3, n)`) is
    refused by name before anything is traced; JAX's own message spoke of "invalid
    PRNG key data". Old-style raw keys (`jax.random.PRNGKey`) stay welcome."""
    flow = _mlp_flow(jr.key(14))
    stochastic = flow.with_estimator(cnftrace.Hutchinson())
    data = jnp.zeros((4, 2))
    message = r"`key` must be a JAX PRNG key, e.g. `jax.random.key\(0\)`; got "
    calls = {
        "3.": lambda: flow.sample(3, 5),
        "an array of dtype float32.": lambda: flow.sample(np.zeros(2, np.float32), 5),
        "7.": lambda: flow.sample_and_log_prob(7, 5),
        "1.5.": lambda: stochastic.log_prob(data, key=1.5),
        "'seed'.": lambda: cnftrace.fit(flow, np.zeros((8, 2)), key="seed", steps=1),
        "0.": lambda: cnftrace.divergence(
            jnp.sin, jnp.zeros(2), estimator=cnftrace.Hutchinson(), key=0
        ),
    }
    for got, call in calls.items():
        with pytest.raises(TypeError, match=message + re.escape(got)):
            call()
    assert stochastic.log_prob(data, key=jax.random.PRNGKey(0)).shape == (4,)


def test_methods_on_concrete_values_are_one_program_each():
    """Op by op, a first `log_prob` traced and compiled about a hundred small
    programs (3.8 s against 1.2 s); each method is now one program, which a call
    with other values of the same shapes reuses. Inside a caller's `jit` the
    methods are inlined and compute the same; a failed solve raises a
    `SolverError` on the host (a runtime error inside a `jit`)."""
    flow = _mlp_flow(jr.key(21))
    x, y = jr.normal(jr.key(22), (7, 2)), jr.normal(jr.key(23), (7, 2))
    logp, traces = traces_of(lambda: flow.log_prob(x))
    assert len(traces) <= 3, traces
    again, traces = traces_of(lambda: flow.log_prob(y))
    assert traces == []
    jitted = _jitted_log_prob
    np.testing.assert_allclose(jitted(flow, y), again, rtol=1e-6, atol=1e-6)
    samples, traces = traces_of(lambda: flow.sample(jr.key(1), 7))
    assert len(traces) <= 3, traces
    # A flow and data committed to their device (as `fit` returns its flow) reuse
    # the program of the uncommitted `flow` and `x`.
    commit = lambda a: jax.device_put(a, a.sharding) if eqx.is_array(a) else a  # noqa: E731
    trained = jax.tree_util.tree_map(commit, flow)
    for f, data in ((flow, commit(y)), (trained, y)):
        out, lowered = traces_of(lambda f=f, data=data: f.log_prob(data), LOWERED)
        assert lowered == [], (lowered, f is trained)
    np.testing.assert_allclose(out, again, rtol=1e-12)
    other, traces = traces_of(lambda: flow.sample(jr.key(2), 7))
    assert traces == [] and not np.allclose(samples, other)
    z, traces = traces_of(lambda: flow.forward(x))
    assert len(traces) <= 3, traces
    np.testing.assert_allclose(flow.inverse(z), x, atol=1e-4)
    failing = _mlp_flow(jr.key(21), max_steps=2, rtol=1e-8, atol=1e-8)
    with pytest.raises(cnftrace.SolverError, match="maximum number of solver steps"):
        failing.log_prob(x)
    with pytest.raises(Exception, match="maximum number of solver steps"):
        jax.block_until_ready(jitted(failing, x))


def test_constructor_validation():
    field = cnftrace.ConcatSquashMLP(2, key=jr.key(0))
    with pytest.raises(ValueError, match="t1 > t0"):
        cnftrace.CNF(field, 2, t0=1.0, t1=0.5)
    with pytest.raises(ValueError, match="dim"):
        cnftrace.CNF(field, 0)
    with pytest.raises(ValueError, match="`dt0` must be finite and > 0"):
        cnftrace.CNF(field, 2, dt0=-0.1)
    with pytest.raises(TypeError, match="callable"):
        cnftrace.CNF(3, 2)
    with pytest.raises(TypeError, match="estimator"):
        cnftrace.CNF(field, 2, estimator="exact")
    with pytest.raises(ValueError, match="blocks"):
        cnftrace.Chain([])
    with pytest.raises(ValueError, match="one shape"):
        cnftrace.Chain([cnftrace.CNF(field, 2), cnftrace.CNF(field, 3)])


def test_concatsquash_mlp():
    net = cnftrace.ConcatSquashMLP(3, width=10, depth=2, key=jr.key(0))
    assert len(net.layers) == 3
    y = jnp.ones(3)
    assert net(0.1, y).shape == (3,)
    assert not jnp.allclose(net(0.1, y), net(0.9, y))  # time enters every layer
    zero = cnftrace.ConcatSquashMLP(3, zero_last=True, key=jr.key(0))
    np.testing.assert_array_equal(zero(0.3, y), jnp.zeros(3))
    with pytest.raises(ValueError, match="width"):
        cnftrace.ConcatSquashMLP(3, width=0, key=jr.key(0))


def test_backward_nfe_counter_counts_vjps_and_leaves_gradients_alone():
    # Reverse mode backpropagates once through every evaluation of the solve: the
    # first evaluation plus 6 per step of Tsit5 or Dopri5 (both reuse their last
    # stage), rejected steps included; the plain evaluation of the initial-step
    # heuristic is not differentiated. So the count is nfe - 1 for each block, also
    # when the checkpointed adjoint replays steps from few checkpoints.
    #
    # Each adjoint once, the estimators shared out between them, and each counted
    # gradient against the gradient without the counter. Every gradient here is a
    # compiled program of its own, which is what this test costs: the exact
    # trace's two cases are the one-block flows of the comparison of adjoints
    # above, whose gradients without the counter that test compiled. Hutchinson's
    # case solves two blocks: the gradient runs through the step-size controller's
    # error estimate, a sum that cancels to about the tolerance, so two programs
    # that round it differently, even of one adjoint, can differ by 1e-7; with one
    # block, 2 checkpoints' counted and plain gradients do, with two they agree to
    # rounding. Here each counted gradient agrees with the plain one to about 1e-10
    # of its largest entry (3e-10 with the suite's XLA flags, which compile the two
    # programs' loops differently); a counter that touched the gradient would move
    # it far more.
    chain = cnftrace.Chain(
        [
            small_flow(
                k,
                t1=0.5,
                adjoint=diffrax.RecursiveCheckpointAdjoint(checkpoints=2),
                estimator=cnftrace.Hutchinson(),
                rtol=1e-8,
                atol=1e-8,
            )  # fmt: skip
            for k in jr.split(jr.key(2), 2)
        ]
    )
    cases = [
        (_adjoint_flow(diffrax.RecursiveCheckpointAdjoint()), _ADJOINT_X),
        (_adjoint_flow(diffrax.DirectAdjoint()), _ADJOINT_X),
        (chain, jr.normal(jr.key(1), (16, 2))),
    ]
    for flow, x in cases:
        params, static = eqx.partition(flow, eqx.is_inexact_array)

        def loss(p, counter, static=static, x=x):
            logp, stats = eqx.combine(p, static).batch_log_prob(x, jr.key(3), counter)
            return -jnp.mean(logp), stats

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
        (_, stats), (grads, count) = fn(params, jnp.zeros(()))
        assert int(stats.num_steps.min()) > 2
        blocks = len(flow.flows) if flow is chain else 1
        assert (
            count
            == int(jnp.sum(stats.nfe - 1))
            == 6 * int(jnp.sum(stats.num_steps)) + blocks
        )
        if flow is chain:
            plain = jax.jit(jax.grad(lambda p: loss(p, None)[0]))(params)
        else:  # `_loss` is the mean log-density: minus `loss`
            plain = jax.tree.map(jnp.negative, _grad_loss(flow, x))
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(plain), strict=True):
            # Equal up to the rounding of differently compiled XLA code.
            scale = float(np.max(np.abs(b)))
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9 * scale)
