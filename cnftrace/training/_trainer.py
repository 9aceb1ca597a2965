"""One training step, jitted, over a state that each step replaces. Failures travel
in the state (diffrax-style) and `Trainer.check` raises for them on the host."""

from collections.abc import Callable
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax import lax
from jax.extend.core import Var
from jaxtyping import Array, Float, PyTree

from .._checks import (
    check_context,
    check_event_shape,
    check_int,
    check_key,
    check_samples,
)
from .._custom_types import Key
from .._defaults import BATCH_SIZE
from .._placement import committed
from ..flows import AbstractFlow
from ..objectives import AbstractObjective
from ..objectives._names import resolve_objective
from ._budget import budget_states
from ._optim import default_optimizer
from ._parallel import DataParallel, MeshSpec, check_batch_size, resolve_mesh
from ._state import StepCounters, TrainState, copy_arrays, raise_for_failures

DataSource = Float[Array, "n ..."] | Callable[[Key, int], Any]


@eqx.filter_jit
def _copy_and_init(params, optimizer: optax.GradientTransformation, init: bool):
    """A strongly typed copy of `params` (a weak type would make the second step
    compile again), and the optimiser's fresh state if `init`."""
    strong = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype=x.dtype), params)
    params = copy_arrays(strong)  # a copy, not the caller's buffers forwarded
    return params, optimizer.init(params) if init else None


class _ArraySampler(eqx.Module):
    """Batches drawn with replacement from the samples (and their contexts)."""

    data: Array
    context: Array | None

    def __call__(self, key, batch_size):
        """`(batch, context or None, False)`: the samples were checked up front."""
        idx = jr.randint(key, (batch_size,), 0, self.data.shape[0])
        context = None if self.context is None else self.context[idx]
        return self.data[idx], context, jnp.asarray(False)


class _NoData(eqx.Module):
    """Zeros of shape `(batch_size, 0)` for an objective that needs no data."""

    dtype: Any = eqx.field(static=True)

    def __call__(self, key, batch_size):
        del key
        return jnp.zeros((batch_size, 0), self.dtype), None, jnp.asarray(False)


class _GeneratorSampler(eqx.Module):
    """Fresh batches from `data(key, batch_size)`, flagged `bad` where not finite
    (a flag, not a host callback, so that the step can be cached on disk)."""

    data: Callable

    def __call__(self, key, batch_size):
        out = self.data(key, batch_size)
        batch, ctx = out if isinstance(out, tuple) else (out, None)
        bad = jnp.any(~jnp.isfinite(batch))
        if ctx is not None:
            bad = bad | jnp.any(~jnp.isfinite(ctx))
        return batch, ctx, bad


def _traced_generator(data: Callable, key, batch_size: int):
    """`(shapes, depends)` of `data(key, batch_size)` from its jaxpr; raises
    `TypeError` where it cannot be traced."""
    try:
        jaxpr, shapes = jax.make_jaxpr(
            lambda key: data(key, batch_size), return_shape=True
        )(key)
    except jax.errors.JAXTypeError as e:
        first = str(e).splitlines()[0]
        raise TypeError(
            "`data(key, batch_size)` cannot be traced by JAX, and the training step "
            f"calls it inside one compiled program ({type(e).__name__}: {first}). "
            "Draw the batch with jax.random from `key`, or pass the samples as an "
            "array."
        ) from None
    reached = set(jaxpr.jaxpr.invars)
    for eqn in jaxpr.jaxpr.eqns:  # an equation of any reached input reaches on
        if any(isinstance(v, Var) and v in reached for v in eqn.invars):
            reached.update(eqn.outvars)
    out = jaxpr.jaxpr.outvars[0]  # the batch: the first output, of a pair too
    return shapes, isinstance(out, Var) and out in reached


