"""The B2 benchmark (experiments/bench/b2.py) on tiny settings: it returns what the
zuko peer's B2 returns, with a curve that moves forward in time."""

import math

import pytest

from experiments import _common
from experiments.bench import b2

# The keys of `zuko_peer.zuko_b2`'s result (not imported: torch is optional).
ZUKO_KEYS = {
    "system",
    "dataset",
    "solver",
    "notes",
    "curve",
    "time_to_gap",
    "best_gap",
    "steps",
    "floor",
    "test_true_nll",
    "threads",
}


@pytest.mark.slow  # one compilation of the training step and of the evaluation
def test_b2_structure():
    seen = []
    r = b2.cnftrace_b2(
        "8gaussians",
        budget_s=4.0,  # compiling the step takes most of it
        eval_every_s=0.5,
        test_size=200,
        batch=32,
        check_every=2,
        on_eval=seen.append,
    )
    assert set(r) == ZUKO_KEYS | {"settings", "nfe_log_prob", "nfe_sample"}
    assert r["system"].startswith("cnftrace ")
    assert r["dataset"] == "8gaussians"
    assert r["floor"] == _common.B2_FLOOR["8gaussians"]
    assert r["settings"]["batch"] == 32
    assert r["steps"] >= 1 and r["steps"] % 2 == 0
    assert set(r["time_to_gap"]) == set(_common.B2_GAPS)

    curve = r["curve"]
    assert curve and len(seen) == len(curve)
    times = [t for t, _ in curve]
    assert all(t > 0 for t in times)
    assert all(a < b for a, b in zip(times, times[1:]))
    assert all(isinstance(nll, float) and math.isfinite(nll) for _, nll in curve)
    assert r["best_gap"] == min(nll for _, nll in curve) - r["floor"]
    assert times[-1] >= 4.0 or r["best_gap"] <= 0.05
    for gap, t in r["time_to_gap"].items():
        assert t is None or (t in times and r["best_gap"] <= gap)

    # The true density scores the 200 test points near the floor.
    assert abs(r["test_true_nll"] - r["floor"]) < 0.3
    assert [e["step"] for e in seen] == sorted(e["step"] for e in seen)
    assert [e["train_s"] for e in seen] == times


def test_b2_rejects_unknown_dataset():
    with pytest.raises(ValueError, match="dataset"):
        b2.cnftrace_b2("moons", budget_s=1.0)
