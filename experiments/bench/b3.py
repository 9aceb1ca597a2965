"""B3 (`experiments/README.md`): how cnftrace's cost grows with the work.

Three measurements, each a function that returns plain rows (lists of dicts) so that a
report can render them (`markdown` does):

- `divergence_cost`: one batched evaluation of the CNF dynamics against the dimension
    d, for the bare network f, the Hutchinson divergence (one Rademacher probe) and
    the exact divergence. Hutchinson should cost a constant multiple of f; exact
    about d times f.
- `step_time_vs_batch`: one jitted training step (NLL, gradient, Adam update) of the
    B1 model against the batch size, with the forward solve's NFE.
- `memory_vs_steps`: the memory of one gradient step against the number of solver
    steps, per diffrax adjoint, from XLA's compile-time buffer assignment
    (`Compiled.memory_analysis()`), with a constant step size so that the number of
    steps is exactly what we ask for.

Everything runs in float32, set explicitly (the test suite turns on x64).

    python -m experiments.bench.b3 [--quick] [--rss] [--pretrain-steps N]
"""

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import cnftrace
from cnftrace.datasets import toy_sample
from experiments._common import (
    B1_DEPTH,
    B1_LR,
    B1_T1,
    B1_WIDTH,
    b1_estimator,
    b1_flow,
    markdown_table,
    time_call,
)

DTYPE = jnp.float32
WIDTH = B1_WIDTH
DEPTH = B1_DEPTH
T1 = B1_T1
LR = B1_LR
ADJOINTS = {
    "recursive_checkpoint": diffrax.RecursiveCheckpointAdjoint,
    "direct": diffrax.DirectAdjoint,
    "backsolve": diffrax.BacksolveAdjoint,
}
MIB = 2.0**20
# The repository root, from which `rss_peak`'s child imports this module.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------- helpers


_estimator = b1_estimator


def _field(dim: int, width: int, depth: int, seed: int) -> cnftrace.ConcatSquashMLP:
    return cnftrace.ConcatSquashMLP(dim, width, depth, key=jr.key(seed), dtype=DTYPE)


