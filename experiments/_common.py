"""The one helper module of the experiments and benchmarks: what two scripts share
lives here, and no script imports another, except `bench/run.py`, the suite, which
runs the sections `bench/b1.py` to `b4.py` in one process so that B1's ratios are
measured side by side. The peers' code is in `bench/zuko_peer.py` and
`bench/tfp_peer.py`, imported only where torch or TFP is installed.

- Results: `RESULTS`, `atomic_write` (a report, a JSON file or a figure is never left
  half-written), `write_results`, `markdown_table`, `figure_bytes`, `environment`.
- Timing: `time_call`, `mean_and_stderr`, `cores`.
- The benchmark protocol (`experiments/README.md`): B1's and B2's constants, B1's
  averaging window, B2's quality curve, and B1's model and training step
  (`b1_flow`, `b1_estimator`, `b1_data`, `cnftrace_b1`).
- Densities with a known log-density (`Target`, `gap_and_se`), cnftrace's default
  recipe on one (`cnftrace_default`: a B5 row), zuko at equal seconds
  (`zuko_at_seconds`, `zuko_peer_module`).
- The command line on a file (`cnftrace_cli`, `SPLIT`) and B5's real tables with
  their classical baselines (`TABLES`, `write_csv`, `gmm_bic`, `kde_cv`,
  `gaussian_log_prob`, `summary`).

Everything else the scripts need is cnftrace's public API (`cnftrace.mlp_flow`,
`cnftrace.warmup_cosine_adam`, `cnftrace.log_prob_batched`, `cnftrace.save`, ...).
They run from the repository root as `python -m experiments.<name>`.
"""

import csv
import io
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import cnftrace
from cnftrace.datasets import (
    KnownDensity,
    gaussian_mixture,
    rotated_product,
    toy_entropy,
    toy_log_prob,
    toy_sample,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def mean_and_stderr(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    stderr = values.std(ddof=1) / math.sqrt(values.size) if values.size > 1 else 0.0
    return float(values.mean()), float(stderr)


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence], align: str | None = None
) -> str:
    """A markdown table, its lines joined by newlines (no newline after the last).

    Cells are `str(cell)`; an empty cell is written `| |`. `align` has one letter per
    column, `l` (`---`) or `r` (`---:`); by default every column is `---`.
    """
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one 'l' or 'r' per column; got {align!r}.")

    def line(cells) -> str:
        return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"

    lines = [line(header), "|" + "".join({"l": "---|", "r": "---:|"}[a] for a in align)]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"{len(header)} columns, but a row has {len(cells)}.")
        lines.append(line(cells))
    return "\n".join(lines)


def time_call(
    fn: Callable, *args, repeats: int = 7, min_seconds: float = 0.05
) -> tuple[float, float]:
    """`(wall, cpu)`: the medians over `repeats` of the wall and the process CPU
    seconds of one call of `fn(*args)` (for an even `repeats`, the upper of the two
    middle values).

    The first call (compilation) is not timed. With `min_seconds > 0`, each repeat
    runs the call often enough to last about `min_seconds`, so that short calls are
    not lost in timer noise; with 0, each repeat is one call. On a shared machine the
    CPU time (all threads of this process) is the steadier measure of the work done;
    the wall time is what a user waits.
    """
    jax.block_until_ready(fn(*args))

    def run(number: int) -> tuple[float, float]:
        cpu = time.process_time()
        wall = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        wall = time.perf_counter() - wall
        return wall, time.process_time() - cpu

    number = 1
    while min_seconds > 0 and number < 10_000:
        elapsed, _ = run(number)
        if elapsed >= min_seconds:
            break
        number *= max(2, min(10, math.ceil(min_seconds / max(elapsed, 1e-9))))
    runs = [run(number) for _ in range(repeats)]
    return (
        statistics.median_high(w for w, _ in runs) / number,
        statistics.median_high(c for _, c in runs) / number,
    )


