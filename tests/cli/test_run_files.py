"""A run on a user's file, end to end: the columns it stores, headers said, the same
file twice, the baseline where the covariance is singular, a run without its
history, samples drawn in chunks, empty paths, the step-limit advice, `load`,
settings that do nothing, compressed files and more steps on a finished run. One
tiny flow-matching run on a file is shared by the file and copied where a test
changes it; everything else is read, checked or refused without training."""

import bz2
import dataclasses
import gzip
import hashlib
import json
import lzma
import math
import os
import shutil
import zipfile

import jax
import jax.random as jr
import numpy as np
import pytest
from _cli import csv_text, dependent_table, fails, read_fails, write_file

import cnftrace
from cnftrace.cli import main
from cnftrace.cli._arguments import run_config
from cnftrace.cli._checks import CommandFailed
from cnftrace.cli._commands import draw_samples, sample_chunk
from cnftrace.cli._data import run_source, training_source
from cnftrace.cli._main import make_parser
from cnftrace.datasets import gaussian_baseline_nll, read_table
from cnftrace.runs import RunConfig
from cnftrace.training._state import StepCounters, raise_for_failures

SMALL = ["--width", "8", "--depth", "1", "--steps", "2", "--batch-size", "16"]


SMALL += ["--no-progress"]


TINY = [*SMALL, "--checkpoint-every", "1", "--objective", "fm"]


TINY += ["--rtol", "1e-3", "--atol", "1e-3"]


def _config(*argv) -> RunConfig:
    args = make_parser().parse_args(["train", "--run-dir", "unused", *argv])
    config = run_config(args)
    config.check()
    return config.resolved()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    x = dependent_table()
    text = csv_text(np.c_[x, np.arange(len(x))], header="x,y,z,label")
    return {"root": root, "x": x, "csv": write_file(root / "xyz.csv", text)}


@pytest.fixture(scope="module")
def run(files):
    """A 2-step flow-matching run on x, y and z, its columns given with blanks."""
    path = str(files["root"] / "run")
    argv = ["train", "--data", files["csv"], "--columns", " x, y, z", "--run-dir"]
    argv += [path, *TINY]
    assert main(argv) == 0
    return {"dir": path, "argv": argv}


@pytest.fixture(scope="module")
def evaluated(run):
    """`cnftrace eval` of the run: its line and eval.json."""
    assert main(["eval", run["dir"]]) == 0
    with open(os.path.join(run["dir"], "eval.json")) as f:
        return json.load(f)


def _copy(run, tmp_path) -> tuple[str, list[str]]:
    """A copy of the run, and its training command pointed at the copy."""
    path = str(tmp_path / "run")
    shutil.copytree(run["dir"], path)
    argv = list(run["argv"])
    argv[argv.index("--run-dir") + 1] = path
    return path, argv


def test_columns_with_blanks_are_stored_as_resolved(run, evaluated):
    with open(os.path.join(run["dir"], "config.json")) as f:
        data_file = json.load(f)["data_file"]
    assert data_file["columns"] == ["x", "y", "z"]  # it stored [" x", " y", " z"]
    assert data_file["names"] == ["x", "y", "z"]
    assert evaluated["n"] == 4 and math.isfinite(evaluated["test_nll"])


def test_a_run_stored_with_blanks_in_its_columns_opens(
    files, tmp_path, monkeypatch, capsys
):
    """A run written before the fix (its config and checkpoints hold `" y"`) is
    evaluated, and resumed by the same command, not stranded."""
    real = training_source

    def as_before(config):
        source, pinned = real(config)
        blanks = tuple(config.columns.split(","))
        pinned["data_file"] = dataclasses.replace(pinned["data_file"], columns=blanks)
        return source, pinned

    run = str(tmp_path / "old")
    argv = ["train", "--data", files["csv"], "--columns", " x, y, z", "--run-dir", run]
    monkeypatch.setattr("cnftrace.cli._train.training_source", as_before)
    assert main([*argv, *TINY]) == 0
    monkeypatch.undo()
    with open(os.path.join(run, "config.json")) as f:
        assert json.load(f)["data_file"]["columns"] == [" x", " y", " z"]
    capsys.readouterr()
    assert main(["eval", run]) == 0
    assert "test NLL" in capsys.readouterr().out
    assert main([*argv, *TINY]) == 0  # the same settings: nothing to resume
    assert "had already trained 2 steps" in capsys.readouterr().out


