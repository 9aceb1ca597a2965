"""A flow's inputs refused by name: empty batches, half-precision inputs and dtypes,
traced bad end times, samplers that ignore their key, sample sizes no program can
hold, NumPy integers, float32 input to a float64 flow, the `jit` spellings the docs
show, and the divergence at an empty point."""

import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from _flows import small_flow
from _paths import ROOT

import cnftrace
from cnftrace._checks import MAX_ELEMENTS, memory_limit
from cnftrace._placement import committed


def _flow(field=None, **kwargs):
    """The flow of a given field, or a tiny MLP flow; loose tolerances."""
    if field is not None:
        return cnftrace.CNF(field, 2, rtol=1e-3, atol=1e-3, **kwargs)
    return small_flow(width=4, field=cnftrace.MLPField, rtol=1e-3, atol=1e-3, **kwargs)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: _flow().log_prob(jnp.zeros((0, 2))), ValueError, "empty batch"),
        (lambda: _flow().log_prob(jnp.zeros((3, 2), jnp.float16)), TypeError,
         "`x` is float16"),
        (lambda: _flow().forward(jnp.zeros((3, 2), jnp.bfloat16)), TypeError,
         "`x` is bfloat16"),
        (lambda: _flow().sample(jr.key(0), 3, dtype=jnp.float16), TypeError,
         "`dtype` is float16"),
        (lambda: cnftrace.fit(_flow(), np.zeros((8, 2), np.float16), key=jr.key(0)),
         TypeError, "`data` is float16"),
        (lambda: _flow(lambda t, z, a: jnp.zeros(3)).log_prob(jnp.zeros((3, 2))),
         ValueError, r"returned shape \(3,\) for a sample of shape \(2,\)"),
        (lambda: _flow(lambda t, z, a: z[:, None]).sample(jr.key(0), 3),
         ValueError, r"returned shape \(2, 1\)"),
        (lambda: _flow(lambda t, z, a: jnp.zeros(2, int)).log_prob(jnp.zeros((3, 2))),
         TypeError, "returned dtype int"),
        (lambda: _flow(t1=math.inf), ValueError, "finite"),
        (lambda: _flow(t1=math.nan), ValueError, "finite"),
        (lambda: _flow(t1=jnp.asarray(-1.0)), ValueError, "t1 > t0"),
    ],
)  # fmt: skip
def test_library_inputs_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_traced_negative_end_time_is_refused():
    @jax.jit
    def log_prob(t1):
        return _flow(lambda t, z, a: -z, t1=t1).log_prob(jnp.ones((2, 2)))

    assert np.all(np.isfinite(log_prob(0.5)))
    with pytest.raises(Exception, match="t1 > t0"):
        jax.block_until_ready(log_prob(-0.5))


@pytest.mark.parametrize(
    "sampler, error, match",
    [
        (
            lambda k, n: np.random.default_rng().standard_normal((n, 2)),
            ValueError,
            "does not depend on `key`",
        ),
        (lambda k, n: jnp.ones((n, 2)), ValueError, "does not depend on `key`"),
        (
            lambda k, n: np.random.default_rng(np.asarray(jr.key_data(k))).normal(
                size=(n, 2)
            ),
            TypeError,
            "cannot be traced by JAX",
        ),
        (lambda k, n: jr.normal(k, (7, 2)), ValueError, "returned 7 samples"),
    ],
    ids=["numpy", "fixed", "untraceable", "count"],
)
def test_a_sampler_that_ignores_its_key_is_refused(sampler, error, match):
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    with pytest.raises(error, match=match):
        cnftrace.fit(flow, sampler, key=jr.key(1), steps=2, batch_size=16)
    # A sampler drawing from its key passes the same check.
    trainer = cnftrace.Trainer(lambda k, n: jr.normal(k, (n, 2)), key=jr.key(1))
    trainer.check_data(flow)


def test_sample_sizes_no_program_can_hold_are_refused():
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*draw them in batches"):
        flow.sample(jr.key(0), 2**30)  # it aborted the interpreter
    with pytest.raises(ValueError, match=r"2\*\*31 - 1"):
        flow.sample_and_log_prob(jr.key(0), 2**30)
    limit, what = memory_limit()
    n = limit // (10 * 2 * 8) + 1  # float64: ten arrays of n * 2 numbers
    if n * 2 <= MAX_ELEMENTS:
        with pytest.raises(ValueError, match=f"cannot fit.*{what}"):
            flow.sample(jr.key(0), n)


