"""Faults and careless input (issue 19): one test per defect the hostile probe found,
numbered as in the issue and as in docs/failure-matrix.md. Most are argument-level and
compile nothing; the reads that hung or exhausted memory before run in a child
process under a timeout and a memory limit, so the suite can never hang."""

import errno
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import cnftrace
from cnftrace.cli import main
from cnftrace.cli._checks import UsageError
from cnftrace.cli._commands import read_metrics
from cnftrace.store._checkpoint import (
    _leaf_specs,
    checkpoint_path,
    config_mismatch,
    encode_checkpoint,
    latest_good_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from cnftrace.store._lock import DirectoryLock

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
TINY = ["--steps", "30", "--batch-size", "16", "--width", "4", "--depth", "1"]
TINY += ["--rtol", "1e-3", "--atol", "1e-3", "--no-progress"]
CONFIG = {"lr": 0.01}


def _state(offset=0.0):
    return {"w": jnp.arange(3, dtype=jnp.float32) + offset}


def _steps(directory):
    return [s for s, _ in list_checkpoints(directory)]


def _fails(argv, status, match, capsys):
    """`main(argv)` ends with `status` and one line on stderr matching `match`."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    return err[0]


# 1. Pruning: unreadable higher-numbered files never outrank fresh good ones.


def test_1_pruning_keeps_fresh_checkpoints_over_unreadable_newer_ones(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30):
        save_checkpoint(d, step, _state(), CONFIG, keep=3)
    for _, path in list_checkpoints(d):
        open(path, "w").close()  # every old checkpoint emptied
    for step in (1, 2, 3):
        save_checkpoint(d, step, _state(step), CONFIG, keep=2)
    # The fresh ones stay; the unreadable newer ones are left alone.
    assert _steps(d) == [2, 3, 10, 20, 30]
    found = latest_good_checkpoint(d, _state(), CONFIG, warn=lambda m: None)
    assert found[0] == 3
    # A good file past them supersedes the unreadable ones, which then go.
    save_checkpoint(d, 40, _state(), CONFIG, keep=2)
    assert _steps(d) == [3, 40]


# 2. Loading trusts nothing in the directory.

_READER = """
import json, os, resource, signal, sys
import jax.numpy as jnp
from cnftrace.store._checkpoint import latest_good_checkpoint

like = {"w": jnp.zeros(3, jnp.float32)}
root = sys.argv[1]
latest_good_checkpoint(os.path.join(root, "warm"), like)  # allocate what loads need
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))

def hung(*_):
    raise TimeoutError("the read hung")

signal.signal(signal.SIGALRM, hung)
out = {}
for case in ("fifo", "devzero", "directory"):
    signal.alarm(10)
    warnings = []
    try:
        found = latest_good_checkpoint(
            os.path.join(root, case), like, warn=warnings.append
        )
        out[case] = [found[0], warnings]
    except BaseException as e:
        out[case] = repr(e)
    signal.alarm(0)
