"""B4, quality per step and per second: cnftrace's default recipe beside zuko's CNF on
densities whose log-density is known, in one run.

The densities (no downloads): `rotated_product(5)` (a rotation of five independent
1-D densities), `gaussian_mixture(12, 6)` (six anisotropic Gaussians in 12-D), and
FFJORD's 8gaussians, checkerboard and rings. The gap is `flow NLL - true NLL` on the
same held-out points (20,000 by default), exact trace for both systems, with its paired
standard error; rings has no closed-form density, so its gap is taken against its
(numerically computed) entropy and the standard error is the NLL's.

cnftrace runs the README's first example: `MLPField(d)`, `CNF(field, d)` and `fit`
with its defaults, given only the number of steps and the batch size. zuko 1.6 runs
`zuko.flows.CNF` with hidden features (64, 64, 64), tanh, its time span set to
[0, 0.5], its exact trace (its default), its tolerances (atol 1e-6, rtol 1e-5), and
Adam at a constant 1e-3: the configuration of the issue that asked for this benchmark.
Both train on the same number of fresh samples per step, drawn by the same sampler.

Equal steps: both gaps after `steps` steps. Equal seconds: zuko is evaluated (off the
clock) at the training second where cnftrace finished, and at its own end; so the
"equal seconds" column compares cnftrace's final model with zuko's model at that same
training time.
"""

import argparse
import json
import os
import sys
import time

import jax.random as jr
import numpy as np

import cnftrace
from experiments._common import (
    DENSITIES,
    RESULTS as RESULTS_DIR,
    Target,
    atomic_write,
    cnftrace_log_prob,
    gap_and_se,
    load_results,
    markdown_table,
)


