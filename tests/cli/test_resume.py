"""A run directory over several runs: the lock that refuses a second run, and a
run killed and resumed that logs every step once."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.random as jr
import numpy as np
import pytest
from _cli import fails
from _paths import SCRIPTS

import cnftrace
from cnftrace.cli import main
from cnftrace.cli._commands import read_metrics
from cnftrace.store._checkpoint import (
    list_checkpoints,
)
from cnftrace.store._lock import DirectoryLock

TINY = ["--steps", "30", "--batch-size", "16", "--width", "4", "--depth", "1"]


TINY += ["--rtol", "1e-3", "--atol", "1e-3", "--no-progress"]


def _steps(directory):
    return [s for s, _ in list_checkpoints(directory)]


def test_a_locked_directory_is_refused_naming_the_owner(tmp_path, capsys):
    d = str(tmp_path / "run")
    flow = cnftrace.CNF(lambda t, z, a: -z, 2)
    data = np.ones((4, 2), np.float32)
    with DirectoryLock(os.path.join(d, "checkpoints")):
        with pytest.raises(cnftrace.CheckpointError, match=f"process {os.getpid()}"):
            cnftrace.fit(flow, data, key=jr.key(0), checkpoints=d + "/checkpoints")
    with DirectoryLock(d):
        fails(["train", "--run-dir", d, *TINY], capsys, 1, f"process {os.getpid()} on")
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


def test_kill_and_resume_logs_every_step_exactly_once(tmp_path, capsys):
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
