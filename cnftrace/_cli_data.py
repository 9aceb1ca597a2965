"""Data sources for the command line: toy 2-D sets, scikit-learn's tabular sets and
the 8x8 digits (dequantised, in logit space), each with how to score its test set."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
import jax.random as jr
import numpy as np

from .datasets import (
    DIGIT_LEVELS,
    TABULAR_DATASETS,
    TOY_DATASETS,
    bits_per_dim,
    dequantize,
    load_digits,
    load_tabular,
    logit_transform,
    toy_entropy,
    toy_sample,
)

ALL_DATASETS = TOY_DATASETS + TABULAR_DATASETS + ("digits",)
LOGIT_ALPHA = 1e-6


@dataclass(frozen=True)
class DataSource:
    """What a run needs from its data.

    - `train`: `(key, n) -> batch` of fresh training samples (in model space).
    - `validation`, `test`: fixed arrays in model space (`test(seed, n)` for toy data).
    - `test_log_det`: per-sample `log|dy/dx|` of the test set's preprocessing (0 if
        none), so `NLL_x = NLL_y - mean(test_log_det)`.
    - `reference`: the floor or baseline the test NLL is printed beside.
    """

    name: str
    dim: int
    train: Callable
    validation: np.ndarray | None
    test: Callable[[int, int], np.ndarray]
    test_log_det: Callable[[int, int], np.ndarray]
    kind: str  # "toy", "tabular" or "images"


def gaussian_baseline_nll(train: np.ndarray, test: np.ndarray) -> float:
    """Test NLL (nats) of a full-covariance Gaussian fitted to `train` by maximum
    likelihood: the simple baseline a flow should beat."""
    mean = train.mean(axis=0)
    cov = np.cov(train, rowvar=False, bias=True) + 1e-6 * np.eye(train.shape[1])
    chol = np.linalg.cholesky(cov)
    z = np.linalg.solve(chol, (test - mean).T).T
    d = train.shape[1]
    log_det = 2 * np.sum(np.log(np.diag(chol)))
    return float(
        np.mean(0.5 * np.sum(z**2, axis=1) + 0.5 * log_det)
        + 0.5 * d * math.log(2 * math.pi)
    )


def _digits_to_logit(levels, key):
    u = jr.uniform(key, levels.shape, levels.dtype)
    s = LOGIT_ALPHA + (1 - 2 * LOGIT_ALPHA) * (levels + u) / DIGIT_LEVELS
    return jnp.log(s) - jnp.log1p(-s)


def digits_from_logit(y: np.ndarray) -> np.ndarray:
    """Maps logit-space digit samples back to pixel intensities in [0, 1]."""
    s = 1 / (1 + np.exp(-y))
    return np.clip((s - LOGIT_ALPHA) / (1 - 2 * LOGIT_ALPHA), 0, 1)


def get_source(name: str) -> DataSource:
    if name in TOY_DATASETS:
        return DataSource(
            name,
            2,
            lambda k, n: toy_sample(name, k, n),
            None,
            lambda seed, n: np.asarray(toy_sample(name, jr.key(seed), n)),
            lambda seed, n: np.zeros(n),
            "toy",
        )
    if name in TABULAR_DATASETS:
        splits = load_tabular(name)
        train = jnp.asarray(splits.train, jnp.result_type(float))

        def sample(key, n):
            return train[jr.randint(key, (n,), 0, train.shape[0])]

        return DataSource(
            name,
            splits.train.shape[1],
            sample,
            splits.val,
            lambda seed, n: splits.test,
            lambda seed, n: np.zeros(splits.test.shape[0]),
            "tabular",
        )
    if name == "digits":
        splits = load_digits()
        train = jnp.asarray(splits.train, jnp.result_type(float))

        def sample_digits(key, n):
            k_idx, k_u = jr.split(key)
            rows = train[jr.randint(k_idx, (n,), 0, train.shape[0])]
            return _digits_to_logit(rows, k_u)

        def fixed(split, seed):
            x = dequantize(split, np.random.default_rng(seed))
            return logit_transform(x, LOGIT_ALPHA)

        return DataSource(
            name,
            64,
            sample_digits,
            fixed(splits.val, 1)[0],
            lambda seed, n: fixed(splits.test, seed)[0],
            lambda seed, n: fixed(splits.test, seed)[1],
            "images",
        )
    raise ValueError(f"unknown data set {name!r}; choose from {ALL_DATASETS}.")


def score_report(source: DataSource, nll_y: float, seed: int, n: int) -> dict:
    """The reference figures printed beside a test NLL."""
    if source.kind == "toy":
        return {"entropy": toy_entropy(source.name)}
    if source.kind == "tabular":
        splits = load_tabular(source.name)
        return {
            "gaussian_baseline_nll": gaussian_baseline_nll(splits.train, splits.test)
        }
    splits = load_digits()
    y_train, _ = logit_transform(
        dequantize(splits.train, np.random.default_rng(0)), LOGIT_ALPHA
    )
    # The same dequantised test set the flow was scored on.
    baseline_y = gaussian_baseline_nll(y_train, source.test(seed, n))
    mean_ld = float(np.mean(source.test_log_det(seed, n)))
    return {
        "bits_per_dim": bits_per_dim(nll_y - mean_ld, 64),
        "gaussian_baseline_bits_per_dim": bits_per_dim(baseline_y - mean_ld, 64),
    }
