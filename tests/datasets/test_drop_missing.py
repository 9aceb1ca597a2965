"""Missing values in a data file: `--drop-missing` (and
`drop_missing=True`) drops the rows with an empty, NA or NaN cell in the chosen
columns, says how many, and pins the count in `config.json`, so that `eval` splits
the same rows; without it, the first missing cell is refused by its line and column,
naming the flag. inf is not missing: it stays refused.

Training here is flow matching on tiny models, every run of the same shapes.
"""

import contextlib
import io
import json
import os

import numpy as np
import pytest

from cnftrace.cli import main
from cnftrace.cli._data import run_source
from cnftrace.datasets import file_source, read_table, split_table
from cnftrace.runs import read_config

TINY = ["--steps", "5", "--width", "8", "--depth", "1", "--batch-size", "32"]
TINY += ["--checkpoint-every", "5", "--rtol", "1e-3", "--atol", "1e-3"]
TINY += ["--no-progress", "--objective", "fm"]
N_ROWS = 80
# The chosen columns' missing cells, one per row they are written in, and the rows.
MISSING = {3: "NA", 7: "", 11: "NaN", 20: " n/a ", 33: "?", 41: "null", 58: "-nan"}


def _rows(n=N_ROWS, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 3)) * [1.0, 10.0, 0.1] + [5.0, -20.0, 0.0]


def _write_csv(path, x, missing=MISSING) -> str:
    """`x` under the header `a,site,b,c` (`site` is text, NA in every fifth row); in
    row `r` of `missing`, column `b` (or `c` for odd `r`) holds `missing[r]`."""
    with open(path, "w") as f:
        f.write("a,site,b,c\n")
        for r, row in enumerate(x):
            cells = [f"{v:.17g}" for v in row]
            if r in missing:
                cells[1 + r % 2] = missing[r]
            site = "NA" if r % 5 == 0 else "north"
            f.write(",".join([cells[0], site, *cells[1:]]) + "\n")
    return str(path)


