"""Saving and loading flows, and the run directories of `cnftrace train`.

A run directory holds `config.json` (the settings: the model is rebuilt from them) and
`checkpoints/` (written by `fit`). The settings that define the model and its
optimisation, and how they become a flow, an optimiser and an objective, live here so
that the command line and `load` agree on them.
"""

import io
import json
import os
import pathlib
import warnings
from typing import Any

import equinox as eqx
import jax.random as jr
import numpy as np

from ._builders import mlp_flow, warmup_cosine_adam
from ._checkpoint import (
    CheckpointError,
    _atomic_write,
    deserialise,
    latest_good_checkpoint,
    list_checkpoints,
    read_header,
    read_regular_file,
)
from ._estimators import AbstractEstimator, Exact, Hutchinson
from ._flow import AbstractFlow
from ._matching import FlowMatching
from ._objectives import AbstractObjective, MaximumLikelihood
from ._standardized import Standardization, StandardizedFlow

# Settings that define the model and the optimisation; a checkpoint written under other
# values of these is refused on resume.
MODEL_KEYS = (
    "data", "blocks", "width", "depth", "activation", "t1", "solver", "rtol", "atol",
    "lr", "batch_size", "estimator", "num_probes", "seed", "clip", "steps",
    "kinetic_energy", "jacobian_norm", "learn_t1", "objective", "fm_sigma", "field",
    "train_tol", "data_file", "data_dir", "patience",
)  # fmt: skip
# Values of settings added after a run's config may have been written.
LATER_KEYS = {
    "kinetic_energy": 0.0,
    "jacobian_norm": 0.0,
    "learn_t1": False,
    "objective": "mle",
    "fm_sigma": 0.0,
    # Runs written before MLPField became the default trained FFJORD's ConcatSquash
    # field at the flow's own tolerance.
    "field": "concatsquash",
    "train_tol": None,
    # Runs on built-in data sets: no file, no directory, no early stopping.
    "data_file": None,
    "data_dir": None,
    "patience": None,
}


def with_defaults(config: dict) -> dict:
    return {**LATER_KEYS, **config}


def read_config(path: str) -> dict:
    """A run's `config.json` with the settings added since filled in, or a
    `CheckpointError` saying what is wrong with it."""
    try:
        text = read_regular_file(path, limit=2**20).decode()
        config = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not a JSON settings file ({e}); restore it, or start a new "
            "run directory."
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object of settings.")
    config = with_defaults(config)
    missing = [k for k in MODEL_KEYS if k not in config]
    if missing:
        raise CheckpointError(
            f"{path} lacks the settings {', '.join(missing)}; restore it, or start a "
            "new run directory."
        )
    return config


def run_flow(config: dict, key, dim: int) -> AbstractFlow:
    """The flow described by a run's config, for data of dimension `dim`."""
    if config["blocks"] == 1:
        # The command line has always drawn a single block's key by a split.
        key = jr.split(key, 1)[0]
    return mlp_flow(
        dim,
        key=key,
        field=config["field"],
        blocks=config["blocks"],
        width=config["width"],
        depth=config["depth"],
        activation=config["activation"],
        t1=config["t1"],
        learn_t1=config.get("learn_t1", False),
        solver=config["solver"],
        rtol=config["rtol"],
        atol=config["atol"],
    )


def run_standardization(config: dict) -> Standardization | None:
    """The standardisation a run on a data file trained under, or `None`."""
    data_file = config.get("data_file") or {}
    if data_file.get("mean") is None:
        return None
    return Standardization(
        np.asarray(data_file["mean"], np.float64),
        np.asarray(data_file["scale"], np.float64),
    )


def run_optimizer(config: dict):
    return warmup_cosine_adam(config["steps"], config["lr"], clip=config["clip"])


def run_estimator(config: dict) -> AbstractEstimator:
    if config["estimator"] == "exact":
        return Exact()
    return Hutchinson(config["num_probes"], config["estimator"])


def run_objective(config: dict) -> AbstractObjective:
    """`fit`'s `objective` for a run's config."""
    if config["objective"] == "mle":
        return MaximumLikelihood(
            run_estimator(config),
            config["kinetic_energy"],
            config["jacobian_norm"],
            tolerance=config["train_tol"],
        )
    coupling = "ot" if config["objective"] == "ot-fm" else "independent"
    return FlowMatching(sigma=config["fm_sigma"], coupling=coupling)


