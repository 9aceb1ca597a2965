"""The benchmark suite in one command: B1, B2 and B3 (`experiments/README.md`),
cnftrace beside zuko (and in B1 beside TFP's JAX FFJORD too) in the same invocation,
written to a markdown report.

    pip install -e ".[bench]"                 # torch 2.13.0 (CPU) and zuko
    pip install --pre -e ".[peers]"           # TFP's JAX FFJORD (tfp-nightly: --pre)
    python -m experiments.bench.run           # everything, about 45 minutes on 2 cores
    python -m experiments.bench.run --quick   # tiny settings, a minute or two
    python -m experiments.bench.run --only b1 --repeats 2   # B1 alone, A B A B

B1 runs the systems alternated, `--repeats` times (cnftrace, zuko, TFP, cnftrace,
zuko, TFP, ... for each estimator; 2 by default, 1 with `--quick`), and reports every
run and the medians. Writes `experiments/results/benchmarks.md` (or `--out`)
atomically: the machine and versions, every figure beside its target, and the raw
numbers as JSON next to it. `docs/benchmarks.md` quotes its headline figures and
includes its full tables.
Without a peer installed its rows say so and the other figures are still measured.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import jax

import cnftrace
from experiments import _common
from experiments._common import atomic_write, markdown_table
from experiments.bench import b1, b2, b3, b4

# What a peer's rows say where its package is not installed (with the import error).
ZUKO_MISSING = "zuko peer not run; `pip install -e '.[bench]'`"
TFP_MISSING = (
    "TFP (JAX) peer not run; `pip install --pre -e '.[peers]'` "
    "(or `pip install --pre tfp-nightly`)"
)
try:
    from experiments.bench import zuko_peer
except ImportError as e:  # the bench extra is not installed
    zuko_peer = None
    ZUKO_MISSING = ZUKO_MISSING.replace("run;", f"run ({e});")

try:
    from experiments.bench import tfp_peer
except ImportError as e:  # the peers extra is not installed
    tfp_peer = None
    TFP_MISSING = TFP_MISSING.replace("run;", f"run ({e});")

TARGETS = {
    "hutchinson": 0.035,
    "exact": 0.045,
    "first_step": 5.0,
    "speedup": 4.0,
    "speedup_tfp": 1.5,
    "floor_ratio": 1.3,
    "b2_seconds": 180.0,
}
# The peers' NFE per forward solve in B1 (experiments/README.md).
PEER_NFE = {"FFJORD reference": 22, "zuko 1.6.0": 40, "diffrax example": 27}


def _mark(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _fmt_s(value) -> str:
    return "—" if value is None else f"{value:.0f} s"


# B1's systems in the order each round runs them, with their report labels.
B1_SYSTEMS = ("cnftrace", "zuko", "tfp")
B1_LABELS = {"zuko": "zuko", "tfp": "TFP"}


def _b1_once(system: str, est: str, iters: int, batch: int) -> dict | None:
    """One B1 run of `system`, or None where its package is not installed."""
    if system == "cnftrace":
        # Every round compiles afresh, as a new process would without the
        # persistent compilation cache (which this script leaves off): otherwise the
        # second round's step would come from this process's in-memory cache.
        jax.clear_caches()
        return _common.cnftrace_b1(est, iters=iters, batch=batch)
    if system == "zuko":
        if zuko_peer is None:
            return None
        return zuko_peer.zuko_b1(est == "exact", iters=iters, batch=batch)
    if tfp_peer is None:
        return None
    return tfp_peer.tfp_b1(est == "exact", iters=iters, batch=batch)


_MEDIAN_KEYS = ("s_per_iter", "first_step_s", "nfe_fwd", "nfe_bwd")


def _median_run(runs: list[dict | None]) -> dict | None:
    """One system's runs summarised: the first run's record with the medians of
    the per-run figures (the run itself where there is one run)."""
    if runs[0] is None:
        return None
    summary = dict(runs[0])
    for key in _MEDIAN_KEYS:
        summary[key] = statistics.median(r[key] for r in runs)
    summary["repeats"] = len(runs)
    return summary


def run_b1(iters: int, batch: int, repeats: int = 1) -> dict:
    """B1 for each estimator: the systems alternated `repeats` times (cnftrace,
    zuko, TFP, cnftrace, zuko, TFP, ...), each run kept under "runs" and each
    system's medians under its name; cnftrace's compute floor at its median NFE."""
    if repeats < 1:
        raise ValueError(f"repeats must be positive; got {repeats}.")
    out = {}
    for est in ("hutchinson", "exact"):
        runs = [
            {name: _b1_once(name, est, iters, batch) for name in B1_SYSTEMS}
            for _ in range(repeats)
        ]
        entry = {name: _median_run([r[name] for r in runs]) for name in B1_SYSTEMS}
        ours = entry["cnftrace"]
        costs = b1.evaluation_costs(est, batch=batch)
        ours["floor_s"] = b1.floor_seconds(costs, ours["nfe_fwd"], ours["nfe_bwd"])
        ours["costs"] = costs
        entry["runs"] = runs
        out[est] = entry
    return out


def _missing(name: str) -> str:
    return ZUKO_MISSING if name == "zuko" else TFP_MISSING


def _ratio(peer: dict | None, ours: dict) -> str:
    return "—" if peer is None else f"{peer['s_per_iter'] / ours['s_per_iter']:.2f}×"


_B1_HEADER = ["s/iter", "first step (s)", "NFE fwd", "NFE bwd"]


def _b1_cells(r: dict) -> list[str]:
    """A B1 run's s/iter, first step and NFE forward and backward."""
    return [
        f"{r['s_per_iter']:.4f}",
        f"{r['first_step_s']:.2f}",
        f"{r['nfe_fwd']:.1f}",
        f"{r['nfe_bwd']:.1f}",
    ]


