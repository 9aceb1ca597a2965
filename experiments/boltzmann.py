"""Boltzmann generators on a CPU: flows trained toward densities known by their energy,
then reweighted by the exact trace.

Two targets of `cnftrace.datasets`:

- `mixture2d`: a 2-D mixture of four Gaussians of unequal mass, whose normaliser is
    known (`log Z = log 3`). An MLP flow is trained by maximum likelihood on exact
    samples and by reverse KL from the energy alone (at `T = 1`, and annealed from
    `T = 4`); 10,000 weighted samples of each estimate `log Z`, against the truth.
- `dw4`: four particles in 2-D with a double-well pair potential (Köhler et al. 2020).
    An E(n)-equivariant flow (`EGNNField` over a `MeanFreeNormal` base, E-NF's width
    32 and depth 3) is trained by maximum likelihood and by flow matching on
    reference samples (replica-exchange Metropolis, seeded), and by reverse KL from the
    energy alone (at `T = 1`, and annealed from `T = 4`). Each is scored by its
    exact-trace test NLL on held-out reference samples and by the effective sample
    size of 10,000 samples weighted toward the energy; the energy histograms of
    their samples show what each covers (`boltzmann_dw4_energies.png`).

Each trained flow's `log Z` estimate is printed too: the DW4 normaliser is unknown,
but flows that cover the target agree on it, and one that misses modes falls short.

Run: `nice -n 5 .venv/bin/python -m experiments.boltzmann` (writes
`experiments/results/boltzmann.{json,md}` and the histogram), or with `--quick` for a
smoke run of a few minutes (few steps, small samples; its figures mean nothing). On a
machine shared through a lock file, `--lock PATH` takes the lock (`flock`) for each
stage (one training run and its weights, the reference sampling) and lets it go
between stages, so that no one waits for the whole experiment.
"""

import argparse
import contextlib
import fcntl
import os
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import cnftrace
from cnftrace.datasets import dw4, mixture_2d
from experiments import _common

STEM = "boltzmann"
N_WEIGHTS = 10_000
# Test NLLs published for DW4, read from the papers' tables (their own MCMC data,
# GPU-hours of training). Whether they are comparable is judged in the note below the
# table, from the target's entropy.
PUBLISHED_DW4 = [
    ("E-NF, maximum likelihood (Garcia Satorras et al. 2021)", 1.72),
    ("equivariant OT flow matching (Klein et al. 2023)", 1.68),
]


class _SharedCPU:
    """The lock file of a shared machine (`--lock`), taken with `flock` before a stage
    of the experiment and let go once it has been held `hold` seconds, at the end of
    a stage: others wait minutes at most, and the experiment does not queue again for
    every short stage."""

    def __init__(self, path, hold):
        self.path, self.hold = path, hold
        self.handle, self.since = None, 0.0

    @contextlib.contextmanager
    def stage(self, name):
        if self.path is None:
            yield
            return
        if self.handle is None:
            start = time.perf_counter()
            self.handle = open(self.path, "a")
            fcntl.flock(self.handle, fcntl.LOCK_EX)
            self.since = time.perf_counter()
            print(f"[{name}: lock taken after {self.since - start:.0f} s]", flush=True)
        try:
            yield
        finally:
            if time.perf_counter() - self.since > self.hold:
                self.release()

    def release(self):
        if self.handle is not None:
            held = time.perf_counter() - self.since
            self.handle.close()  # closing the file lets the lock go
            self.handle = None
            print(f"[lock held {held:.0f} s]", flush=True)


class Tempered(eqx.Module):
    """`beta * log_prob(x)`: the target at temperature `1 / beta`. `beta` is an
    array, so every stage of an annealing schedule runs the same compiled step."""

    log_prob: Callable
    beta: jax.Array

    def __call__(self, x):
        return self.beta.astype(x.dtype) * self.log_prob(x)


def _flow_2d(key):
    field = cnftrace.MLPField(2, width=64, depth=3, key=key)
    return cnftrace.CNF(field, 2, t1=1.0)


def _flow_dw4(key):
    field = cnftrace.EGNNField(4, 2, width=32, depth=3, key=key)
    base = cnftrace.MeanFreeNormal(4, 2)
    return cnftrace.CNF(field, (4, 2), t1=1.0, base=base, rtol=1e-5, atol=1e-5)


