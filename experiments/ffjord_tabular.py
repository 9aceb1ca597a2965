"""FFJORD's tabular density estimation (Grathwohl et al. 2019, table 2 and appendix
table 4): POWER, GAS, HEPMASS, MINIBOONE and BSDS300 with the paper's settings, and
scikit-learn's bundled tabular sets run through the same pipeline.

    python -m experiments.ffjord_tabular --data miniboone --data-dir DATA
    python -m experiments.ffjord_tabular --data all-sklearn
    python -m experiments.ffjord_tabular --data power --data-dir DATA --quick

`DATA` is the unpacked `data/` folder of MAF's archive (Zenodo record 1161203,
`data.tar.gz`), holding `power/`, `gas/`, `hepmass/`, `miniboone/` and `BSDS300/`;
it cannot be downloaded by this script. The scikit-learn sets ship with
scikit-learn. Results go to `experiments/results/ffjord_tabular_<data>.{json,md}`
(`..._quick` with `--quick`), written atomically, and the table is printed.

What every run does (FFJORD's `train_tabular.py` and its appendix):

- Model: a chain of `blocks` CNF blocks, each a ConcatSquash MLP with `depth` hidden
  layers of width `factor * d` and the data set's activation (table below), end
  time learnt (FFJORD's `train_T`, starting at T = 1), dopri5 at atol 1e-8,
  rtol 1e-6 (`--atol`/`--rtol`), in float32 as FFJORD (`--dtype float64` to change).
- Training: Adam, learning rate 1e-3, batches of `batch` drawn from the training
  set; the trace by Hutchinson's estimator with one Gaussian probe (the default of
  FFJORD's `train_tabular.py`, whose published commands do not pass `--rademacher`;
  `--probe rademacher` to change). FFJORD's Adam passes `weight_decay=1e-6` but its
  update (`p.data.add(...)`, not `add_`) discards the decay, so there is none here.
- Stopping (FFJORD's rule): validate every 200 steps; after more than 10
  validations without improvement the learning rate drops to 1e-4, after more than
  20 to 1e-5, after more than 30 training stops; the parameters with the best
  validation NLL are kept. Here each learning rate is a stage of `cnftrace.fit` with
  `patience` (11, 10, 10 validations for `--early-stopping 30`); a stage starts from
  the best parameters so far with a fresh Adam state (FFJORD carries on from the
  current ones), and its patience counts from that stage's best. Validation uses
  the training estimator on the MAF sets (as FFJORD) and the exact trace on the
  scikit-learn sets.
- Test: the exact trace (a JVP per dimension), in chunks, on the whole test set; the
  NLL in nats with its standard error, the NFE, and a full-covariance Gaussian fitted
  to the training set as a baseline, with the paired per-sample difference.

| data | d | activation | depth | width | blocks | batch | FFJORD test NLL |
|---|---|---|---|---|---|---|---|
| power | 6 | tanh | 3 | 10 d | 5 | 10000 | -0.46 |
| gas | 8 | tanh | 3 | 20 d | 5 | 1000 | -8.59 |
| hepmass | 21 | softplus | 2 | 10 d | 10 | 10000 | 14.92 |
| miniboone | 43 | softplus | 2 | 20 d | 1 | 1000 | 10.43 |
| bsds300 | 63 | softplus | 3 | 20 d | 2 | 10000 | -157.40 |
| breast_cancer, wine, diabetes | 30, 13, 10 | softplus | 2 | 20 d | 1 | 1000 * | - |

The scikit-learn sets take MINIBOONE's setting (the smallest of the five sets, and
theirs are smaller still), with batches (*) capped at the training set's size and a
validation every 10 steps (a step is then about one epoch).

Expected full-run times (MAF sets): an extrapolation, not a measurement. `--time-steps
K` trains K steps of the paper configuration and reports the time per step after
compilation; measured on small synthetic files in the real formats and dimensions
(`tests/_formats.py`) at the paper's batch sizes, on two busy CPU cores, at
initialisation (the NFE of a trained FFJORD model is several times higher, so the
per-step cost grows during training). See docs/tabular.md for the figures and their
basis.

Options: `--max-steps` and `--max-minutes` bound a run (the time budget is checked at
validations; the run stops at the first one past it and keeps the best parameters
so far); `--checkpoint-dir` makes a long run resumable (rerun the same command);
`--quick` is a smoke run of seconds (tiny model, a few steps, 64 test samples).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from scipy.stats import multivariate_normal

import cnftrace
from cnftrace.datasets import (
    TABULAR_DATASETS,
    UCI_DATASETS,
    gaussian_baseline_nll,
    load_tabular,
    load_uci,
)
from experiments import _common

PUBLISHED = {  # FFJORD, table 2: test NLL in nats
    "power": -0.46,
    "gas": -8.59,
    "hepmass": 14.92,
    "miniboone": 10.43,
    "bsds300": -157.40,
}


@dataclasses.dataclass(frozen=True)
class Setting:
    activation: str  # "tanh" or "softplus"
    depth: int  # hidden layers of each block's MLP
    factor: int  # hidden width = factor * d
    blocks: int  # CNF blocks in the chain
    batch: int  # training batch (capped at the training set's size)
    validate_every: int  # steps between validations
    val_exact: bool  # validate with the exact trace (else the training estimator)


_MINIBOONE = dict(activation="softplus", depth=2, factor=20, blocks=1, batch=1000)
SETTINGS = {
    "power": Setting("tanh", 3, 10, 5, 10000, 200, False),
    "gas": Setting("tanh", 3, 20, 5, 1000, 200, False),
    "hepmass": Setting("softplus", 2, 10, 10, 10000, 200, False),
    "miniboone": Setting(**_MINIBOONE, validate_every=200, val_exact=False),
    "bsds300": Setting("softplus", 3, 20, 2, 10000, 200, False),
    **{
        name: Setting(**_MINIBOONE, validate_every=10, val_exact=True)
        for name in TABULAR_DATASETS
    },
}
QUICK = Setting("tanh", 1, 1, 1, 64, 2, True)
DATASETS = UCI_DATASETS + TABULAR_DATASETS


class _OutOfTime(Exception):
    """Raised from `fit`'s `on_log` to end a stage once its budget is spent."""


