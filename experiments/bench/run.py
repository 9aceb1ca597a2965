"""The benchmark suite in one command: B1, B2 and B3 of `shared/BENCHMARK.md`, cnftrace
beside zuko in the same invocation, written to a markdown report.

    pip install -e ".[bench]"                 # torch 2.13.0 (CPU) and zuko
    python -m experiments.bench.run           # everything, about 45 minutes on 2 cores
    python -m experiments.bench.run --quick   # tiny settings, a minute or two

Writes `docs/benchmarks.md` (or `--out`) atomically: the machine and versions, every
figure beside its target, and the raw numbers as JSON next to it. Without torch and
zuko installed the zuko columns say so and the cnftrace figures are still measured.
"""

import argparse
import datetime
import json
import os
import platform
import sys

import jax

import cnftrace
from experiments._common import atomic_write
from experiments.bench import b1, b2, b3, b4, common

_HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from experiments.bench import zuko_peer
except ImportError as e:  # the bench extra is not installed
    zuko_peer = None
    ZUKO_MISSING = f"zuko peer not run ({e}); `pip install -e '.[bench]'`"

TARGETS = {
    "hutchinson": 0.035,
    "exact": 0.045,
    "first_step": 5.0,
    "speedup": 4.0,
    "floor_ratio": 1.3,
    "b2_seconds": 180.0,
}
# BENCHMARK.md's peer NFE per forward solve in B1.
PEER_NFE = {"FFJORD reference": 22, "zuko 1.6.0": 40, "diffrax example": 27}


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _fmt_s(value) -> str:
    return "—" if value is None else f"{value:.0f} s"


def run_b1(iters: int, batch: int) -> dict:
    out = {}
    for est in ("hutchinson", "exact"):
        ours = b1.cnftrace_b1(est, iters=iters, batch=batch)
        costs = b1.evaluation_costs(est, batch=batch)
        ours["floor_s"] = b1.floor_seconds(costs, ours["nfe_fwd"], ours["nfe_bwd"])
        ours["costs"] = costs
        peer = None
        if zuko_peer is not None:
            peer = zuko_peer.zuko_b1(est == "exact", iters=iters, batch=batch)
        out[est] = {"cnftrace": ours, "zuko": peer}
    return out


