"""`--dequantize`: columns on a grid (counts, rounded values) are
spread over their grid cells, `eval` reports the cells' NLL bound, `sample` rounds
back to the grid, and a setting that does nothing is refused."""

import json
import os

import jax
import jax.random as jr
import numpy as np
import pytest

from cnftrace.cli import main
from cnftrace.datasets import file_source, grid_steps


def _table(n=200, seed=0):
    """Columns: counts (step 1), values rounded to 0.1 offset by 0.05, and a
    continuous one."""
    rng = np.random.default_rng(seed)
    counts = rng.poisson(4.0, n).astype(float)
    rounded = np.round(rng.normal(2.0, 0.7, n), 1) + 0.05
    return np.stack([counts, rounded, rng.normal(size=n)], axis=1)


def test_grid_steps_find_counts_and_rounded_columns():
    steps = grid_steps(_table())
    assert steps[0] == 1.0 and steps[1] == 0.1 and np.isnan(steps[2])
    # Few distinct values far apart are a grid; all-distinct values are not.
    assert grid_steps(np.array([[0.3], [0.7], [0.3], [0.7]]))[0] == pytest.approx(0.4)
    assert np.isnan(grid_steps(np.arange(10.0)[:, None] ** 1.5)[0])


def test_a_dequantized_source_spreads_grid_columns_over_their_cells(tmp_path):
    path = str(tmp_path / "t.csv")
    np.savetxt(path, _table(), delimiter=",", fmt="%.17g", header="n,x,y", comments="")
    plain = file_source(path, seed=0)
    source = file_source(path, seed=0, dequantize=True)
    assert np.array_equal(source.grid[:2], [1.0, 0.1]) and np.isnan(source.grid[2])
    std = source.standardization
    with jax.enable_x64(True):
        batch = np.asarray(std.inverse(np.asarray(source.train(jr.key(0), 500))))
    # Spread within half a step of a grid value, and off the grid values.
    for j, step in ((0, 1.0), (1, 0.1)):
        cell = (batch[:, j] - source.grid_origin[j]) / step
        assert np.all(np.abs(cell - np.round(cell)) <= 0.5 + 1e-9)
        assert np.mean(np.abs(cell - np.round(cell)) > 0.01) > 0.9
    # The continuous column and the held-out rows: the same rows, moved within
    # their cells by a fixed draw.
    test, again = source.test(0, None), file_source(path, dequantize=True).test(0, 0)
    assert np.array_equal(test, again)
    shift = test - plain.test(0, None)
    assert np.all(np.abs(shift[:, :2]) <= np.array([0.5, 0.05]) + 1e-12)
    assert np.all(shift[:, 2] == 0)
    with pytest.raises(ValueError, match="no column takes its values on a grid"):
        cont = str(tmp_path / "c.csv")
        rows = np.random.default_rng(1).normal(size=(50, 2))
        np.savetxt(cont, rows, delimiter=",", header="a,b", comments="")
        file_source(cont, dequantize=True)


def test_the_command_line_dequantizes_and_rounds_samples_back(tmp_path, capsys):
    path = str(tmp_path / "t.csv")
    np.savetxt(path, _table(), delimiter=",", fmt="%.17g", header="n,x,y", comments="")
    run = str(tmp_path / "run")
    argv = ["train", "--data", path, "--run-dir", run, "--dequantize", "--steps", "2"]
    argv += ["--width", "8", "--depth", "1", "--no-progress", "--base", "normal"]
    with jax.enable_x64(False):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "dequantizing 2 of 3 columns on a grid: n (step 1), x (step 0.1)" in out
        assert main(["eval", run]) == 0
        samples = str(tmp_path / "s.csv")
        assert main(["sample", run, "--n", "50", "--out", samples]) == 0
    with open(os.path.join(run, "eval.json")) as f:
        result = json.load(f)
    assert result["dequantized_columns"] == 2
    np.testing.assert_allclose(
        result["test_nll_cells"], result["test_nll"] - np.log(0.1), rtol=1e-12
    )
    drawn = np.loadtxt(samples, delimiter=",", skiprows=1)
    np.testing.assert_allclose(drawn[:, 0], np.round(drawn[:, 0]), atol=1e-9)
    cells = (drawn[:, 1] - 0.05) / 0.1
    np.testing.assert_allclose(cells, np.round(cells), atol=1e-6)
    # The setting is pinned: resuming without it is another run's data.
    with pytest.raises(SystemExit):
        main([a for a in argv if a != "--dequantize"])
    assert "dequantize" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--data", "8gaussians", "--run-dir", str(tmp_path / "r2"),
              "--dequantize"])  # fmt: skip
    assert "--dequantize spreads a data file" in capsys.readouterr().err
