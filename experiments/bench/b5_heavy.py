"""B5's heavy-tailed rows (issue 42): constructed densities with heavy tails and
well-separated modes (`cnftrace.datasets.heavy_tailed(d)`: Student-t marginals with 1.5
to 5 degrees of freedom and a two-mode marginal with one heavy mode, rotated), scored by
the gap to the truth and by a tail figure, beside the classical fit and zuko's NSF.

Each row, for `d` in `--dims`:

- `default`: the README's first recipe, as before bases existed: `mlp_flow(d, key=...)`
  (a standard-normal base) and `fit(flow, sampler, key=..., steps=STEPS)`.
- `fitted base`: the recipe with a base: `base = fit_base(rows, validation=val)` on
  `--rows` training draws and 5,000 validation draws (the Student-t or the Gaussian
  mixture, by validation), then `mlp_flow(d, key=..., base=base)` (its field starts at
  zero) and the same `fit`. Its seconds include the base's fit.
- `base alone`: that fitted base, untrained further; `BIC mixture`: `fit_base(rows,
  kind="mixture")`, the Gaussian mixture a user would fit (scikit-learn, BIC).
- zuko's NSF (B5's) on fresh draws for the fitted recipe's seconds, where installed.

Gap = model NLL - true NLL on the same `--test-size` held-out draws, exact trace, with
its paired standard error. Tail = the same gap over the 5% of those draws farthest from
the origin, per row.

    python -m experiments.bench.b5_heavy --dims 2,5,10 --steps 2000
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
from cnftrace.datasets import heavy_tailed
from experiments._common import (
    RESULTS,
    Target,
    atomic_write,
    cnftrace_log_prob,
    markdown_table,
    progress,
    zuko_at_seconds,
    zuko_peer_module,
)

DIMS = (2, 5, 10)
TAIL_SHARE = 0.05


def scores(target: Target, test, logp) -> dict:
    """The gap to the truth on `test` (± its paired standard error) and on its 5% of
    rows farthest from the origin."""
    diff = np.asarray(target.true_log_prob(test), np.float64) - np.asarray(
        logp, np.float64
    )
    if not np.all(np.isfinite(diff)):
        return {"gap": float("inf"), "gap_se": float("inf"), "tail": float("inf")}
    radius = np.linalg.norm(np.asarray(test, np.float64), axis=1)
    far = radius >= np.quantile(radius, 1 - TAIL_SHARE)
    return {
        "gap": float(diff.mean()),
        "gap_se": float(diff.std(ddof=1) / np.sqrt(diff.size)),
        "tail": float(diff[far].mean()),
        "tail_se": float(diff[far].std(ddof=1) / np.sqrt(far.sum())),
    }


def readme_default(target: Target, steps: int, test, seed: int = 0) -> dict:
    """The README's first recipe as it was before bases: a standard-normal base,
    `fit`'s defaults on fresh draws."""
    model_key, train_key = jr.split(jr.key(seed))
    flow = cnftrace.mlp_flow(target.dim, key=model_key)
    start = time.perf_counter()
    trained, history = cnftrace.fit(
        flow, target.sample, key=train_key, steps=steps, progress=progress()
    )
    train_s = time.perf_counter() - start
    logp = cnftrace_log_prob(trained, test)
    return dict(scores(target, test, logp), train_s=train_s)


def fitted_recipe(target: Target, steps: int, test, rows: int, seed: int = 0) -> dict:
    """`fit_base` on `rows` draws (5,000 more to validate its choice), a flow over
    it whose field starts at zero, and `fit` on fresh draws."""
    model_key, train_key = jr.split(jr.key(seed))
    train = np.asarray(target.sample(jr.key(10_000 + seed), rows), np.float64)
    val = np.asarray(target.sample(jr.key(20_000 + seed), 5000), np.float64)
    start = time.perf_counter()
    base, info = cnftrace.fit_base(train, validation=val, return_info=True)
    base_s = time.perf_counter() - start
    flow = cnftrace.mlp_flow(target.dim, key=model_key, base=base)
    trained, history = cnftrace.fit(
        flow, target.sample, key=train_key, steps=steps, progress=progress()
    )
    train_s = time.perf_counter() - start
    alone = scores(target, test, np.asarray(base.log_prob(test)))
    mixture = cnftrace.fit_base(train, kind="mixture")
    return {
        "fitted": dict(
            scores(target, test, cnftrace_log_prob(trained, test)),
            train_s=train_s,
            base_s=base_s,
            base=info["reason"],
            loss_last=float(history["loss"][-1]),
        ),
        "base_alone": alone,
        "bic_mixture": dict(
            scores(target, test, np.asarray(mixture.log_prob(test))),
            components=mixture.n_components,
        ),
    }


