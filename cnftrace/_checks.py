"""Argument checks shared across the package, each with one message.

Settings that fix array shapes (numbers of probes, steps, blocks) must be Python
integers: a JAX array there would become a tracer under `jit`. `bool` is a subclass of
`int` to Python, but `n=True` is surely a mistake, so it is refused too.
"""

import math
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array


def is_int(value) -> bool:
    """Whether `value` is a Python (or NumPy) integer and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
    """Whether `value` is a Python (or NumPy) real number and not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, bool
    )


def check_int(name: str, value, low: int = 1) -> int:
    """`value` as a Python `int`, or a `ValueError` naming `name` unless it is an
    int `>= low`. A NumPy integer is accepted and converted: passed on as it is, it
    would be an array to `jit` (a traced shape)."""
    if not is_int(value) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}; got {value!r}.")
    return int(value)


# The one rule for which strings are numbers, in data files and on the command
# line: ASCII digits with an optional sign, point and exponent, or inf, infinity and
# nan in any case; blanks around them aside. Python's `float` also takes `1_010.25`,
# full-width and other Unicode digits (`１２.５`), which a file or a flag holding them
# surely did not mean as numbers; NumPy's parser takes none of them.
_FLOAT = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)",
    re.IGNORECASE,
)
_INT = re.compile(r"[+-]?[0-9]+")


def parse_float(text: str) -> float | None:
    """The number `text` spells by the strict rule above, or `None` where it spells
    none (`"1_010.25"`, `"１２"`, `"0x1p3"`, `"12%"`)."""
    text = text.strip()
    return float(text) if _FLOAT.fullmatch(text) else None


def parse_int(text: str) -> int | None:
    """The integer `text` spells (ASCII digits, an optional sign, blanks around
    them aside), or `None`."""
    text = text.strip()
    return int(text) if _INT.fullmatch(text) else None


def check_activation(activation) -> None:
    """A `TypeError` unless `activation` is callable."""
    if not callable(activation):
        raise TypeError(
            "`activation` must be a function such as `jax.nn.silu`; got "
            f"{activation!r}."
        )


def check_key(name: str, key) -> None:
    """`key` is a JAX PRNG key: a typed key (`jax.random.key`) or the raw `uint32`
    data of one (`jax.random.PRNGKey`; JAX checks its shape)."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and (
        jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or dtype == np.uint32
    ):
        return
    got = f"an array of dtype {dtype}" if dtype is not None else repr(key)
    raise TypeError(
        f"`{name}` must be a JAX PRNG key, e.g. `jax.random.key(0)`; got {got}."
    )


def seed_key(seed: int) -> jax.Array:
    """The PRNG key of an integer seed of up to 64 bits (`-2**63 <= seed < 2**64`).

    `jax.random.key(seed)` keeps only the low 32 bits of a seed without 64-bit mode
    (so 0 and `2**32` would give one key): seeds in `[0, 2**32)` get that key, and
    any other seed the key of its low 32 bits with its high 32 bits folded in (as an
    unsigned 64-bit number), so that seeds differing anywhere give other keys."""
    if not is_int(seed) or not -(2**63) <= seed < 2**64:
        raise ValueError(f"a seed must be an integer of up to 64 bits; got {seed!r}.")
    value = int(seed) % 2**64
    low, high = value & 0xFFFFFFFF, value >> 32
    key = jax.random.key(np.uint32(low))
    return key if high == 0 else jax.random.fold_in(key, np.uint32(high))


def check_weight(name: str, value) -> None:
    """A `TypeError` unless `value` is a number, a `ValueError` unless it is finite
    and `>= 0`."""
    if not is_number(value):
        raise TypeError(f"`{name}` must be a number; got {value!r}.")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}` must be finite and >= 0; got {value!r}.")


def check_positive(name: str, value) -> None:
    """A `TypeError` unless `value` is a number, a `ValueError` unless it is finite
    and `> 0`."""
    if not is_number(value):
        raise TypeError(f"`{name}` must be a number; got {value!r}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be finite and > 0; got {value!r}.")


def check_context(
    context,
    context_dim: int | None,
    n: int,
    *,
    name: str = "context",
    unbatched: bool = False,
    broadcast: bool = True,
    host: bool = False,
) -> Array | None:
    """`context` as an array of shape `(n, context_dim)` (or `None` for a flow that
    is not conditional), or a clear error.

    - `broadcast`: a single row of shape `(context_dim,)` stands for every sample.
    - `unbatched`: the call is for one sample, so only that single row is accepted.
    - `host`: `context` is data on the host (training or test contexts); a NaN or
        inf raises a `ValueError` at once. Otherwise the check is an `eqx.error_if`,
        which also works under `jit`.

    A `jax.ShapeDtypeStruct` (what a data function returns under `jax.eval_shape`)
    has its dtype and shape checked, and is returned as it is.
    """
    if context_dim is None:
        if context is not None:
            raise ValueError(
                f"this flow is not conditional, so it takes no `{name}`; build its "
                "blocks with `context_dim=...` (and a vector field that takes the "
                "context as its `args`) to condition on one."
            )
        return None
    if context is None:
        rows = f"(n, {context_dim}) with one row per sample"
        want = f"({context_dim},) for all samples, or {rows}" if broadcast else rows
        raise ValueError(
            f"this flow is conditional (context_dim={context_dim}) and needs "
            f"`{name}`: an array of shape {want}."
        )
    shapes_only = isinstance(context, jax.ShapeDtypeStruct)
    if not shapes_only:
        context = np.asarray(context) if host else jnp.asarray(context)
    if not jnp.issubdtype(context.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` has dtype {context.dtype}; a context must be floating point "
            "(one-hot encode labels, e.g. `jax.nn.one_hot(labels, num_classes)`)."
        )
    if shapes_only:
        broadcast = False
    if broadcast and context.shape == (context_dim,):
        context = jnp.broadcast_to(context, (n, context_dim))
    elif unbatched or context.shape != (n, context_dim):
        want = f"({n}, {context_dim})"
        if broadcast:
            want = f"({context_dim},)" + ("" if unbatched else f" or {want}")
        raise ValueError(
            f"`{name}` has shape {context.shape}; this call needs shape {want}, one "
            "row per sample."
        )
    if shapes_only:
        return context
    if host:
        if not np.isfinite(context).all():
            raise ValueError(f"`{name}` contains NaN or inf; pass finite contexts.")
        return jnp.asarray(context)
    return eqx.error_if(
        context,
        jnp.any(~jnp.isfinite(context)),
        f"`{name}` contains NaN or inf; pass finite contexts.",
    )


def check_precision(dtype, name: str, fix: str | None = None) -> None:
    """A `TypeError` for floating dtypes narrower than float32 (float16, bfloat16):
    the adaptive solver's error control and the log-density need at least float32.
    `fix`: what to do instead (a cast of `name` by default)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        fix = fix or f"convert it first, e.g. `{name}.astype(jnp.float32)`"
        raise TypeError(
            f"`{name}` is {dtype}, which cnftrace does not support: the adaptive ODE "
            f"solver's error control and the log-density need float32 or float64; "
            f"{fix}."
        )


