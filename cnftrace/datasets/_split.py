"""A table's rows split into training, validation and test rows, at random from a
seed, with enough rows in each part for a held-out NLL and its standard error."""

import math

import numpy as np

from .._defaults import TEST_FRACTION, VAL_FRACTION
from ._real import Splits


def _split_sizes(n: int, val_fraction: float, test_fraction: float):
    n_test = int(round(test_fraction * n))
    n_val = int(round(val_fraction * n))
    return n - n_val - n_test, n_val, n_test


def _enough(n: int, val_fraction: float, test_fraction: float) -> bool:
    """Two training rows, two test rows and (unless `val_fraction` is 0) two
    validation rows: a held-out NLL comes with its standard error."""
    n_train, n_val, n_test = _split_sizes(n, val_fraction, test_fraction)
    return n_train >= 2 and n_test >= 2 and (n_val >= 2 or val_fraction == 0)


def _min_rows(val_fraction: float, test_fraction: float) -> int:
    """The fewest rows a split has `_enough` of, computed from the fractions (a
    search from one row hung for a fraction of 1e-9). `round(f * n) >= 2` needs
    `f * n >= 1.5`, and `n - round(v * n) - round(t * n) >= 2` needs
    `n * (1 - v - t) >= 1`; from that bound (less a row for rounding), the sizes are
    checked up to where `f * n >= 2.5` and `n * (1 - v - t) >= 3` make them
    certain, at most 10,000 rows on (beyond, that certain size is the answer)."""
    v, t = val_fraction, test_fraction
    bounds = [1.5 / t, 1 / (1 - v - t)] + ([1.5 / v] if v else [])
    low = max(1, math.ceil(max(bounds)) - 1)
    sure = [2.5 / t, 3 / (1 - v - t)] + ([2.5 / v] if v else [])
    high = max(low, math.ceil(max(sure)) + 1)
    for n in range(low, min(high, low + 10_000)):
        if _enough(n, v, t):
            return n
    return high


def split_table(
    data: np.ndarray,
    *,
    val_fraction: float = VAL_FRACTION,
    test_fraction: float = TEST_FRACTION,
    seed: int = 0,
    name: str = "data",
) -> Splits:
    """A fixed train/validation/test split of the rows of `data`: a permutation drawn
    from `seed` (`numpy.random.default_rng(seed)`), then `round(test_fraction * n)`
    test rows, `round(val_fraction * n)` validation rows, and the rest for training.
    The same `data` and `seed` always give the same split.

    **Arguments:**

    - `data`: the samples, shape `(n, dim)`.
    - `val_fraction`: the share of validation rows, in `[0, 1)` (0: none).
    - `test_fraction`: the share of test rows, in `(0, 1)`.
    - `seed`: picks the permutation.
    - `name`: what to call `data` in an error (a file name, say).

    **Returns:**

    [`Splits`][cnftrace.datasets.Splits]`(train, val, test)`. A `ValueError` says how
    many rows the fractions need when `data` has too few (two training rows, two
    test rows and, unless `val_fraction` is 0, two validation rows: a held-out NLL
    comes with its standard error).

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import split_table

        train, val, test = split_table(np.arange(40.0).reshape(20, 2), seed=1)
        print(train.shape, val.shape, test.shape)  # (16, 2) (2, 2) (2, 2)
        ```
    """
    for label, value, low_open in (
        ("val_fraction", val_fraction, False),
        ("test_fraction", test_fraction, True),
    ):
        if not (0 < value < 1 if low_open else 0 <= value < 1):
            interval = "(0, 1)" if low_open else "[0, 1)"
            raise ValueError(f"`{label}` must be in {interval}; got {value!r}.")
    if val_fraction + test_fraction >= 1:
        raise ValueError(
            f"`val_fraction` + `test_fraction` = {val_fraction + test_fraction} leaves "
            "no rows for training; make them add up to less than 1."
        )
    data = np.asarray(data)
    n = data.shape[0]
    n_train, n_val, n_test = _split_sizes(n, val_fraction, test_fraction)
    if not _enough(n, val_fraction, test_fraction):
        need = max(_min_rows(val_fraction, test_fraction), n + 1)
        raise ValueError(
            f"{name} has {n} row(s); a split with validation fraction {val_fraction} "
            f"and test fraction {test_fraction} needs at least {need} (two to train "
            "on, two to test, two to validate). Add rows, or change the fractions."
        )
    perm = np.random.default_rng(seed).permutation(n)
    test, val, train = np.split(perm, [n_test, n_test + n_val])
    return Splits(data[train], data[val], data[test])
