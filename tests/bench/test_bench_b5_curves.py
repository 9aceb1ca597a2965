"""B5's time to quality: the seconds-to-a-level and validation-pace helpers on
hand-made figures, and a smoke run of the command (d = 2, a budget of seconds, zuko's
NSF where the bench extra is installed) into a temporary directory that already holds
an earlier row."""

import json
import math
import os

import jax
import pytest

import cnftrace
from experiments import _common
from experiments.bench import b5_curves


def test_seconds_to_is_the_first_point_at_or_under():
    curve = [[0.0, 0, 2.0], [1.5, 10, 0.2], [3.0, 20, 0.08], [4.5, 30, 0.12]]
    curve.append([6.0, 40, 0.05])
    assert b5_curves.seconds_to(curve, 0.10) == 3.0  # not the later 0.05 point
    assert b5_curves.seconds_to(curve, 0.05) == 6.0  # at the level counts
    assert b5_curves.seconds_to(curve, 0.049) is None
    assert b5_curves.seconds_to([], 0.1) is None


def test_validation_every_spreads_the_budget():
    # First step 2.5 s (2 s of it compiling), then 0.5 s a step: a 100 s budget
    # holds (100 - 2) / 0.5 = 196 steps, 15 apart for 13 validations.
    seconds = [2.5, 3.0, 3.5, 4.0]
    assert b5_curves.validation_every(seconds, 100.0, validations=13) == 15
    assert b5_curves.validation_every(seconds, 100.0, validations=196) == 1
    assert b5_curves.validation_every(seconds, 1.0) == 1  # spent on compiling
    assert b5_curves.validation_every([5.0], 3.0) == 1  # one step in the budget


EARLIER = {  # a row of an earlier run, which the smoke run must keep
    "dim": 3,
    "budget_s": 1.0,
    "n_curve": 10,
    "cnftrace": {
        "curve": [[0.0, 0, 1.0], [1.0, 5, 0.04]],
        "recipe": {"width": 8, "depth": 1, "batch": 4},
        "seconds_to": {"0.1": 1.0, "0.05": 1.0},
        "gap": 0.03,
        "gap_se": 0.01,
        "steps_done": 5,
    },
}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("b5_curves")
    with open(out / "b5_curves.json", "w") as f:
        json.dump({"3": EARLIER}, f)
    argv = ["--dims", "2", "--seconds", "1", "--curve-size", "200"]
    argv += ["--test-size", "500", "--peers", "nsf", "--every", "20", "--seed", "3"]
    with jax.enable_x64(False):  # as users run it
        b5_curves.main([*argv, "--out-dir", str(out)])
    with open(out / "b5_curves.json") as f:
        return out, json.load(f)


def test_smoke_run_writes_the_results(smoke):
    out, res = smoke
    assert list(res) == ["2", "3"]  # the earlier row kept, rows in order of d
    assert res["3"] == EARLIER
    row = res["2"]
    assert (row["dim"], row["budget_s"], row["n_curve"]) == (2, 1.0, 200)
    assert row["seed"] == 3
    ours = row["cnftrace"]
    assert ours["recipe"]["batch"] > 0 and ours["every"] == 20
    assert ours["train_s"] >= 1.0  # fit trains until the budget is spent
    seconds = [s for s, _, _ in ours["curve"]]
    steps = [step for _, step, _ in ours["curve"]]
    assert seconds[0] == 0.0 and steps[0] == 0 and steps[-1] == ours["steps_done"]
    assert all(a < b for a, b in zip(seconds, seconds[1:]))
    assert all(a < b for a, b in zip(steps, steps[1:]))
    assert seconds[-1] == ours["train_s"]
    assert math.isfinite(ours["gap"]) and ours["gap_se"] > 0
    for level, s in ours["seconds_to"].items():
        assert s == b5_curves.seconds_to(ours["curve"], float(level))
    table = (out / "b5_curves.md").read_text()
    assert "| 2 | cnftrace (" in table and "| 3 | cnftrace (8×1, batch 4) |" in table
    png = (out / b5_curves.IMAGE).read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]
    zuko = _common.zuko_peer_module()[0] is not None
    assert ("missing" in row["zuko_nsf"]) == (not zuko)
    assert "zuko_cnf" not in row