print(json.dumps(out))
"""


def test_2_fifo_device_and_directory_are_skipped_without_reading(tmp_path):
    for case in ("warm", "fifo", "devzero", "directory"):
        d = str(tmp_path / case)
        save_checkpoint(d, 1, _state(), CONFIG)
    os.mkfifo(checkpoint_path(str(tmp_path / "fifo"), 2))
    os.symlink("/dev/zero", checkpoint_path(str(tmp_path / "devzero"), 2))
    os.mkdir(checkpoint_path(str(tmp_path / "directory"), 2))
    out = subprocess.run(
        [sys.executable, "-c", _READER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,  # the child's own alarms fire first; this is the last guard
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    kinds = {"fifo": "a FIFO", "devzero": "a symbolic link", "directory": "a directory"}
    for case, kind in kinds.items():
        assert isinstance(result[case], list), result[case]
        step, warnings = result[case]
        assert step == 1 and len(warnings) == 1 and kind in warnings[0], result[case]


def _forge(d, step, header, payload):
    with open(checkpoint_path(d, step), "wb") as f:
        f.write(encode_checkpoint(header, payload))


def _payload(tree) -> bytes:
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, tree)
    return buffer.getvalue()


@pytest.mark.parametrize("forgery", ["pickle", "shapes", "step", "edited"])
def test_2_forged_checkpoints_are_skipped_for_the_previous_good_one(tmp_path, forgery):
    d = str(tmp_path)
    save_checkpoint(d, 1, _state(), CONFIG)
    header = {"step": 2, "config": CONFIG, "leaves": _leaf_specs(_state())}
    if forgery == "pickle":  # a pickled object array, checksum recomputed
        buffer = io.BytesIO()
        np.save(buffer, np.array([print, None, 3], dtype=object), allow_pickle=True)
        _forge(d, 2, header, buffer.getvalue())
        reason = "Python objects"
    elif forgery == "shapes":  # other shapes than the header says, checksum redone
        _forge(d, 2, header, _payload({"w": jnp.zeros(5, jnp.float32)}))
        reason = "shape (5,)"
    elif forgery == "step":  # a header whose step is not the file's
        _forge(d, 2, dict(header, step=7), _payload(_state()))
        reason = "holds step 7"
    else:  # the header's step edited in place: the checksum covers the header
        path = save_checkpoint(d, 2, _state(1.0), CONFIG)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data.replace(b'"step": 2', b'"step": 9'))
        reason = "checksum"
    warnings = []
    step, state, _ = latest_good_checkpoint(d, _state(), CONFIG, warn=warnings.append)
    assert step == 1 and len(warnings) == 1 and reason in warnings[0], warnings
    np.testing.assert_array_equal(state["w"], _state()["w"])


# 3. One process per run directory.


def test_3_a_locked_directory_is_refused_naming_the_owner(tmp_path, capsys):
    d = str(tmp_path / "run")
    flow = cnftrace.CNF(lambda t, z, a: -z, 2)
    data = np.ones((4, 2), np.float32)
    with DirectoryLock(os.path.join(d, "checkpoints")):
        with pytest.raises(cnftrace.CheckpointError, match=f"process {os.getpid()}"):
            cnftrace.fit(flow, data, key=jr.key(0), checkpoints=d + "/checkpoints")
    with DirectoryLock(d):
        _fails(["train", "--run-dir", d, *TINY], 1, f"process {os.getpid()} on", capsys)
    assert not os.path.exists(os.path.join(d, "config.json"))
    # A lock left by a dead process is taken over, and said so.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(os.path.join(d, ".lock"), "w") as f:
        json.dump({"pid": dead.pid, "host": os.uname().nodename, "since": 0}, f)
    notes = []
    with DirectoryLock(d, warn=notes.append):
        pass
    assert len(notes) == 1 and f"process {dead.pid}" in notes[0]
    assert not os.path.exists(os.path.join(d, ".lock"))


# 4. Kill and resume: metrics.jsonl, the run's history, holds every step once.


def test_4_kill_and_resume_logs_every_step_exactly_once(tmp_path, capsys):
    run = str(tmp_path / "run")
    # Flow matching: no ODE solve in the training step, so little to compile.
    argv = ["--run-dir", run, *TINY, "--checkpoint-every", "5", "--objective", "fm"]
    proc = subprocess.Popen(
        [sys.executable, os.path.join(SCRIPTS, "cli_for_resume.py"), "0.1", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = os.path.join(run, "metrics.jsonl")
    deadline = time.time() + 300
    while time.time() < deadline:
        newest = max(_steps(os.path.join(run, "checkpoints")), default=0)
        logged = len(read_metrics(run)) if os.path.exists(metrics) else 0
        if newest >= 10 and logged >= newest + 2:
            break  # steps past the last checkpoint were logged: they come again
        if proc.poll() is not None:
            pytest.fail("the training process ended before it could be killed")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with jax.enable_x64(False):  # as the killed process ran
        assert main(["train", *argv]) == 0  # takes over the dead process's lock
    with open(metrics) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == list(range(1, 31))
    # The run keeps one history file and takes one lock: fit's own history file
    # is not written, and only the run directory's lock was left to take over.
    assert "history.jsonl" not in os.listdir(os.path.join(run, "checkpoints"))
    out, err = capsys.readouterr()
    assert err.count("taking over the lock") == 1 and "skipping" not in out + err
    # The last line says where the run resumed; run again, it says it had finished.
    assert re.search(r"trained 30 steps \(resumed at step (10|15|20|25)\);", out)
    with jax.enable_x64(False):
        assert main(["train", *argv]) == 0
    assert f"{run} had already trained 30 steps; final loss" in capsys.readouterr().out
    with open(metrics) as f:
        assert len(f.readlines()) == 30  # nothing logged again
    # `cnftrace plot` reads each step once, even from a log written with repeats:
    # its first record (a later one never replaces it), and no torn last line.
    third = read_metrics(run)[2]
    with open(metrics, "a") as f:
        f.write(json.dumps(dict(third, loss=0.0)) + "\n" + '{"step": 4, "lo')
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[2] == third


# 5. Settings are checked before anything is written; NaN equals NaN.


@pytest.mark.parametrize(
    "flag, value",
    [("--t1", "0"), ("--t1", "nan"), ("--t1", "inf"), ("--lr", "nan"),
     ("--lr", "-1"), ("--clip", "nan"), ("--clip", "-1"), ("--rtol", "0"),
     ("--atol", "nan"), ("--weight-decay", "-1"), ("--weight-decay", "inf")],
)  # fmt: skip
def test_5_bad_settings_are_refused_before_anything_is_written(
    tmp_path, capsys, flag, value
):
    run = str(tmp_path / "run")
    _fails(["train", "--run-dir", run, *TINY, flag, value], 2, flag, capsys)
    assert not os.path.exists(run)


def test_5_nan_equals_nan_in_the_config_check():
    assert config_mismatch({"t1": math.nan}, {"t1": math.nan}) == []
    assert config_mismatch({"t1": math.nan}, {"t1": 0.5}) != []


# 6. Every expected user error: one line on stderr, exit status 2 or 1.


def test_6_user_errors_are_one_line_with_an_exit_status(tmp_path, capsys, monkeypatch):
    run = str(tmp_path / "run")
    train = ["train", "--run-dir", run, *TINY]
    _fails([*train, "--print-every", "0"], 2, "--print-every must be", capsys)
    _fails([*train, "--checkpoint-every", "0"], 2, "--checkpoint-every", capsys)
    _fails([*train, "--batch-size", "100000000000"], 2, "GiB", capsys)
    _fails([*train, "--width", "10000000"], 2, "--width 10000000 cannot fit", capsys)
    (tmp_path / "file").write_text("")
    _fails(["train", "--run-dir", str(tmp_path / "file"), *TINY], 2, "a file", capsys)
    inside_a_file = str(tmp_path / "file" / "run")
    _fails(["train", "--run-dir", inside_a_file, *TINY], 2, "is a file, so", capsys)
    _fails(["eval", run, "--n", "1"], 2, "--n must be at least 2", capsys)
    out = str(tmp_path / "missing" / "x.npy")
    _fails(["sample", run, "--out", out], 2, "does not exist", capsys)
    assert not os.path.exists(run)
    if os.path.isdir("/sys"):  # read-only even for root
        _fails(["train", "--run-dir", "/sys/cnftrace-run", *TINY], 1, "/sys", capsys)

    # A full disk: nothing written, and the message says how to go on.
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr("cnftrace.cli._train.atomic_write", full)
    _fails(train, 1, "No space left on device", capsys)
    monkeypatch.undo()
    assert os.listdir(run) == []  # not even a lock is left

    # A damaged config.json.
    config = os.path.join(run, "config.json")
    with open(config, "w") as f:
        f.write("{not json")
    _fails(["eval", run], 1, "is not a JSON settings file", capsys)
    _fails(train, 1, "is not a JSON settings file", capsys)
    with open(config, "w") as f:
        json.dump({"data": "8gaussians"}, f)
    _fails(["eval", run], 1, "lacks the settings", capsys)

    # --debug: the traceback instead of one line.
    with pytest.raises(UsageError):
        main(["--debug", *train, "--lr", "nan"])
    with pytest.raises(UsageError):
        main([*train, "--lr", "nan", "--debug"])


def test_6_the_installed_command_exits_2_with_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "cnftrace", "train", "--run-dir", str(tmp_path / "r")]
        + ["--lr", "nan"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "cnftrace: error: --lr must be a finite number > 0; got nan."
    ]


# 7. Library inputs: clear errors naming the argument.


def _flow(field=None, **kwargs):
    field = field or cnftrace.MLPField(2, width=4, depth=1, key=jr.key(0))
    return cnftrace.CNF(field, 2, rtol=1e-3, atol=1e-3, **kwargs)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: _flow().log_prob(jnp.zeros((0, 2))), ValueError, "empty batch"),
        (lambda: _flow().log_prob(jnp.zeros((3, 2), jnp.float16)), TypeError,
         "`x` is float16"),
        (lambda: _flow().forward(jnp.zeros((3, 2), jnp.bfloat16)), TypeError,
         "`x` is bfloat16"),
        (lambda: _flow().sample(jr.key(0), 3, dtype=jnp.float16), TypeError,
         "`dtype` is float16"),
        (lambda: cnftrace.fit(_flow(), np.zeros((8, 2), np.float16), key=jr.key(0)),
         TypeError, "`data` is float16"),
        (lambda: _flow(lambda t, z, a: jnp.zeros(3)).log_prob(jnp.zeros((3, 2))),
         ValueError, r"returned shape \(3,\) for a sample of shape \(2,\)"),
        (lambda: _flow(lambda t, z, a: z[:, None]).sample(jr.key(0), 3),
         ValueError, r"returned shape \(2, 1\)"),
        (lambda: _flow(lambda t, z, a: jnp.zeros(2, int)).log_prob(jnp.zeros((3, 2))),
         TypeError, "returned dtype int"),
        (lambda: _flow(t1=math.inf), ValueError, "finite"),
        (lambda: _flow(t1=math.nan), ValueError, "finite"),
        (lambda: _flow(t1=jnp.asarray(-1.0)), ValueError, "t1 > t0"),
    ],
)  # fmt: skip
def test_7_library_inputs_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_7_a_traced_negative_end_time_is_refused():
    @jax.jit
    def log_prob(t1):
        return _flow(lambda t, z, a: -z, t1=t1).log_prob(jnp.ones((2, 2)))

    assert np.all(np.isfinite(log_prob(0.5)))
    with pytest.raises(Exception, match="t1 > t0"):
        jax.block_until_ready(log_prob(-0.5))


# 8. Checkpoints do not grow with the step count; the history lives beside them.


def test_8_checkpoints_do_not_grow_and_history_survives_resume(tmp_path):
    d = str(tmp_path)
    flow = cnftrace.CNF(cnftrace.MLPField(2, width=4, depth=1, key=jr.key(0)), 2)
    data = np.asarray(jr.normal(jr.key(1), (64, 2)))
    kwargs = dict(key=jr.key(2), batch_size=8, optimizer=optax.adam(1e-3))
    kwargs |= dict(objective="fm")  # no ODE solve in the step: quick to compile
    kwargs |= dict(progress=False, checkpoints=cnftrace.Checkpoints(d, every=1, keep=9))
    _, first = cnftrace.fit(flow, data, steps=4, **kwargs)
    sizes = [os.path.getsize(p) for _, p in list_checkpoints(d)]
    assert len(sizes) == 4 and max(sizes) - min(sizes) <= 16, sizes
    # fit(steps=6) resumes at 4 and returns the whole history, each step once.
    _, resumed = cnftrace.fit(flow, data, steps=6, **kwargs)
    assert resumed["step"] == [1, 2, 3, 4, 5, 6]
    assert resumed["loss"][:4] == first["loss"]
