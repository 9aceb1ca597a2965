import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
import pytest

import cnftrace

SAMPLERS = ["rademacher", "gaussian", "sphere"]


def _mlp(key, d=4):
    return eqx.nn.MLP(d, d, 16, 2, activation=jnp.tanh, key=key)


def _operators():
    key1, key2, key3 = jr.split(jr.key(0), 3)
    m = jr.normal(key1, (5, 5))
    diag = jr.normal(key2, (5,))
    net = _mlp(key3, 5)
    y = jr.normal(key1, (5,))
    jac = jax.jacfwd(net)(y)
    struct = jax.ShapeDtypeStruct((5,), m.dtype)
    return {
        "matrix": (lx.MatrixLinearOperator(m), m),
        "diagonal": (lx.DiagonalLinearOperator(diag), jnp.diag(diag)),
        "function": (lx.FunctionLinearOperator(lambda v: m @ v, struct), m),
        "jacobian": (lx.JacobianLinearOperator(lambda x, _: net(x), y), jac),
    }


@pytest.mark.parametrize("name", ["matrix", "diagonal", "function", "jacobian"])
def test_exact_trace(name):
    op, matrix = _operators()[name]
    np.testing.assert_allclose(cnftrace.trace(op), jnp.trace(matrix), rtol=1e-12)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("name", ["matrix", "diagonal", "function", "jacobian"])
def test_hutchinson_trace_is_unbiased(name, sampler):
    op, matrix = _operators()[name]
    est = cnftrace.Hutchinson(sampler=sampler)
    samples = jax.vmap(lambda k: cnftrace.trace(op, estimator=est, key=k))(
        jr.split(jr.key(1), 20_000)
    )
    mean, se = jnp.mean(samples), jnp.std(samples) / math.sqrt(samples.size)
    assert abs(mean - jnp.trace(matrix)) <= 4 * se + 1e-12, (
        mean,
        jnp.trace(matrix),
        se,
    )


def test_trace_of_pytree_operator():
    m = jr.normal(jr.key(2), (3, 3))
    struct = {
        "a": jax.ShapeDtypeStruct((2,), m.dtype),
        "b": jax.ShapeDtypeStruct((1,), m.dtype),
    }

    def mv(v):
        flat = jnp.concatenate([v["a"], v["b"]])
        out = m @ flat
        return {"a": out[:2], "b": out[2:]}

    op = lx.FunctionLinearOperator(mv, struct)
    np.testing.assert_allclose(cnftrace.trace(op), jnp.trace(m), rtol=1e-12)
    est = cnftrace.Hutchinson(num_probes=4)
    probes = est.draw(jr.key(3), (3,), m.dtype)
    expected = jnp.mean(jnp.einsum("ki,ij,kj->k", probes, m, probes))
    np.testing.assert_allclose(
        cnftrace.trace(op, estimator=est, key=jr.key(3)), expected, rtol=1e-12
    )


def test_non_square_operator_is_an_error():
    with pytest.raises(ValueError, match="square"):
        cnftrace.trace(lx.MatrixLinearOperator(jnp.ones((3, 4))))


def test_non_operator_is_an_error():
    with pytest.raises(TypeError, match="lineax"):
        cnftrace.trace(jnp.eye(3))


def test_missing_key_is_an_error():
    op = lx.MatrixLinearOperator(jnp.eye(3))
    with pytest.raises(ValueError, match="key"):
        cnftrace.trace(op, estimator=cnftrace.Hutchinson())


def test_gradient_with_respect_to_matrix_and_diagonal():
    m = jr.normal(jr.key(4), (4, 4))
    grad = jax.grad(lambda m: cnftrace.trace(lx.MatrixLinearOperator(m)))(m)
    np.testing.assert_allclose(grad, jnp.eye(4))
    d = jr.normal(jr.key(5), (4,))
    grad = jax.grad(lambda d: cnftrace.trace(lx.DiagonalLinearOperator(d)))(d)
    np.testing.assert_allclose(grad, jnp.ones(4))
    # Stochastic: d/dM of e^T M e is e e^T, averaged over the probes.
    est = cnftrace.Hutchinson(num_probes=3)
    grad = jax.grad(
        lambda m: cnftrace.trace(
            lx.MatrixLinearOperator(m), estimator=est, key=jr.key(6)
        )
    )(m)
    probes = est.draw(jr.key(6), (4,), m.dtype)
    np.testing.assert_allclose(grad, jnp.einsum("ki,kj->ij", probes, probes) / 3)


def test_gradient_of_jacobian_operator_trace_wrt_network_parameters():
    net = _mlp(jr.key(7))
    y = jr.normal(jr.key(8), (4,))

    def via_operator(net, estimator=cnftrace.Exact(), key=None):
        op = lx.JacobianLinearOperator(lambda x, _: net(x), y)
        return cnftrace.trace(op, estimator=estimator, key=key)

    def via_jacfwd(net):
        return jnp.trace(jax.jacfwd(net)(y))

    # Hutchinson: for fixed probes the gradient is that of mean_k e_k^T J e_k ...
    est = cnftrace.Hutchinson(num_probes=2)
    key = jr.key(9)
    probes = est.draw(key, (4,), y.dtype)

    def by_hand(net):
        jac = jax.jacfwd(net)(y)
        return jnp.mean(jnp.einsum("ki,ij,kj->k", probes, jac, probes))

    # ... and averaged over many keys it is the exact gradient (unbiased).
    def grad_for_key(net, k):
        params, static = eqx.partition(net, eqx.is_array)
        return eqx.filter_grad(lambda p: via_operator(eqx.combine(p, static), est, k))(
            params
        )

    @eqx.filter_jit
    def gradients(net):
        """Every gradient the test compares, in one compiled program."""
        keys = jr.split(jr.key(10), 4000)
        return (
            eqx.filter_grad(via_operator)(net),
            eqx.filter_grad(via_jacfwd)(net),
            eqx.filter_grad(lambda n: via_operator(n, est, key))(net),
            eqx.filter_grad(by_hand)(net),
            jax.vmap(grad_for_key, in_axes=(None, 0))(net, keys),
        )

    g_op, g_ref, g_h, g_hand, grads = gradients(net)
    for a, b in zip(jax.tree_util.tree_leaves(g_op), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for a, b in zip(jax.tree_util.tree_leaves(g_h), jax.tree_util.tree_leaves(g_hand)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for g, ref in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(g_ref)
    ):
        mean = jnp.mean(g, axis=0)
        se = jnp.std(g, axis=0) / math.sqrt(g.shape[0])
        assert jnp.all(jnp.abs(mean - ref) <= 4.5 * se + 1e-9)
