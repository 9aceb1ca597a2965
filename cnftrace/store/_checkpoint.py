"""Training checkpoints: equinox serialisation behind a small, checksummed header.

A file is `cnftrace-checkpoint 2 <header bytes> <payload bytes> <sha256>\\n`, a JSON
header (step, config, the leaves' shapes and dtypes, the caller's counters), then
what `equinox.tree_serialise_leaves` writes. Reading trusts nothing: regular files
only, reads bounded by the declared sizes, the checksum and every array record's
shape and dtype checked before anything is deserialised; each failure is a
`CheckpointError`. Pruning keeps the newest `keep` files that load.
"""

import contextlib
import hashlib
import io
import json
import math
import os
import re
import stat
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._io import FileKindError, atomic_write, open_regular, read_exactly
from ._history import warn_stderr

FORMAT_VERSION = 2
_MAGIC = "cnftrace-checkpoint"
_NAME = re.compile(r"^step_(\d{9})\.ckpt$")
# Bounds on what a reader accepts before it has checked anything.
_FIRST_LINE_LIMIT = 256
_HEADER_LIMIT = 64 * 2**20


class CheckpointError(RuntimeError):
    """A checkpoint is unreadable, corrupted, or belongs to another configuration.

    [`fit`][cnftrace.fit] raises it for a checkpoint written under another `config`
    (naming the differing entries) or a directory another process trains in; it
    reports and skips corrupted files. [`load`][cnftrace.load] raises it for a file
    or run directory it cannot read.

    !!! example

        ```python
        try:
            raise cnftrace.CheckpointError("written under another config")
        except cnftrace.CheckpointError as e:
            print(f"cannot resume: {e}")  # start a fresh run directory instead
        ```
    """


class _ConfigMismatch(CheckpointError):
    """The checkpoint is sound but was written under another config: never skipped."""


def _leaf_specs(tree) -> list[list]:
    leaves = jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    return [[list(x.shape), str(x.dtype)] for x in leaves]


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:09d}.ckpt")


