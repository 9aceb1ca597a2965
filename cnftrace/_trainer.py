"""One training step, jitted, over a state that each step replaces.

Failures travel in the state (diffrax-style): a step whose loss or gradient is not
finite is skipped and counted, a step whose ODE solve failed freezes the state and
records the step and diffrax's result. Nothing raises inside the compiled step;
`Trainer.check` raises on the host, wherever the caller syncs.
"""

import concurrent.futures
import functools
from collections.abc import Callable
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PyTree

from ._builders import warmup_cosine_adam
from ._checks import (
    check_context,
    check_event_shape,
    check_int,
    check_key,
    check_samples,
)
from ._custom_types import Key
from ._flow import AbstractFlow
from ._matching import SHORTHANDS
from ._objectives import AbstractObjective, MaximumLikelihood
from ._parallel import DataParallel, MeshSpec, check_batch_size, resolve_mesh
from ._stepcache import enabled as stepcache_enabled, exported_grads
from ._tracing import without_collector

DataSource = Float[Array, "n ..."] | Callable[[Key, int], Any]
OBJECTIVES = ("mle", "fm", "ot-fm")


# The defaults of `fit` and `Trainer`, in one place.
DEFAULT_BATCH_SIZE = 512


DEFAULT_LR = 3e-3


def default_optimizer(steps: int | None) -> optax.GradientTransformation:
    """The optimiser of `fit` and `Trainer` when none is given. `steps`: the run's
    length where known (`fit` passes it), for a schedule.

    For a run of known length, Adam with a short warmup to 3e-3 and a cosine decay to
    1.5e-4 at the last step, gradients clipped at a global norm of 10
    ([`warmup_cosine_adam`][cnftrace.warmup_cosine_adam]): on the docs' quality page
    it left a quarter of the gap of a constant 1e-3 after the same steps. Without a
    length (a bare `Trainer`), a constant Adam at 1e-3, the best constant rate there.
    """
    if steps is None:
        return optax.adam(1e-3)
    return warmup_cosine_adam(steps, DEFAULT_LR)


class TrainingError(RuntimeError):
    """Raised by [`fit`][cnftrace.fit] (and [`Trainer.check`][cnftrace.Trainer.check])
    when training cannot go on: too many consecutive non-finite steps, or an ODE solve
    that failed (its step limit, say). The message names the step and says what to
    change; the last checkpoint is left intact.

    !!! example

        ```python
        try:
            raise cnftrace.TrainingError("the ODE solver reached its step limit")
        except cnftrace.TrainingError as e:
            print(f"training stopped: {e}")
        ```
    """


def resolve_objective(objective) -> AbstractObjective:
    """`fit`'s `objective`: an objective, or one of the strings that stand for one."""
    if isinstance(objective, AbstractObjective):
        return objective
    if isinstance(objective, str) and objective == "mle":
        return MaximumLikelihood()
    if isinstance(objective, str) and objective in SHORTHANDS:
        return SHORTHANDS[objective]
    raise ValueError(
        f"`objective` must be one of {', '.join(map(repr, OBJECTIVES))} or an "
        "objective such as `cnftrace.MaximumLikelihood(...)` or "
        f"`cnftrace.FlowMatching(...)`; got {objective!r}."
    )


class TrainState(eqx.Module):
    """The state of a training run between two steps of a
    [`Trainer`][cnftrace.Trainer]. Each step returns a new one; none is changed in
    place.

    **Fields:**

    - `step`: the number of steps taken.
    - `flow`: the flow with its current parameters.
    - `opt_state`: the optimiser's state.
    - `failures`: consecutive steps skipped for a non-finite loss or gradient.
    - `skipped`: all steps skipped so far.
    - `failed_step`: the step (1-based) whose ODE solve failed, or 0. From then on
        every step leaves the state as it is.
    - `result`: that solve's `diffrax.RESULTS` (`successful` if none failed).
    - `bad_batch_step`: the step (1-based) whose generated batch held NaN or inf, or
        0. It stops the run as a failed solve does.
    """

    step: Int[Array, ""]
    flow: AbstractFlow
    opt_state: PyTree
    failures: Int[Array, ""]
    skipped: Int[Array, ""]
    failed_step: Int[Array, ""]
    result: diffrax.RESULTS
    bad_batch_step: Int[Array, ""]


def _committed(x):
    if isinstance(x, np.ndarray):
        x = jnp.asarray(x)
    return jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x


