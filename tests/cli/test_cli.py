"""The command line, end to end on tiny settings."""

import json
import os

import numpy as np
import pytest

import cnftrace
from cnftrace.cli import main
from cnftrace.datasets import load_tabular

TINY = ["--steps", "12", "--width", "8", "--depth", "1", "--batch-size", "64"]


def test_train_eval_sample_plot(tmp_path, capsys):
    # As in the README (`--run-dir runs/8g`): a run directory's missing parents are
    # made with it.
    run = str(tmp_path / "runs" / "run")
    assert main(["train", "--run-dir", run, "--checkpoint-every", "5", *TINY]) == 0
    # One history file (metrics.jsonl) and one lock (the run directory's) for a run.
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == [
        "step_000000005.ckpt",
        "step_000000010.ckpt",
        "step_000000012.ckpt",
    ]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert {"loss", "nfe", "nfe_backward", "seconds", "skipped"} <= set(records[0])
    # Tsit5 with the default adjoint: every evaluation but the initial-step
    # heuristic's is backpropagated.
    assert all(r["nfe_backward"] == r["nfe"] - 1 for r in records)
    with open(os.path.join(run, "config.json")) as f:
        assert json.load(f)["width"] == 8

    assert main(["eval", run, "--n", "500"]) == 0
    out = capsys.readouterr().out
    assert "test NLL" in out and "entropy 2.83" in out
    with open(os.path.join(run, "eval.json")) as f:
        result = json.load(f)
    assert result["step"] == 12 and result["n"] == 500
    assert result["gap"] == pytest.approx(result["test_nll"] - result["entropy"])

    # The run opens in Python in one line, as the command line itself opens it.
    flow, info = cnftrace.load(run, return_info=True)
    assert info["step"] == 12 and info["config"]["width"] == 8
    assert np.all(np.isfinite(flow.log_prob(np.zeros((3, 2)))))

    # As many samples as `plot` draws for a 2-D toy set (20,000), so that `plot`
    # reuses the solve `sample` compiled.
    assert main(["sample", run, "--n", "20000"]) == 0
    samples = np.load(os.path.join(run, "samples.npy"))
    assert samples.shape == (20000, 2) and np.all(np.isfinite(samples))

    assert main(["plot", run]) == 0
    assert sorted(os.listdir(os.path.join(run, "plots"))) == [
        "density.png",
        "training.png",
    ]

    # Other settings in the same run directory are refused, by name.
    with pytest.raises(SystemExit, match="width: 8 there, 16 now"):
        main(["train", "--run-dir", run, *TINY[:2], "--width", "16", *TINY[4:]])


def test_datasets_lists_every_built_in_set(capsys):
    assert main(["datasets"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 8 + 3 + 1  # a header, toy, scikit-learn, digits
    assert any(line.startswith("checkerboard") and "3.4657" in line for line in lines)
    wine = next(line.split() for line in lines if line.startswith("wine"))
    assert wine[1:3] == ["13", "178"]  # dimension and rows


def test_not_a_run_directory(tmp_path):
    with pytest.raises(SystemExit, match="not a cnftrace run directory"):
        main(["eval", str(tmp_path)])


def test_dataset_is_an_alias_of_data():
    from cnftrace.cli._main import make_parser

    for flag in ("--data", "--dataset"):
        args = make_parser().parse_args(
            ["train", flag, "checkerboard", "--run-dir", "x"]
        )
        assert args.data == "checkerboard"


def test_per_dataset_training_defaults():
    from cnftrace.cli._arguments import run_config
    from cnftrace.cli._main import make_parser

    def resolved(*argv):
        args = make_parser().parse_args(["train", "--run-dir", "x", *argv])
        config = run_config(args).resolved()
        return config.steps, config.batch_size

    assert resolved() == (2400, 128)
    assert resolved("--dataset", "checkerboard") == (8000, 256)
    assert resolved("--dataset", "checkerboard", "--steps", "10") == (10, 256)


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--run-dir", "x", "--data", "nonsense"])
    assert "Did you mean" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--run-dir", "x", "--data", "8gaussian"])
    err = capsys.readouterr().err
    assert "not a data set name nor a data file. Did you mean 8gaussians?" in err
    with pytest.raises(SystemExit, match="--steps must be at least 1"):
        main(["train", "--run-dir", "x", "--steps", "0"])


def test_help_names_every_command(capsys):
    """`cnftrace --help` in this process: `python -m cnftrace` and the installed
    `cnftrace` are this `main` (test_settings.py runs the first as a process, and
    test_run_config.py checks that the second is `main`)."""
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cnftrace")
    for command in ["train", "eval", "sample", "plot", "datasets"]:
        assert command in out


def test_tabular_and_digits_runs(tmp_path, capsys):
    # `sample` draws as many samples as `plot` does (wine's 26 test rows, a grid of
    # 64 digits), so that `plot` reuses its compiled solve.
    for data, extra, n in [("wine", [], 26), ("digits", ["--width", "16"], 64)]:
        run = str(tmp_path / data)
        args = ["--steps", "4", "--depth", "1", "--batch-size", "32", "--rtol", "1e-3"]
        args += ["--atol", "1e-3", "--checkpoint-every", "2"]
        args += extra or ["--width", "8"]
        assert main(["train", "--data", data, "--run-dir", run, *args]) == 0
        assert main(["eval", run]) == 0
        with open(os.path.join(run, "eval.json")) as f:
            result = json.load(f)
        assert np.isfinite(result["test_nll"])
        assert main(["sample", run, "--n", str(n)]) == 0
        assert main(["plot", run]) == 0
        plots = sorted(os.listdir(os.path.join(run, "plots")))
        if data == "wine":
            assert result["n"] == load_tabular("wine").test.shape[0] == 26
            assert "gaussian_baseline_nll" in result
            assert np.load(os.path.join(run, "samples.npy")).shape == (n, 13)
            assert plots == ["samples.png", "training.png"]  # test rows and samples
        else:
            assert 0 < result["gaussian_baseline_bits_per_dim"] < 10
            assert np.isfinite(result["bits_per_dim"])
            images = np.load(os.path.join(run, "samples.npy"))
            assert images.shape == (n, 8, 8) and images.min() >= 0 and images.max() <= 1
            assert plots == ["samples.png", "training.png"]
    out = capsys.readouterr().out
    assert "bits/dim" in out and "full-covariance Gaussian" in out


def test_train_with_rnode_and_learned_end_time(tmp_path, capsys):
    run = str(tmp_path / "rnode")
    args = ["train", "--run-dir", run, "--kinetic-energy", "0.1"]
    args += ["--jacobian-norm", "0.1", "--learn-t1", "--t1", "0.4", *TINY]
    assert main(args) == 0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert all(r["kinetic"] > 0 and r["jacobian"] > 0 for r in records)
    with open(os.path.join(run, "config.json")) as f:
        config = json.load(f)
    assert config["kinetic_energy"] == 0.1 and config["learn_t1"] is True
    # The trained end time is saved and loaded with the model.
    assert main(["eval", run, "--n", "200"]) == 0
    flow = cnftrace.load(run)
    assert flow.learn_t1 and 0 < float(flow.t1) != pytest.approx(0.4, abs=1e-9)
    with pytest.raises(SystemExit, match="kinetic-energy"):
        main(["train", "--run-dir", str(tmp_path / "bad"), "--kinetic-energy", "-1"])
