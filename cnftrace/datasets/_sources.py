"""The data sets of the command line as training sources: toy 2-D sets, scikit-learn's
tabular sets, the 8x8 digits (dequantised, in logit space), MAF's UCI sets and MNIST
from a directory, and a user's own files, with the Gaussian baseline their test NLL
is read against."""

import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._checks import seed_key
from .._defaults import TEST_FRACTION, VAL_FRACTION
from ..flows import Standardization
from ._files import FORMATS_SHOWN, Table, read_table
from ._mnist import _SOURCE as _MNIST_SOURCE, load_mnist_idx
from ._real import (
    DIGIT_LEVELS,
    TABULAR_DATASETS,
    Splits,
    dequantize,
    load_digits,
    load_tabular,
    logit_transform,
)
from ._split import split_table
from ._toy import TOY_DATASETS, toy_sample
from ._uci import _SOURCE as _UCI_SOURCE, UCI_DATASETS, load_uci

ALL_DATASETS = TOY_DATASETS + TABULAR_DATASETS + ("digits",)
# The sets read from a directory the user provides (`data_dir`).
DIRECTORY_DATASETS = UCI_DATASETS + ("mnist",)
MNIST_LEVELS = 256
_MNIST_VALIDATION = 10_000  # the last rows of MNIST's training file
_MNIST_VALIDATION_USED = 1_000  # of which the first are validated on (exact trace)
# The digits' logit transform: `logit(alpha + (1 - 2 alpha) x)`.
LOGIT_ALPHA = 1e-6


@dataclass(frozen=True)
class DataSource:
    """What a training run needs from its data, as
    [`data_source`][cnftrace.datasets.data_source] returns it.

    - `train`: `(key, n) -> batch` of fresh training samples (in model space).
    - `validation`: a fixed array in model space, or `None`.
    - `test`: `test(seed, n)`, the test set in the units of the flow that
        `cnftrace.load` returns for a run on this data: model space, except for a
        standardised file, where it is the data's own units (the loaded flow is a
        [`StandardizedFlow`][cnftrace.StandardizedFlow]). `n` samples of a toy
        set; the first `n` rows of the fixed test split of a table or a file (all
        of them for `n` of `None` or 0).
    - `test_log_det`: per-sample `log|dy/dx|` of the test set's preprocessing (0 if
        none), so `NLL_x = NLL_y - mean(test_log_det)`.
    - `kind`: `"toy"`, `"tabular"`, `"images"` or `"file"`.
    - `reference`: training samples in the units of `test`, which the
        full-covariance Gaussian baseline is fitted to (tabular data and files).
    - `image_shape`, `levels`: for images, the shape of one image and its number of
        grey levels.
    - `standardization`: for a file, the map from its units to model space, or
        `None`.
    - `table`: for a file, the [`Table`][cnftrace.datasets.Table] read (column
        names, paths, SHA-256 of each file).
    - `grid`: for a file read with `dequantize`, each column's grid step in the
        data's units (NaN for a column not on a grid; see
        [`grid_steps`][cnftrace.datasets.grid_steps]), else `None`; `grid_origin`,
        a value on each column's grid (its least training value).
    """

    name: str
    dim: int
    train: Callable
    validation: np.ndarray | None
    test: Callable[[int, int], np.ndarray]
    test_log_det: Callable[[int, int], np.ndarray]
    kind: str  # "toy", "tabular", "images" or "file"
    reference: np.ndarray | None = None
    image_shape: tuple[int, ...] | None = None
    levels: int | None = None
    standardization: Standardization | None = None
    table: Table | None = None
    grid: np.ndarray | None = None
    grid_origin: np.ndarray | None = None