def environment() -> dict:
    """What the figures were measured on."""
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def atomic_write(path: str, data: bytes) -> None:
    """Writes `data` to `path` by way of a temporary file beside it and a rename, so
    a killed script never leaves half a report or figure (no fsync: a result can be
    computed again). The file gets the mode of one opened normally, not mkstemp's
    0600. Makes the missing parent directories."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    umask = os.umask(0)
    os.umask(umask)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask)
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def figure_bytes(fig, format: str = "png", **kwargs) -> bytes:
    """A matplotlib figure rendered in memory (`fig.savefig` to a buffer), for
    `atomic_write`."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=format, **kwargs)
    return buffer.getvalue()


# The benchmark figures' place and colours (`plots.py` and the scripts that draw their
# own figure).
DOCS_IMAGES = os.path.join(os.path.dirname(RESULTS), os.pardir, "docs", "images")
COLORS = {"cnftrace": "C0", "zuko NSF": "C1", "zuko CNF": "C2", "zuko": "C1"}


def plain_numbers(plt, axis, ticks) -> None:
    """A log axis labelled at `ticks` in plain numbers rather than powers of ten."""
    axis.set_major_locator(plt.FixedLocator(ticks))
    axis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(plt.NullFormatter())


def gap_axes(plt, ax, levels, ticks, xlabel: str, ylabel: str, title: str) -> None:
    """A panel of gaps against seconds: `levels` dashed, a log y axis labelled at
    `ticks` in plain numbers, the labels, a grid and the legend."""
    for level in levels:
        ax.axhline(level, color="grey", lw=0.8, ls="--")
    ax.set_yscale("log")
    plain_numbers(plt, ax.yaxis, ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def save_image_grid(path: str, images: np.ndarray, title: str) -> None:
    """Saves images of shape `(n, 1, h, w)` with values in [0, 1] as a square grid
    in a PNG (written to a temporary file first, then renamed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n, _, h, w = images.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = np.ones((rows * (h + 1) + 1, cols * (w + 1) + 1))
    for i, image in enumerate(images[:, 0]):
        r, c = divmod(i, cols)
        grid[1 + r * (h + 1) : 1 + r * (h + 1) + h, 1 + c * (w + 1) :][:, :w] = image
    fig, ax = plt.subplots(figsize=(0.5 * cols + 1, 0.5 * rows + 1))
    ax.imshow(grid, cmap="gray_r", vmin=0, vmax=1, interpolation="nearest")
    ax.set_axis_off()
    ax.set_title(title, fontsize=9)
    atomic_write(path, figure_bytes(fig, dpi=120, bbox_inches="tight"))
    plt.close(fig)


def write_results(stem: str, payload: dict, markdown: str) -> None:
    """Writes `<stem>.json` (`payload` and the `environment()`) and `<stem>.md`,
    each by `atomic_write` (a temporary file, then a rename)."""
    payload = dict(payload, environment=environment())
    atomic_write(stem + ".json", json.dumps(payload, indent=2).encode())
    atomic_write(stem + ".md", markdown.encode())


def progress() -> bool:
    """Show progress bars only on a terminal."""
    return sys.stderr.isatty()


# ----------------------------------------------------- the benchmark protocol
# B1 (toy training step): FFJORD's 8gaussians, 512 fresh samples per iteration, one
# CNF block with a ConcatSquash MLP 2 -> 64 -> 64 -> 64 -> 2 (tanh), time span
# [0, 0.5], an adaptive 5th-order Runge-Kutta solver at rtol = atol = 1e-5, Adam at
# lr 1e-3, float32; wall seconds per iteration averaged over iterations 21..120, the
# first step (compile) timed on its own. B2 (time to quality): the same model and
# data, the exact-trace test NLL on 5,000 held-out samples every 15 s of training
# time (evaluation not counted), against the data's true entropy.

B1_BATCH = 512
B1_ITERS = 120
B1_WINDOW = (21, 120)  # 1-based, inclusive: the iterations that are averaged
B1_WIDTH = 64
B1_DEPTH = 3
B1_T1 = 0.5
B1_TOL = 1e-5
B1_LR = 1e-3

B2_EVAL_EVERY_S = 15.0
B2_TEST_SIZE = 5000
B2_TEST_SEED = 2024
B2_GAPS = (0.15, 0.05)
# B2's floors (experiments/README.md): 8 well-separated Gaussians (sigma = 0.5 /
# 1.414), and the checkerboard's uniform density on an area of 32.
B2_FLOOR = {
    "8gaussians": math.log(8) + math.log(2 * math.pi * math.e * (0.5 / 1.414) ** 2),
    "checkerboard": math.log(32),
}


def window_values(values: list[float]) -> list[float]:
    """B1's window of a per-iteration series: iterations 21..120 (1-based), or, for a
    shorter run (a smoke test), iterations min(21, len) to the end."""
    if not values:
        raise ValueError("no iterations to average.")
    lo, hi = B1_WINDOW
    lo = min(lo, len(values))
    return values[lo - 1 : hi]


def window_avg(values: list[float]) -> float:
    """The mean of `window_values(values)`."""
    sel = window_values(values)
    return sum(sel) / len(sel)


def cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class QualityCurve:
    """B2's bookkeeping, the same for every system: when to evaluate (every
    `eval_every_s` seconds of training time), the curve of test NLLs, the training
    time of the first evaluation within each of `B2_GAPS` of the floor, the best gap,
    and whether to stop (the smallest gap reached)."""

    def __init__(self, dataset: str, eval_every_s: float):
        if dataset not in B2_FLOOR:
            raise ValueError(f"dataset must be one of {sorted(B2_FLOOR)}.")
        self.floor = B2_FLOOR[dataset]
        self.eval_every_s = eval_every_s
        self.next_eval = eval_every_s
        self.curve: list[tuple[float, float]] = []
        self.time_to_gap: dict[float, float | None] = dict.fromkeys(
            sorted(B2_GAPS, reverse=True)
        )
        self.best_gap = math.inf

    def due(self, train_s: float, budget_s: float) -> bool:
        return train_s >= self.next_eval or train_s >= budget_s

    def record(self, train_s: float, nll: float) -> bool:
        """Adds an evaluation; returns whether the smallest gap has been reached."""
        self.curve.append((train_s, nll))
        gap = nll - self.floor
        self.best_gap = min(self.best_gap, gap)
        for g, seconds in self.time_to_gap.items():
            if seconds is None and gap <= g:
                self.time_to_gap[g] = train_s
        while self.next_eval <= train_s:
            self.next_eval += self.eval_every_s
        return gap <= min(B2_GAPS)

    def result(self) -> dict:
        return {
            "curve": self.curve,
            "time_to_gap": self.time_to_gap,
            "best_gap": self.best_gap,
            "floor": self.floor,
        }


# -------------------------------------------------------- B1's model and step
# The step is what a user runs: `cnftrace.fit` on fresh 8gaussians batches, logging
# every step (so every step ends with a host sync, as a training loop that prints
# its loss does). Iteration times are the gaps between consecutive log records; the
# first step, which compiles, is timed from the call of `fit`.


def b1_flow(
    estimator: str,
    solver: str = "tsit5",
    seed: int = 0,
    jax_precision: bool = False,
) -> cnftrace.CNF:
    """B1's model: one block, ConcatSquash 2-64-64-64-2 (tanh), T = 0.5, float32.
    `jax_precision`: the field's products at JAX's default precision
    (`matmul_precision=None`: TensorFloat-32 on recent NVIDIA GPUs) rather than
    cnftrace's."""
    precision = {"matmul_precision": None} if jax_precision else {}
    if solver not in ("tsit5", "dopri5"):
        raise ValueError(f"solver must be 'tsit5' or 'dopri5'; got {solver!r}.")
    return cnftrace.mlp_flow(
        2,
        key=jr.key(seed),
        field="concatsquash",
        width=B1_WIDTH,
        depth=B1_DEPTH,
        t1=B1_T1,
        solver=solver,
        rtol=B1_TOL,
        atol=B1_TOL,
        estimator=b1_estimator(estimator),
        dtype=jnp.float32,
        **precision,
    )


