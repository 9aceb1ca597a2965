"""The default vector field (`MLPField`) and the densities with a known log-density."""

import math

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from scipy import stats

import cnftrace
from cnftrace.datasets import (
    MARGINALS,
    gaussian_mixture,
    rotated_product,
    warped_product,
)
from cnftrace.datasets._known import _marginal_log_prob, _marginal_sample


def test_mlp_field_shapes_dtypes_and_time_features():
    field = cnftrace.MLPField(3, width=8, depth=2, key=jr.key(0))
    y = jnp.arange(3.0)
    out = field(0.25, y, None)
    assert out.shape == (3,) and out.dtype == jnp.float64
    # The input is [y, cos(k pi t), sin(k pi t)] for k = 1..3: an MLP of that.
    k = jnp.arange(1, 4) * jnp.pi * 0.25
    expected = field.mlp(jnp.concatenate([y, jnp.cos(k), jnp.sin(k)]))
    np.testing.assert_allclose(out, expected, rtol=1e-12)
    assert field.mlp.in_size == 3 + 6
    # float32 parameters give float32 output; an autonomous field ignores t.
    f32 = cnftrace.MLPField(2, width=4, freqs=0, key=jr.key(1), dtype=jnp.float32)
    y32 = jnp.ones(2, jnp.float32)
    assert f32(0.0, y32).dtype == jnp.float32
    np.testing.assert_array_equal(f32(0.0, y32), f32(0.9, y32))
    # zero_last starts the flow at the identity.
    z = cnftrace.MLPField(2, width=4, zero_last=True, key=jr.key(2))
    np.testing.assert_array_equal(z(0.3, jnp.ones(2)), jnp.zeros(2))


def test_mlp_field_conditional_and_in_a_flow():
    field = cnftrace.MLPField(2, width=8, depth=1, context_dim=3, key=jr.key(0))
    c = jnp.array([1.0, -2.0, 0.5])
    k = jnp.arange(1, 4) * jnp.pi * 0.5
    y = jnp.ones(2)
    expected = field.mlp(jnp.concatenate([y, jnp.cos(k), jnp.sin(k), c]))
    np.testing.assert_allclose(field(0.5, y, c), expected, rtol=1e-12)
    flow = cnftrace.CNF(field, 2, t1=0.5, context_dim=3)
    x = jr.normal(jr.key(1), (4, 2))
    ctx = jr.normal(jr.key(2), (4, 3))
    lp = flow.log_prob(x, context=ctx)
    assert lp.shape == (4,) and bool(jnp.all(jnp.isfinite(lp)))
    # Each sample's density depends on its own context.
    assert not np.allclose(lp, flow.log_prob(x, context=-ctx))
    with pytest.raises(ValueError, match="context_dim=3"):
        field(0.5, y, None)


