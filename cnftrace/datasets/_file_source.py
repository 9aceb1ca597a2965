"""A user's own table of samples as a training source (`file_source`), and what a
run pins about those files (`DataFile`)."""

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from .._defaults import TEST_FRACTION, VAL_FRACTION
from ._files import Table, read_table
from ._sources import DataSource, _first_rows, _resampled, table_score
from ._split import split_table
from ._standardization import Standardization


@dataclass(frozen=True, kw_only=True)
class FileSource(DataSource):
    """A user's own table of samples, as
    [`file_source`][cnftrace.datasets.file_source] reads it; `test` is in the data's
    own units.

    - `standardization`: the map from the data's units to model space, or `None`.
    - `table`: the [`Table`][cnftrace.datasets.Table] read.
    - `grid`, `grid_origin`: with `dequantize`, each column's grid step
        ([`grid_steps`][cnftrace.datasets.grid_steps]) and least training value.
    - `data_file`: the [`DataFile`][cnftrace.datasets.DataFile] that reads the
        same rows again.
    """

    standardization: Standardization | None
    table: Table
    grid: np.ndarray | None = None
    grid_origin: np.ndarray | None = None
    data_file: "DataFile"

    fixed_test: ClassVar[bool] = True

    def to_model(self, x):
        std = self.standardization
        return x if std is None else std.forward(x)

    def score(self, nll, seed, n):
        report = table_score(self, self.test(seed, n))
        if self.grid is not None:
            # Spread over its cells, a row's density bounds its cell's probability:
            # -log P(cell) <= NLL - sum of the log steps (Theis et al., 2016).
            on = ~np.isnan(self.grid)
            log_cell = float(np.sum(np.log(self.grid[on])))
            report["dequantized_columns"] = int(on.sum())
            report["test_nll_cells"] = nll - log_cell
            baseline = report["gaussian_baseline_nll"]
            if baseline is not None:
                report["gaussian_baseline_nll_cells"] = baseline - log_cell
        report["units"] = "data"  # log_prob in the file's own units, scaling included
        return report


# The record's settings that decide the rows trained on, their split and their
# standardisation, besides the files' bytes: compared on resume.
_SETTINGS = ("columns", "array", "val_fraction", "test_fraction", "split_seed")
_SETTINGS += ("standardize", "drop_missing", "header", "dequantize")