class Trainer(eqx.Module):
    """A training run's settings and its jitted step: batches from `data`, the
    `objective`'s loss and gradient, an `optimizer` update. [`fit`][cnftrace.fit] is
    a loop over this step; use it directly for loops of your own.

    **Arguments:**

    - `data`: as for [`fit`][cnftrace.fit] (a generator returns `(batch, context)`
        for a conditional flow); `None` for [`ReverseKL`][cnftrace.ReverseKL].
    - `key`: the run's PRNG key; step `i` draws from `jax.random.fold_in(key, i)`.
    - `objective`: an [`AbstractObjective`][cnftrace.AbstractObjective], or
        `"mle"`, `"fm"`, `"ot-fm"`.
    - `optimizer`: an optax optimiser; `optax.adam(1e-3)` by default.
    - `batch_size`: samples per step.
    - `context`: with array data for a conditional flow, one context row per sample.
    - `mesh`: data-parallel training, as for [`fit`][cnftrace.fit].

    A step skips a non-finite update and freezes at a failed ODE solve;
    [`check`][cnftrace.Trainer.check] raises for either on the host.

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

    sample: _ArraySampler | _GeneratorSampler | _NoData
    objective: AbstractObjective
    optimizer: optax.GradientTransformation
    key: Key
    batch_size: int = eqx.field(static=True)
    mesh: DataParallel | None = eqx.field(static=True)

    def __init__(
        self,
        data: DataSource | None,
        *,
        key: Key,
        objective: str | AbstractObjective = "mle",
        optimizer: optax.GradientTransformation | None = None,
        batch_size: int = BATCH_SIZE,
        context: Float[Array, "n context"] | None = None,
        mesh: MeshSpec = None,
    ):
        batch_size = check_int("batch_size", batch_size)
        check_key("key", key)
        self.objective = resolve_objective(objective)
        self.optimizer = default_optimizer(None) if optimizer is None else optimizer
        self.batch_size = batch_size
        self.mesh = resolve_mesh(mesh)
        _check_data_needed(data, self.objective)
        if data is None:
            if context is not None:
                raise ValueError("`context` goes with data; this objective takes none.")
            sample = _NoData(jnp.result_type(float))
        elif callable(data):
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
        """Checks the data against `flow` (shapes, dtypes, contexts) before the
        compiled step; a generator is traced, not run, and must depend on the key."""
        conditional = flow.context_dim is not None
        if isinstance(self.sample, _NoData):
            return
        if isinstance(self.sample, _GeneratorSampler):
            what = "data(key, batch_size)"
            first, depends = _traced_generator(
                self.sample.data, self.key, self.batch_size
            )
            if conditional and not (isinstance(first, tuple) and len(first) == 2):
                raise ValueError(
                    f"the flow is conditional, so `{what}` must return a pair "
                    "`(batch, context)`."
                )
            x, c = first if conditional else (first, None)
            check_samples(x, what, flow.event_shape)
            if x.shape[0] != self.batch_size:
                raise ValueError(
                    f"`{what}` returned {x.shape[0]} samples for a batch_size of "
                    f"{self.batch_size}; return `batch_size` samples (its second "
                    "argument), or pass the samples as an array."
                )
            if not depends:
                raise ValueError(
                    f"`{what}` returns a batch that does not depend on `key`, so every "
                    "step would train on the one batch drawn when the step was traced "
                    "(a NumPy random generator does this, or a fixed array). Draw from "
                    "`key` with jax.random (`jax.random.normal(key, (batch_size, "
                    "dim))`), or pass the samples as an array."
                )
            check_context(
                c,
                flow.context_dim,
                self.batch_size,
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
        """The state before the first step, with a copy of `flow`'s parameters (the
        step donates them); `opt_state` defaults to a fresh one."""
        self.check_data(flow)
        self.objective.check(flow)
        params, static = eqx.partition(flow, eqx.is_inexact_array)
        params, fresh = _copy_and_init(params, self.optimizer, opt_state is None)
        opt_state = fresh if opt_state is None else opt_state
        # Distinct int32 buffers whatever JAX's default integer: each is donated.
        zero = lambda: jnp.zeros((), jnp.int32)  # noqa: E731
        state = TrainState(
            step=zero(),
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
        """`state` with its arrays replicated over the mesh, if any."""
        if self.mesh is not None:
            return self.mesh.replicate(state)
        # Committed like the step's output, or the second step would compile again.
        return committed(state)

    def step(self, state: TrainState) -> tuple[TrainState, dict[str, Array]]:
        """One jitted training step, its randomness from `fold_in(key, state.step)`.

        **Returns:**

        `(state, info)`: the new state and a dict of scalars: `loss`, `nfe`,
        `nfe_backward` (`-1` where not counted), `skipped`, `lr` (with
        [`budget_cosine_adam`][cnftrace.budget_cosine_adam]) and the objective's
        other metrics.
        """
        return jitted_step(self, state)

    def check(self, state: TrainState, max_failures: int | None = None) -> None:
        """Raises a [`TrainingError`][cnftrace.TrainingError] if an ODE solve failed
        or the last `max_failures` steps were all skipped (a device sync)."""
        raise_for_failures(
            jax.device_get(StepCounters.of(state)), state.flow, max_failures
        )


def _check_data_needed(data, objective: AbstractObjective) -> None:
    """A clear error where `data` is missing for an objective that needs it, or
    given to one that would ignore it."""
    if data is None and objective.needs_data:
        raise ValueError(
            f"`data` is None, but the objective {type(objective).__name__} trains on "
            "data: pass an array of samples or a function `(key, batch_size) -> "
            "batch`. To train toward an unnormalised log-density without data, use "
            "`objective=cnftrace.ReverseKL(log_target)` (or `fit(..., target=...)`)."
        )
    if data is not None and not objective.needs_data:
        raise ValueError(
            f"the objective {type(objective).__name__} draws its own samples and "
            "would not use `data`: pass `data=None`, or mix in maximum likelihood on "
            "the data with `cnftrace.ReverseKL(log_target, forward_weight=...)`."
        )


def _gradient(trainer: Trainer, flow: AbstractFlow, batch, ctx, key):
    """`(info, grads, finite, result)`: the step's record, the objective's gradient
    on `batch`, whether loss and gradient are finite, and the solves' result."""
    params, static = eqx.partition(flow, eqx.is_inexact_array)
    # The gradient with respect to `counter` counts the backward pass's evaluations
    # of the vector fields, where every block backpropagates through its solver.
    backsolve = any(
        isinstance(b.adjoint, diffrax.BacksolveAdjoint) for b in flow.blocks
    )
    counter = None if backsolve else jnp.zeros((), batch.dtype)

    def loss_fn(params, counter):
        return trainer.objective.loss(
            eqx.combine(params, static), batch, ctx, key, counter
        )

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (loss, metrics), (grads, backward) = grad_fn(params, counter)
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
    finite = [jnp.isfinite(loss)]
    finite += [jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]
    finite = jnp.all(jnp.stack(finite))
    return info, grads, finite, result


