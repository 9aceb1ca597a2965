"""Base distributions: closed-form log-densities, sampling against the
distribution, gradients at the parameters' extremes, flows over them, their fit to
training rows, and their life in checkpoints and on the command line."""

import json
import os
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from scipy import stats

import cnftrace
from cnftrace.cli import main
from cnftrace.flows._base_fit import _t_mixture_em, base_template

W = np.array([0.3, 0.7])
MEANS = np.array([[-2.0, 0.5], [1.5, -1.0]])
COVS = np.array([[[1.0, 0.3], [0.3, 0.5]], [[2.0, -0.4], [-0.4, 1.0]]])
DF = np.array([3.0, 7.0])


def _bases():
    """One base of each kind, in float64, with its SciPy reference."""
    x_dist = [stats.multivariate_normal(m, c) for m, c in zip(MEANS, COVS)]
    t_dist = [stats.multivariate_t(m, c, df=d) for m, c, d in zip(MEANS, COVS, DF)]
    variances = np.stack([np.diag(c) for c in COVS])
    d_dist = [
        stats.multivariate_normal(m, np.diag(v)) for m, v in zip(MEANS, variances)
    ]
    loc, scale, df = np.array([0.5, -1.0]), np.array([1.5, 0.7]), np.array([1.5, 9.0])

    def mixture(parts):
        return lambda x: np.log(sum(w * p.pdf(x) for w, p in zip(W, parts)))

    return {
        "normal": (
            cnftrace.StandardNormal(2),
            lambda x: stats.multivariate_normal(np.zeros(2)).logpdf(x),
        ),
        "mixture": (cnftrace.GaussianMixture(W, MEANS, COVS), mixture(x_dist)),
        "diag": (
            cnftrace.GaussianMixture(W, MEANS, variances, covariance="diag"),
            mixture(d_dist),
        ),
        "t-mixture": (cnftrace.StudentTMixture(W, MEANS, COVS, DF), mixture(t_dist)),
        "student-t": (
            cnftrace.StudentT(loc, scale, df),
            lambda x: stats.t(df, loc, scale).logpdf(x).sum(-1),
        ),
    }


BASES = _bases()


@pytest.mark.parametrize("name", list(BASES))
def test_log_prob_is_the_closed_form(name):
    base, reference = BASES[name]
    x = np.random.default_rng(0).normal(size=(3, 4, 2)) * 3
    logp = np.asarray(base.log_prob(x))
    assert logp.shape == (3, 4) and logp.dtype == np.float64
    np.testing.assert_allclose(logp, reference(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(base.log_prob(x[0, 0]), reference(x[0, 0]), rtol=1e-12)
    with pytest.raises(ValueError, match="this base has samples of shape"):
        base.log_prob(np.zeros((4, 3)))


def _marginal_cdfs(name):
    """Each coordinate's CDF under the base (marginals of the mixtures are mixtures
    of the components' marginals: univariate normals, or t's with the same df)."""
    if name == "normal":
        return [stats.norm.cdf] * 2
    if name == "student-t":
        return [stats.t(1.5, 0.5, 1.5).cdf, stats.t(9.0, -1.0, 0.7).cdf]
    sd = np.sqrt(np.stack([np.diag(c) for c in COVS]))
    if name == "t-mixture":
        parts = [
            [stats.t(DF[k], MEANS[k, j], sd[k, j]) for k in range(2)] for j in (0, 1)
        ]
    else:
        parts = [[stats.norm(MEANS[k, j], sd[k, j]) for k in range(2)] for j in (0, 1)]
    return [lambda v, p=p: sum(w * q.cdf(v) for w, q in zip(W, p)) for p in parts]


@pytest.mark.parametrize("name", ["normal", "mixture", "t-mixture", "student-t"])
def test_samples_follow_the_distribution(name):
    base = BASES[name][0]
    z = np.asarray(base.sample(jr.key(3), 4000))
    assert z.shape == (4000, 2) and z.dtype == np.float64
    for j, cdf in enumerate(_marginal_cdfs(name)):
        assert stats.kstest(z[:, j], cdf).pvalue > 1e-3, (name, j)


def _total_log_prob(base, x):
    return base.log_prob(x).sum()


# One compiled program per kind of base (op by op, a base's gradient compiled about
# a hundred small programs).
_jitted_total = jax.jit(_total_log_prob)
_grad_total = jax.jit(jax.grad(_total_log_prob))


def test_gradients_are_finite_at_the_parameters_extremes():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)) * 5)
    for df in (0.05, 1e4):
        t = cnftrace.StudentT(0.0, 1.0, df, dim=2)
        tm = cnftrace.StudentTMixture(W, MEANS, COVS, df)
        for base in (t, tm):
            grads = _grad_total(base, x)
            assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    # A weight near zero, and the degrees of freedom against finite differences.
    gm = cnftrace.GaussianMixture([1e-12, 1.0], MEANS, COVS)
    grads = _grad_total(gm, x)
    assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
    tm = cnftrace.StudentTMixture(W, MEANS, COVS, [0.8, 40.0])
    grad = _grad_total(tm, x).df_raw
    h = 1e-4  # central differences: an error of order h^2
    for k in range(2):
        step = jnp.zeros(2).at[k].set(h)
        up = eqx.tree_at(lambda b: b.df_raw, tm, tm.df_raw + step)
        down = eqx.tree_at(lambda b: b.df_raw, tm, tm.df_raw - step)
        fd = (_jitted_total(up, x) - _jitted_total(down, x)) / (2 * h)
        np.testing.assert_allclose(grad[k], fd, rtol=1e-6)


