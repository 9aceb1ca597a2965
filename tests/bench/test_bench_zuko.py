"""The zuko peer of the benchmark suite runs and reports what the scripts expect.

Skipped where the `bench` extra (torch, zuko) is not installed.
"""

import pytest

pytest.importorskip("torch")
pytest.importorskip("zuko")

from experiments import _common  # noqa: E402
from experiments.bench import zuko_peer  # noqa: E402


def _positive_count(value) -> bool:
    return isinstance(value, float) and value > 0 and value == int(value)


@pytest.mark.parametrize("exact", [True, False])
def test_b1_structure(exact):
    r = zuko_peer.zuko_b1(exact=exact, iters=3, batch=64, threads=1)
    assert r["system"].startswith("zuko ")
    assert r["estimator"] == ("exact" if exact else "hutchinson (gaussian probe)")
    assert isinstance(r["solver"], str) and r["solver"]
    assert len(r["iter_times"]) == 3
    assert all(t > 0 for t in r["iter_times"])
    assert r["first_step_s"] == r["iter_times"][0]
    # Three iterations: the window is the last one.
    assert r["s_per_iter"] == r["iter_times"][-1]
    # Dopri5 without FSAL: 7 evaluations per attempted forward step, 6 per backward.
    assert _positive_count(r["nfe_fwd"]) and r["nfe_fwd"] % 7 == 0
    assert _positive_count(r["nfe_bwd"]) and r["nfe_bwd"] % 6 == 0


def test_window_values():
    assert _common.window_values([1.0, 2.0, 3.0]) == [3.0]
    assert _common.window_values(list(range(130))) == list(range(20, 120))
    with pytest.raises(ValueError):
        _common.window_values([])


def test_b2_structure():
    r = zuko_peer.zuko_b2(
        "8gaussians", budget_s=1.5, eval_every_s=0.5, test_size=128, batch=64, threads=1
    )
    assert r["dataset"] == "8gaussians"
    assert r["steps"] >= 1
    assert set(r["time_to_gap"]) == {0.15, 0.05}
    curve = r["curve"]
    assert curve
    times = [t for t, _ in curve]
    assert all(t > 0 for t in times) and times == sorted(times)
    assert all(isinstance(nll, float) and nll == nll for _, nll in curve)
    assert r["best_gap"] == min(nll for _, nll in curve) - r["floor"]
    assert times[-1] >= 1.5 or r["best_gap"] <= 0.05
