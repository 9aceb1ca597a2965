"""B1 and B5's 10- and 40-D rows on one GPU, cnftrace beside zuko on CUDA, in one run
that ends in under 8 minutes and writes `experiments/results/gpu.json` and `gpu.md`.

The machine needs jax with CUDA, equinox, diffrax, lineax, optax and torch (with CUDA)
installed. cnftrace runs from this checkout (the script is run from its root), and
what else it needs comes as wheels carried with the checkout, downloaded where a
package registry is reachable:

    pip download zuko==1.6.0 tqdm --no-deps -d wheels/   # here: zuko, and fit's tqdm
    # carry wheels/ with the checkout, then on the GPU machine:
    pip install --no-deps --no-index wheels/*.whl
    python -m experiments.bench.gpu                      # about 7 minutes
    python -m experiments.bench.gpu --smoke              # tiny sizes on the CPU

Without zuko (or without a CUDA device for torch) its rows say so and cnftrace's are
still measured; without a GPU for jax the run stops at once, unless `--smoke`.

The parts, each with its own time budget (`--budget-b1`, `--budget-b5`) inside the
whole run's (`--budget`, 420 s by default; a part gets what is left when the parts
before it ran long, and a part with less than a minute left is not run):

- B1 (`experiments/README.md`): 8gaussians, batch 512, one CNF block with FFJORD's
  ConcatSquash 2-64-64-64-2, Tsit5 (zuko: its own Dopri5) at 1e-5, Adam 1e-3, float32;
  the exact trace and one Hutchinson probe; s/iter over iterations 21-120 and the
  first step. The first estimator runs a second time with the field's products at
  JAX's default precision (`matmul_precision=None`: TensorFloat-32 on recent
  NVIDIA GPUs) beside cnftrace's float32. cnftrace runs `_common.cnftrace_b1`, zuko
  `zuko_peer.zuko_b1` on CUDA, stopped at its share of the part's budget (the
  table says how many steps ran).
- B5's constructed densities at d = 10 and 40 (`warped_product(d)`, exact
  log-density): cnftrace's default recipe (`mlp_flow(d)`, `fit` with its defaults,
  `_common.cnftrace_default`) for as many steps (at most the CPU row's: 2,000 at
  10-D by maximum likelihood, 40,000 at 40-D by flow matching) as its share of the
  part's budget holds (both trainings and both evaluations must fit), priced by a
  20-step run first; then zuko's NSF (5 transforms, 64 x 2, 8 bins, Adam 1e-3,
  batch 512) on CUDA for the same training seconds. Gap = model NLL - true NLL on
  `--test-size` held-out points, exact trace. The table repeats the CPU row of
  `experiments/results/b5_dims.json` beside it.

Each part's rows are written as soon as it ends, so a stopped run keeps them. Unlike
on a shared CPU, absolute seconds on a GPU are worth reporting.
"""

import os

# JAX would otherwise take most of the GPU's memory at its first use, leaving torch
# (zuko) too little; it then allocates what it needs as it goes.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import importlib.metadata  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.random as jr  # noqa: E402

import cnftrace  # noqa: E402
from cnftrace.datasets import warped_product  # noqa: E402
from experiments._common import (  # noqa: E402
    B1_BATCH,
    B1_ITERS,
    RESULTS,
    Target,
    cnftrace_b1,
    cnftrace_default,
    load_results,
    markdown_table,
    write_results,
    zuko_at_seconds,
    zuko_peer_module,
)