@eqx.filter_jit
def copy_arrays(tree):
    """`tree` with each array copied into a buffer of its own, in one program."""
    return jax.tree_util.tree_map(jnp.copy, tree)


@eqx.filter_jit
def _copy_and_init(params, optimizer: optax.GradientTransformation, init: bool):
    """A copy of `params` in buffers of its own, and the optimiser's fresh state if
    `init`: one program (run op by op, the optimiser's `init` compiles a program for
    each parameter shape). The copies are strongly typed (a weakly typed parameter,
    `jnp.asarray(1.0)` say, would come out of the first update strongly typed, and
    the step would compile again for it)."""
    strong = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=x.dtype), params)
    params = copy_arrays(strong)  # a copy, not the caller's buffers forwarded
    return params, optimizer.init(params) if init else None


def _all_finite(tree) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _discrete_adjoints(flow: AbstractFlow) -> bool:
    """Whether every block differentiates its solve by backpropagating through the
    solver's steps, so that its backward evaluations can be counted."""
    return all(not isinstance(b.adjoint, diffrax.BacksolveAdjoint) for b in flow.blocks)


def solver_settings(flow: AbstractFlow) -> str:
    """The blocks' tolerances and step limits, for error messages."""
    parts = {
        f"rtol={b.rtol}, atol={b.atol}, max_steps={b.max_steps}" for b in flow.blocks
    }
    return "; ".join(sorted(parts))


def _as_pair(out) -> tuple[Array, Array | None]:
    """A generator's output as `(batch, context or None)`."""
    return out if isinstance(out, tuple) else (out, None)


class _ArraySampler(eqx.Module):
    """Batches drawn with replacement from the samples (and their contexts)."""

    data: Array
    context: Array | None

    def __call__(self, key, batch_size):
        """`(batch, context or None, bad)`; `bad` is `False`: the samples were
        checked up front."""
        idx = jr.randint(key, (batch_size,), 0, self.data.shape[0])
        context = None if self.context is None else self.context[idx]
        return self.data[idx], context, jnp.asarray(False)


class _GeneratorSampler(eqx.Module):
    """Fresh batches from `data(key, batch_size)`, checked as they come (an array is
    checked once, up front). The check is a flag, not a host callback, so that the
    compiled step can be stored in the persistent compilation cache: a bad batch
    stops the step before any update, and `Trainer.check` raises for it."""

    data: Callable

    def __call__(self, key, batch_size):
        batch, ctx = _as_pair(self.data(key, batch_size))
        bad = jnp.any(~jnp.isfinite(batch))
        if ctx is not None:
            bad = bad | jnp.any(~jnp.isfinite(ctx))
        return batch, ctx, bad