def test_zuko_curve(smoke):
    pytest.importorskip("torch")
    pytest.importorskip("zuko")
    _, res = smoke
    ours, peer = res["2"]["cnftrace"], res["2"]["zuko_nsf"]
    assert peer["train_s"] >= 1.0 and math.isfinite(peer["gap"])
    # Scored after the first step past each of cnftrace's seconds, and at the end.
    seconds = [s for s, _, _ in peer["curve"]]
    asked = [s for s, _, _ in ours["curve"]]
    assert all(a < b for a, b in zip(seconds, seconds[1:]))
    assert seconds[0] >= asked[0] and seconds[-1] == peer["train_s"]
    assert peer["curve"][-1][1] == peer["steps_done"]


def test_bad_arguments_are_refused(tmp_path):
    for argv in (
        ["--seconds", "0"],
        ["--peers", "maf"],
        ["--dims", "two"],
        ["--fm-share", "1.5"],
        ["--candidate", "width=0"],
        ["--candidate", "depth=2"],
    ):
        with pytest.raises(SystemExit):
            b5_curves.main([*argv, "--out-dir", str(tmp_path)])
    assert os.listdir(tmp_path) == []


def test_the_candidate_is_named_by_its_share():
    fm = {"recipe": {"fm_share": 0.2}}
    assert b5_curves._label("cnftrace_fm", fm) == (
        "cnftrace, flow matching 20% then likelihood"
    )
    alone = {"recipe": {"fm_share": 1}}
    assert b5_curves._label("cnftrace_fm", alone) == "cnftrace, flow matching alone"
    assert b5_curves._label("cnftrace", {"recipe": {}}) == "cnftrace"
    assert b5_curves._label("zuko_nsf", {}) == "zuko NSF"


def test_candidate_settings_are_parsed_applied_and_named():
    settings = b5_curves.parse_settings("tolerance=0.01,probes=2,batch=256")
    assert settings == {"tolerance": 0.01, "probes": 2, "batch": 256}
    assert [type(v) for v in settings.values()] == [float, int, int]
    for bad, words in (
        ("width=1.5", "whole number"),
        ("width=-8", "positive"),
        ("tolerance=inf", "positive"),
        ("width=8,width=16", "each once"),
        ("depth=2", "NAME=VALUE"),
        ("width", "NAME=VALUE"),
    ):
        with pytest.raises(ValueError, match=words):
            b5_curves.parse_settings(bad)
    batch, objective = b5_curves._batch_and_objective(settings)
    assert batch == 256 and isinstance(objective, cnftrace.MaximumLikelihood)
    assert objective.tolerance == 0.01 and objective.estimator.num_probes == 2
    default = cnftrace.MaximumLikelihood()
    assert objective.estimator.sampler == default.estimator.sampler
    # The tolerance alone keeps maximum likelihood's own estimator.
    _, loose = b5_curves._batch_and_objective({"tolerance": 0.1})
    assert loose.estimator == default.estimator and loose.tolerance == 0.1
    # Neither probes nor tolerance: `fit` keeps its own objective (by dimension).
    assert b5_curves._batch_and_objective({"width": 128}) == (None, None)
    key = b5_curves.candidate_key(settings)
    assert key == "cnftrace_batch256_probes2_tolerance0.01"
    result = {"recipe": {"settings": settings}, "curve": []}
    assert b5_curves._label(key, result) == (
        "cnftrace, tolerance 0.01, probes 2, batch 256"
    )
    row = {"zuko_nsf": {"curve": []}, key: result, "cnftrace": {"curve": []}}
    assert [k for k, _ in b5_curves._systems(row)] == ["cnftrace", "zuko_nsf", key]
