"""FFJORD's multiscale CNF on MNIST with FFJORD's settings, read from the four IDX files
(published: 0.99 bits/dim, Grathwohl et al. 2019, Table 2).

FFJORD's MNIST run (`train_cnf.py --data mnist --dims 64,64,64 --strides 1,1,1,1
--num_blocks 2 --layer_type concat --multiscale True --rademacher True`, with its
defaults) and what this script does the same way:

- data: the 60,000 training images, each 8-bit pixel dequantised with fresh uniform
    noise every batch, `(k + u) / 256`, then logit-transformed with alpha = 1e-6;
- model: the multiscale CNF, 3 scales for 28x28 (squeeze and factor-out after the
    first two), 2 blocks per stack, conv fields `64, 64, 64` (3x3, time as an extra
    channel, softplus), a learned end time per block from T = 1 (`train_T`; the
    multiscale model of some versions of FFJORD's code keeps T fixed, as
    `--fixed-t1` does);
- solver: dopri5 at atol = rtol = 1e-5 in training and test;
- training: Rademacher Hutchinson (one probe), batch 200, Adam at 1e-3 after a
    linear warmup over 1,000 steps, no weight decay, no gradient clipping, for
    `--epochs` passes over the data (FFJORD's default is 1,000).

The test NLL is estimated with Hutchinson probes (`--test-probes` per sample, the
exact trace with `--exact-test`: 784 Jacobian-vector products per evaluation), and
the reported standard error includes the probes' noise (FFJORD's own test figures
came from its training estimator, one Rademacher probe). Bits/dim are those of the
8-bit pixels, `(NLL_x + 784 log 256) / (784 log 2)`, with `NLL_x` the NLL of the
dequantised pixels in [0, 1].

Cost (extrapolated, not run). On this project's 2-core CPU, a training step of the
full model at a batch of 4 instead of 200 (28x28 images, NFE 200 per forward pass at
initialisation) took 107 CPU-seconds, measured over three steps after compilation
(3.75 minutes). Linear in the batch, a step of 200 is about 5,400 CPU-seconds (45
minutes on both cores of an idle machine), an epoch of 300 steps about 9 days and
FFJORD's 1,000 epochs decades; and the NFE grows as FFJORD's dynamics stiffen over
training. The full settings are for a GPU; `--quick` and `--steps` are for a CPU.

    python -m experiments.ffjord_mnist --data-dir DIR   # DIR holds the IDX files
    python -m experiments.ffjord_mnist --data-dir DIR --quick   # a smoke run

Results: experiments/results/ffjord_mnist.{json,md,png}.
"""

import argparse
import math
import os
import time

import diffrax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import cnftrace
from cnftrace.datasets import (
    bits_per_dim,
    dequantize,
    digits_from_logit,
    load_mnist_idx,
    logit_transform,
)
from experiments._common import (
    RESULTS,
    markdown_table,
    mean_and_stderr,
    progress,
    save_image_grid,
    write_results,
)

LEVELS = 256
ALPHA = 1e-6
PUBLISHED_BITS_PER_DIM = 0.99


def to_logits(pixels, noise):
    """Dequantised 8-bit pixels in logit space: `logit(alpha + (1 - 2 alpha) s)` with
    `s = (k + u) / 256`."""
    s = ALPHA + (1 - 2 * ALPHA) * (pixels + noise) / LEVELS
    return jnp.log(s) - jnp.log1p(-s)