class Trainer(eqx.Module):
    """A training run's settings and its jitted step: batches from `data`, the
    `objective`'s loss and gradient, an `optimizer` update. [`fit`][cnftrace.fit] is
    a loop over this step; use it directly for loops of your own (a time budget,
    say).

    **Arguments:**

    - `data`: an array of training samples `(n, *event)`, from which batches are
        drawn with replacement, or a function `(key, batch_size) -> batch` (for a
        conditional flow, `-> (batch, context)`) that generates fresh samples.
    - `key`: the run's PRNG key. Step `i` draws its batch and its loss's randomness
        from `jax.random.fold_in(key, i)`, so a run is reproducible and resumable.
    - `objective`: an objective ([`MaximumLikelihood`][cnftrace.MaximumLikelihood],
        [`FlowMatching`][cnftrace.FlowMatching], or your own
        [`AbstractObjective`][cnftrace.AbstractObjective]), or `"mle"`, `"fm"`,
        `"ot-fm"`.
    - `optimizer`: an optax optimiser; `optax.adam(1e-3)` by default.
    - `batch_size`: samples per step.
    - `context`: with array data for a conditional flow, one context row per sample.
    - `mesh`: data-parallel training, as for [`fit`][cnftrace.fit].

    A step skips (leaves the parameters and optimiser state as they were, and
    counts) an update whose loss or gradient is not finite, and freezes the state
    at a failed ODE solve; [`check`][cnftrace.Trainer.check] raises for either on the
    host. Updates are cast to each parameter's dtype, so that a float32 flow stays
    float32 when float64 is enabled (an optax schedule is then float64).

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-3, atol=1e-3)
        data = lambda key, n: 0.5 * jr.normal(key, (n, 2)) + 1.0
        trainer = cnftrace.Trainer(data, key=jr.key(1), batch_size=64)
        state = trainer.init(flow)
        for _ in range(5):
            state, info = trainer.step(state)
        trainer.check(state)  # raises if a solve failed, say
        print(int(state.step), float(info["loss"]), int(info["nfe"]))
        trained = state.flow
        ```
    """

    sample: _ArraySampler | _GeneratorSampler
    objective: AbstractObjective
    optimizer: optax.GradientTransformation
    key: Key
    batch_size: int = eqx.field(static=True)
    mesh: DataParallel | None = eqx.field(static=True)

    def __init__(
        self,
        data: DataSource,
        *,
        key: Key,
        objective: str | AbstractObjective = "mle",
        optimizer: optax.GradientTransformation | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        context: Float[Array, "n context"] | None = None,
        mesh: MeshSpec = None,
    ):
        check_int("batch_size", batch_size)
        check_key("key", key)
        self.objective = resolve_objective(objective)
        self.optimizer = default_optimizer(None) if optimizer is None else optimizer
        self.batch_size = batch_size
        self.mesh = resolve_mesh(mesh)
        if callable(data):
            if context is not None:
                raise ValueError(
                    "`context` goes with array data; a generator for a conditional "
                    "flow returns `(batch, context)` pairs itself."
                )
            sample = _GeneratorSampler(data)
        else:
            context = None if context is None else jnp.asarray(context)
            sample = _ArraySampler(check_samples(data, "data", None), context)
        if self.mesh is not None:
            check_batch_size(batch_size, self.mesh.size)
            key = jr.wrap_key_data(self.mesh.replicate(jr.key_data(key)))
            sample = self.mesh.replicate(sample)
        self.key = key
        self.sample = sample

    def check_data(self, flow: AbstractFlow) -> None:
        """Checks the data against `flow` (shapes, dtypes, contexts), so that a
        mismatch fails here rather than inside the compiled step. A generator is
        traced for the shapes and dtypes of a batch, not run (its values are
        checked in every step: a batch with NaN or inf stops the step, and `check`
        raises for it)."""
        conditional = flow.context_dim is not None
        if isinstance(self.sample, _GeneratorSampler):
            what = "data(key, batch_size)"
            first = jax.eval_shape(lambda key: self.sample.data(key, 2), self.key)
            if conditional and not (isinstance(first, tuple) and len(first) == 2):
                raise ValueError(
                    f"the flow is conditional, so `{what}` must return a pair "
                    "`(batch, context)`."
                )
            x, c = first if conditional else (first, None)
            check_samples(x, what, flow.event_shape)
            check_context(
                c,
                flow.context_dim,
                2,
                name=f"the context of {what}",
                broadcast=False,
                host=True,
            )
            return
        n = self.sample.data.shape[0]
        check_event_shape(self.sample.data.shape[1:], "data", flow.event_shape)
        context = self.sample.context
        if context is not None:
            context = np.asarray(context)
        check_context(context, flow.context_dim, n, broadcast=False, host=True)

    def init(self, flow: AbstractFlow, *, opt_state: PyTree = None) -> TrainState:
        """The state before the first step: checks `flow` against the data and the
        objective, and copies its parameters (the step that `fit` runs donates its
        buffers, so the caller's flow stays usable). `opt_state`: the optimiser's
        state to start from (a resumed run's); a fresh one by default."""
        self.check_data(flow)
        self.objective.check(flow)
        params, static = eqx.partition(flow, eqx.is_inexact_array)
        params, fresh = _copy_and_init(params, self.optimizer, opt_state is None)
        opt_state = fresh if opt_state is None else opt_state
        # Distinct buffers: the step that `fit` runs donates each of them.
        zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
        state = TrainState(
            # Counters of one dtype whatever JAX's default integer (the update
            # keeps them so: the step is compiled for the types it returns).
            step=jnp.zeros((), jnp.int32),
            flow=eqx.combine(params, static),
            opt_state=opt_state,
            failures=zero(),
            skipped=zero(),
            failed_step=zero(),
            result=diffrax.RESULTS.successful,
            bad_batch_step=zero(),
        )
        return self.placed(state)

    def placed(self, state: TrainState) -> TrainState:
        """`state` with its arrays replicated over the mesh (as is, on one
        device)."""
        if self.mesh is not None:
            return self.mesh.replicate(state)
        # The step returns JAX arrays committed to its device; a first state of
        # NumPy leaves (diffrax's result codes) or uncommitted arrays would make the
        # second step compile (or load) a second program.
        return jax.tree_util.tree_map(_committed, state)

    def step(self, state: TrainState) -> tuple[TrainState, dict[str, Array]]:
        """One training step, jitted: draws a batch and the loss's randomness from
        `fold_in(key, state.step)`, takes the objective's value and gradient and
        updates the parameters.

        **Returns:**

        `(state, info)`: the new state and a dict of scalars: `loss` (the objective's
        recorded loss), `nfe` and `nfe_backward` (vector-field evaluations of the
        forward and backward pass; `-1` where not counted, as with
        `diffrax.BacksolveAdjoint`), `skipped` (whether this step was skipped), and
        the objective's other metrics.
        """
        return training_step(self, state)(state)

    def check(self, state: TrainState, max_failures: int | None = None) -> None:
        """Raises a [`TrainingError`][cnftrace.TrainingError] on the host if an ODE
        solve failed, or if the last `max_failures` steps were all skipped for a
        non-finite loss or gradient. A sync with the device."""
        raise_for_failures(
            jax.device_get(StepCounters.of(state)), state.flow, max_failures
        )


