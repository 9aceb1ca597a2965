"""B5's time to quality (issue 45): for each dimension, the gap to the true density
against training seconds, cnftrace as a user gets it with a time budget beside zuko's
NSF and CNF on the same axes, and the seconds each takes to come within 0.10 and 0.05
nats of the truth.

Density: `warped_product(d)`, B5's (see `b5.py`). Two fixed sets of its draws: the
curve's (`--curve-size`, 5,000 by default, key `CURVE_SEED`) and B5's test set
(`--test-size`, 20,000, key `TEST_SEED`). A curve point is (training seconds, gap),
gap = the model's NLL on the curve's points - their true NLL, exact trace.

- cnftrace: `mlp_flow(d, key=...)` and `fit(flow, sampler, key=..., seconds=S,
  validation=Validation(curve_points, every=k))`, every other setting `fit`'s default
  (only the progress bar follows the terminal). `fit` trains until S seconds of steps
  and their compilation are spent; its validations are off that clock, and each one
  is a curve point at the training seconds of its step (`history["val_step"]`,
  `history["val_nll"]` and the step's `history["seconds"]`; step 0's are 0).
  `k` comes from a calibration run before it, outside the budget: the same flow,
  key and budget for `CALIBRATION_STEPS` steps, whose first step gives the compile's
  seconds and the rest the seconds a step; `k` spreads the steps the budget then
  holds over `VALIDATIONS` validations. A CNF's steps slow down as its field learns,
  so the real run usually validates a few times fewer. `fit` returns its best
  validated parameters; their gap on the test set, with its paired standard error,
  is the final gap.
- zuko: B5's NSF and CNF (`zuko_peer.MODELS`), Adam 1e-3, batch 512, fresh draws,
  for S training seconds, scored on the curve's points after the first step past
  each of cnftrace's curve seconds and at the end (at the training seconds then
  spent), and on the test set at the end.

Candidates, each a curve of its own after the default's, in the same run:
`--fm-share S` trains by flow matching for that share of the budget before maximum
likelihood; `--candidate NAME=VALUE,...` (repeatable) changes one or more factors of
the default recipe where a user would change them: `width` (`mlp_flow(...,
width=)`), `batch` (`fit(..., batch_size=)`), `probes` and `tolerance` (`fit(...,
objective=MaximumLikelihood(Hutchinson(probes), tolerance=...))`).

Seconds to a level: the training seconds of the first curve point at or under it
("not reached" otherwise). The plot draws gaps on a log axis, so a gap at or under
zero (within the noise of a model as good as the truth) is left out of its line.

    python -m experiments.bench.b5_curves --dims 10 --seconds 300
    python -m experiments.bench.b5_curves --dims 10 --peers none \
        --candidate tolerance=0.001 --candidate batch=512

(`fit`'s defaults are the ones of the day: the runs recorded with `--candidate
batch=256` at 10-D were made when a budget trained on batches of 512, which
`--candidate batch=512` now gives.)
"""

import argparse
import json
import os
import shlex
import sys
import time

import jax.random as jr
import numpy as np

import cnftrace
from cnftrace.datasets import warped_product
from experiments._common import (
    COLORS,
    DOCS_IMAGES,
    RESULTS,
    Target,
    architecture,
    atomic_write,
    cnftrace_log_prob,
    figure_bytes,
    gap_and_se,
    gap_axes,
    load_results,
    markdown_table,
    progress,
    zuko_peer_module,
)

CURVE_SEED = 5050  # the curve's points: draws apart from B5's test set (TEST_SEED)
LEVELS = (0.10, 0.05)  # nats
VALIDATIONS = 13  # the validations `every` aims at, over the calibrated steps
CALIBRATION_STEPS = 8
PEERS = ("nsf", "cnf")
STEM = "b5_curves"
IMAGE = "b5_time_to_quality.png"
LABELS = {
    "cnftrace": "cnftrace",
    "cnftrace_fm": "cnftrace, FM warm start",
    "zuko_nsf": "zuko NSF",
    "zuko_cnf": "zuko CNF",
}
# Each system's colour: the benchmark figures' own, and one more for the candidate.
SYSTEM_COLORS = {key: COLORS.get(label, "C3") for key, label in LABELS.items()}
FM_EVERY = 1000  # flow-matching steps between the warm start's validations
# The factors a candidate (`--candidate`) may change, and their types: the field's
# width, the batch, the trace estimator's probes and the training solve's tolerance.
SETTINGS = {"width": int, "batch": int, "probes": int, "tolerance": float}


