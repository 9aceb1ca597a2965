import math

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from scipy.spatial import cKDTree
from scipy.special import digamma, logsumexp

from cnftrace.datasets import (
    TOY_DATASETS,
    toy_entropy,
    toy_entropy_is_exact,
    toy_sample,
)

ESTIMATED = [name for name in TOY_DATASETS if not toy_entropy_is_exact(name)]


def kl_entropy(x, k):
    """Kozachenko-Leonenko k-nearest-neighbour entropy estimate (nats), 2-D."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    dist, _ = cKDTree(x).query(x, k=k + 1)
    return digamma(n) - digamma(k) + math.log(math.pi) + 2 * np.log(dist[:, k]).mean()


def test_names_and_exactness():
    assert TOY_DATASETS == (
        "swissroll",
        "8gaussians",
        "pinwheel",
        "circles",
        "moons",
        "2spirals",
        "checkerboard",
        "rings",
    )
    assert sorted(ESTIMATED) == sorted(
        set(TOY_DATASETS) - {"8gaussians", "checkerboard"}
    )
    for name in TOY_DATASETS:
        assert isinstance(toy_entropy(name), float)
        assert math.isfinite(toy_entropy(name))


@pytest.mark.parametrize("name", TOY_DATASETS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_shape_dtype_determinism(name, dtype):
    key = jr.key(0)
    x = toy_sample(name, key, 1001, dtype)
    assert x.shape == (1001, 2)
    assert x.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(x)))
    np.testing.assert_array_equal(x, toy_sample(name, key, 1001, dtype))
    y = toy_sample(name, jr.key(1), 1001, dtype)
    assert not np.allclose(x, y)
    assert toy_sample(name, jr.PRNGKey(3), 1, dtype).shape == (1, 2)  # raw key, n=1


def test_default_dtype_and_jit():
    x = toy_sample("moons", jr.key(0), 5)
    assert x.dtype == jnp.result_type(float)
    y = jax.jit(lambda k: toy_sample("moons", k, 5))(jr.key(0))
    np.testing.assert_array_equal(x, y)


def test_unknown_name():
    with pytest.raises(ValueError, match="swissroll.*checkerboard.*rings"):
        toy_sample("spirals", jr.key(0), 10)
    with pytest.raises(ValueError, match="8gaussians"):
        toy_entropy("gaussians")
    with pytest.raises(ValueError, match="unknown toy dataset"):
        toy_entropy_is_exact("nope")


@pytest.mark.parametrize("n", [0, -3, 2.0, 2.5, True, "10", None])
def test_bad_n(n):
    with pytest.raises(ValueError, match="positive integer"):
        toy_sample("rings", jr.key(0), n)


def test_numpy_int_n_and_bad_dtype():
    assert toy_sample("rings", jr.key(0), np.int64(4)).shape == (4, 2)
    with pytest.raises(ValueError, match="floating"):
        toy_sample("rings", jr.key(0), 4, jnp.int32)


def _8gaussians_logpdf(x):
    sigma = 0.5 / 1.414
    angles = np.arange(8) * np.pi / 4
    centres = (4 / 1.414) * np.stack([np.cos(angles), np.sin(angles)], axis=-1)
    d2 = np.sum((x[:, None, :] - centres[None, :, :]) ** 2, axis=-1)
    return logsumexp(-d2 / (2 * sigma**2), axis=-1) - math.log(
        8 * 2 * math.pi * sigma**2
    )


def test_8gaussians_log_density_matches_entropy():
    x = np.asarray(toy_sample("8gaussians", jr.key(42), 200_000))
    assert abs(_8gaussians_logpdf(x).mean() + toy_entropy("8gaussians")) < 0.01


def test_8gaussians_entropy_by_quadrature():
    # Deterministic check of the overlap-corrected constant: -int p log p on a grid.
    step = 0.01
    g = np.arange(-5.5, 5.5, step) + step / 2
    pts = np.stack(np.meshgrid(g, g), axis=-1).reshape(-1, 2)
    log_p = _8gaussians_logpdf(pts)
    assert abs(np.exp(log_p).sum() * step**2 - 1) < 1e-6
    entropy = -(np.exp(log_p) * log_p).sum() * step**2
    assert abs(entropy - toy_entropy("8gaussians")) < 1e-5
    closed_form = math.log(8) + math.log(2 * math.pi * math.e * (0.5 / 1.414) ** 2)
    assert 0.006 < closed_form - entropy < 0.0066  # the component-overlap term


def test_checkerboard_support_and_uniformity():
    n = 200_000
    x = np.asarray(toy_sample("checkerboard", jr.key(7), n))
    assert np.all(np.abs(x) <= 4)
    square = np.floor(x / 2).astype(int)  # 4 x 4 board of 2 x 2 squares
    assert np.all((square[:, 0] + square[:, 1]) % 2 == 0)  # black squares only
    cell = np.floor(x).astype(int) + 4  # 8 x 8 grid of unit cells
    counts = np.zeros((8, 8))
    np.add.at(counts, (cell[:, 0], cell[:, 1]), 1)
    black = ((np.arange(8)[:, None] // 2 + np.arange(8)[None, :] // 2) % 2) == 0
    assert black.sum() == 32  # so the support has area 32 = exp(entropy)
    frac = counts[black] / n
    sd = math.sqrt((1 / 32) * (1 - 1 / 32) / n)
    assert np.all(np.abs(frac - 1 / 32) < 5 * sd), frac
    assert toy_entropy("checkerboard") == pytest.approx(math.log(32))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_kl_estimator_on_gaussian(k):
    x = jr.normal(jr.key(11), (20_000, 2))
    assert abs(kl_entropy(x, k) - math.log(2 * math.pi * math.e)) < 0.03


@pytest.mark.parametrize("name", ESTIMATED)
def test_estimated_entropies_match_kl(name):
    x = toy_sample(name, jr.key(123), 50_000)
    estimates = [kl_entropy(x, k) for k in range(1, 6)]
    assert max(abs(e - toy_entropy(name)) for e in estimates) < 0.05, estimates
