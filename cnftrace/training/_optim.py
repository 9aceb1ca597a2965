"""The optimiser of `fit` and the command line: Adam on a warmup-cosine schedule
(over the run's steps, or over its time budget), gradients clipped."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array

from .._checks import check_int
from .._defaults import CLIP, CONSTANT_LR, LR, LR_END_DIVISOR, WARMUP
from ..flows import AbstractBase
from ._budget import scale_by_budget


def default_optimizer(
    steps: int | None, seconds: float | None = None
) -> optax.GradientTransformation:
    """The optimiser of `fit` and `Trainer` when none is given:
    [`budget_cosine_adam`][cnftrace.budget_cosine_adam] with a time budget
    `seconds`, [`warmup_cosine_adam`][cnftrace.warmup_cosine_adam] over `steps`
    where the length is known, else a constant Adam (docs/quality.md says why)."""
    if seconds is not None:
        return budget_cosine_adam(LR)
    if steps is None:
        return _constant_adam(CONSTANT_LR)
    return warmup_cosine_adam(steps, LR)


def warmup_cosine_adam(
    steps: int,
    lr: float,
    *,
    warmup: int | None = None,
    end_factor: float | None = None,
    clip: float | None = CLIP,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """Adam (AdamW with `weight_decay`) on a schedule: a linear warmup from 0 to
    `lr`, then a cosine decay to `end_factor * lr` (`lr / 20` by default) at step
    `steps`, held there after; the gradient's global norm clipped at `clip` first
    (`None`: no clipping). The warmup and the horizon are held in the optimiser's
    state, not in the compiled program, so that runs of different lengths share
    their compiled step; the same arguments give the same optimiser object.

    **Arguments:**

    - `steps`: the schedule's horizon, usually the number of training steps.
    - `lr`: the peak learning rate.
    - `warmup`: warmup steps; `min(50, max(1, steps // 4))` by default.
    - `end_factor`, `clip`, `weight_decay`: as above. Weight decay pulls the
        vector fields' weights towards zero; a base distribution's parameters (a
        mixture's means, a Student-t's degrees of freedom) are never decayed.

    !!! example

        ```python
        optimizer = cnftrace.warmup_cosine_adam(2400, 2e-3)
        # cnftrace.fit(flow, data, key=key, steps=2400, optimizer=optimizer)
        ```
    """
    steps = check_int("steps", steps)
    warmup = min(WARMUP, max(1, steps // 4)) if warmup is None else warmup
    warmup = check_int("warmup", warmup, low=0)
    horizon = max(steps, 2)
    if warmup >= horizon:
        raise ValueError(
            f"`warmup` ({warmup}) must be shorter than the schedule's {horizon} "
            "steps: pass fewer warmup steps, or more `steps`."
        )
    end = lr / LR_END_DIVISOR if end_factor is None else lr * end_factor
    return _shared(_horizon_adam, lr, warmup, horizon, end, clip, weight_decay)


class HorizonState(NamedTuple):
    """The state of `warmup_cosine_adam`'s schedule: the steps taken, and the
    warmup and the horizon as arrays rather than constants of the program, so
    that runs of different lengths share one compiled step."""

    count: Array
    warmup: Array
    horizon: Array


def horizon_rate(count, warmup, horizon, lr: float, end: float):
    """optax's `warmup_cosine_decay_schedule(0, lr, warmup, horizon, end)` at step
    `count`, with `warmup` and `horizon` given as integer arrays: a linear warmup
    from 0 to `lr` over `warmup` steps, then a cosine decay to `end` at step
    `horizon`, held there after."""
    dtype = jnp.result_type(float)  # float64 where x64 is on, not int32's float32
    done = jnp.clip(count, 0, warmup).astype(dtype)
    rising = -lr * (1 - done / jnp.maximum(warmup, 1).astype(dtype)) + lr
    decay = (horizon - warmup).astype(dtype)
    since = jnp.minimum(count - warmup, decay)
    cosine = 0.5 * (1 + jnp.cos(jnp.pi * since / decay))
    alpha = end / lr if lr else 0.0
    falling = lr * ((1 - alpha) * cosine + alpha)
    return jnp.where(count < warmup, rising, falling)


def scale_by_horizon(
    lr: float, warmup: int, horizon: int, end: float
) -> optax.GradientTransformation:
    """Updates scaled by `-horizon_rate(...)` at the step count its state holds."""

    def init(params):
        del params
        as_array = functools.partial(jnp.asarray, dtype=jnp.int32)
        return HorizonState(as_array(0), as_array(warmup), as_array(horizon))

    def update(updates, state, params=None):
        del params
        rate = -horizon_rate(state.count, state.warmup, state.horizon, lr, end)
        updates = jax.tree_util.tree_map(lambda u: rate.astype(u.dtype) * u, updates)
        return updates, state._replace(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def budget_cosine_adam(
    lr: float,
    *,
    warmup: int = WARMUP,
    end_factor: float | None = None,
    clip: float | None = CLIP,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """[`warmup_cosine_adam`][cnftrace.warmup_cosine_adam] over a time budget rather
    than a number of steps: the optimiser of [`fit`][cnftrace.fit]`(...,
    seconds=...)`. The rate is the lower of a linear warmup over `warmup` steps and
    a cosine decay from `lr` to `end_factor * lr` (`lr / 20` by default) as the
    budget is spent; `fit` writes the share spent into the optimiser's state before
    each step, and records each step's rate (`lr`).

    **Arguments:** as for `warmup_cosine_adam`, less the horizon.

    !!! example

        ```python
        optimizer = cnftrace.budget_cosine_adam(2e-3)
        # cnftrace.fit(flow, data, key=key, seconds=600, optimizer=optimizer)
        ```
    """
    warmup = check_int("warmup", warmup)
    end = lr / LR_END_DIVISOR if end_factor is None else lr * end_factor
    return _shared(_budget_adam, lr, warmup, end, clip, weight_decay)


def _shared(build, *settings) -> optax.GradientTransformation:
    """`build(*settings)`, the same object for the same settings: an optimiser is
    part of what `fit`'s compiled step is keyed on, and two objects of the same
    settings would have their steps traced and compiled twice (settings that are
    not hashable, such as an array, get an optimiser of their own)."""
    try:
        hash(settings)
    except TypeError:
        return build.__wrapped__(*settings)
    return build(*settings)


@functools.lru_cache(maxsize=64)
def _horizon_adam(lr, warmup, horizon, end, clip, weight_decay):
    return _adam_on(scale_by_horizon(lr, warmup, horizon, end), clip, weight_decay)


@functools.lru_cache(maxsize=64)
def _budget_adam(lr, warmup, end, clip, weight_decay):
    return _adam_on(scale_by_budget(lr, warmup, end), clip, weight_decay)


@functools.lru_cache(maxsize=8)
def _constant_adam(lr):
    return optax.adam(lr)


def _adam_on(
    schedule: optax.GradientTransformation, clip: float | None, weight_decay: float
) -> optax.GradientTransformation:
    """Adam (AdamW with `weight_decay`, bases left out) with its rate from
    `schedule`, the gradient's global norm clipped at `clip` first: optax's
    `adam` and `adamw` with a schedule of our own in place of theirs."""
    parts = [optax.scale_by_adam()]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, _outside_bases))
    parts.append(schedule)
    if clip is not None:
        parts.insert(0, optax.clip_by_global_norm(clip))
    return optax.chain(*parts)


def _outside_bases(params):
    """A mask of a flow's `params`: `False` for its base distributions'."""

    def mask(node):
        if isinstance(node, AbstractBase):
            return jax.tree_util.tree_map(lambda _: False, node)
        return True

    return jax.tree_util.tree_map(
        mask, params, is_leaf=lambda n: isinstance(n, AbstractBase)
    )