def log_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The growth exponent between the first and last point: `y ~ x^slope`."""
    return math.log(ys[-1] / ys[0]) / math.log(xs[-1] / xs[0])


def default_checkpoints(max_steps: int) -> int:
    """How many checkpoints `diffrax.RecursiveCheckpointAdjoint(checkpoints=None)`
    stores for a solve of `max_steps` steps: equinox's checkpointed while loop picks the
    smallest c with `2 max_steps < (c + 1)(c + 2)`, about `sqrt(2 max_steps)` (not
    `log2(max_steps)`), and never more than `max_steps`."""
    if max_steps == 1:
        return 1
    c = math.floor(-1.5 + math.sqrt(2 * max_steps + 0.25)) + 1
    return min(c, max_steps)


def _std_normal_log_prob(z: jax.Array) -> jax.Array:
    return -0.5 * jnp.sum(z**2, axis=-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)


# ------------------------------------------------------- 1. divergence against d


@eqx.filter_jit
def _field_only(field, t, z):
    return jax.vmap(lambda z_i: field(t, z_i, None))(z)


@eqx.filter_jit
def _augmented(term, t, z, args):
    return term.vf(t, term.initial_state(z), args)


def divergence_cost(
    dims: Sequence[int] = (2, 4, 8, 16, 32, 64, 128, 256),
    batch: int = 512,
    width: int = WIDTH,
    depth: int = DEPTH,
    repeats: int = 7,
    min_seconds: float = 0.05,
    seed: int = 0,
) -> list[dict]:
    """Microseconds per batched evaluation of the CNF dynamics against the dimension.

    For each `d`, on a batch of `batch` samples and `ConcatSquashMLP(d, width, depth)`:
    the plain network f (vmapped over the batch), and the network together with its
    divergence as the solver calls it (`cnftrace.CNFTerm.vf`, probes drawn once
    beforehand), with one Rademacher Hutchinson probe and with the exact trace.
    `*_us` are CPU microseconds, `*_wall_us` wall microseconds (see `time_call`); the
    ratios are of CPU times. `exact_over_hutchinson_per_d` near a constant means the
    exact trace costs about d Hutchinson evaluations.
    """
    rows = []
    t = jnp.asarray(0.25, DTYPE)
    for d in dims:
        key_data, key_probe = jr.split(jr.key(seed + d))
        field = _field(d, width, depth, seed)
        z = jr.normal(key_data, (batch, d), DTYPE)
        hutch = cnftrace.CNFTerm(field, _estimator("hutchinson"))
        exact = cnftrace.CNFTerm(field, _estimator("exact"))
        calls = {
            "f": (_field_only, field, t, z),
            "hutchinson": (_augmented, hutch, t, z, hutch.make_args(z, key=key_probe)),
            "exact": (_augmented, exact, t, z, exact.make_args(z)),
        }
        row: dict = {"dim": d}
        for name, call in calls.items():
            wall, cpu = time_call(*call, repeats=repeats, min_seconds=min_seconds)
            row[f"{name}_us"] = 1e6 * cpu
            row[f"{name}_wall_us"] = 1e6 * wall
        row["hutchinson_over_f"] = row["hutchinson_us"] / row["f_us"]
        row["exact_over_f"] = row["exact_us"] / row["f_us"]
        row["exact_over_hutchinson_per_d"] = row["exact_us"] / row["hutchinson_us"] / d
        rows.append(row)
    return rows


def divergence_growth(rows: list[dict]) -> dict:
    """Growth exponents in d, between the smallest and the largest d, of each time."""
    dims = [r["dim"] for r in rows]
    return {
        name: log_slope(dims, [r[name] for r in rows])
        for name in ("f_us", "hutchinson_us", "exact_us")
    }


# ------------------------------------------------- 2. step time against batch


def _trainer(optimizer, dataset: str, batch: int, key) -> cnftrace.Trainer:
    """B1's step for `batch` samples (`cnftrace.Trainer`): draw a batch, value and
    gradient of the mean NLL (with the forward NFE), Adam update. Step `i` of a state
    draws from `fold_in(key, i)`."""
    return cnftrace.Trainer(
        lambda k, n: toy_sample(dataset, k, n, dtype=DTYPE),
        key=key,
        # B1's protocol: the solver at the model's own 1e-5 in training too.
        objective=cnftrace.MaximumLikelihood(tolerance=None),
        optimizer=optimizer,
        batch_size=batch,
    )


def step_time_vs_batch(
    batches: Sequence[int] = (128, 256, 512, 1024, 2048, 4096, 8192),
    iters: int = 10,
    estimator: str = "hutchinson",
    dataset: str = "8gaussians",
    pretrain_steps: int = 0,
    seed: int = 0,
) -> list[dict]:
    """Wall time of one jitted training step of B1's model against the batch size.

    One step draws a fresh batch of `dataset`, takes the value and gradient of the
    mean NLL (trace from `estimator`) and computes an Adam update. Every timed call
    starts from the same parameters (the update is computed, not applied), so NFE
    differences come from the data alone: the freshly initialised ones, or those after
    `pretrain_steps` training steps at batch 512, whose dynamics need more steps. The
    step-size controller takes the max over samples of each sample's error, so bigger
    batches tend to need as many steps or more.

    Reports the medians over `iters` calls of the wall and CPU seconds per step,
    wall microseconds per sample, the mean (min, max) forward NFE, and the first
    call's wall time (tracing and compilation included).
    """
    flow = b1_flow(estimator, seed=seed)
    optimizer = optax.adam(LR)
    state = _trainer(optimizer, dataset, 512, jr.key(seed + 2)).init(flow)
    if pretrain_steps:
        train = _trainer(optimizer, dataset, 512, jr.key(seed + 2))
        for _ in range(pretrain_steps):
            state, _ = train.step(state)
    rows = []
    for batch in batches:
        trainer = _trainer(
            optimizer, dataset, batch, jr.fold_in(jr.key(seed + 1), batch)
        )
        # Step `i` of the state draws from `fold_in(key, i)`: the timed calls start
        # from the same parameters with the step number, so the batch, changed.
        at = lambda i: eqx.tree_at(lambda s: s.step, state, jnp.asarray(i))  # noqa: E731
        start = time.perf_counter()
        jax.block_until_ready(trainer.step(at(0)))
        first_s = time.perf_counter() - start
        walls, cpus, nfes = [], [], []
        for i in range(iters):
            timed = at(i + 1)
            wall, cpu = time.perf_counter(), time.process_time()
            _, info = jax.block_until_ready(trainer.step(timed))
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            nfes.append(int(info["nfe"]))
        seconds = statistics.median(walls)
        nfe = statistics.fmean(nfes)
        rows.append(
            {
                "batch": batch,
                "pretrain_steps": pretrain_steps,
                "seconds_per_step": seconds,
                "cpu_seconds_per_step": statistics.median(cpus),
                "us_per_sample": 1e6 * seconds / batch,
                "nfe_forward": nfe,
                "nfe_min": min(nfes),
                "nfe_max": max(nfes),
                "us_per_sample_per_nfe": 1e6 * seconds / batch / nfe,
                "first_call_s": first_s,
            }
        )
    return rows


# --------------------------------------------- 3. memory against solver steps


def _gradient_step(
    adjoint: str,
    num_steps: int,
    batch: int,
    dim: int,
    estimator: str,
    seed: int,
):
    """A jitted gradient of the mean NLL through exactly `num_steps` Tsit5 steps of
    constant size (`cnftrace.CNF` always adapts its step, so the solve is built here
    from `cnftrace.CNFTerm`), with its arguments."""
    if adjoint not in ADJOINTS:
        raise ValueError(
            f"`adjoint` must be one of {tuple(ADJOINTS)}; got {adjoint!r}."
        )
    field = _field(dim, WIDTH, DEPTH, seed)
    params, static = eqx.partition(field, eqx.is_inexact_array)
    term_estimator = _estimator(estimator)
    data_key, probe_key = jr.split(jr.key(seed + 1))
    if dim == 2:
        x = toy_sample("8gaussians", data_key, batch, dtype=DTYPE)
    else:
        x = jr.normal(data_key, (batch, dim), DTYPE)
    probes = term_estimator.draw(probe_key, x.shape, x.dtype)

    def loss(params, x, probes):
        term = cnftrace.CNFTerm(eqx.combine(params, static), term_estimator)
        sol = diffrax.diffeqsolve(
            term,
            diffrax.Tsit5(),
            # float32 times, or under x64 diffrax would promote the state to float64.
            jnp.asarray(0.0, DTYPE),
            jnp.asarray(T1, DTYPE),
            jnp.asarray(T1 / num_steps, DTYPE),
            term.initial_state(x),
            args=cnftrace.CNFArgs(args=None, probes=probes),
            stepsize_controller=diffrax.ConstantStepSize(),
            adjoint=ADJOINTS[adjoint](),
            max_steps=num_steps,
            saveat=diffrax.SaveAt(t1=True),
        )
        z, delta_logp = sol.ys
        logp = _std_normal_log_prob(z[0]) - delta_logp[0]
        return -jnp.mean(logp), sol.stats["num_steps"]

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return grad, (params, x, probes)


def memory_vs_steps(
    num_steps: Sequence[int] = (8, 16, 32, 64, 128, 256),
    adjoints: Sequence[str] = ("recursive_checkpoint", "direct", "backsolve"),
    batch: int = 512,
    dim: int = 2,
    estimator: str = "hutchinson",
    execute: bool = True,
    seed: int = 0,
) -> list[dict]:
    """XLA's compile-time memory of one gradient step against the number of steps.

    For each adjoint and each `n` in `num_steps` (powers of two, so `T1 / n` is exact
    and the solve takes exactly `n` steps), compiles the gradient of the NLL of a batch
    of `batch` samples through the B1 network and reads
    `Compiled.memory_analysis()`. `temp_bytes` is XLA's scratch allocation
    (activations kept for the backward pass, checkpoints, loop carries): the part
    that depends on the adjoint. `total_bytes` adds the arguments and outputs. (On
    CPU, jax 0.10's `peak_memory_in_bytes` is about the arguments plus the outputs,
    without the temp buffers, so it is not used.) With `execute`, the step is also
    run once and its step count checked against `n`. For the checkpointed adjoint,
    `checkpoints` is the number of checkpoints diffrax/equinox store; `state_bytes`
    is the size of one `(z, delta_logp)` state, for scale.
    """
    rows = []
    for name in adjoints:
        for n in num_steps:
            grad, args = _gradient_step(name, n, batch, dim, estimator, seed)
            start = time.perf_counter()
            compiled = grad.lower(*args).compile()
            compile_s = time.perf_counter() - start
            stats = compiled.memory_analysis()
            row = {
                "adjoint": name,
                "steps": n,
                "checkpoints": default_checkpoints(n)
                if name == "recursive_checkpoint"
                else None,
                "temp_bytes": int(stats.temp_size_in_bytes),
                "total_bytes": int(
                    stats.temp_size_in_bytes
                    + stats.argument_size_in_bytes
                    + stats.output_size_in_bytes
                    - stats.alias_size_in_bytes
                ),
                "state_bytes": batch * (dim + 1) * jnp.dtype(DTYPE).itemsize,
                "compile_s": compile_s,
            }
            row["temp_mib"] = row["temp_bytes"] / MIB
            row["total_mib"] = row["total_bytes"] / MIB
            if execute:
                (_, taken), _ = jax.block_until_ready(compiled(*args))
                if int(taken) != n:
                    raise RuntimeError(
                        f"the {name} solve took {int(taken)} steps, not {n}; use a "
                        "power of two for the number of steps."
                    )
            rows.append(row)
    return rows


def memory_growth(rows: list[dict]) -> dict[str, dict]:
    """Per adjoint, from the fewest to the most steps: the growth exponent of the temp
    and total memory (`memory ~ steps^k`), the temp memory added per extra step, and
    for the checkpointed adjoint the temp memory added per extra checkpoint."""
    out = {}
    for name in dict.fromkeys(r["adjoint"] for r in rows):
        sel = sorted(
            (r for r in rows if r["adjoint"] == name), key=lambda r: r["steps"]
        )
        steps = [r["steps"] for r in sel]
        temp = [r["temp_bytes"] for r in sel]
        growth = {
            "temp_exponent": log_slope(steps, temp),
            "total_exponent": log_slope(steps, [r["total_bytes"] for r in sel]),
            "temp_bytes_per_step": (temp[-1] - temp[0]) / (steps[-1] - steps[0]),
            "temp_bytes_per_checkpoint": None,
        }
        checkpoints = [r["checkpoints"] for r in sel]
        if None not in checkpoints and checkpoints[-1] > checkpoints[0]:
            growth["temp_bytes_per_checkpoint"] = (temp[-1] - temp[0]) / (
                checkpoints[-1] - checkpoints[0]
            )
        out[name] = growth
    return out


def rss_peak(adjoint: str, num_steps: int, batch: int = 512) -> dict:
    """A cross-check of `memory_vs_steps` by the operating system (Linux only): runs
    one compiled gradient step in a fresh process and reports the growth of its peak
    resident set (`VmHWM`, reset after compiling via `/proc/self/clear_refs`)."""
    code = (
        "from experiments.bench import b3; "
        f"print(b3._rss_child({adjoint!r}, {num_steps}, {batch}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=_ROOT,
    )
    return {
        "adjoint": adjoint,
        "steps": num_steps,
        "rss_peak_bytes": int(out.stdout.split()[-1]),
    }


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss_child(adjoint: str, num_steps: int, batch: int) -> int:
    grad, args = _gradient_step(adjoint, num_steps, batch, 2, "hutchinson", 0)
    compiled = grad.lower(*args).compile()
    jax.block_until_ready(args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = _status_kib("VmRSS")
    jax.block_until_ready(compiled(*args))
    return 1024 * (_status_kib("VmHWM") - before)


# ---------------------------------------------------------------------- markdown


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return f"{value:.3g}"
    return str(value)


def table(rows: list[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A markdown table of `rows`, with `columns` as `(key, header)` pairs."""
    cells = [[_fmt(r[k]) for k, _ in columns] for r in rows]
    return markdown_table([h for _, h in columns], cells, "r" * len(columns))