def test_mlp_field_bad_arguments():
    for kwargs, match in [
        ({"dim": 0}, "`dim` must be an int >= 1"),
        ({"dim": 2, "width": 2.5}, "`width` must be an int >= 1"),
        ({"dim": 2, "depth": -1}, "`depth` must be an int >= 0"),
        ({"dim": 2, "freqs": True}, "`freqs` must be an int >= 0"),
        ({"dim": 2, "context_dim": -1}, "`context_dim` must be an int >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            cnftrace.MLPField(key=jr.key(0), **kwargs)
    with pytest.raises(TypeError, match="`activation` must be a function"):
        cnftrace.MLPField(2, activation="tanh", key=jr.key(0))
    field = cnftrace.MLPField(2, width=4, key=jr.key(0))
    with pytest.raises(ValueError, match=r"one sample of shape \(2,\)"):
        field(0.0, jnp.ones((5, 2)))


@pytest.mark.parametrize("name", MARGINALS)
def test_marginals_are_normalised_standardised_and_match_their_sampler(name):
    grid = jnp.linspace(-40.0, 40.0, 800_001)
    p = jnp.exp(_marginal_log_prob(name, grid))
    mass = float(jnp.trapezoid(p, grid))
    mean = float(jnp.trapezoid(grid * p, grid))
    var = float(jnp.trapezoid(grid**2 * p, grid)) - mean**2
    assert abs(mass - 1) < 1e-6 and abs(mean) < 1e-6 and abs(var - 1) < 1e-3
    # The sampler draws from that density: a Kolmogorov-Smirnov test against the
    # density's CDF (by quadrature) at a fixed seed.
    s = np.asarray(_marginal_sample(name, jr.key(0), 20_000, jnp.float64))
    cdf = np.cumsum(np.asarray(p)) * float(grid[1] - grid[0])
    result = stats.kstest(s, lambda q: np.interp(q, np.asarray(grid), cdf))
    assert result.pvalue > 1e-3, result


def test_rotated_product_log_prob_is_exact():
    density = rotated_product(4, seed=3)
    assert density.dim == 4 and "dim=4" in density.name
    rot = np.asarray(density.rotation)
    np.testing.assert_allclose(rot @ rot.T, np.eye(4), atol=1e-12)
    # One draw serves the exact check (its first rows) and the moments: each new
    # sample size compiles the samplers again.
    big = density.sample(jr.key(2), 200_000)
    assert big.shape == (200_000, 4) and big.dtype == jnp.float64
    x = big[:6]
    s = np.asarray(x) @ rot
    expected = sum(
        np.asarray(_marginal_log_prob(m, jnp.asarray(s[:, i])))
        for i, m in enumerate(density.marginals)
    )
    np.testing.assert_allclose(density.log_prob(x), expected, rtol=1e-12)
    # The cycle of marginals: bimodal, gumbel, laplace, student5.
    assert density.marginals == MARGINALS[:4]
    # Mean 0 and unit variance in every coordinate.
    big = np.asarray(big)
    np.testing.assert_allclose(big.mean(0), 0, atol=0.015)
    np.testing.assert_allclose(big.var(0), 1, atol=0.03)
    # float32 on request (the dtype is decided while tracing: no float32 compile).
    f32 = eqx.filter_eval_shape(density.sample, jr.key(0), 3, jnp.float32)
    assert f32.shape == (3, 4) and f32.dtype == jnp.float32


def test_warped_product_is_a_normalised_density_it_samples_from():
    # The change of variables by hand: unscale, unrotate, unwarp in reverse order.
    density = warped_product(6, seed=2)
    assert len(density.warps) == 2
    x = np.asarray(density.sample(jr.key(1), 5))
    s = (x / np.asarray(density.scale)) @ np.asarray(density.rotation)
    for i, j, b in reversed(density.warps):
        s[:, j] -= b * (s[:, i] ** 2 - 1)
    expected = (
        sum(
            np.asarray(_marginal_log_prob(m, jnp.asarray(s[:, i])))
            for i, m in enumerate(density.marginals)
        )
        - np.log(np.asarray(density.scale)).sum()
    )
    np.testing.assert_allclose(density.log_prob(jnp.asarray(x)), expected, rtol=1e-10)
    # In 2-D its density integrates to 1 on a grid, and the samples have unit variance.
    flat = warped_product(2, seed=1)
    g = jnp.linspace(-12, 12, 1201)
    pts = jnp.stack([a.ravel() for a in jnp.meshgrid(g, g)], axis=1)
    total = float(jnp.exp(flat.log_prob(pts)).sum()) * float(g[1] - g[0]) ** 2
    assert abs(total - 1) < 1e-3, total
    big = np.asarray(flat.sample(jr.key(2), 200_000))
    np.testing.assert_allclose(big.var(0), 1, atol=0.03)


def test_gaussian_mixture_matches_scipy_and_is_standardised():
    density = gaussian_mixture(3, components=4, seed=1)
    big = density.sample(jr.key(1), 200_000)
    x = big[:7]  # the exact check on a few rows of the draw the moments use
    weights = np.exp(np.asarray(density.log_weights))
    np.testing.assert_allclose(weights.sum(), 1, rtol=1e-12)
    ref = np.log(
        sum(
            w * stats.multivariate_normal(m, c @ c.T).pdf(np.asarray(x))
            for w, m, c in zip(
                weights, np.asarray(density.means), np.asarray(density.cholesky)
            )
        )
    )
    np.testing.assert_allclose(density.log_prob(x), ref, rtol=1e-10)
    big = np.asarray(big)
    np.testing.assert_allclose(big.mean(0), 0, atol=0.01)
    np.testing.assert_allclose(big.var(0), 1, atol=0.02)
    # Its entropy by Monte Carlo is far below a unit Gaussian's: not Gaussian at all.
    entropy = -float(jnp.mean(density.log_prob(jnp.asarray(big))))
    assert entropy < 3 * 0.5 * math.log(2 * math.pi * math.e) - 1


def test_known_density_bad_arguments():
    with pytest.raises(ValueError, match="`dim` must be an int >= 1"):
        rotated_product(0)
    with pytest.raises(ValueError, match="`components` must be an int >= 1"):
        gaussian_mixture(2, components=0)
    with pytest.raises(ValueError, match=r"shape \(n, 5\)"):
        rotated_product(5).log_prob(jnp.ones((3, 4)))
    with pytest.raises(ValueError, match=r"shape \(n, 2\)"):
        gaussian_mixture(2).log_prob(jnp.ones(2))
    with pytest.raises(ValueError, match="unknown marginal"):
        _marginal_log_prob("cauchy", jnp.ones(2))


def test_known_densities_jit():
    density = rotated_product(3)
    x = density.sample(jr.key(0), 5)
    lp = eqx.filter_jit(lambda d, x: d.log_prob(x))(density, x)
    np.testing.assert_allclose(lp, density.log_prob(x), rtol=1e-12)


def test_concat_squash_layer_closed_form_and_under_vmap():
    """FFJORD's layer `(W x + b) * sigmoid(w_g t + b_g) + w_s t`, by hand, for one
    sample and for a batch (the batched form is how a flow evaluates it)."""
    layer = cnftrace.ConcatSquashLinear(3, 5, key=jr.key(0))
    x = jr.normal(jr.key(1), (4, 3))
    t = 0.3
    w, b, gw, gb, sw = map(
        np.asarray,
        (
            layer.linear.weight,
            layer.linear.bias,
            layer.gate_weight,
            layer.gate_bias,
            layer.shift_weight,
        ),
    )
    gate = 1 / (1 + np.exp(-(gw * t + gb)))
    expected = (np.asarray(x) @ w.T + b) * gate + sw * t
    np.testing.assert_allclose(layer(t, x[0]), expected[0], rtol=1e-13)
    batched = eqx.filter_vmap(layer, in_axes=(None, 0))(t, x)
    np.testing.assert_allclose(batched, expected, rtol=1e-13)
