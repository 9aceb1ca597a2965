"""Shared pieces of the reproduction scripts and benchmarks: where results go, the one
atomic writer (`atomic_write`: a report, a JSON file or a figure is never left
half-written), the one markdown table writer (`markdown_table`) and the one timer of a
call (`time_call`). Everything else they need is cnftrace's public API
(`cnftrace.mlp_flow`, `cnftrace.warmup_cosine_adam`, `cnftrace.log_prob_batched`,
`cnftrace.save`, ...).

The scripts run from the repository root as `python -m experiments.<name>`.
"""

import io
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def mean_and_stderr(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    stderr = values.std(ddof=1) / math.sqrt(values.size) if values.size > 1 else 0.0
    return float(values.mean()), float(stderr)


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence], align: str | None = None
) -> str:
    """A markdown table, its lines joined by newlines (no newline after the last).

    Cells are `str(cell)`; an empty cell is written `| |`. `align` has one letter per
    column, `l` (`---`) or `r` (`---:`); by default every column is `---`.
    """
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one 'l' or 'r' per column; got {align!r}.")

    def line(cells) -> str:
        return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"

    lines = [line(header), "|" + "".join({"l": "---|", "r": "---:|"}[a] for a in align)]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(header):
            raise ValueError(f"{len(header)} columns, but a row has {len(cells)}.")
        lines.append(line(cells))
    return "\n".join(lines)


def time_call(
    fn: Callable, *args, repeats: int = 7, min_seconds: float = 0.05
) -> tuple[float, float]:
    """`(wall, cpu)`: the medians over `repeats` of the wall and the process CPU
    seconds of one call of `fn(*args)` (for an even `repeats`, the upper of the two
    middle values).

    The first call (compilation) is not timed. With `min_seconds > 0`, each repeat
    runs the call often enough to last about `min_seconds`, so that short calls are
    not lost in timer noise; with 0, each repeat is one call. On a shared machine the
    CPU time (all threads of this process) is the steadier measure of the work done;
    the wall time is what a user waits.
    """
    jax.block_until_ready(fn(*args))

    def run(number: int) -> tuple[float, float]:
        cpu = time.process_time()
        wall = time.perf_counter()
        for _ in range(number):
            out = fn(*args)
        jax.block_until_ready(out)
        wall = time.perf_counter() - wall
        return wall, time.process_time() - cpu

    number = 1
    while min_seconds > 0 and number < 10_000:
        elapsed, _ = run(number)
        if elapsed >= min_seconds:
            break
        number *= max(2, min(10, math.ceil(min_seconds / max(elapsed, 1e-9))))
    runs = [run(number) for _ in range(repeats)]
    return (
        statistics.median_high(w for w, _ in runs) / number,
        statistics.median_high(c for _, c in runs) / number,
    )


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


def atomic_write(path: str, data: bytes) -> None:
    """Writes `data` to `path` by way of a temporary file beside it and a rename, so
    a killed script never leaves half a report or figure (no fsync: a result can be
    computed again). The file gets the mode of one opened normally, not mkstemp's
    0600. Makes the missing parent directories."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    umask = os.umask(0)
    os.umask(umask)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~umask)
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def figure_bytes(fig, format: str = "png", **kwargs) -> bytes:
    """A matplotlib figure rendered in memory (`fig.savefig` to a buffer), for
    `atomic_write`."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=format, **kwargs)
    return buffer.getvalue()


def write_results(stem: str, payload: dict, markdown: str) -> None:
    """Writes `<stem>.json` (`payload` and the `environment()`) and `<stem>.md`,
    each by `atomic_write` (a temporary file, then a rename)."""
    payload = dict(payload, environment=environment())
    atomic_write(stem + ".json", json.dumps(payload, indent=2).encode())
    atomic_write(stem + ".md", markdown.encode())


def progress() -> bool:
    """Show progress bars only on a terminal."""
    return sys.stderr.isatty()