def load(name: str, data_dir, dtype) -> cnftrace.datasets.Splits:
    if name in UCI_DATASETS:
        return load_uci(name, data_dir, dtype=dtype)
    splits = load_tabular(name)
    return cnftrace.datasets.Splits(*(a.astype(dtype) for a in splits))


def build_flow(d: int, setting: Setting, args, key):
    # A chain even of one block (whose key is then split too), as FFJORD's.
    flows = [
        cnftrace.mlp_flow(
            d,
            key=k,
            field="concatsquash",
            width=setting.factor * d,
            depth=setting.depth,
            activation=setting.activation,
            t1=1.0,
            learn_t1=True,
            solver="dopri5",
            rtol=args.rtol,
            atol=args.atol,
            max_steps=args.solver_max_steps,
            dtype=args.dtype,
        )
        for k in jr.split(key, setting.blocks)
    ]
    flow = cnftrace.Chain(flows)
    # Every parameter strongly typed as `dtype`: the learnt end time starts as a
    # weakly typed scalar, which the first Adam update makes strong, so that `fit`'s
    # step would be compiled twice.
    dtype = np.dtype(args.dtype)
    strong = lambda a: jnp.asarray(a, dtype) if eqx.is_inexact_array(a) else a
    return jax.tree_util.tree_map(strong, flow)


def stage_plan(early_stopping: int) -> list[tuple[float, int]]:
    """FFJORD's rule as stages `(learning-rate factor, patience)`: the rate drops
    tenfold after more than N//3 and more than 2 (N//3) validations without
    improvement, and training stops after more than N."""
    third = early_stopping // 3
    plan = [(1.0, third + 1), (0.1, third), (0.01, early_stopping - 2 * third)]
    return [(f, p) for f, p in plan if p > 0]


