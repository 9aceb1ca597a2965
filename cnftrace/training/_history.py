"""Step-keyed JSON-lines logs: `fit`'s history file beside its checkpoints and the
command line's `metrics.jsonl`.

One JSON record per line, each with its `step`. A process killed after its last
checkpoint leaves records of steps that the resumed run takes again, so on resume a
log is cut back to the checkpoint's step (`truncate`) and every step is in it exactly
once. Readers also keep only the last record of a step (`dedupe`), for logs written
before that rule. A torn last line (a kill mid-write) is dropped.
"""

import json
import os
from collections.abc import Iterable
from typing import Any

from .._io import atomic_write, read_regular_file

HISTORY_NAME = "history.jsonl"
BASE_NAMES = ("step", "loss", "nfe", "nfe_backward", "seconds", "skipped")
VAL_NAMES = ("val_step", "val_nll", "val_stderr")


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of the log at `path` (none if it does not exist), in file order;
    lines that are not a JSON object with an integer `step` are dropped."""
    try:
        data = read_regular_file(path)
    except FileNotFoundError:
        return []
    records = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict) and type(record.get("step")) is int:
            records.append(record)
    return records


def _kind(record: dict) -> str:
    return "validation" if "val_nll" in record and "loss" not in record else "train"


def dedupe(records: Iterable[dict]) -> list[dict]:
    """The last record of each step (of each kind: training or validation), in step
    order."""
    last = {(_kind(r), r["step"]): r for r in records}
    return [last[k] for k in sorted(last, key=lambda k: (k[1], k[0]))]


def truncate(path: str, step: int) -> list[dict]:
    """Cuts the log at `path` back to its records of steps up to `step` (each step
    once) and returns them."""
    records = dedupe(r for r in read_records(path) if r["step"] <= step)
    if records or os.path.lexists(path):
        rewrite(path, records)
    return records


def rewrite(path: str, records: Iterable[dict]) -> None:
    """Replaces the log at `path` with `records`, atomically."""
    atomic_write(path, b"".join(_line(r) for r in records))


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


def records_from_history(history: dict[str, list]) -> list[dict]:
    """The log's records of a history (a dict of lists), in step order."""
    train = [n for n in history if n not in VAL_NAMES]
    records = [dict(zip(train, values)) for values in zip(*(history[n] for n in train))]
    for step, mean, stderr in zip(*(history.get(n, []) for n in VAL_NAMES)):
        records.append({"step": step, "val_nll": mean, "val_stderr": stderr})
    return dedupe(records)
