"""Faults of issue 36 in the command line's settings: seeds that differ only above
32 bits, and settings refused only after `config.json` was written. Nothing here
trains: `fit` is replaced by a recorder where a run would start."""

import os

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest

from cnftrace._checks import seed_key
from cnftrace.cli import main

TINY = ["--steps", "2", "--batch-size", "16", "--width", "4", "--depth", "1"]
TINY += ["--no-progress"]


def _fails(argv, status, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    return err[0]


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
    _fails(argv, 2, "--num-probes 1000000000000 cannot fit", capsys)
    assert not os.path.exists(run)


def test_negative_split_seed_is_refused_by_name(tmp_path, capsys):
    data = tmp_path / "d.csv"
    rows = np.random.default_rng(0).normal(size=(40, 2))
    np.savetxt(data, rows, delimiter=",", header="x,y", comments="")
    run = str(tmp_path / "run")
    argv = ["train", "--data", str(data), "--run-dir", run, *TINY]
    _fails([*argv, "--split-seed", "-1"], 2, "--split-seed must be", capsys)
    assert not os.path.exists(run)
