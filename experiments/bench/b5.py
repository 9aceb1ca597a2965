"""B5, quality across dimension and data size: cnftrace as a user gets it, beside what
they would otherwise pick, on constructed densities of growing dimension and on real
tables that installed packages ship.

Half `dims`: `warped_product(d)` (exact log-density; non-Gaussian marginals, several
modes, volume-preserving banana warps, a rotation) at each d of `--dims`. cnftrace
runs the README's recipe with every default: `mlp_flow(d, key=...)` and `fit(flow,
sampler, key=..., steps=STEPS)`; the width, depth and batch it then used are read off
the built flow and the sampler's calls and recorded. zuko's NSF (5 transforms, 64 x 2,
8 bins) and CNF (B4's) train on the same fresh samples, Adam 1e-3, batch 512, for the
same training seconds as cnftrace took. Gap = model NLL - true NLL on the same held-out
points (20,000 by default), exact trace, with its paired standard error.

Half `files`: real tables shipped by scikit-learn and matplotlib (no downloads; see
`TABLES`), each written to a CSV and trained on by `cnftrace train --data FILE
--run-dir DIR` with no other flags, then `cnftrace eval DIR`. The baselines use the same
split (`split_table(data, val_fraction=0.1, test_fraction=0.1, seed=0)`, the command
line's defaults), are fitted on the training rows (those cnftrace trains on; it
early-stops on the validation rows) and are scored on the test rows in the data's
units: a full-covariance Gaussian (the same as `eval.json`'s `gaussian_baseline_nll`,
checked), a Gaussian mixture (full covariance, 1-8 components chosen by BIC), a
Gaussian KDE with a bandwidth chosen by 5-fold cross-validation, and zuko's NSF for the
training seconds cnftrace took, early-stopped on the validation rows. The mixture, the
KDE and the NSF see the data standardised by the training rows' mean and standard
deviation (as cnftrace does) and are scored in the data's units through the
standardisation's log-determinant.

    python -m experiments.bench.b5 --half dims --dims 2,5,10 --steps 2000
    python -m experiments.bench.b5 --half files
"""

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import numpy as np

import cnftrace
from cnftrace.datasets import read_table, split_table, warped_product
from experiments._common import (
    B5_MLE_STEPS,
    RESULTS as RESULTS_DIR,
    SPLIT,
    TABLES,
    Target,
    atomic_write,
    cnftrace_cli,
    cnftrace_default,
    gaussian_log_prob,
    gmm_bic,
    kde_cv,
    load_results,
    markdown_table,
    summary,
    trained_by,
    write_csv,
    zuko_at_seconds,
    zuko_peer_module,
)

DIMS = (2, 5, 10, 20, 40)
PEERS = ("nsf", "cnf")
FILES = tuple(TABLES)


def run_dims(
    dims=DIMS,
    steps: int = B5_MLE_STEPS,
    test_size: int = 20_000,
    peers=PEERS,
    peer_seconds: float | None = None,
    on_row=None,
    seed: int = 0,
) -> dict:
    """The `dims` half: for each d, cnftrace's defaults on `warped_product(d)`, then
    each of zuko's `peers` for cnftrace's training seconds (`peer_seconds`, if given,
    instead: for smoke runs). `on_row(key, row)` is called as each row is done.
    `seed` picks cnftrace's initialisation and training keys (not the density nor
    its test set): a row of another seed than 0 is keyed `"d/seed"`. `steps` are
    maximum likelihood's: at a dimension where `fit` trains by flow matching by
    default (`cnftrace.default_recipe(d).objective == "fm"`), it trains for that
    default's own steps."""
    zuko_peer, missing = zuko_peer_module() if peers else (None, None)
    out = {}
    for d in dims:
        target = Target(f"warped_product({d})", warped_product(d, seed=0))
        test = target.test_set(test_size)
        row = {"density": target.density.name, "dim": d, "n_test": test_size}
        row["measured"] = time.strftime("%Y-%m-%d %H:%M %Z")
        row["test_true_nll"] = float(-target.true_log_prob(test).mean())
        row["seed"] = seed
        chosen = cnftrace.default_recipe(d)
        length = steps if chosen.objective == "mle" else chosen.steps
        row["cnftrace"] = ours = cnftrace_default(target, length, test, seed)
        print(f"B5 d={d}: cnftrace {ours}", flush=True)
        seconds = ours["train_s"] if peer_seconds is None else peer_seconds
        row["peer_budget_s"] = seconds  # cnftrace's seconds, but in smoke runs
        for model in peers:
            if zuko_peer is None:
                row[f"zuko_{model}"] = {"missing": missing}
                continue
            peer = zuko_at_seconds(zuko_peer, target, test, seconds, model)
            row[f"zuko_{model}"] = peer
            print(f"B5 d={d}: zuko {model} {peer}", flush=True)
        key = str(d) if seed == 0 else f"{d}/{seed}"
        out[key] = row
        if on_row is not None:
            on_row(key, row)
    return out


