"""`fit`: a short loop over `Trainer`'s step, with validation, checkpoints and
progress around it."""

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Float
from tqdm.auto import tqdm

from .._checks import check_int, is_int
from .._custom_types import Key
from .._defaults import (
    BATCH_SIZE,
    MAX_FAILURES,
    STEPS,
    batch_rule,
    default_batch_size,
    default_objective,
    default_steps,
    objective_rule,
)
from ..flows import AbstractFlow
from ..objectives import (
    AbstractObjective,
    FlowMatching,
    MaximumLikelihood,
    ReverseKL,
)
from ..objectives._names import resolve_objective
from ..store import CheckpointError, _history
from ..store._checkpoint import (
    key_to_data,
    latest_good_checkpoint,
    list_checkpoints,
    read_header,
    save_checkpoint,
)
from ..store._lock import DirectoryLock
from ._budget import Clock, budget_states, check_seconds, with_spent
from ._evaluate import log_prob_batched
from ._optim import default_optimizer
from ._options import Checkpoints, Validation, checked_arguments, checked_validation
from ._parallel import MeshSpec, check_same_on_all_processes, is_main_process
from ._state import StepCounters, TrainState, copy_arrays, raise_for_failures
from ._trainer import DataSource, LoopStep, Trainer


def checkpoint_config(
    flow: AbstractFlow,
    batch_size: int,
    objective: AbstractObjective,
    config: dict[str, Any] | None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """The config `fit` stores in (and checks against) its checkpoints: the user's
    `config` plus what `fit` knows, under `fit.`-prefixed keys."""
    budget = {} if seconds is None else {"fit.seconds": seconds}
    shape = {"fit.batch_size": batch_size, "fit.event_shape": list(flow.event_shape)}
    return {**(config or {}), **shape, **budget, **objective.config()}


def _local_copy(x):
    """A replicated array's copy on this process's first device in its mesh."""
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


def _params(flow: AbstractFlow):
    return eqx.filter(flow, eqx.is_inexact_array)


def _with_params(flow: AbstractFlow, params) -> AbstractFlow:
    return eqx.combine(params, eqx.partition(flow, eqx.is_inexact_array)[1])


def fit(
    flow: AbstractFlow,
    data: DataSource | None = None,
    *,
    key: Key,
    target: Callable[[Array], Array] | None = None,
    steps: int | None = None,
    seconds: float | None = None,
    batch_size: int | None = None,
    objective: str | AbstractObjective | None = None,
    optimizer: optax.GradientTransformation | None = None,
    context: Float[Array, "n context"] | None = None,
    validation: Validation | Float[Array, "n ..."] | None = None,
    checkpoints: Checkpoints | str | os.PathLike | None = None,
    mesh: MeshSpec = None,
    max_failures: int = MAX_FAILURES,
    progress: bool = True,
    log_every: int = 1,
    on_log: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[AbstractFlow, dict[str, list]]:
    """Trains `flow` by maximum likelihood (the default), flow matching (the default
    from 15 dimensions on samples without end), toward an unnormalised density
    (`target=`), or by any other objective: a loop over
    [`Trainer`][cnftrace.Trainer]'s step.

    **Arguments:**

    - `flow`: any cnftrace flow ([`CNF`][cnftrace.CNF], [`Chain`][cnftrace.Chain],
        [`MultiscaleFlow`][cnftrace.MultiscaleFlow]).
    - `data`: an array of training samples `(n, *event)`, drawn from with
        replacement, or a function `(key, batch_size) -> batch` that draws with
        `jax.random` from `key` inside the compiled step; `None` with `target=`.
    - `key`: the PRNG key; step `i` draws from `jax.random.fold_in(key, i)`.
    - `target`: train toward this unnormalised log-density `(n, *event) -> (n,)`
        by [`ReverseKL`][cnftrace.ReverseKL]`(target)`; give no `data` nor
        `objective`.
    - `steps`: the total number of optimiser steps, 1000 by default (40,000 where
        `fit` chooses flow matching, whose steps are cheap); with `seconds`, a cap
        (`None`: none).
    - `seconds`: a time budget: train until this many seconds of steps (and their
        compilation) are spent, on
        [`budget_cosine_adam`][cnftrace.budget_cosine_adam]`(3e-3)` unless an
        `optimizer` is given; a resumed run goes on with those left.
    - `batch_size`: samples per step; by default (`None`) 512, or 256 for
        maximum likelihood under `seconds` on a CPU above 5 dimensions, where a
        wide field's step costs in proportion to its rows and the budget buys more
        steps at half the batch (`fit` says so in one line); a resumed run keeps
        the batch its checkpoints were written with.
    - `objective`: `"mle"` ([`MaximumLikelihood`][cnftrace.MaximumLikelihood]`()`),
        `"fm"` or `"ot-fm"` ([`FlowMatching`][cnftrace.FlowMatching]), or any
        [`AbstractObjective`][cnftrace.AbstractObjective]. By default (`None`),
        `"fm"` where `data` is a function of 15 dimensions or more and the flow can
        be trained by flow matching (a likelihood step solves the ODE, a
        flow-matching step evaluates the field once: from there the cheap steps
        reach a closer density sooner; `fit` says so in one line), else `"mle"`.
    - `optimizer`: an optax optimiser; by default (without `seconds`)
        [`warmup_cosine_adam`][cnftrace.warmup_cosine_adam]`(steps, 3e-3)`.
    - `context`: for a conditional flow with array data, one context row per
        sample (a generator returns `(batch, context)` pairs instead).
    - `validation`: a [`Validation`][cnftrace.Validation], or held-out samples;
        validated from step 0, and the best parameters are returned.
    - `checkpoints`: a [`Checkpoints`][cnftrace.Checkpoints], or a directory,
        resumed from where it holds checkpoints of the same config.
    - `mesh`: data-parallel training over a `jax.sharding.Mesh`
        ([`data_mesh`][cnftrace.data_mesh]) or `"all"`; `None`: one device. See the
        docs' scaling page.
    - `max_failures`: this many consecutive skipped steps (non-finite loss or
        gradient) raise a `TrainingError`.
    - `progress`: show a progress bar.
    - `log_every`: record the history every this many steps.
    - `on_log`: called with each history record (a dict) as it is logged.

    Raises [`TrainingError`][cnftrace.TrainingError] on too many skipped steps or a
    failed ODE solve. Bad arguments (a `data` function that ignores `key` or that
    JAX cannot trace) are refused before training.

    **Returns:**

    `(flow, history)`: the trained flow and a dict of lists (`step`, `loss`, `nfe`,
    `nfe_backward`, `seconds`, `skipped`, the objective's metrics, and the
    budget's and validation's columns).

    !!! example

        ```python
        from cnftrace.datasets import toy_sample

        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, dim=2, t1=0.5, rtol=1e-3, atol=1e-3)
        data = lambda key, n: toy_sample("8gaussians", key, n)
        flow, history = cnftrace.fit(
            flow, data, key=jr.key(1), steps=5, batch_size=64, progress=False
        )
        print(history["loss"][-1], history["nfe"][-1])
        ```
    """
    seconds = check_seconds(seconds)
    checkpoints = checked_arguments(flow, checkpoints)
    by_default = objective is None
    objective = _objective_of(target, objective, data, flow)
    chose_fm = by_default and objective == "fm"
    default_length = seconds is None and steps is None
    if default_length:
        steps = default_steps(objective) if by_default else STEPS
    steps = None if steps is None else check_int("steps", steps)
    if seconds is not None and jax.process_count() > 1:
        raise ValueError(
            "`seconds` stops on this process's clock, which the other processes do "
            "not share: train a multi-process run for a number of `steps`."
        )
    log_every = check_int("log_every", log_every)
    max_failures = check_int("max_failures", max_failures)
    dim = math.prod(flow.event_shape)
    if chose_fm and progress:
        length = f" for {steps:,} steps" if default_length else ""
        print(
            f"fit: {dim} dimensions from a function: trains by flow matching{length} "
            f"({objective_rule()}; pass `objective=` to choose)",
            file=sys.stderr,
            flush=True,
        )
    if batch_size is None:
        batch_size = _stored_batch_size(checkpoints)
    if batch_size is None:
        likelihood = isinstance(resolve_objective(objective), MaximumLikelihood)
        backend = jax.default_backend()
        budget = seconds is not None
        batch_size = default_batch_size(dim, likelihood, budget, backend)
        if batch_size != BATCH_SIZE and progress:
            print(f"fit: {batch_rule()}", file=sys.stderr, flush=True)
    trainer = Trainer(
        data,
        key=key,
        objective=objective,
        optimizer=default_optimizer(steps, seconds) if optimizer is None else optimizer,
        batch_size=batch_size,
        context=context,
        mesh=mesh,
    )
    state = trainer.init(flow)
    if seconds is None and budget_states(state.opt_state):
        raise ValueError(
            "the optimiser's schedule follows a time budget (budget_cosine_adam), "
            "and `seconds` is None: pass `seconds=`, or use warmup_cosine_adam."
        )
    if validation is not None:
        if not isinstance(validation, Validation):
            validation = Validation(validation)
        validation = checked_validation(validation, flow)
    lock = contextlib.nullcontext()
    if checkpoints is not None and checkpoints.lock and is_main_process():
        lock = DirectoryLock(checkpoints.directory, "checkpoint directory")
    with lock:
        loop = _Loop(
            trainer, state, (steps, seconds), validation, checkpoints, flow, key
        )
        try:
            return loop.run(max_failures, progress, log_every, on_log)
        finally:
            loop.log.close()


def _stored_batch_size(checkpoints: Checkpoints | None) -> int | None:
    """The batch size of the newest readable checkpoint in `checkpoints`, or `None`:
    a resumed run keeps the batch it started with where `fit`'s default would now
    choose another (a budgeted run resumed on another kind of device)."""
    if checkpoints is None:
        return None
    for _, path in reversed(list_checkpoints(checkpoints.directory)):
        try:
            config = read_header(path)[0].get("config")
        except (CheckpointError, OSError):
            continue  # `latest_good_checkpoint` reports it
        size = config.get("fit.batch_size") if isinstance(config, dict) else None
        return size if is_int(size) and size > 0 else None
    return None


def _objective_of(target, objective, data, flow) -> str | AbstractObjective:
    """`objective`; `ReverseKL(target)` for `fit(..., target=...)`; where none is
    given, the default for `data` and `flow` (`default_objective`)."""
    if target is None:
        if objective is not None:
            return objective
        sampler = callable(data) and _flow_matches(flow)
        return default_objective(math.prod(flow.event_shape), sampler)
    if objective not in (None, "mle"):
        raise ValueError(
            "pass either `target=` (reverse KL with its defaults) or `objective=`; "
            "for other settings, `objective=cnftrace.ReverseKL(target, ...)`."
        )
    if data is not None:
        raise ValueError(
            "`target=` trains from samples the flow draws itself, without `data`; "
            "to add maximum likelihood on data, pass `data` with "
            "`objective=cnftrace.ReverseKL(target, forward_weight=...)`."
        )
    return ReverseKL(target)


def _flow_matches(flow: AbstractFlow) -> bool:
    """Whether flow matching can train `flow`, by the objective's own check."""
    try:
        FlowMatching().check(flow)
    except (TypeError, ValueError):
        return False
    return True


def _say_lost_history(path: str, step: int, steps: list[int], logged: int) -> None:
    """One line on stderr where the history file of a run resumed at `step` lacks
    the record of `logged`, the last step up to it that was logged."""
    last = steps[-1] if steps else 0
    if last >= logged:
        return
    what = "is missing" if not os.path.lexists(path) else "ends before the checkpoint"
    since = f"steps {last + 1} to {step}" if last + 1 < step else f"step {step}"
    _history.warn_stderr(
        f"{path} {what}: the records of {since} are lost, so the history returned "
        "(and the file) lacks them; the checkpoint of step "
        f"{step} is intact, and the run goes on from it."
    )


class _Loop:
    """`fit`'s host side: the state between steps, the history, the best
    parameters, validation and checkpoints."""

    def __init__(self, trainer, state, length, validation, checkpoints, flow, key):
        self.trainer, self.key = trainer, key
        self.steps, self.budget = length  # a cap (or None) and seconds (or None)
        self.validation, self.checkpoints = validation, checkpoints
        self.main_process = is_main_process()
        self.history = _history.empty_history()
        self.elapsed = 0.0  # seconds of training before this call (when resumed)
        self.config = checkpoint_config(
            flow,
            trainer.batch_size,
            trainer.objective,
            None if checkpoints is None else checkpoints.config,
            self.budget,
        )
        self.log = _history.Log(None)
        self.resumed = None  # (the history file, the step) of a resumed run
        # The best validation's step and per-sample log-densities (after a
        # resume, evaluated again at the next validation).
        self.best_step: int | None = None
        self.best_rows: np.ndarray | None = None
        best = None
        if checkpoints is not None:
            path = checkpoints.history_file
            state, best = self._resume(state, path)
            if self.main_process:
                self.log = _history.Log(path)
        self.state = state
        # A copy of its own: the state is donated to each step.
        self.best = copy_arrays(_params(state.flow)) if best is None else best

    @functools.cached_property
    def val_key(self):
        """The validation keys' root, apart from the training keys; made lazily so
        that a run without validation compiles nothing for it."""
        return jr.fold_in(self.key, 2**31 - 1)

    def _resume(self, state: TrainState, history_path: str):
        """`(state, best parameters or None)` from the newest good checkpoint, with
        the history file cut back to its step and read in."""
        params = _params(state.flow)
        like = (params, state.opt_state, key_to_data(self.key), params)
        like = jax.tree_util.tree_map(_local_copy, like)
        found = latest_good_checkpoint(
            self.checkpoints.directory, like, self.config, warn=_history.warn_stderr
        )
        # Every process must resume from the same step, or they would deadlock.
        first_step = 0 if found is None else found[0]
        check_same_on_all_processes(first_step, "the checkpoint step to resume from")
        if self.main_process:
            records = _history.truncate(history_path, first_step)
        else:  # process 0 truncates (and warns); the others read up to the same step
            records = _history.read_records(history_path, warn=lambda m: None)
            records = _history.dedupe(r for r in records if r["step"] <= first_step)
        if found is None:
            return state, None
        _, (params, opt_state, saved_key, best), header = found
        if not np.array_equal(np.asarray(saved_key), np.asarray(key_to_data(self.key))):
            raise CheckpointError(
                f"the checkpoints in {self.checkpoints.directory} were written by a "
                "run with another `key`; resuming with this key would not continue "
                "that run. Pass the same key, or use a new checkpoint directory."
            )
        self.history = _history.history_from_records(records)
        self.resumed = (history_path, first_step)
        self.best_step = header.get("best_step")
        self.elapsed = header.get("seconds", 0.0)
        state = dataclasses.replace(
            state,
            step=jnp.asarray(first_step, jnp.int32),
            flow=_with_params(state.flow, params),
            opt_state=opt_state,
            skipped=jnp.asarray(header.get("skipped", 0), jnp.int32),
        )
        return self.trainer.placed(state), self.trainer.placed(best)

    def run(self, max_failures, progress, log_every, on_log):
        first_step, steps, budget = int(self.state.step), self.steps, self.budget
        if self.resumed is not None and self.main_process:
            path, step = self.resumed
            logged = step if step == steps else step - step % log_every
            _say_lost_history(path, step, self.history["step"], logged)
        self.clock = clock = Clock(self.elapsed)
        todo = range(first_step, steps) if steps else itertools.count(first_step)
        if budget is not None and self.elapsed >= budget:
            todo = range(0)  # the budget was spent before the resume
        bar = tqdm(
            todo,
            initial=first_step,
            total=steps,
            disable=not (progress and self.main_process),
            desc="training",
            unit="it",
        )
        every = None if self.checkpoints is None else self.checkpoints.every
        validated = self.history["val_step"]
        if self.validation is not None and first_step == 0 and 0 not in validated:
            # Step 0: the flow returned is never worse than the one given.
            record = self._validate(0, {"step": 0})
            if on_log is not None and self.main_process:
                on_log(record)
        # A step only logged is logged after the next is dispatched (its state is
        # donated to that step), so host and device work overlap. The first, last,
        # checkpointed and validated steps are dealt with at once.
        pending = None

        def finish(
            done,
            info,
            counters,
            log=True,
            validate=False,
            failures=max_failures,
            report=True,
        ):
            """Step `done` fetched in one transfer, checked, logged and validated."""
            info, counters = jax.device_get((info, counters))
            raise_for_failures(counters, self.state.flow, failures)
            if not (log or validate):
                return
            record = self._record(done, info, counters)
            if log:
                self._append(record)
            if validate:
                record = self._validate(done, record)
            if report and self.main_process:
                if on_log is not None:
                    on_log(record)
                if progress:
                    bar.set_postfix(
                        loss=f"{record['loss']:.4f}",
                        nfe=f"{record['nfe']}/{record['nfe_backward']}",
                    )

        previous = None  # with a budget, the last step's info: the clock waits for it
        step = LoopStep(self.trainer, self.state)
        try:
            for i in bar:
                done = i + 1
                if budget is not None:  # the schedule's share of the budget spent
                    spent = clock() / budget
                    self.state = with_spent(self.state, spent)
                self.state, info = step(self.state)
                if budget is not None:
                    info = dict(info, budget=budget, budget_spent=spent)
                if pending is not None:
                    before, pending = pending, None
                    finish(*before)
                # With a budget, the step the clock passes it in (the one before
                # this, done) makes this one the last.
                jax.block_until_ready(previous)
                last = done == steps or (budget is not None and clock() >= budget)
                previous = None if budget is None else info
                log_now = done % log_every == 0 or last
                checkpoint_now = every is not None and (done % every == 0 or last)
                validate_now = self.validation is not None and (
                    done % self.validation.every == 0 or last
                )
                if not (log_now or checkpoint_now or validate_now):
                    continue
                if not (checkpoint_now or validate_now or i == first_step or last):
                    pending = (done, info, StepCounters.copied(self.state))
                    continue
                # Host syncs only where something is logged, saved or validated.
                counters = StepCounters.of(self.state)
                finish(done, info, counters, log=log_now, validate=validate_now)
                if checkpoint_now:
                    self._save(done)
                patience = None if self.validation is None else self.validation.patience
                if patience is not None and self._validations_since_best() >= patience:
                    if every is not None and not checkpoint_now:
                        self._save(done)
                    break
                if last:
                    break
        except BaseException:
            # An interrupted run still records the step it had finished.
            if pending is not None:
                with contextlib.suppress(Exception):
                    finish(*pending, failures=None, report=False)
            raise
        bar.close()
        if self.validation is not None:
            return _with_params(self.state.flow, self.best), self.history
        return self.state.flow, self.history

    def _record(self, done: int, info: dict, counters) -> dict[str, Any]:
        """Step `done`'s record from its `info` and `counters`, on the host."""
        record = {
            "step": done,
            "loss": float(info["loss"]),
            "nfe": int(info["nfe"]),
            "nfe_backward": int(info["nfe_backward"]),
            "seconds": self.clock(),
            "skipped": int(counters.skipped),
        }
        extra = {k: float(v) for k, v in info.items() if k not in record}
        extra.pop("skipped", None)
        return record | extra

    def _append(self, record: dict[str, Any]) -> None:
        self.history = _history.append_train(self.history, record)
        self.log.write(record)

    def _val_rows(self, flow, done: int) -> np.ndarray:
        """The per-sample validation log-densities of `flow` (keyed by step `done`
        for a stochastic estimator)."""
        if self.trainer.mesh is not None:
            # Each process evaluates on one of its own devices (the parameters
            # are replicated, so every process gets the same numbers).
            flow = jax.tree_util.tree_map(_local_copy, flow)
        rows = log_prob_batched(
            flow,
            self.validation.data,
            context=self.validation.context,
            estimator=self.validation.estimator,
            key=jr.fold_in(self.val_key, done),
        )
        if not np.all(np.isfinite(rows)):
            raise FloatingPointError(
                f"the flow gave a non-finite log-density on the validation samples "
                f"at step {done}."
            )
        return np.asarray(rows, np.float64)

    def _validate(self, done: int, record: dict[str, Any]) -> dict[str, Any]:
        with self.clock.paused():
            rows = self._val_rows(self.state.flow, done)
            mean = float(-rows.mean())
            stderr = float(rows.std(ddof=1) / np.sqrt(rows.size))
            _history.append_validation(self.history, done, mean, stderr)
            self.log.write({"step": done, "val_nll": mean, "val_stderr": stderr})
            if self._improves(rows):
                self.best = copy_arrays(_params(self.state.flow))
                self.best_step, self.best_rows = done, rows
        return dict(record, val_nll=mean, val_stderr=stderr)

    def _improves(self, rows: np.ndarray) -> bool:
        """Whether `rows` beat the best validation's by `significance` paired
        standard errors ([`Validation`][cnftrace.Validation])."""
        if self.best_step is None:
            return True
        if self.best_rows is None:  # resumed: the best parameters evaluated again
            best = _with_params(self.state.flow, self.best)
            self.best_rows = self._val_rows(best, self.best_step)
        diff = rows - self.best_rows
        gain = float(diff.mean())
        stderr = float(diff.std(ddof=1) / np.sqrt(diff.size))
        return gain > 0 and gain > self.validation.significance * stderr

    def _validations_since_best(self) -> int:
        if self.best_step is None:
            return 0
        return sum(step > self.best_step for step in self.history["val_step"])

    def _save(self, done: int) -> None:
        if not self.main_process:
            return
        extra = {"skipped": int(self.state.skipped), "seconds": round(self.clock(), 3)}
        params = _params(self.state.flow)
        best = self.best if self.validation is not None else params
        state = (params, self.state.opt_state, key_to_data(self.key), best)
        with self.clock.paused():
            self.log.sync()  # the history file covers every checkpoint
            save_checkpoint(
                self.checkpoints.directory,
                done,
                state,
                self.config,
                keep=self.checkpoints.keep,
                extra=extra | {"best_step": self.best_step},
            )
