"""Importance weights of a flow's samples toward an unnormalised target, and what
they say: the effective sample size, the Pareto-smoothed k-hat of their tail, the
target's normaliser `log Z` with its standard error, and reweighted expectations.
The weights use the exact trace by default: a stochastic `log q` biases `Z` upwards."""

import math
import warnings
from collections.abc import Callable

import diffrax
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_int, check_key
from .._custom_types import Key
from .._defaults import EVAL_BATCH_SIZE
from .._placement import committed
from ..estimators import AbstractEstimator, Exact
from ..estimators._base import check_estimator
from ..flows import AbstractFlow, SolverError
from ..flows._inputs import need_key
from ._target import LogDensity, check_log_target

# Above this k-hat importance sampling is unreliable (Vehtari et al. 2024, sec. 3).
KHAT_LIMIT = 0.7


def _logsumexp(a: np.ndarray) -> float:
    top = np.max(a)
    if not np.isfinite(top):
        return float(top)
    return float(top + np.log(np.sum(np.exp(a - top))))


def _gpd_fit(tail: np.ndarray) -> float:
    """The generalised Pareto shape `k` of the sorted positive exceedances `tail`
    (Zhang and Stephens 2009, shrunk towards 0.5 as in PSIS)."""
    m = tail.size
    grid = 30 + int(math.sqrt(m))
    j = np.arange(1, grid + 1, dtype=np.float64)
    quartile = tail[int(m / 4 + 0.5) - 1]
    theta = 1 / tail[-1] + (1 - np.sqrt(grid / (j - 0.5))) / (3 * quartile)
    k = np.mean(np.log1p(-theta[:, None] * tail[None, :]), axis=1)
    profile = m * (np.log(-theta / k) - k - 1)
    # Each grid point's posterior weight, 1 / sum_i exp(profile_i - profile_j).
    weights = 1 / np.sum(np.exp(profile[None, :] - profile[:, None]), axis=1)
    keep = weights >= 10 * np.finfo(np.float64).eps
    weights = weights[keep] / np.sum(weights[keep])
    theta_hat = np.sum(theta[keep] * weights)
    k_hat = float(np.mean(np.log1p(-theta_hat * tail)))
    return (m * k_hat + 10 * 0.5) / (m + 10)


def pareto_khat(log_weights) -> float:
    """The Pareto-smoothed importance sampling diagnostic k-hat of log importance
    weights (Vehtari et al. 2024): the generalised Pareto shape of the largest
    `min(n / 5, 3 sqrt(n))` weights; above 0.7 the weights are unreliable.

    **Arguments:**

    - `log_weights`: shape `(n,)`; non-finite values are not allowed.

    **Returns:**

    k-hat, a float (`inf` when the tail is too short to fit, under 5 weights).

    !!! example

        ```python
        heavy = jr.pareto(jr.key(0), 2.0, (10_000,))  # a tail index of 2: k = 0.5
        print(cnftrace.pareto_khat(jnp.log(heavy)))
        ```
    """
    lw = np.asarray(log_weights, np.float64).reshape(-1)
    if not np.isfinite(lw).all():
        raise ValueError(
            "`log_weights` must be finite to fit their tail; drop or explain the "
            f"{int(np.sum(~np.isfinite(lw)))} that are not."
        )
    n = lw.size
    tail_size = int(math.ceil(min(0.2 * n, 3 * math.sqrt(n))))
    if tail_size < 5 or n <= tail_size:
        return math.inf
    lw = lw - lw.max()
    order = np.sort(lw)
    cutoff = order[-tail_size - 1]
    tail = np.exp(order[-tail_size:]) - math.exp(cutoff)
    if not np.all(tail > 0):  # ties at the cutoff
        tail = tail[tail > 0]
        if tail.size < 5:
            return math.inf
    return _gpd_fit(tail)


