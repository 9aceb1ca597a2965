"""The `cnftrace` command line: train, eval, sample, plot, datasets.

Each training run lives in its own directory:

    RUN_DIR/config.json       the settings (the model is rebuilt from them; for a
                              data file, its SHA-256, split and standardisation)
    RUN_DIR/metrics.jsonl     one JSON record per logged step
    RUN_DIR/checkpoints/      the newest checkpoints (model, optimiser, step, key)
    RUN_DIR/plots/            pictures written by `cnftrace plot` (and after training)
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .. import training
from .._io import atomic_write
from ..datasets import ALL_DATASETS, DataSource, digits_from_logit, toy_entropy
from ..flows import ACTIVATIONS, DEFAULT_ACTIVATION, FIELDS, SOLVERS, AbstractFlow
from ..runs import MODEL_KEYS, load, read_config, run_flow, run_objective, run_optimizer
from ..training import (
    CheckpointError,
    Checkpoints,
    DirectoryLock,
    TrainingError,
    Validation,
    check_batch_size,
    data_mesh,
    enable_compilation_cache,
    evaluate_nll,
    fit,
    is_main_process,
    same_value,
)
from ._checks import (
    CommandFailed,
    UsageError,
    check_args,
    check_fits_in_memory,
    check_model_fits_in_memory,
    check_run_dir,
)
from ._data import (
    changed_files,
    list_datasets,
    run_source,
    score_report,
    training_source,
    write_samples,
)

# Default length and batch size of training, per data set where the general default
# falls short. checkerboard's sharp edges need more and less noisy steps.
_RECIPES = {
    None: {"steps": 2400, "batch_size": 128},
    "checkerboard": {"steps": 8000, "batch_size": 256},
}
_BUILT_IN = set(ALL_DATASETS)


def _load_run(
    run_dir: str, need_data: bool = True
) -> tuple[dict, AbstractFlow, int, DataSource | None]:
    """A trained run (by `cnftrace.load`) with its config, step and data source (for
    a run on a data file, `None` unless `need_data`: sampling needs no data)."""
    if not os.path.isdir(run_dir):
        raise CheckpointError(
            f"{run_dir} is not a cnftrace run directory (no config.json). Create one "
            "with `cnftrace train --run-dir DIR`."
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flow, info = load(run_dir, return_info=True)
    for w in caught:  # skipped checkpoints, say: one line each
        print(f"cnftrace: {w.message}", file=sys.stderr)
    config = info["config"]
    source = None
    if need_data or config.get("data_file") is None:
        source = run_source(config)
    return config, flow, info["step"], source


def cmd_datasets(args) -> int:
    rows = [("name", "dim", "size", "entropy", "what")]
    rows += list_datasets(args.data_dir)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(w) for cell, w in zip(row[1:4], widths[1:])]
        print("  ".join(cells + [row[4]]))
    return 0


def apply_recipe(args) -> None:
    """Fills the training settings left unset (`None`) with the data set's defaults:
    early stopping (after 10 validations without improvement) for a data file and
    the sets of `--data-dir`; none, as always, for the other built-in sets."""
    recipe = _RECIPES.get(args.data if isinstance(args.data, str) else None)
    for name, value in (recipe or _RECIPES[None]).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.patience is None and not (
        isinstance(args.data, str) and args.data in _BUILT_IN
    ):
        args.patience = 10


def _parse_tolerance(value: str) -> float | None:
    if value.lower() == "none":
        return None
    try:
        tol = float(value)
    except ValueError:
        tol = math.nan
    if not (math.isfinite(tol) and tol > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive tolerance or 'none', got {value!r}"
        )
    return tol


def _parse_devices(value: str) -> int | str:
    if value == "all":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"expected 'all' or a number of devices >= 1, got {value!r}"
        )
    return n


def _training_mesh(args):
    """The mesh of `--devices` (all devices with `--distributed`), or `None` for one
    device."""
    devices = args.devices
    if devices is None:
        if not args.distributed:
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
        check_batch_size(args.batch_size, mesh.size, ("--batch-size", "--devices"))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return mesh


def _initialize_distributed() -> None:
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


def _write_config(run_dir: str, config: dict) -> None:
    """Writes `config.json`, after checking that a run already there has the same
    settings."""
    path = os.path.join(run_dir, "config.json")
    if os.path.lexists(path):
        old = read_config(path)
        changed = changed_files(old, config)
        if changed:
            raise UsageError(
                f"{run_dir} was trained on a data file that has changed since: "
                + "; ".join(changed)
                + ". Resuming would train on other data: restore the file, or "
                "train on it in a new --run-dir."
            )
        diffs = [k for k in MODEL_KEYS if not same_value(old.get(k), config[k])]
        if diffs:
            raise UsageError(
                f"{run_dir} holds a run with other settings ("
                + ", ".join(
                    f"{k}: {old.get(k)!r} there, {config[k]!r} now" for k in diffs
                )
                + "). Use another --run-dir, or the same settings to resume."
            )
    atomic_write(path, json.dumps(config, indent=2).encode())


class _Metrics:
    """`metrics.jsonl`, one record per step. Before this run's first record, the
    records from its step on are cut away: those a killed run logged after its last
    checkpoint, which this run takes again. So every step is in the file once."""

    def __init__(self, path: str):
        self.path = path
        self.log = None

    def write(self, record: dict) -> None:
        if self.log is None:
            training.truncate(self.path, record["step"] - 1)
            self.log = training.Log(self.path)
        self.log.write(record)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def cmd_train(args) -> int:
    apply_recipe(args)
    if args.activation is None:
        args.activation = DEFAULT_ACTIVATION[args.field]
    check_run_dir(args.run_dir)
    mesh = _training_mesh(args)
    # Every data file is read and checked here, before anything is written.
    source, data_config = training_source(args)
    config = {k: getattr(args, k, None) for k in MODEL_KEYS} | data_config
    check_fits_in_memory("--batch-size", args.batch_size, source.dim)
    check_model_fits_in_memory(args)
    key = jr.key(args.seed)
    model_key, train_key = jr.split(key)
    # Everything is checked (the model too) before anything is written.
    flow = run_flow(config, model_key, source.dim)
    settings = dict(
        key=train_key,
        objective=run_objective(config),
        optimizer=run_optimizer(config),
        mesh=mesh,
    )
    lock = contextlib.nullcontext()
    if is_main_process():
        lock = DirectoryLock(args.run_dir, "run directory")
    with lock:
        _write_config(args.run_dir, config)
        history, start = _train(args, config, source, flow, settings)
    done = history["step"][-1] if history["step"] else args.steps
    stopped = "" if done >= args.steps else f" (stopped early, of {args.steps})"
    loss = f"final loss {history['loss'][-1]:.4f}"
    if start is None:
        print(f"{args.run_dir} had already trained {done} steps{stopped}; {loss}")
    else:
        resumed = f" (resumed at step {start})" if start else ""
        print(f"trained {done} steps{stopped}{resumed}; {loss}")
    return 0


def _train(args, config, source, flow, settings) -> tuple[dict, int | None]:
    """`fit` on the run directory: its history, and the step this process started
    training from (0 for a new run; `None` where the run had already finished)."""
    tty = sys.stderr.isatty() and not args.no_progress
    metrics = _Metrics(os.path.join(args.run_dir, "metrics.jsonl"))
    last = {"t": time.perf_counter()}
    start = None

    def on_log(record):
        nonlocal start
        if start is None:
            start = record["step"] - 1
        now = time.perf_counter()
        record = dict(record, step_seconds=now - last["t"])
        last["t"] = now
        metrics.write(record)
        if not tty and record["step"] % args.print_every == 0:
            print(
                f"step {record['step']:>7}/{args.steps}  loss {record['loss']:.4f}"
                f"  nfe {record['nfe']}/{record['nfe_backward']} (fwd/bwd)"
                f"  {record['seconds']:.1f}s",
                flush=True,
            )

    validation = None
    if source.validation is not None:
        validation = Validation(
            source.validation,
            every=args.checkpoint_every,
            patience=args.patience or None,
        )
    try:
        _, history = fit(
            flow,
            source.train,
            steps=args.steps,
            batch_size=args.batch_size,
            validation=validation,
            checkpoints=Checkpoints(
                os.path.join(args.run_dir, "checkpoints"),
                every=args.checkpoint_every,
                config=config,
            ),
            progress=tty,
            on_log=on_log,
            **settings,
        )
    finally:
        metrics.close()
    return history, start


def cmd_eval(args) -> int:
    config, flow, step, source = _load_run(args.run_dir)
    check_fits_in_memory("--n", args.n, source.dim)
    test = source.test(args.seed, args.n)
    nll = evaluate_nll(flow, test)
    shown = config["data"] if isinstance(config["data"], str) else config["data"][0]
    result = {
        "step": step,
        "data": config["data"],
        "test_nll": nll.mean,
        "stderr": nll.stderr,
        "nfe": nll.nfe,
        "n": int(test.shape[0]),
        **score_report(source, nll.mean, args.seed, args.n),
    }
    if source.kind == "file":
        result["units"] = "data"  # log_prob in the file's own units, scaling included
    line = (
        f"{shown} at step {step}: test NLL {nll.mean:.4f} ± {nll.stderr:.4f} "
        f"nats (exact trace, n={result['n']})"
    )
    if "entropy" in result:
        result["gap"] = nll.mean - result["entropy"]
        line += f"; entropy {result['entropy']:.4f}; gap {result['gap']:.4f}"
    if "gaussian_baseline_nll" in result:
        line += f"; full-covariance Gaussian {result['gaussian_baseline_nll']:.4f}"
    if "bits_per_dim" in result:
        line += (
            f"; {result['bits_per_dim']:.4f} bits/dim (Gaussian baseline "
            f"{result['gaussian_baseline_bits_per_dim']:.4f})"
        )
    print(line + f"; NFE {nll.nfe:.0f}")
    atomic_write(
        os.path.join(args.run_dir, "eval.json"), json.dumps(result, indent=2).encode()
    )
    return 0


def cmd_sample(args) -> int:
    config, flow, _, source = _load_run(args.run_dir, need_data=False)
    check_fits_in_memory("--n", args.n, math.prod(flow.event_shape))
    x = np.asarray(flow.sample(jr.key(args.seed), args.n))  # in the data's units
    if source is not None and source.kind == "images":
        # Pixel intensities in [0, 1].
        x = digits_from_logit(x).reshape(args.n, *source.image_shape)
    out = args.out or os.path.join(args.run_dir, "samples.npy")
    names = (config.get("data_file") or {}).get("names")
    write_samples(out, x, names)
    print(f"wrote {args.n} samples of shape {x.shape[1:]} to {out}")
    return 0


def read_metrics(run_dir: str) -> list[dict]:
    """The records of `RUN_DIR/metrics.jsonl`, each step once (the last record of a
    step, for files written before resuming cut them back)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    return training.dedupe(training.read_records(path))


