"""The multiscale image flow: squeeze, the conv field, the packing of the latent,
and log-densities against the brute-force change of variables (float64)."""

import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import cnftrace
from cnftrace import MultiscaleFlow, squeeze, unsqueeze

TOL = 1e-10
SHAPE = (1, 4, 4)


@eqx.filter_jit  # one program (op by op, each parameter's shape compiled its own)
def _perturb(flow, key, scale=0.3):
    """Every parameter moved by noise, so that no block is near the identity."""
    params, static = eqx.partition(flow, eqx.is_inexact_array)
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jr.split(key, len(leaves))
    leaves = [p + scale * jr.normal(k, p.shape, p.dtype) for p, k in zip(leaves, keys)]
    return eqx.combine(jax.tree_util.tree_unflatten(tree, leaves), static)


@pytest.fixture(scope="module")
def flow():
    model = MultiscaleFlow(
        SHAPE,
        n_scales=2,
        blocks_per_scale=1,
        hidden=(4,),
        t1=0.5,
        rtol=TOL,
        atol=TOL,
        key=jr.key(0),
    )
    return _perturb(model, jr.key(1))


@pytest.fixture(scope="module")
def x():
    return jr.normal(jr.key(2), (3,) + SHAPE, jnp.float64)


def test_squeeze_is_a_permutation_with_an_exact_inverse():
    x = jnp.arange(2 * 3 * 4 * 6, dtype=jnp.float64).reshape(2, 3, 4, 6)
    y = squeeze(x)
    assert y.shape == (2, 12, 2, 3)
    np.testing.assert_array_equal(np.sort(y.ravel()), np.sort(x.ravel()))
    np.testing.assert_array_equal(unsqueeze(y), x)
    # Channel 4c + 2i + j at (r, s) is input channel c at pixel (2r + i, 2s + j).
    for c, i, j, r, s in [(0, 0, 0, 0, 0), (1, 1, 0, 1, 2), (2, 1, 1, 1, 1)]:
        assert y[1, 4 * c + 2 * i + j, r, s] == x[1, c, 2 * r + i, 2 * s + j]
    # Unbatched images work too.
    np.testing.assert_array_equal(squeeze(x[0]), y[0])
    with pytest.raises(ValueError, match="even height and width"):
        squeeze(jnp.zeros((1, 3, 4)))
    with pytest.raises(ValueError, match="multiple of 4 channels"):
        unsqueeze(jnp.zeros((3, 2, 2)))


def test_conv_field_shape_time_and_zero_init():
    field = cnftrace.ConvField(2, (5, 6), key=jr.key(0))
    y = jr.normal(jr.key(1), (2, 4, 6))
    out = field(0.3, y, None)
    assert out.shape == y.shape
    assert not np.allclose(field(0.7, y, None), out)  # time is an input
    zero = cnftrace.ConvField(2, (5,), zero_last=True, key=jr.key(0))
    np.testing.assert_array_equal(zero(0.3, y, None), 0.0)
    with pytest.raises(ValueError, match=r"shape \(2, h, w\)"):
        field(0.0, jnp.zeros((3, 4, 4)), None)
    with pytest.raises(ValueError, match="hidden"):
        cnftrace.ConvField(2, (5, 0), key=jr.key(0))
    with pytest.raises(TypeError, match="hidden"):
        cnftrace.ConvField(2, 64, key=jr.key(0))


def test_layout_of_scales(flow):
    assert flow.n_scales == 2
    shapes = [b.event_shape for b in flow.blocks]
    assert shapes == [(1, 4, 4), (4, 2, 2), (2, 2, 2)]
    # The structure only: eval_shape skips the (slow, eager) initialisation.
    mnist = eqx.filter_eval_shape(
        MultiscaleFlow, (1, 28, 28), blocks_per_scale=2, hidden=(2,), key=jr.key(0)
    )
    assert mnist.n_scales == 3  # FFJORD's choice for 28x28
    assert [b.event_shape for b in mnist.blocks][::2] == [
        (1, 28, 28),
        (4, 14, 14),
        (2, 14, 14),
        (8, 7, 7),
        (4, 7, 7),
    ]
    assert cnftrace.default_n_scales((1, 8, 8)) == 2
    assert cnftrace.default_n_scales((3, 32, 32)) == 4


def test_forward_is_the_composition_of_the_stacks(flow, x):
    """The latent packs the factored-out half of the squeezed stack's output, then the
    last scale's output; the factored-out half is not touched again."""
    z = flow.forward(x)
    scale0, squeezed0 = flow.scales[0], flow.squeezed[0]
    h = squeezed0.forward(squeeze(scale0.forward(x)))
    out = flow.scales[1].forward(h[:, :2])
    expected = jnp.concatenate([h[:, 2:].reshape(3, -1), out.reshape(3, -1)], 1)
    np.testing.assert_allclose(z, expected.reshape(x.shape), rtol=0, atol=1e-12)


def test_inverse_undoes_forward(flow, x):
    z = flow.forward(x)
    assert not np.allclose(z, x, atol=0.1)
    np.testing.assert_allclose(flow.inverse(z), x, rtol=0, atol=1e-8)