def b1_markdown(res: dict) -> str:
    peers = [n for n in B1_SYSTEMS if n != "cnftrace"]
    rows = []
    for est, entry in res.items():
        ours = entry["cnftrace"]
        ratios = [_ratio(entry[n], ours) for n in peers]
        for name in B1_SYSTEMS:
            r = entry[name]
            if r is None:
                rows.append([est, _missing(name)] + [""] * (4 + len(peers)))
            else:
                extra = ratios if r is ours else [""] * len(peers)
                rows.append([est, r["system"], *_b1_cells(r), *extra])
    header = ["estimator", "system", *_B1_HEADER]
    header += [f"{B1_LABELS[n]} / cnftrace" for n in peers]
    parts = [markdown_table(header, rows, "llrrrr" + "r" * len(peers))]
    repeats = len(next(iter(res.values()))["runs"])
    if repeats > 1:
        runs = [
            [est, i, r["system"], *_b1_cells(r)]
            for est, entry in res.items()
            for i, round_ in enumerate(entry["runs"], 1)
            for r in (round_[name] for name in B1_SYSTEMS)
            if r is not None
        ]
        parts += [
            f"Medians of {repeats} runs above; each run below, in the order they ran "
            "(the systems alternated):",
            markdown_table(
                ["estimator", "round", "system", *_B1_HEADER], runs, "lrlrrrr"
            ),
        ]
    floors = []
    for est, entry in res.items():
        ours = entry["cnftrace"]
        c = ours["costs"]
        floors.append(
            [
                est,
                f"{c['f'] * 1e6:.0f}",
                f"{c['f_div'] * 1e6:.0f}",
                f"{c['grad_f_div'] * 1e6:.0f}",
                f"{ours['floor_s']:.4f}",
                f"{ours['s_per_iter'] / ours['floor_s']:.2f}",
            ]
        )
    header = ["estimator", "f (µs)", "f + divergence (µs)"]
    header += ["gradient of f + divergence (µs)", "floor (s/iter)", "real / floor"]
    parts += [
        "Compute floor (bare jitted evaluations of the same network at the same batch,"
        " times cnftrace's measured NFE):",
        markdown_table(header, floors, "lrrrrr"),
    ]
    return "\n\n".join(parts)


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


_B2_HEADER = ["budget", "≤ 0.15 nats", "≤ 0.05 nats", "best gap", "steps"]


def _b2_cells(r: dict, budget_s: float) -> list[str]:
    """A B2 run's budget, times to the two gaps, best gap and steps."""
    ttg = {float(k): v for k, v in r["time_to_gap"].items()}
    return [
        f"{budget_s:.0f} s",
        _fmt_s(ttg[0.15]),
        _fmt_s(ttg[0.05]),
        f"{r['best_gap']:.3f}",
        r["steps"],
    ]


def b2_objectives_markdown(res: dict) -> str:
    rows = []
    for dataset, entry in res.items():
        for objective in OBJECTIVES:
            r = entry[objective]
            rows.append(
                [dataset, objective, *_b2_cells(r, entry["budget_s"])]
                + [f"{r['nfe_log_prob']:.0f}", r["nfe_sample"]]
            )
    header = ["data", "objective", *_B2_HEADER, "NFE of log_prob", "NFE of sample"]
    return markdown_table(header, rows, "llrrrrrrr")


