"""The typed data path: a source class per kind of data, each
scoring itself, and `DataFile`, what a run pins about its files, read back from its
JSON record exactly as it was written. No flow is trained here: nothing compiles."""

import dataclasses
import json
import math

import numpy as np
import pytest

import cnftrace
from cnftrace import CheckpointError
from cnftrace.datasets import (
    DataFile,
    DataSource,
    FileSource,
    ImageSource,
    Standardization,
    TableSource,
    ToySource,
    bits_per_dim,
    data_source,
    file_source,
    gaussian_baseline_nll,
    toy_entropy,
)
from cnftrace.flows import AbstractStandardization
from cnftrace.runs import RunConfig


@pytest.fixture(scope="module")
def counts_csv(tmp_path_factory):
    """A CSV with a header, a count column (grid step 1), a continuous column and
    two rows with a missing cell."""
    rng = np.random.default_rng(0)
    rows = np.stack([rng.poisson(4.0, 80).astype(float), rng.normal(size=80)], 1)
    lines = ["n,x"] + [f"{a:.17g},{b:.17g}" for a, b in rows]
    lines[5], lines[9] = "NA,0.5", "3,"
    path = tmp_path_factory.mktemp("data") / "counts.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def source(counts_csv):
    return file_source(
        counts_csv,
        columns="n, x",
        seed=3,
        drop_missing=True,
        header=True,
        dequantize=True,
    )


def test_a_data_file_reads_back_from_its_json_record_as_written(source, counts_csv):
    pinned = source.data_file
    record = json.loads(json.dumps(pinned.to_json()))  # as config.json holds it
    assert DataFile.from_json(record) == pinned
    assert DataFile.from_json(record).to_json() == record
    # The record config.json has always held for these settings.
    assert record["columns"] == ["n", "x"] and record["names"] == ["n", "x"]
    assert record["rows"] == [78] and record["dropped_rows"] == [2]
    assert record["split_seed"] == 3 and record["header"] is True
    assert record["grid_steps"] == [1.0, 0.0] and record["standardize"] is True
    assert record["drop_missing"] is True and record["dequantize"] is True
    # The statistics come back bit for bit, and the files read again give the same
    # rows and split.
    std = pinned.standardization
    assert isinstance(std, Standardization)
    assert np.array_equal(std.mean, source.standardization.mean)
    assert np.array_equal(std.scale, source.standardization.scale)
    again = pinned.read()
    assert again.data_file == pinned
    assert np.array_equal(again.test(0, 0), source.test(0, 0))
    # A run's config holds the typed record and stores its JSON form.
    config = RunConfig(run_dir="r", data=counts_csv, data_file=pinned)
    stored = json.loads(json.dumps(config.stored()))
    assert stored["data_file"] == record
    assert RunConfig.from_stored(stored, "config.json").data_file == pinned


def test_samples_are_rounded_back_onto_the_grid_of_dequantized_columns(source):
    # The test rows are the read rows moved within their cells by one fixed draw.
    test = source.test(0, 0)
    rounded = source.data_file.onto_grid(test)
    counts = rounded[:, 0]
    assert np.all(np.abs(counts - test[:, 0]) <= 0.5 + 1e-12)
    np.testing.assert_allclose(counts, np.round(counts), rtol=0, atol=1e-12)
    assert np.array_equal(rounded[:, 1], test[:, 1])  # not on a grid: as it is
    plain = dataclasses.replace(source.data_file, grid_steps=None, grid_origin=None)
    assert plain.onto_grid(test) is test


def test_a_malformed_record_is_refused_naming_what_is_wrong(source):
    record = source.data_file.to_json()
    lacking = {k: v for k, v in record.items() if k != "paths"}
    with pytest.raises(ValueError, match="`data_file` lacks `paths`"):
        DataFile.from_json(lacking)
    for change, said in (
        ({"mean": None}, "`standardize` is at odds with its `mean`"),
        ({"drop_missing": False}, "`drop_missing` is at odds"),
        ({"extra": 1}, r"unknown keys: \['extra'\]"),
    ):
        with pytest.raises(ValueError, match=said):
            DataFile.from_json({**record, **change})
    config = RunConfig(run_dir="r", data="t.csv", data_file=source.data_file)
    stored = dict(config.stored(), data_file={**record, "dequantize": False})
    with pytest.raises(CheckpointError, match="cfg.json: `data_file`'s `dequantize`"):
        RunConfig.from_stored(stored, "cfg.json")


def test_changed_settings_and_files_are_named(source):
    pinned = source.data_file
    assert pinned.changed_settings(pinned) == [] and pinned.changed_files(pinned) == []
    blanks = dataclasses.replace(pinned, columns=(" n", " x"))
    assert pinned.changed_settings(blanks) == []  # the same columns
    other = dataclasses.replace(pinned, split_seed=4, header=None)
    assert pinned.changed_settings(other) == [
        "split_seed: 3 there, 4 now",
        "header: True there, None now",
    ]
    moved = dataclasses.replace(pinned, sha256=("0" * 64,))
    [line] = pinned.changed_files(moved)
    assert line.startswith(f"{pinned.paths[0]} (SHA-256 {pinned.sha256[0][:12]}")


def test_each_kind_of_data_is_a_class_that_scores_itself(source):
    toy = data_source("2spirals")
    assert type(toy) is ToySource and not toy.fixed_test
    assert toy.score(3.0, 0, 10) == {"entropy": toy_entropy("2spirals")}
    assert toy.entropy == toy_entropy("2spirals") and toy.image_shape is None
    table = data_source("wine")
    assert type(table) is TableSource and table.fixed_test and table.entropy is None
    expected = gaussian_baseline_nll(table.reference, table.test(0, 0))
    assert table.score(1.0, 0, 0) == {"gaussian_baseline_nll": expected}
    digits = data_source("digits")
    assert type(digits) is ImageSource and digits.image_shape == (8, 8)
    log_det = float(np.mean(digits.test_log_det(7, 0)))
    report = digits.score(-20.0, 7, 0)
    assert report["bits_per_dim"] == bits_per_dim(-20.0 - log_det, 64, 17)
    assert 0 < report["gaussian_baseline_bits_per_dim"] < math.log2(17)
    pixels = digits.as_data(digits.test(7, 0)[:3])
    assert pixels.shape == (3, 8, 8) and pixels.min() >= 0 and pixels.max() <= 1
    # A file scores in its own units, with the cells' bound of dequantised columns.
    assert type(source) is FileSource and source.fixed_test
    report = source.score(2.0, 0, 0)
    assert report["units"] == "data" and report["dequantized_columns"] == 1
    assert report["test_nll_cells"] == 2.0  # a step of 1: log 1 = 0
    for kind in (ToySource, TableSource, ImageSource, FileSource):
        assert issubclass(kind, DataSource)
    with pytest.raises(TypeError):
        DataSource("x", 1, None, None, None, None)  # abstract


def test_standardization_lives_with_the_data_and_the_flows_apply_it(source):
    std = source.standardization
    assert cnftrace.Standardization is Standardization
    assert isinstance(std, AbstractStandardization)
    assert type(std).__module__ == "cnftrace.datasets._standardization"
    x = source.test(0, 0)
    np.testing.assert_allclose(std.inverse(source.to_model(x)), x, rtol=1e-15)
    assert source.to_model(x) is not x and data_source("wine").to_model(x) is x
