"""Training for a time budget (`fit(..., seconds=...)`): its check, the clock of
training seconds, and the schedule over the share of the budget spent, which `fit`
writes into the optimiser state before each step (`with_spent`)."""

import contextlib
import math
import time
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array

from .._checks import is_number


def check_seconds(seconds) -> float | None:
    """`seconds` as a float, `None` kept; a `ValueError` naming the budget unless it
    is a positive finite number."""
    if seconds is None:
        return None
    if not is_number(seconds) or not 0 < seconds < math.inf:
        raise ValueError(
            "`seconds` is the training time budget, a finite number of seconds > 0; "
            f"got {seconds!r}. Pass e.g. `seconds=600` for ten minutes "
            "(`cnftrace train --minutes 10`), or leave it None to train for `steps`."
        )
    return float(seconds)


class Clock:
    """Training seconds: those since the clock was made, plus `spent` before (a
    resumed run's), less the time spent `paused` (validation, checkpoints)."""

    def __init__(self, spent: float = 0.0):
        self.origin = time.perf_counter() - spent
        self.stopped = None  # when a pause began

    def __call__(self) -> float:
        now = time.perf_counter() if self.stopped is None else self.stopped
        return now - self.origin

    @contextlib.contextmanager
    def paused(self):
        """A block whose seconds are not training seconds."""
        if self.stopped is not None:  # already paused
            yield
            return
        self.stopped = time.perf_counter()
        try:
            yield
        finally:
            self.origin += time.perf_counter() - self.stopped
            self.stopped = None


class BudgetState(NamedTuple):
    """The state of the budget schedule: the steps taken, the share of the time
    budget spent when the current step began (set by `fit`), and the rate of the
    last step."""

    count: Array
    spent: Array
    rate: Array


def budget_rate(count, spent, lr: float, warmup: int, end: float):
    """The rate at step `count` with the share `spent` of the budget gone: the lower
    of a linear warmup over steps and a cosine decay from `lr` to `end` over the
    budget."""
    cosine = end + (lr - end) * (1 + jnp.cos(jnp.pi * jnp.clip(spent, 0, 1))) / 2
    return jnp.minimum(lr * count / warmup, cosine)


def scale_by_budget(lr: float, warmup: int, end: float) -> optax.GradientTransformation:
    """Updates scaled by `-budget_rate(...)`, the rate of the step's count and of
    the share of the budget spent that its state holds."""

    def init(params):
        del params
        zero = jnp.zeros((), jnp.result_type(float))
        return BudgetState(jnp.zeros((), jnp.int32), zero, zero)

    def update(updates, state, params=None):
        del params
        rate = budget_rate(state.count, state.spent, lr, warmup, end)
        rate = rate.astype(state.rate.dtype)
        updates = jax.tree_util.tree_map(lambda u: -rate.astype(u.dtype) * u, updates)
        return updates, BudgetState(state.count + 1, state.spent, rate)

    return optax.GradientTransformation(init, update)


def _is_budget(node) -> bool:
    return isinstance(node, BudgetState)


def budget_states(opt_state) -> list[BudgetState]:
    """The budget schedules' states in an optimiser state (none for another
    optimiser)."""
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=_is_budget)
    return [leaf for leaf in leaves if _is_budget(leaf)]


def with_spent(state, spent: float):
    """`state` (a `TrainState`) with the share of the budget spent set to `spent`
    in each budget schedule of its optimiser state, on the devices (and in the
    dtype) of the value it replaces."""

    def put(node):
        if not _is_budget(node):
            return node
        old = node.spent
        value = np.asarray(spent, old.dtype)
        return node._replace(spent=jax.device_put(value, old.sharding))

    opt_state = jax.tree_util.tree_map(put, state.opt_state, is_leaf=_is_budget)
    return eqx.tree_at(lambda s: s.opt_state, state, opt_state)
