"""`cnftrace train`: a run directory's settings checked and written, then `fit` on
it, resuming where a run there stopped. The directory holds `config.json`,
`metrics.jsonl` (the history), `checkpoints/`, `plots/` and `.lock` (see the docs'
training page)."""

import contextlib
import dataclasses
import json
import os
import sys

import jax
import jax.random as jr

from .._checks import seed_key
from .._io import atomic_write
from ..flows import fit_base
from ..runs import RunConfig, read_config, run_flow, run_objective, run_optimizer
from ..store._lock import DirectoryLock
from ..training import Checkpoints, Validation, data_mesh, fit
from ..training._parallel import check_batch_size, is_main_process
from ._arguments import run_config
from ._checks import (
    CommandFailed,
    UsageError,
    check_fits_in_memory,
    check_model_fits_in_memory,
    check_probes_fit_in_memory,
    check_run_dir,
)
from ._data import as_pinned, training_source


def cmd_train(args) -> int:
    config = run_config(args).resolved()  # checked by `check_args`
    check_run_dir(config.run_dir)
    if config.minutes is not None and config.distributed:
        raise UsageError(
            "--minutes stops on one process's clock, which the other processes do "
            "not share: train a --distributed run for --steps."
        )
    mesh = _training_mesh(config)
    # Every data file is read and checked here, before anything is written.
    source, pinned = training_source(config)
    existing = _existing_run(config.run_dir)
    config = as_pinned(dataclasses.replace(config, **pinned), existing)
    if existing is not None:  # the seconds it has trained, until it stops again
        config = dataclasses.replace(config, seconds=existing.seconds)
    # What the default recipe leaves to the data: its dimension and training rows.
    rows = None if source.reference is None else int(source.reference.shape[0])
    config = config.for_data(source.dim, rows, existing)
    base, config = _fitted_base(config, source, existing)
    check_fits_in_memory("--batch-size", config.batch_size, source.dim)
    check_model_fits_in_memory(config)
    check_probes_fit_in_memory(config, source.dim)
    model_key, train_key = jr.split(seed_key(config.seed))
    # Everything is checked (the model too) before anything is written.
    flow = run_flow(config, model_key, source.dim, base=base)
    settings = dict(
        key=train_key,
        objective=run_objective(config),
        optimizer=run_optimizer(config),
        mesh=mesh,
    )
    lock = contextlib.nullcontext()
    if is_main_process():
        lock = DirectoryLock(config.run_dir, "run directory")
    with lock:
        # Said once the run is sure to start: a refused run prints only its error.
        if config.recipe is not None:
            print(f"recipe: {config.recipe}", flush=True)
        _write_config(config)
        history, start = _train(config, source, flow, settings)
        seconds = history.get("seconds")  # the run's training seconds, kept
        if seconds:  # in config.json too
            config = dataclasses.replace(config, seconds=seconds[-1])
            path = os.path.join(config.run_dir, "config.json")
            atomic_write(path, json.dumps(config.stored(), indent=2).encode())
    done, loss = _last_step(config, history)
    stopped = ""
    if config.minutes is not None:
        stopped = f" in {config.seconds or 0:.0f} s of {config.minutes:g} minutes"
    elif done < config.steps:
        stopped = f" (stopped early, of {config.steps})"
    if start is None:
        print(f"{config.run_dir} had already trained {done} steps{stopped}; {loss}")
    else:
        resumed = f" (resumed at step {start})" if start else ""
        print(f"trained {done} steps{stopped}{resumed}; {loss}")
    return 0


def _fitted_base(config: RunConfig, source, existing: RunConfig | None):
    """`(base, config)`: the base distribution fitted to the (standardised) training
    rows, `None` for the standard normal, and the settings with the base recorded.
    A resumed run fits it again; its checkpoint's parameters then replace it."""
    kind = config.base_to_fit(existing)
    if kind == "normal":
        return None, config.with_base("normal", None, "standard normal", existing)
    base, info = fit_base(
        source.to_model(source.reference),
        validation=source.validation,
        kind=kind,
        seed=config.seed % 2**32,
        return_info=True,
    )
    kind, components = info["kind"], info.get("components")
    return base, config.with_base(kind, components, info["reason"], existing)