def b1_estimator(name: str) -> cnftrace.AbstractEstimator:
    """B1's estimators by name: one Rademacher probe, or the exact trace."""
    if name == "exact":
        return cnftrace.Exact()
    if name == "hutchinson":
        return cnftrace.Hutchinson(1, "rademacher")
    raise ValueError(f"estimator must be 'exact' or 'hutchinson'; got {name!r}.")


def b1_data(key, n):
    """B1's data: `n` fresh 8gaussians samples in float32."""
    return toy_sample("8gaussians", key, n, dtype=jnp.float32)


def cnftrace_b1(
    estimator: str,
    iters: int = B1_ITERS,
    batch: int = B1_BATCH,
    solver: str = "tsit5",
    seed: int = 0,
    jax_precision: bool = False,
) -> dict:
    """B1 for cnftrace: seconds per iteration over B1's window, first-step time and
    NFE forward/backward per iteration (averaged over the window)."""
    if iters < 1:
        raise ValueError(f"iters must be positive; got {iters}.")
    flow = b1_flow(estimator, solver, seed, jax_precision)
    b1_data(jr.key(0), batch).block_until_ready()  # the sampler alone, not the step
    stamps: list[float] = []
    start = time.perf_counter()
    _, history = cnftrace.fit(
        flow,
        b1_data,
        key=jr.key(seed + 1),
        steps=iters,
        batch_size=batch,
        objective=cnftrace.MaximumLikelihood(b1_estimator(estimator), tolerance=None),
        optimizer=optax.adam(B1_LR),
        progress=False,
        on_log=lambda record: stamps.append(time.perf_counter()),
    )
    times = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
    system = f"cnftrace {cnftrace.__version__}"
    return {
        "system": system + (", JAX's matmul precision" if jax_precision else ""),
        "estimator": estimator,
        "solver": f"{solver}, PI control, max-over-samples RMS norm",
        "s_per_iter": window_avg(times),
        "first_step_s": times[0],
        "nfe_fwd": window_avg([float(n) for n in history["nfe"]]),
        "nfe_bwd": window_avg([float(n) for n in history["nfe_backward"]]),
        "iter_times": times,
    }


