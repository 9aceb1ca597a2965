"""Likelihoods of diffusion and flow-matching models through their probability-flow
ODE (`cnftrace.ProbabilityFlow`), with every trace estimator, beside a CNF trained by
maximum likelihood on the same data.

Two data sets:

- **digits**: scikit-learn's 8x8 digits (64 dimensions, 17 grey levels), split
    70/15/15 by `cnftrace.datasets.load_digits`. Every model sees the pixels
    dequantised with fresh uniform noise and scaled to [-1, 1):
    `y = -1 + 2 (k + u) / 17`. Reported in bits per dimension of the discrete
    pixels by `ProbabilityFlow.bits_per_dim(levels, bin_width=1, data_range=(0, 17),
    model_range=(-1, 1))`, which counts the dequantisation and the scaling.
- **8gaussians**: FFJORD's toy mixture, whose differential entropy is known exactly
    (`cnftrace.datasets.toy_entropy`): reported as the gap of the test NLL to it.

Three models each, trained a few minutes on two CPU cores:

- **VP diffusion**: a noise-prediction MLP (`eps(t, x) = sigma(t) x + mlp`, SiLU,
    sinusoidal features of `log t`) trained with DDPM's simple loss under the VP
    schedule (`cnftrace.VPSchedule()`, beta 0.1 to 20), times uniform on
    [1e-5, 1]. On the toy it is evaluated as
    `ProbabilityFlow(net, d, kind="noise", schedule=VPSchedule())` (truncation
    `eps = 1e-5`, standard normal prior). On digits its ODE diverged on a few test
    images (|x| in the millions at `t = 1`, where the drift `(sigma' - f sigma)
    eps` follows the network's extrapolation): it is evaluated as the data
    prediction `x0 = (x - sigma eps) / alpha` clipped to [-1, 1] (DDPM's
    `clip_denoised`), `kind="data"`, and the noise model as it is with the exact
    trace beside it.
- **flow matching**: cnftrace's own `fit(..., objective="fm")` on an `mlp_flow`
    with `t1 = 1`, evaluated as `ProbabilityFlow.from_flow(flow)`.
- **CNF (maximum likelihood)**: `fit(..., objective="mle")`, the same architecture,
    evaluated the same way.

Every model's likelihood is computed with each estimator (Exact, Hutchinson,
Hutch++, XTrace; Tsit5 at rtol = atol = 1e-5) and reported with its mean, its
standard error, the NFE and the seconds. Each stochastic estimate is repeated twice
per sample (fresh probes, the same dequantisation noise for every estimator): the
spread gives each sample's Monte Carlo standard error, and the difference to the
exact trace at the same noise isolates the estimator's own. On digits, a table gives
each estimator's standard error per NFE and the cheapest route to a +-0.01 bits/dim
estimate. Seconds are measured with `--lock` held (a file lock shared with other
heavy jobs), figures of quality without it.

    python -m experiments.probability_flow --lock /tmp/cnftrace-cpu.lock
    python -m experiments.probability_flow --quick   # a smoke run, seconds

On a shared machine the run goes in parts, each under the lock (`--held` says so in
the report), the models kept in a folder (`--models`) and each part's figures
merged into the results file (`--merge`):

    flock LOCK python -m experiments.probability_flow --only toy --n-toy 1000 \
        --models DIR --held --merge
    flock LOCK python -m experiments.probability_flow --only digits --n-test 96 \
        --kinds diffusion --models DIR --held --merge
    flock LOCK python -m experiments.probability_flow --only digits --n-test 96 \
        --kinds fm,mle --models DIR --held --merge

Results: experiments/results/probability_flow.{json,md} (written atomically; the
report is rebuilt from the JSON by `--report-only`).
"""

import argparse
import contextlib
import fcntl
import json
import math
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

import cnftrace
from cnftrace.datasets import load_digits, toy_entropy, toy_sample
from experiments._common import RESULTS, atomic_write, environment, markdown_table

