"""Shared pieces of the reproduction scripts: where results go, how they are written
(atomically: a report or a figure is never left half-written), and a markdown table
writer. Everything else they need is cnftrace's public API (`cnftrace.mlp_flow`,
`cnftrace.warmup_cosine_adam`, `cnftrace.log_prob_batched`, `cnftrace.save`, ...).

The scripts run from the repository root as `python -m experiments.<name>`.
"""

import json
import math
import os
import platform
import sys
import tempfile
import time

import jax
import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def mean_and_stderr(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    stderr = values.std(ddof=1) / math.sqrt(values.size) if values.size > 1 else 0.0
    return float(values.mean()), float(stderr)


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


def _readable_temp(directory: str, suffix: str = "") -> tuple[int, str]:
    """`tempfile.mkstemp` in `directory`, with the mode of a file opened normally
    (mkstemp's 0600 would otherwise stay on the renamed result)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=suffix)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return fd, tmp


def atomic_write(path: str, data: bytes) -> None:
    """Writes `data` to `path` by way of a temporary file beside it and a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = _readable_temp(directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def atomic_savefig(fig, path: str, **kwargs) -> None:
    """Saves a matplotlib figure to `path` by way of a temporary file and a rename."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    suffix = os.path.splitext(path)[1] or ".png"
    fd, tmp = _readable_temp(directory, suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, **kwargs)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_results(stem: str, payload: dict, markdown: str) -> None:
    """Writes `<stem>.json` and `<stem>.md`, each atomically (temp file, fsync,
    rename)."""
    payload = dict(payload, environment=environment())
    atomic_write(stem + ".json", json.dumps(payload, indent=2).encode())
    atomic_write(stem + ".md", markdown.encode())


def progress() -> bool:
    """Show progress bars only on a terminal."""
    return sys.stderr.isatty()
