"""Maximum-likelihood training and exact-trace evaluation."""

import math
import time
from collections.abc import Callable
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, Float
from tqdm.auto import tqdm

from ._checkpoint import (
    CheckpointError,
    key_to_data,
    latest_good_checkpoint,
    save_checkpoint,
)
from ._custom_types import Key
from ._estimators import AbstractEstimator, Exact, Hutchinson
from ._flow import CNF, AbstractFlow, Chain
from ._matching import (
    FlowMatching,
    flow_matching_loss,
    matching_blocks,
    resolve_objective,
)
from ._parallel import (
    MeshSpec,
    check_batch_size,
    check_same_on_all_processes,
    is_main_process,
    resolve_mesh,
)

DataSource = Float[Array, "n ..."] | Callable[[Key, int], Float[Array, "batch ..."]]


class NLL(eqx.Module):
    """A test negative log-likelihood in nats, as
    [`evaluate_nll`][cnftrace.evaluate_nll] returns it.

    **Fields:**

    - `mean`: the mean NLL over the samples.
    - `stderr`: its standard error (sample standard deviation over `sqrt(n)`).
    - `nfe`: the mean number of vector-field evaluations per solve.

    `str(nll)` reads `"2.8310 ± 0.0069 nats"`.

    !!! example

        ```python
        nll = cnftrace.NLL(mean=2.83, stderr=0.01, nfe=70.0)
        print(nll, nll.mean - 2.8319)  # the gap to an entropy
        ```
    """

    mean: float
    stderr: float
    nfe: float

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.stderr:.4f} nats"


def _check_samples(data, name: str, event_shape: tuple[int, ...]) -> Array:
    """`data` as an array of finite floating samples of shape `(n, *event_shape)`,
    or a clear error."""
    data = np.asarray(data)
    if data.ndim < 2 or data.shape[0] < 1:
        raise ValueError(
            f"`{name}` must be an array of samples of shape (n, *event) or a function "
            f"`(key, batch_size) -> batch`; got an array of shape {data.shape}."
        )
    if tuple(data.shape[1:]) != tuple(event_shape):
        raise ValueError(
            f"`{name}` holds samples of shape {data.shape[1:]}, but the flow models "
            f"samples of shape {tuple(event_shape)}."
        )
    if not np.issubdtype(data.dtype, np.floating):
        raise TypeError(
            f"`{name}` has dtype {data.dtype}; convert it to floating point first "
            "(dequantise integer data)."
        )
    bad = ~np.isfinite(data.reshape(data.shape[0], -1)).all(axis=1)
    if bad.any():
        rows = np.flatnonzero(bad)
        raise ValueError(
            f"`{name}` has {rows.size} sample(s) with NaN or inf (first at index "
            f"{rows[0]}); remove or impute them before training."
        )
    return jnp.asarray(data)


def _discrete_adjoints(flow: AbstractFlow) -> bool:
    """Whether every block differentiates its solve by backpropagating through the
    solver's steps (so that backward evaluations can be counted)."""
    return all(
        isinstance(b, CNF) and not isinstance(b.adjoint, diffrax.BacksolveAdjoint)
        for b in _blocks(flow)
    )


def _check_contexts(context, name: str, n: int, context_dim: int | None):
    """`context` as an array `(n, context_dim)` of finite floats (or `None` for a
    flow that is not conditional), or a clear error."""
    if context_dim is None:
        if context is not None:
            raise ValueError(
                f"`{name}` was given, but the flow is not conditional; build it with "
                "`context_dim=...` to condition on a context."
            )
        return None
    if context is None:
        raise ValueError(
            f"the flow is conditional (context_dim={context_dim}); pass `{name}`, an "
            f"array of shape (n, {context_dim}) with one row per sample."
        )
    context = np.asarray(context)
    if context.shape != (n, context_dim):
        raise ValueError(
            f"`{name}` has shape {context.shape}; it needs one row of size "
            f"{context_dim} per sample, shape ({n}, {context_dim})."
        )
    if not np.issubdtype(context.dtype, np.floating):
        raise TypeError(
            f"`{name}` has dtype {context.dtype}; contexts must be floating point "
            "(one-hot encode labels, e.g. `jax.nn.one_hot(labels, k)`)."
        )
    if not np.isfinite(context).all():
        raise ValueError(f"`{name}` contains NaN or inf; pass finite contexts.")
    return jnp.asarray(context)