DIGIT_LEVELS = 17
TOY = "8gaussians"
# The estimators of every table: a name, the estimator and the solver's tolerance
# (rtol = atol). Hutch++ and XTrace take Rademacher vectors, as Hutchinson does: on
# these Jacobians (a large diagonal near t = 0) Gaussian vectors were far noisier.
TOL = 1e-5
ESTIMATORS = (
    ("Exact", cnftrace.Exact(), TOL),
    ("Hutchinson (1 probe)", cnftrace.Hutchinson(1), TOL),
    ("Hutchinson (6 probes)", cnftrace.Hutchinson(6), TOL),
    ("Hutch++ (6)", cnftrace.HutchPlusPlus(6, "rademacher"), TOL),
    ("XTrace (6)", cnftrace.XTrace(6, "rademacher"), TOL),
    ("Exact, tol 1e-3", cnftrace.Exact(), 1e-3),
    ("Hutchinson (1 probe), tol 1e-3", cnftrace.Hutchinson(1), 1e-3),
)
TOY_ESTIMATORS = (
    ("Exact", cnftrace.Exact(), TOL),
    ("Hutchinson (1 probe)", cnftrace.Hutchinson(1), TOL),
    ("Hutch++ (3)", cnftrace.HutchPlusPlus(3, "rademacher"), TOL),
    ("XTrace (4)", cnftrace.XTrace(4, "rademacher"), TOL),
)
MODEL_ORDER = (
    "VP diffusion, noise model as trained",
    "VP diffusion",
    "flow matching",
    "CNF (maximum likelihood)",
)
TARGET = 0.01  # bits/dim: the precision the digits' cheapest route is named for


# ------------------------------------------------------------------ the noise model


class NoiseNet(eqx.Module):
    """`eps(t, x) = sigma(t) x + mlp(x, features of log t)`: the skip term is the
    exact noise prediction for standard-normal data under a VP schedule, so the MLP
    learns a correction. Without it, the probability-flow ODE of the trained model
    diverged on some test images (near `t = 1` its drift is `-10 (x - eps)`, which
    grows wherever the learned `eps` runs ahead of `x`): mean 3.26 bits/dim against
    a median near 3, on 270 images."""

    mlp: eqx.nn.MLP
    schedule: cnftrace.AbstractSchedule
    n_freq: int = eqx.field(static=True)

    def __init__(self, dim, width, depth, schedule, *, key, n_freq=8):
        self.n_freq = n_freq
        self.schedule = schedule
        self.mlp = eqx.nn.MLP(
            dim + 2 * n_freq, dim, width, depth, activation=jax.nn.silu, key=key
        )

    def __call__(self, t, x):
        # log t from log 1e-5 to 0 mapped to [-1, 1], at frequencies 1..2^(n-1).
        s = 1 + 2 * jnp.log(jnp.maximum(t, 1e-6)) / math.log(1e5)
        freqs = 2.0 ** jnp.arange(self.n_freq, dtype=x.dtype)
        angles = math.pi * freqs * s
        features = jnp.concatenate([jnp.sin(angles), jnp.cos(angles)])
        out = self.mlp(jnp.concatenate([x, features.astype(x.dtype)]))
        return self.schedule.sigma(t) * x + out


class ClippedData(eqx.Module):
    """A noise model as a data-prediction model, `x0 = (x - sigma eps) / alpha`
    clipped to the data's range [-1, 1] (DDPM's `clip_denoised`). Its
    probability-flow drift, `(sigma'/sigma) x + (alpha' - alpha sigma'/sigma) x0`,
    keeps `x_t / sigma(t)` bounded wherever the network extrapolates."""

    net: NoiseNet
    schedule: cnftrace.AbstractSchedule

    def __call__(self, t, x):
        eps = self.net(t, x)
        x0 = (x - self.schedule.sigma(t) * eps) / self.schedule.alpha(t)
        return jnp.clip(x0, -1.0, 1.0)