def _final_step(history) -> int:
    return max(history["step"][-1:] + history["val_step"][-1:] + [0])


def train(flow, splits, setting: Setting, args, key, root: str):
    """Trains in stages (see `stage_plan`); returns the best flow, its validation
    NLL, a summary per stage and why training ended."""
    train_x, val_x = splits.train, splits.val
    batch = min(setting.batch, train_x.shape[0])
    estimator = cnftrace.Hutchinson(sampler=args.probe)
    val_estimator = None if setting.val_exact else estimator
    log_every = 10 if setting.validate_every % 10 == 0 else 1
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    best_flow, best_val, used, stages = flow, math.inf, 0, []
    reason = "early stopping"
    for s, (factor, patience) in enumerate(stage_plan(args.early_stopping)):
        if used >= args.max_steps:
            reason = "step budget"
            break
        if s > 0 and deadline is not None and time.time() > deadline:
            reason = "time budget"
            break
        directory = os.path.join(root, f"stage{s}")
        marker = os.path.join(directory, "finished.json")
        lr = args.lr * factor
        steps = args.max_steps - used
        config = {
            "experiment": "ffjord_tabular",
            "data": args.data,
            "setting": dataclasses.asdict(setting),
            "stage": s,
            "lr": lr,
            "patience": patience,
            "atol": args.atol,
            "rtol": args.rtol,
            "dtype": args.dtype,
            "seed": args.seed,
        }
        seen = {"flagged": None}

        def on_log(record, s=s, seen=seen):
            if "val_nll" in record:
                nfe = record.get("nfe", 0)  # none before the first step
                print(
                    f"  stage {s} step {record['step']}: val NLL "
                    f"{record['val_nll']:.4f}, train NFE {nfe}",
                    file=sys.stderr,
                    flush=True,
                )
            if deadline is None or time.time() <= deadline:
                return
            if seen["flagged"] is not None:  # its checkpoint is written by now
                raise _OutOfTime
            if "val_nll" in record:  # this validation is checkpointed next
                seen["flagged"] = record["step"]

        common = dict(
            key=jr.fold_in(key, s),
            batch_size=batch,
            objective=cnftrace.MaximumLikelihood(estimator, tolerance=None),
            optimizer=optax.adam(lr),
            validation=cnftrace.Validation(
                val_x,
                every=setting.validate_every,
                patience=patience,
                estimator=val_estimator,
            ),
            checkpoints=cnftrace.Checkpoints(
                directory, every=setting.validate_every, keep=2, config=config
            ),
            progress=_common.progress(),
            log_every=log_every,
        )
        finished = None
        if os.path.exists(marker):  # a finished stage: reload, train nothing
            with open(marker) as f:
                finished = json.load(f)
            steps = finished["final_step"]
        try:
            trained, hist = cnftrace.fit(
                best_flow, train_x, steps=steps, on_log=on_log, **common
            )
            stopped = None
        except _OutOfTime:  # reload the checkpoint of the last validation
            trained, hist = cnftrace.fit(
                best_flow, train_x, steps=seen["flagged"], **common
            )
            stopped = "time budget"
        final = _final_step(hist)
        if stopped is None and finished is None:
            stopped = "early stopping" if final < steps else "step budget"
            _common.atomic_write(
                marker, json.dumps({"final_step": final, "stopped": stopped}).encode()
            )
        elif finished is not None:
            stopped = finished["stopped"]
        used += final
        stage_best = min(hist["val_nll"]) if hist["val_nll"] else math.inf
        if stage_best < best_val:
            best_flow, best_val = trained, stage_best
        nfe = hist["nfe"][-10:] or [0]
        stages.append(
            {
                "lr": lr,
                "patience": patience,
                "steps": final,
                "stopped": stopped,
                "best_val_nll": stage_best,
                "seconds": hist["seconds"][-1] if hist["seconds"] else 0.0,
                "train_nfe_end": float(np.mean(nfe)),
                "val_step": hist["val_step"],
                "val_nll": hist["val_nll"],
            }
        )
        reason = stopped
        if stopped != "early stopping":
            break
    return best_flow, best_val, stages, reason


