"""A damaged persistent compilation cache cannot hurt a run.

`cnftrace train` fills a cache of its own (XDG_CACHE_HOME, with the size limit and the
settings a user gets), then each case damages entries and trains again in a new
process: it must finish, with the clean run's loss and at most one line on stderr,
which names each kind of damage found. JAX's keys depend on the cache's path, so
every case restores the filled cache at the same path. The start's check reads each
entry alone, so one case damages entries in every way at once (the training step's
entry swapped, the others flipped, truncated, made FIFOs, links to /dev/zero or
unreadable, shared out between the kinds), and one makes the directory read-only.
"""

import ctypes
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _paths import ROOT

pytestmark = pytest.mark.slow

TINY = ["--steps", "3", "--batch-size", "16", "--width", "8", "--depth", "1"]
TINY += ["--no-progress", "--rtol", "1e-3", "--atol", "1e-3"]
STEP = "jit_loop_step-"
# The settings of the suite's own cache, which a user's run does not have.
SUITE_ONLY = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_COMPILATION_CACHE_MAX_SIZE",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "CNFTRACE_COMPILATION_CACHE",
)
# Run as root, a process reads and writes past file modes: the children give up the
# two capabilities that allow it (prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE and
# CAP_DAC_READ_SEARCH) before they start python), so that chmod binds them.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
MEMORY = 4 * 1024**3


def _limits(memory: int | None):
    def preexec():
        if os.geteuid() == 0:
            for capability in (1, 2):
                _PRCTL(24, capability, 0, 0, 0)
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return preexec


# The filling of the cache: a run with another learning rate, the cache's entries
# then (one line), and the clean run, in one process (a process pays seconds of
# imports; the clean run compiles only its training step, as it would in a process
# of its own that loads the rest from the cache). The cache keeps only programs
# slower to compile than its least compile time, so on a fast machine the small
# programs can be fewer than the kinds of damage: copies of them under other keys
# (an entry and its access-time file) make up the number, and are recorded at exit
# as any new entry is. JAX never looks them up, so damaging them tests the start's
# check alone; the real entries get the first kinds, and the training step is
# always swapped.
FILL = """
import hashlib, os, shutil, sys
from cnftrace.cli import main
cache, need, step, foreign, clean, *tiny = sys.argv[1:]
assert main(["train", "--run-dir", foreign, *tiny, "--lr", "0.01"]) == 0
print("entries:", *sorted(os.listdir(cache)))
code = main(["train", "--run-dir", clean, *tiny])
small = sorted(
    n[: -len("-cache")] for n in os.listdir(cache)
    if n.endswith("-cache") and step not in n
)
assert small, os.listdir(cache)
for i in range(int(need) - len(small)):
    stem = small[i % len(small)]
    name, _, key = stem.rpartition("-")
    copy = name + "-" + hashlib.sha256((key + str(i)).encode()).hexdigest()
    for suffix in ("-cache", "-atime"):
        into = os.path.join(cache, copy + suffix)
        shutil.copyfile(os.path.join(cache, stem + suffix), into)
raise SystemExit(code)
"""


def _train(home: Path, run_dir: Path, *extra: str, memory: int | None = None):
    argv = ["train", "--run-dir", str(run_dir), *TINY, *extra]
    code = "from cnftrace.cli import main; raise SystemExit(main())"
    return _python(home, code, argv, memory)


def _python(home: Path, code: str, argv: list[str], memory: int | None = None):
    """`python -c CODE ARGV...` as a user runs it, with the cache in `home`."""
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY}
    env["XDG_CACHE_HOME"] = str(home)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    try:
        return subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=150,
            preexec_fn=_limits(memory),
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run hung on the damaged cache")