def train_diffusion(data_fn, dim, width, depth, steps, batch, key, schedule):
    """DDPM's simple loss `|eps(t, x_t) - e|^2` with `t ~ U(1e-5, 1)`, Adam on
    `warmup_cosine_adam`. Returns the net, the training seconds and the loss at
    every tenth of the run.

    Times drawn half log-uniform (more weight near `t = 0`, where the likelihood
    starts) gave a model whose probability-flow ODE diverged on a few test
    images (|z| near 4000 at `t = 1`; bits/dim above 1e5 for them, median 3.08),
    from fewer draws at large `t`: DDPM's uniform times are kept."""
    init_key, key = jr.split(key)
    net = NoiseNet(dim, width, depth, schedule, key=init_key)
    optimizer = cnftrace.warmup_cosine_adam(steps, 1e-3)
    opt_state = optimizer.init(eqx.filter(net, eqx.is_inexact_array))

    def loss(net, x0, t, e):
        alpha = jax.vmap(schedule.alpha)(t)[:, None]
        sigma = jax.vmap(schedule.sigma)(t)[:, None]
        xt = alpha * x0 + sigma * e
        pred = jax.vmap(net)(t, xt)
        return jnp.mean((pred - e) ** 2)

    @eqx.filter_jit
    def step(net, opt_state, key):
        data_key, t_key, e_key = jr.split(key, 3)
        x0 = data_fn(data_key, batch)
        t = jr.uniform(t_key, (batch,), x0.dtype, 1e-5, 1.0)
        e = jr.normal(e_key, x0.shape, x0.dtype)
        value, grads = eqx.filter_value_and_grad(loss)(net, x0, t, e)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(net, eqx.is_inexact_array)
        )
        return eqx.apply_updates(net, updates), opt_state, value

    start = time.perf_counter()
    losses = []
    for i in range(steps):
        net, opt_state, value = step(net, opt_state, jr.fold_in(key, i))
        if (i + 1) % max(1, steps // 10) == 0:
            losses.append(float(value))
            print(f"  diffusion step {i + 1}: loss {losses[-1]:.4f}", flush=True)
    return net, time.perf_counter() - start, losses


def train_flow(data_fn, dim, width, steps, batch, key, objective, t1):
    model_key, fit_key = jr.split(key)
    flow = cnftrace.mlp_flow(dim, key=model_key, width=width, t1=t1)
    start = time.perf_counter()
    flow, history = cnftrace.fit(
        flow,
        data_fn,
        key=fit_key,
        steps=steps,
        batch_size=batch,
        objective=objective,
        progress=False,
        log_every=max(1, steps // 10),
        on_log=lambda r: print(
            f"  {objective} step {r['step']}: loss {r['loss']:.4f}", flush=True
        ),
    )
    return flow, time.perf_counter() - start, [float(v) for v in history["loss"]]


def read_training(path):
    """The training seconds and losses saved beside a model."""
    with open(path + ".json") as f:
        saved = json.load(f)
    return saved["train_seconds"], saved["train_losses"]


# ---------------------------------------------------------------------- the data


def digits_data():
    train, _, test = load_digits()
    train = jnp.asarray(train)

    def data_fn(key, n):
        pick_key, noise_key = jr.split(key)
        k = train[jr.randint(pick_key, (n,), 0, train.shape[0])]
        u = jr.uniform(noise_key, k.shape, k.dtype)
        return -1 + 2 * (k + u) / DIGIT_LEVELS

    return data_fn, np.asarray(test, np.int32)


def toy_data(n_test):
    def data_fn(key, n):
        return toy_sample(TOY, key, n)

    return data_fn, np.asarray(toy_sample(TOY, jr.key(2024), n_test))


# ------------------------------------------------------------------ measurements


@contextlib.contextmanager
def held(lock_path):
    """The shared CPU lock (a `flock` on `lock_path`) while timing; nothing without
    one."""
    if lock_path is None:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def measure(fn, lock_path):
    """`(result, seconds)`: `fn()` run once for its result (compiling), then timed
    once more with the lock held."""
    out = jax.block_until_ready(fn())
    with held(lock_path):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        seconds = time.perf_counter() - start
    return out, seconds


def evaluate(pf, x, estimators, *, digits, key, lock_path, repeats):
    """Each estimator's estimate on `x`: bits/dim of the digit levels (dequantised
    with the same noise for every estimator: one key), or the NLL in nats. Every
    estimate is repeated `repeats` times per sample; the first estimator must be
    the exact one, at the tight tolerance, the reference of the others."""
    rows = []
    reference = None
    for name, estimator, tol in estimators:
        flow = pf.with_estimator(estimator).with_tolerance(tol, tol)
        r = repeats if (digits or estimator.stochastic) else 1

        if digits:

            def run(flow=flow, r=r):
                return flow.bits_per_dim(
                    x,
                    bin_width=1,
                    data_range=(0, DIGIT_LEVELS),
                    model_range=(-1, 1),
                    key=key,
                    repeats=r,
                )

        else:

            def run(flow=flow, r=r):
                return flow.log_prob_estimate(x, key=key, repeats=r)

        est, seconds = measure(run, lock_path)
        sign = 1.0 if digits else -1.0  # the toy's figure is the NLL
        values = sign * np.asarray(est.values, np.float64)
        if reference is None:
            reference = values
        # One estimate's standard deviation per sample: all of its Monte Carlo
        # noise (probes, and on digits the dequantisation), and the probes' alone,
        # from the difference to the exact trace at the same noise.
        total_sd = float(np.sqrt(r * np.mean(np.asarray(est.stderr) ** 2)))
        probe_sd = float(np.sqrt(r * np.mean((values - reference) ** 2)))
        row = {
            "estimator": name,
            "tolerance": tol,
            "mean": float(values.mean()),
            "median": float(np.median(values)),
            "stderr": float(est.mean_stderr),
            "monte_carlo_stderr": float(est.monte_carlo_stderr),
            "sd_per_estimate": total_sd if r > 1 else 0.0,
            "probe_sd_per_estimate": probe_sd,
            "difference_to_exact": float(np.mean(values - reference)),
            "nfe": int(est.nfe),
            "matvecs": est.matvecs,
            "repeats": r,
            "seconds": seconds,
            "seconds_per_estimate": seconds / (r * values.shape[0]),
            "n": int(values.shape[0]),
        }
        rows.append(row)
        print(
            f"    {name}: {row['mean']:.4f} ± {row['stderr']:.4f} (MC "
            f"{row['monte_carlo_stderr']:.4f}, probe sd {probe_sd:.4f}), NFE "
            f"{row['nfe']}, {seconds:.2f} s",
            flush=True,
        )
    return rows


# -------------------------------------------------------------------------- main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diffusion-steps", type=int, default=20000)
    parser.add_argument("--fm-steps", type=int, default=4000)
    parser.add_argument("--mle-steps", type=int, default=300)
    parser.add_argument("--toy-diffusion-steps", type=int, default=10000)
    parser.add_argument("--toy-fm-steps", type=int, default=3000)
    parser.add_argument("--toy-mle-steps", type=int, default=1000)
    parser.add_argument("--width", type=int, default=256, help="digits models")
    parser.add_argument("--n-test", type=int, default=None, help="digits test rows")
    parser.add_argument("--n-toy", type=int, default=2000, help="toy test samples")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--lock", default=None, help="flock this file when timing")
    parser.add_argument(
        "--held",
        action="store_true",
        help="the whole run holds the CPU lock (started under flock): say so",
    )
    parser.add_argument("--models", default=None, help="save/reuse models here")
    parser.add_argument("--only", choices=("digits", "toy"), default=None)
    parser.add_argument(
        "--kinds",
        default="diffusion,fm,mle",
        help="the models to evaluate, a comma list of diffusion, fm, mle",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other data sets' and models' figures of an earlier "
        "results file (a run split into parts)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rewrite the markdown report from the results file",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.diffusion_steps = args.toy_diffusion_steps = 20
        args.fm_steps = args.toy_fm_steps = 20
        args.mle_steps = args.toy_mle_steps = 4
        args.width, args.n_test, args.n_toy = 16, 8, 64

    kinds = tuple(k.strip() for k in args.kinds.split(","))
    if not kinds or set(kinds) - {"diffusion", "fm", "mle"}:
        parser.error(f"--kinds takes diffusion, fm, mle; got {args.kinds!r}")
    stem = os.path.join(args.out, "probability_flow")
    if args.report_only:
        with open(stem + ".json") as f:
            md = report(json.load(f))
        print(md)
        atomic_write(stem + ".md", md.encode())
        return None
    results = {"data": {}}
    if args.merge and os.path.exists(stem + ".json"):
        with open(stem + ".json") as f:
            results = json.load(f)
        results.pop("environment", None)
    sets = ("digits", "toy") if args.only is None else (args.only,)
    for which in sets:
        # Each data set keeps the settings it was run with (a split run's parts
        # may differ in them: they are reported beside its tables).
        settings = dict(vars(args), kinds=list(kinds))
        new = run_data_set(which, args, kinds)
        old = results["data"].get(which, {}) if args.merge else {}
        models = dict(old.get("models", {}))
        models.update(new["models"])
        models = {name: models[name] for name in MODEL_ORDER if name in models}
        merged = {**old, **new, "models": models}
        merged["settings"] = dict(
            old.get("settings", {}), **{kind: settings for kind in kinds}
        )
        if which == "digits":
            merged["routes"] = routes(merged, new["n"])
        results["data"][which] = merged
    if not args.quick:
        # The figures first: the report is rebuilt from them by --report-only.
        payload = dict(results, environment=environment())
        atomic_write(stem + ".json", json.dumps(payload, indent=2).encode())
    md = report(results)
    print(md)
    if not args.quick:
        atomic_write(stem + ".md", md.encode())
    return results


def run_data_set(which, args, kinds):
    digits = which == "digits"
    key = jr.fold_in(jr.key(args.seed), 0 if digits else 1)
    if digits:
        data_fn, test = digits_data()
        if args.n_test is not None:
            test = test[: args.n_test]
        dim, width, batch = 64, args.width, 256
        steps = (args.diffusion_steps, args.fm_steps, args.mle_steps)
        estimators = ESTIMATORS
    else:
        data_fn, test = toy_data(args.n_toy)
        dim, width, batch = 2, 64 if not args.quick else 16, 512
        steps = (args.toy_diffusion_steps, args.toy_fm_steps, args.toy_mle_steps)
        estimators = TOY_ESTIMATORS
    schedule = cnftrace.VPSchedule()
    out = {"models": {}, "n": int(test.shape[0])}
    print(f"{which}: {test.shape[0]} test samples, {dim} dimensions", flush=True)
    keys = jr.split(key, 4)
    for name, kind in (
        ("VP diffusion", "diffusion"),
        ("flow matching", "fm"),
        ("CNF (maximum likelihood)", "mle"),
    ):
        if kind not in kinds:
            continue
        path = (
            None
            if args.models is None
            else os.path.join(args.models, f"{which}-{kind}.eqx")
        )
        print(f"  {name}", flush=True)
        loaded = path is not None and os.path.exists(path)
        if kind == "diffusion":
            like = NoiseNet(dim, width, 3, schedule, key=keys[0])
            if path is not None and os.path.exists(path):
                net = eqx.tree_deserialise_leaves(path, like)
                seconds, losses = read_training(path)
            else:
                net, seconds, losses = train_diffusion(
                    data_fn, dim, width, 3, steps[0], batch, keys[0], schedule
                )
            model = net
            noise = cnftrace.ProbabilityFlow(net, dim, kind="noise", schedule=schedule)
            if digits:
                # The noise model as it is: Exact only (its ODE diverges on a few
                # images, and the batch's solve takes their steps).
                out["models"]["VP diffusion, noise model as trained"] = {
                    "train_seconds": None,
                    "train_losses": [],
                    "estimates": evaluate(
                        noise,
                        test,
                        estimators[:1],
                        digits=True,
                        key=keys[3],
                        lock_path=args.lock,
                        repeats=args.repeats,
                    ),
                }
                pf = cnftrace.ProbabilityFlow(
                    ClippedData(net, schedule), dim, kind="data", schedule=schedule
                )
            else:
                pf = noise
        else:
            step_count = steps[1] if kind == "fm" else steps[2]
            t1 = 1.0 if kind == "fm" else 0.5
            like = cnftrace.mlp_flow(dim, key=keys[1], width=width, t1=t1)
            if path is not None and os.path.exists(path):
                flow = cnftrace.load(path, like=like)
                seconds, losses = read_training(path)
            else:
                flow, seconds, losses = train_flow(
                    data_fn, dim, width, step_count, batch, keys[1], kind, t1
                )
            pf = cnftrace.ProbabilityFlow.from_flow(flow)
            model = flow
            if kind == "fm":
                out["fm_check"] = fm_check(flow, test, digits, keys[3])
        if path is not None and not os.path.exists(path):
            os.makedirs(args.models, exist_ok=True)
            eqx.tree_serialise_leaves(path, model)
            with open(path + ".json", "w") as f:
                json.dump({"train_seconds": seconds, "train_losses": losses}, f)
        rows = evaluate(
            pf,
            test,
            estimators,
            digits=digits,
            key=keys[3],
            lock_path=args.lock,
            repeats=args.repeats,
        )
        out["models"][name] = {
            "train_seconds": seconds,
            "train_losses": losses,
            "loaded": loaded,
            "estimates": rows,
        }
    if not digits:
        out["entropy"] = toy_entropy(TOY)
    return out


def fm_check(flow, test, digits, key):
    """The ODE likelihood of cnftrace's own flow-matching model against
    `flow.log_prob` of the same field (exact trace, rtol = atol = TOL), on the test
    points in the model's units (digits dequantised once with `key`): through
    `ProbabilityFlow.from_flow`, and through the field passed as a plain callable
    in the other time convention (data at 1, noise at 0, the velocity negated)."""
    x = jnp.asarray(test, jnp.float32)
    if digits:
        u = jr.uniform(key, x.shape, x.dtype)
        x = -1 + 2 * (x + u) / DIGIT_LEVELS
    flow = flow.with_estimator(cnftrace.Exact()).with_tolerance(TOL, TOL)
    field, args = flow.vector_field, flow.args
    t0, t1 = float(flow.t0), float(flow.t1)
    reversed_pf = cnftrace.ProbabilityFlow(
        lambda t, y: -(t1 - t0) * field(t0 + (t1 - t0) * (1 - t), y, args),
        flow.shape,
        kind="velocity",
        data_time=1.0,
        noise_time=0.0,
        prior=flow.base,
        rtol=TOL,
        atol=TOL,
    )
    expected = np.asarray(flow.log_prob(x), np.float64)
    out = {"n": int(x.shape[0]), "dtype": str(x.dtype), "tolerance": TOL}
    for name, pf in (
        ("from_flow", cnftrace.ProbabilityFlow.from_flow(flow)),
        ("plain callable, data at t = 1", reversed_pf),
    ):
        diff = np.asarray(pf.log_prob(x), np.float64) - expected
        out[name] = {
            "max_abs_difference": float(np.max(np.abs(diff))),
            "mean_difference": float(np.mean(diff)),
        }
        print(
            f"    fm check, {name}: max |log p - flow.log_prob| "
            f"{out[name]['max_abs_difference']:.3g} nats "
            f"(log p mean {expected.mean():.3f})",
            flush=True,
        )
    out["flow_log_prob_mean"] = float(expected.mean())
    return out


def routes(data, n):
    """For each model and estimator of the digits: the estimates (repeats) and the
    seconds to a +-TARGET bits/dim estimate of one image and of the test set's
    mean (the Monte Carlo part of its error), from the measured standard deviation
    of one estimate and its seconds. A route at a loose tolerance counts only where
    the exact trace at that tolerance is within TARGET / 2 of the tight one."""
    out = []
    for model, m in data["models"].items():
        rows = m["estimates"]
        exact_at = {
            r["tolerance"]: r for r in rows if r["estimator"].startswith("Exact")
        }
        for r in rows:
            bias = abs(exact_at[r["tolerance"]]["difference_to_exact"])
            var = r["sd_per_estimate"] ** 2
            one = max(1, math.ceil(var / TARGET**2))
            whole = max(1, math.ceil(var / (n * TARGET**2)))
            out.append(
                {
                    "model": model,
                    "estimator": r["estimator"],
                    "admissible": bias <= TARGET / 2,
                    "tolerance_bias": bias,
                    "sd_per_estimate": r["sd_per_estimate"],
                    "probe_sd_per_estimate": r["probe_sd_per_estimate"],
                    "nfe": r["nfe"],
                    "jvps_per_estimate": r["nfe"] * r["matvecs"],
                    "seconds_per_estimate": r["seconds_per_estimate"],
                    "estimates_one_image": one,
                    "seconds_one_image": one * r["seconds_per_estimate"],
                    "estimates_test_set": whole,
                    "seconds_test_set": whole * n * r["seconds_per_estimate"],
                }
            )
    return out


def fastest(rows, key):
    admissible = [r for r in rows if r["admissible"]]
    return min(admissible, key=lambda r: r[key])


def timing_note(settings):
    """How the seconds of a run were measured, from its settings."""
    cores = f"{os.cpu_count()} CPU cores"
    if settings.get("lock") or settings.get("held"):
        return f"{cores}; seconds measured with the shared CPU lock held"
    return f"{cores}; seconds measured on a shared machine"


def settings_note(which, data):
    """The models' training steps (and which were loaded from an earlier run) and
    how the seconds were measured, from the settings each part ran with."""
    steps_of = {"diffusion": "diffusion_steps", "fm": "fm_steps", "mle": "mle_steps"}
    names = {
        "diffusion": "VP diffusion",
        "fm": "flow matching",
        "mle": "CNF (maximum likelihood)",
    }
    parts = []
    for kind, settings in data.get("settings", {}).items():
        option = steps_of[kind] if which == "digits" else "toy_" + steps_of[kind]
        loaded = data["models"].get(names[kind], {}).get("loaded")
        parts.append(
            f"{names[kind]} {settings[option]}"
            + (" (trained by an earlier run, loaded)" if loaded else "")
        )
    timing = {timing_note(s) for s in data.get("settings", {}).values()}
    return f"Training steps: {', '.join(parts)}. {'; '.join(sorted(timing))}."


def report(results):
    lines = [
        "Written by `python -m experiments.probability_flow` (the commands of each "
        "part: docs/likelihoods.md).",
        "",
    ]
    for which in ("digits", "toy"):
        if which not in results["data"]:
            continue
        data = results["data"][which]
        digits = which == "digits"
        n = data["n"]
        repeats = max(s["repeats"] for s in data["settings"].values())
        env = settings_note(which, data)
        if digits:
            lines.append(
                f"**Digits** ({n} test images, 64 dimensions, 17 levels): bits/dim "
                "of the discrete pixels ± the test set's standard error (the "
                "images' spread); MC s.e.: the part of it from the Monte Carlo "
                "noise (dequantisation and probes), each image estimated "
                f"{repeats} times with the same dequantisation noise for every "
                f"estimator. {env}"
            )
            unit = "bits/dim"
        else:
            lines.append(
                f"**{TOY}** ({n} test samples): the test NLL less the true entropy "
                f"{data['entropy']:.4f} nats ± its standard error; stochastic "
                f"estimates repeated {repeats} times. {env}"
            )
            unit = "NLL − entropy (nats)"
        header = [
            "model",
            "estimator",
            unit,
            "median",
            "MC s.e.",
            "NFE",
            "JVPs/eval",
            "seconds",
            "training",
        ]
        rows = []
        for model, m in data["models"].items():
            for i, r in enumerate(m["estimates"]):
                value = r["mean"] - (0.0 if digits else data["entropy"])
                train = m["train_seconds"]
                rows.append(
                    [
                        model if i == 0 else "",
                        r["estimator"],
                        f"{value:.4f} ± {r['stderr']:.4f}",
                        f"{r['median'] - (r['mean'] - value):.4f}",
                        f"{r['monte_carlo_stderr']:.4f}",
                        r["nfe"],
                        r["matvecs"],
                        f"{r['seconds']:.2f}",
                        "" if i or train is None else f"{train / 60:.1f} min",
                    ]
                )
        lines += ["", markdown_table(header, rows, "llrrrrrrr"), ""]
        check = data.get("fm_check")
        if check is not None:
            lines.append(
                "The ODE likelihood of cnftrace's own flow-matching model against "
                "`flow.log_prob` of the same field (exact trace, rtol = atol = "
                f"{check['tolerance']:g}, {check['dtype']}, {check['n']} points, "
                f"mean log-density {check['flow_log_prob_mean']:.3f} nats): the "
                "largest difference is "
                f"{check['from_flow']['max_abs_difference']:.2g} nats through "
                "`ProbabilityFlow.from_flow`, and "
                f"{check['plain callable, data at t = 1']['max_abs_difference']:.2g} "
                "nats through the field passed as a plain callable in the other "
                "time convention (data at 1, noise at 0, the velocity negated)."
            )
            lines.append("")
        if not digits:
            continue
        table = data["routes"]
        lines.append(
            "The standard deviation of one estimate of one image's bits/dim (all "
            "its Monte Carlo noise; the probes' alone beside it), its cost, and the "
            f"estimates and seconds to ±{TARGET} bits/dim (one standard error): "
            f"for one image, and for the Monte Carlo part of the test set's mean "
            f"({n} images)."
        )
        header = [
            "model",
            "estimator",
            "s.d. per estimate (probes)",
            "NFE",
            "JVPs",
            "s per estimate",
            "one image: estimates, s",
            "test set: estimates, s",
        ]
        rows = []
        for i, r in enumerate(table):
            first = i == 0 or table[i - 1]["model"] != r["model"]
            note = "" if r["admissible"] else " (tolerance bias)"
            rows.append(
                [
                    r["model"] if first else "",
                    r["estimator"] + note,
                    f"{r['sd_per_estimate']:.4f} ({r['probe_sd_per_estimate']:.4f})",
                    r["nfe"],
                    r["jvps_per_estimate"],
                    f"{r['seconds_per_estimate']:.4f}",
                    f"{r['estimates_one_image']}, {r['seconds_one_image']:.2f}",
                    f"{r['estimates_test_set']}, {r['seconds_test_set']:.1f}",
                ]
            )
        lines += ["", markdown_table(header, rows, "llrrrrrr"), ""]
        for model in data["models"]:
            mine = [r for r in table if r["model"] == model]
            one, whole = (
                fastest(mine, "seconds_one_image"),
                fastest(mine, "seconds_test_set"),
            )
            lines.append(
                f"- {model}: fastest to ±{TARGET} bits/dim on one image: "
                f"{one['estimator']}, {one['estimates_one_image']} estimate(s), "
                f"{one['seconds_one_image']:.2f} s; on the test set's mean: "
                f"{whole['estimator']}, {whole['estimates_test_set']} estimate(s) "
                f"per image, {whole['seconds_test_set']:.1f} s."
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