class StepCounters(eqx.Module):
    """A training state's counters (see [`TrainState`][cnftrace.TrainState]), and
    all that [`Trainer.check`][cnftrace.Trainer.check] reads: `result` as the
    result code's integer."""

    step: Int[Array, ""]
    failures: Int[Array, ""]
    skipped: Int[Array, ""]
    failed_step: Int[Array, ""]
    result: Int[Array, ""]
    bad_batch_step: Int[Array, ""]

    @classmethod
    def of(cls, state: TrainState) -> "StepCounters":
        [result] = jax.tree_util.tree_leaves(state.result)
        return cls(
            state.step,
            state.failures,
            state.skipped,
            state.failed_step,
            result,
            state.bad_batch_step,
        )

    @classmethod
    def copied(cls, state: TrainState) -> "StepCounters":
        """The counters in buffers of their own (one small program): still readable
        once `state` has been given to the next step."""
        return _copy_counters(cls.of(state))


_copy_counters = jax.jit(copy_arrays)


def raise_for_failures(counters: StepCounters, flow, max_failures: int | None) -> None:
    """`Trainer.check` on counters fetched to the host."""
    failed_step = int(counters.failed_step)
    if failed_step:
        result = jax.tree_util.tree_unflatten(_RESULT_TREE, [counters.result])
        if bool(result == diffrax.RESULTS.max_steps_reached):
            raise TrainingError(
                f"the ODE solver reached its step limit at training step "
                f"{failed_step} ({solver_settings(flow)}): the dynamics have "
                "become too stiff for the tolerance. Raise `max_steps`, loosen "
                "`rtol`/`atol`, lower the learning rate, or regularise the "
                "dynamics; the last checkpoint is intact."
            )
        raise TrainingError(
            f"the ODE solve failed at training step {failed_step}: "
            f"{diffrax.RESULTS[result]} The last checkpoint is intact."
        )
    bad_batch_step = int(counters.bad_batch_step)
    if bad_batch_step:
        raise TrainingError(
            f"the training batch of step {bad_batch_step}, drawn from the data "
            "function, contains NaN or inf; make the function return finite "
            "samples. The model was not updated by that step and the last "
            "checkpoint is intact."
        )
    failures = int(counters.failures)
    if max_failures is not None and failures >= max_failures:
        raise TrainingError(
            f"{failures} consecutive training steps gave a non-finite loss "
            f"or gradient (up to step {int(counters.step)}); stopping. The model was "
            "not updated by those steps and the last checkpoint is intact. Lower "
            "the learning rate, clip gradients, or tighten the solver tolerance."
        )


