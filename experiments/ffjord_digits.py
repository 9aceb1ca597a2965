"""FFJORD's multiscale image model on scikit-learn's 8x8 digits: test bits/dim beside a
full-covariance Gaussian, and a grid of samples.

The digits (17 grey levels, 1797 images split 70/15/15) are dequantised with fresh
uniform noise for every training batch and logit-transformed (alpha = 1e-6), as the
command line's `digits` source does; the flow models the logits as `(1, 8, 8)`
images. The model is FFJORD's multiscale CNF scaled down to the data and to a small
CPU: 2 scales (FFJORD's number for 8x8), 2 blocks per stack, conv fields of two
16-channel hidden layers with softplus, a learned end time per block (FFJORD's
`train_T`), Tsit5 at rtol = atol = 1e-4, Rademacher Hutchinson probes in training,
Adam at 1e-3 (warmup, cosine decay, gradient clipping), batches of 32. Training runs
until the validation NLL (every 100 steps, four probes per sample) has not improved
for `--patience` validations, or `--steps` steps; the best validation model is kept.

The test NLL uses the exact trace. Bits/dim are those of the discrete pixels,
`(NLL_x + 64 log 17) / (64 log 2)` with `NLL_x` the NLL of the dequantised pixels in
[0, 1] (the logit's log-determinant subtracted): an upper bound, in the units of the
Gaussian baseline fitted to the training logits and scored on the same test set.

    python -m experiments.ffjord_digits           # the full run (about 30 minutes)
    python -m experiments.ffjord_digits --quick   # a smoke run

Results: experiments/results/ffjord_digits.{json,md,png} (json and md written
atomically).
"""

import argparse
import math
import os
import time

