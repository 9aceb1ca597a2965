import math

import numpy as np
import pytest

from cnftrace.datasets import (
    TABULAR_DATASETS,
    bits_per_dim,
    dequantize,
    load_digits,
    load_tabular,
    logit_transform,
)


@pytest.mark.parametrize("name", TABULAR_DATASETS)
def test_tabular_splits_are_fixed_and_standardised(name):
    a, b = load_tabular(name), load_tabular(name)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    n = sum(s.shape[0] for s in a)
    assert abs(a.train.shape[0] - 0.7 * n) <= 1
    np.testing.assert_allclose(a.train.mean(axis=0), 0, atol=1e-10)
    np.testing.assert_allclose(a.train.std(axis=0), 1, atol=1e-10)
    # No sample is in two splits.
    rows = {tuple(r) for r in a.train}
    assert not any(tuple(r) in rows for r in a.test)


def test_unknown_tabular():
    with pytest.raises(ValueError, match="breast_cancer"):
        load_tabular("iris2")


def test_digits_and_dequantisation():
    d = load_digits()
    assert d.train.shape[1] == 64
    assert sum(s.shape[0] for s in d) == 1797
    assert d.train.min() == 0 and d.train.max() == 16
    x = dequantize(d.train, np.random.default_rng(0))
    assert x.min() >= 0 and x.max() < 1
    np.testing.assert_array_equal(np.floor(x * 17), d.train)


def test_logit_transform_log_det_matches_finite_differences():
    rng = np.random.default_rng(1)
    x = rng.random((5, 3))
    y, log_det = logit_transform(x, alpha=0.05)
    eps = 1e-6
    slopes = (logit_transform(x + eps, 0.05)[0] - logit_transform(x - eps, 0.05)[0]) / (
        2 * eps
    )
    np.testing.assert_allclose(log_det, np.sum(np.log(slopes), axis=-1), rtol=1e-7)
    # Its inverse is the logistic map.
    s = 1 / (1 + np.exp(-y))
    np.testing.assert_allclose((s - 0.05) / 0.9, x, rtol=1e-12)


def test_bits_per_dim_of_uniform_model():
    # The uniform density on [0,1]^D has NLL 0: exactly log2(levels) bits per dim.
    assert bits_per_dim(0.0, 64, 17) == pytest.approx(math.log2(17))


def test_toy_log_prob_true_densities():
    import jax.numpy as jnp
    import jax.random as jr

    from cnftrace.datasets import toy_entropy, toy_log_prob, toy_sample

    # Mean -log p over many samples estimates the entropy.
    for name in ["8gaussians", "checkerboard"]:
        x = toy_sample(name, jr.key(0), 100_000)
        lp = toy_log_prob(name, x)
        assert jnp.all(jnp.isfinite(lp))
        se = jnp.std(lp) / jnp.sqrt(lp.size) + 1e-12
        assert abs(-jnp.mean(lp) - toy_entropy(name)) < 4 * se + 1e-9
    # Checkerboard: zero density on white squares and off the board.
    white = jnp.array([[1.0, 1.0], [-3.0, -3.0], [5.0, 0.0]]) * jnp.array([[1.0, -1.0]])
    assert jnp.all(jnp.isneginf(toy_log_prob("checkerboard", white)))
    with pytest.raises(ValueError, match="no closed form"):
        toy_log_prob("moons", jnp.zeros((2, 2)))


def test_gaussian_baseline_matches_scipy():
    from scipy.stats import multivariate_normal

    from cnftrace.datasets import gaussian_baseline_nll

    rng = np.random.default_rng(3)
    train = rng.normal(size=(500, 3)) @ np.array(
        [[1, 0, 0], [0.5, 1, 0], [0, 0.3, 2.0]]
    )
    test = rng.normal(size=(100, 3))
    mean, cov = train.mean(0), np.cov(train, rowvar=False, bias=True)
    ref = -multivariate_normal(mean, cov + 1e-6 * np.eye(3)).logpdf(test).mean()
    assert gaussian_baseline_nll(train, test) == pytest.approx(ref, rel=1e-10)
