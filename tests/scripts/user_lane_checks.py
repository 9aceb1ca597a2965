"""The float32 checks of the user lane (test_user_lane.py), in one process that the
test starts with a user's environment: JAX's settings as a user gets them, so
float32 and XLA's full optimisation. One process for all of them, since starting
JAX and compiling is most of what each check costs.

    python user_lane_checks.py README_SCRIPT RUN_DIR N_EVAL N_SAMPLE

README_SCRIPT is the README's first example, run first, as `python README_SCRIPT`
runs it (run_and_report.py). RUN_DIR is a run of `cnftrace train` on 8gaussians:
the process then runs the command line's `eval RUN_DIR --n N_EVAL` and
`sample RUN_DIR --n N_SAMPLE` (`cnftrace.cli.main`, as the installed command calls
it; each loads the run from its directory). It prints one JSON line: the example's
report and output, the two commands' output, the process's JAX settings, the
divergence and trace of functions and operators whose values are known in closed
form (each with its reference computed in float64 by NumPy), and what
`cnftrace.load(RUN_DIR)` gives back (with `sample`'s samples in
RUN_DIR/samples.npy). The evaluation and the samples of `load`'s flow are the
commands' programs again, compiled once.
"""

import contextlib
import io
import json
import os
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import lineax as lx
import numpy as np
from run_and_report import run_and_report

import cnftrace
from cnftrace.cli import main
from cnftrace.datasets import toy_sample

# Hutchinson's estimate of a linear map's divergence, drawn this many times.
DRAWS = 4000


def command(argv: list[str]) -> str:
    """`cnftrace ARGV` as the installed command runs it; its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    assert status == 0, (argv, status)
    return out.getvalue()


def settings() -> dict:
    return {
        "x64": bool(jax.config.read("jax_enable_x64")),
        "disable_most_optimizations": bool(
            jax.config.read("jax_disable_most_optimizations")
        ),
        "default_float": str(jnp.zeros(()).dtype),
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def divergences() -> dict:
    # A linear map `A @ y`, whose divergence is tr(A) at every point; the shift of
    # the diagonal keeps the trace well away from zero, so that a relative
    # tolerance means something.
    a = jr.normal(jr.key(0), (6, 6)) + 2 * jnp.eye(6)
    y = jr.normal(jr.key(1), (6,))
    linear = lambda y: a @ y  # noqa: E731
    fy, exact = jax.jit(lambda y: cnftrace.divergence(linear, y))(y)

    def hutchinson(sampler):
        estimator = cnftrace.Hutchinson(sampler=sampler)
        one = lambda k: cnftrace.divergence(linear, y, estimator=estimator, key=k)[1]  # noqa: E731
        draws = np.asarray(jax.jit(jax.vmap(one))(jr.split(jr.key(2), DRAWS)))
        return {
            "dtype": str(draws.dtype),
            "mean": float(draws.astype(np.float64).mean()),
            "stderr": float(draws.astype(np.float64).std(ddof=1) / np.sqrt(DRAWS)),
        }

    # tanh acts on each entry alone: its divergence is the sum of its derivatives.
    z = 1.5 * jr.normal(jr.key(3), (7,))
    tanh_fz, tanh_div = cnftrace.divergence(jnp.tanh, z)
    z64 = np.asarray(z, np.float64)
    a64 = np.asarray(a, np.float64)
    return {
        "linear": {
            "exact": float(exact),
            "dtype": str(exact.dtype),
            "fy_error": float(np.abs(np.asarray(fy, np.float64) - a64 @ y).max()),
            "trace": float(np.trace(a64)),
            "scale": float(np.abs(np.diag(a64)).sum()),
            "rademacher": hutchinson("rademacher"),
            "gaussian": hutchinson("gaussian"),
        },
        "tanh": {
            "exact": float(tanh_div),
            "dtype": str(tanh_div.dtype),
            "fy_error": float(np.abs(np.asarray(tanh_fz) - np.tanh(z64)).max()),
            "closed_form": float(np.sum(1 - np.tanh(z64) ** 2)),
        },
    }


def traces() -> dict:
    a = jr.normal(jr.key(4), (5, 5)) + 3 * jnp.eye(5)
    matrix = cnftrace.trace(lx.MatrixLinearOperator(a))
    # The Jacobian of sin at x is diag(cos x).
    x = jr.normal(jr.key(5), (5,))
    jacobian = cnftrace.trace(lx.JacobianLinearOperator(lambda x, _: jnp.sin(x), x))
    return {
        "matrix": float(matrix),
        "matrix_dtype": str(matrix.dtype),
        "jnp_trace": float(jnp.trace(a)),
        "matrix_closed_form": float(np.trace(np.asarray(a, np.float64))),
        "jacobian": float(jacobian),
        "jacobian_dtype": str(jacobian.dtype),
        "jacobian_closed_form": float(np.cos(np.asarray(x, np.float64)).sum()),
    }


def loaded(run_dir: str) -> dict:
    flow, info = cnftrace.load(run_dir, return_info=True)
    x = toy_sample("8gaussians", jr.key(6), 2000)
    logp = flow.log_prob(x)
    nll = cnftrace.evaluate_nll(flow, x)
    # As `cnftrace sample RUN_DIR` draws them (its --seed 0).
    cli_samples = np.load(os.path.join(run_dir, "samples.npy"))
    samples = flow.sample(jr.key(0), cli_samples.shape[0])
    params = jax.tree_util.tree_leaves(eqx.filter(flow, eqx.is_inexact_array))
    return {
        "step": info["step"],
        "width": info["config"]["width"],
        "data_dtype": str(x.dtype),
        "logp_dtype": str(logp.dtype),
        "logp_finite": bool(np.all(np.isfinite(np.asarray(logp)))),
        "nll": nll.mean,
        "stderr": nll.stderr,
        "sample_dtype": str(samples.dtype),
        "sample_shape": list(samples.shape),
        "sample_finite": bool(np.all(np.isfinite(np.asarray(samples)))),
        "sample_vs_cli": float(np.abs(np.asarray(samples) - cli_samples).max()),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
    }


if __name__ == "__main__":
    readme, run_dir, n_eval, n_sample = sys.argv[1:5]
    report = {
        "readme": run_and_report(readme),
        "settings": settings(),
        "stdout": {
            "eval": command(["eval", run_dir, "--n", n_eval]),
            "sample": command(["sample", run_dir, "--n", n_sample]),
        },
        "divergence": divergences(),
        "trace": traces(),
        "load": loaded(run_dir),
    }
    print(json.dumps(report))
