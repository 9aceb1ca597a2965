"""Maximum-likelihood training and exact-trace evaluation."""

import math
import time
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

from ._custom_types import Key
from ._estimators import AbstractEstimator, Exact, Hutchinson
from ._flow import AbstractFlow

DataSource = Float[Array, "n *event"] | Callable[[Key, int], Float[Array, "batch *event"]]


class NLL(eqx.Module):
    """A test negative log-likelihood in nats: the mean over samples, its standard
    error, and the mean NFE per solve of the evaluation."""

    mean: float
    stderr: float
    nfe: float

    def __str__(self) -> str:
        return f"{self.mean:.4f} ± {self.stderr:.4f} nats"


def _batch_sampler(data: DataSource, name: str) -> Callable[[Key, int], Array]:
    if callable(data):
        return data
    data = jnp.asarray(data)
    if data.ndim < 2 or data.shape[0] < 1:
        raise ValueError(
            f"`{name}` must be an array of samples of shape (n, *event) or a function "
            f"`(key, batch_size) -> batch`; got an array of shape {data.shape}."
        )

    def sample(key, batch_size):
        idx = jr.randint(key, (batch_size,), 0, data.shape[0])
        return data[idx]

    return sample


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
) -> tuple[AbstractFlow, dict[str, list]]:
    """Trains `flow` by maximum likelihood.

    **Arguments:**

    - `flow`: a [`CNF`][cnftrace.CNF] or [`Chain`][cnftrace.Chain].
    - `data`: an array of training samples `(n, *event)`, from which batches are
        drawn with replacement, or a function `(key, batch_size) -> batch` that
        generates fresh samples.
    - `key`: the PRNG key; the same key gives the same run.
    - `steps`: number of optimiser steps.
    - `batch_size`: samples per step.
    - `optimizer`: an optax optimiser; `optax.adam(1e-3)` by default.
    - `estimator`: the trace estimator used in training, a Rademacher
        [`Hutchinson`][cnftrace.Hutchinson] probe by default. The returned flow keeps
        the flow's own estimator (for evaluation).
    - `progress`: show a progress bar.
    - `log_every`: record the history every this many steps.

    **Returns:**

    `(trained_flow, history)`, the history a dict of lists: `step`, `loss` (the
    training NLL estimate), `nfe` (forward NFE per step, all blocks), `seconds`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"`steps` must be a positive int; got {steps!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int; got {batch_size!r}.")
    sampler = _batch_sampler(data, "data")
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer
    estimator = Hutchinson() if estimator is None else estimator
    params, static = eqx.partition(flow, eqx.is_inexact_array)
    # The step donates its buffers; copy so the caller's flow stays usable.
    params = jax.tree_util.tree_map(jnp.copy, params)
    opt_state = optimizer.init(params)

    def loss_fn(params, batch, key):
        model = eqx.combine(params, static).with_estimator(estimator)
        logp, stats = model.log_prob(batch, key=key, return_stats=True)
        return -jnp.mean(logp), stats.total_nfe

    @eqx.filter_jit(donate="all")
    def step(params, opt_state, key):
        data_key, probe_key = jr.split(key)
        batch = sampler(data_key, batch_size)
        (loss, nfe), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            params, batch, probe_key
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
        return params, opt_state, loss, nfe

    history: dict[str, list[Any]] = {"step": [], "loss": [], "nfe": [], "seconds": []}
    start = time.perf_counter()
    bar = tqdm(range(steps), disable=not progress, desc="training", unit="it")
    for i in bar:
        key, step_key = jr.split(key)
        params, opt_state, loss, nfe = step(params, opt_state, step_key)
        if (i + 1) % log_every == 0 or i == steps - 1:
            loss_f, nfe_i = float(loss), int(nfe)
            history["step"].append(i + 1)
            history["loss"].append(loss_f)
            history["nfe"].append(nfe_i)
            history["seconds"].append(time.perf_counter() - start)
            if progress:
                bar.set_postfix(loss=f"{loss_f:.4f}", nfe=nfe_i)
    return eqx.combine(params, static), history


def evaluate_nll(
    flow: AbstractFlow,
    x: Float[Array, "n *event"],
    *,
    batch_size: int = 1000,
    estimator: AbstractEstimator | None = None,
    key: Key | None = None,
) -> NLL:
    """The test negative log-likelihood of `x` in nats, with its standard error.

    Uses the exact trace by default (pass a stochastic `estimator` and `key` for
    large dimensions; its noise is then part of the reported standard error).
    """
    x = jnp.asarray(x)
    if x.ndim < 2 or x.shape[0] < 2:
        raise ValueError(
            f"`x` must be a batch of at least 2 samples; got shape {x.shape}."
        )
    estimator = Exact() if estimator is None else estimator
    model = flow.with_estimator(estimator)

    @eqx.filter_jit
    def logp(model, chunk, key):
        return model.log_prob(chunk, key=key, return_stats=True)

    values, nfes = [], []
    n = x.shape[0]
    for i, start in enumerate(range(0, n, batch_size)):
        chunk = x[start : start + batch_size]
        k = None if key is None else jr.fold_in(key, i)
        lp, stats = logp(model, chunk, k)
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