def cnftrace_b4(target: Target, steps: int, batch: int, test, seed: int = 0) -> dict:
    """The README's first example on `target`: training seconds (compile included)
    and the exact-trace gap after `steps` steps of `batch` samples."""
    key = jr.key(seed)
    model_key, train_key = jr.split(key)
    field = cnftrace.MLPField(target.dim, key=model_key)
    flow = cnftrace.CNF(field, dim=target.dim)
    target.sample(jr.key(0), batch).block_until_ready()  # the sampler's compile
    start = time.perf_counter()
    flow, history = cnftrace.fit(
        flow,
        target.sample,
        key=train_key,
        steps=steps,
        batch_size=batch,
        progress=False,
        log_every=max(1, steps // 10),
    )
    train_s = time.perf_counter() - start
    gap, se = gap_and_se(target, test, cnftrace_log_prob(flow, test))
    return {
        "system": f"cnftrace {cnftrace.__version__}",
        "train_s": train_s,
        "gap": gap,
        "gap_se": se,
        "nfe_last": history["nfe"][-1],
    }


def run_b4(
    names=DENSITIES,
    steps: int = 2000,
    batch: int = 512,
    test_size: int = 20_000,
    on_row=None,
    equal_seconds_only: bool = False,
) -> dict:
    """B4 for every density in `names`: cnftrace first, then zuko, evaluated at
    cnftrace's training time and at its own end. `on_row(name, row)`, if given, is
    called as each density's row is complete (a long run saves as it goes). With
    `equal_seconds_only`, zuko stops at cnftrace's training seconds: its row has the
    equal-seconds gap and no equal-steps gap (zuko's full run took 8-17 times
    cnftrace's in the run of 2026-11-24)."""
    try:
        from experiments.bench import zuko_peer
    except ImportError as e:  # the bench extra is not installed
        zuko_peer, missing = None, str(e)
    out = {}
    for name in names:
        target = Target(name)
        test = target.test_set(test_size)
        true = target.true_log_prob(test)
        row = {"dim": target.dim, "steps": steps, "batch": batch, "n_test": test_size}
        row["measured"] = time.strftime("%Y-%m-%d %H:%M %Z")
        row["test_true_nll"] = None if true is None else float(-true.mean())
        row["cnftrace"] = ours = cnftrace_b4(target, steps, batch, test)
        print(f"B4 {name}: cnftrace {ours}", flush=True)
        if zuko_peer is None:
            row["zuko"] = {"missing": missing}
        else:
            z = zuko_peer.zuko_b4(
                target.sample,
                target.dim,
                steps,
                batch,
                np.asarray(test),
                # Stopped at cnftrace's seconds, zuko's final model is the one to
                # score: no second evaluation of the same model on the way.
                eval_at_s=() if equal_seconds_only else (ours["train_s"],),
                max_train_s=ours["train_s"] if equal_seconds_only else None,
            )
            peer = {"system": z["system"], "train_s": z["train_s"]}
            peer["steps_done"] = z["steps_done"]
            peer["gap"], peer["gap_se"] = gap_and_se(target, test, z["final_logp"])
            if equal_seconds_only:
                # Stopped at cnftrace's seconds: its final model is the equal-seconds
                # one, and there is no equal-steps figure.
                peer["at_cnftrace_s"] = {
                    "seconds": z["train_s"],  # less where zuko ran out of steps
                    "step": z["steps_done"],
                    "gap": peer["gap"],
                    "gap_se": peer["gap_se"],
                }
                peer["gap"] = peer["gap_se"] = None
            elif z["at_s"]:
                seconds, step, logp = z["at_s"][0]
                gap, se = gap_and_se(target, test, logp)
                peer["at_cnftrace_s"] = {"seconds": seconds, "step": step, "gap": gap}
                peer["at_cnftrace_s"]["gap_se"] = se
            else:  # zuko finished before cnftrace did
                peer["at_cnftrace_s"] = {
                    "seconds": z["train_s"],
                    "step": steps,
                    "gap": peer["gap"],
                    "gap_se": peer["gap_se"],
                }
            row["zuko"] = peer
            print(f"B4 {name}: zuko {peer}", flush=True)
        out[name] = row
        if on_row is not None:
            on_row(name, row)
    return out


def b4_markdown(res: dict) -> str:
    rows = []
    for name, row in res.items():
        ours, peer = row["cnftrace"], row["zuko"]
        head = [
            name,
            row["dim"],
            f"{row['steps']} × {row['batch']}",
            f"{ours['gap']:.4f} ± {ours['gap_se']:.4f}",
            f"{ours['train_s']:.0f}",
        ]
        when = row.get("measured", "—")
        if "missing" in peer:
            rows.append(head + [f"zuko not run: {peer['missing']}", *[""] * 4, when])
            continue
        at = peer["at_cnftrace_s"]
        secs_ok = ours["gap"] < at["gap"]
        if peer["gap"] is None:  # stopped at cnftrace's seconds
            equal_steps = "— (stopped at cnftrace's seconds)"
            steps_winner = "not run"
        else:
            equal_steps = f"{peer['gap']:.4f} ± {peer['gap_se']:.4f}"
            steps_winner = "cnftrace" if ours["gap"] <= peer["gap"] else "zuko"
        rows.append(
            head
            + [
                equal_steps,
                f"{peer['train_s']:.0f}",
                f"{at['gap']:.4f} ± {at['gap_se']:.4f} ({at['step']})",
                steps_winner,
                "cnftrace" if secs_ok else "zuko",
                when,
            ]
        )
    header = ["density", "d", "steps × batch", "cnftrace gap", "cnftrace s"]
    header += ["zuko gap (equal steps)", "zuko s"]
    header += ["zuko gap at cnftrace's seconds (its step)", "equal steps"]
    header += ["equal seconds", "measured"]
    return markdown_table(header, rows, "lrlrrrrrlll")


RESULTS_STEM = os.path.join(RESULTS_DIR, "b4")
# A check: the test set as large as a batch, so that drawing it runs the programs
# that drawing the batches compiled.
QUICK = dict(names=("product5",), steps=3, batch=64, test_size=64)


def section_markdown(res: dict, command: str) -> str:
    """B4's section of the benchmark report: how it was measured, then the table."""
    return "\n".join(
        [
            f"Last written by `{command}` on {time.strftime('%Y-%m-%d %H:%M %Z')} "
            "(each row's own run in its last column); load average then "
            f"{', '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} "
            "CPUs. Gap = model NLL − true NLL on the same "
            f"held-out points, exact trace, ± paired standard error (rings: against "
            "its entropy). cnftrace: the README's first example (`MLPField(d)`, "
            "`CNF(field, d)`, `fit` with its defaults, given the steps and the batch "
            "size). zuko: `zuko.flows.CNF`, hidden (64, 64, 64), tanh, span [0, 0.5], "
            "exact trace, Adam 1e-3. Both draw the same fresh samples each step.",
            "",
            b4_markdown(res),
        ]
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--densities", default=",".join(DENSITIES))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--test-size", type=int, default=20_000)
    parser.add_argument(
        "--out", default=RESULTS_STEM, help="results stem (.json and .md)"
    )
    parser.add_argument(
        "--equal-seconds-only",
        action="store_true",
        help="stop zuko at cnftrace's training seconds (no equal-steps figure)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start a new table instead of updating the rows of the last run",
    )
    args = parser.parse_args(argv)
    names = tuple(n.strip() for n in args.densities.split(",") if n.strip())
    unknown = sorted(set(names) - set(DENSITIES))
    if unknown:
        parser.error(f"--densities: unknown {unknown}; choose from {DENSITIES}.")
    command = "python -m experiments.bench.b4 " + " ".join(argv or sys.argv[1:])
    # Rows of earlier runs are kept (each row says when it was measured) unless
    # --fresh; every finished density is written at once, so a stopped run keeps
    # the rows it finished.
    table = {} if args.fresh else load_results(args.out)

    def save(name, row):
        table[name] = row
        ordered = {n: table[n] for n in DENSITIES if n in table}
        atomic_write(args.out + ".json", json.dumps(ordered, indent=1).encode())
        md = section_markdown(ordered, command.strip())
        atomic_write(args.out + ".md", (md + "\n").encode())

    run_b4(
        names,
        args.steps,
        args.batch,
        args.test_size,
        on_row=save,
        equal_seconds_only=args.equal_seconds_only,
    )
    with open(args.out + ".md") as f:
        print(f.read())


if __name__ == "__main__":
    main()
