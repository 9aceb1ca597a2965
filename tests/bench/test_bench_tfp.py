"""The TFP peer of the benchmark suite (experiments/bench/tfp_peer.py): its two
workarounds, its NFE counts against a counter on every evaluation of the field, its
log-density against cnftrace's on the same field, and the shape of its B1 result.

Skipped where the `peers` extra (`pip install --pre tfp-nightly`) is not installed.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

pytest.importorskip("tensorflow_probability")

from tensorflow_probability.python.internal.backend.jax.compat import (  # noqa: E402
    v2 as tf,
)

import cnftrace  # noqa: E402
from experiments.bench import tfp_peer  # noqa: E402


def test_size_is_static_under_jit():
    """Workaround (a): TFP's `tf.size` gives a concrete count inside `jax.jit`."""
    seen = []

    @jax.jit
    def f(x):
        seen.append(tf.size(x))
        return jnp.zeros(tf.size(x) - 1)

    assert f(jnp.ones((3, 4))).shape == (11,)
    assert isinstance(seen[0], np.int32) and seen[0] == 12


def test_exact_trace_is_the_jacobians_diagonal():
    """Workaround (b): the exact `trace_augmentation_fn` returns the field and the
    per-sample diagonal of its Jacobian, and reverse mode differentiates it (TFP's
    own exact trace is a `while_loop` it cannot)."""
    field = tfp_peer.ConcatSquashField(2, width=8, depth=1, key=jr.key(0))
    z = jr.normal(jr.key(1), (5, 2), jnp.float32)

    @jax.jit
    def check(field, z):
        ode = lambda t, s: jax.vmap(lambda y: field(t, y))(s)
        values, diag = tfp_peer.exact_trace(ode, z.shape, z.dtype)(0.3, (z, z))
        jac = jax.vmap(jax.jacfwd(lambda y: field(0.3, y)))(z)
        return values, ode(0.3, z), diag, jnp.diagonal(jac, axis1=1, axis2=2)

    values, expected_values, diag, expected_diag = check(field, z)
    np.testing.assert_allclose(values, expected_values, rtol=1e-6)
    np.testing.assert_allclose(diag, expected_diag, rtol=1e-5, atol=1e-7)
    grad = jax.jit(jax.grad(lambda f: jnp.sum(check(f, z)[2])))(field)
    assert float(jnp.abs(grad.layers[0].linear.weight).sum()) > 0


class _Counting(tfp_peer.TFPModel):
    """The TFP model with a host counter on every evaluation of its field."""

    def _time_derivative(self, t, state, params):
        jax.debug.callback(lambda: _CALLS.append(1))
        return super()._time_derivative(t, state, params)


_CALLS: list[int] = []


class _Reversed(eqx.Module):
    """TFP's `log_prob` solves dz/dt = -f(T - t, z) from the data (t = 0) to the
    base (t = T); cnftrace solves its field from the data to the base, so this is
    the same ODE for cnftrace."""

    field: tfp_peer.ConcatSquashField
    t1: float

    def __call__(self, t, y, args=None):
        return -self.field(self.t1 - t, y)


def test_log_prob_matches_cnftrace():
    """The TFP model's log-density (exact trace) equals cnftrace's on the same field,
    both solved to 1e-9 in float64: the peer computes the density it claims to. Its
    forward NFE (TFP's count plus the initial evaluation) is what the field saw."""
    t1 = 0.5
    field = tfp_peer.ConcatSquashField(key=jr.key(3), dtype=jnp.float64)
    x = jnp.asarray(
        cnftrace.datasets.toy_sample("8gaussians", jr.key(4), 32), jnp.float64
    )
    model, params = tfp_peer.tfp_model(
        field, exact=True, t1=t1, tol=1e-9, model_type=_Counting
    )
    _CALLS.clear()
    theirs, nfe = jax.jit(model.log_prob)(params, x)
    jax.effects_barrier()
    assert len(_CALLS) == int(nfe) and (int(nfe) - 1) % 6 == 0
    flow = cnftrace.CNF(_Reversed(field, t1), dim=2, t1=t1, rtol=1e-9, atol=1e-9)
    ours = flow.log_prob(x)
    base = jax.scipy.stats.norm.logpdf(x).sum(-1)
    assert float(jnp.max(jnp.abs(ours - base))) > 0.1  # the flow is not the identity
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-6)


def test_b1_structure_and_nfe():
    """A short B1 run (Hutchinson; a smaller field to compile faster) reports what
    the benchmark scripts expect, and its NFE per iteration (TFP's diagnostics plus
    the evaluations outside its count) are the evaluations the field saw, plus the
    one per step whose result TFP's adjoint discards (run here because the counter
    is a side effect)."""
    _CALLS.clear()
    r = tfp_peer.tfp_b1(
        exact=False, iters=3, batch=32, width=16, depth=2, model_type=_Counting
    )
    jax.effects_barrier()
    assert r["system"].startswith("TFP (JAX) ")
    assert r["estimator"] == "hutchinson"
    assert isinstance(r["solver"], str) and r["solver"]
    assert len(r["iter_times"]) == 3 and all(t > 0 for t in r["iter_times"])
    assert r["first_step_s"] == r["iter_times"][0]
    assert r["s_per_iter"] == r["iter_times"][-1]  # three iterations: the last one
    assert r["nfe_fwd"] == r["nfe_fwd_iters"][-1]
    assert r["nfe_bwd"] == r["nfe_bwd_iters"][-1]
    # Dormand--Prince reusing its last stage: 6 evaluations per attempted step,
    # plus the one at the initial state.
    for n in r["nfe_fwd_iters"] + r["nfe_bwd_iters"]:
        assert isinstance(n, float) and n == int(n) and n > 1 and (n - 1) % 6 == 0
    seen = sum(r["nfe_fwd_iters"]) + sum(r["nfe_bwd_iters"]) + len(r["iter_times"])
    assert len(_CALLS) == seen