def gaussian_baseline_nll(train: np.ndarray, test: np.ndarray) -> float:
    """Test NLL (nats) of a full-covariance Gaussian fitted to `train` by maximum
    likelihood (with `1e-6` added to the covariance's diagonal): the simple baseline
    a flow should beat.

    A `ValueError` says it is undefined where the fitted covariance is singular:
    fewer training rows than columns, or columns that are linear combinations of
    the others (its NLL would be set by the jitter alone: 504727553.2 for 5 rows of
    8 columns).

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import gaussian_baseline_nll

        rng = np.random.default_rng(0)
        train, test = rng.normal(size=(1000, 3)), rng.normal(size=(500, 3))
        print(gaussian_baseline_nll(train, test))  # about 3 * 1.42 nats
        ```
    """
    train, test = np.asarray(train, np.float64), np.asarray(test, np.float64)
    # In float64, each column divided by a power of two near its largest magnitude
    # (exactly), so that values near float64's largest do not overflow; the jitter
    # stays 1e-6 in the data's units.
    power = np.ldexp(1.0, np.frexp(np.abs(train).max(axis=0))[1] - 1)
    train, test = train / power, test / power
    mean = train.mean(axis=0)
    rows, d = train.shape
    spread = train.std(axis=0)
    rank = np.linalg.matrix_rank((train - mean) / np.where(spread > 0, spread, 1))
    if rank < d:
        raise ValueError(
            f"undefined: the covariance of {rows} training rows of {d} columns is "
            f"singular (rank {rank}"
            + (": fewer rows than columns)" if rows <= d else ")")
        )
    cov = np.cov(train, rowvar=False, bias=True) + np.diag((1e-3 / power) ** 2)
    chol = np.linalg.cholesky(cov)
    z = np.linalg.solve(chol, (test - mean).T).T
    d = train.shape[1]
    log_det = 2 * np.sum(np.log(np.diag(chol))) + 2 * np.sum(np.log(power))
    return float(
        np.mean(0.5 * np.sum(z**2, axis=1) + 0.5 * log_det)
        + 0.5 * d * math.log(2 * math.pi)
    )


def _levels_to_logit(levels, key, n_levels: int = DIGIT_LEVELS):
    u = jr.uniform(key, levels.shape, jnp.result_type(float))
    s = LOGIT_ALPHA + (1 - 2 * LOGIT_ALPHA) * (levels + u) / n_levels
    return jnp.log(s) - jnp.log1p(-s)


def digits_from_logit(y: np.ndarray) -> np.ndarray:
    """Maps logit-space digit samples back to pixel intensities in [0, 1] (the
    inverse of the `digits` source's logit transform, clipped). The same map serves
    the `mnist` source.

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import digits_from_logit

        print(digits_from_logit(np.array([-20.0, 0.0, 20.0])))  # [0.  0.5 1. ]
        ```
    """
    s = 1 / (1 + np.exp(-y))
    return np.clip((s - LOGIT_ALPHA) / (1 - 2 * LOGIT_ALPHA), 0, 1)


def _resampled(train: np.ndarray, width: np.ndarray | None = None) -> Callable:
    """Batches drawn from the rows `train` with replacement; with `width`, each
    column moved by uniform noise over `[-width/2, width/2]` (a dequantised column:
    its grid step; 0 for the others), drawn afresh with each batch."""
    rows = jnp.asarray(train, jnp.result_type(float))

    def sample(key, n):
        if width is None:
            return rows[jr.randint(key, (n,), 0, rows.shape[0])]
        pick, noise = jr.split(key)
        x = rows[jr.randint(pick, (n,), 0, rows.shape[0])]
        u = jr.uniform(noise, x.shape, x.dtype, -0.5, 0.5)
        return x + u * jnp.asarray(width, x.dtype)[None]

    return sample


# How close to a whole number of grid steps a value must be to be on the grid.
_GRID_TOLERANCE = 1e-6


