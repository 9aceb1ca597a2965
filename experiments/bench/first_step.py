"""B1's first step in a new process, with a cold and with a warm compilation cache.

Every new process (`cnftrace train`, `make demo`, a resume) pays for tracing and
compiling the training step before it trains. With JAX's persistent compilation cache
(`cnftrace.enable_compilation_cache`, on by default for the command line and the
demo) a second process still traces and lowers the step, then loads the compiled
program from disk instead of compiling it.

For each estimator this starts three processes on one fresh cache directory: the
first compiles (cold), the next two load (warm). Each reports B1's first step (the
first call of the jitted step: tracing, lowering, compiling or loading, and running
it), and the seconds from the start of the process, imports included, to the end of
that step.

    python -m experiments.bench.first_step            # both estimators
    python -m experiments.bench.first_step --json out.json

Target (issue 20): first step <= 5 s cold and <= 1 s warm.
"""

import time

_PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from experiments._common import atomic_write, markdown_table  # noqa: E402

ESTIMATORS = ("hutchinson", "exact")
TARGETS = {"cold": 5.0, "warm": 1.0}


def _child(estimator: str) -> None:
    import cnftrace
    from experiments._common import cnftrace_b1

    cnftrace.enable_compilation_cache()  # the directory comes from the environment
    r = cnftrace_b1(estimator, iters=3)
    since_start = time.perf_counter() - _PROCESS_START - sum(r["iter_times"][1:])
    print(json.dumps({"first_step_s": r["first_step_s"], "since_start_s": since_start}))


def measure(estimator: str, cache_dir: str) -> dict:
    """One new process's first step, with `cache_dir` as its compilation cache."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir)
    env.pop("CNFTRACE_COMPILATION_CACHE", None)
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench.first_step", "--child", estimator],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the {estimator} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_steps(estimators=ESTIMATORS, warm_runs: int = 2) -> dict:
    """For each estimator, a cold process and `warm_runs` warm ones on a new cache."""
    results = {}
    for estimator in estimators:
        with tempfile.TemporaryDirectory(prefix="cnftrace-cache-") as cache:
            cold = measure(estimator, cache)
            warm = [measure(estimator, cache) for _ in range(warm_runs)]
        results[estimator] = {"cold": cold, "warm": warm}
    return results


def markdown(results: dict) -> str:
    rows = []
    for estimator, r in results.items():
        runs = [("cold", r["cold"])] + [("warm", w) for w in r["warm"]]
        for kind, run in runs:
            ok = run["first_step_s"] <= TARGETS[kind]
            rows.append(
                [
                    estimator,
                    kind,
                    f"{run['first_step_s']:.2f}",
                    f"{run['since_start_s']:.2f}",
                    f"≤ {TARGETS[kind]:g} s: {'met' if ok else '**missed**'}",
                ]
            )
    header = ["estimator", "cache", "first step (s)"]
    header += ["process start to end of first step (s)", "target"]
    return markdown_table(header, rows, "llrrl")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=ESTIMATORS, help=argparse.SUPPRESS)
    parser.add_argument("--estimators", default=",".join(ESTIMATORS))
    parser.add_argument("--warm-runs", type=int, default=2)
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    estimators = tuple(args.estimators.split(","))
    unknown = [e for e in estimators if e not in ESTIMATORS]
    if unknown:
        parser.error(f"--estimators: unknown {unknown}; choose from {ESTIMATORS}")
    if args.warm_runs < 1:
        parser.error("--warm-runs must be positive")
    results = first_steps(estimators, args.warm_runs)
    print(markdown(results))
    if args.json:
        atomic_write(args.json, json.dumps(results, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
