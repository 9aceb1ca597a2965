"""What buys quality per training step: one factor at a time, measured.

Every variant trains one CNF on a density whose log-density is known exactly
(`cnftrace.datasets.rotated_product(5)` by default: a fixed rotation of five
independent 1-D densities) with `cnftrace.fit`, then scores it with the exact trace on
20,000 held-out points. The figure is the gap `flow NLL - true NLL` on the same points,
with its paired standard error: an unbiased estimate of KL(data || flow), 0 for a
perfect model.

The base ("mlp") is the issue's plain MLP with a sinusoidal time embedding (64 x 3,
tanh, 3 frequencies), T = 0.5, one Rademacher probe, Adam at a constant 1e-3, 2,000
steps of 512 fresh samples, Tsit5 at rtol = atol = 1e-5. Each other variant changes
one thing (see `VARIANTS`); a few combine the winners. `tol` is the solver's tolerance
in training (`MaximumLikelihood(tolerance=...)`); evaluation always uses the exact trace
at rtol = atol = 1e-5, the flow's own. The winner ("silu-cos3e-3-tol1e-3") is what
`cnftrace.MLPField`, `cnftrace.CNF` and `cnftrace.fit` do by default.

    python -m experiments.quality                       # every variant not yet done
    python -m experiments.quality --only mlp,concatsquash
    python -m experiments.quality --density mixture12 --steps 1000
    python -m experiments.quality --table               # rewrite the table only

Results accumulate in experiments/results/quality_<density>_<steps>x<batch>.json (one
entry per variant, written as each finishes, so an interrupted sweep resumes) and the
table in the matching .md. Training seconds depend on the machine's load; the gaps
do not.
"""

import argparse
import json
import math
import os
import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import cnftrace
from cnftrace.datasets import KnownDensity, gaussian_mixture, rotated_product
from experiments._common import RESULTS, atomic_write, markdown_table


class Affine(KnownDensity):
    """`scale * x + shift` for `x` from `base`: unstandardised data, as a user who
    does not standardise their columns would pass it."""

    name: str = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    base: KnownDensity
    scale: jax.Array
    shift: jax.Array

    def sample(self, key, n, dtype=None):
        x = self.base.sample(key, n, dtype)
        return x * self.scale.astype(x.dtype) + self.shift.astype(x.dtype)

    def log_prob(self, x):
        x = jnp.asarray(x)
        inner = (x - self.shift.astype(x.dtype)) / self.scale.astype(x.dtype)
        return self.base.log_prob(inner) - jnp.sum(jnp.log(self.scale)).astype(x.dtype)


def _raw(base: KnownDensity) -> KnownDensity:
    rng = np.random.default_rng(7)
    scale = np.exp(rng.uniform(np.log(0.3), np.log(4.0), base.dim))
    shift = rng.uniform(-3, 3, base.dim)
    return Affine(
        f"{base.name}, unstandardised",
        base.dim,
        base,
        jnp.asarray(scale),
        jnp.asarray(shift),
    )