def test_parameters_round_trip_and_bad_ones_are_refused():
    tm = BASES["t-mixture"][0]
    np.testing.assert_allclose(tm.weights, W, rtol=1e-14)
    np.testing.assert_allclose(tm.covariances, COVS, rtol=1e-13)
    np.testing.assert_allclose(tm.df, DF, rtol=1e-13)
    np.testing.assert_allclose(BASES["student-t"][0].df, [1.5, 9.0], rtol=1e-13)
    big = cnftrace.StudentT(0.0, 1.0, [1e-3, 1e3, 1e6], dim=3)
    np.testing.assert_allclose(big.df, [1e-3, 1e3, 1e6], rtol=1e-10)
    with pytest.raises(ValueError, match="positive definite"):
        cnftrace.GaussianMixture([1.0], [[0.0, 0.0]], [[[1.0, 2.0], [2.0, 1.0]]])
    with pytest.raises(ValueError, match="`df` must be finite and positive"):
        cnftrace.StudentT(0.0, 1.0, -1.0, dim=2)
    with pytest.raises(ValueError, match="`weights` must be finite and positive"):
        cnftrace.GaussianMixture([0.0, 1.0], MEANS, COVS)
    with pytest.raises(TypeError, match="`base` must be a cnftrace base"):
        cnftrace.CNF(cnftrace.MLPField(2, 8, 1, key=jr.key(0)), 2, base="normal")
    with pytest.raises(ValueError, match="`base` has samples of shape"):
        cnftrace.CNF(
            cnftrace.MLPField(3, 8, 1, key=jr.key(0)), 3, base=BASES["mixture"][0]
        )


def _coarse_flow(key, **kwargs):
    """A one-block `mlp_flow` in 2-D, 8 wide, with coarse solver settings; the
    keyword arguments go to `mlp_flow`."""
    return cnftrace.mlp_flow(
        2, key=key, width=8, depth=1, rtol=1e-3, atol=1e-3, **kwargs
    )


@pytest.fixture(scope="module")
def zero_flows():
    """For each base, a one-block flow over it whose field starts at zero (the
    default of `mlp_flow` with a fitted base; asked for with the standard normal),
    with coarse solver settings."""
    flows = {
        name: _coarse_flow(jr.key(0), base=base)
        for name, (base, _) in BASES.items()
        if name != "normal"
    }
    flows["normal"] = _coarse_flow(jr.key(0), zero_last=True)
    return flows


@pytest.mark.parametrize("name", list(BASES))
def test_a_flow_whose_field_starts_at_zero_is_its_base(zero_flows, name):
    flow, base = zero_flows[name], BASES[name][0]
    x = jnp.asarray(np.random.default_rng(2).normal(size=(5, 2)))
    # The zero field moves nothing and has no divergence: the same bits.
    assert np.array_equal(flow.log_prob(x), base.log_prob(x))
    if name not in ("mixture", "t-mixture"):
        return  # sampling: one light and one heavy-tailed base are enough
    samples, logp = flow.sample_and_log_prob(jr.key(4), 6)
    assert np.array_equal(logp, base.log_prob(samples))
    # The same draws (one compiled program against eager calls: to rounding); as
    # many as the heavy-tailed test below draws from the mixture's flow, which
    # reuses this program.
    np.testing.assert_allclose(
        flow.sample(jr.key(4), 100),
        base.sample(jr.key(4), 100),
        rtol=1e-14,
        atol=1e-14,
    )


