"""B5's smoke test: both halves with tiny budgets (d = 2 and a few steps; iris through
`cnftrace train` with a few steps), checking what the results hold, that every
baseline's NLL is finite and that the Gaussian baseline is eval.json's. zuko's parts
run where the bench extra is installed and are reported missing where it is not."""

import math

import jax
import numpy as np
import pytest

import cnftrace
from experiments import _common
from experiments.bench import b5


def _zuko() -> bool:
    """Whether zuko's peer imports (the bench extra is installed), as b5 sees it."""
    return _common.zuko_peer_module()[0] is not None


# Both halves run as users run them, in JAX's default float32 (a run of the command
# line, trained in float32, is loaded into a float32 flow). The dims half's steps and
# test set are the GPU smoke run's (tests/bench/test_bench_gpu.py): with the shared
# compilation cache, the suite compiles their programs once.
@pytest.fixture(scope="module")
def dims_result():
    with jax.enable_x64(False):
        return b5.run_dims((2,), steps=3, test_size=64, peer_seconds=0.3)


@pytest.fixture(scope="module")
def files_result(tmp_path_factory):
    work = tmp_path_factory.mktemp("b5")
    with jax.enable_x64(False):
        return b5.run_files(("iris",), str(work), ("--steps", "3"), peer_seconds=0.3)


def _finite_nll(result: dict) -> bool:
    return math.isfinite(result["nll"]) and result["stderr"] > 0


def test_dims_half(dims_result):
    row = dims_result["2"]
    assert row["dim"] == 2 and row["n_test"] == 64
    assert row["density"] == "warped_product(dim=2, seed=0)"
    assert math.isfinite(row["test_true_nll"])
    ours = row["cnftrace"]
    assert math.isfinite(ours["gap"]) and ours["gap_se"] > 0 and ours["train_s"] > 0
    recipe = ours["recipe"]
    assert recipe["steps"] == 3 and recipe["blocks"] >= 1 and recipe["params"] > 0
    assert recipe["depth"] >= 1 and recipe["width"]
    # The batch is what fit asked the sampler for: without a budget, the recipe's.
    assert recipe["batch"] == cnftrace.default_recipe(2).batch_size
    for model in b5.PEERS:
        peer = row[f"zuko_{model}"]
        assert ("missing" in peer) == (not _zuko())
    table = b5.dims_markdown(dims_result)
    assert table.splitlines()[2].startswith("| 2 | ")
    assert "warped_product" in b5.section_markdown("dims", dims_result, "cmd")


def test_files_half(files_result):
    row = files_result["iris"]
    assert (row["rows"], row["columns"], row["split"]) == (150, 4, [120, 15, 15])
    m = row["methods"]
    ours = m["cnftrace"]
    assert ours["command"].endswith("--steps 3")
    assert ours["steps_done"] == 3 and ours["train_s"] > 0
    assert ours["eval"]["n"] == 15 and ours["eval"]["units"] == "data"
    assert math.isfinite(ours["nll"]) and ours["stderr"] > 0
    # The run's per-row log-densities, recomputed here, give eval.json's NLL.
    assert ours["nll_reloaded"] == pytest.approx(ours["nll"], rel=1e-4, abs=1e-4)
    for method in ("gmm_bic", "kde_cv", "gaussian"):
        assert _finite_nll(m[method]), method
    # The Gaussian baseline is eval.json's, on the same split.
    assert abs(m["gaussian"]["minus_eval_json"]) < 1e-6
    assert m["gaussian"]["nll"] == pytest.approx(
        ours["eval"]["gaussian_baseline_nll"], abs=1e-6
    )
    assert m["gmm_bic"]["components"] in _common.GMM_COMPONENTS
    assert m["kde_cv"]["bandwidth"] in _common.KDE_BANDWIDTHS
    assert ("missing" in m["zuko_nsf"]) == (not _zuko())
    gap = row["cnftrace_minus_gmm"]
    assert gap["gap"] == pytest.approx(ours["nll_reloaded"] - m["gmm_bic"]["nll"])
    assert gap["se"] > 0
    table = b5.files_markdown(files_result)
    assert "| iris | 150 × 4 | 120/15/15 |" in table and "--steps 3" in table


def test_zuko_parts(dims_result, files_result):
    pytest.importorskip("torch")
    pytest.importorskip("zuko")
    for model in b5.PEERS:
        peer = dims_result["2"][f"zuko_{model}"]
        assert math.isfinite(peer["gap"]) and peer["gap_se"] > 0
        assert peer["steps_done"] >= 1 and peer["train_s"] >= 0.3
    nsf = files_result["iris"]["methods"]["zuko_nsf"]
    assert _finite_nll(nsf)
    assert 0 <= nsf["best_step"] <= nsf["steps_done"]
    assert np.isfinite(nsf["best_val_nll"])


def test_tables_are_real_measurements():
    # The files half's tables load without downloads and hold finite numbers (those
    # of statsmodels and vega_datasets where the bench extra installed them).
    for name, (load, source, holds) in _common.TABLES.items():
        try:
            data, names = load()
        except ModuleNotFoundError as e:
            assert e.name in ("statsmodels", "vega_datasets"), name
            continue
        assert data.ndim == 2 and data.shape[1] == len(names), name
        assert data.shape[0] >= 100 and np.isfinite(data).all(), name
        assert source and holds


def test_unknown_file_is_refused():
    with pytest.raises(SystemExit):
        b5.main(["--half", "files", "--files", "nope"])