def ffjord_optimizer(lr: float, warmup: int):
    """Adam with FFJORD's linear warmup from 0 to `lr` over `warmup` steps."""
    schedule = optax.linear_schedule(0.0, lr, max(warmup, 1))
    return optax.adam(schedule)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="holds MNIST's IDX files")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=None, help="overrides --epochs")
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--hidden", default="64,64,64")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tol", type=float, default=1e-5, help="atol = rtol")
    parser.add_argument("--fixed-t1", action="store_true", help="do not learn T")
    parser.add_argument("--test-probes", type=int, default=4)
    parser.add_argument("--exact-test", action="store_true")
    parser.add_argument("--test-batch-size", type=int, default=200)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = parser.parse_args(argv)
    hidden = tuple(int(h) for h in args.hidden.split(","))
    train_images, _, test_images, _ = load_mnist_idx(args.data_dir)
    solver = diffrax.Dopri5()
    if args.quick:
        # The smoke model of ffjord_digits.py (Tsit5 there, not dopri5), with its
        # batch, its validation's 4 probes on 8 images and its 64 samples: on 8x8
        # images a process that runs both smoke runs (the test suite) compiles that
        # evaluation and the sampling once. The training steps differ (FFJORD's
        # warmup and dequantised batches here, an array of rows there).
        args.steps, args.batch_size, args.warmup = 3, 8, 2
        hidden, args.blocks, args.tol, solver = (4,), 1, 1e-3, diffrax.Tsit5()
        test_images = test_images[:8]
    shape = (1,) + train_images.shape[1:]
    dim = math.prod(shape)
    steps_per_epoch = max(1, train_images.shape[0] // args.batch_size)
    steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch

    dtype = jnp.result_type(float)
    train = jnp.asarray(train_images[:, None], dtype)

    def batches(key, n):
        k_idx, k_u = jr.split(key)
        rows = train[jr.randint(k_idx, (n,), 0, train.shape[0])]
        return to_logits(rows, jr.uniform(k_u, rows.shape, dtype))

    test_pixels = dequantize(
        test_images[:, None].astype(np.float64), np.random.default_rng(2024), LEVELS
    )
    test_y, _ = logit_transform(test_pixels, ALPHA)
    _, test_log_det = logit_transform(test_pixels.reshape(len(test_pixels), -1), ALPHA)

    model_key, train_key, test_key, sample_key = jr.split(jr.key(args.seed), 4)
    flow = cnftrace.MultiscaleFlow(
        shape,
        blocks_per_scale=args.blocks,
        hidden=hidden,
        learn_t1=not args.fixed_t1,
        solver=solver,
        rtol=args.tol,
        atol=args.tol,
        key=model_key,
    )
    print(
        f"MNIST {shape}: {train_images.shape[0]} training images, multiscale CNF "
        f"with {flow.n_scales} scales, {len(flow.blocks)} blocks, {steps} steps",
        flush=True,
    )

    checkpoints = None
    if args.checkpoint_dir is not None:
        config = {"script": "ffjord_mnist", "hidden": list(hidden), "tol": args.tol}
        checkpoints = cnftrace.Checkpoints(
            args.checkpoint_dir, every=steps_per_epoch, config=config
        )

    def log(record):
        print(
            f"step {record['step']}: train NLL {record['loss']:.2f} nats, NFE "
            f"{record['nfe']}, {record['seconds']:.0f} s",
            flush=True,
        )

    start = time.perf_counter()
    trained, history = cnftrace.fit(
        flow,
        batches,
        key=train_key,
        steps=steps,
        batch_size=args.batch_size,
        objective=cnftrace.MaximumLikelihood(cnftrace.Hutchinson(), tolerance=None),
        optimizer=ffjord_optimizer(args.lr, args.warmup),
        checkpoints=checkpoints,
        log_every=1 if steps < 100 else 50,
        progress=progress(),
        on_log=log,
    )
    train_seconds = time.perf_counter() - start
    seconds = history["seconds"]
    step_seconds = (
        (seconds[-1] - seconds[0]) / (history["step"][-1] - history["step"][0])
        if len(seconds) > 1
        else float("nan")
    )

    probes = 0 if args.exact_test else args.test_probes
    start = time.perf_counter()
    # Exact trace with `probes=0`, else Hutchinson with that many Rademacher probes
    # per sample (chunk `i` draws them from `fold_in(test_key, i)`).
    logp, eval_nfe = cnftrace.log_prob_batched(
        trained,
        jnp.asarray(test_y, dtype),
        batch_size=args.test_batch_size,
        estimator=cnftrace.Exact() if probes == 0 else cnftrace.Hutchinson(probes),
        key=None if probes == 0 else test_key,
        return_nfe=True,
    )
    eval_seconds = time.perf_counter() - start
    per_sample = [
        bits_per_dim(-lp - ld, dim, LEVELS) for lp, ld in zip(logp, test_log_det)
    ]
    bpd, bpd_se = mean_and_stderr(per_sample)
    samples = trained.sample(sample_key, 64)
    trace = "exact trace" if probes == 0 else f"Hutchinson, {probes} probes"

    header = ["model", "test bits/dim", "published", "eval NFE", "steps", "s/step"]
    rows = [
        [
            "multiscale CNF (FFJORD settings)",
            f"{bpd:.4f} ± {bpd_se:.4f}",
            f"{PUBLISHED_BITS_PER_DIM}",
            f"{eval_nfe:.0f}",
            f"{history['step'][-1]}",
            f"{step_seconds:.2f}",
        ]
    ]
    md = (
        f"FFJORD multiscale CNF on MNIST {shape}, {len(test_y)} test images "
        f"({trace}); bits/dim of the 8-bit pixels ± standard error.\n\n"
        + markdown_table(header, rows)
        + f"\n\nTraining: {train_seconds / 60:.1f} min; test evaluation "
        f"{eval_seconds / 60:.1f} min.\n"
    )
    print(md)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "ffjord_mnist")
    save_image_grid(
        stem + ".png",
        digits_from_logit(np.asarray(samples)),
        f"multiscale CNF on MNIST, test {bpd:.3f} bits/dim",
    )
    payload = {
        "settings": dict(vars(args), hidden=list(hidden), steps=steps),
        "test_bits_per_dim": bpd,
        "test_bits_per_dim_stderr": bpd_se,
        "published_bits_per_dim": PUBLISHED_BITS_PER_DIM,
        "test_trace": trace,
        "n_test": len(test_y),
        "eval_nfe": eval_nfe,
        "seconds_per_step": step_seconds,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "history": {k: history[k] for k in ("step", "loss", "nfe", "seconds")},
    }
    write_results(stem, payload, md)
    return payload


if __name__ == "__main__":
    main()
