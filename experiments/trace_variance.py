"""Variance of trace estimators at a fixed budget of matrix-vector products.

For each operator and budget B (a number of products with the operator), draws many
independent estimates of the trace with `cnftrace.trace` and reports their empirical
mean and variance for

- Hutchinson with B Rademacher probes (the project's default sampler),
- Hutch++ with B products (B/3 sketch vectors, B/3 probes), Gaussian and Rademacher,
- XTrace with B products (B/2 test vectors), Gaussian and Rademacher,

on three kinds of operator:

- `low-rank+noise`: 100 x 100, `U diag(2^-j)_{j<10} U^T + 1e-2 E`, `U` a random
    orthonormal 100 x 10 basis and `E` a symmetric Gaussian matrix with entries of
    variance 1/100 (spectral norm about 2, so the noise eigenvalues are within +-0.02).
- `flat`: 100 x 100, `V diag(lambda) V^T` with the eigenvalues evenly spaced in
    [-1, 1] and `V` a random orthogonal matrix: no spectral decay, so a sketch captures
    little.
- `digits-cnf@x<i>`: the Jacobian (a `lineax.JacobianLinearOperator`) of a CNF's
    vector field at `t = t1 / 2`, at test points `x<i>` of scikit-learn's 8 x 8 digits
    (64-D; dequantised, logit-transformed with alpha = 0.05 and standardised), after
    training the CNF (ConcatSquash 64-64-64-64) with `cnftrace.fit` for 1000 steps.

Each mean is checked against the exact trace (`bias/SE`: its distance in standard
errors), and each operator's leading singular values are listed. Writes
`trace_variance.json` and `trace_variance.md` to `--out` (`experiments/results` by
default) and prints the tables.

Run: `.venv/bin/python -m experiments.trace_variance` (80 to 100 s on two CPU cores,
25 s of it training), or with `--quick` for a smoke run (no training, three small
operators, about ten seconds, most of it compiling).
"""

import argparse
import math
import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import lineax as lx  # noqa: E402
import numpy as np  # noqa: E402

import cnftrace  # noqa: E402
from cnftrace.datasets import dequantize, load_digits, logit_transform  # noqa: E402
from experiments import _common  # noqa: E402

ESTIMATORS = (
    ("Hutchinson", lambda b: cnftrace.Hutchinson(b, "rademacher")),
    ("Hutch++ (Gauss)", lambda b: cnftrace.HutchPlusPlus(b, "gaussian")),
    ("Hutch++ (Rad.)", lambda b: cnftrace.HutchPlusPlus(b, "rademacher")),
    ("XTrace (Gauss)", lambda b: cnftrace.XTrace(b, "gaussian")),
    ("XTrace (Rad.)", lambda b: cnftrace.XTrace(b, "rademacher")),
)
LOGIT_ALPHA = 0.05  # FFJORD's image preprocessing
SINGULAR_VALUES = (1, 2, 3, 5, 10, 20)  # the σ_j of the spectrum table


def low_rank_plus_noise(key, n=100, rank=10, noise=1e-2):
    k1, k2 = jr.split(key)
    u, _ = jnp.linalg.qr(jr.normal(k1, (n, rank)))
    eigenvalues = 2.0 ** -jnp.arange(rank)[None, :]
    g = jr.normal(k2, (n, n)) / math.sqrt(n)
    return (u * eigenvalues) @ u.T + noise * (g + g.T) / math.sqrt(2)


def flat_spectrum(key, n=100):
    v, _ = jnp.linalg.qr(jr.normal(key, (n, n)))
    return (v * jnp.linspace(-1.0, 1.0, n)[None, :]) @ v.T


def _field_at(y, args):
    field, t = args
    return field(t, y, None)