def _batch_sampler(
    data: DataSource,
    name: str,
    event_shape: tuple[int, ...],
    context=None,
    context_dim: int | None = None,
) -> Callable[[Key, int], tuple[Array, Array | None]]:
    """A function `(key, batch_size) -> (batch, context or None)`."""
    if callable(data):
        if context is not None:
            raise ValueError(
                "`context` goes with array data; a generator for a conditional flow "
                "returns `(batch, context)` pairs itself."
            )
        conditional = context_dim is not None
        what = f"{name}(key, batch_size)"
        # One small draw up front, so that a generator of the wrong shape or dtype
        # fails here with a clear message rather than inside the compiled step.
        first = data(jr.key(0), 2)
        if conditional and not (isinstance(first, tuple) and len(first) == 2):
            raise ValueError(
                f"the flow is conditional, so `{what}` must return a pair "
                "`(batch, context)`."
            )
        x, c = first if conditional else (first, None)
        _check_samples(x, what, event_shape)
        _check_contexts(c, f"the context of {what}", 2, context_dim)

        def checked(key, batch_size):
            # Generated batches are checked as they come (an array is checked once,
            # above): a bad one stops the step before any update.
            out = data(key, batch_size)
            batch, ctx = out if conditional else (out, None)
            bad = jnp.any(~jnp.isfinite(batch))
            if conditional:
                bad = bad | jnp.any(~jnp.isfinite(ctx))
            batch = eqx.error_if(
                batch, bad, "a training batch contains NaN or inf; clean the data."
            )
            return batch, ctx

        return checked
    data = _check_samples(data, name, event_shape)
    context = _check_contexts(context, "context", data.shape[0], context_dim)

    def sample(key, batch_size):
        idx = jr.randint(key, (batch_size,), 0, data.shape[0])
        return data[idx], None if context is None else context[idx]

    return sample


def _check_matching(flow: AbstractFlow, matching: FlowMatching, regularize: bool):
    """A clear error for what flow matching cannot train."""
    matching_blocks(flow)
    if regularize:
        raise ValueError(
            "`kinetic_weight` and `jacobian_weight` regularise maximum-likelihood "
            "training; flow matching's straight paths need no such term. Set them "
            "to 0, or use `objective='mle'`."
        )
    if matching.coupling == "ot" and flow.context_dim is not None:
        raise ValueError(
            "`objective='ot-fm'` is not available for a conditional flow: pairing "
            "across contexts would bias each context's base distribution. Use "
            "`objective='fm'`."
        )


class TrainingError(RuntimeError):
    """Raised by [`fit`][cnftrace.fit] when training cannot go on: too many
    consecutive non-finite steps, or the ODE solver hit its step limit. The message
    says what to change; the last checkpoint is left intact.

    !!! example

        ```python
        try:
            raise cnftrace.TrainingError("the ODE solver reached its step limit")
        except cnftrace.TrainingError as e:
            print(f"training stopped: {e}")
        ```
    """


def _all_finite(tree) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _local_copy(x):
    """A replicated array's copy on this process's first device in its mesh."""
    return x.addressable_data(0) if isinstance(x, jax.Array) else x


def _blocks(flow: AbstractFlow) -> tuple[AbstractFlow, ...]:
    return flow.blocks if isinstance(flow, Chain) else (flow,)


def _solver_settings(flow: AbstractFlow) -> str:
    parts = {
        f"rtol={b.rtol}, atol={b.atol}, max_steps={b.max_steps}"
        for b in _blocks(flow)
        if isinstance(b, CNF)
    }
    return "; ".join(sorted(parts)) or "see the flow's blocks"


