"""Targets known by their energy: the 2-D mixture's normaliser by quadrature, DW4's
and LJ13's energies against hand computations and their invariances, and the
replica-exchange sampler against a density whose answer is known (float64)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace
from cnftrace.datasets import (
    TARGETS,
    dw4,
    energy_target,
    lj13,
    mixture_2d,
    random_walk_metropolis,
)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


@eqx.filter_jit
def _energy(target, x):
    """`target.energy(x)` as one compiled program (per target and shape): called
    eagerly, each of its operations would compile a program of its own."""
    return target.energy(x)


@eqx.filter_jit
def _pair_energy(target, d):
    """`target.pair_energy(d)`, compiled likewise."""
    return target.pair_energy(d)


@eqx.filter_jit
def _sample(target, key, n):
    """`target.sample(key, n)` of an exact sampler, compiled likewise."""
    return target.sample(key, n)


def test_mixture_normaliser_by_quadrature():
    target = mixture_2d()
    assert target.log_z == pytest.approx(math.log(3.0), abs=1e-15)
    grid = np.linspace(-7, 7, 701)
    step = grid[1] - grid[0]
    xx, yy = np.meshgrid(grid, grid)
    points = jnp.asarray(np.stack([xx.ravel(), yy.ravel()], axis=1))
    energy = np.asarray(_energy(target, points))
    z = np.exp(-energy).sum() * step**2
    assert math.log(z) == pytest.approx(target.log_z, abs=1e-6)
    # Its exact samples have the mean energy that the quadrature gives.
    mean_energy = (np.exp(-energy) * energy).sum() * step**2 / z
    x = _sample(target, jr.key(0), 100_000)
    e = np.asarray(_energy(target, x))
    assert abs(e.mean() - mean_energy) < 4 * e.std() / math.sqrt(e.size)


def _square(side):
    return np.array([[0, 0], [side, 0], [side, side], [0, side]], float) - side / 2


def test_dw4_energy_by_hand_and_its_invariances():
    target = dw4()
    # A square of side s: four pairs at s, two at s sqrt(2).
    s = 2.5

    def pair(d):
        return 0.9 * (d - 4) ** 4 - 4 * (d - 4) ** 2

    want = 4 * pair(s) + 2 * pair(s * math.sqrt(2))
    np.testing.assert_allclose(
        _energy(target, jnp.asarray(_square(s)[None])), [want], rtol=1e-13
    )
    x = np.asarray(jr.normal(jr.key(0), (3, 4, 2))) * 2
    c, si = math.cos(1.1), math.sin(1.1)
    rot = np.array([[c, -si], [si, c]]) @ np.diag([-1.0, 1.0])
    moved = x[:, [3, 1, 0, 2]] @ rot.T + np.array([[[5.0, -1.0]]])
    np.testing.assert_allclose(
        _energy(target, jnp.asarray(moved)),
        _energy(target, jnp.asarray(x)),
        rtol=1e-12,
    )
    with pytest.raises(ValueError, match=r"\(n, 4, 2\)"):
        target.energy(jnp.zeros((3, 8)))


def test_lj13_pair_minimum_and_trap():
    target = lj13()
    d = np.linspace(0.8, 2.0, 1201)
    e = np.asarray(_pair_energy(target, jnp.asarray(d)))
    assert float(d[np.argmin(e)]) == pytest.approx(1.0, abs=1e-3)
    assert float(e.min()) == pytest.approx(-1.0, abs=1e-9)
    # Two particles at distance 1, the rest far away: the energy is one pair's -1,
    # the distant pairs' (small) share, and the trap's half squared radius.
    x = np.asarray(jr.normal(jr.key(1), (1, 13, 3))) * 50
    x[0, 1] = x[0, 0] + np.array([1.0, 0, 0])
    i, j = np.triu_indices(13, 1)
    dist = np.linalg.norm(x[0, i] - x[0, j], axis=1)
    pairs = np.sum(dist**-12 - 2 * dist**-6)
    centred = x[0] - x[0].mean(axis=0)
    want = pairs + 0.5 * np.sum(centred**2)
    np.testing.assert_allclose(_energy(target, jnp.asarray(x)), [want], rtol=1e-12)
    assert TARGETS == ("mixture2d", "dw4", "lj13")
    assert energy_target("lj13").event_shape == (13, 3)
    with pytest.raises(ValueError, match="unknown target"):
        energy_target("lj55")


def test_replica_exchange_finds_both_modes_in_their_proportions():
    """0.3 N(-4, 0.5^2) + 0.7 N(4, 0.5^2) with every chain started in the left mode:
    plain random-walk Metropolis mostly stays there, replica exchange up to a
    temperature of 27 recovers the right mode's 0.7."""

    def log_prob(x):
        x = x[:, 0]
        left = math.log(0.3) - 0.5 * ((x + 4) / 0.5) ** 2
        right = math.log(0.7) - 0.5 * ((x - 4) / 0.5) ** 2
        return jnp.logaddexp(left, right)

    x0 = jnp.full((200, 1), -4.0)
    settings = dict(key=jr.key(0), burn_in=300, thin=5, step_size=0.5)
    stuck = np.asarray(random_walk_metropolis(log_prob, x0, 20, **settings))
    assert np.mean(stuck > 0) < 0.4
    mixed = random_walk_metropolis(
        log_prob, x0, 20, temperatures=(1.0, 3.0, 9.0, 27.0), **settings
    )
    assert abs(np.mean(np.asarray(mixed) > 0) - 0.7) < 0.05
    with pytest.raises(ValueError, match="temperatures"):
        random_walk_metropolis(log_prob, x0, 2, key=jr.key(0), temperatures=(2.0,))


def test_dw4_reference_samples_are_mean_free_and_seeded():
    target = dw4()
    settings = dict(chains=50, burn_in=100, thin=5)
    x = target.sample(jr.key(0), 120, **settings)
    assert x.shape == (120, 4, 2)
    np.testing.assert_allclose(np.asarray(x).mean(axis=1), 0.0, atol=1e-12)
    np.testing.assert_array_equal(x, target.sample(jr.key(0), 120, **settings))
    # Relaxed from the spread-out start.
    assert float(np.mean(_energy(target, x))) < -15


@pytest.mark.parametrize("make", ["warped_product", "heavy_tailed"])
def test_product_densities_draw_each_column_from_its_own_key(make):
    """B5's product densities draw the columns of one marginal in one vmapped call;
    the draws must be those of one call per column with the column's key, warps
    and rotation applied after."""
    from cnftrace.datasets import _known

    density = getattr(cnftrace.datasets, make)(12, seed=0)
    key, n = jr.key(7), 33
    keys = jr.split(key, density.dim)
    s = np.stack(
        [
            np.asarray(_known._marginal_sample(m, k, n, jnp.float64))
            for m, k in zip(density.marginals, keys)
        ],
        axis=1,
    )
    assert len(set(density.marginals)) < density.dim  # some marginal repeats
    for i, j, b in density.warps:
        s[:, j] += b * (s[:, i] ** 2 - 1)
    rotation, scale = np.asarray(density.rotation), np.asarray(density.scale)
    expected = (s @ rotation.T) * scale[None]
    # The sampler is one compiled program, whose fused arithmetic may round the last
    # bit otherwise than these operations run one by one; a wrong key moves a draw
    # by about its standard deviation, 1.
    np.testing.assert_allclose(
        density.sample(key, n, jnp.float64), expected, rtol=0, atol=1e-13
    )