def seconds_to(curve, level: float) -> float | None:
    """The seconds of the first point `(seconds, step, gap)` of `curve` whose gap is
    at or under `level`; `None` where none is."""
    for seconds, _, gap in curve:
        if gap <= level:
            return seconds
    return None


def validation_every(seconds, budget: float, validations: int = VALIDATIONS) -> int:
    """`Validation.every` for a run of `budget` seconds, from the `seconds` column
    of a calibration run's history (the training seconds after each step, the first
    with the compilation): the steps the budget holds at that pace, over
    `validations`."""
    if len(seconds) < 2:  # the budget went on the first step
        return 1
    per_step = (seconds[-1] - seconds[0]) / (len(seconds) - 1)
    compile_s = max(0.0, seconds[0] - per_step)
    steps = (budget - compile_s) / max(per_step, 1e-9)
    return max(1, round(steps / validations))


def _times(result: dict) -> dict:
    """`result` with its seconds to each of `LEVELS`."""
    to = {f"{level:g}": seconds_to(result["curve"], level) for level in LEVELS}
    return dict(result, seconds_to=to)


def cnftrace_curve(
    target: Target,
    points,
    test,
    seconds: float,
    every: int | None = None,
    fm_share: float = 0.0,
    seed: int = 0,
    settings: dict | None = None,
) -> dict:
    """cnftrace's defaults with a budget of `seconds`, validated on `points` (the
    curve) every `every` steps (`None`: at the pace of a calibration run), and its
    final gap on `test`; the model and the run from `jax.random.key(seed)`. With
    `fm_share`, a candidate recipe: that share of the budget trains by flow
    matching (`objective="fm"`, validated every `FM_EVERY` steps), and maximum
    likelihood starts from its model for the rest, with a fresh optimiser
    (`fm_share=1`: flow matching alone). `settings` (see `SETTINGS`) changes one
    or more factors of the default recipe, each where a user would change it."""
    settings = dict(settings or {})
    model_key, train_key = jr.split(jr.key(seed))
    flow = cnftrace.mlp_flow(target.dim, key=model_key, width=settings.get("width"))
    batch, objective = _batch_and_objective(settings)
    sizes = set()

    def sample(key, n):
        sizes.add(int(n))
        return target.sample(key, n)

    true_nll = float(-target.true_log_prob(points).mean())
    curve, fm_s, fm_steps = [], 0.0, 0
    if fm_share > 0:
        flow, fm = cnftrace.fit(
            flow,
            sample,
            key=jr.fold_in(train_key, 1),
            objective="fm",
            seconds=fm_share * seconds,
            validation=cnftrace.Validation(points, every=FM_EVERY),
            progress=progress(),
        )
        curve = _curve(fm, true_nll, 0.0, 0)
        fm_s, fm_steps = fm["seconds"][-1], fm["step"][-1]
    trained, train_s, steps, calibration_s, wall_s = flow, fm_s, 0, 0.0, 0.0
    if fm_share < 1:
        # After flow matching, maximum likelihood by name: on a sampler of
        # many dimensions `fit`'s default is flow matching itself.
        if objective is None and fm_share > 0:
            objective = "mle"
        trained, history, every, calibration_s, wall_s = _likelihood_phase(
            flow,
            sample,
            train_key,
            points,
            seconds - fm_s,
            every,
            objective=objective,
            batch_size=batch,
        )
        curve += _curve(history, true_nll, fm_s, fm_steps)[1 if fm_steps else 0 :]
        steps, train_s = history["step"][-1], fm_s + history["seconds"][-1]
    gap, se = gap_and_se(target, test, cnftrace_log_prob(trained, test))
    recipe = dict(architecture(flow), steps=steps, batch=max(sizes))
    if fm_steps:
        recipe.update(fm_share=fm_share, fm_steps=fm_steps, fm_s=fm_s)
    if settings:
        recipe["settings"] = settings
    return _times(
        {
            "system": f"cnftrace {cnftrace.__version__}",
            "recipe": recipe,
            "every": every,
            "calibration_s": calibration_s,
            "train_s": train_s,
            "wall_s": wall_s,
            "steps_done": fm_steps + steps,
            "curve": curve,
            "gap": gap,
            "gap_se": se,
        }
    )