def b1_markdown(res: dict) -> str:
    lines = [
        "| estimator | system | s/iter | first step (s) | NFE fwd | NFE bwd "
        "| zuko / cnftrace |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for est, pair in res.items():
        ours, peer = pair["cnftrace"], pair["zuko"]
        ratio = (
            "—" if peer is None else f"{peer['s_per_iter'] / ours['s_per_iter']:.2f}×"
        )
        for r in (ours, peer):
            if r is None:
                lines.append(f"| {est} | {ZUKO_MISSING} | | | | | |")
                continue
            lines.append(
                f"| {est} | {r['system']} | {r['s_per_iter']:.4f} | "
                f"{r['first_step_s']:.2f} | {r['nfe_fwd']:.1f} | {r['nfe_bwd']:.1f} | "
                f"{ratio if r is ours else ''} |"
            )
    lines += [
        "",
        "Compute floor (bare jitted evaluations of the same network at the same batch,"
        " times cnftrace's measured NFE):",
        "",
        "| estimator | f (µs) | f + divergence (µs) | gradient of f + divergence (µs) "
        "| floor (s/iter) | real / floor |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for est, pair in res.items():
        ours = pair["cnftrace"]
        c = ours["costs"]
        lines.append(
            f"| {est} | {c['f'] * 1e6:.0f} | {c['f_div'] * 1e6:.0f} | "
            f"{c['grad_f_div'] * 1e6:.0f} | {ours['floor_s']:.4f} | "
            f"{ours['s_per_iter'] / ours['floor_s']:.2f} |"
        )
    return "\n".join(lines)


SECTIONS = ("b1", "b2", "b2fm", "b3", "b4")


def run_b2(budgets: dict, eval_every: float, test_size: int) -> dict:
    out = {}
    for dataset, budget in budgets.items():
        ours = b2.cnftrace_b2(
            dataset, budget, eval_every_s=eval_every, test_size=test_size
        )
        peer = None
        if zuko_peer is not None:
            peer = zuko_peer.zuko_b2(
                dataset, budget, eval_every_s=eval_every, test_size=test_size
            )
        out[dataset] = {"cnftrace": ours, "zuko": peer, "budget_s": budget}
    return out


OBJECTIVES = ("mle", "fm", "ot-fm")


def run_b2_objectives(budgets: dict, eval_every: float, test_size: int) -> dict:
    """B2 for cnftrace's three training objectives, side by side in one run."""
    out = {}
    for dataset, budget in budgets.items():
        out[dataset] = {"budget_s": budget}
        for objective in OBJECTIVES:
            out[dataset][objective] = b2.cnftrace_b2(
                dataset,
                budget,
                eval_every_s=eval_every,
                test_size=test_size,
                objective=objective,
                batch=128 if objective == "mle" else 256,
            )
    return out


def b2_objectives_markdown(res: dict) -> str:
    lines = [
        "| data | objective | budget | ≤ 0.15 nats | ≤ 0.05 nats | best gap | steps "
        "| NFE of log_prob | NFE of sample |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dataset, entry in res.items():
        for objective in OBJECTIVES:
            r = entry[objective]
            ttg = {float(k): v for k, v in r["time_to_gap"].items()}
            lines.append(
                f"| {dataset} | {objective} | {entry['budget_s']:.0f} s | "
                f"{_fmt_s(ttg[0.15])} | {_fmt_s(ttg[0.05])} | {r['best_gap']:.3f} | "
                f"{r['steps']} | {r['nfe_log_prob']:.0f} | {r['nfe_sample']} |"
            )
    return "\n".join(lines)


def b2_markdown(res: dict) -> str:
    lines = [
        "| data | system | budget | ≤ 0.15 nats | ≤ 0.05 nats | best gap | steps "
        "| test set's true-density NLL |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for dataset, entry in res.items():
        for r in (entry["cnftrace"], entry["zuko"]):
            if r is None:
                lines.append(f"| {dataset} | {ZUKO_MISSING} | | | | | | |")
                continue
            ttg = {float(k): v for k, v in r["time_to_gap"].items()}
            true = r.get("test_true_nll")
            lines.append(
                f"| {dataset} | {r['system']} | {entry['budget_s']:.0f} s | "
                f"{_fmt_s(ttg[0.15])} | {_fmt_s(ttg[0.05])} | {r['best_gap']:.3f} | "
                f"{r['steps']} | {'—' if true is None else f'{true:.3f}'} |"
            )
    return "\n".join(lines)


def targets_markdown(b1_res, b2_res, b3_res) -> str:
    rows = []
    if b1_res:
        for est in ("hutchinson", "exact"):
            ours, peer = b1_res[est]["cnftrace"], b1_res[est]["zuko"]
            s = ours["s_per_iter"]
            rows.append(
                (f"B1 {est} s/iter ≤ {TARGETS[est]}", f"{s:.4f}", s <= TARGETS[est])
            )
            peers = min(PEER_NFE.values())
            rows.append(
                (
                    f"B1 {est} NFE fwd no higher than the peers' (≈{peers}–40)",
                    f"{ours['nfe_fwd']:.1f}",
                    ours["nfe_fwd"] <= max(PEER_NFE.values()),
                )
            )
            if peer is not None:
                ratio = peer["s_per_iter"] / s
                rows.append(
                    (
                        f"B1 {est} ≥ {TARGETS['speedup']:.0f}× faster than zuko",
                        f"{ratio:.2f}×",
                        ratio >= TARGETS["speedup"],
                    )
                )
            first = ours["first_step_s"]
            rows.append(
                (
                    f"B1 {est} first step ≤ {TARGETS['first_step']:.0f} s",
                    f"{first:.2f} s",
                    first <= TARGETS["first_step"],
                )
            )
            fr = s / ours["floor_s"]
            rows.append(
                (
                    f"B1 {est} within {TARGETS['floor_ratio']}× of the compute floor",
                    f"{fr:.2f}×",
                    fr <= TARGETS["floor_ratio"],
                )
            )
    if b2_res and "8gaussians" in b2_res:
        t = {
            float(k): v
            for k, v in b2_res["8gaussians"]["cnftrace"]["time_to_gap"].items()
        }
        rows.append(
            (
                "B2 8gaussians gap ≤ 0.05 in < 180 s of training",
                _fmt_s(t[0.05]),
                t[0.05] is not None and t[0.05] < TARGETS["b2_seconds"],
            )
        )
    if b3_res:
        growth = b3.divergence_growth(b3_res["divergence"])
        ratio_growth = growth["hutchinson_us"] - growth["f_us"]
        rows.append(
            (
                "B3 Hutchinson grows like the network (exponent in d minus f's)",
                f"{ratio_growth:+.2f} (Hutchinson d^{growth['hutchinson_us']:.2f}, "
                f"f d^{growth['f_us']:.2f}, exact d^{growth['exact_us']:.2f})",
                ratio_growth < 0.5,
            )
        )
        mem = b3.memory_growth(b3_res["memory"])["recursive_checkpoint"]
        rows.append(
            (
                "B3 checkpointed-adjoint memory sublinear in steps",
                f"steps^{mem['temp_exponent']:.3f}",
                mem["temp_exponent"] < 1,
            )
        )
    lines = ["| target | measured | |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {_mark(ok)} |" for name, value, ok in rows]
    return "\n".join(lines)


def machine() -> str:
    versions = {"cnftrace": cnftrace.__version__, "jax": jax.__version__}
    for name in ("equinox", "diffrax", "optax", "torch", "zuko"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = "not installed"
    return (
        f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
        f"{jax.devices()[0].platform}; Python {platform.python_version()}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (a check)")
    parser.add_argument(
        "--only",
        default="b1,b2,b2fm,b3",
        help="comma-separated sections to run (b2fm: B2 for the three objectives; "
        "b4, quality beside zuko, takes over an hour and is left out by default: the "
        "report then quotes its last run from experiments/results/b4.md)",
    )
    parser.add_argument("--out", default=None, help="report path (markdown)")
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(
            f"--only: unknown sections {sorted(unknown)}; use {', '.join(SECTIONS)}."
        )
    out = args.out or os.path.join(_HERE, os.pardir, os.pardir, "docs", "benchmarks.md")
    if args.quick:
        b1_args = dict(iters=3, batch=64)
        b4_args = b4.QUICK
        b2_args = dict(budgets={"8gaussians": 3.0}, eval_every=1.0, test_size=200)
        b3_args = dict(
            divergence=dict(dims=(2, 8), batch=64, repeats=3),
            step=dict(batches=(64, 128), iters=3),
            memory=dict(num_steps=(4, 16), batch=64),
        )
    else:
        b1_args = dict(iters=common.B1_ITERS, batch=common.B1_BATCH)
        b2_args = dict(
            budgets={"8gaussians": 240.0, "checkerboard": 480.0},
            eval_every=common.B2_EVAL_EVERY_S,
            test_size=common.B2_TEST_SIZE,
        )
        b3_args = dict(divergence={}, step={}, memory={})
        b4_args = {}

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    b1_res = run_b1(**b1_args) if "b1" in sections else None
    b2_res = run_b2(**b2_args) if "b2" in sections else None
    b2fm_res = run_b2_objectives(**b2_args) if "b2fm" in sections else None
    b4_res = b4.run_b4(**b4_args) if "b4" in sections else None
    b3_res = None
    if "b3" in sections:
        b3_res = {
            "divergence": b3.divergence_cost(**b3_args["divergence"]),
            "step": b3.step_time_vs_batch(**b3_args["step"]),
            "memory": b3.memory_vs_steps(**b3_args["memory"]),
        }

    parts = [
        "# Benchmarks",
        "",
        f"Written by `python -m experiments.bench.run{' --quick' if args.quick else ''}"
        f"{'' if sections == set(SECTIONS) else ' --only ' + args.only}` on "
        f"{started:%Y-%m-%d %H:%M} UTC. Protocol: `shared/BENCHMARK.md` and "
        "`experiments/bench/common.py`; zuko's differences from the protocol: "
        "`experiments/bench/zuko_peer.py`.",
        "",
        f"Machine: {machine()}.",
        "",
        "Shared machines are noisy (15–30% run to run); the ratios are measured side "
        "by side in this one invocation. Load average (1, 5, 15 min) at the start: "
        + ", ".join(f"{x:.2f}" for x in load_before)
        + "; at the end: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + f" (on {os.cpu_count()} CPUs).",
        "",
        "## Targets",
        "",
        targets_markdown(b1_res, b2_res, b3_res),
    ]
    if b1_res:
        parts += [
            "",
            "## B1: toy training step (8gaussians, batch "
            f"{b1_args['batch']}, iterations 21–{b1_args['iters']})",
            "",
            f"cnftrace: {b1_res['hutchinson']['cnftrace']['solver']}.",
            "",
            b1_markdown(b1_res),
        ]
    if b2_res:
        parts += [
            "",
            "## B2: time to quality (training seconds until the exact test NLL is "
            "within the gap of the floor)",
            "",
            f"cnftrace settings: {b2_res[next(iter(b2_res))]['cnftrace']['settings']}.",
            "",
            b2_markdown(b2_res),
        ]
    if b2fm_res:
        settings = {
            o: b2fm_res[next(iter(b2fm_res))][o]["settings"] for o in OBJECTIVES
        }
        parts += [
            "",
            "## B2 by training objective: maximum likelihood, flow matching, OT flow "
            "matching",
            "",
            "The same model, data, clock and evaluations as B2; the NFE columns are "
            "those of the final model (the exact-trace test evaluation per solve, and "
            "drawing the test set's number of samples). Settings: "
            + "; ".join(f"{o}: {v}" for o, v in settings.items())
            + ".",
            "",
            b2_objectives_markdown(b2fm_res),
        ]
    if b3_res:
        parts += ["", "## B3: cost as the work grows", "", b3.markdown(b3_res)]
    b4_title = "## B4: quality per step and per second, beside zuko"
    if b4_res:
        section = b4.section_markdown(b4_res, "python -m experiments.bench.run")
        parts += ["", b4_title, "", section]
    elif os.path.exists(b4.RESULTS_STEM + ".md"):
        with open(b4.RESULTS_STEM + ".md") as f:
            parts += ["", b4_title + " (its last run)", "", f.read().rstrip()]
    report = "\n".join(parts) + "\n"
    atomic_write(out, report.encode())
    raw = {
        "b1": b1_res,
        "b2": b2_res,
        "b2fm": b2fm_res,
        "b3": b3_res,
        "b4": b4_res,
        "machine": machine(),
    }
    atomic_write(
        os.path.splitext(out)[0] + ".json",
        json.dumps(raw, indent=1, default=str).encode(),
    )
    print(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
