"""The third hostile pass (issue 43): nothing silently wrong in files, runs and the
Python API. Numbered as the cases of the issue (section 13 of
docs/failure-matrix.md); `test_small_*` are the small ones at its end. One tiny
flow-matching run on a file is shared by the file and copied where a test changes
it; everything else is read, checked or refused without training."""

import bz2
import dataclasses
import gzip
import hashlib
import json
import lzma
import math
import os
import shutil
import signal
import zipfile

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace
from cnftrace._checks import MAX_ELEMENTS, memory_limit, parse_float, parse_int
from cnftrace.cli import main
from cnftrace.cli._arguments import run_config
from cnftrace.cli._checks import CommandFailed
from cnftrace.cli._commands import draw_samples, sample_chunk
from cnftrace.cli._data import run_source, training_source
from cnftrace.cli._main import make_parser
from cnftrace.datasets import gaussian_baseline_nll, read_table, split_table
from cnftrace.datasets._split import _enough, _min_rows
from cnftrace.runs import RunConfig
from cnftrace.training._state import StepCounters, raise_for_failures

SMALL = ["--width", "8", "--depth", "1", "--steps", "2", "--batch-size", "16"]
SMALL += ["--no-progress"]
TINY = [*SMALL, "--checkpoint-every", "1", "--objective", "fm"]
TINY += ["--rtol", "1e-3", "--atol", "1e-3"]


