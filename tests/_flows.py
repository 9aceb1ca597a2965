"""The small flows the tests build: one builder, so that files differ only in the
settings they choose (and programs of the same settings compile alike); and what
JAX traces for a call."""

import jax
import jax.random as jr

import cnftrace


def small_flow(key=None, d=2, *, width=8, depth=1, field=None, **kwargs):
    """A `CNF` of dimension `d` on a `field` class (`ConcatSquashMLP` by default)
    of `width` and `depth`, initialised from `key` (`jr.key(0)` by default); the
    keyword arguments go to `CNF`."""
    field = cnftrace.ConcatSquashMLP if field is None else field
    key = jr.key(0) if key is None else key
    return cnftrace.CNF(field(d, width=width, depth=depth, key=key), d, **kwargs)


TRACED = "/jax/core/compile/jaxpr_trace_duration"
LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def traces_of(call, event=TRACED):
    """`call()`'s result (waited for) and the names of the programs JAX traced for
    it (with `event=LOWERED`, lowered for compiling: a program traced before is
    lowered again for arguments placed otherwise)."""
    traces = []
    listener = lambda name, *_, fun_name=None, **__: (  # noqa: E731
        traces.append(fun_name) if name == event else None
    )
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        out = jax.block_until_ready(call())
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return out, traces
