import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace

SAMPLERS = ["rademacher", "gaussian", "sphere"]


def _field(y):
    # A nonlinear map with a non-symmetric Jacobian whose diagonal varies with y.
    w = jnp.arange(1.0, 1.0 + y.size, dtype=y.dtype).reshape(y.shape) / y.size
    return jnp.tanh(y * w) + jnp.roll(y, 1) ** 2 + jnp.sin(y) * jnp.sum(y)


def test_exact_matches_jacfwd_trace():
    y = jr.normal(jr.key(0), (5,))
    fy, div = cnftrace.divergence(_field, y, estimator=cnftrace.Exact())
    np.testing.assert_allclose(fy, _field(y), rtol=1e-14)
    np.testing.assert_allclose(div, jnp.trace(jax.jacfwd(_field)(y)), rtol=1e-13)


def test_exact_on_matrix_shaped_state():
    y = jr.normal(jr.key(1), (3, 4))
    _, div = cnftrace.divergence(_field, y)
    jac = jax.jacfwd(_field)(y).reshape(12, 12)
    np.testing.assert_allclose(div, jnp.trace(jac), rtol=1e-13)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_hutchinson_is_unbiased(sampler):
    y = jr.normal(jr.key(2), (6,))
    exact = jnp.trace(jax.jacfwd(_field)(y))
    est = cnftrace.Hutchinson(sampler=sampler)

    def one(key):
        return cnftrace.divergence(_field, y, estimator=est, key=key)[1]

    samples = jax.vmap(one)(jr.split(jr.key(3), 20_000))
    mean, se = jnp.mean(samples), jnp.std(samples) / math.sqrt(samples.size)
    assert se > 0  # the estimator really is random
    assert abs(mean - exact) < 4 * se, (mean, exact, se)


@pytest.mark.parametrize("num_probes", [1, 3])  # one probe takes a path without vmap
def test_hutchinson_value_for_given_probes(num_probes):
    y = jr.normal(jr.key(4), (4,))
    jac = jax.jacfwd(_field)(y)
    est = cnftrace.Hutchinson(num_probes=num_probes)
    probes = est.draw(jr.key(5), y.shape, y.dtype)
    assert probes.shape == (num_probes, 4)
    fy, div = est.estimate(_field, y, probes)
    expected = jnp.mean(jnp.einsum("ki,ij,kj->k", probes, jac, probes))
    np.testing.assert_allclose(div, expected, rtol=1e-13)
    np.testing.assert_allclose(fy, _field(y), rtol=1e-14)
    # The Frobenius estimate E|J eps|^2 from the same JVPs.
    _, _, frob = est.estimate_with_jacobian_norm(_field, y, probes)
    expected = jnp.mean(jnp.sum((probes @ jac.T) ** 2, axis=1))
    np.testing.assert_allclose(frob, expected, rtol=1e-13)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_probe_dtype_and_shape(sampler, dtype):
    est = cnftrace.Hutchinson(num_probes=2, sampler=sampler)
    probes = est.draw(jr.key(0), (7, 5), dtype)
    assert probes.shape == (7, 2, 5)
    assert probes.dtype == dtype
    if sampler == "rademacher":
        assert set(np.unique(np.asarray(probes))) == {-1.0, 1.0}
    if sampler == "sphere":
        np.testing.assert_allclose(
            jnp.linalg.norm(probes, axis=-1), math.sqrt(5), rtol=1e-5
        )


@pytest.mark.parametrize("bad", [0, -2, 1.5, 2.0, True, "3", None])
def test_num_probes_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="num_probes"):
        cnftrace.Hutchinson(num_probes=bad)


def test_num_probes_rejects_jax_arrays():
    with pytest.raises(ValueError, match="num_probes"):
        cnftrace.Hutchinson(num_probes=jnp.asarray(2))


def test_unknown_sampler():
    with pytest.raises(ValueError, match="sampler"):
        cnftrace.Hutchinson(sampler="uniform")


def test_num_probes_stays_static_under_eval_shape_and_jit():
    y = jnp.ones(3)

    def build_and_estimate(y, key):
        # Clamp with Python min, as a user computing the count would.
        est = cnftrace.Hutchinson(num_probes=min(4, 2 * y.shape[0]))
        assert isinstance(est.num_probes, int)
        probes = est.draw(key, y.shape, y.dtype, event_ndim=1)
        return probes, cnftrace.divergence(_field, y, estimator=est, key=key)[1]

    shapes = eqx.filter_eval_shape(build_and_estimate, y, jr.key(0))
    assert shapes[0].shape == (4, 3)

    est = cnftrace.Hutchinson(num_probes=3)

    @eqx.filter_jit
    def f(est, y, key):
        assert isinstance(est.num_probes, int)  # runs at trace time
        return est.draw(key, y.shape, y.dtype)

    assert f(est, y, jr.key(1)).shape == (3, 3)
    # As a static field, num_probes is part of the treedef, not a traced leaf.
    assert jax.tree_util.tree_leaves(est) == []
    out = jax.jit(
        lambda e, y, k: cnftrace.divergence(_field, y, estimator=e, key=k)[1]
    )(est, y, jr.key(2))
    assert out.shape == ()


def test_missing_key_is_an_error():
    with pytest.raises(ValueError, match="key"):
        cnftrace.divergence(_field, jnp.ones(3), estimator=cnftrace.Hutchinson())


def test_integer_input_is_an_error():
    with pytest.raises(TypeError, match="floating"):
        cnftrace.divergence(lambda y: y, jnp.arange(3))


def test_non_square_fn_is_an_error():
    with pytest.raises(ValueError, match="same shape"):
        cnftrace.divergence(lambda y: y[:2], jnp.ones(3))