def _one_line(argv, capsys, status, *parts) -> str:
    """`main(argv)` ends with exit status `status` and one line on stderr holding
    every string of `parts`."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for part in parts:
        assert part in err[0], err[0]
    return err[0]


def _raises(error, paths, *parts, **kwargs) -> str:
    """`read_table(paths, **kwargs)` raises a one-line `error` holding `parts`."""
    with pytest.raises(error) as e:
        read_table(paths, **kwargs)
    message = str(e.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message


def _write(path, data) -> str:
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return str(path)


def _table(n=40, seed=0) -> np.ndarray:
    """x, y and z = x + y: the third column is a sum of the others, so the
    covariance of any rows of the three is singular."""
    xy = np.random.default_rng(seed).standard_normal((n, 2))
    return np.c_[xy, xy.sum(axis=1)]


def _csv_text(x, header="x,y,z") -> str:
    rows = "".join(",".join(f"{v:.17g}" for v in row) + "\n" for row in x)
    return (header + "\n" if header else "") + rows


def _config(*argv) -> RunConfig:
    args = make_parser().parse_args(["train", "--run-dir", "unused", *argv])
    config = run_config(args)
    config.check()
    return config.resolved()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    x = _table()
    text = _csv_text(np.c_[x, np.arange(len(x))], header="x,y,z,label")
    return {"root": root, "x": x, "csv": _write(root / "xyz.csv", text)}


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


# 1. `--columns 'x, y'`: the names stored as resolved; runs stored with blanks open.


def test_1_columns_with_blanks_are_stored_as_resolved(run, evaluated):
    with open(os.path.join(run["dir"], "config.json")) as f:
        data_file = json.load(f)["data_file"]
    assert data_file["columns"] == ["x", "y", "z"]  # it stored [" x", " y", " z"]
    assert data_file["names"] == ["x", "y", "z"]
    assert evaluated["n"] == 4 and math.isfinite(evaluated["test_nll"])


def test_1_a_run_stored_with_blanks_in_its_columns_opens(
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


# 2. A header line of numbers alone.


def test_2_a_first_line_of_numbers_is_said_and_header_yes_names_it(tmp_path, capsys):
    rows = _csv_text(np.random.default_rng(1).normal(size=(30, 2)), header="")
    path = _write(tmp_path / "years.csv", "1990,2000\n" + rows)
    with pytest.warns(UserWarning, match=r"line 1 \(1990, 2000\) holds only numbers"):
        assert read_table(path).data.shape == (31, 2)
    named = read_table(path, header=True)
    assert named.names == ("1990", "2000") and named.data.shape == (30, 2)
    with pytest.raises(ValueError, match="not a number"):
        read_table(_write(tmp_path / "t.csv", "a,b\n" + rows), header=False)
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


# 3. A sampler that does not depend on its key.


@pytest.mark.parametrize(
    "sampler, error, match",
    [
        (
            lambda k, n: np.random.default_rng().standard_normal((n, 2)),
            ValueError,
            "does not depend on `key`",
        ),
        (lambda k, n: jnp.ones((n, 2)), ValueError, "does not depend on `key`"),
        (
            lambda k, n: np.random.default_rng(np.asarray(jr.key_data(k))).normal(
                size=(n, 2)
            ),
            TypeError,
            "cannot be traced by JAX",
        ),
        (lambda k, n: jr.normal(k, (7, 2)), ValueError, "returned 7 samples"),
    ],
    ids=["numpy", "fixed", "untraceable", "count"],
)
def test_3_a_sampler_that_ignores_its_key_is_refused(sampler, error, match):
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    with pytest.raises(error, match=match):
        cnftrace.fit(flow, sampler, key=jr.key(1), steps=2, batch_size=16)
    # A sampler drawing from its key passes the same check.
    trainer = cnftrace.Trainer(lambda k, n: jr.normal(k, (n, 2)), key=jr.key(1))
    trainer.check_data(flow)


# 4. The same file twice.


def test_4_the_same_file_or_the_same_bytes_twice_is_refused(files, tmp_path, capsys):
    path = files["csv"]
    _raises(ValueError, [path, path], "is given twice", "test rows")
    link = tmp_path / "link.csv"
    link.symlink_to(path)
    _raises(ValueError, [path, str(link)], "is given twice", "link.csv")
    copy = shutil.copy(path, tmp_path / "copy.csv")
    _raises(ValueError, [path, str(copy)], "hold the same bytes", "SHA-256")
    run = str(tmp_path / "run")
    argv = ["train", "--data", path, path, "--run-dir", run, *TINY]
    _one_line(argv, capsys, 1, "is given twice")
    assert not os.path.exists(run)


# 5. The full-covariance Gaussian baseline of a singular covariance.


def test_5_a_singular_covariance_has_no_baseline(evaluated, capsys):
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


def test_5_eval_says_the_baseline_is_undefined(run, evaluated, capsys):
    assert main(["eval", run["dir"]]) == 0
    out = capsys.readouterr().out
    assert "full-covariance Gaussian undefined: the covariance of" in out


# 6. Which strings are numbers: one strict rule.


def test_6_numbers_follow_one_strict_rule(tmp_path, capsys):
    for text, value in [("1.5", 1.5), (" -2e3 ", -2000.0), (".5", 0.5), ("5.", 5.0)]:
        assert parse_float(text) == value
    assert math.isinf(parse_float("-Infinity")) and math.isnan(parse_float("NaN"))
    for text in ["1_010.25", "１２.５", "٣", "0x1p3", "12%", "1e", ".", "1,5"]:
        assert parse_float(text) is None, text
    assert parse_int(" 12 ") == 12 and parse_int("1_000") is None
    assert parse_int("１２") is None
    for field in ["1_010.25", "１２.５"]:
        path = _write(tmp_path / "t.csv", f"x,y\n1,2\n{field},3\n")
        _raises(ValueError, path, "line 3 (row 1)", "column 0 ('x')", "ASCII digits")
    run = str(tmp_path / "run")
    for flag, value in [("--steps", "1_000"), ("--lr", "３e-3"), ("--seed", "٣")]:
        _one_line(["train", "--run-dir", run, flag, value], capsys, 2, flag, value)
    assert not os.path.exists(run)


# 7. Fractions that need more rows than a search could reach.


def test_7_the_rows_a_split_needs_are_computed_not_searched(capsys, tmp_path):
    signal.alarm(20)  # the search from one row hung here
    try:
        data = np.zeros((100, 2))
        with pytest.raises(ValueError, match="needs at least 1500000000"):
            split_table(data, test_fraction=1e-9)
        with pytest.raises(ValueError, match="needs at least 1500000000"):
            split_table(data, val_fraction=1e-9)
        path = _write(tmp_path / "t.csv", _csv_text(_table()))
        argv = ["train", "--data", path, "--run-dir", str(tmp_path / "r")]
        _one_line([*argv, "--test-fraction", "1e-9"], capsys, 1, "1500000000")
    finally:
        signal.alarm(0)
    for v in (0.0, 0.01, 0.1, 0.25, 0.33):
        for t in (0.01, 0.05, 0.1, 0.2, 0.3, 0.5):
            if v + t < 1:
                need = next(n for n in range(1, 10_000) if _enough(n, v, t))
                assert _min_rows(v, t) == need, (v, t)


# 8. A sample size no program can hold.


def test_8_sample_sizes_no_program_can_hold_are_refused():
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*draw them in batches"):
        flow.sample(jr.key(0), 2**30)  # it aborted the interpreter
    with pytest.raises(ValueError, match=r"2\*\*31 - 1"):
        flow.sample_and_log_prob(jr.key(0), 2**30)
    limit, what = memory_limit()
    n = limit // (10 * 2 * 8) + 1  # float64: ten arrays of n * 2 numbers
    if n * 2 <= MAX_ELEMENTS:
        with pytest.raises(ValueError, match=f"cannot fit.*{what}"):
            flow.sample(jr.key(0), n)


# 9. A run whose history was deleted.


def test_9_a_finished_run_without_its_history_says_it_is_gone(run, tmp_path, capsys):
    path, argv = _copy(run, tmp_path)
    os.remove(os.path.join(path, "metrics.jsonl"))
    capsys.readouterr()
    assert main(argv) == 0  # it raised an IndexError
    captured = capsys.readouterr()
    assert "had already trained 2 steps; no final loss" in captured.out
    assert "metrics.jsonl is missing" in captured.err


def test_9_a_resumed_run_without_its_history_says_what_is_lost(tmp_path, capsys):
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


# 10. NumPy integers.


def test_10_numpy_integers_are_taken_as_ints():
    i = np.int64
    flow = cnftrace.mlp_flow(i(2), key=jr.key(0), width=i(8), depth=i(1))
    np.testing.assert_array_equal(
        flow.sample(jr.key(0), i(3)), flow.sample(jr.key(0), 3)
    )
    x, logp = flow.sample_and_log_prob(jr.key(0), i(3))
    assert x.shape == (3, 2) and logp.shape == (3,)
    for value in (
        cnftrace.Validation(x, every=i(2), patience=i(3)).every,
        cnftrace.Checkpoints("d", every=i(5), keep=i(2)).keep,
        cnftrace.Hutchinson(i(2)).num_probes,
        cnftrace.CNF(cnftrace.MLPField(2, width=8, key=jr.key(0)), 2).max_steps,
        cnftrace.CNF(
            cnftrace.MLPField(2, width=8, key=jr.key(0)), 2, max_steps=i(64)
        ).max_steps,
    ):
        assert type(value) is int


# 11. float32 input to a float64 flow.


def test_11_float32_input_to_a_float64_flow_is_solved_in_float64():
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    x = jr.normal(jr.key(1), (4, 2), jnp.float32)
    assert flow.blocks[0].vector_field.mlp.layers[0].weight.dtype == jnp.float64
    logp = flow.log_prob(x)  # an internal dynamic_update_slice error
    assert logp.dtype == jnp.float64
    want = flow.log_prob(x.astype(jnp.float64))
    np.testing.assert_allclose(logp, want, rtol=1e-12)
    samples = flow.sample(jr.key(2), 4, dtype=jnp.float32)
    assert samples.dtype == jnp.float32
    z = jr.normal(jr.key(2), (4, 2), jnp.float32)
    np.testing.assert_allclose(samples, flow.inverse(z), rtol=1e-6)


# 12. `jit` of a flow's method: the spellings the docs show.


def test_12_the_jit_spellings_the_docs_show_work():
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    x = jr.normal(jr.key(1), (4, 2))
    want = flow.log_prob(x)
    np.testing.assert_allclose(jax.jit(lambda x: flow.log_prob(x))(x), want, 1e-10)
    np.testing.assert_allclose(eqx.filter_jit(flow.log_prob)(x), want, rtol=1e-10)
    with pytest.raises(TypeError, match="unhashable"):
        jax.jit(flow.log_prob)(x)  # why the docs show the two above
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "training.md")) as f:
        text = " ".join(f.read().split())
    assert "eqx.filter_jit(flow.log_prob)" in text
    assert "jax.jit(lambda x: flow.log_prob(x))" in text
    assert "eqx.filter_jit(flow.log_prob)" in cnftrace.AbstractFlow.__doc__


# 13. The divergence at an empty point.


def test_13_the_divergence_at_an_empty_point_is_refused_by_name():
    with pytest.raises(ValueError, match=r"`y` is empty \(shape \(0,\)\)"):
        cnftrace.divergence(jnp.tanh, jnp.ones(0))
    fy, div = cnftrace.divergence(jnp.tanh, jnp.ones(()))  # a scalar is a point
    assert float(div) == pytest.approx(1 - math.tanh(1) ** 2, rel=1e-12)


# 14. `sample --n` in chunks of a size fixed by the dimension.


class _Recorder:
    """A stand-in flow that records the sizes it is asked for."""

    def __init__(self):
        self.sizes = []

    def sample(self, key, n):
        self.sizes.append(n)
        return np.full((n, 2), float(jr.key_data(key).sum()))


def test_14_samples_are_drawn_in_chunks_fixed_by_the_dimension(tmp_path, capsys):
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


def test_14_sample_n_beyond_memory_is_refused_before_the_work(run, capsys):
    out = os.path.join(run["dir"], "huge.npy")
    argv = ["sample", run["dir"], "--n", str(10**13), "--out", out]
    _one_line(argv, capsys, 2, "--n 10000000000000 cannot fit", "memory")
    assert not os.path.exists(out)


# 15-18, 21, 23: text files.


def test_15_old_mac_line_endings_are_named(tmp_path):
    path = _write(tmp_path / "mac.csv", "x,y\r1,2\r3,4\r5,6\r")
    _raises(ValueError, path, "line 1", "carriage return alone", "tr '\\r' '\\n'")
    path = _write(tmp_path / "mixed.csv", "x,y\r\n1,2\r\n3,4\r5,6\r\n")
    _raises(ValueError, path, "line 3 cannot be read", "carriage return alone")


def test_16_a_trailing_comma_on_every_line_is_an_empty_column_left_out(tmp_path):
    x = np.random.default_rng(0).normal(size=(20, 2))
    text = _csv_text(x, header="x,y").replace("\n", ",\n")
    table = read_table(_write(tmp_path / "excel.csv", text))
    assert table.names == ("x", "y")
    np.testing.assert_array_equal(table.data, x)
    # A value in that column on line 3: a column after all, and its gaps refused.
    lines = text.split("\n")
    lines[2] += "7"
    path = _write(tmp_path / "e.csv", "\n".join(lines))
    _raises(ValueError, path, "line 2 (row 0)", "column 2 ('') is empty")


def test_17_a_file_of_another_format_than_its_name_says_is_named(tmp_path):
    text = _csv_text(_table())
    message = _raises(
        ValueError,
        _write(tmp_path / "t.npy", text),
        "is not a NumPy .npy file",
        "text",
        ".csv",
    )
    assert "allow_pickle" not in message
    path = str(tmp_path / "objects.npy")
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    message = _raises(ValueError, path, "Python objects (a pickle)", "not read")
    assert "allow_pickle" not in message
    gz = _write(tmp_path / "g.csv", gzip.compress(text.encode()))
    _raises(ValueError, gz, "gzip-compressed", "rename it to end in .csv.gz")
    _raises(ValueError, _write(tmp_path / "a.npz", text), "not a NumPy .npz archive")


def test_18_utf16_is_named_utf16(tmp_path):
    text = _csv_text(_table())
    path = _write(tmp_path / "u.csv", text.encode("utf-16"))
    message = _raises(ValueError, path, "is UTF-16 text", "iconv -f utf-16")
    assert "Latin-1" not in message
    path = _write(tmp_path / "le.csv", text.encode("utf-16-le"))
    _raises(ValueError, path, "looks like UTF-16 text without a byte-order mark")
    path = _write(tmp_path / "nul.csv", b"x,y\n1,2\n3\x00,4\n")
    _raises(ValueError, path, "line 3, column 2", "NUL byte")


def test_21_lines_are_lines_after_a_quoted_newline(tmp_path):
    path = _write(tmp_path / "q.csv", 'x,y\n1,"2\n"\n3,4\n5,abc\n')
    _raises(ValueError, path, "line 5 (row 2)", "'abc'")  # it said line 4
    path = _write(tmp_path / "h.csv", '"x\ny",z\n1,2\n3,4\n5,b\n')
    _raises(ValueError, path, "line 5 (row 2)")


def test_23_repeated_names_in_columns_left_out_do_not_refuse_the_file(tmp_path):
    path = _write(tmp_path / "d.csv", "x,y,n,n\n1,2,a,b\n3,4,c,d\n")
    table = read_table(path, columns="x,y")  # it refused the file
    np.testing.assert_array_equal(table.data, [[1, 2], [3, 4]])
    _raises(
        ValueError, path, "names the column 'n' twice (positions 2, 3)", columns="n"
    )
    _raises(ValueError, path, "'n' twice", "--columns")
    assert read_table(path, columns=[0, 1]).names == ("x", "y")


# 19. Empty paths and names.


def test_19_empty_paths_and_names_are_refused(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv, part in [
        (["train", "--run-dir", ""], "--run-dir is empty"),
        (["train", "--run-dir", "r", "--data", ""], "--data is empty"),
        (["train", "--run-dir", "r", "--data", "t.csv", "--columns", " "], "--columns"),
        (["eval", ""], "RUN_DIR is empty"),
        (["sample", run["dir"], "--out", ""], "--out is empty"),  # a default, silently
        (["datasets", "--data-dir", ""], "--data-dir is empty"),
    ]:
        _one_line(argv, capsys, 2, part)
    assert os.listdir(tmp_path) == []
    assert not os.path.exists(os.path.join(run["dir"], "samples.npy"))


# 20. The advice on a solve at its step limit names what each face can change.


def test_20_the_step_limit_advice_names_flags_and_arguments():
    import diffrax

    code = jax.tree_util.tree_leaves(diffrax.RESULTS.max_steps_reached)[0]
    counters = StepCounters(3, 0, 0, 3, code, 0)
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
    with pytest.raises(cnftrace.TrainingError) as e:
        raise_for_failures(counters, flow, None)
    message = str(e.value)
    assert "--train-tol" in message and "--lr" in message
    assert "Raise `max_steps`" not in message and "in Python" in message


# 22. `cnftrace.load` on what it cannot load.


def test_22_load_names_what_it_was_given(run, files):
    with pytest.raises(cnftrace.CheckpointError, match="not a file written by"):
        cnftrace.load(files["csv"])  # "a file of arrays"
    checkpoint = os.path.join(run["dir"], "checkpoints", "step_000000002.ckpt")
    like = cnftrace.mlp_flow(3, key=jr.key(0), width=8, depth=1)
    with pytest.raises(cnftrace.CheckpointError) as e:
        cnftrace.load(checkpoint, like=like)  # "another architecture?"
    assert "training checkpoint" in str(e.value) and run["dir"] in str(e.value)
    with pytest.raises(TypeError, match="`path` must be"):
        cnftrace.load(None)


# 24. Settings that do nothing.


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
def test_24_settings_that_do_nothing_are_refused(flags, part, tmp_path, capsys):
    run = str(tmp_path / "run")
    _one_line(["train", "--run-dir", run, *SMALL, *flags], capsys, 2, part)
    assert not os.path.exists(run)


def test_24_eval_seed_on_a_fixed_test_split_is_refused(run, capsys):
    _one_line(["eval", run["dir"], "--seed", "7"], capsys, 2, "--seed 7 does nothing")


# 25. Compressed files, archives, spreadsheets and standard input.


def test_25_compressed_files_read_as_their_table(files, tmp_path, capsys):
    raw = open(files["csv"], "rb").read()
    plain = read_table(files["csv"])
    tsv = raw.replace(b",", b"\t")
    for name, data in [
        ("t.csv.gz", gzip.compress(raw)),
        ("t.tsv.gz", gzip.compress(tsv)),
        ("t.csv.bz2", bz2.compress(raw)),
        ("t.csv.xz", lzma.compress(raw)),
    ]:
        path = _write(tmp_path / name, data)
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
    _raises(ValueError, two, "holds 2 data tables", "a.csv, b.csv")
    sheet = _write(tmp_path / "t.xlsx", b"PK\x03\x04")
    _raises(ValueError, sheet, "is a spreadsheet", "save it as CSV")
    _raises(ValueError, "-", "standard input")
    argv = ["train", "--data", "-", "--run-dir", str(tmp_path / "r")]
    _one_line(argv, capsys, 2, "--data - (standard input) cannot be read")


def test_25_a_compressed_run_is_pinned_by_the_bytes_read(files, tmp_path):
    raw = open(files["csv"], "rb").read()
    path = _write(tmp_path / "t.csv.gz", gzip.compress(raw, mtime=0))
    config = _config("--data", path, "--columns", "x,y")
    source, pinned = training_source(config)
    config = RunConfig(**{**vars(config), **pinned})
    np.testing.assert_array_equal(run_source(config).test(0, 0), source.test(0, 0))
    _write(path, gzip.compress(raw, mtime=1))  # the same table, other bytes
    with pytest.raises(CommandFailed, match="has changed since training"):
        run_source(config)


# 26. A finished run trained for longer.


def test_26_more_steps_on_a_run_says_why_and_what_to_run(run, capsys):
    argv = [*run["argv"], "--steps", "3"]
    message = _one_line(argv, capsys, 2, "steps: 2 there, 3 now", "cosine schedule")
    assert f"--run-dir {run['dir']}-3" in message


# The small ones.


def test_small_eval_of_a_missing_directory_says_it_does_not_exist(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    _one_line(["eval", missing], capsys, 1, f"{missing} does not exist")


def test_small_skipped_checkpoints_are_said_on_stderr_in_train(run, tmp_path, capsys):
    path, argv = _copy(run, tmp_path)
    with open(os.path.join(path, "checkpoints", "step_000000002.ckpt"), "r+b") as f:
        f.truncate(50)
    capsys.readouterr()
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "skipping checkpoint" in captured.err  # it went to stdout
    assert "skipping" not in captured.out
    assert "resumed at step 1" in captured.out
