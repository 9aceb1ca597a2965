"""The checks of a probability-flow ODE's inputs: the model's output for one
sample, the truncation `eps` and the schedule over the integrated interval. Each
runs when the flow is built or traced, at no run-time cost."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._checks import is_number
from ._schedules import AbstractSchedule

# How many times of `[eps, t_end]` the schedule is checked at, ends included.
_GRID = 1025


def check_model_output(out, x, kind: str):
    """The model's output `out` for one sample `x`, checked when traced (at no
    run-time cost): an array of `x`'s shape and dtype."""
    shape = getattr(out, "shape", None)
    dtype = getattr(out, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"the {kind} model must return an array shaped like its input `x`; it "
            f"returned {type(out).__name__}."
        )
    if tuple(shape) != tuple(x.shape):
        raise ValueError(
            f"the {kind} model returned shape {tuple(shape)} for one sample of shape "
            f"{tuple(x.shape)}; it is called on one sample `x` and a scalar `t`, and "
            "must return an array of `x`'s shape. A model written for batches can be "
            "wrapped as `lambda t, x: net(t[None], x[None])[0]`."
        )
    if dtype != x.dtype:
        raise TypeError(
            f"the {kind} model returned dtype {dtype} for a sample of dtype "
            f"{x.dtype}; return the sample's dtype, e.g. "
            "`lambda t, x: net(t, x).astype(x.dtype)`, or give the flow data of the "
            "model's dtype."
        )
    return out


def check_eps(eps, length: float, kind: str) -> None:
    if not is_number(eps):
        raise TypeError(f"`eps` must be a number; got {eps!r}.")
    low_ok = eps >= 0 if kind == "velocity" else eps > 0
    if not (math.isfinite(eps) and low_ok and eps < length):
        interval = f"[0, {length:g})" if kind == "velocity" else f"(0, {length:g})"
        hint = (
            "0 integrates the whole interval"
            if kind == "velocity"
            else "score_sde uses 1e-5; the score diverges where sigma vanishes"
        )
        raise ValueError(
            f"`eps`, the truncation of the time interval at the data end, must lie "
            f"in {interval} for a {kind} model (the interval's length is "
            f"{length:g}); got {eps!r}. {hint[0].upper()}{hint[1:]}."
        )


def check_schedule(schedule: AbstractSchedule, kind: str, eps: float) -> None:
    """`sigma` (and for score and noise models `alpha`) finite and above the
    precision of their dtype on a grid of `[eps, t_end]`: the drift divides by
    them."""
    t_end = float(schedule.t_end)
    times = np.linspace(eps, t_end, _GRID)
    grid = jnp.asarray(times)
    names = ("sigma", "alpha") if kind in ("score", "noise") else ("sigma",)
    for name in names:
        values = jax.vmap(getattr(schedule, name))(grid)
        # Zero to the schedule's own precision counts as zero: cos(pi / 2) is 6e-17.
        tiny = float(jnp.finfo(values.dtype).eps)
        values = np.asarray(values, np.float64)
        bad = ~(np.isfinite(values) & (values > tiny))
        if not bad.any():
            continue
        i = int(np.flatnonzero(bad)[0])
        fix = (
            f"raise `eps` past it (the ODE starts at t = eps = {eps:g})"
            if name == "sigma"
            else "end the interval before it, with the schedule's `t_end`"
            + ("" if kind == "data" else ", or use a data-prediction model")
        )
        raise ValueError(
            f"the schedule's {name}(t) is {values[i]:g} (zero to its precision) at "
            f"t = {times[i]:.6g}, inside "
            f"the integrated interval [eps, t_end] = [{eps:g}, {t_end:g}]; the "
            f"probability-flow drift of a {kind} model divides by {name}(t), which "
            f"must stay positive there: {fix}."
        )


def check_model_shape(model, shape: tuple[int, ...], kind: str) -> None:
    """The model's output shape and dtype for one sample of the default float,
    checked without running it."""
    dtype = jnp.result_type(float)
    x = jax.ShapeDtypeStruct(shape, dtype)
    t = jax.ShapeDtypeStruct((), dtype)
    out = eqx.filter_eval_shape(model, t, x)
    check_model_output(out, x, kind)
