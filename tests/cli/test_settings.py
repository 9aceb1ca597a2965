"""The command line's settings: refused by name, before anything is written, with
one line and an exit status; seeds that differ only above 32 bits give other runs.
Nothing here trains: `fit` is replaced by a recorder where a run would start."""

import errno
import json
import math
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest
from _cli import fails

from cnftrace._checks import seed_key
from cnftrace.cli import main
from cnftrace.cli._checks import UsageError
from cnftrace.store._checkpoint import (
    config_mismatch,
)

TINY = ["--steps", "2", "--batch-size", "16", "--width", "4", "--depth", "1"]
TINY += ["--no-progress"]


def _started(tmp_path, monkeypatch, seed: int):
    """The key and the initial parameters `cnftrace train --seed SEED` would start
    `fit` with, in float32 as a user runs it (no 64-bit mode: there JAX's own keys
    keep the high bits)."""
    seen = {}

    def recorder(flow, data, *, key, steps, **kwargs):
        seen["key"] = np.asarray(jr.key_data(key))
        seen["params"] = eqx.filter(flow, eqx.is_inexact_array)
        return flow, {"step": [steps], "loss": [0.0]}

    monkeypatch.setattr("cnftrace.cli._train.fit", recorder)
    run = str(tmp_path / f"seed{seed}")
    with jax.enable_x64(False):
        assert main(["train", "--run-dir", run, *TINY, "--seed", str(seed)]) == 0
    return seen


def test_seeds_that_differ_above_32_bits_give_other_runs(tmp_path, monkeypatch):
    zero = _started(tmp_path, monkeypatch, 0)
    high = _started(tmp_path, monkeypatch, 2**32)
    assert not np.array_equal(zero["key"], high["key"])
    same = jax.tree.map(
        lambda a, b: bool(np.array_equal(a, b)), zero["params"], high["params"]
    )
    assert not all(jax.tree.leaves(same))
    # The same seed twice is the same run.
    again = _started(tmp_path, monkeypatch, 0)
    assert np.array_equal(zero["key"], again["key"])


def test_seed_key_keeps_32_bit_seeds_and_separates_the_rest():
    with jax.enable_x64(False):
        for seed in (0, 7, 2**32 - 1):  # the keys runs have always had
            assert np.array_equal(
                jr.key_data(seed_key(seed)), jr.key_data(jr.key(seed))
            )
        seeds = [0, 1, 2**31, 2**32 - 1, 2**32, 2**33, -1, -(2**31), 2**63 - 1]
        seeds += [-(2**63), 2**64 - 1]
        keys = {tuple(np.asarray(jr.key_data(seed_key(s))).tolist()) for s in seeds}
    assert len(keys) == len(seeds) - 1  # -1 and 2**64 - 1 are one 64-bit number
    with pytest.raises(ValueError, match="64 bits"):
        seed_key(2**64)


def test_huge_num_probes_is_refused_before_anything_is_written(tmp_path, capsys):
    run = str(tmp_path / "run")
    argv = ["train", "--run-dir", run, *TINY, "--num-probes", "1000000000000"]
    fails(argv, capsys, 2, "--num-probes 1000000000000 cannot fit")
    assert not os.path.exists(run)


def test_negative_split_seed_is_refused_by_name(tmp_path, capsys):
    data = tmp_path / "d.csv"
    rows = np.random.default_rng(0).normal(size=(40, 2))
    np.savetxt(data, rows, delimiter=",", header="x,y", comments="")
    run = str(tmp_path / "run")
    argv = ["train", "--data", str(data), "--run-dir", run, *TINY]
    fails([*argv, "--split-seed", "-1"], capsys, 2, "--split-seed must be")
    assert not os.path.exists(run)


@pytest.mark.parametrize(
    "flag, value",
    [("--t1", "0"), ("--t1", "nan"), ("--t1", "inf"), ("--lr", "nan"),
     ("--lr", "-1"), ("--clip", "nan"), ("--clip", "-1"), ("--rtol", "0"),
     ("--atol", "nan"), ("--weight-decay", "-1"), ("--weight-decay", "inf")],
)  # fmt: skip
def test_bad_settings_are_refused_before_anything_is_written(
    tmp_path, capsys, flag, value
):
    run = str(tmp_path / "run")
    fails(["train", "--run-dir", run, *TINY, flag, value], capsys, 2, flag)
    assert not os.path.exists(run)


def test_nan_equals_nan_in_the_config_check():
    assert config_mismatch({"t1": math.nan}, {"t1": math.nan}) == []
    assert config_mismatch({"t1": math.nan}, {"t1": 0.5}) != []


def test_user_errors_are_one_line_with_an_exit_status(tmp_path, capsys, monkeypatch):
    run = str(tmp_path / "run")
    train = ["train", "--run-dir", run, *TINY]
    fails([*train, "--print-every", "0"], capsys, 2, "--print-every must be")
    fails([*train, "--checkpoint-every", "0"], capsys, 2, "--checkpoint-every")
    fails([*train, "--batch-size", "100000000000"], capsys, 2, "GiB")
    fails([*train, "--width", "10000000"], capsys, 2, "--width 10000000 cannot fit")
    (tmp_path / "file").write_text("")
    fails(["train", "--run-dir", str(tmp_path / "file"), *TINY], capsys, 2, "a file")
    inside_a_file = str(tmp_path / "file" / "run")
    fails(["train", "--run-dir", inside_a_file, *TINY], capsys, 2, "is a file, so")
    fails(["eval", run, "--n", "1"], capsys, 2, "--n must be at least 2")
    out = str(tmp_path / "missing" / "x.npy")
    fails(["sample", run, "--out", out], capsys, 2, "does not exist")
    assert not os.path.exists(run)
    if os.path.isdir("/sys"):  # read-only even for root
        fails(["train", "--run-dir", "/sys/cnftrace-run", *TINY], capsys, 1, "/sys")

    # A full disk: nothing written, and the message says how to go on.
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr("cnftrace.cli._train.atomic_write", full)
    fails(train, capsys, 1, "No space left on device")
    monkeypatch.undo()
    assert os.listdir(run) == []  # not even a lock is left

    # A damaged config.json.
    config = os.path.join(run, "config.json")
    with open(config, "w") as f:
        f.write("{not json")
    fails(["eval", run], capsys, 1, "is not a JSON settings file")
    fails(train, capsys, 1, "is not a JSON settings file")
    with open(config, "w") as f:
        json.dump({"data": "8gaussians"}, f)
    fails(["eval", run], capsys, 1, "lacks the settings")

    # --debug: the traceback instead of one line.
    with pytest.raises(UsageError):
        main(["--debug", *train, "--lr", "nan"])
    with pytest.raises(UsageError):
        main([*train, "--lr", "nan", "--debug"])


def test_the_installed_command_exits_2_with_one_line(tmp_path):
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