def cmd_plot(args) -> int:
    from ..plot import (
        plot_flow_2d,
        plot_image_grid,
        plot_samples,
        plot_training_curves,
    )

    config, flow, step, source = _load_run(args.run_dir)
    plots = os.path.join(args.run_dir, "plots")
    paths = []
    if source.kind == "toy":
        data = source.test(args.seed, 20_000)
        samples = np.asarray(flow.sample(jr.key(args.seed + 1), 20_000))
        paths.append(
            plot_flow_2d(
                flow,
                data,
                samples,
                os.path.join(plots, "density.png"),
                title=f"{config['data']}, step {step}",
            )
        )
    elif source.kind == "images":
        samples = np.asarray(flow.sample(jr.key(args.seed + 1), 64))
        paths.append(
            plot_image_grid(
                digits_from_logit(samples).reshape(64, *source.image_shape),
                os.path.join(plots, "samples.png"),
                title=f"{config['data']} samples, step {step}",
            )
        )
    else:  # a table: the test rows beside as many samples, pair by pair
        data = source.test(args.seed, 0)
        samples = np.asarray(flow.sample(jr.key(args.seed + 1), data.shape[0]))
        names = (config.get("data_file") or {}).get("names")
        paths.append(
            plot_samples(
                data,
                samples,
                os.path.join(plots, "samples.png"),
                names=names,
                title=f"test rows and samples, step {step}",
            )
        )
    records = read_metrics(args.run_dir)
    if records:
        entropy = toy_entropy(config["data"]) if source.kind == "toy" else None
        paths.append(
            plot_training_curves(
                records, os.path.join(plots, "training.png"), entropy=entropy
            )
        )
    for p in paths:
        print(f"wrote {p}")
    return 0