DENSITIES = {
    "product5": lambda: rotated_product(5, seed=0),
    "product5-raw": lambda: _raw(rotated_product(5, seed=0)),
    "product8": lambda: rotated_product(8, seed=0),
    "mixture12": lambda: gaussian_mixture(12, components=6, seed=0),
    "product16": lambda: rotated_product(16, seed=0),
}
ACTIVATIONS = {
    "tanh": jax.nn.tanh,
    "softplus": jax.nn.softplus,
    "silu": jax.nn.silu,
    "elu": jax.nn.elu,
}
BASE = {
    "field": "mlp",
    "width": 64,
    "depth": 3,
    "activation": "tanh",
    "freqs": 3,
    "t1": 0.5,
    "learn_t1": False,
    "estimator": "rademacher",
    "lr": 1e-3,
    "schedule": "constant",
    "batch": None,  # the sweep's batch size
    "blocks": 1,
    "tol": 1e-5,
}
# One factor at a time from BASE, then combinations.
VARIANTS = {
    "mlp": {},
    "concatsquash": {"field": "concatsquash"},
    "concatsquash-T1": {"field": "concatsquash", "t1": 1.0},
    "concatsquash-cosine": {"field": "concatsquash", "schedule": "cosine", "lr": 2e-3},
    "softplus": {"activation": "softplus"},
    "silu": {"activation": "silu"},
    "elu": {"activation": "elu"},
    "width32": {"width": 32},
    "width128": {"width": 128},
    "depth2": {"depth": 2},
    "depth4": {"depth": 4},
    "freqs0": {"freqs": 0},
    "freqs6": {"freqs": 6},
    "T1": {"t1": 1.0},
    "T2": {"t1": 2.0},
    "learn_t1": {"learn_t1": True},
    "gaussian-probe": {"estimator": "gaussian"},
    "exact-trace": {"estimator": "exact"},
    "lr3e-3": {"lr": 3e-3},
    "lr3e-4": {"lr": 3e-4},
    "cosine-1e-3": {"schedule": "cosine"},
    "cosine-3e-3": {"schedule": "cosine", "lr": 3e-3},
    "cosine-5e-3": {"schedule": "cosine", "lr": 5e-3},
    "batch128": {"batch": 128},
    "batch256": {"batch": 256},
    "blocks2": {"blocks": 2},
    "tol1e-3": {"tol": 1e-3},
    "tol1e-4": {"tol": 1e-4},
    # Combinations of the single-factor winners.
    "silu-cos3e-3": {"activation": "silu", "schedule": "cosine", "lr": 3e-3},
    "silu-cos3e-3-tol1e-3": {
        "activation": "silu",
        "schedule": "cosine",
        "lr": 3e-3,
        "tol": 1e-3,
    },
    "silu-cos5e-3-tol1e-3": {
        "activation": "silu",
        "schedule": "cosine",
        "lr": 5e-3,
        "tol": 1e-3,
    },
    "silu-cos3e-3-tol1e-3-exact": {
        "activation": "silu",
        "schedule": "cosine",
        "lr": 3e-3,
        "tol": 1e-3,
        "estimator": "exact",
    },
    "silu-cos3e-3-tol1e-3-batch256": {
        "activation": "silu",
        "schedule": "cosine",
        "lr": 3e-3,
        "tol": 1e-3,
        "batch": 256,
    },
    "silu-cos3e-3-tol1e-3-T1": {
        "activation": "silu",
        "schedule": "cosine",
        "lr": 3e-3,
        "tol": 1e-3,
        "t1": 1.0,
    },
    "concatsquash-silu-cos3e-3-tol1e-3": {
        "field": "concatsquash",
        "activation": "silu",
        "schedule": "cosine",
        "lr": 3e-3,
        "tol": 1e-3,
    },
}


def config_of(name: str, batch: int, extra: dict | None = None) -> dict:
    cfg = dict(BASE, **VARIANTS.get(name, {}), **(extra or {}))
    cfg["batch"] = cfg["batch"] or batch
    return cfg


def build_flow(cfg: dict, dim: int, key) -> cnftrace.AbstractFlow:
    activation = ACTIVATIONS[cfg["activation"]]
    blocks = []
    for k in jr.split(key, cfg["blocks"]):
        if cfg["field"] == "mlp":
            field = cnftrace.MLPField(
                dim,
                cfg["width"],
                cfg["depth"],
                activation,
                freqs=cfg["freqs"],
                key=k,
            )
        else:
            field = cnftrace.ConcatSquashMLP(
                dim, cfg["width"], cfg["depth"], activation, key=k
            )
        blocks.append(
            cnftrace.CNF(
                field,
                dim,
                t1=cfg["t1"],
                learn_t1=cfg["learn_t1"],
                rtol=1e-5,
                atol=1e-5,
                solver=diffrax.Tsit5(),
            )
        )
    return blocks[0] if len(blocks) == 1 else cnftrace.Chain(blocks)


def build_optimizer(cfg: dict, steps: int) -> optax.GradientTransformation:
    if cfg["schedule"] == "constant":
        return optax.adam(cfg["lr"])
    return cnftrace.warmup_cosine_adam(steps, cfg["lr"])


def build_estimator(cfg: dict) -> cnftrace.AbstractEstimator:
    if cfg["estimator"] == "exact":
        return cnftrace.Exact()
    return cnftrace.Hutchinson(sampler=cfg["estimator"])


def gap_on(flow, density, test: jax.Array, chunk: int = 2000) -> tuple[float, float]:
    """`mean(flow NLL - true NLL)` over `test` with the exact trace at 1e-5, and its
    paired standard error."""
    logq = cnftrace.log_prob_batched(flow, test, batch_size=chunk)
    logp = np.asarray(density.log_prob(test))
    diff = (logp - logq).astype(np.float64)
    if not np.all(np.isfinite(diff)):
        raise FloatingPointError("non-finite log-density on the test set")
    return float(diff.mean()), float(diff.std(ddof=1) / math.sqrt(diff.size))


