"""experiments/ffjord_tabular.py: smoke runs on synthetic files in MAF's formats and
on a scikit-learn set, its learning-rate stages, time budget and resume (with a
stand-in for `fit`), and its errors."""

import importlib.util
import json
import math
import os

import jax.random as jr
import numpy as np
import pytest
from _formats import WRITERS
from _paths import ROOT

import cnftrace

SIZES = {  # large enough for 64 validation and test rows after MAF's splits
    "power": {"n": 1000},
    "gas": {"n": 800},
    "hepmass": {"n_train": 1400, "n_test": 200},
    "miniboone": {"n": 800},
    "bsds300": {"sizes": (100, 64, 64)},
}


@pytest.fixture(scope="module")
def script():
    path = os.path.join(ROOT, "experiments", "ffjord_tabular.py")
    spec = importlib.util.spec_from_file_location("ffjord_tabular", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _saved(out, stem):
    with open(out / f"{stem}.json") as f:
        payload = json.load(f)
    return payload, (out / f"{stem}.md").read_text()


@pytest.mark.slow  # compiles a training step and two exact-trace evaluations
@pytest.mark.parametrize("name", sorted(SIZES))
def test_maf_set_quick(script, tmp_path, capsys, name):
    data = tmp_path / "data"
    WRITERS[name](data, **SIZES[name])
    out = tmp_path / "out"
    argv = ["--data", name, "--data-dir", str(data), "--quick", "--out", str(out)]
    (result,) = script.main(argv)
    payload, table = _saved(out, f"ffjord_tabular_{name}_quick")
    saved = payload["results"][0]
    assert saved["data"] == name and saved["dim"] == cnftrace.datasets.UCI_DIMS[name]
    for key in ("test_nll", "test_stderr", "gaussian_nll", "minus_gaussian"):
        assert math.isfinite(saved[key]), key
    assert saved["test_nll"] == pytest.approx(result["test_nll"])
    assert saved["test_nfe"] > 0 and saved["steps"] == 6
    assert saved["stopped"] == "step budget"
    assert len(saved["t1"]) == 1 and saved["t1"][0] > 0
    published = script.PUBLISHED[name]
    assert saved["published"] == published
    row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
    assert f"| {published:.2f} |" in row
    assert f"| {saved['test_nll'] - published:+.2f} |" in row
    assert row in capsys.readouterr().out  # the table is printed too


@pytest.mark.slow  # compiles a training step and two exact-trace evaluations
def test_sklearn_quick_and_resume(script, tmp_path, capsys):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    argv = ["--data", "wine", "--quick", "--out", str(out)]
    (first,) = script.main(argv + ["--checkpoint-dir", str(ckpt)])
    payload, table = _saved(out, "ffjord_tabular_wine_quick")
    saved = payload["results"][0]
    assert saved["published"] is None and saved["sizes"][0] == 125
    assert math.isfinite(saved["test_nll"]) and math.isfinite(saved["gaussian_nll"])
    assert "| wine | 13 |" in table and "Gaussian" in table
    assert os.path.exists(ckpt / "wine" / "stage0" / "finished.json")
    # A rerun with the same checkpoints trains nothing and gives the same model.
    (again,) = script.main(argv + ["--checkpoint-dir", str(ckpt)])
    assert again["test_nll"] == first["test_nll"] and again["steps"] == 6
    assert again["train_seconds"] < 10
    assert "wine: test NLL" in capsys.readouterr().out


# The set and step of the quick run above: with the shared compilation cache, the
# suite compiles the step once.
@pytest.mark.slow  # compiles a training step
def test_time_steps_reports_seconds_per_step(script, tmp_path):
    argv = [
        "--data",
        "wine",
        "--quick",
        "--time-steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    (result,) = script.main(argv)
    payload, table = _saved(tmp_path, "ffjord_tabular_wine_quick_timing")
    saved = payload["timing"][0]
    assert saved["batch"] == 64 and len(saved["nfe_forward"]) == 2
    assert 0 < saved["seconds_per_step"] < saved["first_step_seconds"]
    assert saved["cpu_seconds_per_step"] > 0
    assert table.startswith("| data | d | batch |") and "| wine | 13 | 64 |" in table


# ------------------------------------------------------------------ stages, budget


class FakeFit:
    """Stands in for `cnftrace.fit`: returns `("flow", lr, validations)` as the
    trained flow, and a history whose validation NLLs, one every 10 steps, are the
    next of `curves`; a rerun in the same checkpoint directory gets the same curve.
    Calls `on_log` with each validation record and one plain record after it."""

    def __init__(self, curves, stored=None):
        self.curves, self.calls = list(curves), []
        self.stored = {} if stored is None else stored

    def __call__(self, flow, data, *, steps, on_log=None, **kw):
        lr = kw["optimizer"]  # `optax.adam` is patched to return its learning rate
        patience = kw["validation"].patience
        call = {"flow": flow, "lr": lr, "steps": steps, "patience": patience}
        self.calls.append(call | kw)
        directory = kw["checkpoints"].directory
        if directory not in self.stored:
            self.stored[directory] = self.curves.pop(0)
        vals = [v for i, v in enumerate(self.stored[directory]) if 10 * i < steps]
        at = [10 * (i + 1) for i in range(len(vals))]
        for step, v in zip(at, vals):
            if on_log is not None:
                on_log({"step": step, "val_nll": v, "nfe": 20})
                on_log({"step": step + 1, "nfe": 20})
        hist = {"step": at, "val_step": at, "val_nll": vals, "nfe": [20] * len(at)}
        return ("flow", lr, len(vals)), dict(hist, seconds=[1.0] * len(at))


@pytest.fixture
def patched(script, monkeypatch):
    def install(fake):
        monkeypatch.setattr(script.cnftrace, "fit", fake)
        monkeypatch.setattr(script.optax, "adam", lambda lr: lr)
        return fake

    return install


def _args(script, *extra):
    args, _, _ = script.parse(["--data", "wine", *extra])
    return args


def test_stage_plan_is_ffjords_rule(script):
    assert script.stage_plan(30) == [(1.0, 11), (0.1, 10), (0.01, 10)]
    assert sum(p for _, p in script.stage_plan(30)) == 31  # stop at counter > 30
    assert script.stage_plan(3) == [(1.0, 2), (0.1, 1), (0.01, 1)]
    assert script.stage_plan(1) == [(1.0, 1), (0.01, 1)]


def test_stages_continue_from_the_best(script, tmp_path, patched):
    # Stage 0 stops early (11 validations after its best at the first one); stage 1
    # is worse throughout, stage 2 best: the result is stage 2's flow.
    fake = patched(FakeFit([[5.0] + [6.0] * 11, [5.5] * 11, [4.0, 4.5] + [4.6] * 9]))
    args = _args(script)
    setting = script.SETTINGS["wine"]
    splits = cnftrace.datasets.Splits(np.zeros((5, 13)), np.zeros((3, 13)), None)
    flow, best, stages, reason = script.train(
        "init", splits, setting, args, jr.key(0), str(tmp_path)
    )
    assert [c["lr"] for c in fake.calls] == [1e-3, 1e-4, 1e-5]
    assert [c["patience"] for c in fake.calls] == [11, 10, 10]
    assert fake.calls[0]["flow"] == "init"
    assert fake.calls[1]["flow"] == ("flow", 1e-3, 12)  # the best so far
    assert fake.calls[2]["flow"] == ("flow", 1e-3, 12)  # stage 1 was no better
    assert flow == ("flow", 1e-5, 11) and best == 4.0
    assert [s["steps"] for s in stages] == [120, 110, 110]
    assert reason == "early stopping"
    # Every stage left its marker; a rerun loads the stages without training.
    again = patched(FakeFit([], stored=fake.stored))
    out = script.train("init", splits, setting, args, jr.key(0), str(tmp_path))
    assert out[0] == flow and [c["steps"] for c in again.calls] == [120, 110, 110]


def test_step_budget_ends_the_stages(script, tmp_path, patched):
    fake = patched(FakeFit([[5.0, 4.0, 3.0]]))
    args = _args(script, "--max-steps", "30")
    splits = cnftrace.datasets.Splits(np.zeros((5, 13)), np.zeros((3, 13)), None)
    _, best, stages, reason = script.train(
        "init", splits, script.SETTINGS["wine"], args, jr.key(0), str(tmp_path)
    )
    assert len(fake.calls) == 1 and fake.calls[0]["steps"] == 30
    assert reason == "step budget" and best == 3.0 and stages[0]["steps"] == 30


def test_time_budget_keeps_the_last_validation(script, tmp_path, patched):
    fake = patched(FakeFit([[5.0, 4.0, 3.0, 2.0]]))
    args = _args(script, "--max-minutes", "0")
    splits = cnftrace.datasets.Splits(np.zeros((5, 13)), np.zeros((3, 13)), None)
    flow, best, stages, reason = script.train(
        "init", splits, script.SETTINGS["wine"], args, jr.key(0), str(tmp_path)
    )
    # The first validation is past the budget; the next record raises, and the
    # stage is reloaded at that validation's checkpoint (step 10).
    assert [c["steps"] for c in fake.calls] == [10**9, 10]
    assert reason == "time budget" and best == 5.0 and stages[0]["steps"] == 10
    assert not os.path.exists(tmp_path / "stage0" / "finished.json")


# ------------------------------------------------------------------ errors


def test_maf_set_needs_a_data_dir(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--data", "gas", "--out", str(tmp_path)])
    assert "--data-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--data", "gas", "--data-dir", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert "nowhere" in err and "1161203" in err


def test_missing_file_says_where_to_get_it(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--data", "hepmass", "--data-dir", str(tmp_path), "--quick"])
    err = capsys.readouterr().err
    assert "--data-dir" in err and "1000_train.csv" in err and "zenodo" in err


def test_bad_arguments(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        script.main(["--data", "higgs"])
    assert "invalid choice: 'higgs'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        script.main(["--data", "wine", "--data-dir", str(tmp_path)])
    assert "MAF sets only" in capsys.readouterr().err
    for flag, value in (("--max-steps", "0"), ("--atol", "0"), ("--max-minutes", "-1")):
        with pytest.raises(SystemExit):
            script.main(["--data", "wine", flag, value])
        assert flag in capsys.readouterr().err
