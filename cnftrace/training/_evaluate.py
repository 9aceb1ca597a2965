"""Evaluation in chunks: per-sample log-densities and the test NLL."""

import math

import diffrax
import equinox as eqx
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_context, check_int
from .._custom_types import Key
from .._defaults import EVAL_BATCH_SIZE
from .._placement import committed
from ..estimators import AbstractEstimator, Exact
from ..flows import AbstractFlow, SolverError
from ..flows._inputs import need_key, validate_input
from ..flows._standardized import standardize_on_host


class NLL(eqx.Module):
    """A test negative log-likelihood in nats, as
    [`evaluate_nll`][cnftrace.evaluate_nll] returns it.

    **Fields:**

    - `mean`: the mean NLL over the samples.
    - `stderr`: its standard error (sample standard deviation over `sqrt(n)`).
    - `nfe`: the mean number of vector-field evaluations per solve.

    `str(nll)` reads `"2.8310 ± 0.0069 nats"`.

    !!! example

        ```python
        nll = cnftrace.NLL(mean=2.83, stderr=0.01, nfe=70.0)
        print(nll, nll.mean - 2.8319)  # the gap to an entropy
        ```
    """

    mean: float
    stderr: float
    nfe: float

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.stderr:.4f} nats"


@eqx.filter_jit
def _log_prob_nfe_result(model: AbstractFlow, x, key, context=None):
    """The log-density of a checked batch, its evaluations per solve and the first
    failed solve's result (checked by the caller: no host callback)."""
    logp, stats = model.batch_log_prob(x, key, context=context)
    return logp, stats.total_nfe, stats.first_failure()


def log_prob_batched(
    flow: AbstractFlow,
    x: Float[Array, "n ..."],
    *,
    batch_size: int = EVAL_BATCH_SIZE,
    context: Float[Array, "n context"] | None = None,
    estimator: AbstractEstimator | None = None,
    key: Key | None = None,
    return_nfe: bool = False,
):
    """The log-density of every sample of `x`, evaluated `batch_size` samples at a
    time, every chunk by one compiled program (a shorter last chunk is filled up
    with repeats of its own rows, whose values are dropped).

    **Arguments:**

    - `flow`: any cnftrace flow.
    - `x`: samples, shape `(n, *event_shape)`.
    - `batch_size`: samples per solve; bounds the memory.
    - `context`: one row per sample, for a conditional flow.
    - `estimator`: the trace estimator, [`Exact`][cnftrace.Exact] by default (the
        flow's own is not used: training estimators are usually stochastic). Pass a
        stochastic one (and a `key`) for large dimensions.
    - `key`: the PRNG key of a stochastic estimator; chunk `i` uses
        `jax.random.fold_in(key, i)`.
    - `return_nfe`: also return the mean number of vector-field evaluations per
        solve.

    **Returns:**

    The log-densities as a NumPy array of shape `(n,)`; with `return_nfe`, a pair
    `(log_prob, nfe)`. NaN or inf in `x` raise a `ValueError`, and a failed solve a
    [`SolverError`][cnftrace.SolverError]. Host data given to a
    [`StandardizedFlow`][cnftrace.StandardizedFlow] is standardised in float64.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, dim=2)
        x = jr.normal(jr.key(1), (250, 2))
        logp, nfe = cnftrace.log_prob_batched(flow, x, batch_size=100, return_nfe=True)
        print(logp.shape, nfe)  # (250,) and the evaluations per solve
        ```
    """
    batch_size = check_int("batch_size", batch_size)
    flow, x, log_det = standardize_on_host(flow, x)
    x, unbatched = validate_input(x, flow.event_shape, "x")
    if unbatched:
        raise ValueError(
            f"`x` must be a batch of samples, shape (n, *{flow.event_shape}); got "
            f"one sample of shape {flow.event_shape}: use `flow.log_prob` for it."
        )
    n = x.shape[0]
    context = check_context(context, flow.context_dim, n, broadcast=False, host=True)
    model = flow.with_estimator(Exact() if estimator is None else estimator)
    need_key(key, model.estimators())
    if not any(e.stochastic for e in model.estimators()):
        # The exact trace draws nothing: without the key, an evaluation with one
        # (fit's validation) and one without (the test set's) are one program.
        key = None
    # The model's arrays committed once; each chunk's then go to the same device.
    model = committed(model)
    values, nfes = [], []
    for i, start in enumerate(range(0, n, batch_size)):
        m = min(batch_size, n - start)
        rows = slice(start, start + m)
        if m < batch_size < n:
            # A shorter last chunk is filled up with its own rows repeated, so that
            # every chunk runs one compiled program. Under the exact trace the
            # repeats change neither the solve's steps (its error norm is a
            # maximum over the samples) nor the values kept; a stochastic
            # estimator draws its probes for the filled chunk.
            rows = start + np.arange(batch_size) % m
        chunk = x[rows]
        ctx = None if context is None else context[rows]
        k = None if key is None else jr.fold_in(key, i)
        lp, nfe, result = _log_prob_nfe_result(*committed((model, chunk, k, ctx)))
        if result != diffrax.RESULTS.successful:
            raise SolverError(
                f"the ODE solve failed on samples {start} to "
                f"{start + m - 1} of `x`: {diffrax.RESULTS[result]}"
            )
        values.append(np.asarray(lp)[:m])
        nfes.append(float(nfe))
    lp = np.concatenate(values)
    lp = lp + np.asarray(log_det, lp.dtype)
    return (lp, float(np.mean(nfes))) if return_nfe else lp


def evaluate_nll(
    flow: AbstractFlow,
    x: Float[Array, "n ..."],
    *,
    context: Float[Array, "n context"] | None = None,
    batch_size: int = EVAL_BATCH_SIZE,
    estimator: AbstractEstimator | None = None,
    key: Key | None = None,
) -> NLL:
    """The test negative log-likelihood of `x` (at least two samples) in nats, with
    its standard error, from the log-densities of
    [`log_prob_batched`][cnftrace.log_prob_batched], whose arguments it takes (a
    stochastic estimator's noise is then part of the standard error).

    **Returns:**

    An [`NLL`][cnftrace.NLL]: the mean NLL over `x`, its standard error, and the
    mean NFE per solve. A non-finite log-density raises `FloatingPointError`.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, dim=2)
        nll = cnftrace.evaluate_nll(flow, jr.normal(jr.key(1), (100, 2)))
        print(nll)  # e.g. "2.9 ± 0.1 nats"
        ```
    """
    shape = np.shape(x)  # not cast yet: a host array keeps its float64
    if len(shape) < 2 or shape[0] < 2:
        raise ValueError(
            f"`x` must be a batch of at least 2 samples; got shape {shape}."
        )
    lp, nfe = log_prob_batched(
        flow,
        x,
        batch_size=batch_size,
        context=context,
        estimator=estimator,
        key=key,
        return_nfe=True,
    )
    if not np.all(np.isfinite(lp)):
        raise FloatingPointError("the flow gave a non-finite log-density on `x`.")
    stderr = float(lp.std(ddof=1) / math.sqrt(lp.shape[0]))
    return NLL(mean=float(-lp.mean()), stderr=stderr, nfe=float(nfe))