def test_a_first_line_of_numbers_is_said_and_header_yes_names_it(tmp_path, capsys):
    rows = csv_text(np.random.default_rng(1).normal(size=(30, 2)), header="")
    path = write_file(tmp_path / "years.csv", "1990,2000\n" + rows)
    with pytest.warns(UserWarning, match=r"line 1 \(1990, 2000\) holds only numbers"):
        assert read_table(path).data.shape == (31, 2)
    named = read_table(path, header=True)
    assert named.names == ("1990", "2000") and named.data.shape == (30, 2)
    with pytest.raises(ValueError, match="not a number"):
        read_table(write_file(tmp_path / "t.csv", "a,b\n" + rows), header=False)
    # On the command line: one line on stderr, with the flag; --header yes pins it.
    source, pinned = training_source(_config("--data", path))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--header yes" in err[0] and "years.csv" in err[0]
    assert source.table.names is None and "header" not in pinned["data_file"].to_json()
    source, pinned = training_source(_config("--data", path, "--header", "yes"))
    assert capsys.readouterr().err == ""
    assert pinned["data_file"].to_json()["header"] is True
    assert pinned["data_file"].names == ("1990", "2000")
    np.save(tmp_path / "a.npy", np.ones((20, 2)))
    with pytest.raises(ValueError, match="has no header line"):
        read_table(str(tmp_path / "a.npy"), header=True)


def test_the_same_file_or_the_same_bytes_twice_is_refused(files, tmp_path, capsys):
    path = files["csv"]
    read_fails(ValueError, [path, path], "is given twice", "test rows")
    link = tmp_path / "link.csv"
    link.symlink_to(path)
    read_fails(ValueError, [path, str(link)], "is given twice", "link.csv")
    copy = shutil.copy(path, tmp_path / "copy.csv")
    read_fails(ValueError, [path, str(copy)], "hold the same bytes", "SHA-256")
    run = str(tmp_path / "run")
    argv = ["train", "--data", path, path, "--run-dir", run, *TINY]
    fails(argv, capsys, 1, "is given twice")
    assert not os.path.exists(run)


def test_a_singular_covariance_has_no_baseline(evaluated, capsys):
    assert evaluated["gaussian_baseline_nll"] is None
    assert "singular (rank 2)" in evaluated["gaussian_baseline_undefined"]
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="fewer rows than columns"):
        gaussian_baseline_nll(rng.normal(size=(5, 8)), rng.normal(size=(3, 8)))
    train, test = rng.normal(size=(200, 3)), rng.normal(size=(50, 3))
    mean, cov = train.mean(axis=0), np.cov(train, rowvar=False, bias=True)
    cov += 1e-6 * np.eye(3)
    d = test - mean
    nll = 0.5 * np.einsum("ni,ij,nj->n", d, np.linalg.inv(cov), d)
    nll += 0.5 * np.linalg.slogdet(2 * np.pi * cov)[1]
    assert gaussian_baseline_nll(train, test) == pytest.approx(nll.mean(), rel=1e-9)


def test_eval_says_the_baseline_is_undefined(run, evaluated, capsys):
    assert main(["eval", run["dir"]]) == 0
    out = capsys.readouterr().out
    assert "full-covariance Gaussian undefined: the covariance of" in out


def test_a_finished_run_without_its_history_says_it_is_gone(run, tmp_path, capsys):
    path, argv = _copy(run, tmp_path)
    os.remove(os.path.join(path, "metrics.jsonl"))
    capsys.readouterr()
    assert main(argv) == 0  # it raised an IndexError
    captured = capsys.readouterr()
    assert "had already trained 2 steps; no final loss" in captured.out
    assert "metrics.jsonl is missing" in captured.err


