"""Right answers on real data files: a large offset kept in float64 until the data
are standardised, a byte-order mark, a file not in UTF-8, a wrong delimiter, a
directory given as `--data`, values beyond float32's range or near float64's,
progress while a big file is parsed, and `eval --n` on a file's run.

The command-line runs are tiny flow-matching runs in float32 (x64 off, as users run
them), where the precision of a float32 cast shows.
"""

import json
import os

import jax
import jax.random as jr
import numpy as np
import pytest
from _cli import fails, read_fails

import cnftrace
from cnftrace.cli import main
from cnftrace.datasets import _text, read_table, split_table

TINY = ["--steps", "20", "--width", "8", "--depth", "1", "--batch-size", "32"]
TINY += ["--rtol", "1e-3", "--atol", "1e-3", "--no-progress", "--objective", "fm"]
OFFSET = 1.7e9


def _epoch_data(n=400, seed=0) -> np.ndarray:
    """Times in seconds since 1970 (about 1.7e9) spread by 100 s, and a second
    column of unit spread: float32 holds 1.7e9 only to the nearest 128."""
    z = np.random.default_rng(seed).standard_normal((n, 2))
    return np.c_[OFFSET + 100 * z[:, 0], z[:, 1]]


def _csv(path, x, header="t,y") -> str:
    np.savetxt(path, x, delimiter=",", header=header or "", comments="", fmt="%.17g")
    return str(path)


@pytest.fixture(scope="module")
def epoch_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("epoch")
    x = _epoch_data()
    path = _csv(root / "epoch.csv", x)
    run = str(root / "e")
    argv = ["train", "--data", path, "--run-dir", run, "--steps", "200"]
    argv += ["--objective", "fm", "--width", "16", "--no-progress"]
    with jax.enable_x64(False):
        assert main(argv) == 0
    return run, path, x


# 1. Precision with a large offset.


def test_standardization_of_host_data_is_float64():
    x = _epoch_data()
    std = cnftrace.Standardization.from_data(x)
    mean, scale = x.mean(axis=0), x.std(axis=0)
    with jax.enable_x64(False):  # as users run: JAX's default float is float32
        y = std.forward(x)
        back = std.inverse(y)
        log_det = std.log_det
    y = np.asarray(y)
    assert y.dtype == np.float64
    np.testing.assert_allclose(y, (x - mean) / scale, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(back), x, rtol=1e-14)
    assert float(log_det) == pytest.approx(-np.sum(np.log(scale)), rel=1e-14)
    assert len(np.unique(np.round(y[:, 0], 6))) == x.shape[0]


