"""Tracing with Python's cyclic garbage collector off (cnftrace/_tracing.py)."""

import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import cnftrace
from cnftrace._tracing import collector_off


def test_collector_off_leaves_the_collector_as_it_found_it():
    assert gc.isenabled()
    with collector_off():
        assert not gc.isenabled()
        with collector_off():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still holds it off
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_off():
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        with collector_off():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


_SEEN = []


class _Recording(eqx.Module):
    """A linear field that records, when traced, whether the collector is on."""

    matrix: jax.Array

    def __call__(self, t, z, args):
        _SEEN.append(gc.isenabled())
        return self.matrix @ z


def test_flow_methods_and_the_training_step_trace_with_the_collector_off():
    seen = _SEEN
    seen.clear()
    field = _Recording(-0.5 * jnp.eye(2))
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-3, atol=1e-3)
    flow.log_prob(jnp.ones((3, 2)))
    assert seen and not any(seen)
    seen.clear()
    cnftrace.fit(
        flow, lambda k, n: jax.random.normal(k, (n, 2)), key=jax.random.key(0),
        steps=1, batch_size=8, progress=False,
    )  # fmt: skip
    assert seen and not any(seen)
    assert gc.isenabled()