def test_a_resumed_run_without_its_history_says_what_is_lost(tmp_path, capsys):
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    data = lambda k, n: jr.normal(k, (n, 2))  # noqa: E731
    checkpoints = cnftrace.Checkpoints(str(tmp_path / "ckpt"), every=2)
    settings = dict(key=jr.key(1), steps=4, batch_size=16, objective="fm")
    settings.update(checkpoints=checkpoints, progress=False)
    _, history = cnftrace.fit(flow, data, **settings)
    assert history["step"] == [1, 2, 3, 4]
    os.remove(tmp_path / "ckpt" / "step_000000004.ckpt")  # the run stopped at 2
    os.remove(tmp_path / "ckpt" / "history.jsonl")
    capsys.readouterr()
    _, history = cnftrace.fit(flow, data, **settings)
    assert history["step"] == [3, 4]
    err = capsys.readouterr().err
    assert "history.jsonl is missing: the records of steps 1 to 2 are lost" in err


class _Recorder:
    """A stand-in flow that records the sizes it is asked for."""

    def __init__(self):
        self.sizes = []

    def sample(self, key, n):
        self.sizes.append(n)
        return np.full((n, 2), float(jr.key_data(key).sum()))


def test_samples_are_drawn_in_chunks_fixed_by_the_dimension(tmp_path, capsys):
    assert sample_chunk(2) == 2**20 and sample_chunk(3) == 2**21 // 3
    assert sample_chunk(2**22) == 1
    recorder = _Recorder()
    assert draw_samples(recorder, jr.key(0), 10, 4).shape == (10, 2)
    assert recorder.sizes == [4, 4, 4]  # never more than a chunk at once
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    key = jr.key(3)
    got = draw_samples(flow, key, 10, 4)
    parts = [flow.sample(jr.fold_in(key, i), 4) for i in range(3)]
    np.testing.assert_array_equal(got, np.concatenate(parts)[:10])
    np.testing.assert_array_equal(draw_samples(flow, key, 3, 4), flow.sample(key, 3))


def test_sample_n_beyond_memory_is_refused_before_the_work(run, capsys):
    out = os.path.join(run["dir"], "huge.npy")
    argv = ["sample", run["dir"], "--n", str(10**13), "--out", out]
    fails(argv, capsys, 2, "--n 10000000000000 cannot fit", "memory")
    assert not os.path.exists(out)