def _training_mesh(config: RunConfig):
    """The mesh of `--devices` (all devices with `--distributed`), or `None` for one
    device."""
    devices = config.devices
    if devices is None:
        if not config.distributed:
            return None
        devices = "all"  # a multi-host run trains on every process's devices
    available = len(jax.devices())
    if devices != "all" and devices > available:
        raise UsageError(
            f"--devices {devices} asks for more devices than the "
            f"{available} available; pass --devices all or a number up to {available}."
        )
    mesh = data_mesh(None if devices == "all" else devices)
    try:
        check_batch_size(config.batch_size, mesh.size, ("--batch-size", "--devices"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return mesh


def initialize_distributed() -> None:
    """`jax.distributed.initialize` from the environment: JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES and JAX_PROCESS_ID where set, JAX's own detection (SLURM, Open
    MPI, Cloud TPU) for the rest."""
    numbers = {}
    for name, var in (
        ("num_processes", "JAX_NUM_PROCESSES"),
        ("process_id", "JAX_PROCESS_ID"),
    ):
        value = os.environ.get(var)
        if value is not None:
            try:
                numbers[name] = int(value)
            except ValueError:
                raise UsageError(f"{var}={value!r} is not an integer.") from None
    try:
        jax.distributed.initialize(**numbers)
    except (ValueError, RuntimeError) as e:
        raise CommandFailed(
            f"--distributed could not join the cluster: {e}. Outside SLURM, "
            "Open MPI or Cloud TPU, set JAX_COORDINATOR_ADDRESS=host:port (process "
            "0's address), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process."
        ) from None


def _existing_run(run_dir: str) -> RunConfig | None:
    """The settings of the run already in `run_dir`, or `None` for a new one."""
    path = os.path.join(run_dir, "config.json")
    return read_config(path) if os.path.lexists(path) else None


def _write_config(config: RunConfig) -> None:
    """Writes `config.json`, after checking that a run already there has the same
    settings."""
    run_dir = config.run_dir
    path = os.path.join(run_dir, "config.json")
    if os.path.lexists(path):
        old = read_config(path)
        files = old.data_file is not None and config.data_file is not None
        changed = old.data_file.changed_files(config.data_file) if files else []
        if changed:
            raise UsageError(
                f"{run_dir} was trained on a data file that has changed since: "
                + "; ".join(changed)
                + ". Resuming would train on other data: restore the file, or "
                "train on it in a new --run-dir."
            )
        diffs = config.differences(old)
        if files:  # resuming would train on other rows
            diffs += old.data_file.changed_settings(config.data_file)
        if diffs:
            raise UsageError(
                f"{run_dir} holds a run with other settings ({', '.join(diffs)}). "
                "Use another --run-dir, or the same settings to resume."
                + _other_steps(old, config)
            )
    atomic_write(path, json.dumps(config.stored(), indent=2).encode())


def _train(config: RunConfig, source, flow, settings) -> tuple[dict, int | None]:
    """`fit` on the run directory: its history, and the step this process started
    training from (0 for a new run; `None` where the run had already finished)."""
    tty = sys.stderr.isatty() and not config.no_progress
    start = None

    def on_log(record):
        nonlocal start
        if "loss" not in record:  # the validation of the flow as it starts
            if not tty:
                print(f"step       0  val_nll {record['val_nll']:.4f}", flush=True)
            return
        if start is None:
            start = record["step"] - 1
        if not tty and record["step"] % config.print_every == 0:
            of = "" if config.steps is None else f"/{config.steps}"
            print(
                f"step {record['step']:>7}{of}  loss {record['loss']:.4f}"
                f"  nfe {record['nfe']}/{record['nfe_backward']} (fwd/bwd)"
                f"  {record['seconds']:.1f}s",
                flush=True,
            )

    validation = None
    if source.validation is not None:
        validation = Validation(
            source.validation,
            every=config.checkpoint_every,
            patience=config.patience or None,
        )
    # One history file and one lock for the run: `fit` writes metrics.jsonl, and the
    # run directory's lock, held by the caller, covers the checkpoints.
    checkpoints = Checkpoints(
        os.path.join(config.run_dir, "checkpoints"),
        every=config.checkpoint_every,
        config=config.compared(),
        history=os.path.join(config.run_dir, "metrics.jsonl"),
        lock=False,
    )
    _, history = fit(
        flow,
        source.train,
        steps=config.steps,
        seconds=None if config.minutes is None else 60 * config.minutes,
        batch_size=config.batch_size,
        validation=validation,
        checkpoints=checkpoints,
        progress=tty,
        on_log=on_log,
        **settings,
    )
    return history, start


def _other_steps(old: RunConfig, new: RunConfig) -> str:
    """Why `--steps` (or `--minutes`) cannot change on a run, and what trains it for
    longer."""
    if old.minutes != new.minutes:
        return (
            " --minutes is part of a run: its learning rate follows a cosine schedule "
            f"over its {old.minutes} minutes, and the same command resumes it with "
            "the minutes it has left. To train longer, use a new --run-dir."
        )
    if old.steps == new.steps:
        return ""
    return (
        " --steps is part of a run: its learning rate follows a cosine schedule "
        f"over all of its {old.steps} steps, so a run of {new.steps} steps follows "
        "another schedule from its first step, and this run cannot be continued "
        f"into it exactly. To train {new.steps} steps, run this command with a new "
        f"--run-dir (e.g. --run-dir {new.run_dir.rstrip(os.sep)}-{new.steps})."
    )


def _last_step(config: RunConfig, history: dict) -> tuple[int, str]:
    """The last step trained and the words for its loss, from `fit`'s history."""
    if history["step"]:
        return history["step"][-1], f"final loss {history['loss'][-1]:.4f}"
    done = config.steps or 0
    return done, "no final loss: the run's history file, metrics.jsonl, is gone"
