"""Runs a Python script as `python SCRIPT` would (as `__main__`, from its own
directory), then reports what it ran under and left behind: JAX's settings in the
process, and the dtype, shape and finiteness of the `samples` and the parameters of
the `flow` the script defined. test_user_lane.py runs the README's first example
through it, unchanged, and reads the example's own printed output.

    python run_and_report.py SCRIPT

prints the script's output, then the report as one JSON line;
user_lane_checks.py calls `run_and_report` first in its process.
"""

import contextlib
import io
import json
import os
import runpy
import sys

import equinox as eqx
import jax
import numpy as np


def run_and_report(script: str) -> dict:
    """Runs `script`; the report, with the script's stdout under "stdout"."""
    script = os.path.abspath(script)
    argv, path = sys.argv, list(sys.path)
    sys.argv = [script]
    sys.path.insert(0, os.path.dirname(script))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            namespace = runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    samples = np.asarray(namespace["samples"])
    flow = namespace["flow"]
    params = jax.tree_util.tree_leaves(eqx.filter(flow, eqx.is_inexact_array))
    return {
        "stdout": out.getvalue(),
        "x64": bool(jax.config.read("jax_enable_x64")),
        "disable_most_optimizations": bool(
            jax.config.read("jax_disable_most_optimizations")
        ),
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "sample_dtype": str(namespace["samples"].dtype),
        "sample_shape": list(samples.shape),
        "sample_finite": bool(np.all(np.isfinite(samples))),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "last_step": namespace["history"]["step"][-1],
    }


if __name__ == "__main__":
    report = run_and_report(sys.argv[1])
    print(report.pop("stdout"), end="")
    print(json.dumps(report))