def test_empty_paths_and_names_are_refused(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv, part in [
        (["train", "--run-dir", ""], "--run-dir is empty"),
        (["train", "--run-dir", "r", "--data", ""], "--data is empty"),
        (["train", "--run-dir", "r", "--data", "t.csv", "--columns", " "], "--columns"),
        (["eval", ""], "RUN_DIR is empty"),
        (["sample", run["dir"], "--out", ""], "--out is empty"),  # a default, silently
        (["datasets", "--data-dir", ""], "--data-dir is empty"),
    ]:
        fails(argv, capsys, 2, part)
    assert os.listdir(tmp_path) == []
    assert not os.path.exists(os.path.join(run["dir"], "samples.npy"))


def test_the_step_limit_advice_names_flags_and_arguments():
    import diffrax

    code = jax.tree_util.tree_leaves(diffrax.RESULTS.max_steps_reached)[0]
    counters = StepCounters(3, 0, 0, 3, code, 0)
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    with pytest.raises(cnftrace.TrainingError) as e:
        raise_for_failures(counters, flow, None)
    message = str(e.value)
    assert "--train-tol" in message and "--lr" in message
    assert "Raise `max_steps`" not in message and "in Python" in message


def test_load_names_what_it_was_given(run, files):
    with pytest.raises(cnftrace.CheckpointError, match="not a file written by"):
        cnftrace.load(files["csv"])  # "a file of arrays"
    checkpoint = os.path.join(run["dir"], "checkpoints", "step_000000002.ckpt")
    like = cnftrace.mlp_flow(3, key=jr.key(0), width=8, depth=1)
    with pytest.raises(cnftrace.CheckpointError) as e:
        cnftrace.load(checkpoint, like=like)  # "another architecture?"
    assert "training checkpoint" in str(e.value) and run["dir"] in str(e.value)
    with pytest.raises(TypeError, match="`path` must be"):
        cnftrace.load(None)


@pytest.mark.parametrize(
    "flags, part",
    [
        (["--objective", "fm", "--num-probes", "2"], "--num-probes 2 does nothing"),
        (["--objective", "fm", "--estimator", "gaussian"], "--estimator gaussian"),
        (["--objective", "ot-fm", "--train-tol", "1e-4"], "--train-tol 0.0001"),
        (["--fm-sigma", "0.1"], "--fm-sigma 0.1 does nothing"),
        (["--estimator", "exact", "--num-probes", "3"], "draws no probes"),
        (["--val-fraction", "0.2"], "built-in data set"),
        (["--test-fraction", "0.2"], "built-in data set"),
        (["--split-seed", "3"], "built-in data set"),
        (["--no-standardize"], "--no-standardize does nothing"),
        (["--header", "yes"], "--header yes does nothing"),
        (["--data-dir", "somewhere"], "--data-dir somewhere does nothing"),
        (["--patience", "5"], "no validation set"),
        (["--data", "t.csv", "--val-fraction", "0", "--patience", "5"], "--val-fr"),
    ],
)
def test_settings_that_do_nothing_are_refused(flags, part, tmp_path, capsys):
    run = str(tmp_path / "run")
    fails(["train", "--run-dir", run, *SMALL, *flags], capsys, 2, part)
    assert not os.path.exists(run)


def test_eval_seed_on_a_fixed_test_split_is_refused(run, capsys):
    fails(["eval", run["dir"], "--seed", "7"], capsys, 2, "--seed 7 does nothing")


def test_compressed_files_read_as_their_table(files, tmp_path, capsys):
    raw = open(files["csv"], "rb").read()
    plain = read_table(files["csv"])
    tsv = raw.replace(b",", b"\t")
    for name, data in [
        ("t.csv.gz", gzip.compress(raw)),
        ("t.tsv.gz", gzip.compress(tsv)),
        ("t.csv.bz2", bz2.compress(raw)),
        ("t.csv.xz", lzma.compress(raw)),
    ]:
        path = write_file(tmp_path / name, data)
        table = read_table(path)
        np.testing.assert_array_equal(table.data, plain.data)
        assert table.names == plain.names
        assert table.sha256 == (hashlib.sha256(data).hexdigest(),)
    one = str(tmp_path / "one.zip")
    with zipfile.ZipFile(one, "w") as z:
        z.writestr("data/t.csv", raw)
    np.testing.assert_array_equal(read_table(one).data, plain.data)
    two = str(tmp_path / "two.zip")
    with zipfile.ZipFile(two, "w") as z:
        z.writestr("a.csv", raw)
        z.writestr("b.csv", raw)
    read_fails(ValueError, two, "holds 2 data tables", "a.csv, b.csv")
    sheet = write_file(tmp_path / "t.xlsx", b"PK\x03\x04")
    read_fails(ValueError, sheet, "is a spreadsheet", "save it as CSV")
    read_fails(ValueError, "-", "standard input")
    argv = ["train", "--data", "-", "--run-dir", str(tmp_path / "r")]
    fails(argv, capsys, 2, "--data - (standard input) cannot be read")


def test_a_compressed_run_is_pinned_by_the_bytes_read(files, tmp_path):
    raw = open(files["csv"], "rb").read()
    path = write_file(tmp_path / "t.csv.gz", gzip.compress(raw, mtime=0))
    config = _config("--data", path, "--columns", "x,y")
    source, pinned = training_source(config)
    config = RunConfig(**{**vars(config), **pinned})
    np.testing.assert_array_equal(run_source(config).test(0, 0), source.test(0, 0))
    write_file(path, gzip.compress(raw, mtime=1))  # the same table, other bytes
    with pytest.raises(CommandFailed, match="has changed since training"):
        run_source(config)


def test_more_steps_on_a_run_says_why_and_what_to_run(run, capsys):
    argv = [*run["argv"], "--steps", "3"]
    message = fails(argv, capsys, 2, "steps: 2 there, 3 now", "cosine schedule")
    assert f"--run-dir {run['dir']}-3" in message


def test_eval_of_a_missing_directory_says_it_does_not_exist(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    fails(["eval", missing], capsys, 1, f"{missing} does not exist")


def test_skipped_checkpoints_are_said_on_stderr_in_train(run, tmp_path, capsys):
    path, argv = _copy(run, tmp_path)
    with open(os.path.join(path, "checkpoints", "step_000000002.ckpt"), "r+b") as f:
        f.truncate(50)
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint" in captured.err  # it went to stdout
    assert "skipping" not in captured.out
    assert "resumed at step 1" in captured.out
