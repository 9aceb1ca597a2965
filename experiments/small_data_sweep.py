"""What buys quality on small real tables (issue 37): `cnftrace train --data FILE`
with one flag set changed at a time, on B5's tables, over several train/validation/test
splits, beside the BIC Gaussian mixture on the same splits.

One split's test rows are few (15 to 105 on B5's tables), so one split's difference
between two recipes is mostly noise; this repeats each (table, recipe) over
`--split-seeds` (the command line's `--split-seed`) and reports, per table and
recipe, the mean over splits of `cnftrace test NLL - mixture test NLL` (nats, the
data's units) with the standard error of that mean over the splits.

    python -m experiments.small_data_sweep --files stocks,goog --variants base,rnode
    python -m experiments.small_data_sweep --split-seeds 0,1,2,3 --jobs 2

Runs go `--jobs` at a time (quality only: no timing is read from them); each result
is added to `--out` as it finishes, so a sweep cut short keeps what it measured.
"""

import argparse
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import cnftrace
from cnftrace.datasets import file_source, read_table, split_table
from experiments._common import (
    RESULTS,
    SPLIT,
    TABLES,
    atomic_write,
    cnftrace_cli,
    gmm_bic,
    write_csv,
)

# The flags each recipe adds to `cnftrace train --data FILE --run-dir DIR`.
VARIANTS = {
    "base": [],
    "rnode": ["--kinetic-energy", "0.01", "--jacobian-norm", "0.01"],
    "width32": ["--width", "32"],
    "width128": ["--width", "128"],
    "lr1e-3": ["--lr", "1e-3"],
    "batch64": ["--batch-size", "64"],
    "batch512": ["--batch-size", "512"],
    "val25": ["--checkpoint-every", "25"],
    "val25_p40": ["--checkpoint-every", "25", "--patience", "40"],
    "depth2": ["--depth", "2"],
    "fm": ["--objective", "fm"],
    "wd0.1": ["--weight-decay", "0.1"],
    "wd1": ["--weight-decay", "1"],
    # The rows whitened by the training rows' full covariance before the command
    # line sees them (so the flow starts at the full-covariance Gaussian rather than
    # at the diagonal one), scored back in the data's units.
    "whiten": [],
    "zero": ["--zero-last"],
    "whiten_zero": ["--zero-last"],
    # The base distribution (issue 42): the default fits one to the training rows.
    "normal": ["--base", "normal"],
    "mixture": ["--base", "mixture"],
    "t-mixture": ["--base", "t-mixture"],
    "student-t": ["--base", "student-t"],
    "random": ["--no-zero-last"],  # the fitted base, the field initialised at random
    # Grid columns spread over their cells; the mixture is then fitted to and scored
    # on the same dequantised rows (the likelihood both are measured by).
    "dequantize": ["--dequantize"],
    "dequantize_normal": ["--dequantize", "--base", "normal"],
}


def whitened(data: np.ndarray, seed: int) -> tuple[np.ndarray, float]:
    """Every row mapped by `z = L^-1 (x - mean)`, `L L^T` the covariance of split
    `seed`'s training rows (the command line then splits the same rows the same way:
    its permutation depends on the row count and the seed only), and `log |det L|`,
    which turns a log-density of `z` into one of `x`: `log p(x) = log p(z) - log|L|`."""
    train, _, _ = split_table(data, **(SPLIT | {"seed": seed}))
    mean = train.mean(0)
    chol = np.linalg.cholesky(np.cov(train.T, ddof=1))
    z = np.linalg.solve(chol, (data - mean).T).T
    return z, float(np.log(np.diag(chol)).sum())


