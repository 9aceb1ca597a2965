"""The B3 benchmark (experiments/bench/b3.py) on tiny settings: the rows it returns,
and the relations that hold whatever the machine's noise."""

import math

import pytest

from experiments.bench import b3


def test_divergence_cost_rows():
    rows = b3.divergence_cost(
        dims=(2, 4), batch=16, width=8, depth=1, repeats=2, min_seconds=0.002
    )
    assert [r["dim"] for r in rows] == [2, 4]
    for r in rows:
        for name in ("f_us", "hutchinson_us", "exact_us"):
            assert math.isfinite(r[name]) and r[name] > 0
        assert r["hutchinson_over_f"] == pytest.approx(r["hutchinson_us"] / r["f_us"])
        assert r["exact_over_f"] == pytest.approx(r["exact_us"] / r["f_us"])
    text = b3.divergence_table(rows)
    assert text.count("\n|") == 1 + len(rows)  # separator line and one per row
    assert "Growth exponents in d" in text


@pytest.mark.slow  # two compilations of a training step
def test_step_time_vs_batch_rows():
    rows = b3.step_time_vs_batch(batches=(16, 32), iters=2)
    assert [r["batch"] for r in rows] == [16, 32]
    for r in rows:
        assert r["seconds_per_step"] > 0
        assert r["us_per_sample"] == pytest.approx(
            1e6 * r["seconds_per_step"] / r["batch"]
        )
        # At least one Tsit5 step of 6 evaluations, and the same parameters at every
        # call.
        assert 6 <= r["nfe_min"] <= r["nfe_forward"] <= r["nfe_max"]
        assert isinstance(r["nfe_min"], int) and r["pretrain_steps"] == 0
    assert "| 32 |" in b3.step_table(rows)


@pytest.mark.slow  # four compilations of a gradient step
def test_memory_vs_steps():
    rows = b3.memory_vs_steps(
        num_steps=(4, 8), adjoints=("recursive_checkpoint", "backsolve"), batch=32
    )
    assert [(r["adjoint"], r["steps"]) for r in rows] == [
        ("recursive_checkpoint", 4),
        ("recursive_checkpoint", 8),
        ("backsolve", 4),
        ("backsolve", 8),
    ]
    by = {(r["adjoint"], r["steps"]): r for r in rows}
    for r in rows:
        assert 0 < r["temp_bytes"] < r["total_bytes"]
    # Two and three checkpoints: one more saved state costs memory, but far less than
    # saving every step would.
    assert [by["recursive_checkpoint", n]["checkpoints"] for n in (4, 8)] == [2, 3]
    assert (
        by["recursive_checkpoint", 4]["temp_bytes"]
        < by["recursive_checkpoint", 8]["temp_bytes"]
    )
    # The backsolve adjoint stores no forward trajectory: its memory does not depend
    # on the number of steps.
    assert by["backsolve", 8]["temp_bytes"] <= 1.05 * by["backsolve", 4]["temp_bytes"]
    growth = b3.memory_growth(rows)
    assert growth["recursive_checkpoint"]["temp_bytes_per_checkpoint"] > 0
    assert "backsolve" in b3.memory_table(rows)


def test_default_checkpoints_matches_equinox_rule():
    for n in (1, 2, 3, 8, 100, 256, 4096):
        c = b3.default_checkpoints(n)
        assert 1 <= c <= n
        if n > 1:  # the smallest c with 2n < (c + 1)(c + 2)
            assert 2 * n < (c + 1) * (c + 2) and not 2 * n < c * (c + 1)