@dataclass(frozen=True)
class DataFile:
    """What a run pins about the files it trains on: the arguments of
    [`file_source`][cnftrace.datasets.file_source] and what was found.
    [`read`][cnftrace.datasets.DataFile.read] reads the same rows again;
    `to_json`/`from_json` give the record in a run's `config.json`.

    - `paths`, `sha256`, `rows`: each file, the SHA-256 of its bytes, its rows.
    - `columns`: the columns asked for (names or positions), or `None` for all;
        `names`: the column names read, or `None`.
    - `array`, `val_fraction`, `test_fraction`, `split_seed`, `header`: as given
        to `file_source` (its `seed` is `split_seed`).
    - `mean`, `scale`: the standardisation's statistics, `None` without it.
    - `dropped_rows`: rows dropped from each file (`drop_missing`), else `None`.
    - `grid_steps`, `grid_origin`: each column's grid step and a value on its grid
        (0 off the grid), `None` unless dequantised.
    """

    paths: tuple[str, ...]
    sha256: tuple[str, ...]
    rows: tuple[int, ...]
    columns: tuple[str | int, ...] | None
    names: tuple[str, ...] | None
    array: str | None
    val_fraction: float
    test_fraction: float
    split_seed: int
    mean: tuple[float, ...] | None = None
    scale: tuple[float, ...] | None = None
    header: bool | None = None
    dropped_rows: tuple[int, ...] | None = None
    grid_steps: tuple[float, ...] | None = None
    grid_origin: tuple[float, ...] | None = None

    @property
    def standardize(self) -> bool:
        """Whether the files were standardised (`file_source`'s `standardize`)."""
        return self.mean is not None

    @property
    def drop_missing(self) -> bool:
        """Whether rows with a missing value were dropped (`drop_missing`)."""
        return self.dropped_rows is not None

    @property
    def dequantize(self) -> bool:
        """Whether the columns on a grid were dequantised (`dequantize`)."""
        return self.grid_steps is not None

    @property
    def standardization(self) -> Standardization | None:
        """The map from the data's units to the units trained in, or `None`."""
        if self.mean is None:
            return None
        return Standardization(
            np.asarray(self.mean, np.float64), np.asarray(self.scale, np.float64)
        )

    def read(self) -> FileSource:
        """The files read, split and standardised again as they were."""
        return file_source(
            list(self.paths),
            columns=self._columns(),
            array=self.array,
            val_fraction=self.val_fraction,
            test_fraction=self.test_fraction,
            seed=self.split_seed,
            standardize=self.standardize,
            drop_missing=self.drop_missing,
            header=self.header,
            dequantize=self.dequantize,
        )

    def onto_grid(self, x: np.ndarray) -> np.ndarray:
        """Samples with each dequantised column rounded back to its grid."""
        if self.grid_steps is None:
            return x
        step = np.asarray(self.grid_steps, np.float64)
        origin = np.asarray(self.grid_origin, np.float64)
        on = step > 0
        cells = np.round((x[:, on] - origin[on]) / step[on])
        x = np.array(x, np.float64)
        x[:, on] = origin[on] + cells * step[on]
        return x

    def _columns(self) -> list | None:
        """The columns asked for, stripped of blanks (old runs stored `" y"`)."""
        if self.columns is None:
            return None
        return [c.strip() if isinstance(c, str) else c for c in self.columns]

    def settings(self) -> dict[str, Any]:
        """The settings that decide the rows besides the files' bytes, as JSON."""
        values = {name: getattr(self, name) for name in _SETTINGS}
        return dict(values, columns=self._columns())

    def changed_settings(self, now: "DataFile") -> list[str]:
        """The settings that `now` changes, as readable lines."""
        there, here = self.settings(), now.settings()
        return [
            f"{name}: {there[name]!r} there, {here[name]!r} now"
            for name in _SETTINGS
            if there[name] != here[name]
        ]

    def changed_files(self, now: "DataFile") -> list[str]:
        """The files whose SHA-256 differs in `now`, as readable lines."""
        found = dict(zip(now.paths, now.sha256))
        return [
            f"{path} (SHA-256 {sha[:12]}... when the run began, {found[path][:12]}... "
            "now)"
            for path, sha in zip(self.paths, self.sha256)
            if path in found and found[path] != sha
        ]

    def to_json(self) -> dict[str, Any]:
        """The record as JSON values, defaults left out."""
        out = {
            "paths": list(self.paths),
            "sha256": list(self.sha256),
            "rows": list(self.rows),
            "columns": None if self.columns is None else list(self.columns),
            "names": None if self.names is None else list(self.names),
            "array": self.array,
            "val_fraction": self.val_fraction,
            "test_fraction": self.test_fraction,
            "split_seed": self.split_seed,
            "standardize": self.standardize,
            "mean": None if self.mean is None else list(self.mean),
            "scale": None if self.scale is None else list(self.scale),
        }
        if self.header is not None:
            out["header"] = self.header
        if self.dropped_rows is not None:
            out["drop_missing"] = True
            out["dropped_rows"] = list(self.dropped_rows)
        if self.grid_steps is not None:
            out["dequantize"] = True
            out["grid_steps"] = list(self.grid_steps)
            out["grid_origin"] = list(self.grid_origin)
        return out

    @classmethod
    def from_json(cls, record: Any) -> "DataFile":
        """The record `to_json` wrote; raises `ValueError` naming a bad key."""
        if not isinstance(record, dict):
            raise ValueError(f"`data_file` must be a JSON object; got {record!r:.60}.")
        fields = dataclasses.fields(cls)
        names = [f.name for f in fields]
        unknown = sorted(set(record) - set(names) - set(_FLAGS))
        if unknown:
            raise ValueError(f"`data_file` holds unknown keys: {unknown}.")
        needed = [f.name for f in fields if f.default is dataclasses.MISSING]
        for key in (*needed, "mean", "scale", "standardize"):
            if key not in record:
                raise ValueError(f"`data_file` lacks `{key}`.")
        for flag, key in _FLAGS.items():
            if record.get(flag, False) is not (record.get(key) is not None):
                raise ValueError(f"`data_file`'s `{flag}` is at odds with its `{key}`.")
        values = {name: record.get(name) for name in names}
        return cls(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
        )