def run(
    dims=DIMS,
    steps=2000,
    rows=20_000,
    test_size=20_000,
    peers=("nsf",),
    save=None,
    earlier=None,
):
    """The rows of `dims`, added to (or replacing those of) the `earlier` rows."""
    zuko_peer, missing = zuko_peer_module() if peers else (None, None)
    out = dict(earlier or {})
    for d in dims:
        target = Target(f"heavy_tailed({d})", heavy_tailed(d, seed=0))
        test = target.test_set(test_size)
        row = {"density": target.density.name, "dim": d, "n_test": test_size}
        row["measured"] = time.strftime("%Y-%m-%d %H:%M %Z")
        row["rows"] = rows
        row["steps"] = steps
        row["default"] = readme_default(target, steps, test)
        row.update(fitted_recipe(target, steps, test, rows))
        print(f"B5 heavy d={d}: {json.dumps(row)}", flush=True)
        for model in peers:
            if zuko_peer is None:
                row[f"zuko_{model}"] = {"missing": missing}
                continue
            seconds = row["fitted"]["train_s"]
            peer = zuko_at_seconds(zuko_peer, target, test, seconds, model)
            row[f"zuko_{model}"] = peer
            print(f"B5 heavy d={d}: zuko {model} {peer}", flush=True)
        out[str(d)] = row
        if save is not None:
            save(out)
    return out


def markdown(res: dict) -> str:
    def cell(r):
        if r is None or "gap" not in r:
            return "not run"
        tail = "" if r.get("tail") is None else f"; tail {r['tail']:.2f}"
        return f"{r['gap']:.3f} ± {r['gap_se']:.3f}{tail}"

    rows = []
    for _, row in sorted(res.items(), key=lambda item: int(item[0])):
        nsf = row.get("zuko_nsf")
        rows.append(
            [
                row["dim"],
                row.get("steps", 2000),
                cell(row["default"]) + f" ({row['default']['train_s']:.0f} s)",
                cell(row["fitted"]) + f" ({row['fitted']['train_s']:.0f} s)",
                cell(row["base_alone"]),
                cell(row["bic_mixture"]) + f" (k = {row['bic_mixture']['components']})",
                "zuko not installed"
                if nsf is None or "missing" in nsf
                else cell(nsf) + f" ({nsf['steps_done']} steps)",
                row["fitted"]["base"],
                row["measured"],
            ]
        )
    header = [
        "d",
        "steps",
        "default (normal base)",
        "fitted base (default for a table)",
    ]
    header += ["base alone", "BIC mixture", "zuko NSF, fitted's seconds"]
    header += ["base chosen", "measured"]
    return markdown_table(header, rows, "rrrrrrrll")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default=",".join(map(str, DIMS)))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--test-size", type=int, default=20_000)
    parser.add_argument("--peers", default="nsf", help="zuko's models ('' for none)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "b5_heavy"))
    parser.add_argument(
        "--fresh", action="store_true", help="start a new table (else rows are updated)"
    )
    args = parser.parse_args(argv)
    earlier = None
    if not args.fresh and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            earlier = json.load(f)
    dims = [int(d) for d in args.dims.split(",") if d]
    peers = [p for p in args.peers.split(",") if p]
    command = "python -m experiments.bench.b5_heavy " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )

    def save(res):
        atomic_write(args.out + ".json", json.dumps(res, indent=1).encode())
        head = (
            f"Last written by `{command}` on {time.strftime('%Y-%m-%d %H:%M %Z')}; "
            f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}. "
            "Gap to the truth (nats) ± paired standard error; tail: the gap over the "
            "5% of test draws farthest from the origin. See the script's docstring."
        )
        atomic_write(args.out + ".md", f"{head}\n\n{markdown(res)}\n".encode())

    run(dims, args.steps, args.rows, args.test_size, peers, save, earlier)
    with open(args.out + ".md") as f:
        print(f.read())


if __name__ == "__main__":
    main()
