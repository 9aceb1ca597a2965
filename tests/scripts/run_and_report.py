"""Runs a Python script as `python SCRIPT` would (as `__main__`, from its own
directory), then prints one JSON line on what it ran under and left behind: JAX's
settings in the process, and the dtype, shape and finiteness of the `samples` and
the parameters of the `flow` the script defined. test_user_lane.py runs the README's
first example through it, unchanged, and reads the example's own printed output
above that line.

    python run_and_report.py SCRIPT
"""

import json
import os
import runpy
import sys

import equinox as eqx
import jax
import numpy as np

script = os.path.abspath(sys.argv[1])
sys.argv = [script]
sys.path.insert(0, os.path.dirname(script))
namespace = runpy.run_path(script, run_name="__main__")

samples = np.asarray(namespace["samples"])
params = jax.tree_util.tree_leaves(eqx.filter(namespace["flow"], eqx.is_inexact_array))
print(
    json.dumps(
        {
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
    )
)