def _batch_and_objective(settings: dict):
    """`fit`'s `batch_size` and `objective` for a candidate's `settings` (`None`:
    `fit`'s own default); `MaximumLikelihood`'s own estimator and tolerance but for
    the `probes` and `tolerance` it names."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(
            f"settings: unknown {sorted(unknown)}; known: {list(SETTINGS)}"
        )
    kwargs = {}
    if "probes" in settings:
        kwargs["estimator"] = cnftrace.Hutchinson(num_probes=settings["probes"])
    if "tolerance" in settings:
        kwargs["tolerance"] = settings["tolerance"]
    objective = cnftrace.MaximumLikelihood(**kwargs) if kwargs else None
    return settings.get("batch"), objective


def parse_settings(spec: str) -> dict:
    """`"width=128,tolerance=0.01"` as `{"width": 128, "tolerance": 0.01}`: the
    factors of `SETTINGS`, each once, with a value of its type."""
    out = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in SETTINGS or name in out:
            raise ValueError(
                f"{part.strip()!r}: NAME=VALUE with NAME one of {', '.join(SETTINGS)}, "
                "each once"
            )
        kind = SETTINGS[name]
        try:
            number = kind(value)
        except ValueError:
            what = "whole number" if kind is int else "number"
            raise ValueError(f"{name}: a {what}; got {value!r}") from None
        if not 0 < number < float("inf"):
            raise ValueError(f"{name}: a positive number; got {value!r}")
        out[name] = number
    return out


def _likelihood_phase(
    flow, sample, key, points, seconds: float, every, objective=None, batch_size=None
):
    """`fit`'s defaults (its default objective unless `objective` is given, its
    default batch unless `batch_size` is) for `seconds`, validated on `points`
    every `every` steps (`None`: calibrated); the trained flow, its history,
    `every`, and the calibration's and the run's wall seconds."""
    sized = {} if batch_size is None else {"batch_size": batch_size}
    start = time.perf_counter()
    if every is None:
        _, calibration = cnftrace.fit(
            flow,
            sample,
            key=key,
            seconds=seconds,
            steps=CALIBRATION_STEPS,
            objective=objective,
            progress=False,
            **sized,
        )
        every = validation_every(calibration["seconds"], seconds)
    calibration_s = time.perf_counter() - start
    start = time.perf_counter()
    trained, history = cnftrace.fit(
        flow,
        sample,
        key=key,
        seconds=seconds,
        objective=objective,
        validation=cnftrace.Validation(points, every=every),
        progress=progress(),
        **sized,
    )
    return trained, history, every, calibration_s, time.perf_counter() - start


def _curve(history: dict, true_nll: float, s0: float, step0: int) -> list:
    """`[seconds, step, gap]` at each validation of a `fit` history, after `s0`
    seconds and `step0` steps of an earlier phase."""
    at = dict(zip(history["step"], history["seconds"]))
    return [
        [s0 + (0.0 if step == 0 else at[step]), step0 + step, nll - true_nll]
        for step, nll in zip(history["val_step"], history["val_nll"])
    ]


def zuko_curve(
    zuko_peer,
    target: Target,
    points,
    test,
    seconds: float,
    at_s,
    model: str,
    device: str = "cpu",
) -> dict:
    """zuko's `model` for `seconds` training seconds on torch's `device`, scored on
    `points` at each of `at_s` and at the end, and its final gap on `test`."""
    batch = 512
    z = zuko_peer.zuko_b4(
        target.sample,
        target.dim,
        None,
        batch,
        np.asarray(points),
        eval_at_s=at_s,
        max_train_s=seconds,
        model=model,
        final_test=np.asarray(test),
        device=device,
    )
    evaluated = [
        (s, step, logp) for s, (_, step, logp) in zip(z["at_train_s"], z["at_s"])
    ]
    evaluated.append((z["train_s"], z["steps_done"], z["final_logp"]))
    curve, steps_seen = [], set()
    for s, step, logp in evaluated:
        if step not in steps_seen:  # a slow step can pass several of `at_s`
            steps_seen.add(step)
            curve.append([s, step, gap_and_se(target, points, logp)[0]])
    gap, se = gap_and_se(target, test, z["final_test_logp"])
    peer = {key: z[key] for key in ("system", "model", "train_s", "steps_done")}
    return _times(dict(peer, batch=batch, curve=curve, gap=gap, gap_se=se))


def run(
    dims=(10,),
    seconds: float = 300.0,
    curve_size: int = 5000,
    test_size: int = 20_000,
    peers=PEERS,
    on_row=None,
    every: int | None = None,
    fm_share: float = 0.0,
    seed: int = 0,
    device: str = "cpu",
    candidates=(),
) -> dict:
    """A row per d of `dims`: cnftrace's curve, then each of zuko's `peers` at the
    seconds of its points. `on_row(key, row)` is called as each row is done.
    `every`: cnftrace's steps between validations, instead of calibrating them
    (smoke runs). `fm_share` > 0: also the flow-matching warm start's curve
    (see `cnftrace_curve`). `seed`: cnftrace's model and run (the density and its
    points stay those of seed 0). `device`: torch's, where zuko trains ("cuda" on
    a GPU; cnftrace runs on JAX's default device). `candidates`: settings (see
    `parse_settings`), each a candidate's curve after the default's."""
    zuko_peer, missing = zuko_peer_module() if peers else (None, None)
    out = {}
    for d in dims:
        target = Target(f"warped_product({d})", warped_product(d, seed=0))
        points = target.sample(jr.key(CURVE_SEED), curve_size)
        test = target.test_set(test_size)
        row = {"density": target.density.name, "dim": d, "budget_s": seconds}
        row.update(n_curve=curve_size, n_test=test_size)
        row["measured"] = time.strftime("%Y-%m-%d %H:%M %Z")
        row["curve_true_nll"] = float(-target.true_log_prob(points).mean())
        row["test_true_nll"] = float(-target.true_log_prob(test).mean())
        row["seed"] = seed
        row["cnftrace"] = ours = cnftrace_curve(
            target, points, test, seconds, every, seed=seed
        )
        print(f"B5 curves d={d}: cnftrace {json.dumps(ours)}", flush=True)
        if fm_share > 0:
            row["cnftrace_fm"] = cnftrace_curve(
                target, points, test, seconds, every, fm_share, seed
            )
            candidate = json.dumps(row["cnftrace_fm"])
            print(f"B5 curves d={d}: candidate {candidate}", flush=True)
        for settings in candidates:
            result = cnftrace_curve(
                target, points, test, seconds, every, seed=seed, settings=settings
            )
            row[candidate_key(settings)] = result
            print(f"B5 curves d={d}: candidate {json.dumps(result)}", flush=True)
        at_s = [s for s, _, _ in ours["curve"]]
        for model in peers:
            if zuko_peer is None:
                row[f"zuko_{model}"] = {"missing": missing}
                continue
            peer = zuko_curve(
                zuko_peer, target, points, test, seconds, at_s, model, device
            )
            row[f"zuko_{model}"] = peer
            print(f"B5 curves d={d}: zuko {model} {json.dumps(peer)}", flush=True)
        out[str(d)] = row
        if on_row is not None:
            on_row(str(d), row)
    return out


def candidate_key(settings: dict) -> str:
    """The row's key of a candidate's result: `cnftrace_` and its settings."""
    return "cnftrace_" + "_".join(f"{k}{v:g}" for k, v in sorted(settings.items()))


def _label(key: str, result: dict) -> str:
    """The name of a system's line and row: a candidate's says what share of its
    budget went to flow matching before maximum likelihood, or which settings it
    changed."""
    settings = result.get("recipe", {}).get("settings")
    if settings:
        return "cnftrace, " + ", ".join(f"{k} {v:g}" for k, v in settings.items())
    share = result.get("recipe", {}).get("fm_share")
    if share == 1:
        return "cnftrace, flow matching alone"
    if share is not None:
        return f"cnftrace, flow matching {share:.0%} then likelihood"
    return LABELS[key]


def _systems(row: dict):
    """`(key, result)` of each system of `row` that ran: those of `LABELS`, then
    the candidates of `--candidate`."""
    keys = list(LABELS) + [k for k in row if k.startswith("cnftrace_")]
    for key in dict.fromkeys(keys):
        result = row.get(key)
        if isinstance(result, dict) and "curve" in result:
            yield key, result


def markdown(res: dict) -> str:
    rows = []
    for row in res.values():
        for key, r in _systems(row):
            name = _label(key, r)
            if key.startswith("cnftrace"):
                recipe = r["recipe"]
                name += (
                    f" ({recipe['width']}×{recipe['depth']}, batch {recipe['batch']})"
                )
            to = [
                "not reached" if s is None else f"{s:.0f}"
                for s in r["seconds_to"].values()
            ]
            gap = f"{r['gap']:.3f} ± {r['gap_se']:.3f}"
            rows.append(
                [row["dim"], name, f"{row['budget_s']:g}", *to, gap, r["steps_done"]]
            )
    header = ["d", "system", "budget (s)"]
    header += [f"seconds to ≤ {level:g} nats" for level in LEVELS]
    header += ["final gap ± se", "steps"]
    return markdown_table(header, rows, "rlrrrrr")


def figure(plt, res: dict):
    """One panel per d: each system's gap against training seconds, log y, with
    `LEVELS` dashed."""
    rows = sorted(res.values(), key=lambda r: r["dim"])
    fig, axes = plt.subplots(
        1,
        len(rows),
        figsize=(4.8 * len(rows), 3.8),
        layout="constrained",
        squeeze=False,
    )
    for ax, row in zip(axes[0], rows):
        for i, (key, r) in enumerate(_systems(row)):
            points = [(s, gap) for s, _, gap in r["curve"] if gap > 0]
            if points:
                s, gap = zip(*points)
                label, color = _label(key, r), SYSTEM_COLORS.get(key, f"C{i + 4}")
                ax.plot(s, gap, "o-", ms=3, label=label, color=color)
        ticks = [0.01, 0.03, 0.05, 0.1, 0.3, 1, 3, 10]
        title = f"B5, warped_product({row['dim']})"
        ylabel = "model NLL − true NLL (nats)"
        gap_axes(plt, ax, LEVELS, ticks, "training seconds", ylabel, title)
    return fig


def write(res: dict, out_dir: str | None, command: str) -> list[str]:
    """The JSON, the table and the plot of `res`: under `out_dir`, or (`None`) the
    results directory and docs/images. Returns their paths."""
    stem = os.path.join(RESULTS if out_dir is None else out_dir, STEM)
    image = os.path.join(DOCS_IMAGES if out_dir is None else out_dir, IMAGE)
    atomic_write(stem + ".json", json.dumps(res, indent=1).encode())
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    sizes = "/".join(f"{n:,}" for n in sorted({row["n_curve"] for row in res.values()}))
    head = (
        f"Last written by `{command}` on {time.strftime('%Y-%m-%d %H:%M %Z')} (each "
        f"row's own run in the JSON); load average then {load} on {os.cpu_count()} "
        "CPUs. Gap = model NLL − true NLL (nats): the seconds to a level are those "
        f"of the first validation at or under it, on {sizes} fixed draws; the final "
        "gap is on B5's test set, ± paired standard error. cnftrace: `mlp_flow` and "
        "`fit(..., seconds=budget, validation=...)` with `fit`'s defaults; zuko: "
        "B5's NSF and CNF, Adam 1e-3, batch 512, for the same budget. See the "
        "script's docstring."
    )
    atomic_write(stem + ".md", f"{head}\n\n{markdown(res)}\n".encode())
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(plt, res)
    atomic_write(image, figure_bytes(fig, dpi=110))
    plt.close(fig)
    return [stem + ".json", stem + ".md", image]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="10", help="comma-separated dimensions")
    parser.add_argument(
        "--seconds", type=float, default=300.0, help="training budget per system"
    )
    parser.add_argument("--curve-size", type=int, default=5000)
    parser.add_argument("--test-size", type=int, default=20_000)
    parser.add_argument(
        "--peers", default=",".join(PEERS), help="zuko's models ('none' for none)"
    )
    parser.add_argument(
        "--every",
        type=int,
        help="cnftrace's steps between validations (default: calibrated so that "
        "about 13 fall in the budget); for smoke runs",
    )
    parser.add_argument(
        "--fm-share",
        type=float,
        default=0.0,
        help="also run a candidate: this share of the budget (0 to 1) trains by "
        "flow matching before maximum likelihood (1: flow matching alone)",
    )
    parser.add_argument(
        "--candidate",
        action="append",
        default=[],
        help="also run the defaults with these factors changed, as NAME=VALUE,... "
        f"with NAME one of {', '.join(SETTINGS)} (e.g. width=128 or "
        "tolerance=0.01,batch=256); repeat for several candidates",
    )
    parser.add_argument(
        "--out-dir",
        help="where the JSON, table and plot go (default: experiments/results and "
        "docs/images); for smoke runs",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="start a new table (else rows are updated)"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="cnftrace's model and run key (the density and its points stay fixed); "
        "rows are kept by dimension, so give another seed its own --out-dir",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where zuko trains (torch's device); cnftrace runs on JAX's default",
    )
    args = parser.parse_args(argv)
    try:
        dims = [int(d) for d in args.dims.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--dims: whole numbers separated by commas; got {args.dims!r}.")
    if not dims or min(dims) < 1:
        parser.error(f"--dims: dimensions of 1 or more; got {args.dims!r}.")
    if not 0 < args.seconds < float("inf"):
        parser.error(f"--seconds: a positive number of seconds; got {args.seconds}.")
    if not 0 <= args.fm_share <= 1:
        parser.error(f"--fm-share: a share in [0, 1]; got {args.fm_share}.")
    if args.every is not None and args.every < 1:
        parser.error(f"--every: a number of steps, 1 or more; got {args.every}.")
    for flag, n in (("--curve-size", args.curve_size), ("--test-size", args.test_size)):
        if n < 2:
            parser.error(f"{flag}: at least 2 points (for a standard error); got {n}.")
    try:
        candidates = [parse_settings(spec) for spec in args.candidate]
    except ValueError as e:
        parser.error(f"--candidate: {e}")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    peers = [] if peers == ["none"] else peers
    if set(peers) - set(PEERS):
        unknown = sorted(set(peers) - set(PEERS))
        parser.error(f"--peers: unknown {unknown}; choose from {PEERS} or 'none'.")
    command = "python -m experiments.bench.b5_curves " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    stem = os.path.join(RESULTS if args.out_dir is None else args.out_dir, STEM)
    table = {} if args.fresh else load_results(stem)

    def save(key, row):
        table[key] = row
        ordered = {k: table[k] for k in sorted(table, key=int)}
        write(ordered, args.out_dir, command.strip())

    sizes = (args.curve_size, args.test_size)
    run(
        dims,
        args.seconds,
        *sizes,
        peers,
        save,
        args.every,
        args.fm_share,
        args.seed,
        args.device,
        candidates,
    )
    with open(stem + ".md") as f:
        print(f.read())


if __name__ == "__main__":
    main()