# ----------------------------------------- densities with a known log-density
# B4's named densities, B5's constructed ones (`warped_product(d)`), the gap of a
# model to the truth on held-out points, cnftrace's default recipe and zuko at
# equal seconds.

TEST_SEED = 4040
DENSITIES = ("product5", "mixture12", "8gaussians", "checkerboard", "rings")


class Target:
    """One density of B4 (or, given its `density`, any `KnownDensity`, as B5 does):
    its dimension, a sampler `(key, n) -> (n, d)` (JAX's default float), and the true
    log-density of test points (`None` where only the entropy is known)."""

    def __init__(self, name: str, density: KnownDensity | None = None):
        self.name = name
        if density is not None:
            pass
        elif name == "product5":
            density = rotated_product(5, seed=0)
        elif name == "mixture12":
            density = gaussian_mixture(12, components=6, seed=0)
        elif name in ("8gaussians", "checkerboard", "rings"):
            density = None
        else:
            raise ValueError(f"unknown B4 density {name!r}; choose from {DENSITIES}.")
        self.density = density
        self.dim = 2 if density is None else density.dim
        self.entropy = toy_entropy(name) if name == "rings" else None

    def sample(self, key, n):
        if self.density is None:
            return toy_sample(self.name, key, n)
        return self.density.sample(key, n)

    def true_log_prob(self, x) -> np.ndarray | None:
        if self.name == "rings":
            return None
        x64 = np.asarray(x, np.float64)
        if self.density is None:
            return np.asarray(toy_log_prob(self.name, x64), np.float64)
        return np.asarray(self.density.log_prob(x64), np.float64)

    def test_set(self, n: int):
        return self.sample(jr.key(TEST_SEED), n)


def gap_and_se(target: Target, test, model_logp: np.ndarray) -> tuple[float, float]:
    """The gap `model NLL - true NLL` on `test` and its (paired) standard error."""
    model_logp = np.asarray(model_logp, np.float64)
    if not np.all(np.isfinite(model_logp)):
        return math.inf, math.inf
    true = target.true_log_prob(test)
    if true is None:
        diff = -model_logp - target.entropy
    else:
        diff = true - model_logp
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(diff.size))