def test_chains_and_wrappers_share_one_base():
    gm = BASES["mixture"][0]
    fields = [cnftrace.MLPField(2, 8, 1, key=k) for k in jr.split(jr.key(0), 2)]
    chain = cnftrace.Chain([cnftrace.CNF(f, 2) for f in fields], base=gm)
    assert eqx.tree_equal(chain.base, chain.flows[-1].base, gm)
    assert isinstance(chain.flows[0].base, cnftrace.StandardNormal)  # unused
    two = cnftrace.mlp_flow(2, key=jr.key(0), blocks=2, width=8, depth=1, base=gm)
    assert eqx.tree_equal(two.base, gm)
    assert isinstance(two.flows[0].base, cnftrace.StandardNormal)
    std = cnftrace.Standardization(np.zeros(2), np.ones(2))
    wrapped = cnftrace.StandardizedFlow(chain, std)
    assert eqx.tree_equal(wrapped.base, gm)
    other = BASES["student-t"][0]
    assert eqx.tree_equal(wrapped.with_base(other).base, other)
    image = cnftrace.MultiscaleFlow(
        (1, 4, 4), n_scales=1, blocks_per_scale=1, hidden=(4,), key=jr.key(0)
    )
    assert image.base.shape == (1, 4, 4)


def test_weight_decay_leaves_a_base_alone():
    gm = BASES["mixture"][0]
    flow = cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1, base=gm)
    params = eqx.filter(flow, eqx.is_inexact_array)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    opt = cnftrace.warmup_cosine_adam(10, 1e-2, weight_decay=0.5)
    state = opt.init(params)
    update = jax.jit(opt.update)  # one program, not op by op
    for _ in range(3):
        updates, state = update(zero, state, params)
        params = eqx.apply_updates(params, updates)
    assert np.array_equal(params.base.means, gm.means)
    assert not np.array_equal(
        params.vector_field.mlp.layers[0].weight, flow.vector_field.mlp.layers[0].weight
    )


def test_a_frozen_base_gets_no_gradient():
    # Of the shape of the test above's points: the trainable mixture's gradient is
    # the program that test compiled.
    x = jnp.asarray(np.random.default_rng(3).normal(size=(16, 2)))
    for trainable in (True, False):
        gm = cnftrace.GaussianMixture(W, MEANS, COVS, trainable=trainable)
        grad = _grad_total(gm, x)
        assert (np.abs(np.asarray(grad.means)).max() > 0) == trainable


def test_heavy_tailed_draws_beyond_the_solvers_range_are_drawn_again(zero_flows):
    # With 0.35 degrees of freedom about one draw in 200 lies beyond float32's 1/eps.
    base = cnftrace.StudentT(0.0, 1.0, 0.35, dim=2, dtype=jnp.float32)
    flow = cnftrace.mlp_flow(
        2, key=jr.key(0), width=8, depth=1, base=base, dtype=jnp.float32
    )
    with pytest.warns(UserWarning, match=r"of 2000 draws of the base were beyond"):
        x = flow.sample(jr.key(0), 2000, dtype=jnp.float32)
    assert np.isfinite(np.asarray(x)).all()
    assert np.abs(np.asarray(x)).max() <= 1 / np.finfo(np.float32).eps
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a light-tailed base: nothing to say
        zero_flows["mixture"].sample(jr.key(0), 100)


def _clusters(n, seed=0):
    rng = np.random.default_rng(seed)
    centres = np.array([[-4.0, 0.0], [4.0, 1.0], [0.0, 5.0]])
    return centres[rng.integers(0, 3, n)] + rng.normal(size=(n, 2)) * [0.6, 0.4]


def test_fit_base_fits_the_mixture_and_tails_where_the_data_have_them():
    from sklearn.mixture import GaussianMixture

    rows = _clusters(400)
    train, val = rows[:300], rows[300:]
    gm, info = cnftrace.fit_base(train, kind="mixture", return_info=True)
    # scikit-learn's BIC choice, density for density.
    fits = [
        GaussianMixture(k, n_init=3, random_state=0).fit(train) for k in range(1, 9)
    ]
    best = min(fits, key=lambda g: g.bic(train))
    assert gm.n_components == best.n_components == info["components"] == 3
    np.testing.assert_allclose(gm.log_prob(val), best.score_samples(val), rtol=1e-9)
    assert "BIC over 1-8 components" in info["reason"]
    # Gaussian clusters: the auto choice keeps Gaussian components or, with
    # Student-t ones, many degrees of freedom (nearly Gaussian).
    auto = cnftrace.fit_base(train, validation=val)
    assert isinstance(auto, cnftrace.GaussianMixture) or np.min(auto.df) > 10
    # Heavy tails (2 degrees of freedom): Student-t components, better on held-out
    # rows than the Gaussian mixture (which piles up components for the tails).
    heavy = stats.t(2).rvs(size=(600, 2), random_state=1)
    tails, info = cnftrace.fit_base(
        heavy[:450], validation=heavy[450:], return_info=True
    )
    assert isinstance(tails, cnftrace.StudentTMixture) and info["kind"] == "t-mixture"
    assert info["scores"]["t-mixture"] < info["scores"]["mixture"]
    assert "validation NLL" in info["reason"]
    product = cnftrace.fit_base(heavy[:450], kind="student-t")
    np.testing.assert_allclose(product.df, [2.0, 2.0], rtol=0.35)
    # EM recovers a multivariate t's degrees of freedom and scale matrix.
    scale = np.array([[1.0, 0.6], [0.6, 2.0]])
    rows = stats.multivariate_t(np.zeros(2), scale, df=3.0).rvs(4000, random_state=2)
    _, mean, cov, df = _t_mixture_em(
        rows, np.ones(1), np.zeros((1, 2)), np.eye(2)[None], np.array([30.0])
    )
    np.testing.assert_allclose(df, [3.0], rtol=0.15)
    np.testing.assert_allclose(cov[0], scale, atol=0.15)
    with pytest.raises(ValueError, match="`kind` must be one of"):
        cnftrace.fit_base(train, kind="gaussian")
    with pytest.raises(ValueError, match="`validation` has 3 columns"):
        cnftrace.fit_base(train, validation=np.zeros((5, 3)))
    with pytest.raises(ValueError, match="contains NaN or inf"):
        cnftrace.fit_base(np.full((5, 2), np.nan))