ESTIMATORS = ("hutchinson", "exact")
DIMS = (10, 40)
MIN_PART_S = 60.0  # a part with less than this left is not run
EVAL_SHARE = 0.2  # of a B5 row's seconds after pricing: both exact-trace evaluations
FULL = dict(
    budget=420.0,
    budget_b1=120.0,
    budget_b5=140.0,
    test_size=10_000,
    iters=B1_ITERS,
    batch=B1_BATCH,
    dims=DIMS,
    probe_steps=20,  # the short run that prices a training step
    estimators=ESTIMATORS,
)
SMOKE = dict(
    budget=600.0,
    budget_b1=120.0,
    budget_b5=120.0,
    test_size=64,
    # B1's batch, B5's steps and test set as in `run --quick` and the B5 smoke test:
    # a process sharing the compilation cache with those compiles their programs once.
    iters=3,
    batch=64,
    dims=(2,),
    probe_steps=3,
    estimators=("hutchinson",),  # B1's exact trace runs the same code
)
VERSIONS = ("jax", "jaxlib", "equinox", "diffrax", "lineax", "optax", "torch", "zuko")


def versions() -> dict:
    out = {"cnftrace": cnftrace.__version__}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def devices(zuko_peer) -> dict:
    """What each system runs on: jax's first device, and torch's CUDA device."""
    jax_device = jax.devices()[0]
    out = {"jax": f"{jax_device.platform}: {jax_device.device_kind}"}
    if zuko_peer is not None:
        torch = zuko_peer.torch
        out["torch"] = (
            f"cuda: {torch.cuda.get_device_name(0)}"
            if torch.cuda.is_available()
            else "cpu (torch sees no CUDA device)"
        )
    return out


class Clock:
    """The run's time: what is left of the whole budget, and each part's share."""

    def __init__(self, budget_s: float):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def part(self, budget_s: float, later_parts_s: float) -> float:
        """A part's seconds: its own budget, or what the whole budget leaves after
        keeping `later_parts_s` for the parts after it, whichever is less."""
        return min(budget_s, self.left() - later_parts_s)


def run_b1(budget_s: float, settings: dict, zuko_peer, device: str) -> dict:
    """B1 for each estimator: cnftrace, then zuko on `device` for at most what the
    estimator's share of `budget_s` has left."""
    out = {}
    start = time.perf_counter()
    estimators = settings["estimators"]
    iters, batch = settings["iters"], settings["batch"]
    for i, est in enumerate(estimators):
        ours = cnftrace_b1(est, iters=iters, batch=batch)
        row = {"cnftrace": ours}
        if est == estimators[0]:
            # The field's products at JAX's default precision (TensorFloat-32 on
            # recent NVIDIA GPUs), beside cnftrace's float32: what the precision
            # costs or saves, in seconds and in evaluations.
            row["cnftrace_jax_precision"] = cnftrace_b1(
                est, iters=iters, batch=batch, jax_precision=True
            )
        share = (i + 1) * budget_s / len(estimators) - (time.perf_counter() - start)
        if zuko_peer is None:
            row["zuko"] = {"missing": "zuko is not installed"}
        elif share <= 0:
            row["zuko"] = {"missing": "out of time"}
        else:
            row["zuko"] = zuko_peer.zuko_b1(
                est == "exact",
                iters=iters,
                batch=batch,
                device=device,
                max_seconds=share,
            )
        for system, r in row.items():
            if "missing" not in r:
                r.pop("iter_times", None)
                print(f"B1 {est} {system}: {r['s_per_iter']:.4f} s/iter", flush=True)
        out[est] = row
    return out


