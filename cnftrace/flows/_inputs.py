"""The checks of what a flow's methods are given, made on the host before any
program runs where the values are concrete."""

import math
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from .._checks import check_key, check_precision, is_number
from ..estimators import AbstractEstimator


def tracing(tree) -> bool:
    """Whether any leaf of `tree` is being traced (by a caller's `jit`, `grad`, ...);
    data that is not is checked on the host, before any program."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def validate_input(x, event_shape: tuple[int, ...], name: str) -> tuple[Array, bool]:
    """Checks `x` and returns it with a batch axis, and whether one was added.

    NaN and inf in data are refused on the host, before any program runs. A value
    being traced (under the caller's `jit`, `grad`, ...) is checked by an
    `eqx.error_if` instead, which puts a host callback in the caller's program (and
    JAX's persistent cache stores no program with one)."""
    on_host = not tracing(x)
    if isinstance(x, (list, tuple)):
        x = jnp.asarray(x)
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"`{name}` must be an array; got {type(x).__name__}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` has dtype {x.dtype}; a flow needs floating-point input. Convert "
            f"it first, e.g. `{name}.astype(jnp.float32)` (dequantise integer data)."
        )
    check_precision(x.dtype, name)
    event_ndim = len(event_shape)
    shape = tuple(x.shape)
    if shape == event_shape:
        unbatched = True
    elif len(shape) == event_ndim + 1 and shape[1:] == event_shape:
        unbatched = False
    else:
        raise ValueError(
            f"`{name}` has shape {shape}, but this flow models samples of shape "
            f"{event_shape}: pass one sample of shape {event_shape} or a batch of "
            f"shape (n, {', '.join(map(str, event_shape))})."
        )
    if not unbatched and shape[0] == 0:
        raise ValueError(
            f"`{name}` is an empty batch (shape {shape}); pass at least one sample."
        )
    not_finite = (
        f"`{name}` contains NaN or inf; a density is only defined at finite points. "
        "Remove or impute those samples first."
    )
    if on_host and not _all_finite(x):
        raise ValueError(not_finite)
    x = jnp.asarray(x)
    x = x[None] if unbatched else x
    if not on_host:
        x = eqx.error_if(x, jnp.any(~jnp.isfinite(x)), not_finite)
    return x, unbatched


@jax.jit
def _all_finite_jit(x):
    return jnp.all(jnp.isfinite(x))


def _all_finite(x) -> bool:
    """Whether concrete `x` is all finite, checked where it lives: on the host for
    NumPy data and arrays in host memory, by a small program on an accelerator."""
    if isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices()):
        return bool(_all_finite_jit(x))
    return bool(np.isfinite(np.asarray(x)).all())


def need_key(key, estimators: Sequence[AbstractEstimator]) -> None:
    if key is None and any(e.stochastic for e in estimators):
        raise ValueError(
            "this flow uses a stochastic trace estimator (e.g. Hutchinson) and needs "
            "`key=jax.random.key(seed)`; or evaluate with the exact trace via "
            "`flow.with_estimator(cnftrace.Exact())`."
        )
    if key is not None:
        check_key("key", key)


def check_span(t0, t1) -> None:
    """`t0` and `t1` finite with `t1 > t0`, where they are numbers (or concrete
    scalar arrays); a traced span is checked when the flow is solved."""
    values = []
    for name, value in (("t0", t0), ("t1", t1)):
        if is_number(value):
            values.append(float(value))
            continue
        if isinstance(value, jax.core.Tracer):
            return
        if not isinstance(value, (jax.Array, np.ndarray)) or np.ndim(value) != 0:
            raise TypeError(f"`{name}` must be a number; got {value!r}.")
        values.append(float(value))
    t0, t1 = values
    if not (math.isfinite(t0) and math.isfinite(t1)):
        raise ValueError(f"the time span must be finite; got t0={t0}, t1={t1}.")
    if t1 <= t0:
        raise ValueError(f"need `t1 > t0`; got t0={t0}, t1={t1}.")
