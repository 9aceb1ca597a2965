"""Two training steps (`fit`) and one chunked evaluation of a tiny flow, in a process
of its own, with the compilation cache on (`enable_compilation_cache(argv[1])`).
Prints one JSON line: the programs JAX compiled and those it loaded from the cache,
the losses, and how often the training step's gradient was traced (JAX's cache
holds compiled programs: a process traces its step even where it loads it)."""

import functools
import json
import logging
import re
import sys

import jax
import jax.random as jr

import cnftrace
from cnftrace.training import _trainer


class _Programs(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.loaded, self.missed = [], []

    def emit(self, record):
        message = record.getMessage()
        name = re.search(r"for '([^']+)'", message)
        if name and message.startswith("Persistent compilation cache hit"):
            self.loaded.append(name.group(1))
        elif name and message.startswith("PERSISTENT COMPILATION CACHE MISS"):
            self.missed.append(name.group(1))


programs = _Programs()
logger = logging.getLogger("jax._src.compiler")
logger.setLevel(logging.DEBUG)
logger.addHandler(programs)

# Each trace of the step's gradient.
traced = []
_gradient = _trainer._gradient


@functools.wraps(_gradient)
def _counting(*args, **kwargs):
    traced.append(1)
    return _gradient(*args, **kwargs)


_trainer._gradient = _counting

directory = cnftrace.enable_compilation_cache(sys.argv[1])
flow = cnftrace.CNF(cnftrace.MLPField(2, width=4, depth=1, key=jr.key(0)), 2)
# A data function: its batches are checked in the step, by a flag, not a callback.
trained, history = cnftrace.fit(
    flow,
    lambda k, n: jr.normal(k, (n, 2)),
    key=jr.key(1),
    steps=2,
    batch_size=8,
    log_every=1,
    progress=False,
)
logp = cnftrace.log_prob_batched(trained, jr.normal(jr.key(2), (6, 2)), batch_size=6)
print(
    json.dumps(
        {
            "directory": directory,
            "cache_dir": jax.config.jax_compilation_cache_dir,
            "loaded": programs.loaded,
            "missed": programs.missed,
            "finite": bool(abs(logp).max() < 1e6),
            "losses": [float(v) for v in history["loss"]],
            "traced": len(traced),
        }
    )
)
