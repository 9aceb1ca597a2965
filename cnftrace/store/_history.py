"""Step-keyed JSON-lines logs: `fit`'s history file (`history.jsonl` beside its
checkpoints, or the command line's `RUN_DIR/metrics.jsonl`).

One JSON record per line, each with its `step`; on resume a log is cut back to the
checkpoint's step (`truncate`). A line that is not a record of a step, or repeats a
recorded step (of the same kind), is skipped and reported in one warning; the first
record of a step is the one kept. A torn last line is dropped silently.
"""

import json
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

from .._io import atomic_write, read_regular_file

HISTORY_NAME = "history.jsonl"
BASE_NAMES = ("step", "loss", "nfe", "nfe_backward", "seconds", "skipped")
VAL_NAMES = ("val_step", "val_nll", "val_stderr")


def warn_stderr(message: str) -> None:
    print(message, file=sys.stderr)


def read_records(
    path: str,
    *,
    needed: tuple[str, ...] = BASE_NAMES,
    warn: Callable[[str], None] = warn_stderr,
) -> list[dict[str, Any]]:
    """The records of the log at `path` (none if it does not exist), in file order:
    a training record holds a number for each of `needed`, a validation record (a
    `val_nll` and no `loss`) a number for `val_nll`, and every value of either is a
    number (or null). Other lines, and a repeat of a step's record, are skipped with
    one call of `warn` (see the module's docstring)."""
    try:
        data = read_regular_file(path)
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the newline that ends the file
    records, seen, skipped = [], set(), []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record, reason = _parsed(line, needed)
        if record is not None and (_kind(record), record["step"]) in seen:
            record, reason = None, f"it repeats step {record['step']}"
        if record is not None:
            seen.add((_kind(record), record["step"]))
            records.append(record)
        elif not (number == len(lines) and not data.endswith(b"\n")):
            skipped.append((number, reason))  # (a torn last line goes unsaid)
    if skipped:
        (first, reason), n = skipped[0], len(skipped)
        if n == 1:
            warn(f"{path}: line {first} is not a record of a step ({reason}); skipped.")
        else:
            warn(
                f"{path}: {n} lines are not records of a step and are skipped, the "
                f"first at line {first} ({reason})."
            )
    return records


def _parsed(line: bytes, needed: tuple[str, ...]) -> tuple[dict | None, str]:
    """`(record, "")` for a line that is a record, `(None, why not)` otherwise."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None, "not JSON"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    if type(record.get("step")) is not int:
        return None, "no integer step"
    names = ("val_nll",) if _kind(record) == "validation" else needed
    missing = [name for name in names if name not in record]
    if missing:
        return None, f"no {', '.join(missing)}"
    for name, value in record.items():
        if not (type(value) in (int, float) or (value is None and name not in names)):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            return None, f"its {name} is {shown}, not a number"
    return record, ""


def _kind(record: dict) -> str:
    return "validation" if "val_nll" in record and "loss" not in record else "train"


def dedupe(records: Iterable[dict]) -> list[dict]:
    """The first record of each step (of each kind: training or validation), in
    step order."""
    first: dict[tuple[str, int], dict] = {}
    for r in records:
        first.setdefault((_kind(r), r["step"]), r)
    return [first[k] for k in sorted(first, key=lambda k: (k[1], k[0]))]


def truncate(path: str, step: int) -> list[dict]:
    """Cuts the log at `path` back to its records of steps up to `step` (each step
    once; the lines `read_records` skips are dropped), atomically, and returns them."""
    records = dedupe(r for r in read_records(path) if r["step"] <= step)
    if records or os.path.lexists(path):
        atomic_write(path, b"".join(_line(r) for r in records))
    return records


def _line(record: dict) -> bytes:
    return json.dumps(record).encode() + b"\n"


class Log:
    """Appends records to a log file, one line each, flushed at once; `sync` also
    fsyncs (before a checkpoint is written, so that the log covers it). With
    `path=None` it writes nothing."""

    def __init__(self, path: str | None):
        self.path = path
        self.file = None

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        if self.file is None:
            self.file = open(self.path, "ab")
        self.file.write(_line(record))
        self.file.flush()

    def sync(self) -> None:
        if self.file is not None:
            os.fsync(self.file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def empty_history() -> dict[str, list]:
    return {n: [] for n in BASE_NAMES + VAL_NAMES}


def append_train(history: dict[str, list], record: dict[str, Any]) -> dict:
    """`history` with a training record appended (a new metric of the objective's
    gets a column before validation's)."""
    new = [name for name in record if name not in history]
    if new:
        names = [n for n in history if n not in VAL_NAMES] + new + list(VAL_NAMES)
        history = {n: history.get(n, []) for n in names}
    for name, value in record.items():
        history[name].append(value)
    return history


def append_validation(history: dict[str, list], step: int, mean, stderr) -> None:
    history["val_step"].append(step)
    history["val_nll"].append(mean)
    history["val_stderr"].append(stderr)


def history_from_records(records: Iterable[dict]) -> dict[str, list]:
    """`fit`'s history (a dict of lists) from its log's records."""
    history = empty_history()
    for r in records:
        if _kind(r) == "validation":
            append_validation(history, r["step"], r["val_nll"], r.get("val_stderr"))
        else:
            history = append_train(history, r)
    return history