# The flags of a record, each true where the field it names is set.
_FLAGS = {
    "standardize": "mean",
    "drop_missing": "dropped_rows",
    "dequantize": "grid_steps",
}


# How close to a whole number of grid steps a value must be to be on the grid.
_GRID_TOLERANCE = 1e-6


def grid_steps(rows: np.ndarray) -> np.ndarray:
    """Each column's grid step (the smallest gap between its distinct values) where
    all its values lie whole steps apart and it has at most one distinct value per
    two rows; NaN for the others.

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import grid_steps

        rows = np.array([[1.0, 0.25], [3.0, 0.5], [2.0, 0.75], [5.0, 1.0]] * 3)
        rows[:, 1] += np.random.default_rng(0).normal(size=12)  # a continuous column
        print(grid_steps(rows))  # [ 1. nan]
        ```
    """
    rows = np.asarray(rows, np.float64)
    steps = np.full(rows.shape[1], np.nan)
    for j in range(rows.shape[1]):
        values = np.unique(rows[:, j])
        if values.size < 2 or values.size > rows.shape[0] / 2:
            continue
        # To 12 significant digits: 0.1 rather than the 0.0999999999999943 between
        # two decimal values in binary.
        step = float(f"{np.min(np.diff(values)):.12g}")
        ratios = (values - values[0]) / step
        if np.all(np.abs(ratios - np.round(ratios)) < _GRID_TOLERANCE):
            steps[j] = step
    return steps


def _dequantized(rows: np.ndarray, steps: np.ndarray, seed: int) -> np.ndarray:
    """`rows` with each grid column moved by one seeded draw of noise over its cell."""
    width = np.nan_to_num(steps)
    u = np.random.default_rng(seed).uniform(-0.5, 0.5, rows.shape)
    return rows + u * width[None]