def _objective_grads(objective, static, treedef, impl, count, leaves, x, ctx, key):
    """The objective's gradient at the parameters `leaves` (the flow's inexact
    arrays, flattened by `treedef`; `static` is the rest of the flow), on batch `x`
    with key data `key` of implementation `impl`. Returns only arrays in plain
    containers, so that it can be exported and stored (`_stepcache`):
    `(info, grads, finite)`: the step's record (`loss`, the objective's metrics,
    `nfe`, `nfe_backward`, and `result`, diffrax's result code), the gradient, and
    whether the loss and the gradient are finite."""
    key = jr.wrap_key_data(key, impl=impl)
    # The gradient with respect to `counter` counts the backward pass's evaluations
    # of the vector fields (exact for discrete adjoints; see CNFTerm.make_args).
    counter = jnp.zeros((), x.dtype) if count else None

    def loss_fn(leaves, counter):
        flow = eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)
        return objective.loss(flow, x, ctx, key, counter)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (loss, metrics), (grads, backward) = grad_fn(leaves, counter)
    info = dict(metrics)
    stats = info.pop("stats", None)
    result = diffrax.RESULTS.successful
    if stats is not None:
        info.setdefault("nfe", stats.total_nfe)
        result = stats.first_failure()
    info.setdefault("loss", loss)
    if "nfe_backward" not in info:
        info["nfe_backward"] = (
            jnp.round(backward).astype(int) if backward is not None else -1
        )
    info = {k: jnp.asarray(v) for k, v in info.items()}
    info["result"] = jnp.asarray(jax.tree_util.tree_leaves(result)[0], jnp.int32)
    finite = jnp.isfinite(loss) & _all_finite(grads)
    return info, grads, finite


_RESULT_TREE = jax.tree_util.tree_structure(diffrax.RESULTS.successful)


def step_program(trainer: Trainer, state: TrainState):
    """The stored form of the step's gradient (`_stepcache.exported_grads`) for this
    trainer and state, or `None` (cache off, a model the cache cannot describe, or a
    mesh)."""
    if trainer.mesh is not None or not stepcache_enabled():
        return None
    fn, fixed, args = _grad_parts(trainer, state)
    objective, static, treedef, impl, count = fixed
    # What the key describes: the tree structure as the parameters' dtypes and
    # shapes in their places (a PyTreeDef cannot be described).
    places = jax.tree_util.tree_unflatten(
        treedef, [f"{x.dtype}{x.shape}" for x in args[0]]
    )
    return exported_grads(fn, (objective, static, places, impl, count), args)


def _update_leaves(
    optimizer, treedef, static, leaves, bad_batch, grads, finite, result
):
    """`_update` on one device over the state's arrays flattened (`leaves`, by
    `treedef`; `static` is the rest of the state), returning the new state's arrays
    flattened the same way and whether the step was skipped: only arrays in plain
    containers, so that it can be stored (`_stepcache`)."""
    state = eqx.combine(jax.tree_util.tree_unflatten(treedef, leaves), static)
    new, skipped = _update(optimizer, None, state, bad_batch, grads, finite, result)
    return jax.tree_util.tree_leaves(eqx.filter(new, eqx.is_array)), skipped


def update_program(trainer: Trainer, state: TrainState):
    """The stored form of the update (`_update_leaves`) for this trainer's optimiser
    and this state, or `None` (cache off, an optimiser or model the cache cannot
    describe, or a mesh): a later process reads it compiled instead of tracing
    the optimiser's update again."""
    if trainer.mesh is not None or not stepcache_enabled():
        return None
    arrays, static = eqx.partition(state, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(arrays)
    places = jax.tree_util.tree_unflatten(
        treedef, [f"{x.dtype}{x.shape}" for x in leaves]
    )
    fn = functools.partial(_update_leaves, trainer.optimizer, treedef, static)
    return exported_grads(
        fn,
        ("update", trainer.optimizer, static, places),
        (leaves, *_update_inputs(arrays.flow)),
    )


def _update_inputs(flow: AbstractFlow) -> tuple:
    """The shapes of what the update takes from a step beside the state: whether
    the batch was bad, the gradient (flattened), whether it and the loss are
    finite, and the solve's result code."""
    grads = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _grads_input(flow)]
    flag = jax.ShapeDtypeStruct((), jnp.bool_)
    return flag, grads, flag, jax.ShapeDtypeStruct((), jnp.int32)


class _StoredUpdate:
    """The update through its stored program (`update_program`), with the split
    step's signature; the jitted update for good where the program cannot take
    the arguments (a `TypeError` or `ValueError` raised before anything runs)."""

    def __init__(self, program, jitted):
        self.program, self.jitted = program, jitted

    def __call__(self, trainer_arrays, arrays, bad_batch, grads, finite, result):
        if self.program is not None:
            leaves, treedef = jax.tree_util.tree_flatten(arrays)
            try:
                new, skipped = self.program.executable()(
                    leaves, bad_batch, grads, finite, result
                )
                return jax.tree_util.tree_unflatten(treedef, new), skipped
            except (TypeError, ValueError):
                self.program = None
        return self.jitted(trainer_arrays, arrays, bad_batch, grads, finite, result)