def _config(run) -> dict:
    with open(os.path.join(run, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def dropped_run(tmp_path_factory):
    """A run with `--drop-missing` on a CSV with seven missing cells, and what it
    printed."""
    root = tmp_path_factory.mktemp("dropmissing")
    x = _rows()
    path = _write_csv(root / "weather.csv", x)
    run = str(root / "run")
    args = ["train", "--data", path, "--columns", "a,b,c", "--run-dir", run]
    return run, path, x, _main_output([*args, "--drop-missing", *TINY])


def _main_output(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def test_rows_with_missing_cells_are_dropped_counted_and_pinned(dropped_run):
    run, path, x, printed = dropped_run
    first_line = min(MISSING) + 2  # the header is line 1
    assert (
        f"cnftrace: dropped {len(MISSING)} of {N_ROWS} rows with missing values in "
        f"{path} (first: line {first_line})\n"
    ) in printed
    data_file = _config(run)["data_file"]
    assert data_file["drop_missing"] is True
    assert data_file["dropped_rows"] == [len(MISSING)]
    kept = np.delete(x, sorted(MISSING), axis=0)
    assert data_file["rows"] == [len(kept)]  # an NA in `site` keeps its row
    # eval re-reads the file with the same option and scores the same test split.
    source = run_source(read_config(os.path.join(run, "config.json")))
    np.testing.assert_array_equal(source.test(0, None), split_table(kept).test)
    assert main(["eval", run]) == 0
    with open(os.path.join(run, "eval.json")) as f:
        assert json.load(f)["n"] == split_table(kept).test.shape[0]


def test_a_run_without_missing_values_is_the_same_with_the_flag(tmp_path):
    path = _write_csv(tmp_path / "clean.csv", _rows(), missing={})
    runs = {}
    for flag in ([], ["--drop-missing"]):
        run = str(tmp_path / f"run{len(flag)}")
        printed = _main_output(["train", "--data", path, "--columns", "a,b,c"] + flag
                               + ["--run-dir", run, *TINY])  # fmt: skip
        runs[bool(flag)] = run, printed
    (plain, plain_out), (flagged, flagged_out) = runs[False], runs[True]
    assert "dropped" not in plain_out
    assert f"dropped 0 of {N_ROWS} rows with missing values in {path}\n" in flagged_out
    before, after = _config(plain), _config(flagged)
    assert "drop_missing" not in before["data_file"]  # unchanged without the flag
    extra = (
        after["data_file"].pop("drop_missing"),
        after["data_file"].pop("dropped_rows"),
    )
    # The training seconds differ from run to run; the settings may not.
    assert before.pop("seconds") > 0 and after.pop("seconds") > 0
    assert extra == (True, [0]) and after == before
    sources = [run_source(read_config(os.path.join(r, "config.json"))) for r in
               (plain, flagged)]  # fmt: skip
    np.testing.assert_array_equal(sources[0].test(0, None), sources[1].test(0, None))
    losses = []
    for run in (plain, flagged):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            losses.append([r["loss"] for r in map(json.loads, f) if "loss" in r])
    assert losses[0] == losses[1]
    # Resuming with the flag turned off, or on another split, is refused before
    # config.json is touched (the checkpoints refused it after, config.json
    # rewritten with the other split for eval to score).
    args = ["train", "--data", path, "--columns", "a,b,c", *TINY]
    with pytest.raises(SystemExit, match="drop_missing: True there, False now"):
        main([*args, "--run-dir", flagged])
    with pytest.raises(SystemExit, match=r"\(split_seed: 0 there, 1 now\)"):
        main([*args, "--run-dir", plain, "--split-seed", "1"])
    assert _config(flagged)["data_file"]["drop_missing"] is True
    assert _config(plain)["data_file"]["split_seed"] == 0
    assert main([*args, "--run-dir", flagged, "--drop-missing"]) == 0  # resumes


@pytest.mark.parametrize("cell", ["NA", "", "nan", "None"])
def test_without_the_flag_a_missing_cell_is_refused_naming_it(cell, tmp_path):
    path = _write_csv(tmp_path / "bad.csv", _rows(), missing={3: cell})
    what = "is empty" if cell == "" else f"holds {cell!r}"
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", "--data", path, "--columns", "a,b,c", "--run-dir", str(run),
              *TINY])  # fmt: skip
    message = str(e.value)
    assert f"{path}, line 5 (row 3), column 3 ('c') {what}, a missing value" in message
    assert "--drop-missing" in message
    assert not run.exists()
    with pytest.raises(ValueError, match=r"drop_missing=True"):
        read_table(path, columns=["a", "b", "c"])
    # A text cell is no missing value: refused with the flag too.
    path = _write_csv(tmp_path / "text.csv", _rows(), missing={4: "oops", 6: "NA"})
    with pytest.raises(ValueError, match=r"line 6 \(row 4\), column 2 \('b'\) holds "
                       "'oops', which is not a number"):  # fmt: skip
        read_table(path, columns=["a", "b", "c"], drop_missing=True)


def test_all_rows_dropped_or_too_few_left_is_said(tmp_path):
    x = _rows(n=20)
    every = _write_csv(
        tmp_path / "every.csv", x, missing=dict.fromkeys(range(20), "NA")
    )
    run = tmp_path / "run"
    with pytest.raises(
        SystemExit, match="every one of its 20 rows has a missing value"
    ):
        main(["train", "--data", every, "--columns", "a,b,c", "--run-dir", str(run),
              "--drop-missing", *TINY])  # fmt: skip
    assert not run.exists()
    few = _write_csv(tmp_path / "few.csv", x, missing=dict.fromkeys(range(12), "NA"))
    with pytest.raises(
        ValueError, match=r"few.csv \(12 rows with missing values dropped\) has 8 row"
    ):
        file_source(few, columns=["a", "b", "c"], drop_missing=True)


def test_missing_markers_and_a_headerless_first_row(tmp_path):
    markers = ["", " NA ", "n/a", "N/A", "#N/A", "<NA>", "NaN", "-nan", "NULL",
               "None", "?"]  # fmt: skip
    rows = [f"{i}.5,{m}" for i, m in enumerate(markers)]
    rows += [f"{i}.25,{i}" for i in range(30)]
    path = tmp_path / "markers.csv"
    path.write_text("1,NA\n" + "\n".join(rows) + "\n")  # no header: line 1 is data
    table = read_table(str(path), drop_missing=True)
    assert table.names is None and table.data.shape == (30, 2)
    assert table.dropped == (len(markers) + 1,)
    assert table.first_dropped == ("line 1",)
    # Without the flag, nothing is dropped.
    clean = tmp_path / "clean.csv"
    clean.write_text("x,y\n1,2\n3,4\n")
    assert read_table(str(clean)).dropped == (0,)
    # inf is not a missing value.
    clean.write_text("x,y\n1,2\n3,inf\n5,NA\n")
    with pytest.raises(ValueError, match=r"row 1 \(line 3\), column 1 \('y'\) = inf"):
        read_table(str(clean), drop_missing=True)


def test_nan_rows_of_an_npy_file(tmp_path):
    x = _rows(n=40)
    x[[5, 9, 30], [0, 2, 1]] = np.nan
    path = str(tmp_path / "samples.npy")
    np.save(path, x)
    with pytest.raises(ValueError) as e:
        read_table(path)
    assert "row 5, column 0" in str(e.value) and "drop_missing=True" in str(e.value)
    assert "3 row(s) with a missing value (NaN)" in str(e.value)
    table = read_table(path, drop_missing=True)
    np.testing.assert_array_equal(table.data, np.delete(x, [5, 9, 30], axis=0))
    assert table.dropped == (3,) and table.first_dropped == ("row 5",)
    # Only the chosen columns count; a stacked file gets its own count.
    other = str(tmp_path / "more.npy")
    np.save(other, x[::-1])
    table = read_table([path, other], columns=[1], drop_missing=True)
    assert table.dropped == (1, 1) and table.rows == (39, 39)
    x[12, 1] = np.inf
    np.save(path, x)
    with pytest.raises(ValueError, match=r"row 12, column 1 = inf.*not infinite"):
        read_table(path, drop_missing=True)


def test_drop_missing_needs_a_data_file(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match="--drop-missing reads a data file"):
        main(["train", "--data", "moons", "--run-dir", str(run), "--drop-missing",
              *TINY])  # fmt: skip
    assert not run.exists()