def b2_markdown(res: dict) -> str:
    rows = []
    for dataset, entry in res.items():
        for r in (entry["cnftrace"], entry["zuko"]):
            if r is None:
                rows.append([dataset, ZUKO_MISSING] + [""] * 6)
                continue
            true = r.get("test_true_nll")
            rows.append(
                [dataset, r["system"], *_b2_cells(r, entry["budget_s"])]
                + ["—" if true is None else f"{true:.3f}"]
            )
    header = ["data", "system", *_B2_HEADER, "test set's true-density NLL"]
    return markdown_table(header, rows, "llrrrrrr")


def targets_markdown(b1_res, b2_res, b3_res) -> str:
    rows = []
    if b1_res:
        for est in ("hutchinson", "exact"):
            ours = b1_res[est]["cnftrace"]
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
            for name, label, target in (
                ("zuko", "zuko", TARGETS["speedup"]),
                ("tfp", "TFP (JAX)", TARGETS["speedup_tfp"]),
            ):
                peer = b1_res[est].get(name)
                if peer is not None:
                    ratio = peer["s_per_iter"] / s
                    rows.append(
                        (
                            f"B1 {est} ≥ {target:g}× faster than {label}",
                            f"{ratio:.2f}×",
                            ratio >= target,
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
    cells = [[name, value, _mark(ok)] for name, value, ok in rows]
    return markdown_table(["target", "measured", ""], cells)


def machine() -> str:
    versions = {"cnftrace": cnftrace.__version__, "jax": jax.__version__}
    for name in (
        "equinox",
        "diffrax",
        "optax",
        "torch",
        "zuko",
        "tensorflow_probability",
    ):
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
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="B1 rounds, the systems alternated in each (cnftrace, zuko, TFP, "
        "cnftrace, ...); the report gives every run and the medians (default 2, "
        "1 with --quick)",
    )
    args = parser.parse_args(argv)
    sections = {s.strip() for s in args.only.split(",") if s.strip()}
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be positive; got {args.repeats}.")
    repeats = args.repeats or (1 if args.quick else 2)
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(
            f"--only: unknown sections {sorted(unknown)}; use {', '.join(SECTIONS)}."
        )
    out = args.out or os.path.join(_common.RESULTS, "benchmarks.md")
    if args.quick:
        b1_args = dict(iters=3, batch=64)
        b4_args = b4.QUICK
        b2_args = dict(budgets={"8gaussians": 2.5}, eval_every=2.5, test_size=200)
        b3_args = dict(
            divergence=dict(dims=(2, 8), batch=64, repeats=3),
            step=dict(batches=(64, 128), iters=3),
            memory=dict(num_steps=(4, 16), batch=64),
        )
    else:
        b1_args = dict(iters=_common.B1_ITERS, batch=_common.B1_BATCH)
        b2_args = dict(
            budgets={"8gaussians": 240.0, "checkerboard": 480.0},
            eval_every=_common.B2_EVAL_EVERY_S,
            test_size=_common.B2_TEST_SIZE,
        )
        b3_args = dict(divergence={}, step={}, memory={})
        b4_args = {}

    started = datetime.datetime.now(datetime.timezone.utc)
    load_before = os.getloadavg()
    b1_res = run_b1(**b1_args, repeats=repeats) if "b1" in sections else None
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
        "# B1, B2 and B3: the suite's last report",
        "",
        f"Written by `python -m experiments.bench.run{' --quick' if args.quick else ''}"
        f"{'' if sections == set(SECTIONS) else ' --only ' + args.only}"
        f"{'' if args.repeats is None else f' --repeats {args.repeats}'}` on "
        f"{started:%Y-%m-%d %H:%M} UTC. Protocol: `experiments/README.md`; "
        "the peers' differences from the protocol: "
        "`experiments/bench/zuko_peer.py` (zuko, `pip install -e '.[bench]'`) and "
        "`experiments/bench/tfp_peer.py` (TFP's JAX FFJORD, `pip install --pre -e "
        "'.[peers]'`: tfp-nightly is a pre-release).",
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
            f"cnftrace: {b1_res['hutchinson']['cnftrace']['solver']}."
            + (
                ""
                if b1_res["hutchinson"]["tfp"] is None
                else f" TFP (JAX): {tfp_peer.SOLVER}; {tfp_peer.NOTES}"
            ),
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
    # Two heading levels down, so that docs/benchmarks.md includes the report whole
    # under its section "Full tables of the last runs".
    lines = "\n".join(parts).split("\n")
    report = "\n".join("##" + line if line.startswith("#") else line for line in lines)
    report += "\n"
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
