"""Shared pieces of the reproduction scripts: where results go, how they are written
(atomically: a report is never left half-written), exact-trace evaluation in chunks,
the optimiser schedule, and a markdown table writer.

The scripts run as `python experiments/<name>.py`, so this module is imported as
`_common` from the scripts' own directory.
"""

import json
import math
import os
import platform
import sys
import time

import jax
import numpy as np
import optax

import cnftrace
from cnftrace._checkpoint import _atomic_write
from cnftrace._train import log_prob_and_stats

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def exact_log_prob(flow, x, *, chunk: int = 1000, context=None):
    """Per-sample log-densities of `x` with the **exact** trace, evaluated `chunk`
    samples at a time, and the mean NFE per solve. Returns `(logp, nfe)` as a NumPy
    array and a float."""
    flow = flow.with_estimator(cnftrace.Exact())
    out, nfe = [], []
    for start in range(0, x.shape[0], chunk):
        ctx = None if context is None else context[start : start + chunk]
        lp, stats = log_prob_and_stats(flow, x[start : start + chunk], None, ctx)
        out.append(np.asarray(lp))
        nfe.append(float(stats.total_nfe))
    return np.concatenate(out), float(np.mean(nfe))


def mean_and_stderr(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    stderr = values.std(ddof=1) / math.sqrt(values.size) if values.size > 1 else 0.0
    return float(values.mean()), float(stderr)


def warmup_cosine_adam(
    steps: int, lr: float, *, clip: float = 10.0, weight_decay: float = 0.0
):
    """Adam (AdamW if `weight_decay`) with a short linear warmup and a cosine decay
    to `lr / 20`, after clipping the gradient's global norm at `clip`."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, min(50, steps // 4), max(steps, 2), end_value=lr / 20
    )
    opt = (
        optax.adamw(schedule, weight_decay=weight_decay)
        if weight_decay
        else optax.adam(schedule)
    )
    return optax.chain(optax.clip_by_global_norm(clip), opt)


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def environment() -> dict:
    """What the figures were measured on."""
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_results(stem: str, payload: dict, markdown: str) -> None:
    """Writes `<stem>.json` and `<stem>.md`, each atomically (temp file, fsync,
    rename)."""
    payload = dict(payload, environment=environment())
    _atomic_write(stem + ".json", json.dumps(payload, indent=2).encode())
    _atomic_write(stem + ".md", markdown.encode())


def progress() -> bool:
    """Show progress bars only on a terminal."""
    return sys.stderr.isatty()
