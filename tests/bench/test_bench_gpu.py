"""The GPU run (experiments/bench/gpu.py) with `--smoke` on the CPU: tiny sizes, every
part run, its tables written; and without `--smoke` it refuses a machine where jax has
no GPU instead of timing the CPU."""

import json
import math

import jax
import pytest

from experiments.bench import gpu


@pytest.mark.slow  # compiles B1's step, a default flow's (one program twice), log_prob
def test_smoke_runs_every_part_and_writes_its_tables(tmp_path):
    stem = str(tmp_path / "gpu")
    assert gpu.main(["--smoke", "--out", stem]) == 0
    with open(stem + ".json") as f:
        res = json.load(f)
    assert list(res["b1"]) == list(gpu.SMOKE["estimators"]) == ["hutchinson"]
    assert list(gpu.FULL["estimators"]) == ["hutchinson", "exact"]
    for row in res["b1"].values():
        ours = row["cnftrace"]
        assert ours["s_per_iter"] > 0 and ours["nfe_fwd"] > 0
        # zuko ran on the CPU where installed, or its row says why not.
        assert "missing" in row["zuko"] or row["zuko"]["iters_done"] >= 1
        # JAX's default precision beside cnftrace's: the CPU computes float32
        # products in float32 either way, so the solves take the same steps.
        theirs = row["cnftrace_jax_precision"]
        assert theirs["system"].endswith("JAX's matmul precision")
        assert theirs["nfe_fwd"] == ours["nfe_fwd"]
        assert theirs["nfe_bwd"] == ours["nfe_bwd"]
    (row,) = res["b5"].values()
    ours = row["cnftrace"]
    assert row["dim"] == 2 and ours["recipe"]["steps"] == gpu.SMOKE["probe_steps"]
    assert math.isfinite(ours["gap"]) and ours["gap_se"] > 0
    assert row["probe_s_per_step"] > 0
    with open(stem + ".md") as f:
        text = f.read()
    assert "## B1 on the GPU" in text and "## B5's constructed densities" in text
    assert "| hutchinson | cnftrace" in text and "| 2 | " in text


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="this machine has a GPU")
def test_a_full_run_needs_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--out", str(tmp_path / "gpu")])
    assert e.value.code == 2
    assert "--smoke" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_budgets_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--smoke", "--budget-b1", "0"])
    assert "--budget-b1 must be positive" in capsys.readouterr().err