def run_variant(cfg: dict, density, steps: int, seed: int, test) -> dict:
    key = jr.key(seed)
    model_key, train_key = jr.split(key)
    flow = build_flow(cfg, density.dim, model_key)
    start = time.perf_counter()
    flow, history = cnftrace.fit(
        flow,
        lambda k, n: density.sample(k, n),
        key=train_key,
        steps=steps,
        batch_size=cfg["batch"],
        # The training tolerance; the flow keeps 1e-5 for the evaluation.
        objective=cnftrace.MaximumLikelihood(
            build_estimator(cfg), tolerance=cfg["tol"]
        ),
        optimizer=build_optimizer(cfg, steps),
        progress=False,
        log_every=max(1, steps // 20),
    )
    train_s = time.perf_counter() - start
    gap, se = gap_on(flow, density, test)
    return {
        "config": cfg,
        "steps": steps,
        "seed": seed,
        "gap": gap,
        "gap_se": se,
        "train_s": train_s,
        "nfe_last": history["nfe"][-1],
        "loss_last": history["loss"][-1],
        "t1": [float(b.t1) for b in flow.blocks],
    }


def write_table(path_md: str, results: dict, title: str) -> None:
    base = results.get("mlp", {}).get("gap")
    rows = []
    for name, r in sorted(results.items(), key=lambda kv: kv[1]["gap"]):
        change = {
            k: v
            for k, v in r["config"].items()
            if k != "batch" and BASE.get(k) != v or (k == "batch" and v != r["batch0"])
        }
        change = ", ".join(f"{k}={v}" for k, v in change.items()) or "(base)"
        rel = "" if base is None else f"{r['gap'] - base:+.4f}"
        gap = f"{r['gap']:.4f} ± {r['gap_se']:.4f}"
        rows.append([name, change, gap, rel, f"{r['train_s']:.0f}", r["nfe_last"]])
    header = [
        "variant",
        "change from the base",
        "gap (nats)",
        "vs base",
        "train s",
        "NFE",
    ]
    text = (
        f"**{title}**\n\n"
        "Gap = flow NLL - true NLL on 20,000 held-out points (exact trace), ± its "
        "paired standard error. Training seconds depend on the machine's load.\n\n"
        + markdown_table(header, rows)
        + "\n"
    )
    atomic_write(path_md, text.encode())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", default="product5", choices=sorted(DENSITIES))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="comma-separated variant names")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        help="extra variant as NAME:key=value,key=value (values parsed as JSON)",
    )
    parser.add_argument("--redo", action="store_true", help="rerun finished variants")
    parser.add_argument("--table", action="store_true", help="only rewrite the table")
    parser.add_argument("--test-size", type=int, default=20_000)
    args = parser.parse_args(argv)

    for spec in args.set:
        name, _, body = spec.partition(":")
        extra = {}
        for item in filter(None, body.split(",")):
            k, _, v = item.partition("=")
            try:
                extra[k] = json.loads(v)
            except json.JSONDecodeError:
                extra[k] = v
        VARIANTS[name] = extra
    stem = os.path.join(
        RESULTS, f"quality_{args.density}_{args.steps}x{args.batch}_s{args.seed}"
    )
    results = {}
    if os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            results = json.load(f)
    density = DENSITIES[args.density]()
    title = f"Quality by factor: {density.name}, {args.steps} steps of {args.batch}"
    names = args.only.split(",") if args.only else list(VARIANTS)
    test = density.sample(jr.key(10_000 + args.seed), args.test_size, jnp.float32)
    for name in [] if args.table else names:
        if name in results and not args.redo:
            continue
        cfg = config_of(name, args.batch)
        print(f"{name}: {cfg}", flush=True)
        r = run_variant(cfg, density, args.steps, args.seed, test)
        r["batch0"] = args.batch
        results[name] = r
        print(
            f"  gap {r['gap']:.4f} ± {r['gap_se']:.4f}  train {r['train_s']:.0f} s  "
            f"nfe {r['nfe_last']}",
            flush=True,
        )
        atomic_write(stem + ".json", json.dumps(results, indent=1).encode())
        write_table(stem + ".md", results, title)
    write_table(stem + ".md", results, title)


if __name__ == "__main__":
    main()
