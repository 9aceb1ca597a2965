"""What buys quality as the dimension grows (issue 37): one factor at a time around
the default recipe, on B5's constructed densities (`warped_product(d)`), many
variants at once.

Each variant trains one flow with `cnftrace.fit` on fresh samples and scores it with
the exact trace on 20,000 held-out points: the gap `flow NLL - true NLL` with its
paired standard error. The base is the default when the sweep ran: `MLPField` 64 x 3
SiLU with 3 time frequencies, T = 0.5, one Rademacher probe, training tolerance 1e-3,
`warmup_cosine_adam(steps, 3e-3)`, 2,000 steps of 512. A variant changes the keys
it names (see `VARIANTS`); `--set NAME:key=value,...` adds one.

    python -m experiments.recipe_sweep --dim 10 --only base,width128 --jobs 2
    python -m experiments.recipe_sweep --dim 10 --jobs 8 --deadline 500 --out r.json

Variants run as separate processes, `--jobs` at a time (on a GPU, several share it),
until `--deadline` seconds; each result is added to `--out` (a JSON object by
`d<dim>/<variant>`) as it finishes, so a sweep cut short keeps what it measured.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from experiments._common import atomic_write

BASE = {
    "width": 64,
    "depth": 3,
    "blocks": 1,
    "t1": 0.5,
    "activation": "silu",
    "freqs": 3,
    "zero_last": False,
    "lr": 3e-3,
    "weight_decay": 0.0,
    "batch": 512,
    "steps": 2000,
    "tol": 1e-3,
    "estimator": "rademacher",
    "kinetic": 0.0,
    "jacobian": 0.0,
}
VARIANTS = {
    "base": {},
    "width128": {"width": 128},
    "width256": {"width": 256},
    "width32": {"width": 32},
    "depth2": {"depth": 2},
    "depth4": {"depth": 4},
    "blocks2": {"blocks": 2},
    "T1": {"t1": 1.0},
    "T0.25": {"t1": 0.25},
    "freqs0": {"freqs": 0},
    "freqs8": {"freqs": 8},
    "zero_last": {"zero_last": True},
    "tanh": {"activation": "tanh"},
    "lr1e-3": {"lr": 1e-3},
    "lr6e-3": {"lr": 6e-3},
    "batch256": {"batch": 256},
    "batch1024": {"batch": 1024},
    "tol1e-4": {"tol": 1e-4},
    "tol1e-2": {"tol": 1e-2},
    "exact": {"estimator": "exact"},
    "gaussian": {"estimator": "gaussian"},
    "kinetic0.01": {"kinetic": 0.01},
    "rnode0.01": {"kinetic": 0.01, "jacobian": 0.01},
    "wd1e-4": {"weight_decay": 1e-4},
    "steps4000": {"steps": 4000},
    "width128-depth4": {"width": 128, "depth": 4},
    "width128-lr1e-3": {"width": 128, "lr": 1e-3},
    "width256-lr1e-3": {"width": 256, "lr": 1e-3},
    "width128-T1": {"width": 128, "t1": 1.0},
}


def config_of(name: str, extra: dict | None = None) -> dict:
    return dict(BASE, **VARIANTS.get(name, {}), **(extra or {}))


def run_one(cfg: dict, dim: int, seed: int, test_size: int) -> dict:
    """Trains and scores one variant in this process."""
    import diffrax
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import optax

    import cnftrace
    from cnftrace.datasets import warped_product

    density = warped_product(dim, seed=seed)
    activation = {"silu": jax.nn.silu, "tanh": jax.nn.tanh}[cfg["activation"]]
    model_key, train_key = jr.split(jr.key(seed))
    blocks = [
        cnftrace.CNF(
            cnftrace.MLPField(
                dim,
                cfg["width"],
                cfg["depth"],
                activation,
                freqs=cfg["freqs"],
                zero_last=cfg["zero_last"],
                key=k,
            ),
            dim,
            t1=cfg["t1"],
            rtol=1e-5,
            atol=1e-5,
            solver=diffrax.Tsit5(),
        )
        for k in jr.split(model_key, cfg["blocks"])
    ]
    flow = blocks[0] if len(blocks) == 1 else cnftrace.Chain(blocks)
    estimator = (
        cnftrace.Exact()
        if cfg["estimator"] == "exact"
        else cnftrace.Hutchinson(sampler=cfg["estimator"])
    )
    objective = cnftrace.MaximumLikelihood(
        estimator,
        kinetic_weight=cfg["kinetic"],
        jacobian_weight=cfg["jacobian"],
        tolerance=cfg["tol"],
    )
    optimizer = cnftrace.warmup_cosine_adam(
        cfg["steps"], cfg["lr"], weight_decay=cfg["weight_decay"]
    )
    assert isinstance(optimizer, optax.GradientTransformation)
    start = time.perf_counter()
    flow, history = cnftrace.fit(
        flow,
        lambda k, n: density.sample(k, n),
        key=train_key,
        steps=cfg["steps"],
        batch_size=cfg["batch"],
        objective=objective,
        optimizer=optimizer,
        progress=False,
        log_every=max(1, cfg["steps"] // 20),
    )
    train_s = time.perf_counter() - start
    test = density.sample(jr.key(10_000 + seed), test_size, jnp.float32)
    logq = cnftrace.log_prob_batched(flow, test, batch_size=2000)
    logp = np.asarray(density.log_prob(test))
    diff = (logp - logq).astype(np.float64)
    return {
        "config": cfg,
        "dim": dim,
        "seed": seed,
        "gap": float(diff.mean()),
        "gap_se": float(diff.std(ddof=1) / math.sqrt(diff.size)),
        "finite": bool(np.all(np.isfinite(diff))),
        "train_s": train_s,
        "nfe_last": history["nfe"][-1],
        "loss_last": history["loss"][-1],
        "device": str(jax.devices()[0].device_kind),
    }


def sweep(jobs: list[tuple[int, str, dict]], args) -> dict:
    """Runs `(dim, name, cfg)` jobs `args.jobs` at a time until the deadline."""
    results = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            results = json.load(f)
    pending = [j for j in jobs if f"d{j[0]}/{j[1]}" not in results or args.redo]
    running = []
    start = time.time()
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    while pending or running:
        late = time.time() - start > args.deadline
        while pending and len(running) < args.jobs and not late:
            dim, name, cfg = pending.pop(0)
            argv = [sys.executable, "-m", "experiments.recipe_sweep", "--one"]
            argv += [json.dumps(cfg), "--dim", str(dim), "--seed", str(args.seed)]
            argv += ["--test-size", str(args.test_size)]
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env, text=True)
            running.append((proc, dim, name, time.time()))
        if late and not running:
            break
        time.sleep(1)
        for item in list(running):
            proc, dim, name, t0 = item
            hard = time.time() - start > args.deadline + args.grace
            if proc.poll() is None and not hard:
                continue
            running.remove(item)
            if proc.poll() is None:
                proc.kill()
                print(f"d{dim}/{name}: killed at the deadline", flush=True)
                continue
            lines = [ln for ln in proc.stdout.read().splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(f"d{dim}/{name}: failed ({proc.returncode})", flush=True)
                continue
            r = json.loads(lines[-1])
            r["wall_s"] = time.time() - t0
            results[f"d{dim}/{name}"] = r
            print(
                f"d{dim}/{name}: gap {r['gap']:.4f} ± {r['gap_se']:.4f}  "
                f"train {r['train_s']:.0f}s  nfe {r['nfe_last']}",
                flush=True,
            )
            atomic_write(args.out, json.dumps(results, indent=1).encode())
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", default="10", help="comma-separated dimensions")
    parser.add_argument("--only", help="comma-separated variant names")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-size", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--deadline", type=float, default=math.inf)
    parser.add_argument("--grace", type=float, default=60.0)
    parser.add_argument("--redo", action="store_true")
    parser.add_argument(
        "--out", default=os.path.join("experiments", "results", "recipe_sweep.json")
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        r = run_one(json.loads(args.one), int(args.dim), args.seed, args.test_size)
        print(json.dumps(r), flush=True)
        return
    for spec in args.set:
        name, _, body = spec.partition(":")
        extra = {}
        for item in filter(None, body.split(",")):
            k, _, v = item.partition("=")
            extra[k] = json.loads(v)
        VARIANTS[name] = extra
    names = args.only.split(",") if args.only else list(VARIANTS)
    jobs = [
        (int(d), name, config_of(name)) for name in names for d in args.dim.split(",")
    ]
    sweep(jobs, args)


if __name__ == "__main__":
    main()