def _gap(result: dict) -> str:
    return f"{result['gap']:.3f} ± {result['gap_se']:.3f}"


def dims_markdown(res: dict) -> str:
    rows = []
    for row in res.values():
        ours = row["cnftrace"]
        r = ours["recipe"]
        seed = row.get("seed", 0)
        cells = [
            row["dim"] if seed == 0 else f"{row['dim']} (key {seed})",
            f"{r['width']}×{r['depth']}, {trained_by(r)}{r['steps']} × {r['batch']}",
            _gap(ours),
            f"{ours['train_s']:.0f}",
        ]
        gaps = {"cnftrace": ours["gap"]}
        for model in PEERS:
            peer = row.get(f"zuko_{model}")
            if peer is None:
                cells.append("not run")
            elif "missing" in peer:
                cells.append("zuko not installed")
            else:
                gaps[f"zuko {model.upper()}"] = peer["gap"]
                steps, secs = peer["steps_done"], peer["train_s"]
                cells.append(f"{_gap(peer)} ({steps} steps, {secs:.0f} s)")
        cells += [min(gaps, key=gaps.get), row["measured"]]
        rows.append(cells)
    header = ["d", "cnftrace recipe (width×depth, steps × batch)", "cnftrace gap"]
    header += ["cnftrace s", "zuko NSF gap, same seconds", "zuko CNF gap, same seconds"]
    header += ["best", "measured"]
    return markdown_table(header, rows, "rlrrrrll")


# ------------------------------------------------------------------ real tabular files


def run_file(
    name: str,
    work_dir: str,
    train_args=(),
    peers=("nsf",),
    peer_seconds=None,
    split_seed: int = 0,
):
    """One table of the `files` half: its CSV, cnftrace's run, each method's test NLL
    in the data's units (`methods`), and cnftrace's gap to the BIC mixture with its
    paired standard error (from the run's per-row log-densities, recomputed here).
    `split_seed`: the command line's `--split-seed` (and the baselines' split)."""
    loader, source, holds = TABLES[name]
    data, names = loader()
    path = os.path.join(work_dir, name, f"{name}.csv")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_csv(path, data, names)
    table = read_table(path).data  # what cnftrace reads
    if not np.array_equal(table, data):
        raise AssertionError(f"{path} does not read back as the table written.")
    train, val, test = split_table(table, **(SPLIT | {"seed": split_seed}))
    if split_seed:
        train_args = ["--split-seed", str(split_seed), *train_args]
    row = {"source": source, "holds": holds, "rows": int(table.shape[0])}
    row.update(columns=int(table.shape[1]), split=[len(train), len(val), len(test)])
    row["measured"] = time.strftime("%Y-%m-%d %H:%M %Z")

    run_dir = os.path.join(work_dir, name, f"run{split_seed or ''}")
    ours = cnftrace_cli(path, run_dir, train_args)
    if ours["eval"]["n"] != len(test):
        raise AssertionError(
            f"eval.json scored {ours['eval']['n']} rows, not {len(test)}"
        )
    flow = cnftrace.load(run_dir)  # a StandardizedFlow: log_prob in the data's units
    logp = {"cnftrace": np.asarray(cnftrace.log_prob_batched(flow, test), np.float64)}
    ours["nll_reloaded"] = -float(logp["cnftrace"].mean())  # eval.json's, recomputed
    print(f"B5 {name}: cnftrace {ours}", flush=True)

    std = cnftrace.Standardization.from_data(train)
    log_det = float(np.asarray(std.log_det))  # log p(x) = log p(z) + log_det
    z_train, z_val, z_test = (
        np.asarray(std.forward(x), np.float64) for x in (train, val, test)
    )
    methods = {"cnftrace": ours}
    for method, result in (
        ("gmm_bic", gmm_bic(z_train, z_test)),
        ("kde_cv", kde_cv(z_train, z_test)),
    ):
        logp[method] = result.pop("test_logp") + log_det
        methods[method] = result
    logp["gaussian"] = gaussian_log_prob(train, test)
    methods["gaussian"] = {
        "minus_eval_json": float(-logp["gaussian"].mean())
        - ours["eval"]["gaussian_baseline_nll"]
    }
    zuko_peer, missing = zuko_peer_module() if peers else (None, None)
    for model in peers:
        if model != "nsf":
            raise ValueError(f"the files half runs zuko's NSF only; got {model!r}.")
        if zuko_peer is None:
            methods["zuko_nsf"] = {"missing": missing}
            continue
        seconds = ours["train_s"] if peer_seconds is None else peer_seconds
        row["peer_budget_s"] = seconds  # cnftrace's seconds, but in smoke runs
        z = zuko_peer.zuko_table_nsf(z_train, z_val, z_test, seconds)
        logp["zuko_nsf"] = z.pop("test_logp") + log_det
        methods["zuko_nsf"] = z
    for method, values in logp.items():
        if method != "cnftrace":  # eval.json's figures are cnftrace's
            methods[method].update(summary(values))
    others = {k: v for k, v in methods.items() if k != "cnftrace"}
    print(f"B5 {name}: baselines {others}", flush=True)
    row["methods"] = methods
    diff = logp["gmm_bic"] - logp["cnftrace"]  # cnftrace's NLL minus the mixture's
    row["cnftrace_minus_gmm"] = {
        "gap": float(diff.mean()),
        "se": float(diff.std(ddof=1) / len(diff) ** 0.5),
    }
    return row


