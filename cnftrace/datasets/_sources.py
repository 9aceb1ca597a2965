"""The command line's data sets as training sources, one class per kind of data,
with the figures their test NLL is read against."""

import abc
import math
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .._checks import seed_key
from ._files import FORMATS_SHOWN
from ._mnist import _SOURCE as _MNIST_SOURCE, load_mnist_idx
from ._real import (
    DIGIT_LEVELS,
    TABULAR_DATASETS,
    Splits,
    bits_per_dim,
    dequantize,
    load_digits,
    load_tabular,
    logit_transform,
)
from ._toy import TOY_DATASETS, toy_entropy, toy_sample
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
class DataSource(abc.ABC):
    """What a training run needs from its data, as
    [`data_source`][cnftrace.datasets.data_source] and
    [`file_source`][cnftrace.datasets.file_source] return it.

    - `train`: `(key, n) -> batch` of fresh training samples (in model space).
    - `validation`: a fixed array in model space, or `None`.
    - `test`: `test(seed, n)`, the test set in the units of the flow `cnftrace.load`
        returns for this data (a standardised file's own units, else model space):
        `n` samples, or the first `n` rows of a fixed split (all for `None` or 0).
    - `test_log_det`: per-sample `log|dy/dx|` of the test set's preprocessing.
    - `reference`: training samples in `test`'s units for the Gaussian baseline.
    - `fixed_test` (class attribute): whether `test` is a fixed split.
    """

    name: str
    dim: int
    train: Callable
    validation: np.ndarray | None
    test: Callable[[int, int | None], np.ndarray]
    test_log_det: Callable[[int, int | None], np.ndarray]
    reference: np.ndarray | None = None
    fixed_test: ClassVar[bool] = False

    @abc.abstractmethod
    def score(self, nll: float, seed: int, n: int | None) -> dict:
        """The reference figures reported beside a test NLL of `nll` nats (in the
        units of `test`) on `test(seed, n)`, as a dict of JSON values."""

    @property
    def entropy(self) -> float | None:
        """The data's differential entropy in nats where known, else `None`."""
        return None

    @property
    def image_shape(self) -> tuple[int, ...] | None:
        """The shape of one image, for images; `None` for other data."""
        return None

    def to_model(self, x: np.ndarray) -> np.ndarray:
        """Samples in the units of `test` mapped to model space."""
        return x

    def as_data(self, y: np.ndarray) -> np.ndarray:
        """A flow's samples in the units of `test` as the data look (images as
        pixels in `[0, 1]` of shape `image_shape`)."""
        return y


def _baseline(source: DataSource, test: np.ndarray) -> tuple[float | None, str | None]:
    """`(nll, why)`: the Gaussian baseline's test NLL, or `None` and why not."""
    if source.reference is None:
        return None, None
    try:
        return gaussian_baseline_nll(source.reference, test), None
    except ValueError as e:  # a singular covariance: no baseline, and it is said
        return None, str(e)


def table_score(source: DataSource, test: np.ndarray) -> dict:
    """A table's score on `test`: its Gaussian baseline (or why it is undefined)."""
    baseline, undefined = _baseline(source, test)
    report = {"gaussian_baseline_nll": baseline}
    if undefined is not None:
        report["gaussian_baseline_undefined"] = undefined
    return report


@dataclass(frozen=True)
class ToySource(DataSource):
    """A toy 2-D set: fresh samples, no validation set; scored by its entropy."""

    @property
    def entropy(self) -> float:
        return toy_entropy(self.name)

    def score(self, nll, seed, n):
        return {"entropy": self.entropy}


@dataclass(frozen=True)
class TableSource(DataSource):
    """A built-in table: fixed splits; scored against the Gaussian baseline."""

    fixed_test: ClassVar[bool] = True

    def score(self, nll, seed, n):
        return table_score(self, self.test(seed, n))


@dataclass(frozen=True, kw_only=True)
class ImageSource(DataSource):
    """Dequantised images in logit space, flattened; scored in bits per dimension.

    - `shape`: the shape of one image.
    - `levels`: its number of grey levels.
    """

    shape: tuple[int, ...]
    levels: int

    @property
    def image_shape(self) -> tuple[int, ...]:
        return self.shape

    def as_data(self, y):
        return digits_from_logit(np.asarray(y)).reshape(-1, *self.shape)

    def score(self, nll, seed, n):
        mean_ld = float(np.mean(self.test_log_det(seed, n)))
        report = {"bits_per_dim": bits_per_dim(nll - mean_ld, self.dim, self.levels)}
        if self.reference is not None:
            # The same dequantised test set the flow was scored on.
            baseline, undefined = _baseline(self, self.test(seed, n))
            report["gaussian_baseline_bits_per_dim"] = (
                None
                if baseline is None
                else bits_per_dim(baseline - mean_ld, self.dim, self.levels)
            )
            if undefined is not None:
                report["gaussian_baseline_undefined"] = undefined
        return report