def checkpoint_config(
    flow: AbstractFlow,
    batch_size: int,
    estimator: AbstractEstimator,
    config: dict[str, Any] | None,
    kinetic_weight: float = 0.0,
    jacobian_weight: float = 0.0,
    objective: str | FlowMatching = "mle",
) -> dict[str, Any]:
    """The config `fit` stores in (and checks against) its checkpoints: the user's
    `config` plus what `fit` itself knows, under `fit.`-prefixed keys."""
    out = {
        **(config or {}),
        "fit.batch_size": batch_size,
        "fit.estimator": repr(estimator),
        "fit.event_shape": list(flow.event_shape),
    }
    if kinetic_weight or jacobian_weight:
        out["fit.kinetic_weight"] = float(kinetic_weight)
        out["fit.jacobian_weight"] = float(jacobian_weight)
    matching = resolve_objective(objective)
    if matching is not None:
        out["fit.objective"] = repr(matching)
    return out


def fit(
    flow: AbstractFlow,
    data: DataSource,
    *,
    key: Key,
    steps: int = 1000,
    batch_size: int = 512,
    optimizer: optax.GradientTransformation | None = None,
    estimator: AbstractEstimator | None = None,
    progress: bool = True,
    log_every: int = 1,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 100,
    keep: int = 3,
    config: dict[str, Any] | None = None,
    max_failures: int = 10,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    validation: Float[Array, "n ..."] | None = None,
    validate_every: int = 100,
    patience: int | None = None,
    validation_estimator: AbstractEstimator | None = None,
    context: Float[Array, "n context"] | None = None,
    validation_context: Float[Array, "n context"] | None = None,
    kinetic_weight: float = 0.0,
    jacobian_weight: float = 0.0,
    mesh: MeshSpec = None,
    objective: str | FlowMatching = "mle",
) -> tuple[AbstractFlow, dict[str, list]]:
    """Trains `flow` by maximum likelihood (the default) or by flow matching.

    **Arguments:**

    - `flow`: any cnftrace flow: a [`CNF`][cnftrace.CNF], a
        [`Chain`][cnftrace.Chain] or a [`MultiscaleFlow`][cnftrace.MultiscaleFlow].
    - `data`: an array of training samples `(n, *event)`, from which batches are
        drawn with replacement, or a function `(key, batch_size) -> batch` that
        generates fresh samples.
    - `key`: the PRNG key; the same key gives the same run. Step `i` uses
        `jax.random.fold_in(key, i)` for its batch and probes, so a resumed run draws
        exactly what an uninterrupted one would.
    - `steps`: the total number of optimiser steps (a resumed run stops there too).
    - `batch_size`: samples per step.
    - `optimizer`: an optax optimiser; `optax.adam(1e-3)` by default.
    - `estimator`: the trace estimator used in training, a Rademacher
        [`Hutchinson`][cnftrace.Hutchinson] probe by default. The returned flow keeps
        the flow's own estimator (for evaluation).
    - `progress`: show a progress bar.
    - `log_every`: record the history every this many steps.
    - `checkpoint_dir`: where to write checkpoints (model, optimiser state, step,
        key, history, config) every `checkpoint_every` steps and at the end, keeping
        the newest `keep`. If it already holds checkpoints of the same config, training
        resumes from the newest good one (corrupted ones are reported and skipped).
    - `config`: a JSON-serialisable dict describing the run; a checkpoint written
        under another config is refused, naming the differences.
    - `max_failures`: a step whose loss or gradient is not finite is skipped (the
        model and optimiser state stay as they were) and counted; after this many
        consecutive skipped steps training stops with a `TrainingError`.
        The failure count is checked whenever a record is logged.
    - `on_log`: called with each history record (a dict) as it is logged.
    - `validation`: held-out samples. Every `validate_every` steps (and at the end)
        their NLL is computed with the **exact** trace (or `validation_estimator`,
        whose noise is then part of the reported standard error), and the parameters
        with the best validation NLL are the ones returned.
    - `patience`: stop early after this many validations without improvement.
    - `context`, `validation_context`: for a conditional flow (`context_dim=...`)
        with array data, one context row per sample of `data` and of `validation`.
        A generator for a conditional flow returns `(batch, context)` pairs instead.
    - `kinetic_weight`, `jacobian_weight`: RNODE's regularisation (Finlay et al.
        2020). The loss becomes `NLL + kinetic_weight * E[int |f|^2 dt] +
        jacobian_weight * E[int |df/dz|_F^2 dt]`, both integrals taken in the same
        solve as the log-density, the Frobenius norm from the training estimator's
        own probes and Jacobian-vector products (no extra evaluations). Smoother
        dynamics need fewer solver steps; see the docs' regularisation page.
    - `mesh`: train data-parallel over several devices: a `jax.sharding.Mesh`
        (e.g. [`data_mesh`][cnftrace.data_mesh]`(devices)`), or `"all"` for every
        device in `jax.devices()`. The parameters and optimiser state are replicated
        on every device and each batch is split over the mesh's devices, so
        `batch_size` must be a multiple of their number; the results are those of
        one device up to floating-point rounding, and checkpoints load on any number
        of devices. In a multi-process run (after `jax.distributed.initialize`)
        every process calls `fit` with the same arguments; only process 0 writes
        checkpoints, shows progress and calls `on_log`. `None` (the default): one
        device. See the docs' scaling page.
    - `objective`: `"mle"` (the default): maximum likelihood through the ODE solve.
        `"fm"`: conditional flow matching, which regresses the vector field onto
        straight Gaussian paths from data to base with no ODE solve in the step
        (see [`flow_matching_loss`][cnftrace.flow_matching_loss]); `"ot-fm"`: the
        same with minibatch optimal-transport pairing, which gives straighter paths
        and cheaper solves. A [`FlowMatching`][cnftrace.FlowMatching] sets the
        path's width `sigma`. Flow matching trains a `CNF` or a `Chain` of them with
        fixed end times; `estimator` and the regularisation weights do not apply,
        and validation still computes the exact NLL through the ODE.

    **Returns:**

    `(trained_flow, history)`: the flow with the best validation NLL (the last one
    without `validation`), and a dict of lists: `step`, `loss` (the training NLL
    estimate; with flow matching, its loss), `nfe` (forward NFE per step, all
    blocks; `1` with flow matching, one evaluation of a field per sample),
    `nfe_backward` (the
    vector-field evaluations backpropagated through per step, all blocks, counted
    exactly; `-1` where a block uses `BacksolveAdjoint`, whose backward solve is not
    counted), `seconds`, `skipped`
    (non-finite steps skipped so far); with `validation` also `val_step`, `val_nll`,
    `val_stderr`; with regularisation also `kinetic` and `jacobian` (batch means of
    the integrals).

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
    for name, value, low in (
        ("steps", steps, 1),
        ("batch_size", batch_size, 1),
        ("log_every", log_every, 1),
        ("checkpoint_every", checkpoint_every, 1),
        ("keep", keep, 1),
        ("max_failures", max_failures, 1),
        ("validate_every", validate_every, 1),
        ("patience", 1 if patience is None else patience, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}; got {value!r}.")
    weights = {"kinetic_weight": kinetic_weight, "jacobian_weight": jacobian_weight}
    for name, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"`{name}` must be a number; got {value!r}.")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"`{name}` must be finite and >= 0; got {value!r}.")
    regularize = kinetic_weight > 0 or jacobian_weight > 0
    matching = resolve_objective(objective)
    if matching is not None:
        _check_matching(flow, matching, regularize)
    parallel = resolve_mesh(mesh)
    if parallel is not None:
        check_batch_size(batch_size, parallel.size)
    main_process = is_main_process()
    sampler = _batch_sampler(data, "data", flow.event_shape, context, flow.context_dim)
    if validation is not None:
        validation = _check_samples(validation, "validation", flow.event_shape)
        validation_context = _check_contexts(
            validation_context,
            "validation_context",
            validation.shape[0],
            flow.context_dim,
        )
    elif validation_context is not None:
        raise ValueError("`validation_context` was given without `validation`.")
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    estimator = Hutchinson() if estimator is None else estimator
    params, static = eqx.partition(flow, eqx.is_inexact_array)
    # The step donates its buffers; copy so the caller's flow stays usable.
    params = jax.tree_util.tree_map(jnp.copy, params)
    opt_state = optimizer.init(params)
    run_config = checkpoint_config(
        flow, batch_size, estimator, config, kinetic_weight, jacobian_weight, objective
    )
    names = ("step", "loss", "nfe", "nfe_backward", "seconds", "skipped")
    if regularize:
        names += ("kinetic", "jacobian")
    names += ("val_step", "val_nll", "val_stderr")
    history: dict[str, list[Any]] = {name: [] for name in names}
    # A separate copy: `params` is donated to each step.
    best_params = jax.tree_util.tree_map(jnp.copy, params)
    first_step = 0
    if checkpoint_dir is not None:
        like = (params, opt_state, key_to_data(key), best_params)
        found = latest_good_checkpoint(checkpoint_dir, like, run_config)
        if found is not None:
            first_step, (params, opt_state, saved_key, best_params), header = found
            if not np.array_equal(np.asarray(saved_key), np.asarray(key_to_data(key))):
                raise CheckpointError(
                    f"the checkpoints in {checkpoint_dir} were written by a run with "
                    "another `key`; resuming with this key would not continue that "
                    "run. Pass the same key, or use a new checkpoint directory."
                )
            history = header["history"]
            for name in names:
                history.setdefault(name, [])
        # Every process must resume from the same step, or they would deadlock.
        check_same_on_all_processes(first_step, "the checkpoint step to resume from")
    if parallel is not None:
        params, opt_state, best_params = parallel.replicate(
            (params, opt_state, best_params)
        )

    if validation is not None:
        val_estimator = (
            Exact() if validation_estimator is None else validation_estimator
        )
        # Validation keys (used only by stochastic validation estimators) are kept
        # apart from the training keys `fold_in(key, step)`.
        val_key = jr.fold_in(key, 2**31 - 1)

    def loss_fn(params, counter, batch, ctx, key):
        if matching is not None:
            model = eqx.combine(params, static)
            loss = flow_matching_loss(
                model, batch, key=key, objective=matching, context=ctx
            )
            return loss, (loss, jnp.asarray(1), ())
        model = eqx.combine(params, static).with_estimator(estimator)
        if not regularize:
            logp, stats = model._batch_log_prob(batch, key, counter, context=ctx)
            nll = -jnp.mean(logp)
            return nll, (nll, stats.total_nfe, ())
        logp, reg, stats = model._batch_log_prob(
            batch, key, counter, context=ctx, regularize=True
        )
        nll = -jnp.mean(logp)
        kinetic, jacobian = jnp.mean(reg.kinetic), jnp.mean(reg.jacobian)
        loss = nll + kinetic_weight * kinetic + jacobian_weight * jacobian
        return loss, (nll, stats.total_nfe, (kinetic, jacobian))

    # The gradient with respect to `counter` counts the backward pass's evaluations
    # of the vector fields (exact for discrete adjoints; see CNFTerm.make_args).
    count_backward = matching is None and _discrete_adjoints(flow)

    @eqx.filter_jit(donate="all-except-first")
    def step(i, params, opt_state, failures):
        data_key, probe_key = jr.split(jr.fold_in(key, i))
        batch, ctx = sampler(data_key, batch_size)
        if parallel is not None:
            # Every process draws the same global batch; each device keeps its part.
            batch, ctx = parallel.shard_batch((batch, ctx))
        counter = jnp.zeros((), batch.dtype) if count_backward else None
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
        (loss, aux), (grads, nfe_backward) = grad_fn(
            params, counter, batch, ctx, probe_key
        )
        nll, nfe, reg = aux
        if count_backward:
            nfe_backward = jnp.round(nfe_backward).astype(int)
        else:
            nfe_backward = 1 if matching is not None else -1
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = eqx.apply_updates(params, updates)
        ok = jnp.isfinite(loss) & _all_finite(grads)
        keep_new = lambda new, old: jnp.where(ok, new, old)
        params = jax.tree_util.tree_map(keep_new, new_params, params)
        opt_state = jax.tree_util.tree_map(keep_new, new_opt_state, opt_state)
        failures = jnp.where(ok, 0, failures + 1)
        if parallel is not None:
            params, opt_state = parallel.keep_replicated((params, opt_state))
        return params, opt_state, nll, (nfe, nfe_backward), reg, failures, ~ok

    def save(done):
        if not main_process:
            return
        best = best_params if validation is not None else params
        state = (params, opt_state, key_to_data(key), best)
        save_checkpoint(
            checkpoint_dir, done, state, run_config, keep=keep, history=history
        )

    def validations_since_best() -> int:
        nll = history["val_nll"]
        return len(nll) - 1 - int(np.argmin(nll)) if nll else 0

    skipped = history["skipped"][-1] if history["skipped"] else 0
    failures = jnp.zeros((), jnp.int32)
    index = jnp.asarray
    if parallel is not None:
        failures = parallel.replicate(failures)
        index_dtype = jnp.asarray(0).dtype
        index = lambda i: parallel.replicate(np.asarray(i, index_dtype))
    skipped_now = jnp.zeros((), jnp.int32)
    start = time.perf_counter() - (history["seconds"][-1] if history["seconds"] else 0)
    bar = tqdm(
        range(first_step, steps),
        initial=first_step,
        total=steps,
        disable=not (progress and main_process),
        desc="training",
        unit="it",
    )
    for i in bar:
        done = i + 1
        log_now = done % log_every == 0 or done == steps
        checkpoint_now = checkpoint_dir is not None and (
            done % checkpoint_every == 0 or done == steps
        )
        validate_now = validation is not None and (
            done % validate_every == 0 or done == steps
        )
        try:
            params, opt_state, loss, (nfe, nfe_backward), reg, failures, bad = step(
                index(i), params, opt_state, failures
            )
            skipped_now = skipped_now + bad
            # Host syncs only where something is logged, saved or validated.
            if log_now or checkpoint_now or validate_now:
                skipped += int(skipped_now)
                skipped_now = jnp.asarray(0)
                record = {
                    "step": done,
                    "loss": float(loss),
                    "nfe": int(nfe),
                    "nfe_backward": int(nfe_backward),
                    "seconds": time.perf_counter() - start,
                    "skipped": skipped,
                }
                if regularize:
                    record["kinetic"], record["jacobian"] = map(float, reg)
        except Exception as e:  # the solver's max_steps check, raised at run time
            if "maximum number of solver steps" not in str(e):
                raise
            raise TrainingError(
                f"the ODE solver reached its step limit near training step {done} "
                f"({_solver_settings(flow)}): the dynamics have become too stiff for "
                "the tolerance. Raise `max_steps`, loosen `rtol`/`atol`, lower the "
                "learning rate, or regularise the dynamics; the last checkpoint is "
                "intact."
            ) from e
        if not (log_now or checkpoint_now or validate_now):
            continue
        if int(failures) >= max_failures:
            raise TrainingError(
                f"{int(failures)} consecutive training steps gave a non-finite loss "
                f"or gradient (up to step {done}); stopping. The model was not "
                "updated by those steps and the last checkpoint is intact. Lower the "
                "learning rate, clip gradients, or tighten the solver tolerance."
            )
        if log_now:
            for name, value in record.items():
                history[name].append(value)
        if validate_now:
            model = eqx.combine(params, static)
            if parallel is not None:
                # Each process evaluates on one of its own devices (the parameters
                # are replicated, so every process gets the same numbers).
                model = jax.tree_util.tree_map(_local_copy, model)
            val = evaluate_nll(
                model,
                validation,
                context=validation_context,
                estimator=val_estimator,
                key=jr.fold_in(val_key, done),
            )
            history["val_step"].append(done)
            history["val_nll"].append(val.mean)
            history["val_stderr"].append(val.stderr)
            record = dict(record, val_nll=val.mean, val_stderr=val.stderr)
            if validations_since_best() == 0:
                best_params = jax.tree_util.tree_map(jnp.copy, params)
        if (log_now or validate_now) and main_process:
            if on_log is not None:
                on_log(record)
            if progress:
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    nfe=f"{record['nfe']}/{record['nfe_backward']}",
                )
        if checkpoint_now:
            save(done)
        if patience is not None and validations_since_best() >= patience:
            if checkpoint_dir is not None and not checkpoint_now:
                save(done)
            break
    bar.close()
    if validation is not None:
        return eqx.combine(best_params, static), history
    return eqx.combine(params, static), history


@eqx.filter_jit
def log_prob_and_stats(model: AbstractFlow, x, key, context=None):
    """`model.log_prob(x, context=context, key=key, return_stats=True)`, jitted once
    at module level so that repeated evaluations (validation during `fit`) reuse the
    compiled code."""
    return model.log_prob(x, context=context, key=key, return_stats=True)


def evaluate_nll(
    flow: AbstractFlow,
    x: Float[Array, "n ..."],
    *,
    context: Float[Array, "n context"] | None = None,
    batch_size: int = 1000,
    estimator: AbstractEstimator | None = None,
    key: Key | None = None,
) -> NLL:
    """The test negative log-likelihood of `x` in nats, with its standard error.

    **Arguments:**

    - `flow`: any cnftrace flow.
    - `x`: at least two samples, shape `(n, *event_shape)`.
    - `context`: one row per sample, for a conditional flow (the NLL is then that of
        `x` given its context).
    - `batch_size`: samples per solve; bounds the memory.
    - `estimator`: the trace estimator, [`Exact`][cnftrace.Exact] by default. Pass a
        stochastic one (and a `key`) for large dimensions; its noise is then part of
        the reported standard error.
    - `key`: the PRNG key of a stochastic estimator.

    **Returns:**

    An [`NLL`][cnftrace.NLL]: the mean NLL over `x`, its standard error, and the
    mean NFE per solve. A non-finite log-density raises `FloatingPointError`.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, dim=2)
        nll = cnftrace.evaluate_nll(flow, jr.normal(jr.key(1), (100, 2)))
        print(nll)  # e.g. "2.9 ± 0.1 nats"
        ```
    """
    x = jnp.asarray(x)
    if x.ndim < 2 or x.shape[0] < 2:
        raise ValueError(
            f"`x` must be a batch of at least 2 samples; got shape {x.shape}."
        )
    n = x.shape[0]
    context = _check_contexts(context, "context", n, flow.context_dim)
    estimator = Exact() if estimator is None else estimator
    model = flow.with_estimator(estimator)
    values, nfes = [], []
    for i, start in enumerate(range(0, n, batch_size)):
        chunk = x[start : start + batch_size]
        ctx = None if context is None else context[start : start + batch_size]
        k = None if key is None else jr.fold_in(key, i)
        lp, stats = log_prob_and_stats(model, chunk, k, ctx)
        values.append(np.asarray(lp))
        nfes.append(float(stats.total_nfe))
    lp = np.concatenate(values)
    if not np.all(np.isfinite(lp)):
        raise FloatingPointError("the flow gave a non-finite log-density on `x`.")
    return NLL(
        mean=float(-lp.mean()),
        stderr=float(lp.std(ddof=1) / math.sqrt(n)),
        nfe=float(np.mean(nfes)),
    )
