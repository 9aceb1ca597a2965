"""experiments/ffjord_toy.py end to end at its smoke settings."""

import importlib.util
import json
import math
import os

import pytest
from _paths import ROOT


@pytest.fixture(scope="module")
def toy():
    path = os.path.join(ROOT, "experiments", "ffjord_toy.py")
    spec = importlib.util.spec_from_file_location("ffjord_toy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_run_writes_table_json_and_figure(toy, tmp_path, capsys):
    (r,) = toy.main(["--quick", "--data", "checkerboard", "--out", str(tmp_path)])
    assert r["data"] == "checkerboard"
    assert math.isfinite(r["test_nll"]) and r["test_stderr"] > 0
    assert r["gap"] == pytest.approx(r["test_nll"] - math.log(32))
    assert r["eval_nfe"] > 0 and r["sample_nfe"] > 0
    # checkerboard's recipe: a flow-matching warm start, then maximum likelihood.
    assert r["stages"] == "3 × 512 FM + 3 × 256 MLE"
    with open(tmp_path / "ffjord_toy.json") as f:
        saved = json.load(f)
    assert saved["results"] == [r] and "jax" in saved["environment"]
    table = (tmp_path / "ffjord_toy.md").read_text()
    assert "| checkerboard | 3.4657 |" in table  # log 32, closed form
    assert "≤ 0.05: **missed**" in table  # three smoke steps miss the target
    assert (tmp_path / "ffjord_toy.png").stat().st_size > 1000
    assert "test NLL" in capsys.readouterr().out
    # Leftover temporary files would mean a non-atomic write.
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]

    # --resume keeps finished data sets (here: all of them) instead of training.
    again = toy.main(
        ["--quick", "--data", "checkerboard", "--resume", "--out", str(tmp_path)]
    )
    assert again == saved["results"]
    assert "kept from" in capsys.readouterr().out
    assert (tmp_path / "ffjord_toy_models" / "checkerboard.eqx").exists()

    # A resumed run over other data sets keeps the earlier ones in the results.
    other = dict(r, data="moons")
    toy.save(str(tmp_path / "ffjord_toy"), [other], {"checkerboard": r}, "cnftrace")
    with open(tmp_path / "ffjord_toy.json") as f:
        assert [x["data"] for x in json.load(f)["results"]] == ["moons", "checkerboard"]

    # Numerical entropies are starred; a met target says so.
    rows = [dict(r, data="rings", entropy_is_closed_form=False)]
    rows.append(dict(r, data="8gaussians", gap=0.01))
    table = toy.table(rows, "cnftrace")
    assert "| rings | 3.4657* |" in table and "≤ 0.05: met" in table
    assert "cnftrace's recipe" in table
    assert "FFJORD's toy model" in toy.table(rows, "ffjord")


def test_bad_arguments_are_refused_by_name(toy, tmp_path, capsys):
    with pytest.raises(SystemExit):
        toy.main(["--data", "spiral", "--out", str(tmp_path)])
    assert "--data: unknown ['spiral']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        toy.main(["--steps", "0", "--out", str(tmp_path)])
    assert "--steps must be positive" in capsys.readouterr().err