def train_digits_cnf(key, steps, batch_size, width):
    """A one-block CNF on the digits (dequantised, logit-transformed, standardised with
    the training mean and standard deviation), trained for `steps` steps."""
    splits = load_digits()
    rng = np.random.default_rng(0)
    train, _ = logit_transform(dequantize(splits.train, rng), LOGIT_ALPHA)
    test, _ = logit_transform(dequantize(splits.test, rng), LOGIT_ALPHA)
    mean, std = train.mean(axis=0), train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    train, test = (train - mean) / std, (test - mean) / std
    model_key, fit_key = jr.split(key)
    field = cnftrace.ConcatSquashMLP(64, width=width, depth=2, key=model_key)
    flow = cnftrace.CNF(field, dim=64, t1=0.5, rtol=1e-3, atol=1e-3)
    start = time.perf_counter()
    if steps > 0:
        flow, history = cnftrace.fit(
            flow,
            jnp.asarray(train),
            key=fit_key,
            steps=steps,
            batch_size=batch_size,
            progress=False,
            log_every=max(1, steps // 4),
        )
        loss = float(history["loss"][-1])
    else:
        loss = float("nan")
    info = {
        "steps": steps,
        "batch_size": batch_size,
        "model": f"ConcatSquashMLP 64-{width}-{width}-64 (tanh), t1=0.5, Tsit5 at 1e-3",
        "final_training_loss": loss,
        "training_seconds": time.perf_counter() - start,
    }
    return flow, jnp.asarray(test), info


@eqx.filter_jit
def _draws(operator, estimator, keys):
    return jax.vmap(lambda k: cnftrace.trace(operator, estimator=estimator, key=k))(
        keys
    )


def spectrum(operator):
    """The exact trace, Frobenius norm and leading singular values of an operator."""
    sv = np.linalg.svd(
        np.asarray(lx.materialise(operator).as_matrix()), compute_uv=False
    )
    return {
        "size": int(sv.size),
        "trace": float(cnftrace.trace(operator)),
        "frobenius": float(np.linalg.norm(sv)),
        "singular_values": [float(v) for v in sv[:24]],
    }


def measure(label, operator, estimators, budgets, num_keys, key):
    """Rows of statistics for every estimator and budget on one operator."""
    exact = float(cnftrace.trace(operator))
    rows = []
    for budget in budgets:
        keys = jr.split(jr.fold_in(key, budget), num_keys)
        start = time.perf_counter()
        for name, make in estimators:
            draws = np.asarray(_draws(operator, make(budget), keys))
            mean, var = float(draws.mean()), float(draws.var(ddof=1))
            se = math.sqrt(var / num_keys)
            rows.append(
                {
                    "budget": budget,
                    "estimator": name,
                    "exact": exact,
                    "mean": mean,
                    "variance": var,
                    "bias_over_se": (mean - exact) / se if se > 0 else 0.0,
                    "finite": bool(np.all(np.isfinite(draws))),
                }
            )
        seconds = time.perf_counter() - start
        print(f"  {label}, budget {budget}: {seconds:.1f} s", flush=True)
    return rows


def markdown(report) -> str:
    names = list(dict.fromkeys(row["estimator"] for row in report["rows"]))
    variances = []
    by_key = {}
    for row in report["rows"]:
        by_key.setdefault((row["operator"], row["budget"]), []).append(row)
    for (operator, budget), rows in by_key.items():
        base = rows[0]["variance"]  # Hutchinson's, the first estimator
        cells = [f"{base:.3g}"]
        for row in rows[1:]:
            cells.append(f"{row['variance']:.3g} ({row['variance'] / base:.2g}x)")
        worst = max(abs(r["bias_over_se"]) for r in rows)
        variances.append(
            [operator, f"{rows[0]['exact']:.4g}", budget, *cells, f"{worst:.1f}"]
        )
    spectra = []
    for name, info in report["operators"].items():
        sv = info["singular_values"] + [0.0] * 20
        picked = [f"{sv[j - 1]:.2g}" for j in SINGULAR_VALUES]
        spectra.append(
            [name, info["size"], f"{info['trace']:.4g}", f"{info['frobenius']:.3g}"]
            + picked
        )
    cfg, cnf = report["config"], report["cnf"]
    trained = f"trained for {cnf['steps']} steps" if cnf["steps"] else "untrained"
    header = ["operator", "tr(A)", "B", *names, "max abs(bias)/SE"]
    spectrum_header = ["operator", "n", "tr(A)", "Frobenius"]
    spectrum_header += [f"σ{j}" for j in SINGULAR_VALUES]
    lines = [
        _common.markdown_table(header, variances, "l" + "r" * (len(header) - 1)),
        "",
        _common.markdown_table(
            spectrum_header, spectra, "l" + "r" * (len(spectrum_header) - 1)
        ),
        "",
        f"Empirical variance over {cfg['num_keys']} keys (ratio to Hutchinson with the "
        "same number of matrix-vector products in brackets); the last column is the "
        "largest distance, in standard errors, of an estimator's mean from the exact "
        "trace. The second table: each operator's leading singular values. CNF: "
        f"{cnf['model']}, {trained} (final training loss "
        f"{cnf['final_training_loss']:.1f} nats); its Jacobian is taken at test "
        "points at t = t1/2.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument("--out", default=_common.RESULTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--train-steps", type=int, default=1000, help="CNF training steps (full run)"
    )
    args = parser.parse_args(argv)
    estimators = ESTIMATORS
    if args.quick:  # every code path but training, in a few compilations
        estimators = ESTIMATORS[:1] + ESTIMATORS[3:4]  # Hutchinson, XTrace
        budgets, num_keys, size, points = (6,), 64, 20, 1
        cnf_settings = {"steps": 0, "batch_size": 16, "width": 16}
    else:
        budgets, num_keys, size, points = (6, 12, 24, 48), 2000, 100, 2
        cnf_settings = {"steps": args.train_steps, "batch_size": 128, "width": 64}
    start = time.perf_counter()
    key = jr.key(args.seed)
    k_low, k_flat, k_cnf, k_draws = jr.split(key, 4)
    flow, test, cnf_info = train_digits_cnf(k_cnf, **cnf_settings)
    print(
        f"CNF on the digits: {cnf_info['steps']} steps in "
        f"{cnf_info['training_seconds']:.0f} s; measuring...",
        flush=True,
    )
    operators = {
        "low-rank+noise": lx.MatrixLinearOperator(low_rank_plus_noise(k_low, size)),
        "flat": lx.MatrixLinearOperator(flat_spectrum(k_flat, size)),
    }
    t_half = 0.5 * flow.t1
    for i in range(points):
        operators[f"digits-cnf@x{i}"] = lx.JacobianLinearOperator(
            _field_at, test[i], (flow.vector_field, t_half)
        )
    rows = []
    for name, operator in operators.items():
        for row in measure(name, operator, estimators, budgets, num_keys, k_draws):
            rows.append({"operator": name, **row})
    report = {
        "config": {
            "budgets": list(budgets),
            "num_keys": num_keys,
            "seed": args.seed,
            "size": size,
            "quick": args.quick,
            "dtype": "float64",
        },
        "cnf": cnf_info,
        "operators": {name: spectrum(op) for name, op in operators.items()},
        "rows": rows,
        "seconds": time.perf_counter() - start,
    }
    table = markdown(report)
    _common.write_results(os.path.join(args.out, "trace_variance"), report, table)
    print(table)
    print(f"({report['seconds']:.0f} s; written to {args.out})")
    return report


if __name__ == "__main__":
    main()