@pytest.mark.parametrize("kind", ["normal", "mixture", "t-mixture", "student-t"])
def test_save_and_load_keep_the_base(zero_flows, tmp_path, kind):
    """A flow saved with its base loads into a template of the base's kind (fresh
    parameters) with the same log-density, bit for bit. The flows are those of the
    zero-field test above, and the points of its shape: the same compiled
    `log_prob`. The template's field is not zero, so that the field's parameters
    must load too."""
    flow = zero_flows[kind]
    path = cnftrace.save(str(tmp_path / "flow.eqx"), flow)
    components = None if kind in ("normal", "student-t") else 2
    template = base_template(kind, 2, components, dtype=jnp.float64)
    like = _coarse_flow(jr.key(1), base=template, zero_last=False)
    loaded = cnftrace.load(path, like=like)
    x = np.random.default_rng(4).normal(size=(5, 2))
    assert np.array_equal(loaded.log_prob(x), flow.log_prob(x))


def test_the_command_line_fits_a_base_says_so_and_keeps_it(tmp_path):
    """`cnftrace train --data FILE` with no flags fits a base to the training rows,
    starts the field at zero, says what it chose in its recipe line and config.json,
    validates at step 0 and keeps what validation prefers."""
    rows = _clusters(400, seed=2)
    data = str(tmp_path / "clusters.csv")
    np.savetxt(data, rows, delimiter=",", fmt="%.17g")
    run = str(tmp_path / "run")
    argv = ["train", "--data", data, "--run-dir", run, "--steps", "30"]
    argv += ["--checkpoint-every", "10", "--depth", "1", "--width", "16"]
    argv += ["--no-progress", "--batch-size", "64"]
    with jax.enable_x64(False):
        assert main(argv) == 0
        flow, info = cnftrace.load(run, return_info=True)
    config = info["config"]
    assert config["base"] in ("mixture", "t-mixture") and config["zero_last"] is True
    assert config["base_components"] == flow.base.n_components == 3
    assert "base: mixture of 3 full-covariance" in config["recipe"]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert records[0]["step"] == 0 and "val_nll" in records[0]
    vals = [r["val_nll"] for r in records if "val_nll" in r]
    # The kept flow is the best validated one: never worse than the base alone.
    split = cnftrace.datasets.split_table(rows, seed=0)
    std = cnftrace.Standardization.from_data(split.train)
    val = np.asarray(std.forward(split.val), np.float32)
    kept = -float(np.mean(np.asarray(flow.flow.log_prob(val))))
    assert kept == pytest.approx(min(vals), abs=1e-4) and min(vals) <= vals[0]
    # The same base as fit_base gives, and the fitted mixture's test NLL at most.
    test = split.test
    with jax.enable_x64(False):
        model = float(np.mean(np.asarray(flow.log_prob(test))))
        alone = cnftrace.fit_base(np.asarray(std.forward(split.train)), kind="mixture")
        mixture = float(np.mean(np.asarray(alone.log_prob(std.forward(test)))))
    mixture += float(std.log_det)
    assert model > mixture - 0.1, (model, mixture)


def test_a_fitted_base_needs_a_table():
    from cnftrace.runs import RunConfig

    for data in ("8gaussians", "digits"):
        config = RunConfig(data=data, run_dir="r", base="mixture")
        with pytest.raises(ValueError, match="--base mixture is fitted to a table"):
            config.check()
        assert RunConfig(data=data, run_dir="r").base_to_fit() == "normal"
    assert RunConfig(data="wine", run_dir="r").base_to_fit() == "auto"
    assert RunConfig(data="t.csv", run_dir="r").base_to_fit() == "auto"
