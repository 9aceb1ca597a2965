"""Real data that needs no download: scikit-learn's bundled sets.

- `load_digits`: the 8x8 digits as 64-D images with 17 grey levels, uniformly
  dequantised and logit-transformed, with the log-determinant of that transform so
  that a flow's NLL can be turned into bits per dimension of the *discrete* pixels.
- `load_tabular`: bundled tabular sets, standardised with the training statistics.

Splits are fixed (a permutation from a fixed seed), 70% / 15% / 15%.
"""

import math
from typing import NamedTuple

import numpy as np

_SPLIT_SEED = 20190506  # fixed: the same splits on every machine


class Splits(NamedTuple):
    """Train, validation and test arrays (float64 NumPy)."""

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
    """A scikit-learn tabular set (`"breast_cancer"` 30-D, `"wine"` 13-D or
    `"diabetes"` 10-D), split 70/15/15 and standardised with the training mean and
    standard deviation. Labels are dropped: these are density-estimation data."""
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
    """scikit-learn's 8x8 digits as integer grey levels 0..16, shape `(n, 64)`,
    split 70/15/15. Dequantise with [`dequantize`][cnftrace.datasets.dequantize]."""
    x = _sklearn().load_digits().data.astype(np.float64)
    return _split(x)


def dequantize(
    levels_array: np.ndarray, rng: np.random.Generator, levels: int = DIGIT_LEVELS
) -> np.ndarray:
    """Uniform dequantisation: `(k + u) / levels` with `u ~ U[0, 1)`, in `[0, 1)`."""
    u = rng.random(levels_array.shape)
    return (levels_array + u) / levels


def logit_transform(
    x: np.ndarray, alpha: float = 1e-6
) -> tuple[np.ndarray, np.ndarray]:
    """`y = logit(alpha + (1 - 2 alpha) x)` for `x` in `[0, 1]`, and the per-sample
    log-determinant `sum log|dy/dx|`. The density of `x` is then
    `log p_x(x) = log p_y(y) + log_det`."""
    s = alpha + (1 - 2 * alpha) * x
    y = np.log(s) - np.log1p(-s)
    log_det = np.sum(np.log1p(-2 * alpha) - np.log(s) - np.log1p(-s), axis=-1)
    return y, log_det


def bits_per_dim(nll_x: float, dim: int, levels: int = DIGIT_LEVELS) -> float:
    """Bits per dimension of discrete data from the NLL (nats) of its dequantised
    version in `[0, 1]^dim`: `(nll_x + dim log(levels)) / (dim log 2)`. This is an
    upper bound on the discrete data's negative log2-likelihood per dimension."""
    return (nll_x + dim * math.log(levels)) / (dim * math.log(2))
