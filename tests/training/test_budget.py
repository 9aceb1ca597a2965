"""Training for a time budget: `fit(..., seconds=...)` and `cnftrace train --minutes`
(issue 45). The budget is checked before anything is written, the run stops once
its training seconds pass it, the learning rate follows the share of the budget
spent, and a resumed run goes on with the seconds it had left."""

import json
import math
import os

import jax
import jax.random as jr
import numpy as np
import pytest
from _cli import fails

import cnftrace
from cnftrace._defaults import (
    BATCH_SIZE,
    BUDGET_BATCH_SIZE,
    LR,
    LR_END_DIVISOR,
    WARMUP,
    WIDTH_BY_DIM,
    default_batch_size,
)
from cnftrace.cli import main

BUDGET = 2.0  # seconds
# One optimiser for every run here: the same object keeps the compiled step shared.
OPTIMIZER = cnftrace.budget_cosine_adam(LR)


def _data(key, n):
    return 0.5 * jr.normal(key, (n, 2)) + 1.0


@pytest.fixture(scope="module")
def flow():
    field = cnftrace.MLPField(2, width=8, depth=1, key=jr.key(0))
    return cnftrace.CNF(field, 2, t1=0.5, rtol=1e-3, atol=1e-3)


def _fit(flow, **kwargs):
    kwargs = dict(key=jr.key(1), batch_size=32, optimizer=OPTIMIZER) | kwargs
    return cnftrace.fit(flow, _data, progress=False, **kwargs)


def _closed_form_rate(step, spent):
    """The rate of (1-based) step `step` begun with the share `spent` of the budget
    gone: a linear warmup over WARMUP steps or the cosine over the budget, the lower."""
    end = LR / LR_END_DIVISOR
    cosine = end + (LR - end) * (1 + np.cos(np.pi * np.minimum(spent, 1))) / 2
    return np.minimum(LR * (step - 1) / WARMUP, cosine)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "10", True])
def test_a_budget_that_is_not_a_positive_finite_number_is_refused(flow, tmp_path, bad):
    directory = tmp_path / "checkpoints"
    with pytest.raises(ValueError, match="`seconds` is the training time budget"):
        _fit(flow, seconds=bad, checkpoints=directory)
    assert not directory.exists()


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "ten"])
def test_the_command_line_refuses_a_bad_budget_before_writing(tmp_path, capsys, bad):
    run = tmp_path / "run"
    fails(["train", "--run-dir", str(run), "--minutes", bad], capsys, 2, "--minutes")
    assert not run.exists()


def test_the_budget_schedule_without_a_budget_is_refused(flow):
    with pytest.raises(ValueError, match="pass `seconds=`"):
        _fit(flow, steps=3)


@pytest.fixture(scope="module")
def budgeted(flow):
    _fit(flow, seconds=100.0, steps=2)  # compiled here, not in the budget's seconds
    return _fit(flow, seconds=BUDGET)[1]


def test_a_budgeted_fit_stops_once_its_seconds_are_spent(budgeted):
    seconds = np.asarray(budgeted["seconds"])
    assert len(seconds) > 20 and np.all(np.diff(seconds) > 0)
    # The step the clock passes the budget in makes the next one the last.
    assert seconds[-3] < BUDGET <= seconds[-1] < BUDGET + 1.0
    assert budgeted["budget"] == [BUDGET] * len(seconds)


def test_the_rate_follows_the_share_of_the_budget_spent(budgeted):
    step = np.asarray(budgeted["step"])
    spent = np.asarray(budgeted["budget_spent"])
    rate = np.asarray(budgeted["lr"])
    assert np.all(np.diff(spent) > 0) and spent[0] < 0.1 < 0.9 < spent[-1]
    np.testing.assert_allclose(rate, _closed_form_rate(step, spent), rtol=1e-6)
    warming = LR * (step - 1) / WARMUP < LR
    assert warming.any() and (~warming).any()  # both parts of the schedule ran
    assert rate[-1] < 1.01 * LR / LR_END_DIVISOR  # decayed by the budget's end