def grid_steps(rows: np.ndarray) -> np.ndarray:
    """Each column's grid step: for a column whose values all lie a whole number of
    one step apart (counts, rounded measurements: at most one distinct value per two
    rows, so that it is not a continuous column that happens to fit), that step, the
    smallest gap between its distinct values; NaN for the others.

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
    """`rows` with each grid column moved by one fixed draw of uniform noise over
    its grid cell (seeded: a run's validation and test rows are the same each time
    they are read)."""
    width = np.nan_to_num(steps)
    u = np.random.default_rng(seed).uniform(-0.5, 0.5, rows.shape)
    return rows + u * width[None]


def _first_rows(test: np.ndarray) -> tuple[Callable, Callable]:
    """`test` and `test_log_det` of a fixed test split: its first `n` rows (all of
    them for `n` of `None` or 0), and as many zeros."""
    return (
        lambda seed, n: test[:n] if n else test,
        lambda seed, n: np.zeros(test[:n].shape[0] if n else test.shape[0]),
    )


def _tabular(name: str, splits: Splits) -> DataSource:
    return DataSource(
        name,
        splits.train.shape[1],
        _resampled(splits.train),
        splits.val,
        *_first_rows(splits.test),
        "tabular",
        reference=splits.train,
    )


def _images(name, splits, image_shape, n_levels, validation_rows=None):
    """Dequantised images in logit space: fresh noise every batch, fixed noise
    (seed 1 for validation, the given seed for the test set) otherwise."""
    train = jnp.asarray(splits.train.reshape(splits.train.shape[0], -1))
    dim = math.prod(image_shape)

    def sample(key, n):
        k_idx, k_u = jr.split(key)
        rows = train[jr.randint(k_idx, (n,), 0, train.shape[0])]
        return _levels_to_logit(rows.astype(jnp.result_type(float)), k_u, n_levels)

    def fixed(split, seed, n=None):
        split = split.reshape(split.shape[0], -1)[:n].astype(np.float64)
        # A 64-bit seed, negative ones too (NumPy takes only non-negative ones).
        x = dequantize(split, np.random.default_rng(seed % 2**64), n_levels)
        return logit_transform(x, LOGIT_ALPHA)

    def test(seed, n):  # the digits' whole test split; at most n MNIST images
        return fixed(splits.test, seed, None if name == "digits" else n)[0]

    def test_log_det(seed, n):
        return fixed(splits.test, seed, None if name == "digits" else n)[1]

    return DataSource(
        name,
        dim,
        sample,
        fixed(splits.val, 1, validation_rows)[0],
        test,
        test_log_det,
        "images",
        reference=fixed(splits.train, 0)[0] if name == "digits" else None,
        image_shape=image_shape,
        levels=n_levels,
    )


def _mnist(data_dir) -> DataSource:
    images, _, test, _ = load_mnist_idx(mnist_root(data_dir))
    cut = max(images.shape[0] - _MNIST_VALIDATION, images.shape[0] // 2)
    splits = Splits(images[:cut], images[cut:], test)
    return _images(
        "mnist", splits, images.shape[1:], MNIST_LEVELS, _MNIST_VALIDATION_USED
    )


def mnist_root(data_dir) -> str:
    """`data_dir/mnist` where it holds MNIST's files, else `data_dir` itself."""
    nested = os.path.join(os.fspath(data_dir), "mnist")
    return nested if os.path.isdir(nested) else os.fspath(data_dir)