class ImportanceWeights(eqx.Module):
    """Importance weights `log w = log_target - log q` of samples from a flow `q`
    toward an unnormalised target, and their diagnostics (host, float64), as
    [`importance_weights`][cnftrace.importance_weights] returns them. Non-finite
    weights are counted and warned about, never dropped.

    **Arguments and fields:**

    - `log_q`: the flow's log-density of each sample, shape `(n,)`.
    - `log_target`: the target's unnormalised log-density of each sample.
    - `samples`: the samples, or `None`.
    - `warn` (an argument only): warn when some weights are not finite.

    !!! example

        ```python
        log_q = jnp.array([-1.0, -1.2, -0.9, -1.1, -1.0])
        weights = cnftrace.ImportanceWeights(log_q, log_q + 0.5)  # p~ = e^0.5 q
        print(weights.log_z, weights.ess_fraction)  # 0.5 and 1.0
        mean, stderr = weights.expectation(jnp.arange(5.0))
        ```
    """

    log_q: np.ndarray
    log_target: np.ndarray
    samples: np.ndarray | None = None

    def __init__(self, log_q, log_target, samples=None, *, warn: bool = True):
        log_q = np.asarray(log_q, np.float64)
        log_target = np.asarray(log_target, np.float64)
        if log_q.ndim != 1 or log_target.shape != log_q.shape or log_q.size < 2:
            raise ValueError(
                "`log_q` and `log_target` must have one value per sample, the same "
                f"shape (n,) with n >= 2; got {log_q.shape} and {log_target.shape}."
            )
        if samples is not None:
            samples = np.asarray(samples)
            if samples.shape[:1] != log_q.shape:
                raise ValueError(
                    f"`samples` must have {log_q.size} rows, one per weight; got "
                    f"shape {samples.shape}."
                )
        self.log_q = log_q
        self.log_target = log_target
        self.samples = samples
        if warn and self.nonfinite:
            warnings.warn(self._nonfinite_message(), RuntimeWarning, stacklevel=2)

    def _nonfinite_message(self) -> str:
        t, q = self.log_target, self.log_q
        parts = [
            f"{int(np.sum(np.isnan(t)))} NaN",
            f"{int(np.sum(t == np.inf))} +inf",
            f"{int(np.sum(t == -np.inf))} -inf",
        ]
        message = (
            f"{self.nonfinite} of {self.n} samples have a log-weight that is not "
            f"finite (log_target: {', '.join(parts)}; log_q not finite: "
            f"{int(np.sum(~np.isfinite(q)))}). They are kept: -inf is a weight of "
            "zero, a NaN or +inf makes the estimates NaN."
        )
        bad = np.flatnonzero(~np.isfinite(self.log_weights))
        return message + f" First at index {bad[0]}."

    @property
    def n(self) -> int:
        """The number of samples."""
        return int(self.log_q.size)

    @property
    def log_weights(self) -> np.ndarray:
        """`log_target - log_q` per sample (float64)."""
        with np.errstate(invalid="ignore"):
            return self.log_target - self.log_q

    @property
    def nonfinite(self) -> int:
        """How many samples have a log-weight that is NaN or infinite."""
        return int(np.sum(~np.isfinite(self.log_weights)))

    def _usable(self) -> bool:
        lw = self.log_weights
        return not (np.isnan(lw).any() or (lw == np.inf).any())

    def normalized(self) -> np.ndarray:
        """The self-normalised weights `w / sum(w)` (NaN if any weight is NaN or
        infinite)."""
        if not self._usable():
            return np.full(self.n, np.nan)
        lw = self.log_weights
        return np.exp(lw - _logsumexp(lw))

    @property
    def ess(self) -> float:
        """Kish's effective sample size `(sum w)^2 / sum w^2`."""
        if not self._usable():
            return math.nan
        lw = self.log_weights
        return float(math.exp(2 * _logsumexp(lw) - _logsumexp(2 * lw)))

    @property
    def ess_fraction(self) -> float:
        """`ess / n`: 1 when every weight is equal."""
        return self.ess / self.n

    @property
    def log_z(self) -> float:
        """`log mean(w)`, the estimate of the target's log-normaliser."""
        if not self._usable():
            return math.nan
        return _logsumexp(self.log_weights) - math.log(self.n)

    @property
    def log_z_stderr(self) -> float:
        """The delta-method standard error of `log_z`, `sqrt(1/ess - 1/n)`."""
        ess = self.ess
        return math.sqrt(max(1 / ess - 1 / self.n, 0.0)) if ess == ess else math.nan

    @property
    def elbo(self) -> float:
        """`mean(log w)`, a lower bound on `log Z` (the gap is the reverse KL)."""
        if not self._usable():
            return math.nan
        return float(np.mean(self.log_weights))

    @property
    def pareto_k(self) -> float:
        """The Pareto-smoothed k-hat of the weights (see `pareto_khat`)."""
        lw = self.log_weights
        if not self._usable():
            return math.nan
        finite = lw[np.isfinite(lw)]  # -inf: weights of zero, no part of the tail
        return pareto_khat(finite) if finite.size >= 2 else math.inf

    @property
    def reliable(self) -> bool:
        """Whether `pareto_k < 0.7`."""
        return bool(self.pareto_k < KHAT_LIMIT)

    def expectation(
        self, values: Float[Array, "n ..."] | Callable
    ) -> tuple[np.ndarray, np.ndarray]:
        """The self-normalised importance-sampling estimate of `E_p[f]` and its
        standard error (delta method, `sqrt(sum wbar^2 (f - mean)^2)`).

        **Arguments:**

        - `values`: `f` of each sample, shape `(n, ...)`, or a function applied to
            `samples` (then the weights must hold them).

        **Returns:**

        `(mean, stderr)`, each of shape `values.shape[1:]`.
        """
        if callable(values):
            if self.samples is None:
                raise ValueError(
                    "`values` is a function, but these weights hold no samples; "
                    "pass its values on the samples, shape (n, ...), instead."
                )
            values = values(self.samples)
        values = np.asarray(values, np.float64)
        if values.shape[:1] != (self.n,):
            raise ValueError(
                f"`values` must have one row per sample, ({self.n}, ...); got shape "
                f"{values.shape}."
            )
        w = self.normalized().reshape((self.n,) + (1,) * (values.ndim - 1))
        mean = np.sum(w * values, axis=0)
        stderr = np.sqrt(np.sum(w**2 * (values - mean) ** 2, axis=0))
        return mean, stderr

    def summary(self) -> dict[str, float | int]:
        """The diagnostics as a dict of plain numbers (for a JSON file)."""
        return {
            "n": self.n,
            "ess": self.ess,
            "ess_fraction": self.ess_fraction,
            "log_z": self.log_z,
            "log_z_stderr": self.log_z_stderr,
            "elbo": self.elbo,
            "pareto_k": self.pareto_k,
            "nonfinite": self.nonfinite,
        }

    def __str__(self) -> str:
        return (
            f"ESS {self.ess:.0f} of {self.n} ({100 * self.ess_fraction:.1f}%), "
            f"log Z {self.log_z:.4f} ± {self.log_z_stderr:.4f}, "
            f"k-hat {self.pareto_k:.2f}"
            + (f", {self.nonfinite} non-finite" if self.nonfinite else "")
        )