def run_files(
    names=FILES,
    work_dir: str | None = None,
    train_args=(),
    peers=("nsf",),
    peer_seconds: float | None = None,
    on_row=None,
    split_seeds=(0,),
) -> dict:
    """The `files` half, a row per table of `names` and split seed (keyed `name`
    for split 0, `name/seed` for the others); the CSVs and run directories go under
    `work_dir` (a new temporary directory if `None`). `train_args` are added to
    `cnftrace train` (none for the benchmark; smoke runs shorten it) and
    `peer_seconds` replaces cnftrace's seconds as zuko's budget (smoke runs)."""
    work_dir = tempfile.mkdtemp(prefix="b5-files-") if work_dir is None else work_dir
    out = {}
    for name in names:
        for seed in split_seeds:
            row = run_file(name, work_dir, train_args, peers, peer_seconds, seed)
            row["work_dir"] = os.path.join(os.path.abspath(work_dir), name)
            row["split_seed"] = seed
            key = name if seed == 0 else f"{name}/{seed}"
            out[key] = row
            if on_row is not None:
                on_row(key, row)
    return out


def _nll(result: dict) -> str:
    return f"{result['nll']:.3f} ± {result['stderr']:.3f}"


def files_markdown(res: dict) -> str:
    rows = []
    for name, row in res.items():
        m = row["methods"]
        ours = m["cnftrace"]
        nsf = m.get("zuko_nsf")
        if nsf is None:
            nsf_cell = "not run"
        elif "missing" in nsf:
            nsf_cell = "zuko not installed"
        else:
            steps, secs = nsf["steps_done"], nsf["train_s"]
            nsf_cell = f"{_nll(nsf)} ({steps} steps, {secs:.0f} s)"
        scored = {k: v["nll"] for k, v in m.items() if "nll" in v}
        gap = row["cnftrace_minus_gmm"]
        flags = ours["command"].split("--run-dir")[1].split()[1:]
        rows.append(
            [
                name,
                f"{row['rows']} × {row['columns']}",
                "/".join(map(str, row["split"])),
                f"{_nll(ours)} ({ours['steps_done']} steps, {ours['train_s']:.0f} s"
                + (f"; {' '.join(flags)}" if flags else "")
                + ")",
                f"{_nll(m['gmm_bic'])} (k = {m['gmm_bic']['components']})",
                f"{_nll(m['kde_cv'])} (h = {m['kde_cv']['bandwidth']:.3g}"
                + (", grid's edge" if m["kde_cv"]["at_edge"] else "")
                + ")",
                _nll(m["gaussian"]),
                nsf_cell,
                f"{gap['gap']:+.3f} ± {gap['se']:.3f}",
                min(scored, key=scored.get).replace("_", " "),
                row["measured"],
            ]
        )
    header = ["file", "rows × cols", "train/val/test", "cnftrace train (no flags)"]
    header += ["GMM, BIC", "KDE, CV", "Gaussian", "zuko NSF, same seconds"]
    header += ["cnftrace − GMM", "best", "measured"]
    return markdown_table(header, rows, "lrrrrrrrrll")


# ------------------------------------------------------------------------ the command