def test_log_prob_is_the_change_of_variables(flow, x):
    """log N(z) + log|det dz/dx| with the Jacobian of the forward map by autodiff."""
    # Forward-mode autodiff through the solves needs diffrax's ForwardMode adjoint;
    # the adjoint changes how a solve is differentiated, not what it computes. The
    # Jacobian by `jacfwd` compiles in about half the time of `jacrev`'s (whose
    # backward pass holds the checkpointed solves), and agrees with it to 1e-14.
    forward_mode = eqx.tree_at(
        lambda f: [b.adjoint for b in f.blocks],
        flow,
        [diffrax.ForwardMode()] * len(flow.blocks),
    )

    def forward_flat(v):
        return forward_mode.forward(v.reshape(x.shape)).ravel()

    # The Jacobian of the whole batch's map (48 x 48): samples must not mix, beyond
    # the solver's tolerance (they share adaptive steps).
    jac = jax.jit(jax.jacfwd(forward_flat))(x.ravel()).reshape(3, 16, 3, 16)
    z = flow.forward(x).reshape(3, 16)
    logp, stats = flow.log_prob(x, return_stats=True)
    assert stats.nfe.shape == (3,)
    for i in range(3):
        for j in range(3):
            if j != i:
                np.testing.assert_allclose(jac[i, :, j], 0.0, rtol=0, atol=1e-8)
        _, log_det = jnp.linalg.slogdet(jac[i, :, i])
        brute = -0.5 * jnp.sum(z[i] ** 2) - 8 * math.log(2 * math.pi) + log_det
        np.testing.assert_allclose(logp[i], brute, rtol=0, atol=1e-8)
    # The flow is far from the identity, so this was not a trivial check.
    base = -0.5 * jnp.sum(x**2, axis=(1, 2, 3)) - 8 * math.log(2 * math.pi)
    assert np.max(np.abs(logp - base)) > 0.1


def test_sample_and_log_prob_agree_with_log_prob(flow, x):
    """The inverse pass unpacks the latent and its log-determinant has the right
    sign: the density of a sample, computed while drawing it, is `log_prob`'s."""
    samples, logp = flow.sample_and_log_prob(jr.key(3), 3)
    assert samples.shape == (3,) + SHAPE and np.all(np.isfinite(samples))
    np.testing.assert_allclose(logp, flow.log_prob(samples), rtol=0, atol=1e-8)


def test_regularization_sums_over_blocks(flow, x):
    logp, reg, stats = flow.log_prob_and_regularization(x)
    np.testing.assert_allclose(logp, flow.log_prob(x), rtol=0, atol=1e-8)
    assert reg.kinetic.shape == reg.jacobian.shape == (3,)
    assert np.all(reg.kinetic > 0) and np.all(reg.jacobian > 0)
    assert stats.nfe.shape == (3,) and np.all(stats.nfe > 0)


@pytest.mark.slow  # one compilation of a training step
def test_fit_lowers_the_nll():
    """Five steps lower the NLL by 5.9 nats on two seeds of `fit`'s key (20 steps:
    by 9.1), far past the bar of 1 nat."""
    key = jr.key(4)
    mix = jr.normal(key, (16, 16)) / 4 + jnp.eye(16)
    data = (jr.normal(jr.key(5), (128, 16)) @ mix).reshape(128, *SHAPE) + 1.0
    flow = MultiscaleFlow(
        SHAPE,
        blocks_per_scale=1,
        hidden=(8,),
        t1=0.5,
        rtol=1e-4,
        atol=1e-4,
        learn_t1=True,
        key=key,
    )
    # `fit` returns its parameters committed to their device, and a committed input
    # makes `jit` compile again (another program): the untrained flow's parameters
    # are committed too, so that both evaluations run one compiled program.
    params, static = eqx.partition(flow, eqx.is_array)
    flow = eqx.combine(jax.device_put(params, jax.devices()[0]), static)
    before = cnftrace.evaluate_nll(flow, data)
    trained, history = cnftrace.fit(
        flow,
        data,
        key=jr.key(6),
        steps=5,
        batch_size=64,
        optimizer=optax.adam(2e-2),
        progress=False,
    )
    after = cnftrace.evaluate_nll(trained, data)
    assert after.mean < before.mean - 1.0
    assert len(history["loss"]) == 5
    # Every block's evaluations but its initial-step heuristic's are backpropagated.
    blocks = len(flow.blocks)
    assert history["nfe_backward"] == [n - blocks for n in history["nfe"]]
    assert trained.blocks[0].t1 != flow.blocks[0].t1  # the end times learn


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(shape=(1, 8)), ValueError, "`shape`"),
        (dict(shape=(1, 8, 8.0)), ValueError, "`shape`"),
        (dict(shape=(1, 6, 6), n_scales=3), ValueError, "divisible by 4"),
        (dict(n_scales=0), ValueError, "`n_scales`"),
        (dict(blocks_per_scale=0), ValueError, "`blocks_per_scale`"),
        (dict(hidden=(8, -1)), ValueError, r"`hidden\[1\]`"),
        (dict(rtol=0.0), ValueError, "`rtol`"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs = dict(dict(shape=(1, 8, 8), hidden=(2,), key=jr.key(0)), **kwargs)
    with pytest.raises(error, match=match):
        MultiscaleFlow(**kwargs)


def test_context_is_refused(flow, x):
    with pytest.raises(ValueError, match="not conditional"):
        flow.log_prob(x, context=jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="not conditional"):
        flow.transform(x, inverse=False, log_det=False, key=None, context=x)


def test_with_adjoint_and_solver_settings_reach_every_block():
    flow = eqx.filter_eval_shape(
        MultiscaleFlow,
        (1, 4, 4),
        hidden=(2,),
        solver=diffrax.Dopri5(),
        adjoint=diffrax.BacksolveAdjoint(),
        rtol=1e-3,
        atol=1e-4,
        key=jr.key(0),
    )
    for block in flow.blocks:
        assert isinstance(block.solver, diffrax.Dopri5)
        assert isinstance(block.adjoint, diffrax.BacksolveAdjoint)
        assert (block.rtol, block.atol) == (1e-3, 1e-4)