def _grad_parts(trainer: Trainer, state: TrainState, batch=None, ctx=None, key=None):
    params, static = eqx.partition(state.flow, eqx.is_inexact_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if batch is None:  # shapes only, for the cache's key
        batch, ctx = jax.eval_shape(
            lambda k: trainer.sample(k, trainer.batch_size)[:2], trainer.key
        )
        key = jax.eval_shape(lambda k: jr.key_data(jr.split(k)[0]), trainer.key)
    impl = str(jr.key_impl(trainer.key))
    fixed = (trainer.objective, static, treedef, impl, _discrete_adjoints(state.flow))
    return functools.partial(_objective_grads, *fixed), fixed, (leaves, batch, ctx, key)


def _draw(trainer: Trainer, state: TrainState):
    """The step's batch (and context), whether the batch is bad, and the key data of
    the loss's randomness, all from `fold_in(trainer.key, state.step)`."""
    data_key, loss_key = jr.split(jr.fold_in(trainer.key, state.step))
    batch, ctx, bad_batch = trainer.sample(data_key, trainer.batch_size)
    if trainer.mesh is not None:
        # Every process draws the same global batch; each device keeps its part.
        batch, ctx = trainer.mesh.shard_batch((batch, ctx))
    return batch, ctx, bad_batch, jr.key_data(loss_key)


def _update(
    optimizer, mesh, state: TrainState, bad_batch, grads, finite, result
) -> tuple[TrainState, Array]:
    """`(state, skipped)`: the state after a step whose gradient program returned
    the gradient `grads` (flattened), whether it and the loss are `finite`, and the
    solve's `result` code (see `_objective_grads`): `optimizer`'s update, unless the
    step failed or is skipped. Its inputs do not depend on the objective, so it can
    be compiled before the gradient is traced."""
    params, static = eqx.partition(state.flow, eqx.is_inexact_array)
    treedef = jax.tree_util.tree_structure(params)
    grads = jax.tree_util.tree_unflatten(treedef, grads)
    result = jax.tree_util.tree_unflatten(_RESULT_TREE, [result])

    updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
    # Keep each parameter's dtype (an optax schedule is float64 under x64).
    updates = jax.tree_util.tree_map(lambda u, p: u.astype(p.dtype), updates, params)
    new_params = eqx.apply_updates(params, updates)
    solved = result == diffrax.RESULTS.successful
    frozen = (state.failed_step > 0) | (state.bad_batch_step > 0)
    ok = finite & solved & ~bad_batch & ~frozen
    keep_new = lambda new, old: jnp.where(ok, new, old)
    params = jax.tree_util.tree_map(keep_new, new_params, params)
    opt_state = jax.tree_util.tree_map(keep_new, new_opt_state, state.opt_state)
    if mesh is not None:
        params, opt_state = mesh.keep_replicated((params, opt_state))
    fails_now = ~solved & ~bad_batch & ~frozen
    state = TrainState(
        step=state.step + 1,
        flow=eqx.combine(params, static),
        opt_state=opt_state,
        failures=jnp.where(ok, 0, state.failures + 1),
        skipped=state.skipped + (~ok).astype(state.skipped.dtype),
        failed_step=jnp.where(fails_now, state.step + 1, state.failed_step),
        result=diffrax.RESULTS.where(fails_now, result, state.result),
        bad_batch_step=jnp.where(
            bad_batch & ~frozen, state.step + 1, state.bad_batch_step
        ),
    )
    return state, ~ok


def _step_info(info: dict, skipped) -> dict:
    """What a step returns beside the state: the gradient program's record without
    the result code (kept in the state), and whether the step was skipped."""
    info = {k: v for k, v in info.items() if k != "result"}
    info["skipped"] = skipped
    return info


def _train_step(trainer: Trainer, state: TrainState):
    """One step as one program: what a data-parallel run (a mesh) runs."""
    batch, ctx, bad_batch, key = _draw(trainer, state)
    fn, _, args = _grad_parts(trainer, state, batch, ctx, key)
    info, grads, finite = fn(*args)
    state, skipped = _update(
        trainer.optimizer, trainer.mesh, state, bad_batch, grads, finite, info["result"]
    )
    return state, _step_info(info, skipped)


_step = without_collector(eqx.filter_jit(_train_step))
# `fit` gives the state's buffers to the step: it never reuses a state.
_step_donating = without_collector(
    eqx.filter_jit(_train_step, donate="all-except-first")
)


class _SplitPrograms:
    """A step's three programs (draw, gradient, update) for one trainer's and one
    state's static parts, jitted over arrays alone: a step then costs three
    dispatches and a partition of the state, not a partition and hash of the whole
    trainer and flow per program (which made a flow-matching step several times
    slower than its computation)."""

    def __init__(self, trainer_static, state_static, donate: bool):
        self.state_static = state_static

        def _draw_program(trainer_arrays, step):
            trainer = eqx.combine(trainer_arrays, trainer_static)
            return _draw(trainer, _StepOnly(step))

        def _grads_program(trainer_arrays, state_arrays, batch, ctx, key):
            trainer = eqx.combine(trainer_arrays, trainer_static)
            state = eqx.combine(state_arrays, state_static)
            fn, _, args = _grad_parts(trainer, state, batch, ctx, key)
            return fn(*args)

        def _update_program(
            trainer_arrays, state_arrays, bad_batch, grads, finite, result
        ):
            trainer = eqx.combine(trainer_arrays, trainer_static)
            state = eqx.combine(state_arrays, state_static)
            new, skipped = _update(
                trainer.optimizer, None, state, bad_batch, grads, finite, result
            )
            return eqx.filter(new, eqx.is_array), skipped

        self.draw = jax.jit(_draw_program)
        self.grads = jax.jit(_grads_program)
        # Only the state is donated (the gradient's buffers cannot be reused).
        self.update = jax.jit(_update_program, donate_argnums=(1,) if donate else ())
        # The draw and the update compiled ahead (`SplitStep`), by their arguments'
        # types.
        self.ahead: dict = {}

    def draw_ahead(self, trainer_arrays, state_arrays) -> "_CompiledAhead":
        """The draw compiled (or compiling) for these arrays' types: made once, so
        that a later run of the same model reuses it."""
        return self._ahead("draw", trainer_arrays, state_arrays)

    def update_ahead(self, trainer_arrays, state_arrays) -> "_CompiledAhead":
        """The update, as `draw_ahead`."""
        return self._ahead("update", trainer_arrays, state_arrays)

    def _ahead(self, which, trainer_arrays, state_arrays):
        leaves, treedef = jax.tree_util.tree_flatten((trainer_arrays, state_arrays))
        key = (which, treedef, tuple(jax.typeof(x) for x in leaves))
        if key not in self.ahead:
            if which == "draw":
                args = (trainer_arrays, state_arrays.step)
            else:
                args = (
                    trainer_arrays,
                    state_arrays,
                    *_update_inputs(state_arrays.flow),
                )
            self.ahead[key] = _CompiledAhead(getattr(self, which), *args)
        return self.ahead[key]


class _StepOnly(eqx.Module):
    """What `_draw` reads of a state: its step."""

    step: Array


# The programs of recent runs, by their static parts: a second `fit` of the same
# model reuses them (traced and compiled) as the jitted step used to.
_PROGRAMS: dict = {}
_MAX_PROGRAMS = 16


def _split_programs(trainer: Trainer, state: TrainState, donate: bool):
    """`(trainer's arrays, _SplitPrograms)`; a `TypeError` where a static part
    cannot be hashed."""
    trainer_arrays, trainer_static = eqx.partition(trainer, eqx.is_array)
    state_static = eqx.filter(state, eqx.is_array, inverse=True)
    # The result code's static part (diffrax's enumeration) is the same for every
    # state, and cannot be hashed.
    key = (trainer_static, state_static.flow, state_static.opt_state, donate)
    programs = _PROGRAMS.pop(key, None)
    if programs is None:
        programs = _SplitPrograms(trainer_static, state_static, donate)
    _PROGRAMS[key] = programs  # the most recently used last
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        del _PROGRAMS[next(iter(_PROGRAMS))]
    return trainer_arrays, programs


def _grads_input(flow: AbstractFlow) -> list:
    return jax.tree_util.tree_leaves(eqx.filter(flow, eqx.is_inexact_array))


class _CompiledAhead:
    """`jitted`, traced and lowered for `args` when made and compiled in a
    background thread (XLA compiles without holding Python's lock), so that it
    compiles while the caller goes on tracing. Called, it waits for that compile and
    runs the compiled program; it falls back on `jitted` for good if compiling
    failed or the arguments differ from `args`' types (a `TypeError` or `ValueError`
    raised before anything runs)."""

    def __init__(self, jitted, *args):
        self.jitted = jitted
        self._future = None
        try:
            lowered = jitted.trace(*args).lower()
        except Exception:
            return
        self._future = _AHEAD.submit(lowered.compile)

    def __call__(self, *args):
        if self._future is not None:
            try:
                compiled = self._future.result()
            except Exception:
                compiled = None
            self._future = None
            self._compiled = compiled
        compiled = getattr(self, "_compiled", None)
        if compiled is not None:
            try:
                return compiled(*args)
            except (TypeError, ValueError):
                self._compiled = None
        return self.jitted(*args)


_AHEAD = concurrent.futures.ThreadPoolExecutor(1, "cnftrace-compile-ahead")


class SplitStep:
    """One step on one device, as three programs: the draw, the objective's gradient
    and the update. With `stored` (what `fit` runs), the gradient and the update
    are taken compiled from the store beside the compilation cache (`_stepcache`:
    no tracing or lowering), or put there, and compute bit for bit what
    `Trainer.step` computes; the draw compiles in the background while the gradient
    is traced, and the update (whose inputs do not depend on the objective) is
    traced while the gradient compiles, and compiles beside it. `donate`: the
    state's buffers are given to the update. Built once per run; a `TypeError` where
    the trainer or the flow holds a static part that cannot be hashed."""

    @without_collector  # it traces the stored programs
    def __init__(self, trainer: Trainer, state: TrainState, donate=False, stored=False):
        self.trainer_arrays, self.programs = _split_programs(trainer, state, donate)
        p = self.programs
        self._draw, self._update, self.program = p.draw, p.update, None
        self._calls = 0
        if not stored:
            return
        arrays = eqx.filter(state, eqx.is_array)
        # The draw compiles while the gradient is traced; the update is traced
        # while the gradient compiles (which leaves a core free for its first
        # second or so), and compiles beside it.
        self._draw = p.draw_ahead(self.trainer_arrays, arrays)
        program = step_program(trainer, state)
        if program is not None and program.has_executable:
            self.program = program
        # The update read from the store, or compiled now.
        update = update_program(trainer, state)
        if update is not None and update.has_executable:
            self._update = _StoredUpdate(update, p.update)
        else:
            self._update = p.update_ahead(self.trainer_arrays, arrays)

    @without_collector  # the jitted programs trace at their first call
    def __call__(self, state: TrainState) -> tuple[TrainState, dict[str, Array]]:
        p = self.programs
        arrays = eqx.filter(state, eqx.is_array)
        batch, ctx, bad_batch, key = self._draw(self.trainer_arrays, arrays.step)
        if self.program is None:
            out = p.grads(self.trainer_arrays, arrays, batch, ctx, key)
        else:
            out = self.program.executable()(_grads_input(arrays.flow), batch, ctx, key)
        info, grads, finite = out
        new, skipped = self._update(
            self.trainer_arrays, arrays, bad_batch, grads, finite, info["result"]
        )
        if self._calls == 1:
            self.save()  # the first step has been waited for
        self._calls += 1
        return eqx.combine(new, p.state_static), _step_info(info, skipped)

    def save(self) -> list[concurrent.futures.Future]:
        """Writes the executables this process compiled for the store, in the
        background (`_stepcache.ExportedGrads.save_executable`; the futures of
        those writes): done at the second step, so that the first does not wait
        for it, and by `fit` at its end, which waits for them."""
        programs = (self.program, getattr(self._update, "program", None))
        saving = [p.save_executable() for p in programs if p is not None]
        return [future for future in saving if future is not None]


def training_step(trainer: Trainer, state: TrainState, donate=False, stored=False):
    """The step `Trainer.step` and `fit` run, as a function of the state: the split
    step on one device, one program on a mesh or where a static part cannot be hashed
    (both callers take the same one, so they compute the same numbers). `stored`:
    the gradient program comes from (or goes to) the store beside the compilation
    cache (`_stepcache`), where it is on."""
    if trainer.mesh is None:
        try:
            return SplitStep(trainer, state, donate, stored)
        except TypeError:
            pass
    return functools.partial(_step_donating if donate else _step, trainer)
