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


def kl_entropies(x, ks=(1, 2, 3, 4, 5)):
    """Kozachenko-Leonenko k-nearest-neighbour entropy estimates (nats), 2-D."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    dist, _ = cKDTree(x).query(x, k=max(ks) + 1)  # column 0 is the point itself
    log_dist = np.log(dist[:, 1:])  # drop the zero self-distances
    return [
        digamma(n) - digamma(k) + math.log(math.pi) + 2 * log_dist[:, k - 1].mean()
        for k in ks
    ]


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


N = 50_000  # one sample size throughout, so each generator compiles once per dtype


@pytest.mark.parametrize("name", TOY_DATASETS)
def test_shape_dtype_determinism(name):
    key = jr.key(0)
    x = toy_sample(name, key, N)
    assert x.shape == (N, 2)
    assert x.dtype == jnp.result_type(float) == jnp.float64  # x64 is on in conftest
    assert bool(jnp.all(jnp.isfinite(x)))
    np.testing.assert_array_equal(x, toy_sample(name, key, N))
    y = toy_sample(name, jr.key(1), N)
    assert np.mean(np.any(x != y, axis=-1)) > 0.99


def test_float32_inside_jit():
    @jax.jit
    def sample_all(key):
        return {name: toy_sample(name, key, 1001, jnp.float32) for name in TOY_DATASETS}

    for name, x in sample_all(jr.key(0)).items():
        assert x.shape == (1001, 2) and x.dtype == jnp.float32, name
        assert bool(jnp.all(jnp.isfinite(x))), name
        assert 0.5 < float(jnp.std(x)) < 3, name  # roughly the right scale


def test_raw_key_and_numpy_int_n():
    x = toy_sample("rings", jr.PRNGKey(3), np.int64(1))
    assert x.shape == (1, 2)


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


def test_bad_dtype():
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
    # 200k samples as 4 x N, reusing the compiled N-sample generator.
    keys = jr.split(jr.key(42), 4)
    x = np.concatenate([np.asarray(toy_sample("8gaussians", k, N)) for k in keys])
    assert abs(_8gaussians_logpdf(x).mean() + toy_entropy("8gaussians")) < 0.01


def test_8gaussians_entropy_by_quadrature():
    # Deterministic check of the overlap-corrected constant: -int p log p on a grid.
    step = 0.02  # the midpoint rule is spectrally accurate here (sigma = 0.35)
    g = np.arange(-5.5, 5.5, step) + step / 2
    pts = np.stack(np.meshgrid(g, g), axis=-1).reshape(-1, 2)
    log_p = _8gaussians_logpdf(pts)
    assert abs(np.exp(log_p).sum() * step**2 - 1) < 1e-6
    entropy = -(np.exp(log_p) * log_p).sum() * step**2
    assert abs(entropy - toy_entropy("8gaussians")) < 1e-5
    closed_form = math.log(8) + math.log(2 * math.pi * math.e * (0.5 / 1.414) ** 2)
    assert 0.006 < closed_form - entropy < 0.0066  # the component-overlap term


def test_checkerboard_support_and_uniformity():
    n = N
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


def test_kl_estimator_on_gaussian():
    x = np.random.default_rng(11).standard_normal((20_000, 2))
    estimates = kl_entropies(x)
    assert max(abs(e - math.log(2 * math.pi * math.e)) for e in estimates) < 0.03


@pytest.mark.parametrize("name", ESTIMATED)
def test_estimated_entropies_match_kl(name):
    estimates = kl_entropies(toy_sample(name, jr.key(123), N))
    assert max(abs(e - toy_entropy(name)) for e in estimates) < 0.05, estimates