def evaluate(flow, splits, chunk: int) -> dict:
    """Exact-trace test NLL with its standard error, the Gaussian baseline, and
    their paired difference per test sample."""
    start = time.perf_counter()
    logp, nfe = cnftrace.log_prob_batched(
        flow, splits.test, batch_size=chunk, return_nfe=True
    )
    seconds = time.perf_counter() - start
    if not np.all(np.isfinite(logp)):
        raise FloatingPointError("the trained flow gave a non-finite test log-density")
    nll, nll_se = _common.mean_and_stderr(-logp)
    train = np.asarray(splits.train, np.float64)
    test = np.asarray(splits.test, np.float64)
    gauss = gaussian_baseline_nll(train, test)
    diff, diff_se = _common.mean_and_stderr(
        -logp - _gaussian_nll_per_sample(train, test)
    )
    t1 = [float(b.t1) for b in flow.blocks]
    return {
        "test_nll": nll,
        "test_stderr": nll_se,
        "test_nfe": nfe,
        "eval_seconds": seconds,
        "gaussian_nll": gauss,
        "minus_gaussian": diff,
        "minus_gaussian_stderr": diff_se,
        "t1": t1,
    }


def _gaussian_nll_per_sample(train, test) -> np.ndarray:
    """Per-sample NLL of the Gaussian of `gaussian_baseline_nll` (same covariance,
    same jitter), for a paired comparison; its mean is checked against that."""
    cov = np.cov(train, rowvar=False, bias=True) + 1e-6 * np.eye(train.shape[1])
    out = -multivariate_normal(train.mean(axis=0), cov).logpdf(test)
    assert abs(out.mean() - gaussian_baseline_nll(train, test)) < 1e-6
    return out


def row(r: dict) -> list[str]:
    pub = r.get("published")
    gap = "-" if pub is None else f"{r['test_nll'] - pub:+.2f}"
    return [
        r["data"],
        str(r["dim"]),
        "/".join(str(n) for n in r["sizes"]),
        f"{r['test_nll']:.3f} ± {r['test_stderr']:.3f}",
        "-" if pub is None else f"{pub:.2f}",
        gap,
        f"{r['gaussian_nll']:.3f}",
        f"{r['minus_gaussian']:+.3f} ± {r['minus_gaussian_stderr']:.3f}",
        f"{r['best_val_nll']:.3f}",
        f"{r['test_nfe']:.0f}",
        "+".join(str(s["steps"]) for s in r["stages"]) + f" ({r['stopped']})",
        f"{r['train_seconds']:.0f}",
    ]


HEADER = [
    "data",
    "d",
    "train/val/test",
    "test NLL (exact)",
    "FFJORD",
    "gap",
    "Gaussian",
    "flow − Gaussian (paired)",
    "best val NLL",
    "test NFE",
    "steps per stage",
    "train s",
]