def test_numpy_integers_are_taken_as_ints():
    i = np.int64
    flow = cnftrace.mlp_flow(i(2), key=jr.key(0), width=i(8), depth=i(1))
    np.testing.assert_array_equal(
        flow.sample(jr.key(0), i(3)), flow.sample(jr.key(0), 3)
    )
    x, logp = flow.sample_and_log_prob(jr.key(0), i(3))
    assert x.shape == (3, 2) and logp.shape == (3,)
    for value in (
        cnftrace.Validation(x, every=i(2), patience=i(3)).every,
        cnftrace.Checkpoints("d", every=i(5), keep=i(2)).keep,
        cnftrace.Hutchinson(i(2)).num_probes,
        cnftrace.CNF(cnftrace.MLPField(2, width=8, key=jr.key(0)), 2).max_steps,
        cnftrace.CNF(
            cnftrace.MLPField(2, width=8, key=jr.key(0)), 2, max_steps=i(64)
        ).max_steps,
    ):
        assert type(value) is int


def test_float32_input_to_a_float64_flow_is_solved_in_float64():
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    x = jr.normal(jr.key(1), (4, 2), jnp.float32)
    assert flow.blocks[0].vector_field.mlp.layers[0].weight.dtype == jnp.float64
    logp = flow.log_prob(x)  # an internal dynamic_update_slice error
    assert logp.dtype == jnp.float64
    want = flow.log_prob(x.astype(jnp.float64))
    np.testing.assert_allclose(logp, want, rtol=1e-12)
    samples = flow.sample(jr.key(2), 4, dtype=jnp.float32)
    assert samples.dtype == jnp.float32
    z = jr.normal(jr.key(2), (4, 2), jnp.float32)
    np.testing.assert_allclose(samples, flow.inverse(z), rtol=1e-6)


def test_the_jit_spellings_the_docs_show_work():
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    x = jr.normal(jr.key(1), (4, 2))
    want = flow.log_prob(x)
    np.testing.assert_allclose(jax.jit(lambda x: flow.log_prob(x))(x), want, 1e-10)
    np.testing.assert_allclose(eqx.filter_jit(flow.log_prob)(x), want, rtol=1e-10)
    with pytest.raises(TypeError, match="unhashable"):
        jax.jit(flow.log_prob)(x)  # why the docs show the two above
    root = ROOT
    with open(os.path.join(root, "docs", "training.md")) as f:
        text = " ".join(f.read().split())
    assert "eqx.filter_jit(flow.log_prob)" in text
    assert "jax.jit(lambda x: flow.log_prob(x))" in text
    assert "eqx.filter_jit(flow.log_prob)" in cnftrace.AbstractFlow.__doc__


def test_the_divergence_at_an_empty_point_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`y` is empty \(shape \(0,\)\)"):
        cnftrace.divergence(jnp.tanh, jnp.ones(0))
    fy, div = cnftrace.divergence(jnp.tanh, jnp.ones(()))  # a scalar is a point
    assert float(div) == pytest.approx(1 - math.tanh(1) ** 2, rel=1e-12)


def test_program_arguments_are_committed_to_one_device():
    """`committed` commits every array of a tree (NumPy arrays as JAX arrays of the
    same values and dtype), to the device of those already committed, and leaves
    trees with traced values alone."""
    loose = jnp.arange(3.0)
    device = jax.devices()[0]
    fixed = jax.device_put(jnp.ones(2), device)
    host = np.arange(4, dtype=np.int32)
    tree = {"a": loose, "b": fixed, "c": host, "d": 1.5, "e": "name"}
    out = committed(tree)
    assert not loose.committed  # the caller's arrays are left as they are
    assert all(out[k].committed for k in "abc") and out["b"] is fixed
    assert {next(iter(out[k].devices())) for k in "abc"} == {device}
    np.testing.assert_array_equal(out["a"], loose)
    np.testing.assert_array_equal(out["c"], host)
    assert out["c"].dtype == host.dtype and (out["d"], out["e"]) == (1.5, "name")
    assert committed(fixed) is fixed
    inside = []
    jax.jit(lambda x: inside.append(committed((x, loose))) or x)(1.0)
    assert inside[0][1] is loose