def _update(trainer: Trainer, state: TrainState, bad_batch, grads, finite, result):
    """`(state, skipped)`: the state after the optimiser's update of `grads`,
    unless the step failed or is skipped."""
    params, static = eqx.partition(state.flow, eqx.is_inexact_array)
    solved = result == diffrax.RESULTS.successful
    frozen = (state.failed_step > 0) | (state.bad_batch_step > 0)
    ok = finite & solved & ~bad_batch & ~frozen

    def apply(params, opt_state):
        updates, opt_state = trainer.optimizer.update(grads, opt_state, params)
        # Keep each parameter's dtype (an optax schedule is float64 under x64).
        updates = jax.tree_util.tree_map(
            lambda u, p: u.astype(p.dtype), updates, params
        )
        return eqx.apply_updates(params, updates), opt_state

    keep = lambda params, opt_state: (params, opt_state)
    params, opt_state = lax.cond(ok, apply, keep, params, state.opt_state)
    if trainer.mesh is not None:
        params, opt_state = trainer.mesh.keep_replicated((params, opt_state))
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


def _train_step(trainer: Trainer, state: TrainState):
    """One training step: the batch and the loss's randomness from
    `fold_in(trainer.key, state.step)`, the objective's gradient, the update."""
    data_key, loss_key = jr.split(jr.fold_in(trainer.key, state.step))
    batch, ctx, bad_batch = trainer.sample(data_key, trainer.batch_size)
    if trainer.mesh is not None:
        # Every process draws the same global batch; each device keeps its part.
        batch, ctx = trainer.mesh.shard_batch((batch, ctx))
    info, grads, finite, result = _gradient(trainer, state.flow, batch, ctx, loss_key)
    state, skipped = _update(trainer, state, bad_batch, grads, finite, result)
    info["skipped"] = skipped
    for budget in budget_states(state.opt_state)[:1]:  # a time budget's schedule
        info["lr"] = budget.rate
    return state, info