def run_one(name: str, args) -> dict:
    dtype = np.dtype(args.dtype)
    splits = load(name, args.data_dir, dtype)
    setting = QUICK if args.quick else SETTINGS[name]
    if args.batch_size is not None:
        setting = dataclasses.replace(setting, batch=args.batch_size)
    if args.quick:
        n = min(64, splits.val.shape[0], splits.test.shape[0])
        splits = cnftrace.datasets.Splits(splits.train, splits.val[:n], splits.test[:n])
    d = splits.train.shape[1]
    model_key, train_key = jr.split(jr.key(args.seed))
    flow = build_flow(d, setting, args, model_key)
    if args.time_steps:
        return time_steps(name, flow, splits, setting, args, train_key)
    run_args = argparse.Namespace(**{**vars(args), "data": name})
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        root = args.checkpoint_dir and os.path.join(args.checkpoint_dir, name)
        trained, best_val, stages, stopped = train(
            flow, splits, setting, run_args, train_key, root or scratch
        )
    train_seconds = time.perf_counter() - start
    result = {
        "data": name,
        "dim": d,
        "sizes": [int(a.shape[0]) for a in splits],
        "setting": dataclasses.asdict(setting),
        "published": PUBLISHED.get(name),
        "best_val_nll": best_val,
        "stages": stages,
        "stopped": stopped,
        "steps": sum(s["steps"] for s in stages),
        "train_seconds": train_seconds,
        **evaluate(trained, splits, args.test_chunk),
    }
    print(
        f"{name}: test NLL {result['test_nll']:.4f} ± {result['test_stderr']:.4f} "
        f"(Gaussian {result['gaussian_nll']:.4f}), {result['steps']} steps, "
        f"{train_seconds:.0f} s",
        flush=True,
    )
    return result


