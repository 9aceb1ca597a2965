"""How the flows' public methods run: each as one compiled program, with a failed
solve raised on the host.

`log_prob`, `sample` and the maps check their input on the host, then run one program
(per flow structure, shapes and static arguments) and raise a failed solve's message
after it; inside a caller's transformation they are inlined and raise by a runtime
check instead."""

from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.random as jr
import numpy as np

from ..ode import SolveStats
from ._inputs import tracing


def _compiled(fn: Callable) -> Callable:
    """`fn(flow, *args)` as one compiled program (per flow structure, shapes and
    static arguments) when called on concrete values: run op by op, a first call
    compiles about a hundred small programs. Inside a caller's transformation (any
    argument traced) it is inlined as it is, so that values the caller traces are
    never baked into a program of their own."""
    jitted = eqx.filter_jit(fn)

    def call(flow, *args):
        if tracing((flow, args)):
            return fn(flow, *args)
        return jitted(flow, *args)

    return call


@_compiled
def log_prob_program(flow, x, key, context, regularize):
    return flow._batch_log_prob(x, key, context=context, regularize=regularize)


@_compiled
def transform_program(flow, x, inverse, log_det, key, context):
    return flow.transform(
        x, inverse=inverse, log_det=log_det, key=key, context=context
    )[:3]


@_compiled
def sample_program(flow, key, n, dtype, context, log_det):
    if log_det:
        key, probe_key = jr.split(key)
    else:
        probe_key = None
    z = flow.base.sample(key, n, dtype=dtype)
    x, ld, stats, _ = flow.transform(
        z, inverse=True, log_det=log_det, key=probe_key, context=context
    )
    if not log_det:
        return x, stats
    return x, flow.base.log_prob(z) - ld, stats


class SolverError(RuntimeError):
    """An ODE solve failed (its step limit, say): raised on the host, with diffrax's
    message, by the flows' methods (`log_prob`, `sample`, ...) called outside a
    `jit`, and by [`log_prob_batched`][cnftrace.log_prob_batched] and
    [`evaluate_nll`][cnftrace.evaluate_nll] with the samples it failed on."""


def raise_on_failure(out, stats: SolveStats):
    """`out`, after a check that every solve behind it succeeded: a failed solve
    raises diffrax's message for its result; on the host (a `SolverError`) for
    concrete statistics, by a runtime check inside a caller's transformation."""
    if tracing(stats):
        result = stats.first_failure()
        return result.error_if(out, result != diffrax.RESULTS.successful)
    codes = np.asarray(jax.tree_util.tree_leaves(stats.result)[0]).reshape(-1)
    successful = np.asarray(jax.tree_util.tree_leaves(diffrax.RESULTS.successful)[0])
    failed = np.flatnonzero(codes != successful)
    if failed.size:
        block = int(failed[0])
        result = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(diffrax.RESULTS.successful),
            [np.asarray(codes[block], successful.dtype)],
        )
        where = f" of block {block} (of {codes.size})" if codes.size > 1 else ""
        raise SolverError(f"the ODE solve{where} failed: {diffrax.RESULTS[result]}")
    return out