class _Exit(SystemExit):
    """Ends the command with exit status `status` once its one-line message is
    printed; `str()` of it is the message."""

    def __init__(self, message: str, status: int):
        super().__init__(status)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit status 2."""

    def error(self, message):
        print(
            f"{self.prog}: error: {message} (see `{self.prog} --help`)",
            file=sys.stderr,
        )
        raise _Exit(message, 2)


class _DataAction(argparse.Action):
    """`--data`: one name or file is kept as a string, several files as a list."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(values) == 1 else list(values))


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cnftrace",
        description="Train, evaluate and sample continuous normalizing flows.",
    )
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, show the full traceback (otherwise one line)",
    )
    parser.add_argument("--debug", action="store_true", help=debug._actions[0].help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = lambda *a, **k: sub.add_parser(*a, parents=[debug], **k)  # noqa: E731

    p = add_parser("train", help="train a flow (a built-in data set or your file)")
    p.add_argument(
        "--data",
        "--dataset",
        dest="data",
        default="8gaussians",
        nargs="+",
        action=_DataAction,
        metavar="NAME|FILE",
        help="a built-in data set (`cnftrace datasets` lists them), or one or more "
        "files of samples (.csv, .tsv, .npy, .npz, .parquet; several are stacked)",
    )
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="where MAF's UCI sets (power, gas, hepmass, miniboone, bsds300) and "
        "MNIST's files are",
    )
    p.add_argument(
        "--columns",
        metavar="A,B,...",
        help="the columns of a data file to train on, by header name or 0-based "
        "position (default: all)",
    )
    p.add_argument("--array", metavar="NAME", help="the array of a .npz file")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="share of a data file's rows held out for validation (0: none)",
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=0.1,
        help="share of a data file's rows held out for `cnftrace eval`",
    )
    p.add_argument(
        "--split-seed",
        type=int,
        default=0,
        help="picks a data file's train/validation/test split",
    )
    p.add_argument(
        "--no-standardize",
        action="store_true",
        help="train on a data file's values as they are (by default each column is "
        "standardised by its training mean and standard deviation, and `eval`, "
        "`sample` and `cnftrace.load` undo it)",
    )
    p.add_argument(
        "--patience",
        type=int,
        default=None,
        help="stop after this many validations without improvement (0: never; "
        "default 10 for a data file and the --data-dir sets, never for the others)",
    )
    p.add_argument("--run-dir", required=True, help="directory of this run")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="total optimiser steps (default: 2400; 8000 for checkerboard)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="fresh samples per step (default: 128; 256 for checkerboard)",
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--clip", type=float, default=10.0, help="gradient-norm clip")
    p.add_argument("--blocks", type=int, default=1, help="number of CNF blocks")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=3, help="hidden layers per block")
    p.add_argument(
        "--field",
        default="mlp",
        choices=list(FIELDS),
        help="vector field: an MLP with sinusoidal time features (mlp, the default) "
        "or FFJORD's ConcatSquash layers (concatsquash)",
    )
    p.add_argument(
        "--activation",
        default=None,
        choices=sorted(ACTIVATIONS),
        help="default: silu for --field mlp, tanh for concatsquash",
    )
    p.add_argument("--t1", type=float, default=0.5, help="integration time")
    p.add_argument(
        "--learn-t1",
        action="store_true",
        help="train the integration time too (FFJORD's train_T), starting at --t1",
    )
    p.add_argument(
        "--kinetic-energy",
        type=float,
        default=0.0,
        metavar="WEIGHT",
        help="RNODE weight of the kinetic energy integral (0: off)",
    )
    p.add_argument(
        "--jacobian-norm",
        type=float,
        default=0.0,
        metavar="WEIGHT",
        help="RNODE weight of the Jacobian Frobenius-norm integral (0: off)",
    )
    p.add_argument(
        "--objective",
        default="mle",
        choices=["mle", "fm", "ot-fm"],
        help="maximum likelihood through the ODE solve (mle), conditional flow "
        "matching (fm), or flow matching with minibatch optimal-transport pairing "
        "(ot-fm); flow matching needs no solve in training",
    )
    p.add_argument(
        "--fm-sigma",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="width of flow matching's Gaussian paths at the data end, in [0, 1)",
    )
    p.add_argument("--solver", default="tsit5", choices=sorted(SOLVERS))
    p.add_argument(
        "--rtol", type=float, default=1e-5, help="solver tolerance of the model"
    )
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument(
        "--train-tol",
        type=_parse_tolerance,
        default=1e-3,
        metavar="TOL|none",
        help="solver rtol = atol in maximum-likelihood training (default 1e-3; 'none' "
        "trains at --rtol/--atol); evaluation and sampling use --rtol/--atol",
    )
    p.add_argument(
        "--estimator",
        default="rademacher",
        choices=["rademacher", "gaussian", "sphere", "exact"],
        help="trace estimator in training (evaluation always uses the exact trace)",
    )
    p.add_argument("--num-probes", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--print-every", type=int, default=50, help="log lines (no tty)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines")
    p.add_argument(
        "--devices",
        type=_parse_devices,
        default=None,
        metavar="N|all",
        help="train data-parallel on the first N devices, or all of them (the batch "
        "size must be a multiple of the number; default: one device)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-host run via jax.distributed.initialize (one process per "
        "host; see the docs' scaling page)",
    )
    p.set_defaults(func=cmd_train)

    p = add_parser("eval", help="exact-trace test NLL of a trained run")
    p.add_argument("run_dir")
    p.add_argument("--n", type=int, default=5000, help="test samples")
    p.add_argument("--seed", type=int, default=12345, help="seed of the test set")
    p.set_defaults(func=cmd_eval)

    p = add_parser("sample", help="draw samples from a trained run (.npy or .csv)")
    p.add_argument("run_dir")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        help="output file, .npy, .csv or .tsv by its extension (default "
        "RUN_DIR/samples.npy); samples are in the data's units",
    )
    p.set_defaults(func=cmd_sample)

    p = add_parser("plot", help="density, samples and training curves (PNG)")
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_plot)

    p = add_parser("datasets", help="list the data sets, with --data-dir those there")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="also list MAF's UCI sets and MNIST, found (or not) in DIR",
    )
    p.set_defaults(func=cmd_datasets)
    return parser


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _failure(e: BaseException) -> tuple[int, str]:
    """The exit status and the one-line message for an error that ends a command."""
    if isinstance(e, UsageError):
        return 2, _one_line(str(e))
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted; what was checkpointed is kept."
    expected = (CommandFailed, CheckpointError, TrainingError, ValueError, TypeError)
    if isinstance(e, expected):
        return 1, _one_line(str(e))
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        message = f"{e.strerror or e}{where}"
        if e.errno == 28:  # ENOSPC
            message += "; free some space and run the same command to resume"
        return 1, message
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return 1, f"{type(e).__name__}: {first} (run with --debug for the traceback)"


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    try:
        check_args(args)
        if getattr(args, "distributed", False):
            _initialize_distributed()  # before anything else touches JAX
        # Compiled programs are stored on disk: a second run, a resume, `eval` and
        # `sample` of a trained run load them instead of compiling again.
        enable_compilation_cache()
        jnp.zeros(())
        return args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        if args.debug:
            raise
        status, message = _failure(e)
        print(f"cnftrace: error: {message}", file=sys.stderr)
        raise _Exit(message, status) from None


if __name__ == "__main__":
    sys.exit(main())