def data_source(name: str, *, data_dir: str | os.PathLike | None = None) -> DataSource:
    """The data set `name` as the command line trains on it: a toy 2-D set (fresh
    samples every batch), a scikit-learn tabular set (batches drawn from its training
    split), `"digits"` (dequantised with fresh noise every batch, in logit space,
    flattened to 64 values), or one of the sets read from `data_dir`: MAF's UCI
    sets (`power`, `gas`, `hepmass`, `miniboone`, `bsds300`, see
    [`load_uci`][cnftrace.datasets.load_uci]) and `"mnist"` (MNIST's IDX files in
    `data_dir` or `data_dir/mnist`, dequantised in logit space like the digits,
    flattened to 784 values; the last 10000 training images are held out, the
    first 1000 of them validated on).

    !!! example

        ```python
        from cnftrace.datasets import data_source

        source = data_source("digits")
        batch = source.train(jr.key(0), 16)      # (16, 64), logit space
        test = source.test(2024, 0)             # a fixed dequantisation
        print(source.dim, batch.shape, test.shape)
        ```
    """
    if name in DIRECTORY_DATASETS:
        if data_dir is None:
            where = "MAF's UCI files" if name in UCI_DATASETS else "MNIST's IDX files"
            raise ValueError(
                f"{name!r} is read from {where} in a directory you provide: pass "
                "`data_dir` (`--data-dir DIR` on the command line); "
                "`cnftrace datasets --data-dir DIR` lists what it finds there."
            )
        try:
            if name == "mnist":
                return _mnist(data_dir)
            return _tabular(name, load_uci(name, data_dir))
        except FileNotFoundError:
            raise  # its message names the file and where to get it
        except (ValueError, OSError, EOFError, pickle.UnpicklingError) as e:
            source = _MNIST_SOURCE if name == "mnist" else _UCI_SOURCE
            raise ValueError(
                f"{name}: a file in {os.fspath(data_dir)} is malformed: {e}. {source}"
            ) from None
    if name in TOY_DATASETS:
        return DataSource(
            name,
            2,
            lambda k, n: toy_sample(name, k, n),
            None,
            lambda seed, n: np.asarray(toy_sample(name, seed_key(seed), n)),
            lambda seed, n: np.zeros(n),
            "toy",
        )
    if name in TABULAR_DATASETS:
        return _tabular(name, load_tabular(name))
    if name == "digits":
        return _images("digits", load_digits(), (8, 8), DIGIT_LEVELS)
    raise ValueError(
        f"unknown data set {name!r}; choose from {ALL_DATASETS + DIRECTORY_DATASETS}, "
        f"or give a data file ({FORMATS_SHOWN})."
    )


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
) -> DataSource:
    """A user's own table of samples as a training source: the files read and checked
    by [`read_table`][cnftrace.datasets.read_table], split by
    [`split_table`][cnftrace.datasets.split_table] (`seed` picks the split), and,
    with `standardize`, standardised by the training rows' mean and standard
    deviation, in float64 on the host (a large offset keeps its precision). Batches
    are drawn from the training rows (standardised), the validation rows are
    standardised too, and `test(seed, n)` returns the first `n` test rows (all of
    them for `n` of `None` or 0) in the data's own units. A column that takes one
    value over the training rows is refused by name: it has no density to learn;
    so, without `standardize`, is a value beyond the range of JAX's float (float32
    unless x64 is on), in which the data are then used. With `drop_missing`, the
    rows with a missing value in the chosen columns are dropped before the split
    (`source.table.dropped` counts them per file); without it, they are refused.
    With `dequantize`, each column whose values lie on a grid
    ([`grid_steps`][cnftrace.datasets.grid_steps]: counts, rounded values) is
    dequantised: each training batch moves it by uniform noise over its grid cell,
    and the validation and test rows by one fixed draw, so the flow learns a density
    spread over each cell rather than spikes on the grid values.
    `header`: whether a text file's first line names its columns (see
    [`read_table`][cnftrace.datasets.read_table]).

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
        # Fixed draws (by the split seed) for the held-out rows; fresh ones in each
        # training batch.
        val = _dequantized(splits.val, grid, seed + 1)
        test = _dequantized(splits.test, grid, seed + 2)
        # What baselines and a fitted base see: the training rows, one fixed draw.
        reference = _dequantized(splits.train, grid, seed)
    return DataSource(
        name,
        table.data.shape[1],
        _resampled(to_model(splits.train), width),
        to_model(val) if splits.val.shape[0] else None,
        *_first_rows(test),
        "file",
        reference=reference,
        standardization=std,
        table=table,
        grid=grid,
        grid_origin=None if grid is None else splits.train.min(axis=0),
    )


def _check_range(table: Table, std: Standardization | None) -> None:
    """A `ValueError` naming the first value of `table` that is beyond the range of
    JAX's default float (float32 unless x64 is on) in the units the flow sees it
    in: as it is, or standardised by `std`."""
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