def divergence_table(rows: list[dict]) -> str:
    growth = divergence_growth(rows)
    body = table(
        rows,
        [
            ("dim", "d"),
            ("f_us", "f (CPU µs)"),
            ("hutchinson_us", "Hutchinson (CPU µs)"),
            ("exact_us", "exact (CPU µs)"),
            ("hutchinson_over_f", "Hutchinson / f"),
            ("exact_over_f", "exact / f"),
            ("exact_over_hutchinson_per_d", "exact / (d · Hutchinson)"),
            ("f_wall_us", "f (wall µs)"),
            ("hutchinson_wall_us", "Hutchinson (wall µs)"),
            ("exact_wall_us", "exact (wall µs)"),
        ],
    )
    note = (
        f"Growth exponents in d of the CPU times (time ~ d^k, d = {rows[0]['dim']} "
        f"to {rows[-1]['dim']}): f {growth['f_us']:.2f}, Hutchinson "
        f"{growth['hutchinson_us']:.2f}, exact {growth['exact_us']:.2f}."
    )
    return body + "\n\n" + note


def step_table(rows: list[dict]) -> str:
    return table(
        rows,
        [
            ("batch", "batch"),
            ("pretrain_steps", "trained steps"),
            ("seconds_per_step", "s / step"),
            ("cpu_seconds_per_step", "CPU s / step"),
            ("us_per_sample", "µs / sample"),
            ("nfe_forward", "NFE fwd (mean)"),
            ("nfe_min", "min"),
            ("nfe_max", "max"),
            ("us_per_sample_per_nfe", "µs / sample / NFE"),
            ("first_call_s", "first call (s)"),
        ],
    )