def _loss(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.findall(r"final loss (\S+)", proc.stdout)
    assert found, proc.stdout
    return found[-1]


@dataclass
class Filled:
    home: Path  # XDG_CACHE_HOME; the cache is home/cnftrace/jax
    template: Path  # a copy of home after the two runs
    loss: str  # the clean run's final loss
    step: str  # the clean run's training step's entry
    foreign: str  # the training step of a run with another learning rate

    @property
    def cache(self) -> Path:
        return self.home / "cnftrace" / "jax"

    def restore(self) -> Path:
        if self.home.exists():
            os.chmod(self.cache, 0o755)
            shutil.rmtree(self.home)
        shutil.copytree(self.template, self.home, symlinks=True)
        return self.cache

    def others(self) -> list[Path]:
        """The entries but the training steps' (small programs, quick to compile)."""
        names = sorted(os.listdir(self.cache))
        return [self.cache / n for n in names if n.endswith("-cache") and STEP not in n]


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    base = tmp_path_factory.mktemp("cache-faults")
    home = base / "xdg"
    # A run with another learning rate: its training step has the same inputs and
    # outputs as the clean run's, and other numbers inside.
    cache = home / "cnftrace" / "jax"
    need = str(len(DAMAGES))
    argv = [str(cache), need, STEP, str(base / "foreign"), str(base / "clean")]
    proc = _python(home, FILL, argv + TINY)
    loss = _loss(proc)
    (listed,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("entries:")]
    before = set(listed.split()[1:])
    steps = [
        n for n in os.listdir(cache) if n.startswith(STEP) and n.endswith("-cache")
    ]
    (step,) = [n for n in steps if n not in before]
    (foreign,) = [n for n in steps if n in before]
    shutil.copytree(home, base / "template", symlinks=True)
    yield Filled(home, base / "template", loss, step, foreign)
    if cache.exists():
        os.chmod(cache, 0o755)


def _flip(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _fifo(path: Path):
    atime = path.with_name(path.name.removesuffix("-cache") + "-atime")
    for p in (path, atime):
        p.unlink(missing_ok=True)
        os.mkfifo(p)


def _devzero(path: Path):
    path.unlink()
    path.symlink_to("/dev/zero")


def _unreadable(path: Path):
    os.chmod(path, 0)


# Each kind of damage to an entry, with the words of cnftrace's one line of warning
# for it. The start's check reads every entry alone, so one run damages one or more
# entries in each way (a run each cost a process start and its loads apiece).
DAMAGES = {
    "flipped": (_flip, "changed since written"),
    "truncated": (_truncate, "changed since written"),
    "fifo": (_fifo, "not regular"),
    "devzero": (_devzero, "not regular"),
    "unreadable": (_unreadable, "unreadable"),
}


def _entries(cache: Path, filled: Filled, binds: bool) -> list[str]:
    """(a)-(f): the step's entry swapped for another run's step (same inputs and
    outputs, other numbers inside), and the other entries shared out between the
    kinds of `DAMAGES` (unreadable ones only where file modes bind); the words the
    warning must hold."""
    shutil.copyfile(cache / filled.foreign, cache / filled.step)
    kinds = [k for k in DAMAGES if binds or k != "unreadable"]
    others = filled.others()
    assert len(others) >= len(kinds), others
    for i, path in enumerate(others):
        DAMAGES[kinds[i % len(kinds)]][0](path)
    return sorted({DAMAGES[k][1] for k in kinds})


def _read_only(cache: Path, filled: Filled, binds: bool) -> list[str]:
    """(g) a read-only cache directory: the cache stays off."""
    shutil.rmtree(cache)
    cache.mkdir()
    os.chmod(cache, 0o555)
    return ["is not writable"]


def _binds_root(tmp_path) -> bool:
    """Whether file modes bind the children (always, but for root without the
    capability to give up the others)."""
    locked = tmp_path / "locked"
    locked.write_text("x")
    os.chmod(locked, 0)
    probe = [sys.executable, "-c", f"open({str(locked)!r}).read()"]
    proc = subprocess.run(probe, capture_output=True, preexec_fn=_limits(None))
    return proc.returncode != 0


@pytest.mark.parametrize("damage", [_entries, _read_only], ids=["entries", "ro"])
def test_a_damaged_cache_entry_is_compiled_again(damage, filled, tmp_path):
    """(a)-(f) entries flipped, truncated, swapped for another program's, FIFOs,
    links to /dev/zero, unreadable, all in one run; (g) a read-only cache
    directory."""
    binds = _binds_root(tmp_path)
    if damage is _read_only and not binds:
        pytest.skip("file modes do not bind this user")
    cache = filled.restore()
    try:
        words = damage(cache, filled, binds)
        memory = MEMORY if damage is _entries else None  # for /dev/zero's links
        proc = _train(filled.home, tmp_path / "run", memory=memory)
    finally:
        os.chmod(cache, 0o755)
    assert _loss(proc) == filled.loss, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) <= 1, proc.stderr[-3000:]
    for said in words:
        assert said in proc.stderr, (said, proc.stderr[-3000:])
    # What was left in the cache is whole again: regular files, read back.
    for name in os.listdir(cache):
        if name.endswith(("-cache", "-atime")):
            path = cache / name
            assert stat.S_ISREG(os.lstat(path).st_mode), name
            path.read_bytes()
