"""Data-parallel training throughput on 1, 2 and 4 devices.

B1's model and data (see `experiments/README.md`: 8gaussians, ConcatSquash
2-64-64-64-2, Tsit5 at rtol = atol = 1e-5, Adam, float32, one Rademacher probe)
trained with `cnftrace.fit(..., mesh=cnftrace.data_mesh(n))`, each device count in its
own process.
On CPU the devices are forced with `XLA_FLAGS=--xla_force_host_platform_device_count=N`:
they share the machine's cores, so on a small machine the figures show the overhead of
sharding, not a speed-up. Every run uses the same key, so every device count does the
same work (the same batches, probes and solver steps).

Throughput is steady state: the batch size over the median time of the steps after
`--warmup` (the first step, which compiles, is reported on its own). Every step is
logged, so every step ends with a host sync, as a training loop that prints its loss
does. Each device count runs `--rounds` times, interleaved with the others, and the
fastest round is kept: on a shared machine the other jobs only ever slow a run down.

    python -m experiments.bench.parallel                 # CPU: 1, 2, 4 forced devices
    python -m experiments.bench.parallel --backend gpu   # the GPUs of this machine

Writes `experiments/results/parallel_<backend>.{json,md}`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import jax
import jax.random as jr

import cnftrace
from experiments import _common

# The repository root, from which the children run this module.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(devices: int | None, steps: int, warmup: int, batch_size: int) -> dict:
    """One run in this process: `devices` in the mesh, or `None` for no mesh."""
    records = []
    mesh = None if devices is None else cnftrace.data_mesh(devices)
    _, history = cnftrace.fit(
        _common.b1_flow("hutchinson"),
        _common.b1_data,
        key=jr.key(0),
        steps=steps,
        batch_size=batch_size,
        progress=False,
        on_log=records.append,
        mesh=mesh,
    )
    seconds = [r["seconds"] for r in records]
    gaps = [b - a for a, b in zip(seconds[warmup - 1 :], seconds[warmup:])]
    per_step = statistics.median(gaps)
    nfe = [r["nfe"] for r in records[warmup:]]
    return {
        "devices": devices,
        "platform": jax.devices()[0].platform,
        "device_count": jax.device_count(),
        "first_step_s": seconds[0],
        "s_per_step": per_step,
        "s_per_step_mean": statistics.mean(gaps),
        "samples_per_s": batch_size / per_step,
        "nfe_fwd": statistics.mean(nfe),
        "final_loss": history["loss"][-1],
    }


def run_one(
    devices: int | None, backend: str, steps: int, warmup: int, batch_size: int
) -> dict:
    env = dict(os.environ)
    if backend == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={devices or 1}"
        ).strip()
    args = [sys.executable, "-m", "experiments.bench.parallel"]
    args += ["--child", str(devices or 0)]
    args += ["--steps", str(steps), "--warmup", str(warmup)]
    args += ["--batch-size", str(batch_size)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, cwd=_ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the run on {devices} device(s) failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(
    rows: list[dict], backend: str, cores: int, batch_size: int, rounds: int
) -> str:
    base = rows[0]["samples_per_s"]
    table = _common.markdown_table(
        [
            "devices",
            "mesh",
            "samples/s",
            "s/step",
            "vs. no mesh",
            "each round (samples/s)",
            "NFE/step",
            "first step (s)",
        ],
        [
            [
                r["devices"] or 1,
                "no" if r["devices"] is None else f"data_mesh({r['devices']})",
                f"{r['samples_per_s']:.0f}",
                f"{r['s_per_step']:.4f}",
                f"{r['samples_per_s'] / base:.2f}x",
                ", ".join(f"{x['samples_per_s']:.0f}" for x in r.get("rounds", [r])),
                f"{r['nfe_fwd']:.1f}",
                f"{r['first_step_s']:.1f}",
            ]
            for r in rows
        ],
    )
    where = (
        f"{cores} CPU cores shared by all forced devices: this shows the overhead of "
        "sharding, not a speed-up"
        if backend == "cpu"
        else f"{rows[-1]['platform']} devices"
    )
    return (
        f"# Data-parallel throughput ({backend})\n\n"
        f"B1's model, batch {batch_size}, median step after warm-up, best of "
        f"{rounds} round(s), each listed (their spread is the noise of the machine); "
        f"{where}. The NFE column shows that every device count does the same "
        "work.\n\n" + table + "\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--backend", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=_common.B1_BATCH)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", help="output stem (default results/parallel_BACKEND)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps.")
    if args.child is not None:
        devices = args.child or None
        print(json.dumps(child(devices, args.steps, args.warmup, args.batch_size)))
        return 0
    configs = [None, *args.devices]
    runs: dict = {str(c): [] for c in configs}
    for round_ in range(args.rounds):
        for devices in configs:
            row = run_one(
                devices, args.backend, args.steps, args.warmup, args.batch_size
            )
            runs[str(devices)].append(row)
            print(
                f"round {round_ + 1}: {devices or 1} device(s), mesh "
                f"{devices is not None}: {row['samples_per_s']:.0f} samples/s",
                flush=True,
            )
    rows = [
        dict(max(runs[str(c)], key=lambda r: r["samples_per_s"]), rounds=runs[str(c)])
        for c in configs
    ]
    stem = args.out or os.path.join(_common.RESULTS, f"parallel_{args.backend}")
    payload = {
        "protocol": "B1 model and data, fit(mesh=data_mesh(n)), steady state",
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "cores": _common.cores(),
        "rows": rows,
    }
    text = markdown(rows, args.backend, _common.cores(), args.batch_size, args.rounds)
    _common.write_results(stem, payload, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