def _train(flow, data, objective, steps, batch_size, key, lr):
    start = time.perf_counter()
    flow, history = cnftrace.fit(
        flow,
        data,
        key=key,
        objective=objective,
        steps=steps,
        batch_size=batch_size,
        optimizer=cnftrace.warmup_cosine_adam(steps, lr),
        progress=_common.progress(),
        log_every=max(1, steps // 10),
        on_log=lambda r: print(
            f"  step {r['step']}: loss {r['loss']:.3f}, nfe {r['nfe']}, "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        ),
    )
    return flow, history, time.perf_counter() - start


def _weights(flow, target, key, n):
    start = time.perf_counter()
    weights = cnftrace.importance_weights(
        flow, target.log_prob, n, key=key, batch_size=2000
    )
    return weights, time.perf_counter() - start


def _mode_masses(x, target):
    """The fraction of samples nearest each of the mixture's means."""
    means = np.asarray(target.means)
    nearest = np.argmin(((x[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    return np.bincount(nearest, minlength=len(means)) / len(x)


def mixture_experiment(args, key):
    target = mixture_2d()
    truth = target.log_z
    masses = np.exp(np.asarray(target.log_masses) - truth)
    rows, out = [], {"log_z_true": truth, "mode_masses_true": masses.tolist()}
    exact_samples = lambda k, n: target.sample(k, n)  # noqa: E731

    def tempered(beta):
        """Reverse KL toward p~^beta: at beta < 1 the modes are wider and nearer
        in density, so a flow spreads over all of them before it is cooled."""
        target_at = Tempered(target.log_prob, jnp.asarray(beta))
        return cnftrace.ReverseKL(target_at, estimator=cnftrace.Exact())

    third = args.steps_2d // 3
    runs = {
        "maximum likelihood on exact samples": [(exact_samples, "mle", args.steps_2d)],
        "reverse KL from the energy": [
            (None, tempered(1.0), args.steps_2d),
        ],
        "reverse KL, annealed (T = 4, 2, 1)": [
            (None, tempered(0.25), third),
            (None, tempered(0.5), third),
            (None, tempered(1.0), args.steps_2d - 2 * third),
        ],
    }
    for i, (name, stages) in enumerate(runs.items()):
        k_init, k_fit, k_w = jr.split(jr.fold_in(key, i), 3)
        with args.cpu.stage(f"mixture2d, {name}"):
            flow, seconds = _flow_2d(k_init), 0.0
            for j, (data, objective, steps) in enumerate(stages):
                flow, history, stage_seconds = _train(
                    flow, data, objective, steps, 256, jr.fold_in(k_fit, j), 3e-3
                )
                seconds += stage_seconds
            weights, w_seconds = _weights(flow, target, k_w, args.weights)
        err = weights.log_z - truth
        modes = _mode_masses(weights.samples, target)
        out[name] = {
            **weights.summary(),
            "log_z_error": err,
            "train_seconds": seconds,
            "weights_seconds": w_seconds,
            "steps": args.steps_2d,
            "mode_masses_flow": modes.tolist(),
            "final_loss": history["loss"][-1],
        }
        print(f"mixture2d, {name}: {weights}; log Z error {err:+.4f} ({seconds:.0f} s)")
        rows.append(
            [
                name,
                f"{weights.log_z:.4f} ± {weights.log_z_stderr:.4f}",
                f"{err:+.4f}",
                f"{100 * weights.ess_fraction:.1f}%",
                f"{weights.pareto_k:.2f}",
                " / ".join(f"{m:.2f}" for m in modes),
                f"{seconds:.0f}",
            ]
        )
    table = _common.markdown_table(
        [
            "mixture2d",
            f"log Z ({args.weights} weighted samples)",
            "error",
            "ESS",
            "k-hat",
            "flow's mode masses",
            "train s",
        ],
        rows,
        "llrrrlr",
    )
    note = (
        f"True `log Z = log 3 = {truth:.4f}`; the target's mode masses are "
        + " / ".join(f"{m:.2f}" for m in masses)
        + f". {args.steps_2d} steps of 256 samples each."
    )
    return out, table + "\n\n" + note


def _pair_states(x, target):
    """The fraction of samples with k pair distances under 4 (the barrier of the
    double well), k = 0..6: DW4's metastable states."""
    short = (np.asarray(target.distances(jnp.asarray(x))) < 4).sum(axis=1)
    return np.bincount(short, minlength=7) / len(short)


def dw4_experiment(args, key):
    target = dw4()
    k_ref, k_check, k_runs = jr.split(key, 3)
    n_ref = args.train + args.test
    with args.cpu.stage("dw4 reference samples"):
        start = time.perf_counter()
        reference = np.asarray(
            target.sample(
                k_ref, n_ref, chains=args.chains, burn_in=args.burn_in, thin=args.thin
            )
        )
        ref_seconds = time.perf_counter() - start
        # An independent run with five times the burn-in: the sampler has converged if
        # the two agree on the metastable states' populations and the mean energy.
        check = np.asarray(
            target.sample(
                k_check,
                args.test,
                chains=args.chains,
                burn_in=5 * args.burn_in,
                thin=args.thin,
            )
        )
        order = np.asarray(jr.permutation(jr.fold_in(k_ref, 1), n_ref))
    reference = reference[order]
    train, test = reference[: args.train], reference[args.train :]
    ref_energy = np.asarray(target.energy(jnp.asarray(test)))
    check_energy = np.asarray(target.energy(jnp.asarray(check)))
    sampler = {
        "seconds": ref_seconds,
        "settings": {
            "chains": args.chains,
            "burn_in": args.burn_in,
            "thin": args.thin,
            "temperatures": [1.0, 1.5, 2.25, 3.4, 5.0],
        },
        "test_mean_energy": float(ref_energy.mean()),
        "check_mean_energy": float(check_energy.mean()),
        "test_pair_states": _pair_states(test, target).tolist(),
        "check_pair_states": _pair_states(check, target).tolist(),
    }
    print(
        f"dw4 reference: {n_ref} samples in {ref_seconds:.0f} s; mean energy "
        f"{ref_energy.mean():.3f} (check run {check_energy.mean():.3f})"
    )

    def reverse_kl(beta):
        return cnftrace.ReverseKL(Tempered(target.log_prob, jnp.asarray(beta)))

    third = args.steps_rkl // 3
    # (name, batch size, learning rate, stages of (data, objective, steps))
    runs = [
        ("maximum likelihood", 128, 3e-3, [(train, "mle", args.steps_mle)]),
        ("flow matching", 256, 3e-3, [(train, "fm", args.steps_fm)]),
        (
            "reverse KL (energy only)",
            128,
            2e-3,
            [(None, reverse_kl(1.0), args.steps_rkl)],
        ),
        (
            "reverse KL, annealed T = 4, 2, 1 (energy only)",
            128,
            2e-3,
            [
                (None, reverse_kl(0.25), third),
                (None, reverse_kl(0.5), third),
                (None, reverse_kl(1.0), args.steps_rkl - 2 * third),
            ],
        ),
    ]
    out, rows, samples = {"sampler": sampler}, [], {}
    for i, (name, batch, lr, stages) in enumerate(runs):
        k_init, k_fit, k_w = jr.split(jr.fold_in(k_runs, i), 3)
        if args.dw4_runs and i not in args.dw4_runs:
            continue
        with args.cpu.stage(f"dw4, {name}"):
            flow, seconds = _flow_dw4(k_init), 0.0
            for j, (data, objective, stage_steps) in enumerate(stages):
                flow, history, stage_seconds = _train(
                    flow, data, objective, stage_steps, batch, jr.fold_in(k_fit, j), lr
                )
                seconds += stage_seconds
            steps = sum(stage[2] for stage in stages)
            start = time.perf_counter()
            nll = cnftrace.evaluate_nll(flow, test, batch_size=1000)
            nll_seconds = time.perf_counter() - start
            weights, w_seconds = _weights(flow, target, k_w, args.weights)
        samples[name] = weights
        out[name] = {
            "test_nll": nll.mean,
            "test_nll_stderr": nll.stderr,
            "nfe": nll.nfe,
            **weights.summary(),
            "train_seconds": seconds,
            "nll_seconds": nll_seconds,
            "weights_seconds": w_seconds,
            "steps": steps,
            "batch_size": batch,
            "pair_states_flow": _pair_states(weights.samples, target).tolist(),
        }
        print(
            f"dw4, {name}: test NLL {nll}; {weights} ({seconds:.0f} s training, "
            f"{w_seconds:.0f} s for the weights)"
        )
        rows.append(
            [
                name,
                f"{nll.mean:.3f} ± {nll.stderr:.3f}",
                f"{100 * weights.ess_fraction:.1f}%",
                f"{weights.pareto_k:.2f}",
                f"{weights.log_z:.3f} ± {weights.log_z_stderr:.3f}",
                f"{steps} × {batch}",
                f"{seconds:.0f}",
            ]
        )
    table = _common.markdown_table(
        [
            "dw4",
            "test NLL (nats)",
            f"ESS of {args.weights}",
            "k-hat",
            "log Z",
            "steps × batch",
            "train s",
        ],
        rows,
        "lrrrrlr",
    )
    _histogram(
        test, samples, target, os.path.join(args.out, args.name + "_dw4_energies")
    )
    # No flow's NLL can be below the target's entropy E_p[E] + log Z; log Z from
    # the flow whose weights are the most even.
    best = max(samples.values(), key=lambda w: w.ess_fraction)
    entropy = float(ref_energy.mean()) + best.log_z
    out["entropy_estimate"] = entropy
    states = " / ".join(f"{p:.3f}" for p in sampler["test_pair_states"][2:5])
    check_states = " / ".join(f"{p:.3f}" for p in sampler["check_pair_states"][2:5])
    note = (
        f"Reference samples: replica-exchange random-walk Metropolis, "
        f"{args.chains} chains, burn-in {args.burn_in}, one sample every {args.thin} "
        f"steps ({ref_seconds:.0f} s for {n_ref}); {args.train} to train on, "
        f"{args.test} to test. Fractions of test samples with 2 / 3 / 4 short "
        f"pairs: {states} (an independent run with 5x the burn-in: {check_states}); "
        f"mean energy {ref_energy.mean():.3f} ({check_energy.mean():.3f}).\n\n"
        f"The target's entropy, `E_p[E] + log Z`, is {entropy:.2f} nats (the test "
        "samples' mean energy, and log Z from the flow with the most even weights): "
        "no test NLL on these coordinates can be below it. Published DW4 test NLLs: "
        + "; ".join(f"{name} {nll:.2f}" for name, nll in PUBLISHED_DW4)
        + (
            ". They are above it, and comparable within the reference samplers' "
            "agreement."
            if all(nll >= entropy for _, nll in PUBLISHED_DW4)
            else ". They are below it, so they are not densities of these "
            "coordinates (the papers scale the positions or the density otherwise) "
            "and are not compared here; the ESS is."
        )
    )
    return out, table + "\n\n" + note


def _histogram(test, weights_by_name, target, stem):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = np.asarray(target.energy(jnp.asarray(test)))
    bins = np.linspace(-30, 0, 61)
    fig, axes = plt.subplots(
        1, len(weights_by_name), figsize=(4.2 * len(weights_by_name), 3.4)
    )
    for ax, (name, weights) in zip(np.atleast_1d(axes), weights_by_name.items()):
        e = np.asarray(target.energy(jnp.asarray(weights.samples)))
        ax.hist(ref, bins, density=True, color="0.75", label="reference (MCMC)")
        ax.hist(e, bins, density=True, histtype="step", color="C0", label="flow")
        w = weights.normalized()
        if np.all(np.isfinite(w)):
            ax.hist(
                e,
                bins,
                weights=w / np.diff(bins)[0],
                histtype="step",
                color="C3",
                label="flow, reweighted",
            )
        ax.set_title(f"{name}\nESS {100 * weights.ess_fraction:.1f}%", fontsize=9)
        ax.set_xlabel("energy")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    _common.atomic_write(stem + ".png", _common.figure_bytes(fig, dpi=110))
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=_common.RESULTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--only", choices=("mixture2d", "dw4"), help="run one target (its own files)"
    )
    parser.add_argument("--lock", help="a lock file to hold while computing")
    parser.add_argument(
        "--hold",
        type=float,
        default=300.0,
        help="with --lock: let the lock go after the stage that passes this many "
        "seconds of holding it",
    )
    parser.add_argument(
        "--dw4-runs",
        type=lambda v: [int(i) for i in v.split(",")],
        help="the DW4 runs to make, by their index (0 maximum likelihood, 1 flow "
        "matching, 2 reverse KL, 3 annealed reverse KL); all by default",
    )
    parser.add_argument("--steps-2d", type=int, default=3000)
    parser.add_argument("--steps-mle", type=int, default=400)
    parser.add_argument("--steps-fm", type=int, default=8000)
    parser.add_argument("--steps-rkl", type=int, default=600)
    parser.add_argument("--weights", type=int, default=N_WEIGHTS)
    parser.add_argument("--train", type=int, default=10_000)
    parser.add_argument("--test", type=int, default=2000)
    parser.add_argument("--chains", type=int, default=2000)
    parser.add_argument("--burn-in", type=int, default=2000)
    parser.add_argument("--thin", type=int, default=50)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps_2d = args.steps_mle = args.steps_fm = args.steps_rkl = 12
        args.weights, args.train, args.test = 500, 500, 200
        args.chains, args.burn_in, args.thin = 100, 100, 5
    args.name = STEM + (f"_{args.only}" if args.only else "")
    args.name += "_quick" if args.quick else ""
    settings = dict(vars(args))
    args.cpu = _SharedCPU(args.lock, args.hold)
    key = jr.key(args.seed)
    start = time.perf_counter()
    payload, parts = {}, []
    try:
        if args.only in (None, "mixture2d"):
            payload["mixture2d"], md = mixture_experiment(args, jr.fold_in(key, 0))
            parts.append("### A 2-D energy with a known normaliser\n\n" + md)
        if args.only in (None, "dw4"):
            payload["dw4"], md = dw4_experiment(args, jr.fold_in(key, 1))
            parts.append("### DW4\n\n" + md)
    finally:
        args.cpu.release()
    payload |= {"settings": settings, "seconds": time.perf_counter() - start}
    markdown = "\n\n".join(parts) + "\n"
    _common.write_results(os.path.join(args.out, args.name), payload, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
