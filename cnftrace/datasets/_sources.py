"""The data sets of the command line as training sources: toy 2-D sets, scikit-learn's
tabular sets and the 8x8 digits (dequantised, in logit space), with the Gaussian
baseline their test NLL is read against."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ._real import (
    DIGIT_LEVELS,
    TABULAR_DATASETS,
    dequantize,
    load_digits,
    load_tabular,
    logit_transform,
)
from ._toy import TOY_DATASETS, toy_sample

ALL_DATASETS = TOY_DATASETS + TABULAR_DATASETS + ("digits",)
# The digits' logit transform: `logit(alpha + (1 - 2 alpha) x)`.
LOGIT_ALPHA = 1e-6


@dataclass(frozen=True)
class DataSource:
    """What a training run needs from its data, as
    [`data_source`][cnftrace.datasets.data_source] returns it.

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
    likelihood (with `1e-6` added to the covariance's diagonal): the simple baseline
    a flow should beat.

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import gaussian_baseline_nll

        rng = np.random.default_rng(0)
        train, test = rng.normal(size=(1000, 3)), rng.normal(size=(500, 3))
        print(gaussian_baseline_nll(train, test))  # about 3 * 1.42 nats
        ```
    """
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
    """Maps logit-space digit samples back to pixel intensities in [0, 1] (the
    inverse of the `digits` source's logit transform, clipped).

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import digits_from_logit

        print(digits_from_logit(np.array([-20.0, 0.0, 20.0])))  # [0.  0.5 1. ]
        ```
    """
    s = 1 / (1 + np.exp(-y))
    return np.clip((s - LOGIT_ALPHA) / (1 - 2 * LOGIT_ALPHA), 0, 1)


def data_source(name: str) -> DataSource:
    """The data set `name` as the command line trains on it: a toy 2-D set (fresh
    samples every batch), a scikit-learn tabular set (batches drawn from its training
    split) or `"digits"` (dequantised with fresh noise every batch, in logit space,
    flattened to 64 values).

    !!! example

        ```python
        from cnftrace.datasets import data_source

        source = data_source("digits")
        batch = source.train(jr.key(0), 16)      # (16, 64), logit space
        test = source.test(2024, 0)             # a fixed dequantisation
        print(source.dim, batch.shape, test.shape)
        ```
    """
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