def section_markdown(half: str, res: dict, command: str) -> str:
    """B5's section of the benchmark report for one half: how, then the table."""
    when = time.strftime("%Y-%m-%d %H:%M %Z")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    head = (
        f"Last written by `{command}` on {when} (each row's own run in its last "
        f"column); load average then {load} on {os.cpu_count()} CPUs. "
    )
    if half == "dims":
        head += (
            "Density: `cnftrace.datasets.warped_product(d)`. Gap = model NLL − true "
            "NLL on the same held-out points, exact trace, ± paired standard error. "
            "cnftrace: `mlp_flow(d, key=...)` and `fit(flow, sampler, key=..., "
            "steps=...)`, every other setting `fit`'s default (the recipe column says "
            "what they were). zuko: `flows.NSF(d, transforms=5, hidden_features=(64, "
            "64), bins=8)` and `flows.CNF` (hidden (64, 64, 64), tanh, span [0, 0.5], "
            "exact trace), Adam 1e-3, batch 512, for cnftrace's training seconds. "
            "All draw fresh samples each step."
        )
        return "\n".join([head, "", dims_markdown(res)])
    head += (
        "Test NLL (nats) in the data's units ± standard error, on the test rows of "
        "`cnftrace train`'s split (80/10/10, seed 0). cnftrace: `cnftrace train "
        "--data FILE --run-dir DIR` with no other flags (it early-stops on the "
        "validation rows), then `cnftrace eval`. Baselines fitted on the same "
        "training rows: a Gaussian mixture (full covariance, 1–8 components by "
        "BIC), a Gaussian KDE (bandwidth by 5-fold CV), both on the standardised "
        "rows; the full-covariance Gaussian (= eval.json's baseline); zuko's NSF on "
        "the standardised rows for cnftrace's training seconds, Adam 1e-3, batch "
        "min(512, rows), the best of its validations (every 100 steps, patience 10). "
        "cnftrace − GMM: paired difference of the per-row NLLs."
    )
    notes = [f"- {name}: {row['source']}: {row['holds']}." for name, row in res.items()]
    return "\n".join([head, "", files_markdown(res), "", *notes])


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--half", choices=("dims", "files", "both"), default="both")
    parser.add_argument("--dims", default=",".join(map(str, DIMS)))
    parser.add_argument(
        "--steps",
        type=int,
        default=B5_MLE_STEPS,
        help="dims: fit's maximum-likelihood steps (at the dimensions where fit "
        "trains by flow matching, its own default steps)",
    )
    parser.add_argument("--test-size", type=int, default=20_000, help="dims")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="dims: cnftrace's initialisation and training key (the density and "
        "its test set stay); rows of another seed than 0 are kept beside",
    )
    parser.add_argument(
        "--peers", default=",".join(PEERS), help="dims: zuko's models to run (none: '')"
    )
    parser.add_argument("--files", default=",".join(FILES))
    parser.add_argument(
        "--split-seeds", default="0", help="files: the splits (--split-seed) to run"
    )
    parser.add_argument(
        "--work-dir", help="files: where the CSVs and runs go (default: a temp dir)"
    )
    parser.add_argument(
        "--no-zuko", action="store_true", help="files: leave zuko's NSF out"
    )
    parser.add_argument(
        "--train-args",
        default="",
        help="files: flags added to `cnftrace train`, for smoke runs only (the "
        "benchmark gives none)",
    )
    parser.add_argument(
        "--peer-seconds",
        type=float,
        help="train zuko this many seconds instead of cnftrace's (smoke runs only)",
    )
    parser.add_argument(
        "--out", default=os.path.join(RESULTS_DIR, "b5"), help="results stem"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start new tables instead of updating the rows of the last run",
    )
    args = parser.parse_args(argv)
    dims = [int(d) for d in _names(args.dims)]
    files = _names(args.files)
    peers = _names(args.peers)
    for label, given, known in (
        ("--files", files, FILES),
        ("--peers", peers, PEERS),
    ):
        if set(given) - set(known):
            unknown = sorted(set(given) - set(known))
            parser.error(f"{label}: unknown {unknown}; choose from {known}.")
    command = "python -m experiments.bench.b5 " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )

    def saver(half: str, order):
        stem = f"{args.out}_{half}"
        table = {} if args.fresh else load_results(stem)

        def save(key, row):
            table[key] = row
            ordered = {k: table[k] for k in order if k in table}
            ordered |= {k: v for k, v in table.items() if k not in ordered}
            atomic_write(stem + ".json", json.dumps(ordered, indent=1).encode())
            md = section_markdown(half, ordered, command.strip())
            atomic_write(stem + ".md", (md + "\n").encode())

        return stem, save

    stems = []
    if args.half in ("dims", "both"):
        stem, save = saver("dims", [str(d) for d in sorted(set(DIMS) | set(dims))])
        run_dims(
            dims, args.steps, args.test_size, peers, args.peer_seconds, save, args.seed
        )
        stems.append(stem)
    if args.half in ("files", "both"):
        stem, save = saver("files", FILES)
        run_files(
            files,
            args.work_dir,
            shlex.split(args.train_args),
            () if args.no_zuko else ("nsf",),
            args.peer_seconds,
            save,
            [int(s) for s in _names(args.split_seeds)],
        )
        stems.append(stem)
    for stem in stems:
        with open(stem + ".md") as f:
            print(f.read())


if __name__ == "__main__":
    main()
