"""What the command line reports beside a test NLL, per data set (the data sources
themselves are `cnftrace.datasets.data_source`)."""

import numpy as np

from .datasets import (
    LOGIT_ALPHA,
    DataSource,
    bits_per_dim,
    dequantize,
    gaussian_baseline_nll,
    load_digits,
    load_tabular,
    logit_transform,
    toy_entropy,
)


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
