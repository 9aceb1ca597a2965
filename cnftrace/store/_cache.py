"""JAX's persistent compilation cache, on for the command line, the demo and the tests,
with its entries checked before JAX may run them (see `enable_compilation_cache`)."""

import atexit
import collections
import contextlib
import hashlib
import json
import os
import stat
import time
import warnings
import zlib

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

from .._io import atomic_write, open_regular, read_exactly, read_regular_file

try:  # JAX compresses with zstd where Python has it (as JAX looks for it), else zlib
    from compression import zstd as _zstd  # type: ignore[import-not-found]
except ImportError:
    try:
        import zstandard as _zstd  # type: ignore[import-not-found, no-redef]
    except ImportError:
        _zstd = None

OPT_OUT = "CNFTRACE_COMPILATION_CACHE"
"""The environment variable that turns the cache off: `0`, `off`, `false` or `no`."""

# Programs that compile faster than this cost about as much to read back.
MIN_COMPILE_SECONDS = 0.03
# The least recently used programs are deleted beyond this size.
MAX_BYTES = 2 * 1024**3
# The SHA-256 and signature of each entry when first seen, beside the entries.
RECORDS = "cnftrace-entries.json"
_SUFFIXES = ("-cache", "-atime")
# An entry cut short and younger than this may still be being written: left to JAX.
_WRITING_NS = 10 * 10**9
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_NO_WAIT = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/cnftrace/jax`, or `~/.cache/cnftrace/jax` without it."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(home, "cnftrace", "jax")


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for this process, and return its
    directory (or `None` where it stays off).

    - A directory already chosen for JAX (`JAX_COMPILATION_CACHE_DIR`, or
        `jax.config.update("jax_compilation_cache_dir", ...)`) is kept as it is;
        otherwise the cache goes to `path`, or to
        [`default_cache_dir()`][cnftrace.default_cache_dir] without one.
    - `CNFTRACE_COMPILATION_CACHE=0` (or `off`, `false`, `no`) leaves the cache off;
        so does a directory that cannot be created or written to, or a bad entry that
        cannot be removed (with a one-line warning; a directory chosen for JAX is then
        turned off too).

    The directory is checked first: an entry that is not a regular file, cannot be
    read, or no longer has the SHA-256 recorded when it was first seen is deleted
    and compiled again, with one line of warning (see `docs/training.md`,
    "Compiling once"). Programs that compile in under `MIN_COMPILE_SECONDS` are not
    stored, and the least recently used are deleted beyond `MAX_BYTES` (JAX's
    `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` and `JAX_COMPILATION_CACHE_MAX_SIZE`
    override both); a directory already chosen for JAX keeps JAX's size setting, as
    the other processes writing to it have it. The command line, `make demo` and the
    tests call this at start.

    !!! example

        ```python
        import tempfile

        print(cnftrace.enable_compilation_cache(tempfile.mkdtemp()) is not None)
        ```
    """
    if os.environ.get(OPT_OUT, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    chosen = jax.config.jax_compilation_cache_dir
    directory = chosen or path or default_cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return _stays_off(f"cannot create {directory!r} ({e})", chosen)
    if not os.access(directory, os.W_OK | os.X_OK):
        return _stays_off(f"{directory!r} is not writable", chosen)
    try:
        removed = _tidy(directory)
    except OSError as e:
        return _stays_off(f"cannot tidy {directory!r} ({e})", chosen)
    if chosen is None:
        jax.config.update("jax_compilation_cache_dir", directory)
    # JAX's own settings where the user chose none.
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS
        )
    # A size limit only in a directory chosen here: JAX's eviction reads every
    # entry's access-time file, which a process without a limit does not write, so
    # a limit set by only some of a directory's writers stops every later write.
    if chosen is None and "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_enable_compilation_cache", True)
    # JAX decides at its first compile whether the cache is used: start over.
    _jax_cache.reset_cache()
    # The entries this process writes are recorded when it exits (one directory).
    atexit.unregister(_record_new_entries)
    atexit.register(_record_new_entries, directory)
    if removed:
        warnings.warn(
            f"removed {removed} from the compilation cache {directory!r}; their "
            "programs are compiled again.",
            stacklevel=2,
        )
    return directory


def _stays_off(why: str, chosen: str | None) -> None:
    if chosen is not None:
        jax.config.update("jax_enable_compilation_cache", False)
        _jax_cache.reset_cache()
    warnings.warn(
        f"the compilation cache stays off: {why}; set JAX_COMPILATION_CACHE_DIR to "
        f"a writable directory, or {OPT_OUT}=0 to silence this.",
        stacklevel=3,
    )
    return None


def _signature(info: os.stat_result) -> list[int]:
    """What changes when a file is written, replaced or has its mode changed."""
    return [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def _read_entry(path: str) -> tuple[bytes, list[int]]:
    """An entry's bytes (a regular file only, never through a link, never blocking,
    up to its size) and its signature."""
    with open_regular(path) as (fd, size):
        return read_exactly(fd, size, path), _signature(os.fstat(fd))


def _whole(data: bytes) -> bool | None:
    """Whether JAX can decompress an entry (zlib checks an Adler-32 of the whole):
    `None` where it stops short, as one still being written does."""
    if data[:4] == _ZSTD_MAGIC:
        try:
            return _zstd is not None and len(_zstd.decompress(data)) > 4
        except Exception:
            return None
    stream = zlib.decompressobj()
    try:
        out = stream.decompress(data)
    except zlib.error:
        return False
    return len(out) > 4 if stream.eof else None


def _read_records(directory: str) -> dict[str, list]:
    """`{entry: [sha256, signature]}`; empty where the file is missing or damaged."""
    try:
        found = json.loads(read_regular_file(os.path.join(directory, RECORDS)))
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {k: v for k, v in found.items() if isinstance(v, list) and len(v) == 2}


def _write_records(directory: str, records: dict[str, list]) -> None:
    data = json.dumps(records, sort_keys=True).encode()
    atomic_write(os.path.join(directory, RECORDS), data)


def _check(directory: str, records: dict[str, list]):
    """The records of the good entries, and the bad ones' names with what is wrong."""
    kept: dict[str, list] = {}
    bad: dict[str, str] = {}
    now = time.time_ns()
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if not name.endswith(_SUFFIXES) and name not in (".lockfile", RECORDS):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
                if not stat.S_ISREG(info.st_mode):
                    bad[name] = "not regular"
                elif not name.endswith("-cache"):  # JAX writes these too
                    os.close(os.open(entry.path, os.O_RDWR | _NO_WAIT))
                elif name in records and records[name][1] == _signature(info):
                    kept[name] = records[name]
                else:
                    data, signature = _read_entry(entry.path)
                    digest = hashlib.sha256(data).hexdigest()
                    if name in records and records[name][0] != digest:
                        bad[name] = "changed since written"
                        continue
                    whole = name in records or _whole(data)
                    if whole:
                        kept[name] = [digest, signature]
                    elif whole is False or now - info.st_mtime_ns > _WRITING_NS:
                        bad[name] = "damaged"
            except FileNotFoundError:
                continue  # evicted meanwhile
            except OSError:
                bad[name] = "unreadable"
    return kept, bad


def _tidy(directory: str) -> str:
    """Removes the bad entries of `directory` and records the good ones first seen;
    returns what was removed, in words (`""` for nothing). An `OSError` where an
    entry cannot be removed or the records cannot be written."""
    records = _read_records(directory)
    kept, bad = _check(directory, records)
    for name in bad:
        # An entry goes with its access-time file: JAX's eviction reads the
        # access-time file of every entry, and fails on a missing one.
        pair = [name[:-6] + suffix for suffix in _SUFFIXES]
        for gone in pair if name.endswith(_SUFFIXES) else [name]:
            kept.pop(gone, None)
            path = os.path.join(directory, gone)
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    os.rmdir(path)  # only an empty one; else the cache stays off
                else:
                    os.remove(path)  # a link, not what it points to
    if kept != records:  # written only when something changed: every start reads it
        _write_records(directory, kept)
    if not bad:
        return ""
    counts = collections.Counter(bad.values())
    whys = ", ".join(f"{n} {why}" for why, n in sorted(counts.items()))
    return f"{len(bad)} bad file{'s' if len(bad) > 1 else ''} ({whys})"


def _record_new_entries(directory: str) -> None:
    """At exit: records the entries written since the start (those not recorded)."""
    try:
        records = _read_records(directory)
        with os.scandir(directory) as entries:
            names = {entry.name for entry in entries}
        kept = {name: r for name, r in records.items() if name in names}
        for name in sorted(names - set(kept)):
            if not name.endswith("-cache"):
                continue
            try:
                data, signature = _read_entry(os.path.join(directory, name))
            except OSError:
                continue
            if _whole(data):
                kept[name] = [hashlib.sha256(data).hexdigest(), signature]
        if kept != records:
            _write_records(directory, kept)
    except OSError:
        pass  # the next start records them instead
