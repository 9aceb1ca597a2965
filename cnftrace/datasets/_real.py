"""Real data that needs no download (scikit-learn's bundled digits and tables), in
fixed 70/15/15 splits, and the digits' dequantisation and logit transform."""

import math
from typing import NamedTuple

import numpy as np

_SPLIT_SEED = 20190506  # fixed: the same splits on every machine


class Splits(NamedTuple):
    """Train, validation and test arrays of shape `(n, dim)` (float64 NumPy), as
    [`load_digits`][cnftrace.datasets.load_digits],
    [`load_tabular`][cnftrace.datasets.load_tabular] and
    [`load_uci`][cnftrace.datasets.load_uci] return them; a named tuple, so it
    unpacks as `train, val, test = splits`.

    !!! example

        ```python
        import numpy as np

        from cnftrace.datasets import Splits

        splits = Splits(np.zeros((7, 2)), np.zeros((2, 2)), np.zeros((1, 2)))
        train, val, test = splits
        print(splits.val.shape, len(test))  # (2, 2) 1
        ```
    """

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray


def _split(x: np.ndarray) -> Splits:
    perm = np.random.default_rng(_SPLIT_SEED).permutation(x.shape[0])
    n_train = int(round(0.7 * x.shape[0]))
    n_val = int(round(0.15 * x.shape[0]))
    x = x[perm]
    return Splits(x[:n_train], x[n_train : n_train + n_val], x[n_train + n_val :])


def _sklearn():
    try:
        import sklearn.datasets as skd
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the bundled real data sets need scikit-learn: `pip install scikit-learn`."
        ) from e
    return skd


TABULAR_DATASETS = ("breast_cancer", "wine", "diabetes")


def load_tabular(name: str) -> Splits:
    """Loads a tabular data set bundled with scikit-learn, for density estimation.

    The rows are split 70/15/15 by a fixed permutation (the same splits on every
    machine) and standardised with the training mean and standard deviation; the
    labels are dropped. Needs scikit-learn.

    **Arguments:**

    - `name`: one of `TABULAR_DATASETS`: `"breast_cancer"` (30-D), `"wine"` (13-D)
        or `"diabetes"` (10-D).

    **Returns:**

    [`Splits`][cnftrace.datasets.Splits]`(train, val, test)` of float64 arrays, each
    of shape `(n, dim)`.

    Raises `ValueError` for an unknown `name`.

    !!! example

        ```python
        from cnftrace.datasets import load_tabular

        train, val, test = load_tabular("wine")
        print(train.shape, val.shape, test.shape)  # (125, 13) (27, 13) (26, 13)
        ```
    """
    if name not in TABULAR_DATASETS:
        raise ValueError(
            f"unknown tabular data set {name!r}; choose from {TABULAR_DATASETS}."
        )
    skd = _sklearn()
    x = getattr(skd, f"load_{name}")().data.astype(np.float64)
    splits = _split(x)
    mean = splits.train.mean(axis=0)
    std = splits.train.std(axis=0)
    std = np.where(std > 0, std, 1.0)
    return Splits(*((s - mean) / std for s in splits))


DIGIT_LEVELS = 17  # pixel values 0..16


def load_digits() -> Splits:
    """Loads scikit-learn's 8x8 digits as integer grey levels 0..16 (17 levels).

    The rows are split 70/15/15 by a fixed permutation. Dequantise them with
    [`dequantize`][cnftrace.datasets.dequantize], then map them to the real line
    with [`logit_transform`][cnftrace.datasets.logit_transform]. Needs
    scikit-learn.

    **Returns:**

    [`Splits`][cnftrace.datasets.Splits]`(train, val, test)` of float64 arrays of
    shape `(n, 64)`, with integer values 0 to 16.

    !!! example

        ```python
        from cnftrace.datasets import load_digits

        train, val, test = load_digits()
        print(train.shape, train.max())  # (1258, 64) 16.0
        ```
    """
    x = _sklearn().load_digits().data.astype(np.float64)
    return _split(x)


def dequantize(
    levels_array: np.ndarray, rng: np.random.Generator, levels: int = DIGIT_LEVELS
) -> np.ndarray:
    """Dequantises integer levels uniformly: `(k + u) / levels` with `u ~ U[0, 1)`.

    **Arguments:**

    - `levels_array`: the integer levels `k`, in `0..levels - 1`, any shape.
    - `rng`: a NumPy random generator, which draws `u`.
    - `levels`: the number of levels; 17 (`DIGIT_LEVELS`, the digits' grey levels)
        by default.

    **Returns:**

    A float array of the same shape, with values in `[0, 1)`.

    !!! example

        ```python
        import numpy as np

        from cnftrace.datasets import dequantize

        x = dequantize(np.array([[0.0, 16.0]]), np.random.default_rng(0))
        print(x)  # about [[0.037 0.957]]: 0/17 + u/17 and 16/17 + u/17
        ```
    """
    u = rng.random(levels_array.shape)
    return (levels_array + u) / levels


def logit_transform(
    x: np.ndarray, alpha: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """Maps `x` in `[0, 1]` to the real line: `y = logit(alpha + (1 - 2 alpha) x)`.

    It also returns the per-sample log-determinant `sum log|dy/dx|`. The density of
    `x` is then `log p_x(x) = log p_y(y) + log_det`.

    **Arguments:**

    - `x`: the data in `[0, 1]`, shape `(..., dim)`; the last axis is summed in
        the log-determinant.
    - `alpha`: a small margin that keeps `0` and `1` away from infinite logits.

    **Returns:**

    `(y, log_det)`: `y` has the shape of `x`, and `log_det` has its shape without
    the last axis.

    !!! example

        ```python
        import numpy as np

        from cnftrace.datasets import logit_transform

        y, log_det = logit_transform(np.array([[0.25, 0.5]]))
        print(y, log_det)  # about [[-1.0986  0.]] [3.0603]
        ```
    """
    s = alpha + (1 - 2 * alpha) * x
    y = np.log(s) - np.log1p(-s)
    log_det = np.sum(np.log1p(-2 * alpha) - np.log(s) - np.log1p(-s), axis=-1)
    return y, log_det


def bits_per_dim(nll_x: float, dim: int, levels: int = DIGIT_LEVELS) -> float:
    """Converts the NLL (in nats) of dequantised data in `[0, 1]^dim` into bits per
    dimension of the discrete data: `(nll_x + dim log(levels)) / (dim log 2)`.

    This is an upper bound on the discrete data's negative log2-likelihood per
    dimension.

    **Arguments:**

    - `nll_x`: the NLL per sample, in nats, of the dequantised data in `[0, 1]`.
        For a flow trained on `y` from
        [`logit_transform`][cnftrace.datasets.logit_transform], this is
        `nll_y - log_det` (averaged over the samples).
    - `dim`: the number of dimensions, e.g. 64 for the digits.
    - `levels`: the number of discrete levels; 17 (`DIGIT_LEVELS`) by default.

    !!! example

        ```python
        from cnftrace.datasets import bits_per_dim

        print(bits_per_dim(-50.0, dim=64))  # about 2.96
        ```
    """
    return (nll_x + dim * math.log(levels)) / (dim * math.log(2))