def test_a_resumed_budget_goes_on_with_the_seconds_it_had_left(
    flow, budgeted, tmp_path
):
    # `budgeted` compiled the step outside this test's budget, also where this test
    # runs without the others (alone, or on a worker of its own).
    del budgeted
    checkpoints = cnftrace.Checkpoints(str(tmp_path / "ckpt"), every=10)
    # Stopped by a step cap (as a killed run stops at its last checkpoint).
    _, first = _fit(flow, seconds=BUDGET, steps=30, checkpoints=checkpoints)
    assert first["step"][-1] == 30 and first["seconds"][-1] < BUDGET
    _, resumed = _fit(flow, seconds=BUDGET, checkpoints=checkpoints)
    assert resumed["step"][:30] == first["step"]
    assert resumed["seconds"][:30] == first["seconds"]
    # The clock goes on from the stored seconds, and stops at the budget.
    later = np.asarray(resumed["seconds"][30:])
    assert later[0] >= round(first["seconds"][-1], 3) and later[-1] >= BUDGET
    assert later[-3] < BUDGET
    # The schedule goes on too: step 31 is the 31st of the warmup, not the first.
    step, spent = np.asarray(resumed["step"]), np.asarray(resumed["budget_spent"])
    assert step[30] == 31 and spent[30] >= spent[29]
    np.testing.assert_allclose(resumed["lr"], _closed_form_rate(step, spent), rtol=1e-6)
    # A spent budget trains no more; another budget is another run.
    _, again = _fit(flow, seconds=BUDGET, checkpoints=checkpoints)
    assert again["step"] == resumed["step"]
    with pytest.raises(cnftrace.CheckpointError, match="fit.seconds"):
        _fit(flow, seconds=2 * BUDGET, checkpoints=checkpoints)


def test_a_budget_on_a_cpu_trains_on_smaller_batches_and_says_so(capsys, monkeypatch):
    """Under `seconds`, maximum likelihood on a CPU above `WIDTH_BY_DIM`'s first size
    draws `BUDGET_BATCH_SIZE` samples a step unless told otherwise, and `fit` says
    so in one line; below, without a budget, on a GPU or TPU, or by another
    objective, the batch stays `BATCH_SIZE`."""
    wide = WIDTH_BY_DIM[0][0] + 1
    assert default_batch_size(wide, True, True, "cpu") == BUDGET_BATCH_SIZE < BATCH_SIZE
    assert default_batch_size(40, True, True, "cpu") == BUDGET_BATCH_SIZE
    for other in (
        (wide - 1, True, True, "cpu"),
        (wide, False, True, "cpu"),
        (wide, True, False, "cpu"),
        (wide, True, True, "gpu"),
        (wide, True, True, "tpu"),
    ):
        assert default_batch_size(*other) == BATCH_SIZE, other

    sizes = set()

    def data(key, n):
        sizes.add(n)
        return jr.normal(key, (n, wide))

    field = cnftrace.MLPField(wide, width=8, depth=1, key=jr.key(0))
    narrow = cnftrace.CNF(field, wide, t1=0.5, rtol=1e-3, atol=1e-3)
    key, budget = jr.key(1), dict(seconds=100.0, steps=1, optimizer=OPTIMIZER)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # also on a GPU
    cnftrace.fit(narrow, data, key=key, **budget)
    assert BUDGET_BATCH_SIZE in sizes and BATCH_SIZE not in sizes, sizes
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fit:")]
    assert len(said) == 1 and f"batches of {BUDGET_BATCH_SIZE}" in said[0], said


def test_a_resumed_run_keeps_the_batch_it_started_with(flow, tmp_path):
    """A run resumed without `batch_size` goes on with its checkpoints' batch, where
    `fit`'s default would choose another (as on another kind of device)."""
    checkpoints = cnftrace.Checkpoints(str(tmp_path / "ckpt"), every=5)
    _, first = _fit(flow, seconds=BUDGET, steps=5, checkpoints=checkpoints)
    sizes = set()

    def data(key, n):
        sizes.add(n)
        return _data(key, n)

    _, resumed = cnftrace.fit(
        flow, data, key=jr.key(1), seconds=BUDGET, steps=8, optimizer=OPTIMIZER,
        checkpoints=checkpoints, progress=False,
    )  # fmt: skip
    assert sizes == {32} and resumed["step"][:5] == first["step"]
    assert resumed["step"][-1] == 8


def test_train_minutes_writes_its_budget_and_seconds(tmp_path, capsys):
    run = str(tmp_path / "run")
    tiny = ["--width", "8", "--depth", "1", "--batch-size", "64", "--no-progress"]
    args = ["train", "--run-dir", run, "--minutes", "0.02", *tiny]
    assert main(args) == 0
    assert "s of 0.02 minutes" in capsys.readouterr().out
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    budget = 0.02 * 60
    assert config["minutes"] == 0.02 and config["steps"] is None
    assert config["seconds"] == records[-1]["seconds"] >= budget
    assert all(r["budget"] == budget for r in records)
    # The same command resumes, with no seconds left: it trains no more.
    assert main(args) == 0
    assert "had already trained" in capsys.readouterr().out
    # Another budget is another run's.
    with pytest.raises(SystemExit, match="--minutes is part of a run"):
        main(["train", "--run-dir", run, "--minutes", "0.05", *tiny])