def price_steps(target: Target, probe_steps: int) -> tuple[float, float]:
    """`(first, step)`: the seconds of the first (compiling) step of cnftrace's
    default recipe on `target`, and of a steady step (the median gap between the log
    records of a `probe_steps`-step run after the first)."""
    stamps = []
    flow = cnftrace.mlp_flow(target.dim, key=jr.key(0))
    start = time.perf_counter()
    cnftrace.fit(
        flow,
        target.sample,
        key=jr.key(1),
        steps=probe_steps,
        progress=False,
        on_log=lambda record: stamps.append(time.perf_counter()),
    )
    gaps = sorted(b - a for a, b in zip(stamps[:-1], stamps[1:]))
    return stamps[0] - start, gaps[len(gaps) // 2]


def max_steps(d: int) -> int:
    """A row's step cap: the steps of B5's CPU row at `d` (a GPU row never trains
    longer than the row it is set beside), or the default recipe's steps where the CPU
    has no row: 1,000 by maximum likelihood, 40,000 by flow matching."""
    on_cpu = load_results(os.path.join(RESULTS, "b5_dims")).get(str(d), {})
    steps = on_cpu.get("cnftrace", {}).get("recipe", {}).get("steps")
    return int(steps) if steps else cnftrace.default_recipe(d).steps


def run_b5_row(
    d: int, budget_s: float, settings: dict, zuko_peer, device: str, smoke: bool
) -> dict:
    """One B5 row: cnftrace's defaults, then zuko's NSF for cnftrace's training
    seconds. After pricing a step, cnftrace gets the steps that let both trainings
    (compile included) and both evaluations fit in what is left of `budget_s`: each
    training takes `(1 - EVAL_SHARE) / 2` of it."""
    start = time.perf_counter()
    target = Target(f"warped_product({d})", warped_product(d, seed=0))
    test = target.test_set(settings["test_size"])
    probe = settings["probe_steps"]
    first_s, step_s = price_steps(target, probe)
    left = budget_s - (time.perf_counter() - start)
    train_s = left * (1 - EVAL_SHARE) / 2 - first_s
    # A smoke run trains the pricing run's steps again: the same program.
    steps = probe if smoke else max(probe, min(max_steps(d), int(train_s / step_s)))
    row = {"density": target.density.name, "dim": d, "n_test": len(test)}
    row["measured"] = time.strftime("%Y-%m-%d %H:%M %Z")
    row["probe_s_per_step"] = step_s
    row["probe_first_step_s"] = first_s
    row["cnftrace"] = ours = cnftrace_default(target, steps, test)
    print(f"B5 d={d}: cnftrace gap {ours['gap']:.3f} in {steps} steps", flush=True)
    if zuko_peer is None:
        row["zuko_nsf"] = {"missing": "zuko is not installed"}
    else:
        seconds = min(ours["train_s"], 0.5) if smoke else ours["train_s"]
        row["zuko_nsf"] = zuko_at_seconds(
            zuko_peer, target, test, seconds, "nsf", device=device
        )
        print(f"B5 d={d}: zuko NSF gap {row['zuko_nsf']['gap']:.3f}", flush=True)
    return row


def _gap(r: dict) -> str:
    return f"{r['gap']:.3f} ± {r['gap_se']:.3f}"


def markdown(res: dict) -> str:
    lines = [
        f"Written by `{res['command']}` on {res['date']}, in {res['elapsed_s']:.0f} s.",
        "Devices: "
        + "; ".join(f"{k} {v}" for k, v in res["devices"].items())
        + ". Versions: "
        + ", ".join(f"{k} {v}" for k, v in res["versions"].items() if v)
        + ".",
    ]
    if res.get("b1"):
        rows = []
        for est, row in res["b1"].items():
            ours = row["cnftrace"]
            for system, r in row.items():
                if "missing" in r:
                    rows.append([est, system, f"not run: {r['missing']}"] + [""] * 5)
                    continue
                ratio = r["s_per_iter"] / ours["s_per_iter"]
                rows.append(
                    [
                        est,
                        r["system"],
                        f"{r['s_per_iter']:.4f}",
                        f"{r['first_step_s']:.2f}",
                        f"{r['nfe_fwd']:.1f}",
                        f"{r['nfe_bwd']:.1f}",
                        r.get("iters_done", res["settings"]["iters"]),
                        "" if system == "cnftrace" else f"{ratio:.2f}×",
                    ]
                )
        header = ["estimator", "system", "s/iter", "first step (s)", "NFE fwd"]
        header += ["NFE bwd", "iterations", "s/iter ÷ cnftrace's"]
        lines += ["", "## B1 on the GPU", "", markdown_table(header, rows, "llrrrrrr")]
    if res.get("b5"):
        cpu = load_results(os.path.join(RESULTS, "b5_dims"))
        rows = []
        for key, row in res["b5"].items():
            ours, r = row["cnftrace"], row["cnftrace"]["recipe"]
            peer = row["zuko_nsf"]
            peer_cell = (
                f"not run: {peer['missing']}"
                if "missing" in peer
                else f"{_gap(peer)} ({peer['steps_done']} steps)"
            )
            on_cpu = cpu.get(key, {}).get("cnftrace")
            cpu_cell = "—"
            if on_cpu is not None:
                cpu_r = on_cpu["recipe"]
                cpu_cell = (
                    f"{_gap(on_cpu)} ({cpu_r['steps']} steps, "
                    f"{on_cpu['train_s']:.0f} s)"
                )
            rows.append(
                [
                    row["dim"],
                    f"{r['width']}×{r['depth']}, {r['steps']} × {r['batch']}",
                    _gap(ours),
                    f"{ours['train_s']:.0f}",
                    f"{r['steps'] / ours['train_s']:.1f}",
                    peer_cell,
                    cpu_cell,
                ]
            )
        header = ["d", "cnftrace recipe (width×depth, steps × batch)", "gap", "s"]
        header += ["steps/s", "zuko NSF, same seconds", "cnftrace on the CPU"]
        lines += [
            "",
            "## B5's constructed densities on the GPU",
            "",
            markdown_table(header, rows, "rlrrrll"),
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes; runs on the CPU (a check)"
    )
    parser.add_argument("--budget", type=float, help="seconds for the whole run")
    parser.add_argument("--budget-b1", type=float, help="seconds for B1")
    parser.add_argument("--budget-b5", type=float, help="seconds for each B5 row")
    parser.add_argument("--test-size", type=int, help="B5's held-out points")
    parser.add_argument(
        "--out",
        default=None,
        help="results stem (default experiments/results/gpu; with --smoke, a "
        "temporary directory's gpu_smoke)",
    )
    args = parser.parse_args(argv)
    settings = dict(SMOKE if args.smoke else FULL)
    for name in ("budget", "budget_b1", "budget_b5", "test_size"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive.")
            settings[name] = value
    if not args.smoke and jax.default_backend() != "gpu":
        parser.error(
            f"jax runs on {jax.default_backend()}, not a GPU: install jax with CUDA, "
            "or pass --smoke for a check on the CPU."
        )
    out = args.out or (
        os.path.join(tempfile.gettempdir(), "gpu_smoke")
        if args.smoke
        else os.path.join(RESULTS, "gpu")
    )
    zuko_peer, missing = zuko_peer_module()
    if zuko_peer is None:
        print(f"zuko not run ({missing}); see this script's docstring.", flush=True)
    cuda = zuko_peer is not None and zuko_peer.torch.cuda.is_available()
    device = "cuda" if cuda and not args.smoke else "cpu"

    clock = Clock(settings["budget"])
    command = "python -m experiments.bench.gpu" + (" --smoke" if args.smoke else "")
    res = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "devices": devices(zuko_peer),
        "versions": versions(),
        "settings": settings,
        "b1": None,
        "b5": {},
    }

    def save():
        res["elapsed_s"] = time.perf_counter() - clock.start
        write_results(out, res, markdown(res))

    later = settings["budget_b5"] * len(settings["dims"])
    part = clock.part(settings["budget_b1"], later)
    if part >= (0 if args.smoke else MIN_PART_S):
        res["b1"] = run_b1(part, settings, zuko_peer, device)
        save()
    for i, d in enumerate(settings["dims"]):
        later = settings["budget_b5"] * (len(settings["dims"]) - i - 1)
        part = clock.part(settings["budget_b5"], later)
        if part < (0 if args.smoke else MIN_PART_S):
            print(f"B5 d={d}: not run, {part:.0f} s left for it", flush=True)
            continue
        res["b5"][str(d)] = run_b5_row(d, part, settings, zuko_peer, device, args.smoke)
        save()
    save()
    print(markdown(res))
    print(f"wrote {out}.json and {out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