def zuko_at_seconds(
    zuko_peer,
    target: Target,
    test,
    seconds: float,
    model: str,
    batch: int = 512,
    device: str = "cpu",
) -> dict:
    """zuko's `model` ("cnf" or "nsf", see `zuko_peer.MODELS`) trained on fresh
    samples of `target`, `batch` a step, Adam 1e-3, for `seconds` training seconds
    on `device`, and its gap on `test`."""
    z = zuko_peer.zuko_b4(
        target.sample,
        target.dim,
        None,
        batch,
        np.asarray(test),
        max_train_s=seconds,
        model=model,
        device=device,
    )
    gap, se = gap_and_se(target, test, z["final_logp"])
    peer = {key: z[key] for key in ("system", "model", "train_s", "steps_done")}
    return dict(peer, batch=batch, gap=gap, gap_se=se)


def cnftrace_log_prob(flow, test, chunk: int = 2000) -> np.ndarray:
    """Per-point log-densities by the exact trace, `chunk` points per solve."""
    return cnftrace.log_prob_batched(flow, test, batch_size=chunk)


# B5's maximum-likelihood steps in the dims half (`b5.py --steps`); the plots mark
# the rows that trained otherwise.
B5_MLE_STEPS = 2000


def trained_by(recipe: dict) -> str:
    """`"flow matching, "` where a row's cnftrace `recipe` trained by flow matching,
    else `""`: how the tables and plots name `fit`'s choice (rows without an
    `objective` predate it and are maximum likelihood)."""
    return "flow matching, " if recipe.get("objective") == "fm" else ""


def architecture(flow) -> dict:
    """What a flow's default model turned out to be: the number of blocks, and the
    first block's field type, hidden widths and depth (read off its linear layers:
    every `eqx.nn.Linear` but the output one is a hidden layer), and the parameter
    count."""
    blocks = flow.blocks
    field = blocks[0].vector_field
    linears = [
        leaf
        for leaf in jax.tree_util.tree_leaves(
            field, is_leaf=lambda x: isinstance(x, eqx.nn.Linear)
        )
        if isinstance(leaf, eqx.nn.Linear)
    ]
    widths = [layer.out_features for layer in linears[:-1]]
    params = eqx.filter(flow, eqx.is_inexact_array)
    return {
        "blocks": len(blocks),
        "field": type(field).__name__,
        "width": widths[0] if len(set(widths)) == 1 else widths,
        "depth": len(widths),
        "params": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
    }


def cnftrace_default(target: Target, steps: int, test, seed: int = 0) -> dict:
    """The README's recipe on `target` with `fit`'s defaults (only `steps` given):
    training seconds (compile included), the exact-trace gap, and the recipe the
    defaults picked (the objective `fit` chose for the dimension, and the batch, read
    off the sizes `fit` asks the sampler for)."""
    chosen = cnftrace.default_recipe(target.dim)
    model_key, train_key = jr.split(jr.key(seed))
    flow = cnftrace.mlp_flow(target.dim, key=model_key)
    sizes = set()

    def sample(key, n):
        sizes.add(int(n))
        return target.sample(key, n)

    start = time.perf_counter()
    # Only the progress bar is not fit's default: shown on a terminal, not in a log.
    trained, history = cnftrace.fit(
        flow, sample, key=train_key, steps=steps, progress=progress()
    )
    train_s = time.perf_counter() - start
    gap, se = gap_and_se(target, test, cnftrace_log_prob(trained, test))
    recipe = dict(architecture(flow), objective=chosen.objective, steps=steps)
    recipe["batch"] = max(sizes)
    recipe["sampler_sizes"] = sorted(sizes)  # fit's shape check asks for 2 first
    return {
        "system": f"cnftrace {cnftrace.__version__}",
        "recipe": recipe,
        "train_s": train_s,
        "gap": gap,
        "gap_se": se,
        "loss_last": float(history["loss"][-1]),
        "nfe_last": history["nfe"][-1],
    }