def list_checkpoints(directory: str) -> list[tuple[int, str]]:
    """`(step, path)` of the entries named like checkpoints in `directory`, oldest
    first (names only, unchecked)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found)


def _digest(first: bytes, header: bytes, payload: bytes) -> str:
    h = hashlib.sha256(first)
    h.update(header)
    h.update(payload)
    return h.hexdigest()


def encode_checkpoint(header: dict[str, Any], payload: bytes) -> bytes:
    """The bytes of a format-2 checkpoint file."""
    head = json.dumps(header, sort_keys=True).encode()
    first = f"{_MAGIC} {FORMAT_VERSION} {len(head)} {len(payload)} ".encode()
    return first + _digest(first, head, payload).encode() + b"\n" + head + payload


def save_checkpoint(
    directory: str,
    step: int,
    state,
    config: dict[str, Any],
    *,
    keep: int = 3,
    extra: dict[str, Any] | None = None,
) -> str:
    """Writes `state` (a pytree) as the checkpoint of `step`, with the small JSON
    values `extra` in its header, and `prune`s the directory. Returns the path."""
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, state)
    header = {"step": int(step), "config": config, "leaves": _leaf_specs(state)}
    header |= extra or {}
    path = checkpoint_path(directory, step)
    atomic_write(path, encode_checkpoint(header, buffer.getvalue()), ".ckpt")
    prune(directory, keep, state, config)
    return path


def prune(directory: str, keep: int, like, config) -> list[str]:
    """Deletes all but the newest `keep` checkpoints that load into `like` under
    `config`, the unreadable regular files older than the newest of those, and the
    temporary files of a killed writer; leaves other configs' files alone. Returns
    the deleted checkpoint paths."""
    good, bad = [], []
    for name in os.listdir(directory):
        if name.startswith(".tmp-") and name.endswith(".ckpt"):
            with contextlib.suppress(OSError):  # the caller holds the lock
                os.remove(os.path.join(directory, name))
    for step, path in list_checkpoints(directory):
        try:
            _verified(path, like, config)
        except _ConfigMismatch:
            continue  # another run's: not ours to delete
        except CheckpointError:
            if os.path.lexists(path) and stat.S_ISREG(os.lstat(path).st_mode):
                bad.append((step, path))
        except FileNotFoundError:
            continue
        else:
            good.append((step, path))
    if not good:
        return []
    newest = good[-1][0]
    doomed = [p for _, p in good[:-keep]] + [p for s, p in bad if s < newest]
    for path in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    return doomed


def read_header(path: str) -> tuple[dict, bytes]:
    """Reads and verifies a checkpoint file; returns `(header, payload)`."""
    try:
        with open_regular(path) as (fd, size):
            if size == 0:
                raise CheckpointError(f"{path} is empty.")
            start = os.read(fd, min(size, _FIRST_LINE_LIMIT))
            if not start.startswith(_MAGIC.encode() + b" "):
                raise CheckpointError(
                    f"{path} is not a cnftrace checkpoint (bad header)."
                )
            header, payload = _read_body(fd, size, start, path)
    except FileKindError as e:  # not a regular file, or truncated
        raise CheckpointError(str(e)) from None
    if not isinstance(header.get("step"), int) or "leaves" not in header:
        raise CheckpointError(f"{path} is not a cnftrace checkpoint (bad header).")
    match = _NAME.match(os.path.basename(path))
    if match and int(match.group(1)) != header["step"]:
        raise CheckpointError(
            f"{path} says it holds step {header['step']}, but its name says "
            f"{int(match.group(1))}: it was edited or renamed."
        )
    return header, payload


def _read_body(fd: int, size: int, start: bytes, path: str) -> tuple[dict, bytes]:
    first, newline, rest = start.partition(b"\n")
    fields = first.split(b" ")
    if not newline or len(fields) != 5:
        raise CheckpointError(f"{path} is not a cnftrace checkpoint (bad first line).")
    try:
        version, n_header, n_payload = (int(f) for f in fields[1:4])
        digest = fields[4].decode("ascii")
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError(
            f"{path} is not a cnftrace checkpoint (bad first line)."
        ) from None
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {version}; this version of cnftrace reads "
            f"format {FORMAT_VERSION}."
        )
    expected = len(first) + 1 + n_header + n_payload
    if n_header < 0 or n_payload < 0 or n_header > _HEADER_LIMIT or size != expected:
        raise CheckpointError(
            f"{path} is truncated or padded: {size} bytes where its first line "
            f"declares {expected}."
        )
    body = rest + read_exactly(fd, n_header + n_payload - len(rest), path)
    head, payload = body[:n_header], body[n_header:]
    prefix = first[: len(first) - len(fields[4])]
    if _digest(prefix, head, payload) != digest:
        raise CheckpointError(f"{path} is corrupted: its checksum does not match.")
    try:
        header = json.loads(head)
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a cnftrace checkpoint (bad header).")
    return header, payload


def same_value(a, b) -> bool:
    """`a == b` for config values, where NaN equals NaN (recursively)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def config_mismatch(saved: dict, current: dict) -> list[str]:
    """The config keys whose values differ, as readable lines."""
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
        for k in keys
        if not same_value(saved.get(k), current.get(k))
    ]


