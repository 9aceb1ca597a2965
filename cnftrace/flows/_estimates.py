"""What a likelihood estimate reports, and the arithmetic of bits per dimension
(`dequantized_bits`, the one place where dequantisation and scaling count) with the
checks of [`ProbabilityFlow.bits_per_dim`][cnftrace.ProbabilityFlow.bits_per_dim]'s
arguments."""

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._checks import check_positive, is_number
from ..estimators import AbstractEstimator, Exact, Hutchinson, HutchPlusPlus, XTrace
from ._inputs import tracing


class LikelihoodEstimate(eqx.Module):
    """Per-sample likelihoods from [`ProbabilityFlow`][cnftrace.ProbabilityFlow]'s
    [`log_prob_estimate`][cnftrace.ProbabilityFlow.log_prob_estimate] (nats) or
    [`bits_per_dim`][cnftrace.ProbabilityFlow.bits_per_dim] (bits per dimension),
    with their Monte Carlo standard errors.

    **Fields:**

    - `values`: one estimate per sample, shape `(n,)`: the mean over the `repeats`.
    - `stderr`: each sample's Monte Carlo standard error (from the trace
        estimator's probes and the dequantisation noise), `std / sqrt(repeats)` over
        the repeats: 0 where nothing is random, NaN where something is but
        `repeats = 1` (one draw cannot measure its own spread).
    - `nfe`: the vector-field evaluations of the one solve (every sample and repeat
        in one batch).
    - `matvecs`: Jacobian-vector products per sample per evaluation (the state's
        size for [`Exact`][cnftrace.Exact], the probes of
        [`Hutchinson`][cnftrace.Hutchinson], the budget of Hutch++ and XTrace;
        `-1` for an estimator of another kind). The cost per sample is about
        `nfe * matvecs * repeats` products.
    - `unit`: `"nats"` (log-densities) or `"bits/dim"`.
    - `repeats`: how many independent estimates were averaged per sample.

    !!! example

        ```python
        pf = cnftrace.ProbabilityFlow(
            lambda t, x: -x, 2, kind="score", schedule=cnftrace.VPSchedule(),
            estimator=cnftrace.Hutchinson(),
        )
        est = pf.log_prob_estimate(jnp.zeros((3, 2)), key=jr.key(0), repeats=4)
        print(est.values, est.stderr)      # about -1.8379 each: log N(0; 0, I)
        print(est.mean, est.mean_stderr, est.monte_carlo_stderr)
        ```
    """

    values: Float[Array, " n"]
    stderr: Float[Array, " n"]
    nfe: Int[Array, ""]
    matvecs: int = eqx.field(static=True)
    unit: str = eqx.field(static=True)
    repeats: int = eqx.field(static=True)

    @property
    def mean(self) -> Float[Array, ""]:
        """The mean of `values` over the samples."""
        return jnp.mean(self.values)

    @property
    def mean_stderr(self) -> Float[Array, ""]:
        """The standard error of `mean` from the samples' spread,
        `std(values) / sqrt(n)`: the error bar of a test set's figure as an estimate
        of the data distribution's (the Monte Carlo noise included); NaN for one
        sample."""
        n = self.values.shape[0]
        if n < 2:
            return jnp.full((), jnp.nan, self.values.dtype)
        return jnp.std(self.values, ddof=1) / math.sqrt(n)

    @property
    def monte_carlo_stderr(self) -> Float[Array, ""]:
        """The part of `mean`'s standard error that the Monte Carlo noise makes,
        `sqrt(sum stderr^2) / n`: how far `mean` may be from the exact trace's
        (and, with dequantisation, the expected) figure on these very samples."""
        n = self.values.shape[0]
        return jnp.sqrt(jnp.sum(self.stderr**2)) / n


def dequantized_bits(
    log_prob_model: Float[Array, "..."], size: int, bin_width_model
) -> Float[Array, "..."]:
    """Bits per dimension of a bin from the model's log-density at a dequantised
    point of it: `-(log p_y + D log w) / (D log 2)`, `w` the bin's width in the
    model's units (the data's bin width times the scaling to the model's range) and
    `D = size`. The one place where the dequantisation and the scaling count."""
    log_volume = size * jnp.log(jnp.asarray(bin_width_model, log_prob_model.dtype))
    return -(log_prob_model + log_volume) / (size * math.log(2))


