"""`cnftrace eval`, `sample`, `plot` and `datasets`: what the command line does with
a trained run, and the list of data sets."""

import json
import math
import os
import stat
import sys

import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._checks import memory_limit, seed_key
from .._io import atomic_write, file_kind
from ..datasets import DataSource
from ..runs import LoadedRun, load_run
from ..store import _history
from ..training import evaluate_nll
from ._checks import (
    CommandFailed,
    UsageError,
    check_fits_in_memory,
    nearest_existing,
    warnings_said,
)
from ._data import eval_size, list_datasets, run_source, write_samples


def _load(run_dir: str, need_data: bool = True) -> tuple[LoadedRun, DataSource | None]:
    """A trained run and its data source (for a run on a data file, `None` unless
    `need_data`); the checkpoints skipped are reported, one line each."""
    with warnings_said():
        run = load_run(run_dir)
    source = None
    if need_data or run.config.data_file is None:
        source = run_source(run.config)
    return run, source


def cmd_datasets(args) -> int:
    rows = [("name", "dim", "size", "entropy", "what")]
    rows += list_datasets(args.data_dir)
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(w) for cell, w in zip(row[1:4], widths[1:])]
        print("  ".join(cells + [row[4]]))
    return 0


def _check_writable(run_dir: str, path: str, fix: str) -> None:
    """A `CommandFailed` naming `path`, before any work, where the command could not
    write it at its end (the nearest existing directory must be writable, the name
    not taken by something other than a regular file); `fix`: the way round."""
    if not os.path.isdir(run_dir):
        return  # `load_run` says what it is
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        kind = file_kind(os.lstat(path).st_mode)
        raise CommandFailed(f"cannot write {path}: it is {kind}; move it, or {fix}.")
    directory = nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(directory):
        raise CommandFailed(
            f"cannot write {path}: {directory} is not a directory; move it, or {fix}."
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CommandFailed(
            f"cannot write {path}: {directory} is read-only to this user; make it "
            f"writable (chmod u+w {directory}), or {fix}."
        )


def cmd_eval(args) -> int:
    eval_json = os.path.join(args.run_dir, "eval.json")
    _check_writable(args.run_dir, eval_json, "evaluate a copy of the run")
    run, source = _load(args.run_dir)
    config, flow, step = run.config, run.flow, run.step
    if source.fixed_test and args.seed != EVAL_SEED:
        raise UsageError(
            f"--seed {args.seed} does nothing here: it draws the test samples of a "
            "toy set and the dequantisation noise of images, and the test split of "
            f"{source.name} is fixed (by the run's --split-seed); drop it."
        )
    n = eval_size(source, args.n)
    check_fits_in_memory("--n", n, source.dim)
    test = source.test(args.seed, n)
    nll = evaluate_nll(flow, test)  # data on the host: standardised in float64
    shown = config.data if isinstance(config.data, str) else config.data[0]
    result = {
        "step": step,
        "data": config.data,
        "test_nll": nll.mean,
        "stderr": nll.stderr,
        "nfe": nll.nfe,
        "n": int(test.shape[0]),
        **source.score(nll.mean, args.seed, n),
    }
    line = (
        f"{shown} at step {step}: test NLL {nll.mean:.4f} ± {nll.stderr:.4f} "
        f"nats (exact trace, n={result['n']})"
    )
    if "entropy" in result:
        result["gap"] = nll.mean - result["entropy"]
        line += f"; entropy {result['entropy']:.4f}; gap {result['gap']:.4f}"
    undefined = result.get("gaussian_baseline_undefined")
    if "gaussian_baseline_nll" in result:
        baseline = result["gaussian_baseline_nll"]
        line += "; full-covariance Gaussian " + (
            undefined if baseline is None else f"{baseline:.4f}"
        )
    if "bits_per_dim" in result:
        baseline = result.get("gaussian_baseline_bits_per_dim")
        shown = undefined if baseline is None else f"{baseline:.4f}"
        line += f"; {result['bits_per_dim']:.4f} bits/dim"
        if "gaussian_baseline_bits_per_dim" in result:
            line += f" (Gaussian baseline {shown})"
    print(line + f"; NFE {nll.nfe:.0f}")
    atomic_write(eval_json, json.dumps(result, indent=2).encode())
    return 0


def cmd_sample(args) -> int:
    out = args.out or os.path.join(args.run_dir, "samples.npy")
    _check_writable(args.run_dir, out, "pass --out a file in a writable directory")
    run, source = _load(args.run_dir, need_data=False)
    config, flow = run.config, run.flow
    dim = math.prod(flow.event_shape)
    rows = sample_chunk(dim)
    check_sample_fits(args.n, rows, dim, config.width, config.blocks, out)
    inner = flow if run.transform is None else flow.flow
    with warnings_said():  # a heavy-tailed base's draws out of range, say
        y = draw_samples(inner, seed_key(args.seed), args.n, rows)
    # The standardised flow's samples, mapped to the data's units in float64.
    x = y if run.transform is None else run.transform.inverse(y)
    names = None
    if config.data_file is not None:  # a run on files, sampled without reading them
        x, names = config.data_file.onto_grid(x), config.data_file.names
    else:
        x = source.as_data(x)  # images: pixel intensities in [0, 1]
    write_samples(out, x, names)
    print(f"wrote {args.n} samples of shape {x.shape[1:]} to {out}")
    return 0


# The seed `eval` draws its test samples with, unless --seed says otherwise.
EVAL_SEED = 12345
# `sample` draws at most this many numbers (rows times the dimension) per solve.
SAMPLE_CHUNK_NUMBERS = 2**21


def sample_chunk(dim: int) -> int:
    """The rows of one solve of `cnftrace sample`, from the dimension alone (never
    the machine), so that a seed and `--n` give the same samples everywhere."""
    return max(1, SAMPLE_CHUNK_NUMBERS // dim)


def draw_samples(flow, key, n: int, rows: int) -> np.ndarray:
    """`n` samples of `flow` on the host: `flow.sample(key, n)` up to `rows`, else
    solves of `rows` samples, the i-th from `jax.random.fold_in(key, i)`, so that
    the device holds one solve's buffers at a time."""
    if n <= rows:
        return np.asarray(flow.sample(key, n))
    parts = [
        np.asarray(flow.sample(jr.fold_in(key, i), rows)) for i in range(-(-n // rows))
    ]
    return np.concatenate(parts)[:n]


def check_sample_fits(n, rows, dim, width, blocks, out) -> None:
    """A `UsageError` where `sample --n N` cannot fit: one solve of `rows` samples
    on the device (about `6 * width + 12 * dim` numbers a sample), and the `n`
    samples on the host (24 bytes a number, 25 more in a text file)."""
    itemsize = jnp.dtype(jnp.result_type(float)).itemsize
    device = min(n, rows) * (6 * width * blocks + 12 * dim) * itemsize
    host = n * dim * (24 + (25 if not out.lower().endswith(".npy") else 0))
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limits = (memory_limit(), (memory, "this machine's memory"))
    for need, (limit, what) in zip((device, host), limits):
        if need > limit:
            raise UsageError(
                f"--n {n} cannot fit: {n} samples of dimension {dim} need at least "
                f"{need / 2**30:.3g} GiB, more than the {limit / 2**30:.3g} GiB of "
                f"{what}. Use a smaller --n (several runs of `sample` with other "
                "--seed values give more)."
            )


def read_metrics(run_dir: str) -> list[dict]:
    """The records of `RUN_DIR/metrics.jsonl`, each step once, in step order (see
    `store._history`)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    records = _history.read_records(
        path,
        needed=("step", "loss", "nfe"),  # what `plot_training_curves` draws
        warn=lambda m: print(f"cnftrace: {m}", file=sys.stderr),
    )
    return _history.dedupe(records)


def cmd_plot(args) -> int:
    from ..plot import (
        plot_flow_2d,
        plot_image_grid,
        plot_samples,
        plot_training_curves,
    )

    plots = os.path.join(args.run_dir, "plots")
    _check_writable(args.run_dir, os.path.join(plots, "training.png"), "plot a copy")
    run, source = _load(args.run_dir)
    config, flow, step = run.config, run.flow, run.step
    paths = []
    if source.image_shape is not None:
        samples = np.asarray(flow.sample(seed_key(args.seed + 1), 64))
        paths.append(
            plot_image_grid(
                source.as_data(samples),
                os.path.join(plots, "samples.png"),
                title=f"{config.data} samples, step {step}",
            )
        )
    elif not source.fixed_test:  # a toy set: fresh samples, and the density in 2-D
        data = source.test(args.seed, 20_000)
        samples = np.asarray(flow.sample(seed_key(args.seed + 1), 20_000))
        paths.append(
            plot_flow_2d(
                flow,
                data,
                samples,
                os.path.join(plots, "density.png"),
                title=f"{config.data}, step {step}",
            )
        )
    else:  # a table: the test rows beside as many samples, pair by pair
        data = source.test(args.seed, 0)
        samples = np.asarray(flow.sample(seed_key(args.seed + 1), data.shape[0]))
        names = None if config.data_file is None else config.data_file.names
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
        paths.append(
            plot_training_curves(
                records, os.path.join(plots, "training.png"), entropy=source.entropy
            )
        )
    for p in paths:
        print(f"wrote {p}")
    return 0