def time_steps(name, flow, splits, setting, args, key) -> dict:
    """Wall-clock and CPU seconds per training step of the configuration, after
    the first step (which compiles)."""
    batch = min(setting.batch, splits.train.shape[0])
    clocks = []  # after each step: (wall, CPU) seconds
    _, hist = cnftrace.fit(
        flow,
        splits.train,
        key=key,
        steps=args.time_steps + 1,
        batch_size=batch,
        objective=cnftrace.MaximumLikelihood(
            cnftrace.Hutchinson(sampler=args.probe), tolerance=None
        ),
        optimizer=optax.adam(args.lr),
        progress=_common.progress(),
        on_log=lambda _: clocks.append((time.perf_counter(), time.process_time())),
    )
    wall, cpu = ((b - a) / args.time_steps for a, b in zip(clocks[0], clocks[-1]))
    out = {
        "data": name,
        "dim": splits.train.shape[1],
        "batch": batch,
        "setting": dataclasses.asdict(setting),
        "seconds_per_step": wall,
        "cpu_seconds_per_step": cpu,
        "first_step_seconds": hist["seconds"][0],
        "nfe_forward": hist["nfe"][1:],
        "nfe_backward": hist["nfe_backward"][1:],
        "load_average": os.getloadavg(),
    }
    print(
        f"{name}: {wall:.2f} s ({cpu:.2f} CPU s) per step (batch {batch}, forward "
        f"NFE {np.mean(out['nfe_forward']):.0f}, first step "
        f"{hist['seconds'][0]:.0f} s)",
        flush=True,
    )
    return out


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        required=True,
        choices=DATASETS + ("all-sklearn",),
        help="a MAF set (needs --data-dir) or a scikit-learn set",
    )
    parser.add_argument("--data-dir", help="the unpacked data/ folder of MAF's archive")
    parser.add_argument("--out", default=_common.RESULTS)
    parser.add_argument("--checkpoint-dir", help="resumable runs: checkpoints go here")
    parser.add_argument("--max-steps", type=int, help="default: no limit")
    parser.add_argument("--max-minutes", type=float)
    parser.add_argument("--early-stopping", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--atol", type=float, default=1e-8)
    parser.add_argument("--rtol", type=float, default=1e-6)
    parser.add_argument(
        "--probe", choices=("gaussian", "rademacher"), default="gaussian"
    )
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--solver-max-steps", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, help="default: the paper's")
    parser.add_argument("--test-chunk", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-steps", type=int, default=0, help="time K steps")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = parser.parse_args(argv)
    names = TABULAR_DATASETS if args.data == "all-sklearn" else (args.data,)
    if any(n in UCI_DATASETS for n in names):
        if args.data_dir is None:
            parser.error(
                f"--data {args.data} needs --data-dir DIR: the unpacked data/ folder "
                "of MAF's archive (Zenodo record 1161203, data.tar.gz)."
            )
        if not os.path.isdir(args.data_dir):
            parser.error(
                f"--data-dir {args.data_dir!r} is not a directory; pass the unpacked "
                "data/ folder of MAF's archive (Zenodo record 1161203, data.tar.gz)."
            )
    elif args.data_dir is not None:
        parser.error(f"--data-dir is for the MAF sets only, not --data {args.data}.")
    if args.max_steps is None:
        args.max_steps = 6 if args.quick else 10**9
    for flag, value, low in (
        ("--max-steps", args.max_steps, 1),
        ("--early-stopping", args.early_stopping, 1),
        ("--test-chunk", args.test_chunk, 1),
        ("--batch-size", 1 if args.batch_size is None else args.batch_size, 1),
        ("--solver-max-steps", args.solver_max_steps, 1),
        ("--time-steps", args.time_steps, 0),
    ):
        if value < low:
            parser.error(f"{flag} must be at least {low}; got {value}.")
    for flag, value in (
        ("--lr", args.lr),
        ("--atol", args.atol),
        ("--rtol", args.rtol),
    ):
        if not value > 0:
            parser.error(f"{flag} must be positive; got {value}.")
    if args.max_minutes is not None and args.max_minutes < 0:
        parser.error(f"--max-minutes must be >= 0; got {args.max_minutes}.")
    if args.quick:
        args.atol = args.rtol = 1e-5
    return args, names, parser


def main(argv=None):
    args, names, parser = parse(argv)
    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    suffix = ("_quick" if args.quick else "") + ("_timing" if args.time_steps else "")
    report = timing_report if args.time_steps else results_report
    results = []
    for name in names:  # each set's report is written as soon as it is done
        try:
            results.append(run_one(name, args))
        except FileNotFoundError as e:
            parser.error(f"--data-dir: {e}")
        report([results[-1]], args, f"ffjord_tabular_{name}{suffix}")
    if len(names) > 1:
        md = report(results, args, f"ffjord_tabular_{args.data}{suffix}")
        print(md)
    return results


def results_report(results, args, stem) -> str:
    rows = [row(r) for r in results]
    md = describe(args) + "\n" + _common.markdown_table(HEADER, rows) + "\n"
    if len(results) == 1:
        print(md)
    payload = {"args": vars(args), "results": results}
    _common.write_results(os.path.join(args.out, stem), payload, md)
    return md


def timing_report(results, args, stem) -> str:
    header = ["data", "d", "batch", "blocks", "s / step", "CPU s / step"]
    header += ["forward NFE", "backward NFE", "first step s", "load average"]
    rows = [
        [
            r["data"],
            str(r["dim"]),
            str(r["batch"]),
            str(r["setting"]["blocks"]),
            f"{r['seconds_per_step']:.2f}",
            f"{r['cpu_seconds_per_step']:.2f}",
            f"{np.mean(r['nfe_forward']):.0f}",
            f"{np.mean(r['nfe_backward']):.0f}",
            f"{r['first_step_seconds']:.0f}",
            "{:.1f}".format(r["load_average"][0]),
        ]
        for r in results
    ]
    md = _common.markdown_table(header, rows) + "\n"
    payload = {"args": vars(args), "timing": results}
    _common.write_results(os.path.join(args.out, stem), payload, md)
    return md


def describe(args) -> str:
    return (
        "FFJORD tabular: test NLL in nats (lower is better) by the exact trace, ± one "
        "standard error; FFJORD's published figure and the gap to it; a "
        "full-covariance Gaussian fitted to the training set, and the flow's paired "
        "per-sample difference to it (negative: the flow is better); the best "
        "validation NLL; NFE of the test evaluation (all blocks); steps per "
        "learning-rate stage and why training ended. "
        f"dopri5 atol {args.atol:g} rtol {args.rtol:g}, {args.dtype}, "
        f"{args.probe} probe in training"
        + (", quick smoke settings." if args.quick else ".")
        + "\n"
    )


if __name__ == "__main__":
    main()
