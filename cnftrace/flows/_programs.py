"""How the flows' public methods run: each as one compiled program, with a failed
solve raised on the host."""

import warnings
from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array

from .._placement import committed
from ..ode import SolveStats
from ._inputs import tracing


def _compiled(fn: Callable) -> Callable:
    """`fn(flow, *args)` as one compiled program (per flow structure, shapes and
    static arguments) when called on concrete values: run op by op, a first call
    compiles about a hundred small programs. Inside a caller's transformation (any
    argument traced) it is inlined as it is, so that values the caller traces are
    never baked into a program of their own. The arguments' arrays are committed
    to one device first, so that a flow fresh or trained, and data from the host or
    from a compiled program, share the program."""
    jitted = eqx.filter_jit(fn)

    def call(flow, *args):
        if tracing((flow, args)):
            return fn(flow, *args)
        return jitted(*committed((flow, *args)))

    return call


@_compiled
def log_prob_program(flow, x, key, context, regularize):
    return flow.batch_log_prob(x, key, context=context, regularize=regularize)


@_compiled
def transform_program(flow, x, inverse, log_det, key, context):
    return flow.transform(
        x, inverse=inverse, log_det=log_det, key=key, context=context
    )[:3]


# Rounds of drawing again the base draws beyond the solver's range (heavy-tailed bases
# only): a Student-t with 1.5 degrees of freedom goes beyond float32's range once in
# about 1e11 draws.
_REDRAWS = 2


def solver_range(dtype) -> float:
    """The largest magnitude a base draw may have for the ODE solve: `1 / eps` of
    the float (8.4e6 in float32, 4.5e15 in float64), beyond which neighbouring
    floats are more than a unit apart. Much further out the solver's relative error
    control cannot be met (a float32 batch with draws near 1e12 reaches its step
    limit) and squares overflow."""
    return float(1 / np.finfo(np.dtype(dtype)).eps)


def base_draws(base, key, n: int, dtype) -> tuple[Array, Array, Array]:
    """`(z, redrawn, left)`: `n` draws of `base` of `dtype` with those beyond
    `solver_range` (or not finite: a heavy tail overflowing the float) drawn again,
    up to `_REDRAWS` times, the number of draws that were, and the number still beyond
    after that. A light-tailed base is drawn once (both counts 0)."""
    z = base.sample(key, n, dtype=dtype)
    if not base.heavy_tailed:
        zero = jnp.zeros((), jnp.int32)
        return z, zero, zero
    limit = solver_range(dtype)

    def beyond(z):
        flat = jnp.abs(z.reshape(n, -1))
        return ~jnp.all(flat <= limit, axis=1)  # NaN and inf count as beyond

    bad = beyond(z)
    redrawn = jnp.sum(bad, dtype=jnp.int32)

    # The rounds as a loop, so that the program holds one copy of the base's sampler
    # (a Student-t's is a rejection loop of its own) rather than one per round.
    def again(r, carry):
        z, bad = carry
        fresh = base.sample(jr.fold_in(key, r + 1), n, dtype=dtype)
        z = jnp.where(bad.reshape((n,) + (1,) * (z.ndim - 1)), fresh, z)
        return z, beyond(z)

    z, bad = jax.lax.fori_loop(0, _REDRAWS, again, (z, bad))
    return z, redrawn, jnp.sum(bad, dtype=jnp.int32)


@_compiled
def sample_program(flow, key, n, dtype, context, log_det):
    """`(x, log_prob or None, stats, (redrawn, left))` of `n` samples."""
    key, probe_key = jr.split(key) if log_det else (key, None)
    z, redrawn, left = base_draws(flow.base, key, n, dtype)
    x, ld, stats, _ = flow.transform(
        z, inverse=True, log_det=log_det, key=probe_key, context=context
    )
    logp = flow.base.log_prob(z) - ld if log_det else None
    return x, logp, stats, (redrawn, left)


def check_draws(out, counts, base, n: int, dtype):
    """`out` after the base draws' counts `(redrawn, left)` are checked: draws left
    beyond the solver's range raise a `ValueError` saying how many and why (inside a
    caller's transformation, a runtime check); draws drawn again are reported in a
    warning. Samples with a NaN or inf never reach the caller."""
    redrawn, left = counts
    limit = solver_range(dtype)
    what = (
        f"beyond the ODE solver's range for {np.dtype(dtype).name} (|z| > "
        f"{limit:.3g}, where floats are more than a unit apart) under the base's "
        f"heavy tails ({base.describe()})"
    )
    if tracing(counts):
        return eqx.error_if(out, left > 0, f"draws of the base were {what}.")
    redrawn, left = int(redrawn), int(left)
    if left:
        raise ValueError(
            f"{left} of {n} draws of the base were {what}, even drawn again. Sample "
            "in float64 (`dtype=jnp.float64`, with jax_enable_x64), or use a base "
            "with more degrees of freedom."
        )
    if redrawn:
        warnings.warn(
            f"{redrawn} of {n} draws of the base were {what}; they were drawn again, "
            "so these samples come from the flow with its base truncated there.",
            stacklevel=4,
        )
    return out


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