def gaussian_baseline_nll(train: np.ndarray, test: np.ndarray) -> float:
    """Test NLL (nats) of a full-covariance Gaussian fitted to `train` by maximum
    likelihood (`1e-6` added to the covariance's diagonal).

    Raises `ValueError` where the fitted covariance is singular.

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
    # Columns scaled exactly by a power of two so that huge values do not overflow.
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


def digits_from_logit(y: np.ndarray) -> np.ndarray:
    """Maps logit-space image samples back to pixels in [0, 1] (clipped).

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
    """Batches of rows of `train` drawn with replacement; with `width`, each column
    moved by fresh uniform noise over `[-width/2, width/2]`."""
    rows = jnp.asarray(train, jnp.result_type(float))

    def sample(key, n):
        if width is None:
            return rows[jr.randint(key, (n,), 0, rows.shape[0])]
        pick, noise = jr.split(key)
        x = rows[jr.randint(pick, (n,), 0, rows.shape[0])]
        u = jr.uniform(noise, x.shape, x.dtype, -0.5, 0.5)
        return x + u * jnp.asarray(width, x.dtype)[None]

    return sample


def _first_rows(test: np.ndarray) -> tuple[Callable, Callable]:
    """`test` and `test_log_det` of a fixed split: its first `n` rows, and zeros."""
    return (
        lambda seed, n: test[:n] if n else test,
        lambda seed, n: np.zeros(test[:n].shape[0] if n else test.shape[0]),
    )


def _tabular(name: str, splits: Splits) -> TableSource:
    return TableSource(
        name,
        splits.train.shape[1],
        _resampled(splits.train),
        splits.val,
        *_first_rows(splits.test),
        reference=splits.train,
    )


def _images(name, splits, image_shape, n_levels, validation_rows=None):
    """Dequantised images: fresh noise every batch, fixed noise otherwise."""
    train = jnp.asarray(splits.train.reshape(splits.train.shape[0], -1))
    dim = math.prod(image_shape)

    def sample(key, n):
        k_idx, k_u = jr.split(key)
        rows = train[jr.randint(k_idx, (n,), 0, train.shape[0])]
        rows = rows.astype(jnp.result_type(float))
        u = jr.uniform(k_u, rows.shape, rows.dtype)
        s = LOGIT_ALPHA + (1 - 2 * LOGIT_ALPHA) * (rows + u) / n_levels
        return jnp.log(s) - jnp.log1p(-s)

    def fixed(split, seed, n=None):
        split = split.reshape(split.shape[0], -1)[:n].astype(np.float64)
        # A 64-bit seed, negative ones too (NumPy takes only non-negative ones).
        x = dequantize(split, np.random.default_rng(seed % 2**64), n_levels)
        return logit_transform(x, LOGIT_ALPHA)

    def test(seed, n):  # the digits' whole test split; at most n MNIST images
        return fixed(splits.test, seed, None if name == "digits" else n)

    return ImageSource(
        name,
        dim,
        sample,
        fixed(splits.val, 1, validation_rows)[0],
        lambda seed, n: test(seed, n)[0],
        lambda seed, n: test(seed, n)[1],
        reference=fixed(splits.train, 0)[0] if name == "digits" else None,
        shape=tuple(image_shape),
        levels=n_levels,
    )


def _mnist(data_dir) -> ImageSource:
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
    """The data set `name` as the command line trains on it: a toy set, a built-in
    table, `"digits"`, or one read from `data_dir` (MAF's UCI sets, see
    [`load_uci`][cnftrace.datasets.load_uci], and `"mnist"`, in `data_dir` or
    `data_dir/mnist`). Images are dequantised in logit space and flattened.
    Raises `ValueError` for an unknown name or a malformed file.

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
        return ToySource(
            name,
            2,
            lambda k, n: toy_sample(name, k, n),
            None,
            lambda seed, n: np.asarray(toy_sample(name, seed_key(seed), n)),
            lambda seed, n: np.zeros(n),
        )
    if name in TABULAR_DATASETS:
        return _tabular(name, load_tabular(name))
    if name == "digits":
        return _images("digits", load_digits(), (8, 8), DIGIT_LEVELS)
    raise ValueError(
        f"unknown data set {name!r}; choose from {ALL_DATASETS + DIRECTORY_DATASETS}, "
        f"or give a data file ({FORMATS_SHOWN})."
    )