import diffrax
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import cnftrace
from cnftrace.datasets import (
    DIGIT_LEVELS,
    LOGIT_ALPHA,
    bits_per_dim,
    data_source,
    dequantize,
    digits_from_logit,
    gaussian_baseline_nll,
    load_digits,
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

SHAPE = (1, 8, 8)
DIM = 64


def gaussian_bits_per_dim(test_flat, test_log_det) -> float:
    """The full-covariance Gaussian baseline on the same dequantised test logits, in
    bits/dim, fitted as the command line's `digits` source fits it."""
    y_train, _ = logit_transform(
        dequantize(load_digits().train, np.random.default_rng(0)), LOGIT_ALPHA
    )
    nll_y = gaussian_baseline_nll(y_train, test_flat)
    return bits_per_dim(nll_y - float(np.mean(test_log_det)), DIM)


def make_flow(key, shape, hidden, blocks, tol):
    return cnftrace.MultiscaleFlow(
        shape,
        blocks_per_scale=blocks,
        hidden=hidden,
        learn_t1=True,
        solver=diffrax.Tsit5(),
        rtol=tol,
        atol=tol,
        key=key,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200, help="at most this many")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", default="16,16", help="conv hidden channels")
    parser.add_argument("--blocks", type=int, default=2, help="blocks per stack")
    parser.add_argument("--tol", type=float, default=1e-4, help="rtol = atol")
    parser.add_argument("--validate-every", type=int, default=100)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-dir", default=None, help="checkpoint here; rerun to resume"
    )
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    args = parser.parse_args(argv)
    hidden = tuple(int(h) for h in args.hidden.split(","))
    n_test = None
    if args.quick:
        # ffjord_mnist.py's smoke run uses this model on 8x8 images, this batch and
        # this validation's size and estimator (as its test evaluation): a process
        # that runs both (the test suite) traces and compiles them once.
        args.steps, args.batch_size, args.validate_every = 4, 8, 2
        hidden, args.blocks, args.tol, n_test = (4,), 1, 1e-3, 8

    source = data_source("digits")
    validation = np.asarray(source.validation).reshape(-1, *SHAPE)
    test_seed = 2024
    test_flat = np.asarray(source.test(test_seed, 0))
    if n_test is not None:
        validation, test_flat = validation[:n_test], test_flat[:n_test]
    test = test_flat.reshape(-1, *SHAPE)
    test_log_det = np.asarray(source.test_log_det(test_seed, 0))[: test.shape[0]]

    def train(key, n):
        return source.train(key, n).reshape(n, *SHAPE)

    model_key, train_key, sample_key = jr.split(jr.key(args.seed), 3)
    flow = make_flow(model_key, SHAPE, hidden, args.blocks, args.tol)
    n_params = sum(
        p.size for p in jax.tree_util.tree_leaves(flow) if isinstance(p, jax.Array)
    )
    print(
        f"multiscale CNF: {flow.n_scales} scales, {len(flow.blocks)} blocks, "
        f"hidden {hidden}, {n_params} parameters",
        flush=True,
    )

    checkpoints = None
    if args.checkpoint_dir is not None:
        config = {
            "script": "ffjord_digits",
            "hidden": list(hidden),
            "blocks": args.blocks,
            "tol": args.tol,
            "lr": args.lr,
            "steps": args.steps,
            "seed": args.seed,
        }
        checkpoints = cnftrace.Checkpoints(args.checkpoint_dir, config=config)

    def log(record):
        if "val_nll" in record and "loss" not in record:  # before any step
            print(f"step 0: val NLL {record['val_nll']:.2f} nats", flush=True)
        elif "val_nll" in record:
            print(
                f"step {record['step']}: train NLL {record['loss']:.2f}, val NLL "
                f"{record['val_nll']:.2f} ± {record['val_stderr']:.2f} nats, NFE "
                f"{record['nfe']}, {record['seconds']:.0f} s",
                flush=True,
            )

    trained, history = cnftrace.fit(
        flow,
        train,
        key=train_key,
        steps=args.steps,
        batch_size=args.batch_size,
        objective=cnftrace.MaximumLikelihood(cnftrace.Hutchinson(), tolerance=None),
        optimizer=cnftrace.warmup_cosine_adam(args.steps, args.lr),
        validation=cnftrace.Validation(
            validation,
            every=args.validate_every,
            patience=args.patience,
            estimator=cnftrace.Hutchinson(num_probes=4),
        ),
        checkpoints=checkpoints,
        log_every=10,
        progress=progress(),
        on_log=log,
    )
    # From the history, so that a resumed run counts the time before it stopped.
    train_seconds = history["seconds"][-1]
    steps_run = history["step"][-1]
    best_step = history["val_step"][int(np.argmin(history["val_nll"]))]

    start = time.perf_counter()
    logp, eval_nfe = cnftrace.log_prob_batched(
        trained, jnp.asarray(test), batch_size=30, return_nfe=True
    )
    eval_seconds = time.perf_counter() - start
    nll_y = float(-logp.mean())
    per_sample = [bits_per_dim(-lp - ld, DIM) for lp, ld in zip(logp, test_log_det)]
    bpd, bpd_se = mean_and_stderr(per_sample)
    baseline = gaussian_bits_per_dim(test_flat, test_log_det)
    uniform = math.log2(DIGIT_LEVELS)

    samples, stats = trained.sample(sample_key, 64, return_stats=True)
    pixels = digits_from_logit(np.asarray(samples))
    sample_nfe = float(stats.total_nfe)
    t1s = [float(b.t1) for b in trained.blocks]
    tail = history["nfe"][-max(1, len(history["nfe"]) // 10) :]

    header = ["model", "test bits/dim", "test NLL (logit space, nats)", "NFE"]
    rows = [
        [
            "multiscale CNF (this run)",
            f"{bpd:.4f} ± {bpd_se:.4f}",
            f"{nll_y:.2f}",
            f"{eval_nfe:.0f} (exact-trace eval), {float(np.mean(tail)):.0f} (train "
            f"fwd), {sample_nfe:.0f} (sampling)",
        ],
        ["full-covariance Gaussian", f"{baseline:.4f}", "", ""],
        ["uniform dequantised pixels", f"{uniform:.4f}", "", ""],
    ]
    md = (
        f"FFJORD multiscale CNF on scikit-learn's 8x8 digits ({DIGIT_LEVELS} levels), "
        f"{test.shape[0]} test images, exact trace; bits/dim of the discrete pixels "
        "± standard error over test images.\n\n"
        + markdown_table(header, rows)
        + f"\n\nModel: {flow.n_scales} scales, {len(flow.blocks)} CNF blocks, conv "
        f"hidden channels {hidden}, softplus, {n_params} parameters, Tsit5 at rtol = "
        f"atol = {args.tol:g}, learned end times {', '.join(f'{t:.2f}' for t in t1s)}."
        f"\nTraining: {steps_run} steps of {args.batch_size} (best validation at step "
        f"{best_step}), Hutchinson (Rademacher), Adam {args.lr:g}; "
        f"{train_seconds / 60:.1f} min on {os.cpu_count()} CPU cores (load average "
        f"{os.getloadavg()[1]:.1f} over the last 5 minutes); test evaluation "
        f"{eval_seconds / 60:.1f} min.\n"
    )
    print(md)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "ffjord_digits")
    save_image_grid(
        stem + ".png",
        pixels,
        f"multiscale CNF samples, test {bpd:.3f} bits/dim (Gaussian {baseline:.3f})",
    )
    payload = {
        "settings": dict(vars(args), hidden=list(hidden)),
        "test_bits_per_dim": bpd,
        "test_bits_per_dim_stderr": bpd_se,
        "test_nll_logit_space": nll_y,
        "gaussian_baseline_bits_per_dim": baseline,
        "uniform_bits_per_dim": uniform,
        "n_test": int(test.shape[0]),
        "eval_nfe": eval_nfe,
        "sample_nfe": sample_nfe,
        "train_nfe_end": float(np.mean(tail)),
        "steps_run": steps_run,
        "best_step": best_step,
        "train_seconds": train_seconds,
        "eval_seconds": eval_seconds,
        "parameters": n_params,
        "learned_t1": t1s,
        "history": {
            k: history[k] for k in ("step", "loss", "nfe", "val_step", "val_nll")
        },
    }
    write_results(stem, payload, md)
    return payload


if __name__ == "__main__":
    main()
