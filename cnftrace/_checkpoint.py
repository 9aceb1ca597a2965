"""Training checkpoints: equinox serialisation behind a small JSON header.

A checkpoint file is one JSON header line followed by the payload that
`equinox.tree_serialise_leaves` writes for the training state. The header records the
format version, the step, the run's config, the shapes and dtypes of the leaves and a
SHA-256 of the payload, so a truncated or corrupted file is detected before anything is
loaded. Files are written atomically (temporary file, fsync, rename) and only the
newest `keep` are kept.
"""

import hashlib
import io
import json
import os
import re
import tempfile
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

FORMAT_VERSION = 1
_MAGIC = "cnftrace-checkpoint"
_NAME = re.compile(r"^step_(\d{9})\.ckpt$")


class CheckpointError(RuntimeError):
    """A checkpoint is unreadable, corrupted, or belongs to another configuration.

    [`fit`][cnftrace.fit] raises it when its checkpoint directory holds a checkpoint
    written under another `config` (the message names the differing entries).
    Corrupted or truncated files, and files of another architecture, are reported and
    skipped instead: `fit` resumes from the newest good one, or starts afresh.
    [`load`][cnftrace.load] raises it for a file or run directory it cannot read.

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
    """`(step, path)` of the checkpoint files in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found)


def _default_mode(path: str) -> None:
    """mkstemp creates files private (0600); give `path` the mode of a file opened
    normally, under the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".ckpt")
    try:
        _default_mode(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_checkpoint(
    directory: str,
    step: int,
    state,
    config: dict[str, Any],
    *,
    keep: int = 3,
    history: dict | None = None,
) -> str:
    """Writes `state` (a pytree of arrays and static data) as the checkpoint of `step`
    and removes all but the newest `keep` checkpoints. Returns the file's path.
    `history` (JSON-serialisable) is stored in the header."""
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, state)
    payload = buffer.getvalue()
    header = {
        "magic": _MAGIC,
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "config": config,
        "leaves": _leaf_specs(state),
        "payload_bytes": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "history": history or {},
    }
    data = json.dumps(header, sort_keys=True).encode() + b"\n" + payload
    path = checkpoint_path(directory, step)
    _atomic_write(path, data)
    for _, old in list_checkpoints(directory)[:-keep]:
        os.remove(old)
    return path


def read_header(path: str) -> tuple[dict, bytes]:
    """Reads and verifies a checkpoint file; returns `(header, payload)`."""
    with open(path, "rb") as f:
        data = f.read()
    line, sep, payload = data.partition(b"\n")
    try:
        header = json.loads(line) if sep else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("magic") != _MAGIC:
        raise CheckpointError(f"{path} is not a cnftrace checkpoint (bad header).")
    if header.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {header.get('format_version')}; this "
            f"version of cnftrace reads format {FORMAT_VERSION}."
        )
    if len(payload) != header["payload_bytes"]:
        raise CheckpointError(
            f"{path} is truncated: {len(payload)} of {header['payload_bytes']} payload "
            "bytes."
        )
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise CheckpointError(f"{path} is corrupted: its checksum does not match.")
    return header, payload


def config_mismatch(saved: dict, current: dict) -> list[str]:
    """The config keys whose values differ, as readable lines."""
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: checkpoint has {saved.get(k)!r}, this run has {current.get(k)!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]


def load_checkpoint(path: str, like, config: dict[str, Any] | None = None):
    """Loads the checkpoint at `path` into the structure of `like`.

    Raises [`CheckpointError`][cnftrace.CheckpointError] if the file is corrupted, or
    if `config` is given and differs from the saved config (naming each mismatch).
    Returns `(step, state)`.
    """
    header, state = _load(path, like, config)
    return header["step"], state


def _load(path: str, like, config) -> tuple[dict, object]:
    header, payload = read_header(path)
    if config is not None:
        diffs = config_mismatch(header["config"], config)
        if diffs:
            raise _ConfigMismatch(
                f"{path} was written by a run with another configuration:\n  "
                + "\n  ".join(diffs)
                + "\nResume with the same settings, or start a new run directory."
            )
    if header["leaves"] != _leaf_specs(like):
        raise CheckpointError(
            f"{path} holds arrays of other shapes or dtypes than this model and "
            "optimiser (was it written for another architecture?)."
        )
    return header, eqx.tree_deserialise_leaves(io.BytesIO(payload), like)


def latest_good_checkpoint(directory: str, like, config=None, *, warn=print):
    """The newest checkpoint in `directory` that loads cleanly, skipping (and
    reporting) corrupted ones. A config mismatch is not skipped: it raises.
    Returns `(step, state, header)` or `None` when there is no usable checkpoint."""
    for _, path in reversed(list_checkpoints(directory)):
        try:
            header, state = _load(path, like, config)
        except _ConfigMismatch:
            raise
        except CheckpointError as e:
            warn(f"skipping checkpoint: {e}")
            continue
        return header["step"], state, header
    return None


def key_to_data(key) -> jax.Array:
    return jax.random.key_data(key)


def data_to_key(data) -> jax.Array:
    return jax.random.wrap_key_data(jnp.asarray(data))
