"""An exclusive lock on a directory, so that two processes never train into one: a
file, `.lock`, naming its owner, held with `flock` (released by the kernel when the
owner exits: a killed process's lock is taken over, and said so)."""

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time

from .._io import file_kind
from ._checkpoint import CheckpointError

LOCK_NAME = ".lock"


class DirectoryLocked(CheckpointError):
    """Another live process holds the directory's lock."""


def _owner_alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # cannot tell: assume it is alive
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(owner: dict) -> str:
    since = owner.get("since")
    when = ""
    if isinstance(since, (int, float)):
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since))
    return f"process {owner.get('pid')} on {owner.get('host')}{when}"


class DirectoryLock:
    """`with DirectoryLock(directory, what):` holds `directory`'s lock, or raises a
    [`CheckpointError`][cnftrace.CheckpointError] naming the process that holds it.
    `what` names the directory in messages ("run directory", ...)."""

    def __init__(self, directory: str, what: str = "directory", *, warn=None):
        self.directory = directory
        self.what = what
        self.path = os.path.join(directory, LOCK_NAME)
        self.warn = warn or (lambda m: print(m, file=sys.stderr))
        self.fd = None

    def __enter__(self) -> "DirectoryLock":
        self._check_kind(self.directory, "directory")
        os.makedirs(self.directory, exist_ok=True)
        while self.fd is None:
            self._check_kind(self.path, "regular file")
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            fd = os.open(self.path, flags, 0o644)
            try:
                # It may have been swapped since it was looked at.
                self._check_kind(self.path, "regular file", fd)
                got = self._try_lock(fd)
            except BaseException:
                os.close(fd)
                raise
            if got:
                self.fd = fd
            else:
                os.close(fd)  # the file was replaced meanwhile: try the new one
        return self

    def _check_kind(self, path: str, wanted: str, fd: int | None = None) -> None:
        """A `CheckpointError` naming `path` if it exists (or `fd` is open on it) as
        something other than `wanted`, a "directory" or a "regular file"."""
        try:
            mode = os.fstat(fd).st_mode if fd is not None else os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if wanted == "directory" and stat.S_ISLNK(mode):
            with contextlib.suppress(OSError):  # a dangling link is not
                mode = os.stat(path).st_mode  # a link to a directory is one
        if (stat.S_ISDIR if wanted == "directory" else stat.S_ISREG)(mode):
            return
        role = self.what if wanted == "directory" else f"{self.what}'s lock"
        raise CheckpointError(
            f"{path} is {file_kind(mode)}, not a {wanted}, so it cannot be the "
            f"{role}; remove it or move it away, and run again."
        )

    def _try_lock(self, fd: int) -> bool:
        owner = _read_owner(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            flocked = True
        except BlockingIOError:
            raise self._locked(owner) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            flocked = False  # no flock here: judge the owner by its pid
            if owner and owner.get("pid") != os.getpid() and _owner_alive(owner):
                raise self._locked(owner) from None
        # The lock's file may have been removed and made anew since it was opened.
        try:
            if os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                return False
        except FileNotFoundError:
            return False
        if owner and owner.get("pid") != os.getpid() and flocked:
            self.warn(
                f"taking over the lock of {self.directory}, left by "
                f"{_describe(owner)}, which is no longer running."
            )
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode() + b"\n", 0)
        return True

    def _locked(self, owner: dict) -> DirectoryLocked:
        who = _describe(owner) if owner else "another process"
        return DirectoryLocked(
            f"the {self.what} {self.directory} is in use by {who} (its lock is "
            f"{self.path}). Wait for it to finish or stop it, or use another "
            f"{self.what}."
        )

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):  # while held: nobody else holds this file
            os.remove(self.path)
        os.close(self.fd)
        self.fd = None


def _read_owner(fd: int) -> dict:
    try:
        owner = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (ValueError, OSError):
        return {}
    return owner if isinstance(owner, dict) else {}