def gmm_nll(
    data: np.ndarray, seed: int, path: str | None = None
) -> tuple[np.ndarray, int]:
    """The BIC mixture's per-row test log-density on split `seed`, in the data's
    units (fitted on the standardised training rows, as B5 does). With the file's
    `path`, on its rows dequantised as `cnftrace train --dequantize` reads them."""
    train, _, test = split_table(data, **(SPLIT | {"seed": seed}))
    if path is not None:
        source = file_source(path, seed=seed, dequantize=True)
        train, test = source.reference, source.test(0, None)
    std = cnftrace.Standardization.from_data(train)
    log_det = float(np.asarray(std.log_det))
    z_train, z_test = (np.asarray(std.forward(x), np.float64) for x in (train, test))
    fit = gmm_bic(z_train, z_test)
    return fit["test_logp"] + log_det, fit["components"]


def run_one(path: str, run_dir: str, seed: int, flags: list[str]) -> dict:
    """B5's `cnftrace train` and `cnftrace eval` of one file on split `seed`, with
    the variant's `flags`: the figures the sweep keeps."""
    train_args = ["--no-progress", "--split-seed", str(seed), *flags]
    result = cnftrace_cli(path, run_dir, train_args)
    return {k: result[k] for k in ("nll", "steps_done", "best_val_step", "train_s")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="stocks,goog,wine,iris")
    parser.add_argument("--variants", default="base,rnode,width32,lr1e-3,val25_p40")
    parser.add_argument("--split-seeds", default="0,1,2")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(RESULTS, "small_data_sweep.json"))
    args = parser.parse_args(argv)
    # Each `cnftrace` process B5 starts inherits this: one thread apiece, so that
    # `--jobs` of them share the cores.
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    files = [f for f in args.files.split(",") if f]
    variants = [v for v in args.variants.split(",") if v]
    seeds = [int(s) for s in args.split_seeds.split(",") if s]
    for name in files:
        if name not in TABLES:
            parser.error(f"--files: unknown {name!r}; choose from {list(TABLES)}")
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"--variants: unknown {name!r}; choose from {list(VARIANTS)}")

    work = tempfile.mkdtemp(prefix="small-data-")
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    gmm = {}
    for name in files:
        data, names = TABLES[name][0]()
        path = os.path.join(work, f"{name}.csv")
        write_csv(path, data, names)
        data = read_table(path).data
        for seed in seeds:
            gmm[name, seed] = gmm_nll(data, seed)

    def job(item):
        name, variant, seed = item
        run_dir = os.path.join(work, f"{name}-{variant}-{seed}")
        path = os.path.join(work, f"{name}.csv")
        log_det = 0.0
        if variant.startswith("whiten"):
            z, log_det = whitened(read_table(path).data, seed)
            path = os.path.join(work, f"{name}-whitened-{seed}.csv")
            write_csv(path, z, [f"z{j}" for j in range(z.shape[1])])
        row = run_one(path, run_dir, seed, VARIANTS[variant])
        row["nll"] += log_det  # in the data's units
        logp, k = gmm[name, seed]
        if variant.startswith("dequantize"):
            logp, k = gmm_nll(read_table(path).data, seed, path)
        row.update(gmm_nll=float(-logp.mean()), gmm_components=k)
        row["minus_gmm"] = row["nll"] - row["gmm_nll"]
        return item, row

    items = [(n, v, s) for n in files for v in variants for s in seeds]
    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        for (name, variant, seed), row in pool.map(job, items):
            results.setdefault(name, {}).setdefault(variant, {})[str(seed)] = row
            atomic_write(args.out, json.dumps(results, indent=1).encode())
            print(
                f"{time.time() - start:6.0f}s {name:8s} {variant:10s} split {seed}: "
                f"{row['nll']:.3f} - GMM {row['gmm_nll']:.3f} = "
                f"{row['minus_gmm']:+.3f} ({row['steps_done']} steps, best val at "
                f"{row['best_val_step']})",
                flush=True,
            )
    print("\nmean over splits of cnftrace - GMM (nats), ± s.e. over splits:")
    for name in files:
        for variant in variants:
            gaps = [results[name][variant][str(s)]["minus_gmm"] for s in seeds]
            se = np.std(gaps, ddof=1) / len(gaps) ** 0.5 if len(gaps) > 1 else 0.0
            print(f"  {name:8s} {variant:10s} {np.mean(gaps):+.3f} ± {se:.3f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
