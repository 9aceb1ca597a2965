"""A trainable end time (FFJORD's train_T): closed form, finite differences, fit."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy as jsp
import numpy as np
import optax
import pytest

import cnftrace

TIGHT = dict(rtol=1e-11, atol=1e-11, solver=diffrax.Dopri8())


class Linear(eqx.Module):
    matrix: jax.Array

    def __call__(self, t, z, args):
        return self.matrix @ z


def _grad_wrt_end(flow, loss):
    """d loss / d t1, from the gradient with respect to the log-span parameter (one
    compiled program rather than the many small ones of an eager gradient)."""
    grads = eqx.filter_jit(eqx.filter_grad(loss))(flow)
    return grads._end / (flow.t1 - flow.t0)


def test_learnable_end_time_gradient_matches_closed_form():
    d, t0, t1 = 3, 0.2, 0.9
    a = 0.5 * jr.normal(jr.key(0), (d, d))
    x = jr.normal(jr.key(1), (5, d))
    flow = cnftrace.CNF(Linear(a), d, t0=t0, t1=t1, learn_t1=True, **TIGHT)
    np.testing.assert_allclose(flow.t1, t1, rtol=1e-15)

    # log p(x) = log N(exp(A T) x) + T tr(A), T = t1 - t0; d/dT = -z^T A z + tr(A).
    z = x @ jsp.linalg.expm((t1 - t0) * a).T
    np.testing.assert_allclose(
        flow.log_prob(x),
        jnp.sum(jsp.stats.norm.logpdf(z), -1) + (t1 - t0) * jnp.trace(a),
        atol=1e-9,
    )
    expected = jnp.mean(-jnp.einsum("ni,ij,nj->n", z, a, z) + jnp.trace(a))
    got = _grad_wrt_end(flow, lambda f: jnp.mean(f.log_prob(x)))
    np.testing.assert_allclose(got, expected, rtol=1e-8)


def test_learnable_end_time_gradient_matches_finite_differences():
    # Through the default (checkpointed) adjoint; the closed-form test above covers
    # the end time's gradient on a linear field.
    field = cnftrace.ConcatSquashMLP(2, width=8, depth=2, key=jr.key(0))
    x = jr.normal(jr.key(1), (6, 2))
    kwargs = dict(rtol=1e-10, atol=1e-10, solver=diffrax.Dopri8())

    def flow_at(t1):
        return cnftrace.CNF(field, 2, t1=t1, learn_t1=True, **kwargs)

    def loss(flow):
        return jnp.mean(flow.log_prob(x))

    # The end time is an array: one compiled loss serves both sides of the difference.
    loss_jit = eqx.filter_jit(loss)
    t1, h = 0.6, 1e-5
    flow = flow_at(t1)
    got = _grad_wrt_end(flow, loss)
    fd = (loss_jit(flow_at(t1 + h)) - loss_jit(flow_at(t1 - h))) / (2 * h)
    np.testing.assert_allclose(got, fd, rtol=1e-6)
    # Sampling runs from the learned t1 back to t0, the exact inverse.
    round_trip = eqx.filter_jit(lambda f: f.inverse(f.forward(x)))(flow)
    np.testing.assert_allclose(round_trip, x, atol=1e-8)


def test_fit_trains_the_end_time():
    # Data N(0, s^2) with a linear field A = a I: the best T has exp(-a T) = s, so
    # with a fixed, only T can fit the scale; it must move towards log(s) / -a.
    class Scale(eqx.Module):
        rate: float = eqx.field(static=True)

        def __call__(self, t, z, args):
            return -self.rate * z

    s = 3.0
    data = s * jr.normal(jr.key(0), (4096, 2), jnp.float32)
    flow = cnftrace.CNF(Scale(1.0), 2, t1=0.2, learn_t1=True, rtol=1e-6, atol=1e-6)
    trained, hist = cnftrace.fit(
        flow,
        data,
        key=jr.key(1),
        steps=150,
        batch_size=256,
        optimizer=optax.adam(0.05),
        objective=cnftrace.MaximumLikelihood(cnftrace.Exact()),
        progress=False,
    )
    # exp(+T) maps data to the base here (dz/dt = -z shrinks it): T* = log s.
    np.testing.assert_allclose(float(trained.t1), np.log(s), rtol=0.05)
    assert float(trained.t1) > 0


def test_learn_t1_input_checks():
    field = cnftrace.ConcatSquashMLP(2, width=4, depth=1, key=jr.key(0))
    with pytest.raises(TypeError, match="learn_t1"):
        cnftrace.CNF(field, 2, t1=jnp.asarray(1.0), learn_t1=True)
    with pytest.raises(TypeError, match="learn_t1"):
        cnftrace.CNF(field, 2, learn_t1=1)
    with pytest.raises(ValueError, match="t1 > t0"):
        cnftrace.CNF(field, 2, t0=1.0, t1=0.5, learn_t1=True)
    # Without learn_t1 the end time is a plain float (not trained).
    flow = cnftrace.CNF(field, 2, t1=0.5)
    assert flow.t1 == 0.5
    params = eqx.filter(flow, eqx.is_inexact_array)
    assert params._end is None