def check_payload(payload: bytes, like, path: str) -> None:
    """A `CheckpointError` naming the first leaf that does not fit, unless `payload`
    is one NumPy array record per array leaf of `like`, of its shape and dtype, and
    nothing else (reading the records' headers only)."""
    f = io.BytesIO(payload)
    leaves = [x for x in jax.tree_util.tree_leaves(like) if eqx.is_array_like(x)]
    for i, leaf in enumerate(leaves):
        where = f"{path}: array {i + 1} of {len(leaves)}"
        try:
            version = np.lib.format.read_magic(f)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(f)
        except (ValueError, EOFError, SyntaxError, TypeError):
            raise CheckpointError(f"{where} is not a NumPy array record.") from None
        if dtype.hasobject:
            raise CheckpointError(
                f"{where} holds Python objects (a pickle), not numbers; it is not read."
            )
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            want = np.dtype(leaf.dtype)
            # Extended dtypes (bfloat16, ...) are saved as raw bytes of their size.
            raw = want.kind == "V" and dtype.itemsize == want.itemsize
            same = dtype == want or raw
            if tuple(shape) != tuple(np.shape(leaf)) or not same:
                raise CheckpointError(
                    f"{where} has shape {tuple(shape)} and dtype {dtype}, where this "
                    f"model and optimiser hold shape {tuple(np.shape(leaf))} and dtype "
                    f"{want} (was it written for another architecture, or by another "
                    "version of cnftrace?)."
                )
        elif tuple(shape) != ():
            raise CheckpointError(f"{where} should be a scalar; it has shape {shape}.")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > len(payload) - f.tell():
            raise CheckpointError(f"{where} is cut short.")
        f.seek(nbytes, io.SEEK_CUR)
    if f.tell() != len(payload):
        raise CheckpointError(
            f"{path} holds {len(payload) - f.tell()} bytes after its last array: it "
            "was written for another model or optimiser."
        )


def deserialise(payload: bytes, like, path: str):
    """`like` filled from `payload`, after `check_payload`."""
    check_payload(payload, like, path)
    try:
        return eqx.tree_deserialise_leaves(io.BytesIO(payload), like)
    except Exception as e:  # what check_payload cannot foresee, as one message
        raise CheckpointError(f"{path} cannot be loaded: {e}") from None


def load_checkpoint(path: str, like, config: dict[str, Any] | None = None):
    """`(step, state)`: the checkpoint at `path` loaded into the structure of
    `like`; a `CheckpointError` if it is corrupted or `config` differs from its."""
    header, payload = _verified(path, like, config)
    return header["step"], deserialise(payload, like, path)


def _verified(path: str, like, config) -> tuple[dict, bytes]:
    """`(header, payload)` of a checkpoint that fits `like` and `config`, checked
    down to every array record's shape and dtype, but not deserialised."""
    header, payload = read_header(path)
    if config is not None:
        saved = header.get("config")
        saved = saved if isinstance(saved, dict) else {}
        diffs = config_mismatch(saved, config)
        if diffs:
            raise _ConfigMismatch(
                f"{path} was written by a run with another configuration:\n  "
                + "\n  ".join(diffs)
                + "\nResume with the same settings, or start a new run directory."
            )
    if header["leaves"] != _leaf_specs(like):
        raise CheckpointError(
            f"{path} holds arrays of other shapes or dtypes than this model and "
            "optimiser (was it written for another architecture, or by another version "
            "of cnftrace?)."
        )
    check_payload(payload, like, path)
    return header, payload


def latest_good_checkpoint(directory: str, like, config=None, *, warn=None):
    """`(step, state, header)` of the newest checkpoint in `directory` that loads,
    or `None`; the others are reported to `warn` (stderr by default) and skipped,
    but a config mismatch raises."""
    warn = warn_stderr if warn is None else warn
    for _, path in reversed(list_checkpoints(directory)):
        try:
            header, payload = _verified(path, like, config)
            state = deserialise(payload, like, path)
        except _ConfigMismatch:
            raise
        except CheckpointError as e:
            warn(f"skipping checkpoint: {e}")
            continue
        except FileNotFoundError:
            continue  # removed since the listing
        except OSError as e:
            warn(f"skipping checkpoint: {path} cannot be read: {e}")
            continue
        return header["step"], state, header
    return None


def key_to_data(key) -> jax.Array:
    return jax.random.key_data(key)
