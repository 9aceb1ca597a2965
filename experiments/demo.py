"""`make demo`: train a small CNF on 8gaussians, report the exact test NLL beside the
data's true entropy, and write a picture of the learned density and samples.

    python -m experiments.demo [--steps N] [--seed S] [--out DIR]
"""

import argparse
import math
import os
import time

import jax
import jax.numpy as jnp
import jax.random as jr

import cnftrace
from cnftrace.datasets import toy_entropy, toy_log_prob, toy_sample
from cnftrace.plot import plot_flow_2d


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="training steps")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-size", type=int, default=5000)
    parser.add_argument("--out", default="demo_output", help="output directory")
    args = parser.parse_args(argv)
    # A second `make demo` loads its compiled programs from disk instead of
    # compiling them again.
    cnftrace.enable_compilation_cache()

    dataset = "8gaussians"
    key = jr.key(args.seed)
    model_key, train_key, test_key, sample_key = jr.split(key, 4)

    # The README's first example: cnftrace's default field and recipe (MLPField
    # 2-64-64-64-2 with SiLU and sinusoidal time features, T = 0.5, Tsit5 at 1e-5 for
    # evaluation; fit's defaults: one Rademacher probe and the solver at 1e-2 in
    # training, Adam warming up to 3e-3 with a cosine decay).
    field = cnftrace.MLPField(2, key=model_key)
    flow = cnftrace.CNF(field, dim=2)

    print(
        f"cnftrace demo: one CNF block (MLPField 2-64-64-64-2, SiLU, T=0.5), "
        f"{dataset}, {args.steps} steps of {args.batch_size} fresh samples with fit's "
        f"defaults. JAX on {jax.devices()[0].platform}."
    )
    start = time.perf_counter()
    logged = []  # when each history record (every 10 steps) reached the host
    flow, history = cnftrace.fit(
        flow,
        lambda k, n: toy_sample(dataset, k, n),
        key=train_key,
        steps=args.steps,
        batch_size=args.batch_size,
        progress=True,
        log_every=10,
        on_log=lambda record: logged.append(time.perf_counter()),
    )
    train_seconds = time.perf_counter() - start

    test = toy_sample(dataset, test_key, args.test_size)
    nll = cnftrace.evaluate_nll(flow, test)
    entropy = toy_entropy(dataset)  # the mixture's entropy, overlap included
    closed_form = math.log(8) + math.log(2 * math.pi * math.e * (0.5 / 1.414) ** 2)
    floor = -float(jnp.mean(toy_log_prob(dataset, test)))
    print(f"training time          {train_seconds:7.1f} s")
    # Compiling the training step, or loading it from the compilation cache on a
    # second run, is most of the first ten steps.
    print(f"first 10 steps         {logged[0] - start:7.1f} s (compiling included)")
    print(
        f"final train NLL        {history['loss'][-1]:7.4f} nats (Hutchinson estimate)"
    )
    print(f"test NLL (exact trace) {nll.mean:7.4f} ± {nll.stderr:.4f} nats")
    gap = nll.mean - closed_form
    print(f"entropy, closed form   {closed_form:7.4f} nats  gap {gap:.4f}")
    print(f"entropy, with overlap  {entropy:7.4f} nats  gap {nll.mean - entropy:.4f}")
    print(f"true density on test   {floor:7.4f} nats  gap {nll.mean - floor:.4f}")
    print(f"NFE per solve          {nll.nfe:7.1f} (exact-trace evaluation)")

    samples = flow.sample(sample_key, 20_000)
    os.makedirs(args.out, exist_ok=True)
    path = plot_flow_2d(
        flow,
        toy_sample(dataset, jr.fold_in(test_key, 1), 20_000),
        samples,
        os.path.join(args.out, "demo_8gaussians.png"),
        title=f"{dataset}: test NLL {nll.mean:.3f} nats (entropy {closed_form:.3f})",
    )
    print(f"picture                {path}")
    print(f"total time             {time.perf_counter() - start:7.1f} s")
    return nll, entropy


if __name__ == "__main__":
    jnp.zeros(())  # initialise the backend before timing
    main()
