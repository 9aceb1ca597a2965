"""Text and array files read right or refused by name: numbers under one strict rule,
the rows a split needs, line endings, trailing commas, formats other than the name
says, UTF-16, quoted newlines and repeated column names."""

import gzip
import math
import os
import signal

import numpy as np
import pytest
from _cli import csv_text, dependent_table, fails, read_fails, write_file

from cnftrace._checks import parse_float, parse_int
from cnftrace.datasets import read_table, split_table
from cnftrace.datasets._split import _enough, _min_rows


def test_numbers_follow_one_strict_rule(tmp_path, capsys):
    for text, value in [("1.5", 1.5), (" -2e3 ", -2000.0), (".5", 0.5), ("5.", 5.0)]:
        assert parse_float(text) == value
    assert math.isinf(parse_float("-Infinity")) and math.isnan(parse_float("NaN"))
    for text in ["1_010.25", "１２.５", "٣", "0x1p3", "12%", "1e", ".", "1,5"]:
        assert parse_float(text) is None, text
    assert parse_int(" 12 ") == 12 and parse_int("1_000") is None
    assert parse_int("１２") is None
    for field in ["1_010.25", "１２.５"]:
        path = write_file(tmp_path / "t.csv", f"x,y\n1,2\n{field},3\n")
        read_fails(ValueError, path, "line 3 (row 1)", "column 0 ('x')", "ASCII digits")
    run = str(tmp_path / "run")
    for flag, value in [("--steps", "1_000"), ("--lr", "３e-3"), ("--seed", "٣")]:
        fails(["train", "--run-dir", run, flag, value], capsys, 2, flag, value)
    assert not os.path.exists(run)


def test_the_rows_a_split_needs_are_computed_not_searched(capsys, tmp_path):
    signal.alarm(20)  # the search from one row hung here
    try:
        data = np.zeros((100, 2))
        with pytest.raises(ValueError, match="needs at least 1500000000"):
            split_table(data, test_fraction=1e-9)
        with pytest.raises(ValueError, match="needs at least 1500000000"):
            split_table(data, val_fraction=1e-9)
        path = write_file(tmp_path / "t.csv", csv_text(dependent_table()))
        argv = ["train", "--data", path, "--run-dir", str(tmp_path / "r")]
        fails([*argv, "--test-fraction", "1e-9"], capsys, 1, "1500000000")
    finally:
        signal.alarm(0)
    for v in (0.0, 0.01, 0.1, 0.25, 0.33):
        for t in (0.01, 0.05, 0.1, 0.2, 0.3, 0.5):
            if v + t < 1:
                need = next(n for n in range(1, 10_000) if _enough(n, v, t))
                assert _min_rows(v, t) == need, (v, t)


def test_old_mac_line_endings_are_named(tmp_path):
    path = write_file(tmp_path / "mac.csv", "x,y\r1,2\r3,4\r5,6\r")
    read_fails(ValueError, path, "line 1", "carriage return alone", "tr '\\r' '\\n'")
    path = write_file(tmp_path / "mixed.csv", "x,y\r\n1,2\r\n3,4\r5,6\r\n")
    read_fails(ValueError, path, "line 3 cannot be read", "carriage return alone")


def test_a_trailing_comma_on_every_line_is_an_empty_column_left_out(tmp_path):
    x = np.random.default_rng(0).normal(size=(20, 2))
    text = csv_text(x, header="x,y").replace("\n", ",\n")
    table = read_table(write_file(tmp_path / "excel.csv", text))
    assert table.names == ("x", "y")
    np.testing.assert_array_equal(table.data, x)
    # A value in that column on line 3: a column after all, and its gaps refused.
    lines = text.split("\n")
    lines[2] += "7"
    path = write_file(tmp_path / "e.csv", "\n".join(lines))
    read_fails(ValueError, path, "line 2 (row 0)", "column 2 ('') is empty")


def test_a_file_of_another_format_than_its_name_says_is_named(tmp_path):
    text = csv_text(dependent_table())
    message = read_fails(
        ValueError,
        write_file(tmp_path / "t.npy", text),
        "is not a NumPy .npy file",
        "text",
        ".csv",
    )
    assert "allow_pickle" not in message
    path = str(tmp_path / "objects.npy")
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    message = read_fails(ValueError, path, "Python objects (a pickle)", "not read")
    assert "allow_pickle" not in message
    gz = write_file(tmp_path / "g.csv", gzip.compress(text.encode()))
    read_fails(ValueError, gz, "gzip-compressed", "rename it to end in .csv.gz")
    read_fails(
        ValueError, write_file(tmp_path / "a.npz", text), "not a NumPy .npz archive"
    )


def test_utf16_is_named_utf16(tmp_path):
    text = csv_text(dependent_table())
    path = write_file(tmp_path / "u.csv", text.encode("utf-16"))
    message = read_fails(ValueError, path, "is UTF-16 text", "iconv -f utf-16")
    assert "Latin-1" not in message
    path = write_file(tmp_path / "le.csv", text.encode("utf-16-le"))
    read_fails(ValueError, path, "looks like UTF-16 text without a byte-order mark")
    path = write_file(tmp_path / "nul.csv", b"x,y\n1,2\n3\x00,4\n")
    read_fails(ValueError, path, "line 3, column 2", "NUL byte")


def test_lines_are_lines_after_a_quoted_newline(tmp_path):
    path = write_file(tmp_path / "q.csv", 'x,y\n1,"2\n"\n3,4\n5,abc\n')
    read_fails(ValueError, path, "line 5 (row 2)", "'abc'")  # it said line 4
    path = write_file(tmp_path / "h.csv", '"x\ny",z\n1,2\n3,4\n5,b\n')
    read_fails(ValueError, path, "line 5 (row 2)")


def test_repeated_names_in_columns_left_out_do_not_refuse_the_file(tmp_path):
    path = write_file(tmp_path / "d.csv", "x,y,n,n\n1,2,a,b\n3,4,c,d\n")
    table = read_table(path, columns="x,y")  # it refused the file
    np.testing.assert_array_equal(table.data, [[1, 2], [3, 4]])
    read_fails(
        ValueError, path, "names the column 'n' twice (positions 2, 3)", columns="n"
    )
    read_fails(ValueError, path, "'n' twice", "--columns")
    assert read_table(path, columns=[0, 1]).names == ("x", "y")