def make_estimate(values, stats, flow, unit, repeats, stochastic) -> LikelihoodEstimate:
    """The mean over the repeats (axis 0 of `values`) and its standard error."""
    if repeats > 1:
        stderr = jnp.std(values, axis=0, ddof=1) / math.sqrt(repeats)
    else:
        stderr = jnp.full(values.shape[1:], jnp.nan if stochastic else 0.0)
    return LikelihoodEstimate(
        values=jnp.mean(values, axis=0),
        stderr=stderr.astype(values.dtype),
        nfe=stats.total_nfe,
        matvecs=_matvecs(flow.blocks[0].estimator, math.prod(flow.event_shape)),
        unit=unit,
        repeats=repeats,
    )


def _matvecs(estimator: AbstractEstimator, size: int) -> int:
    if isinstance(estimator, Exact):
        return size
    if isinstance(estimator, Hutchinson):
        return estimator.num_probes
    if isinstance(estimator, (HutchPlusPlus, XTrace)):
        return estimator.num_matvecs
    return -1


def data_scaling(x, bin_width, data_range, model_range, dequantize):
    """`(d_lo, a, a * bin_width)` of `bits_per_dim`'s arguments, after checking
    them."""
    dtype = getattr(x, "dtype", None)
    integer = dtype is not None and jnp.issubdtype(dtype, jnp.integer)
    if bin_width is None:
        what = f"integers ({dtype})" if integer else "values"
        raise ValueError(
            f"`x` holds {what} without their `bin_width`: bits per dimension are "
            "those of discrete data, whose bins must be known. Pass the spacing of "
            "the values, e.g. `bin_width=1` for 8-bit integers 0..255 (with "
            "`data_range=(0, 256)`), or `bin_width=1/255` for them divided by 255."
        )
    check_positive("bin_width", bin_width)
    if not isinstance(dequantize, bool):
        raise TypeError(f"`dequantize` must be a bool; got {dequantize!r}.")
    if data_range is None:
        if model_range is not None:
            raise ValueError(
                "`model_range` says where `data_range`'s ends land in the model's "
                "units: pass `data_range` too, e.g. `data_range=(0, 256), "
                "model_range=(-1, 1)` for 8-bit images."
            )
        return 0.0, 1.0, float(bin_width)
    low, high = _pair("data_range", data_range)
    if high - low < bin_width:
        raise ValueError(
            f"`data_range` {data_range} is narrower than one bin of width "
            f"{bin_width}: it is the interval the bins cover, e.g. (0, 256) for "
            "8-bit integers."
        )
    m_lo, m_hi = (
        (low, high) if model_range is None else _pair("model_range", model_range)
    )
    scale = (m_hi - m_lo) / (high - low)
    return low, scale, scale * bin_width


def _pair(name, value) -> tuple[float, float]:
    if not (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(is_number(v) and math.isfinite(v) for v in value)
        and value[0] < value[1]
    ):
        raise ValueError(
            f"`{name}` must be a pair of finite numbers `(low, high)` with "
            f"low < high; got {value!r}."
        )
    return float(value[0]), float(value[1])


def check_in_range(x, data_range):
    """`x`, after a check that its values lie in `data_range`: on the host for
    concrete data, by a runtime error inside a caller's transformation."""
    low, high = data_range
    # A little slack for values computed in floating point (k / 255, say).
    slack = 1e-6 * (high - low)
    message = (
        f"`x` has values outside the declared `data_range` {tuple(data_range)}: "
        "check that `x` is in the data's own units (not already scaled to the "
        "model's range) and that `data_range` covers its values."
    )
    if tracing(x):
        bad = jnp.any((x < low - slack) | (x > high + slack))
        return eqx.error_if(x, bad, message)
    values = np.asarray(x)
    if values.min() < low - slack or values.max() > high + slack:
        lo, hi = float(values.min()), float(values.max())
        raise ValueError(f"{message} Its values run from {lo:g} to {hi:g}.")
    return x