def save(path: str, flow: AbstractFlow) -> str:
    """Writes the arrays of `flow` to `path` with equinox's serialisation
    (`equinox.tree_serialise_leaves`), atomically: a temporary file, then a rename,
    so that a crash never leaves half a file. Returns `path`.

    Read it back with [`load`][cnftrace.load]`(path, like=...)`, where `like` is a
    flow of the same architecture (built with the same settings; its values do not
    matter).

    !!! example

        ```python
        flow = cnftrace.mlp_flow(2, key=jr.key(0), width=16, depth=1)
        cnftrace.save("flow.eqx", flow)
        ```
    """
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, flow)
    _atomic_write(path, buffer.getvalue())
    return path


def load(path: str, *, like: AbstractFlow | None = None, return_info: bool = False):
    """A trained flow: from a file written by [`save`][cnftrace.save], or from the
    run directory of `cnftrace train`.

    **Arguments:**

    - `path`: a file written by `save` (then `like` is needed), or a run
        directory (holding `config.json` and `checkpoints/`): the flow is rebuilt
        from its config and given the parameters of its newest good checkpoint,
        those with the best validation NLL where the run validated.
    - `like`: for a file, a flow of the same architecture to load into (its values
        do not matter).
    - `return_info`: also return a dict with the run's `config`, the
        checkpoint's `step` and the data `transform` (all `None` for a file).

    **Returns:**

    The flow, ready for `log_prob`, `sample`, ...; with `return_info`, a pair
    `(flow, info)`. A file or checkpoint that does not fit raises
    [`CheckpointError`][cnftrace.CheckpointError].

    A run trained on the command line (`cnftrace train --run-dir runs/8g`) opens in
    one line: `flow = cnftrace.load("runs/8g")`. A run on a data file that was
    standardised (`cnftrace train --data points.csv`, the default) comes back as a
    [`StandardizedFlow`][cnftrace.StandardizedFlow], so that `log_prob` and
    `sample` work in the data's own units; `info["transform"]` is its
    [`Standardization`][cnftrace.Standardization] (`None` where the run trained on
    the data as it is).

    !!! example

        ```python
        settings = dict(width=16, depth=1)
        cnftrace.save("flow.eqx", cnftrace.mlp_flow(2, key=jr.key(0), **settings))
        like = cnftrace.mlp_flow(2, key=jr.key(1), **settings)  # any values
        flow = cnftrace.load("flow.eqx", like=like)
        samples = flow.sample(jr.key(2), 100)
        ```
    """
    if os.path.isdir(path):
        flow, info = _load_run(path)
    else:
        flow = _load_file(path, like)
        info = {"config": None, "step": None, "transform": None}
    return (flow, info) if return_info else flow


def _load_file(path: str, like: AbstractFlow | None) -> AbstractFlow:
    if like is None:
        raise ValueError(
            f"{path} is a file of arrays; pass `like=`, a flow of the same "
            "architecture to load them into (or give a run directory)."
        )
    if pathlib.Path(path).suffix == "":
        path = f"{path}.eqx"  # as equinox reads it
    data = read_regular_file(path)
    try:
        return deserialise(data, like, path)
    except CheckpointError as e:
        raise CheckpointError(
            f"{path} does not hold the arrays of a flow like `like` ({e}); was it "
            "saved from a flow of another architecture?"
        ) from None


def _event_shape(checkpoints: str) -> tuple[int, ...] | None:
    """The event shape recorded in the newest readable checkpoint's header."""
    for _, path in reversed(list_checkpoints(checkpoints)):
        try:
            header, _ = read_header(path)
        except CheckpointError:
            continue
        shape = header.get("config", {}).get("fit.event_shape")
        if shape is not None:
            return tuple(shape)
    return None


def _load_run(run_dir: str) -> tuple[AbstractFlow, dict[str, Any]]:
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(
            f"{run_dir} is not a cnftrace run directory (no config.json). Create one "
            "with `cnftrace train --run-dir DIR`."
        )
    config = read_config(path)
    checkpoints = os.path.join(run_dir, "checkpoints")
    shape = _event_shape(checkpoints)
    if shape is None or len(shape) != 1:
        raise CheckpointError(f"no usable checkpoint in {checkpoints}.")
    flow = run_flow(config, jr.key(config["seed"]), shape[0])
    params, static = eqx.partition(flow, eqx.is_inexact_array)
    opt_state = run_optimizer(config).init(params)
    like = (params, opt_state, jr.key_data(jr.key(config["seed"])), params)
    found = latest_good_checkpoint(
        checkpoints, like, warn=lambda m: warnings.warn(m, stacklevel=3)
    )
    if found is None:
        raise CheckpointError(f"no usable checkpoint in {checkpoints}.")
    step, (_, _, _, best), _ = found  # the best (or, untracked, the last)
    flow = eqx.combine(best, static)
    transform = run_standardization(config)
    if transform is not None:
        flow = StandardizedFlow(flow, transform)
    return flow, {"config": config, "step": step, "transform": transform}
