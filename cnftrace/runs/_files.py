"""Saving and loading flows: a file of arrays (`save`), or the run directory of
`cnftrace train` (`config.json` and `checkpoints/`), rebuilt from its settings."""

import io
import os
import pathlib
import warnings
from typing import NamedTuple

import equinox as eqx
import jax.random as jr

from .._io import FileKindError, atomic_write, read_regular_file
from ..datasets import Standardization
from ..flows import AbstractFlow, StandardizedFlow
from ..store import CheckpointError
from ..store._checkpoint import (
    deserialise,
    latest_good_checkpoint,
    list_checkpoints,
    read_header,
    same_value,
)
from ._build import run_flow, run_optimizer, run_standardization
from ._config import RunConfig, read_config


def save(path: str, flow: AbstractFlow) -> str:
    """Writes the arrays of `flow` to `path` with `equinox.tree_serialise_leaves`,
    atomically. Returns `path`. Read it back with
    [`load`][cnftrace.load]`(path, like=...)`, `like` a flow of the same
    architecture (its values do not matter).

    !!! example

        ```python
        flow = cnftrace.mlp_flow(2, key=jr.key(0), width=16, depth=1)
        cnftrace.save("flow.eqx", flow)
        ```
    """
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, flow)
    atomic_write(path, buffer.getvalue())
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

    The flow; with `return_info`, a pair `(flow, info)`. A run on a standardised
    data file comes back as a [`StandardizedFlow`][cnftrace.StandardizedFlow]
    working in the data's own units (`info["transform"]` is its
    [`Standardization`][cnftrace.Standardization]).

    A file or checkpoint that does not fit, or a run directory where a checkpoint
    holds other settings than `config.json`, raises
    [`CheckpointError`][cnftrace.CheckpointError] naming each difference; a missing
    path raises `FileNotFoundError`.

    !!! example

        ```python
        settings = dict(width=16, depth=1)
        cnftrace.save("flow.eqx", cnftrace.mlp_flow(2, key=jr.key(0), **settings))
        like = cnftrace.mlp_flow(2, key=jr.key(1), **settings)  # any values
        flow = cnftrace.load("flow.eqx", like=like)
        samples = flow.sample(jr.key(2), 100)
        ```
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            "`path` must be a file written by `cnftrace.save` or the run directory of "
            f"`cnftrace train` (a str or a pathlib.Path); got {path!r:.80}."
        )
    path = os.fspath(path)
    if os.path.isdir(path):
        run = load_run(path)
        flow = run.flow
        info = {"config": run.config.stored(), "step": run.step}
        info |= {"transform": run.transform}
    else:
        flow = _load_file(path, like)
        info = {"config": None, "step": None, "transform": None}
    return (flow, info) if return_info else flow


def _load_file(path: str, like: AbstractFlow | None) -> AbstractFlow:
    if not os.path.lexists(path) and pathlib.Path(path).suffix == "":
        # `save` writes the path it is given; equinox's own writer adds `.eqx`.
        if os.path.lexists(f"{path}.eqx"):
            path = f"{path}.eqx"
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"{path} does not exist: give `load` a file written by `cnftrace.save` "
            "(with `like=`), or the run directory of `cnftrace train`."
        )
    try:
        data = read_regular_file(path)
    except FileKindError as e:
        raise CheckpointError(str(e)) from None
    _check_saved_flow(path, data)
    if like is None:
        raise ValueError(
            f"{path} is a file of arrays; pass `like=`, a flow of the same "
            "architecture to load them into (or give a run directory)."
        )
    try:
        return deserialise(data, like, path)
    except CheckpointError as e:
        raise CheckpointError(
            f"{path} does not hold the arrays of a flow like `like` ({e}); was it "
            "saved from a flow of another architecture?"
        ) from None


def _check_saved_flow(path: str, data: bytes) -> None:
    """A `CheckpointError` where a file is surely not one `save` wrote: a training
    checkpoint, or a file that does not begin as NumPy's (a data table)."""
    if data.startswith(b"cnftrace-checkpoint ") or data.startswith(b'{"step"'):
        run = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        raise CheckpointError(
            f"{path} is a training checkpoint (of `cnftrace train` or `fit`), not a "
            "file written by `cnftrace.save`: load the run it belongs to, "
            f"`cnftrace.load({run!r})` (the directory above its checkpoints/), or save "
            "the flow you trained with `cnftrace.save(path, flow)`."
        )
    if not data.startswith(b"\x93NUMPY"):
        first = data[:40].decode("utf-8", errors="replace").split("\n")[0]
        raise CheckpointError(
            f"{path} is not a file written by `cnftrace.save` (it begins {first!r}, "
            "not with the arrays equinox writes: a data table?). Give `load` a file "
            "written by `cnftrace.save` (with `like=`), or the run directory of "
            "`cnftrace train`."
        )