def test_standardized_flow_log_prob_of_host_data_standardises_on_the_host():
    x = _epoch_data(50)
    std = cnftrace.Standardization.from_data(x)
    with jax.enable_x64(False):
        inner = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)
        flow = cnftrace.StandardizedFlow(inner, std)
        y = (x - x.mean(axis=0)) / x.std(axis=0)
        want = np.asarray(inner.log_prob(y)) - np.sum(np.log(x.std(axis=0)))
        got = np.asarray(flow.log_prob(x))
        batched = cnftrace.log_prob_batched(flow, x, batch_size=20)
        nll = cnftrace.evaluate_nll(flow, x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(batched, want, rtol=1e-5)
    assert nll.mean == pytest.approx(-want.mean(), rel=1e-5)


def test_large_offset_trains_evaluates_and_samples_in_float64(
    epoch_run, tmp_path, capsys
):
    run, path, x = epoch_run
    # The same data without the offset: its standardised data, and so its trained
    # flow and its NLL, must be the same.
    shifted = _csv(tmp_path / "shifted.csv", x - [OFFSET, 0.0])
    argv = ["train", "--data", shifted, "--run-dir", str(tmp_path / "s"), "--steps"]
    argv += ["200", "--objective", "fm", "--width", "16", "--no-progress"]
    results = []
    with jax.enable_x64(False):
        assert main(argv) == 0
        for r in (run, str(tmp_path / "s")):
            assert main(["eval", r]) == 0
            with open(os.path.join(r, "eval.json")) as f:
                results.append(json.load(f))
        result = results[0]
        assert result["test_nll"] == pytest.approx(results[1]["test_nll"], abs=0.01)
        # The data are Gaussian: the flow can at best match the Gaussian baseline.
        assert result["test_nll"] < result["gaussian_baseline_nll"] + 0.15
        out = str(tmp_path / "s.csv")
        assert main(["sample", run, "--n", "400", "--out", out]) == 0
    s = np.loadtxt(out, delimiter=",", skiprows=1)
    assert s.shape == (400, 2)
    assert len(np.unique(s[:, 0])) > 300  # float32 would give about 8 values
    assert abs(s[:, 0].mean() - x[:, 0].mean()) < 30
    assert 0.7 < s[:, 0].std() / x[:, 0].std() < 1.3


# 2. A UTF-8 byte-order mark (Excel's "CSV UTF-8").


def test_byte_order_mark_is_not_part_of_the_first_field(tmp_path):
    x = np.random.default_rng(0).normal(size=(200, 3))
    body = "\n".join(",".join(f"{v:.17g}" for v in row) for row in x) + "\n"
    bare = tmp_path / "bare.csv"
    bare.write_bytes(b"\xef\xbb\xbf" + body.encode())
    table = read_table(str(bare))
    assert table.data.shape == (200, 3) and table.names is None
    np.testing.assert_array_equal(table.data, x)
    headed = tmp_path / "headed.csv"
    headed.write_bytes(b"\xef\xbb\xbf" + ("x,y,z\n" + body).encode())
    table = read_table(str(headed), columns="x,y")
    assert table.names == ("x", "y") and table.data.shape == (200, 2)


# 3. A file not in UTF-8.


def test_latin1_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("a,b\n1,2\n3,4\ncaf\u00e9,5\n".encode("latin-1"))
    read_fails(ValueError, str(path), str(path), "line 4", "column 4", "0xe9", "UTF-8")


# 4. A wrong delimiter.


def test_semicolons_and_tabs_in_a_csv_are_named(tmp_path):
    x = np.random.default_rng(0).normal(size=(20, 2))
    semi = tmp_path / "semi.csv"
    np.savetxt(semi, x, delimiter=";", header="a;b", comments="", fmt="%.6f")
    read_fails(ValueError, str(semi), "not a number", "separated by ';'", "commas")
    read_fails(
        ValueError, str(semi), "no column named 'a'", "separated by ';'", columns="a,b"
    )
    bare = tmp_path / "bare.csv"
    np.savetxt(bare, x, delimiter=";", fmt="%.6f")
    read_fails(ValueError, str(bare), str(bare), "separated by ';'")
    tabs = tmp_path / "tabs.csv"
    np.savetxt(tabs, x, delimiter="\t", header="a\tb", comments="", fmt="%.6f")
    read_fails(ValueError, str(tabs), "separated by tabs", ".tsv")
    commas = tmp_path / "commas.tsv"
    np.savetxt(commas, x, delimiter=",", header="a,b", comments="", fmt="%.6f")
    read_fails(ValueError, str(commas), "separated by commas", ".csv")


# 5. A directory given as the data.


def test_a_directory_as_data_is_named_a_directory(tmp_path, capsys):
    folder = tmp_path / "measurements"
    folder.mkdir()
    (folder / "a.csv").write_text("x\n1\n2\n")
    run = str(tmp_path / "run")
    fails(
        ["train", "--data", str(folder), "--run-dir", run, *TINY],
        capsys,
        2,
        str(folder),
        "is a directory",
        "a.csv",
        "--data-dir",
    )
    assert not os.path.exists(run)
    named = tmp_path / "looks.csv"
    named.mkdir()
    read_fails(ValueError, str(named), str(named), "is a directory", "--data-dir")


# 6. A value finite in float64, infinite in float32.


def _with_value(tmp_path, value, name, split=0) -> tuple[str, int]:
    """A 200-row CSV whose column 'b' holds `value` in one row of a split (0 train,
    1 validation, 2 test), and that row."""
    x = np.random.default_rng(1).normal(size=(200, 2))
    row = int(split_table(np.arange(200.0)[:, None], seed=0)[split][0, 0])
    x[row, 1] = value
    return _csv(tmp_path / name, x, header="a,b"), row


def test_a_value_beyond_float32_trains_standardised(tmp_path):
    path, _ = _with_value(tmp_path, 1e39, "big.csv")
    run = str(tmp_path / "run")
    with jax.enable_x64(False):
        assert main(["train", "--data", path, "--run-dir", run, *TINY]) == 0
        assert main(["eval", run]) == 0
    with open(os.path.join(run, "eval.json")) as f:
        result = json.load(f)
    assert np.isfinite(result["test_nll"])


def test_a_value_beyond_float32_is_refused_unstandardised(tmp_path, capsys):
    path, row = _with_value(tmp_path, 1e39, "big.csv")
    run = str(tmp_path / "run")
    argv = ["train", "--data", path, "--run-dir", run, "--no-standardize", *TINY]
    match = [path, "column 1 ('b')", "1e+39", f"row {row}", "float32", "Standardise"]
    with jax.enable_x64(False):
        fails(argv, capsys, None, *match)
    assert not os.path.exists(os.path.join(run, "config.json"))


def test_a_held_out_value_beyond_float32_once_standardised_is_refused(tmp_path, capsys):
    """1e39 in a validation row is 1e39 standard deviations of the training rows
    away: refused by name before anything is written, not a NaN in training."""
    path, row = _with_value(tmp_path, 1e39, "big.csv", split=1)
    run = str(tmp_path / "run")
    match = [path, "column 1 ('b')", "1e+39", f"row {row}", "standardised", "float32"]
    with jax.enable_x64(False):
        fails(["train", "--data", path, "--run-dir", run, *TINY], capsys, None, *match)
    assert not os.path.exists(os.path.join(run, "config.json"))


# 7. A value near float64's largest.


def test_values_near_float64s_largest_are_standardised(tmp_path):
    rng = np.random.default_rng(2)
    x = np.c_[rng.normal(size=200), 1e308 * (1 + 0.1 * rng.normal(size=200))]
    x[:, 1] = np.clip(x[:, 1], 0.6e308, 1.4e308)
    std = cnftrace.Standardization.from_data(x)
    u = x[:, 1] / 1e308
    assert float(std.mean[1]) == pytest.approx(1e308 * u.mean(), rel=1e-12)
    assert float(std.scale[1]) == pytest.approx(1e308 * u.std(), rel=1e-12)
    path = _csv(tmp_path / "huge.csv", x, header="a,b")
    run = str(tmp_path / "run")
    with jax.enable_x64(False):
        assert main(["train", "--data", path, "--run-dir", run, *TINY]) == 0
        assert main(["eval", run]) == 0
    with open(os.path.join(run, "eval.json")) as f:
        result = json.load(f)
    assert np.isfinite(result["test_nll"]) and np.isfinite(
        result["gaussian_baseline_nll"]
    )
    # log(1e307) = 707 nats of scale: both figures are about 707 + 2.8.
    assert abs(result["test_nll"] - result["gaussian_baseline_nll"]) < 1.0


def test_a_column_spanning_beyond_float64_is_named_not_constant(tmp_path):
    x = np.random.default_rng(3).normal(size=(50, 2))
    x[0, 1], x[1, 1] = 1.5e308, -1.5e308
    with pytest.raises(ValueError) as e:
        cnftrace.Standardization.from_data(x, name="wide.csv")
    message = str(e.value)
    assert "constant" not in message and "column 1" in message
    assert "float64" in message and "wide.csv" in message


# 8. Progress while a big text file is parsed.


def test_progress_is_shown_for_big_files_only(tmp_path, capsys, monkeypatch):
    x = np.random.default_rng(0).normal(size=(3000, 3))
    path = _csv(tmp_path / "big.csv", x, header="a,b,c")
    table = read_table(path)
    assert capsys.readouterr().err == ""  # a small file: quiet
    monkeypatch.setattr(_text, "PROGRESS_BYTES", 1000)
    again = read_table(path)
    err = capsys.readouterr().err
    assert "big.csv" in err and "rows" in err
    np.testing.assert_array_equal(again.data, table.data)
    np.testing.assert_array_equal(table.data, x)


def test_the_fast_parser_agrees_with_the_checking_one(tmp_path):
    """Blank lines, spaces, a text column left out and a quoted number read the same
    way whichever parser reads them; errors still name their line."""
    path = tmp_path / "mixed.csv"
    path.write_text('a, site ,b\n1.5, north, 2\n\n"3",south,4e3\n-0.25,x,inf\n')
    with pytest.raises(ValueError, match="line 5"):
        read_table(str(path), columns="a,b")
    path.write_text('a, site ,b\n1.5, north, 2\n\n"3" ,south,4e3\n-0.25,x,7\n')
    table = read_table(str(path), columns="a,b")
    np.testing.assert_array_equal(table.data, [[1.5, 2], [3, 4e3], [-0.25, 7]])
    path.write_text("a,b\n1,2\n3,4,5\n")
    with pytest.raises(ValueError, match="line 3 has 3 fields"):
        read_table(str(path))


# 9. `eval --n` on a file's run.


def test_eval_n_takes_the_first_rows_of_the_test_split(epoch_run, capsys):
    run = epoch_run[0]
    with jax.enable_x64(False):
        assert main(["eval", run, "--n", "10"]) == 0
        with open(os.path.join(run, "eval.json")) as f:
            first = json.load(f)
        assert first["n"] == 10
        assert main(["eval", run]) == 0
        with open(os.path.join(run, "eval.json")) as f:
            assert json.load(f)["n"] == 40  # all of the test split, by default
        capsys.readouterr()
        fails(
            ["eval", run, "--n", "41"], capsys, None, "--n 41", "40 rows", "test split"
        )
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "first N rows" in " ".join(capsys.readouterr().out.split())


# 10. A file too small for a held-out standard error: refused before config.json.


def test_a_file_with_one_validation_row_is_refused_before_anything_is_written(
    tmp_path, capsys
):
    rows = np.random.default_rng(0).standard_normal((10, 2))
    path = _csv(str(tmp_path / "ten.csv"), rows, header="x,y")
    run = str(tmp_path / "run")
    argv = ["train", "--data", path, "--run-dir", run, *TINY]
    fails(argv, capsys, None, "has 10 row(s)", "needs at least 15", "two to validate")
    assert not os.path.exists(run)
    # Fifteen rows are enough: two to validate and two to test.
    train, val, test = split_table(np.arange(15.0)[:, None], seed=0)
    assert (len(train), len(val), len(test)) == (11, 2, 2)