def memory_table(rows: list[dict]) -> str:
    body = table(
        rows,
        [
            ("adjoint", "adjoint"),
            ("steps", "steps"),
            ("checkpoints", "checkpoints"),
            ("temp_mib", "temp (MiB)"),
            ("total_mib", "temp + args + outputs (MiB)"),
            ("temp_bytes", "temp (bytes)"),
        ],
    )
    lines = []
    for name, g in memory_growth(rows).items():
        line = (
            f"- {name}: temp ~ steps^{g['temp_exponent']:.3f}, total ~ "
            f"steps^{g['total_exponent']:.3f}; "
            f"{g['temp_bytes_per_step'] / 1024:.2f} KiB of temp per extra step"
        )
        if g["temp_bytes_per_checkpoint"] is not None:
            line += (
                f", {g['temp_bytes_per_checkpoint'] / 1024:.1f} KiB per extra "
                "checkpoint"
            )
        lines.append(line)
    state = rows[0]["state_bytes"] / 1024
    return (
        body
        + "\n\nGrowth from the fewest to the most steps (one `(z, delta_logp)` state "
        + f"is {state:.1f} KiB):\n\n"
        + "\n".join(lines)
    )


def markdown(rows_by_section: dict[str, list[dict]]) -> str:
    """The B3 tables: keys among `"divergence"`, `"step"`, `"step_trained"` (rows of
    `step_time_vs_batch`) and `"memory"`."""
    render = {
        "divergence": ("Divergence cost against dimension", divergence_table),
        "step": ("Training-step time against batch size", step_table),
        "step_trained": (
            "Training-step time against batch size, trained parameters",
            step_table,
        ),
        "memory": ("Gradient-step memory against solver steps", memory_table),
    }
    parts = []
    for key, rows in rows_by_section.items():
        title, fn = render[key]
        parts.append(f"### {title}\n\n{fn(rows)}")
    return "\n\n".join(parts) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings")
    parser.add_argument("--rss", action="store_true", help="also measure process RSS")
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=300,
        help="training steps before the second step-time table",
    )
    args = parser.parse_args(argv)
    if args.quick:
        sections = {
            "divergence": divergence_cost(dims=(2, 8, 32), batch=64, repeats=3),
            "step": step_time_vs_batch(batches=(64, 128), iters=3),
            "step_trained": step_time_vs_batch(
                batches=(64, 128), iters=3, pretrain_steps=20
            ),
            "memory": memory_vs_steps(num_steps=(4, 16), batch=64),
        }
    else:
        sections = {
            "divergence": divergence_cost(),
            "step": step_time_vs_batch(),
            "step_trained": step_time_vs_batch(pretrain_steps=args.pretrain_steps),
            "memory": memory_vs_steps(),
        }
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {device}, {os.cpu_count()} CPUs\n")
    print(markdown(sections))
    if args.rss:
        print("Peak resident-set growth of one executed gradient step:\n")
        steps, batch = ((4, 16), 64) if args.quick else ((8, 256), 512)
        for name in ADJOINTS:
            for n in steps:
                peak = rss_peak(name, n, batch)["rss_peak_bytes"]
                print(f"- {name}, {n} steps: {peak / MIB:.2f} MiB")


if __name__ == "__main__":
    main()