def check_event_shape(shape, name: str, event_shape: tuple[int, ...]) -> None:
    """A clear error unless samples of shape `shape` are those the flow models."""
    if tuple(shape) != tuple(event_shape):
        raise ValueError(
            f"`{name}` holds samples of shape {tuple(shape)}, but the flow models "
            f"samples of shape {tuple(event_shape)}."
        )


def check_samples(data, name: str, event_shape: tuple[int, ...] | None) -> Array:
    """`data` as an array of finite floating samples of shape `(n, *event_shape)`
    (any event shape if `None`), or a clear error. Checked on the host. A
    `jax.ShapeDtypeStruct` has its shape and dtype checked, and is returned as it
    is."""
    shapes_only = isinstance(data, jax.ShapeDtypeStruct)
    if not shapes_only:
        data = np.asarray(data)
    if data.ndim < 2 or data.shape[0] < 1:
        raise ValueError(
            f"`{name}` must be an array of samples of shape (n, *event) or a function "
            f"`(key, batch_size) -> batch`; got an array of shape {data.shape}."
        )
    if event_shape is not None:
        check_event_shape(data.shape[1:], name, event_shape)
    if not jnp.issubdtype(data.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` has dtype {data.dtype}; convert it to floating point first "
            "(dequantise integer data)."
        )
    check_precision(data.dtype, name)
    if shapes_only:
        return data
    bad = ~np.isfinite(data.reshape(data.shape[0], -1)).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(
            f"`{name}` has {rows.size} sample(s) with NaN or inf (first at index "
            f"{rows[0]}); remove or impute them before training."
        )
    return jnp.asarray(data)


# XLA indexes an array's elements with 32-bit integers: a program making an array of
# more elements aborts the process (`flow.sample(key, 2**30)` of a 2-D flow did).
MAX_ELEMENTS = 2**31 - 1


def memory_limit() -> tuple[int, str]:
    """The bytes one device can hold, and what they are: the accelerator's memory
    where JAX reports it, else the machine's."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{jax.devices()[0].device_kind} memory"
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * page, "this machine's memory"


def check_solve_fits(name: str, n: int, event_size: int, dtype, fix: str) -> None:
    """A `ValueError` naming `name` where one ODE solve over `n` samples of
    `event_size` numbers cannot run: an array of more than `MAX_ELEMENTS` numbers
    (XLA would abort the process), or more than the device's memory for the ten
    arrays of that size a solve keeps at least (the state, the solver's stages,
    the error estimate). `fix`: what to do instead."""
    numbers = n * event_size
    if numbers > MAX_ELEMENTS:
        raise ValueError(
            f"{name} = {n} samples of {event_size} numbers make arrays of {numbers} "
            f"numbers, more than the {MAX_ELEMENTS} (2**31 - 1) an XLA program can "
            f"index; {fix}."
        )
    need = 10 * numbers * jnp.dtype(dtype).itemsize
    limit, what = memory_limit()
    if need > limit:
        raise ValueError(
            f"{name} = {n} samples of {event_size} numbers cannot fit: a solve over "
            f"them needs at least {need / 2**30:.3g} GiB, more than the "
            f"{limit / 2**30:.3g} GiB of {what}; {fix}."
        )