def zuko_peer_module():
    """zuko's peer module, or the reason it cannot be imported (no bench extra)."""
    try:
        from experiments.bench import zuko_peer
    except ImportError as e:
        return None, str(e)
    return zuko_peer, None


def load_results(stem: str) -> dict:
    """The rows of the last run written at `stem` (.json), or none."""
    try:
        with open(stem + ".json") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


# ------------------------------------------------- the command line on a file
# `cnftrace train --data FILE` with no flags, as B5's files half runs it.

SPLIT = dict(val_fraction=0.1, test_fraction=0.1, seed=0)  # the command line's


def _cli(args, log) -> tuple[float, str]:
    """Runs `python -m cnftrace ARGS` in a process of its own (importing the cnftrace
    this one imports); its wall seconds and output. A failure raises with the output."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(cnftrace.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "cnftrace", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wall = time.perf_counter() - start
    with open(log, "a") as f:
        f.write(f"$ cnftrace {shlex.join(args)}\n{done.stdout}")
    if done.returncode != 0:
        raise RuntimeError(
            f"cnftrace {shlex.join(args)} failed ({done.returncode}):\n{done.stdout}"
        )
    return wall, done.stdout


def cnftrace_cli(path: str, run_dir: str, train_args=()) -> dict:
    """`cnftrace train --data PATH --run-dir RUN_DIR` (plus `train_args`, empty for
    the benchmark), then `cnftrace eval RUN_DIR`: the test NLL of eval.json, the
    training seconds of metrics.jsonl (compile included, validation not), the
    settings the run's defaults picked, and how far it trained."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a run directory would be resumed
    os.makedirs(run_dir)
    log = os.path.join(run_dir, "..", "commands.log")
    train = ["train", "--data", path, "--run-dir", run_dir, *train_args]
    train_wall, output = _cli(train, log)
    eval_wall, _ = _cli(["eval", run_dir], log)
    with open(os.path.join(run_dir, "eval.json")) as f:
        evaluation = json.load(f)
    with open(os.path.join(run_dir, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    vals = [r for r in records if "val_nll" in r]
    records = [r for r in records if "loss" in r]  # a validation has its own line
    settings = ("field", "blocks", "width", "depth", "steps", "batch_size", "lr")
    settings += ("base", "base_components", "zero_last")
    return {
        "system": f"cnftrace {cnftrace.__version__}",
        "command": "cnftrace " + shlex.join(train),
        "recipe": {k: config.get(k) for k in settings + ("patience",)},
        "steps_done": records[-1]["step"],
        "train_s": records[-1]["seconds"],
        "train_command_s": train_wall,
        "eval_command_s": eval_wall,
        "best_val_step": min(vals, key=lambda r: r["val_nll"])["step"]
        if vals
        else None,
        "eval": evaluation,
        "nll": evaluation["test_nll"],
        "stderr": evaluation["stderr"],
        "output_tail": output.strip().splitlines()[-3:],
    }


# ---------------------------------------------------------------- real tables
# B5's real tables and their classical baselines: measurement tables that installed
# packages ship (scikit-learn's bundled CSVs, matplotlib's sample data, statsmodels'
# and vega_datasets' tables; nothing is downloaded), a CSV writer that keeps every
# value exactly, and the baselines a user would fit first (a full-covariance
# Gaussian, a Gaussian mixture chosen by BIC, a KDE with a cross-validated
# bandwidth), each returning per-row test log-densities.

GMM_COMPONENTS = range(1, 9)
KDE_BANDWIDTHS = np.logspace(-2, 0.5, 26)  # in the units of the rows given


def _sklearn_table(name: str):
    import sklearn.datasets as skd

    if name == "diabetes":
        bunch = skd.load_diabetes(scaled=False)  # diabetes_data_raw.csv.gz
    else:
        bunch = getattr(skd, f"load_{name}")()
    return np.asarray(bunch.data, np.float64), list(bunch.feature_names)


def _iris():
    return _sklearn_table("iris")


def _wine():
    return _sklearn_table("wine")


def _breast_cancer():
    return _sklearn_table("breast_cancer")


def _diabetes():
    data, names = _sklearn_table("diabetes")
    keep = [j for j, n in enumerate(names) if n != "sex"]
    return data[:, keep], [names[j] for j in keep]


def _sample_data(name: str) -> str:
    import matplotlib

    return os.path.join(matplotlib.get_data_path(), "sample_data", name)


STOCKS = ("IBM", "AAPL", "MSFT", "XRX", "ADBE", "^GSPC", "^IXIC")


def _stocks():
    with open(_sample_data("Stocks.csv"), newline="") as f:
        rows = [r for r in csv.reader(f) if r and not r[0].startswith("#")]
    header, rows = rows[0], rows[1:]
    cols = [header.index(name) for name in STOCKS]
    prices = [[float(r[j]) for j in cols] for r in rows if all(r[j] for j in cols)]
    # The last row repeats the one before (the month's close, written twice).
    prices = np.asarray(
        [p for i, p in enumerate(prices) if i == 0 or p != prices[i - 1]]
    )
    return 100 * np.diff(np.log(prices), axis=0), [f"{n} monthly %" for n in STOCKS]


def _goog():
    with np.load(_sample_data("goog.npz")) as f:
        p = f["price_data"]
    data = np.stack(
        [
            100 * np.diff(np.log(p["adj_close"])),
            100 * np.log(p["high"] / p["low"])[1:],
            np.log10(p["volume"].astype(np.float64))[1:],
        ],
        axis=1,
    )
    return data, ["return %", "high/low range %", "log10 volume"]


def _statsmodels(name: str):
    import statsmodels.api as sm

    return getattr(sm.datasets, name).load_pandas().data


def _engel():
    frame = _statsmodels("engel")
    return frame.to_numpy(np.float64), ["income", "food expenditure"]


MACRO = ("realgdp", "realcons", "realinv", "realgovt", "realdpi", "cpi", "m1")


def _macro():
    frame = _statsmodels("macrodata")
    levels = frame[list(MACRO)].to_numpy(np.float64)
    return 100 * np.diff(np.log(levels), axis=0), [f"{n} growth %" for n in MACRO]


def _vega(name: str):
    from vega_datasets import local_data

    return getattr(local_data, name)()


CARS = ("Miles_per_Gallon", "Displacement", "Horsepower", "Weight_in_lbs")
CARS += ("Acceleration",)


def _cars():
    frame = _vega("cars")[list(CARS)].dropna()
    return frame.to_numpy(np.float64), list(CARS)


def _seattle():
    columns = ["precipitation", "temp_max", "temp_min", "wind"]
    return _vega("seattle_weather")[columns].to_numpy(np.float64), columns


def _airports():
    columns = ["latitude", "longitude"]
    return _vega("airports")[columns].to_numpy(np.float64), columns


# name -> (loader, where it comes from, what the table holds)
TABLES = {
    "iris": (_iris, "scikit-learn iris.csv", "four flower measurements (cm)"),
    "wine": (_wine, "scikit-learn wine_data.csv", "13 chemical measurements"),
    "breast_cancer": (
        _breast_cancer,
        "scikit-learn breast_cancer.csv",
        "30 features of cell nuclei images",
    ),
    "diabetes": (
        _diabetes,
        "scikit-learn diabetes_data_raw.csv.gz",
        "age, BMI, blood pressure, six serum measurements (the binary sex column "
        "left out: a continuous density on two values has no finite optimum)",
    ),
    "stocks": (
        _stocks,
        "matplotlib sample_data/Stocks.csv",
        "monthly log returns (%) 1990-2022 of the seven series quoted throughout "
        "(IBM, AAPL, MSFT, XRX, ADBE, S&P 500, Nasdaq); prices are a trending "
        "series, not draws from one density",
    ),
    "goog": (
        _goog,
        "matplotlib sample_data/goog.npz",
        "Google's daily log return (%), intraday high/low range (%) and log10 "
        "volume, 2004-2008",
    ),
    # Added for issue 42 (the bench extra installs statsmodels and vega_datasets).
    "engel": (
        _engel,
        "statsmodels datasets.engel",
        "Belgian households' income and food expenditure, 1857 (heavy right tails)",
    ),
    "macro": (
        _macro,
        "statsmodels datasets.macrodata",
        "US quarterly growth (%) of real GDP, consumption, investment, government "
        "spending, disposable income, CPI and M1, 1959-2009",
    ),
    "cars": (
        _cars,
        "vega_datasets cars.json",
        "mpg, displacement, horsepower, weight and acceleration of 392 cars (rows "
        "with a missing value left out)",
    ),
    "seattle": (
        _seattle,
        "vega_datasets seattle-weather.csv",
        "Seattle's daily precipitation (zero on most days), maximum and minimum "
        "temperature and wind, 2012-2015",
    ),
    "airports": (
        _airports,
        "vega_datasets airports.csv",
        "latitude and longitude of 3,376 US airports (clustered by geography)",
    ),
}


def write_csv(path: str, data: np.ndarray, names) -> None:
    """The table as a CSV under a header, every value written exactly (17 digits)."""
    lines = [",".join(n.replace(",", ";") for n in names)]
    lines += [",".join(f"{v:.17g}" for v in row) for row in data]
    atomic_write(path, ("\n".join(lines) + "\n").encode())


def summary(logp: np.ndarray) -> dict:
    """The mean NLL of per-row log-densities and its standard error."""
    nll = -np.asarray(logp, np.float64)
    return {
        "nll": float(nll.mean()),
        "stderr": float(nll.std(ddof=1) / len(nll) ** 0.5),
    }


def gaussian_log_prob(train: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per-row log-densities of `test` under the full-covariance Gaussian fitted to
    `train` by maximum likelihood, with 1e-6 added to the covariance's diagonal (as
    `cnftrace.datasets.gaussian_baseline_nll` does), in float64."""
    mean = train.mean(axis=0)
    cov = np.cov(train, rowvar=False, bias=True).reshape(train.shape[1], -1)
    chol = np.linalg.cholesky(cov + 1e-6 * np.eye(train.shape[1]))
    z = np.linalg.solve(chol, (test - mean).T).T
    log_det = 2 * np.sum(np.log(np.diag(chol)))
    return (
        -0.5 * np.sum(z**2, axis=1)
        - 0.5 * log_det
        - 0.5 * z.shape[1] * np.log(2 * np.pi)
    )


def gmm_bic(train: np.ndarray, test: np.ndarray, seed: int = 0) -> dict:
    """A full-covariance Gaussian mixture of 1-8 components (at most one per two
    training rows), the count chosen by BIC on `train`; per-row log-densities of
    `test` (in the units of the rows given)."""
    from sklearn.mixture import GaussianMixture

    fits = {}
    for k in GMM_COMPONENTS:
        if k > train.shape[0] // 2:
            break
        gmm = GaussianMixture(k, covariance_type="full", n_init=3, random_state=seed)
        fits[k] = gmm.fit(train)
    bic = {k: float(g.bic(train)) for k, g in fits.items()}
    k = min(bic, key=bic.get)
    return {"components": k, "bic": bic, "test_logp": fits[k].score_samples(test)}


def kde_cv(train: np.ndarray, test: np.ndarray, seed: int = 0) -> dict:
    """A Gaussian-kernel density estimate of `train`, its bandwidth (of
    `KDE_BANDWIDTHS`) chosen by 5-fold cross-validated log-likelihood on `train`;
    per-row log-densities of `test`. `at_edge` says the choice is the grid's end."""
    from sklearn.model_selection import GridSearchCV, KFold
    from sklearn.neighbors import KernelDensity

    search = GridSearchCV(
        KernelDensity(kernel="gaussian"),
        {"bandwidth": KDE_BANDWIDTHS},
        cv=KFold(5, shuffle=True, random_state=seed),
    ).fit(train)
    h = float(search.best_params_["bandwidth"])
    edge = h in (KDE_BANDWIDTHS[0], KDE_BANDWIDTHS[-1])
    kde = search.best_estimator_
    return {"bandwidth": h, "at_edge": edge, "test_logp": kde.score_samples(test)}
