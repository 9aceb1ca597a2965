"""The optimiser of `fit` and the command line: Adam on a warmup-cosine schedule
(over the run's steps, or over its time budget), gradients clipped."""

import jax
import optax

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
        return optax.adam(CONSTANT_LR)
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
    (`None`: no clipping).

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
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        lr,
        warmup_steps=warmup,
        decay_steps=max(steps, 2),
        end_value=lr / LR_END_DIVISOR if end_factor is None else lr * end_factor,
    )
    adam = (
        optax.adamw(schedule, weight_decay=weight_decay, mask=_outside_bases)
        if weight_decay
        else optax.adam(schedule)
    )
    return adam if clip is None else optax.chain(optax.clip_by_global_norm(clip), adam)


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
    # `optax.adam` and `optax.adamw`, with the budget's rate in place of theirs.
    parts = [optax.scale_by_adam()]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay, _outside_bases))
    parts.append(scale_by_budget(lr, warmup, end))
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