jitted_step = eqx.filter_jit(_train_step)


class _Layout:
    """What `LoopStep`'s compiled step takes as given rather than as arguments: the
    trainer's non-array parts and the state's structure and non-array leaves.

    A static argument of `jax.jit`, so that two runs whose layouts are equal (the
    same flow, objective, optimiser object and data source: a run repeated, a run
    resumed) share one traced and compiled step. `jax.jit` hashes and compares a
    static argument at every call: the hash is computed once, and a layout compared
    with itself is equal at once."""

    def __init__(self, trainer_rest, treedef, keep, rest):
        self.parts = (trainer_rest, treedef, tuple(keep), tuple(rest))
        try:
            self._hash = hash(self.parts)
        except TypeError:  # an unhashable leaf: this layout equals itself only
            self._hash = id(self)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, _Layout) or self._hash != other._hash:
            return False
        try:
            return bool(self.parts == other.parts)
        except Exception:  # a leaf whose comparison is not a bool
            return False

    def rebuild(self, arrays) -> TrainState:
        _, treedef, keep, rest = self.parts
        it = iter(arrays)
        merged = [next(it) if k else r for k, r in zip(keep, rest, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, merged)


def loop_step(layout: _Layout, trainer_arrays, arrays):
    """`_train_step` on the arrays of a trainer and a state split by `layout`; the
    new state's arrays, and the step's record."""
    trainer_rest, treedef, keep, rest = layout.parts
    trainer = eqx.combine(trainer_arrays, trainer_rest)
    new, info = _train_step(trainer, layout.rebuild(arrays))
    out, out_treedef = jax.tree_util.tree_flatten(new)
    same = out_treedef == treedef and all(
        eqx.is_array(o) if k else not eqx.is_array(o) and (o is r or o == r)
        for o, r, k in zip(out, rest, keep, strict=True)
    )
    if not same:
        raise AssertionError("a training step changed the state's structure")
    return [o for o, k in zip(out, keep) if k], info


_jitted_loop_step = jax.jit(loop_step, static_argnums=0, donate_argnums=2)


class LoopStep:
    """`trainer`'s step for a loop that replaces its state at every step, as `fit`'s
    does: `step(state)` returns `(state, info)` like `jitted_step(trainer, state)`,
    and donates the buffers of the state it is given.

    `eqx.filter_jit` splits both of its arguments into arrays and the rest at every
    call, which costs about as much as a small flow's whole step. Here the trainer
    is split once, and a call flattens only the state and hands its arrays to
    `jax.jit` as a list (the loop Equinox's documentation advises for small steps).
    The state's other leaves (functions, settings) are the ones `state` had when
    the step was built; the compiled step checks that it returns them unchanged.
    """

    def __init__(self, trainer: Trainer, state: TrainState):
        trainer_arrays, trainer_rest = eqx.partition(trainer, eqx.is_array)
        leaves, treedef = jax.tree_util.tree_flatten(state)
        keep = [eqx.is_array(leaf) for leaf in leaves]
        rest = [None if k else leaf for leaf, k in zip(leaves, keep, strict=True)]
        self._trainer_arrays = trainer_arrays
        self._layout = _Layout(trainer_rest, treedef, keep, rest)

    def __call__(self, state: TrainState) -> tuple[TrainState, dict[str, Array]]:
        layout = self._layout
        _, treedef, keep, _ = layout.parts
        leaves = treedef.flatten_up_to(state)
        arrays = [leaf for leaf, k in zip(leaves, keep) if k]
        arrays, info = _jitted_loop_step(layout, self._trainer_arrays, arrays)
        return layout.rebuild(arrays), info