@eqx.filter_jit
def _weights_chunk(model: AbstractFlow, log_target, key, n: int, dtype):
    """`n` samples of `model`, their `log q`, `log_target`, evaluations and result."""
    base_key, probe_key = jr.split(key)
    z = model.base.sample(base_key, n, dtype=dtype)
    x, log_det, stats, _ = model.transform(z, inverse=True, log_det=True, key=probe_key)
    log_q = model.base.log_prob(z) - log_det
    return x, log_q, log_target(x), stats.total_nfe, stats.first_failure()


def importance_weights(
    flow: AbstractFlow,
    log_target: LogDensity,
    n: int,
    *,
    key: Key,
    batch_size: int = EVAL_BATCH_SIZE,
    estimator: AbstractEstimator | None = None,
    dtype=None,
    keep_samples: bool = True,
) -> ImportanceWeights:
    """Draws `n` samples from `flow` with their exact log-density and weighs them
    toward the unnormalised target `log_target`, `batch_size` at a time.

    **Arguments:**

    - `flow`: a flow that is not conditional.
    - `log_target`: the target's unnormalised log-density, a JAX function from a
        batch `(m, *event_shape)` to `(m,)` (checked on abstract values first).
    - `n`: how many samples.
    - `key`: the PRNG key; chunk `i` uses `jax.random.fold_in(key, i)`.
    - `batch_size`: samples per solve; bounds the memory.
    - `estimator`: the trace estimator for `log q`, [`Exact`][cnftrace.Exact] by
        default (a stochastic one biases the log-normaliser upwards).
    - `dtype`: the samples' dtype (JAX's default float if omitted).
    - `keep_samples`: keep the samples in the result (for
        [`expectation`][cnftrace.ImportanceWeights.expectation] of a function).

    **Returns:**

    An [`ImportanceWeights`][cnftrace.ImportanceWeights]. A failed solve raises a
    [`SolverError`][cnftrace.SolverError]; non-finite target values are counted and
    reported, not dropped.

    !!! example

        ```python
        def log_target(x):  # 3 N(0, I): log Z = log 3
            return jnp.log(3.0) - 0.5 * jnp.sum(x**2, axis=1) - jnp.log(2 * jnp.pi)

        field = cnftrace.MLPField(2, width=8, depth=1, zero_last=True, key=jr.key(0))
        flow = cnftrace.CNF(field, 2)  # the identity map: q = N(0, I)
        weights = cnftrace.importance_weights(flow, log_target, 500, key=jr.key(1))
        print(weights)  # ESS 500 of 500 (100.0%), log Z 1.0986 ...
        ```
    """
    if not isinstance(flow, AbstractFlow):
        raise TypeError(f"`flow` must be a cnftrace flow; got {type(flow).__name__}.")
    if flow.context_dim is not None:
        raise ValueError(
            "`importance_weights` weighs the samples of a flow that is not "
            f"conditional; this one takes a context (context_dim={flow.context_dim})."
        )
    check_int("n", n, 2)
    check_int("batch_size", batch_size)
    check_key("key", key)
    check_log_target(log_target, flow.event_shape, gradient=False, name="log_target")
    estimator = Exact() if estimator is None else estimator
    check_estimator(estimator)
    model = flow.with_estimator(estimator)
    need_key(key, model.estimators())
    dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
    # The model's and the target's arrays committed once; each chunk's key then goes
    # to the same device.
    model, log_target = committed((model, log_target))
    parts: dict[str, list] = {"x": [], "log_q": [], "log_p": []}
    for i, start in enumerate(range(0, n, batch_size)):
        size = min(batch_size, n - start)
        arrays = committed((model, log_target, jr.fold_in(key, i)))
        x, log_q, log_p, _, result = _weights_chunk(*arrays, size, dtype)
        if result != diffrax.RESULTS.successful:
            raise SolverError(
                f"the ODE solve failed drawing samples {start} to {start + size - 1}: "
                f"{diffrax.RESULTS[result]}"
            )
        if keep_samples:
            parts["x"].append(np.asarray(x))
        parts["log_q"].append(np.asarray(log_q))
        parts["log_p"].append(np.asarray(log_p))
    samples = np.concatenate(parts["x"]) if keep_samples else None
    weights = ImportanceWeights(
        np.concatenate(parts["log_q"]),
        np.concatenate(parts["log_p"]),
        samples,
        warn=False,
    )
    if weights.nonfinite:
        warnings.warn(weights._nonfinite_message(), RuntimeWarning, stacklevel=2)
    return weights
