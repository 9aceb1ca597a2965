"""Reading and writing files safely: atomic writes (a temporary file, fsync, a
rename), and reads that open only regular files, never through a link and never
blocking on a FIFO, bounded by the file's size."""

import contextlib
import os
import stat
import tempfile


class FileKindError(OSError):
    """A path that is not a regular file where one is read or written (a directory,
    a link, a FIFO, ...), or a file that ended while it was being read."""


def atomic_write(path: str, data: bytes, suffix: str = "") -> None:
    """Writes `data` to `path` by way of a temporary file beside it (fsynced) and a
    rename, then fsyncs the directory: a crash leaves the old file or the new one,
    never half of one. Makes the missing parent directories. An `OSError` names
    `path`, never the temporary file (which is removed)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise FileKindError(
            f"cannot write {path}: something that is not a regular file has its name "
            "(a directory, a link, a FIFO?); move it away."
        )
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=suffix)
        # mkstemp makes files private (0600): the mode of a file opened normally.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        if isinstance(e, FileKindError) or e.errno is None:
            raise
        # The temporary file's name would mislead: the error is the target's.
        raise OSError(e.errno, e.strerror, path) from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.remove(tmp)


def read_regular_file(path: str, limit: int | None = None) -> bytes:
    """The bytes of `path` if it is a regular file (not a link, FIFO, device or
    directory), read up to its size (and at most `limit` bytes); a `FileKindError`
    otherwise. A missing file raises `FileNotFoundError`."""
    with open_regular(path) as (fd, size):
        return read_exactly(fd, size if limit is None else min(size, limit), path)


@contextlib.contextmanager
def open_regular(path: str):
    """`with open_regular(path) as (fd, size)`: an open regular file and its size."""
    check_regular(os.lstat(path).st_mode, path)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise FileKindError(f"{path} cannot be opened: {e.strerror}.") from None
    try:
        info = os.fstat(fd)
        check_regular(info.st_mode, path)  # it may have been swapped since lstat
        yield fd, info.st_size
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    """What a file of `mode` (`os.lstat(path).st_mode`) is, in words: "a regular
    file", "a directory", "a FIFO", ..."""
    kinds = [
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def check_regular(mode: int, path: str) -> None:
    if not stat.S_ISREG(mode):
        raise FileKindError(
            f"{path} is {file_kind(mode)}, not a regular file; it is not read."
        )


def read_exactly(fd: int, n: int, path: str) -> bytes:
    chunks, left = [], n
    while left > 0:
        chunk = os.read(fd, min(left, 2**24))
        if not chunk:
            raise FileKindError(f"{path} is truncated: it ended while being read.")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