def _checked_checkpoints(
    config: RunConfig, config_path: str, checkpoints: str
) -> tuple[tuple[int, ...] | None, str | None]:
    """The event shape and parameter dtype in the newest readable checkpoint's
    header, once every readable checkpoint in `checkpoints` is found to hold the
    settings of `config_path` (a `CheckpointError` naming the differences
    otherwise: a directory that mixes runs is not trusted)."""
    shape, dtype, mismatched = None, None, []
    for _, path in reversed(list_checkpoints(checkpoints)):
        try:
            header, _ = read_header(path)
        except (CheckpointError, OSError):
            continue
        saved = header.get("config")
        saved = saved if isinstance(saved, dict) else {}
        diffs = _setting_differences(saved, config)
        if diffs:
            mismatched.append((path, diffs))
        elif shape is None and isinstance(saved.get("fit.event_shape"), list):
            shape = tuple(saved["fit.event_shape"])
            floats = [
                leaf[1]
                for leaf in header.get("leaves", [])
                if isinstance(leaf, list) and leaf[1:] in (["float32"], ["float64"])
            ]
            dtype = floats[0] if floats else None
    if mismatched:
        (path, diffs), more = mismatched[0], len(mismatched) - 1
        raise _mismatch(config_path, path, diffs, more)
    return shape, dtype


def _mismatch(config_path: str, path: str, diffs: list[str], more: int = 0):
    others = f" (and {more} more of its checkpoints)" if more else ""
    return CheckpointError(
        f"{config_path} does not hold the settings of {path}{others}: "
        + "; ".join(diffs)
        + ". config.json was edited, or another run's checkpoint was copied in; "
        "restore config.json (or the run's own checkpoints), or train these "
        "settings in a new --run-dir."
    )


def _setting_differences(saved: dict, config: RunConfig) -> list[str]:
    """The settings where a checkpoint's config differs from `config`, as readable
    lines (its `fit.` keys aside)."""
    settings = {k: v for k, v in saved.items() if not k.startswith("fit.")}
    try:
        there = RunConfig.from_stored(settings, "the checkpoint").compared()
    except CheckpointError:  # unknown or missing settings: compared as they are
        there = settings
    here = config.compared()

    def shown(values: dict, name: str) -> str:
        text = repr(values[name]) if name in values else "nothing"
        return text if len(text) <= 60 else text[:57] + "..."

    return [
        f"{name} is {shown(there, name)} in the checkpoint, {shown(here, name)} in "
        "config.json"
        for name in sorted(set(there) | set(here))
        if name not in there
        or name not in here
        or not same_value(there[name], here[name])
    ]


class LoadedRun(NamedTuple):
    """A trained run as `load_run` reads it."""

    flow: AbstractFlow
    config: RunConfig
    step: int
    transform: Standardization | None


def load_run(run_dir: str) -> LoadedRun:
    """The flow of a run directory, rebuilt from its settings with the (best)
    parameters of its newest good checkpoint, its settings, the step and the data's
    standardisation; a `CheckpointError` saying what is missing or wrong."""
    if not os.path.lexists(run_dir):
        raise FileNotFoundError(
            f"{run_dir} does not exist: give the run directory of `cnftrace train` "
            "(its --run-dir)."
        )
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(
            f"{run_dir} is not a cnftrace run directory (no config.json). Create one "
            "with `cnftrace train --run-dir DIR`."
        )
    config = read_config(path)
    checkpoints = os.path.join(run_dir, "checkpoints")
    shape, dtype = _checked_checkpoints(config, path, checkpoints)
    if shape is None or len(shape) != 1:
        raise CheckpointError(f"no usable checkpoint in {checkpoints}.")
    flow = run_flow(config, jr.key(config.seed), shape[0], dtype=dtype)
    params, static = eqx.partition(flow, eqx.is_inexact_array)
    opt_state = run_optimizer(config).init(params)
    like = (params, opt_state, jr.key_data(jr.key(config.seed)), params)
    found = latest_good_checkpoint(
        checkpoints, like, warn=lambda m: warnings.warn(m, stacklevel=3)
    )
    if found is None:
        raise CheckpointError(f"no usable checkpoint in {checkpoints}.")
    step, (_, _, _, best), header = found  # the best (or, untracked, the last)
    saved = header.get("config")
    diffs = _setting_differences(saved if isinstance(saved, dict) else {}, config)
    if diffs:  # a file swapped in since the check above
        raise _mismatch(path, f"the checkpoint of step {step} in {checkpoints}", diffs)
    flow = eqx.combine(best, static)
    transform = run_standardization(config)
    if transform is not None:
        flow = StandardizedFlow(flow, transform)
    return LoadedRun(flow, config, step, transform)