def file_source(
    paths: str | os.PathLike | list,
    *,
    columns=None,
    array: str | None = None,
    val_fraction: float = VAL_FRACTION,
    test_fraction: float = TEST_FRACTION,
    seed: int = 0,
    standardize: bool = True,
    drop_missing: bool = False,
    header: bool | None = None,
    dequantize: bool = False,
) -> FileSource:
    """A user's own table of samples as a training source: the files read by
    [`read_table`][cnftrace.datasets.read_table] (`columns`, `array`,
    `drop_missing`, `header`), split by
    [`split_table`][cnftrace.datasets.split_table] (`seed` picks the split) and,
    with `standardize`, standardised by the training rows. With `dequantize`, each
    column on a grid ([`grid_steps`][cnftrace.datasets.grid_steps]) moves by
    uniform noise over its cell. Its `data_file` (a
    [`DataFile`][cnftrace.datasets.DataFile]) pins what was read.

    Raises `ValueError` for a constant column, or (without `standardize`) a value
    beyond the range of JAX's float.

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import file_source

        rng = np.random.default_rng(0)
        np.save("points.npy", rng.normal(size=(50, 3)) * [1.0, 10.0, 100.0])
        source = file_source("points.npy", seed=0)
        print(source.dim, source.train(jr.key(0), 4).shape)  # 3 (4, 3)
        print(source.standardization.scale)                   # about [1, 10, 100]
        ```
    """
    table = read_table(
        paths, columns=columns, array=array, drop_missing=drop_missing, header=header
    )
    name = table.paths[0] if len(table.paths) == 1 else " + ".join(table.paths)
    dropped = sum(table.dropped)
    left = f"{name} ({dropped} rows with missing values dropped)" if dropped else name
    splits = split_table(
        table.data,
        val_fraction=val_fraction,
        test_fraction=test_fraction,
        seed=seed,
        name=left,
    )
    spread = splits.train.max(axis=0) - splits.train.min(axis=0)
    if np.any(spread == 0):
        j = int(np.flatnonzero(spread == 0)[0])
        column = f"column {j}" + (f" ({table.names[j]!r})" if table.names else "")
        value = splits.train[0, j].item()  # a Python number, printed as one
        raise ValueError(
            f"{name}: {column} is constant over the {splits.train.shape[0]} training "
            f"rows (always {value!r}): a zero variance, which cannot be "
            "standardised and has no density to learn. Leave it out with `--columns`."
        )
    # In float64 on the host until standardised: a large offset keeps its precision.
    std = Standardization.from_data(splits.train, name=name) if standardize else None
    _check_range(table, std)
    to_model = std.forward if standardize else np.asarray
    grid, width, val, test = None, None, splits.val, splits.test
    reference = splits.train
    if dequantize:
        grid = grid_steps(splits.train)
        if np.all(np.isnan(grid)):
            raise ValueError(
                f"{name}: no column takes its values on a grid (whole multiples of "
                "one step apart, at most one distinct value per two rows), so "
                "dequantize has nothing to do; drop it."
            )
        width = np.nan_to_num(grid) / (1.0 if std is None else np.asarray(std.scale))
        val = _dequantized(splits.val, grid, seed + 1)
        test = _dequantized(splits.test, grid, seed + 2)
        reference = _dequantized(splits.train, grid, seed)
    origin = None if grid is None else splits.train.min(axis=0)
    if isinstance(columns, str):  # as `read_table` reads them
        columns = [c.strip() for c in columns.split(",")]
    on = None if grid is None else ~np.isnan(grid)
    data_file = DataFile(
        paths=table.paths,
        sha256=table.sha256,
        rows=table.rows,
        columns=None if columns is None else tuple(columns),
        names=table.names,
        array=array,
        val_fraction=float(val_fraction),
        test_fraction=float(test_fraction),
        split_seed=int(seed),
        mean=None if std is None else tuple(np.asarray(std.mean).tolist()),
        scale=None if std is None else tuple(np.asarray(std.scale).tolist()),
        header=header,
        dropped_rows=table.dropped if drop_missing else None,
        grid_steps=None if grid is None else tuple(np.where(on, grid, 0.0).tolist()),
        grid_origin=None if grid is None else tuple(np.where(on, origin, 0.0).tolist()),
    )
    return FileSource(
        name,
        table.data.shape[1],
        _resampled(to_model(splits.train), width),
        to_model(val) if splits.val.shape[0] else None,
        *_first_rows(test),
        reference=reference,
        standardization=std,
        table=table,
        grid=grid,
        grid_origin=origin,
        data_file=data_file,
    )


def _check_range(table: Table, std: Standardization | None) -> None:
    """Raises `ValueError` naming the first value beyond JAX's default float's
    range in the units the flow sees (standardised by `std`, if given)."""
    dtype = np.dtype(jnp.result_type(float))
    largest = np.finfo(dtype).max
    seen = table.data if std is None else std.forward(table.data)
    big = ~(np.abs(seen) <= largest)
    if not big.any():
        return
    r, j = (int(i[0]) for i in np.nonzero(big))
    ends = np.cumsum(table.rows)
    f = int(np.searchsorted(ends, r, side="right"))
    row = r - (int(ends[f - 1]) if f else 0)
    if table.dropped and table.dropped[f]:
        row = f"{row} of those kept"
    column = f"column {j}" + (f" ({table.names[j]!r})" if table.names else "")
    where = f"{table.paths[f]}: {column} holds {table.data[r, j].item()!r} (row {row})"
    beyond = f"beyond the range of {dtype} (largest {largest:.4g})"
    if std is None:
        raise ValueError(
            f"{where}, {beyond}, in which data that is not standardised is used. "
            "Standardise it (leave out `--no-standardize`), or rescale that column."
        )
    mean, scale = np.asarray(std.mean)[j].item(), np.asarray(std.scale)[j].item()
    raise ValueError(
        f"{where}, which standardised by the training rows (mean {mean:.4g}, "
        f"standard deviation {scale:.4g}) is {seen[r, j].item():.4g}, {beyond}: a "
        "value this far from the others cannot be modelled. Correct or remove "
        "that row."
    )
