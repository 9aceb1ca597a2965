"""The probability-flow ODE of diffusion and flow-matching models
(`cnftrace.ProbabilityFlow`), checked against closed forms.

For Gaussian-mixture data `x_0 ~ sum_k w_k N(m_k, S_k)` noised as `x_t = alpha(t) x_0 +
sigma(t) e`, every marginal is a Gaussian mixture, `p_t = sum_k w_k N(alpha m_k,
alpha^2 S_k + sigma^2 I)`, so its score, the posterior means `E[x_0 | x_t]` and
`E[e | x_t]` (data and noise prediction) and an interpolant's velocity
`alpha' E[x_0 | x_t] + sigma' E[e | x_t]` are known in closed form. Driven by them, the
ODE's log-likelihood must be the mixture's own log-density at the truncated data end
(`log p_eps`), to 1e-4 nats, for every schedule and model kind; with the exact
marginal at the noise end as the prior, the solve is the only error. The truncation's
own effect (`log p_eps - log p_0`) and the default prior's are measured separately.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace

TOL = 1e-4  # nats per sample: the target
SOLVE = dict(rtol=1e-6, atol=1e-6)  # errors near 3e-7 nats


class Mixture(eqx.Module):
    """A Gaussian mixture in `d` dimensions with diagonal covariances (elementwise
    arithmetic only: small programs, quick to compile), and its marginals under a
    schedule. Its score's Jacobian is not diagonal: the components' posterior
    weights couple the coordinates."""

    weights: jax.Array  # (k,)
    means: jax.Array  # (k, d)
    variances: jax.Array  # (k, d)

    def _marginal(self, alpha, sigma):
        return alpha * self.means, alpha**2 * self.variances + sigma**2

    def _terms(self, alpha, sigma, x):
        means, variances = self._marginal(alpha, sigma)
        diff = x[None] - means
        logits = jnp.log(self.weights) - 0.5 * jnp.sum(
            diff**2 / variances + jnp.log(2 * math.pi * variances), axis=1
        )
        return logits, diff / variances  # C_k^-1 (x - alpha m_k)

    def log_prob_at(self, alpha, sigma, x):
        logits, _ = self._terms(alpha, sigma, x)
        return jax.nn.logsumexp(logits)

    def score(self, alpha, sigma, x):
        """`grad log p_t(x) = -sum_k r_k C_k^-1 (x - alpha m_k)`."""
        logits, sol = self._terms(alpha, sigma, x)
        return -(jax.nn.softmax(logits) @ sol)

    def posterior_means(self, alpha, sigma, x):
        """`(E[x_0 | x_t = x], E[e | x_t = x])`, finite at `alpha = 0` and at
        `sigma = 0` alike."""
        logits, sol = self._terms(alpha, sigma, x)
        r = jax.nn.softmax(logits)
        x0 = self.means + alpha * self.variances * sol
        return r @ x0, sigma * (r @ sol)

    def prior_at(self, alpha, sigma) -> cnftrace.GaussianMixture:
        means, variances = self._marginal(alpha, sigma)
        return cnftrace.GaussianMixture(
            np.asarray(self.weights),
            np.asarray(means),
            np.asarray(variances),
            covariance="diag",
            trainable=False,
        )


MIX2 = Mixture(
    jnp.array([0.3, 0.7]),
    jnp.array([[-1.0, 0.5], [1.2, -0.4]]),
    jnp.array([[0.5, 0.3], [0.2, 0.4]]),
)


class Trig(cnftrace.AbstractSchedule):
    """A schedule of the test's own: the trigonometric interpolant, alpha = cos,
    sigma = sin, with `alpha = 0` at its end (fine for a data-prediction model)."""

    t_end: float = 1.0

    def alpha(self, t):
        return jnp.cos(0.5 * jnp.pi * t)

    def sigma(self, t):
        return jnp.sin(0.5 * jnp.pi * t)


class ClosedForm(eqx.Module):
    """The exact model of `kind` for `mixture` under `schedule`."""

    mixture: Mixture
    schedule: cnftrace.AbstractSchedule
    kind: str = eqx.field(static=True)

    def __call__(self, t, x):
        s = self.schedule
        alpha, sigma = s.alpha(t), s.sigma(t)
        if self.kind == "score":
            return self.mixture.score(alpha, sigma, x)
        x0, e = self.mixture.posterior_means(alpha, sigma, x)
        if self.kind == "data":
            return x0
        if self.kind == "noise":
            return e
        d_alpha, d_sigma = s.derivatives(t)
        return d_alpha * x0 + d_sigma * e  # velocity


def _points(n=4, d=2, seed=0):
    """Four points: the batch of the tests of `velocity_flow` below, whose
    `log_prob` program the straight path's test compiles first."""
    return 0.8 * jr.normal(jr.key(seed), (n, d))


def _exact_prior(schedule, mixture=MIX2):
    t = schedule.t_end
    return mixture.prior_at(schedule.alpha(t), schedule.sigma(t))


@eqx.filter_jit
def _log_p(schedule, t, x, mixture=MIX2):
    """`log p_t(x)` in closed form, one compiled program (not op by op)."""
    return jax.vmap(
        lambda y: mixture.log_prob_at(schedule.alpha(t), schedule.sigma(t), y)
    )(x)


DIFFUSION = {
    "vp": cnftrace.VPSchedule(),
    "subvp": cnftrace.SubVPSchedule(),
    "ve": cnftrace.VESchedule(sigma_min=0.01, sigma_max=20.0),
    "cosine": cnftrace.CosineSchedule(),
}


@pytest.mark.parametrize("name", sorted(DIFFUSION))
def test_diffusion_likelihood_is_the_mixture_density(name):
    """Score, noise and data models of each schedule, in one compiled program (a
    `jit` over three flows)."""
    schedule = DIFFUSION[name]
    kinds = ("score", "noise", "data")
    flows = [
        cnftrace.ProbabilityFlow(
            ClosedForm(MIX2, schedule, kind),
            2,
            kind=kind,
            schedule=schedule,
            prior=_exact_prior(schedule),
            **SOLVE,
        )
        for kind in kinds
    ]
    x = _points()
    logps = eqx.filter_jit(lambda fs, x: [f.log_prob(x) for f in fs])(flows, x)
    expected = _log_p(schedule, flows[0].eps, x)
    for kind, logp in zip(kinds, logps):
        np.testing.assert_allclose(logp, expected, rtol=0, atol=TOL, err_msg=kind)


def test_the_closed_forms_themselves():
    """The test's own closed forms: the score is the gradient of the log-density,
    Tweedie's formula links it to the posterior means, and `E[x_0 | x_t]` at
    `sigma = 0` is the point itself."""

    @jax.jit
    def forms(alpha, sigma, x):
        x0, e = MIX2.posterior_means(alpha, sigma, x)
        grad = jax.grad(MIX2.log_prob_at, argnums=2)(alpha, sigma, x)
        return x0, e, grad, MIX2.score(alpha, sigma, x)

    x = jnp.array([0.3, -0.7])
    for alpha, sigma in ((0.8, 0.6), (0.0, 1.0), (1.0, 0.0)):
        x0, e, grad, score = forms(alpha, sigma, x)
        np.testing.assert_allclose(alpha * x0 + sigma * e, x, rtol=1e-12)
        if sigma > 0:
            np.testing.assert_allclose(score, grad, rtol=1e-12)
            np.testing.assert_allclose(-e / sigma, grad, rtol=1e-12)
        else:
            np.testing.assert_allclose(x0, x, rtol=1e-12)


def _velocity_case(name):
    """`(model, data_time, noise_time, schedule)`: a closed-form velocity in the
    interpolant's time, or in the reversed convention (data at 1)."""
    linear = cnftrace.LinearSchedule()
    if name == "linear":
        return ClosedForm(MIX2, linear, "velocity"), 0.0, 1.0, linear
    if name == "trig":
        return ClosedForm(MIX2, Trig(), "velocity"), 0.0, 1.0, Trig()
    # facebookresearch/flow_matching and torchcfm: noise at 0, data at 1.
    forward = ClosedForm(MIX2, linear, "velocity")
    return (lambda t, x: -forward(1 - t, x)), 1.0, 0.0, linear


@pytest.mark.parametrize("name", ["linear", "trig", "data-at-1"])
def test_velocity_likelihood_is_the_mixture_density(name):
    model, data_time, noise_time, schedule = _velocity_case(name)
    # The interpolant's end is pure noise: the default standard normal is exact.
    pf = cnftrace.ProbabilityFlow(
        model, 2, kind="velocity", data_time=data_time, noise_time=noise_time, **SOLVE
    )
    assert pf.eps == 0.0
    x = _points()
    np.testing.assert_allclose(
        pf.log_prob(x), _log_p(schedule, 0.0, x), rtol=0, atol=TOL
    )


def test_data_model_reaches_alpha_zero_on_a_schedule_of_ones_own():
    """A data-prediction model on the trigonometric interpolant integrates up to
    `alpha = 0` (its drift divides by `sigma` only), and the default prior is
    then the exact end marginal."""
    schedule = Trig()
    pf = cnftrace.ProbabilityFlow(
        ClosedForm(MIX2, schedule, "data"), 2, kind="data", schedule=schedule, **SOLVE
    )
    x = _points()
    np.testing.assert_allclose(
        pf.log_prob(x), _log_p(schedule, pf.eps, x), rtol=0, atol=TOL
    )
    # A noise model's drift divides by alpha, zero at t_end.
    with pytest.raises(ValueError, match=r"alpha\(t\) is .*zero.*t_end"):
        cnftrace.ProbabilityFlow(
            ClosedForm(MIX2, schedule, "noise"), 2, kind="noise", schedule=schedule
        )


def test_truncation_and_default_prior_effects():
    """What `eps` and the default prior change, each alone (the figures of the
    docs page), on this mixture: VP's default truncation `eps = 1e-5` moves the
    log-density by about 1e-5 nats; its standard normal prior, which ignores the
    data's share `alpha(T) x_0` of the end marginal, by about 3e-3 (the prior's
    log-density at the ODE's end point against the exact marginal's); VE's data
    end is blurred by `sigma_min = 0.01`, by about 1e-3 nats."""
    x = _points()
    vp, ve = DIFFUSION["vp"], DIFFUSION["ve"]
    truncation = _log_p(vp, 1e-5, x) - MIX2_log_p0(x)
    assert 1e-6 < float(jnp.max(jnp.abs(truncation))) < 2e-5
    blur = _log_p(ve, 1e-5, x) - MIX2_log_p0(x)
    assert 1e-4 < float(jnp.max(jnp.abs(blur))) < 2e-3
    pf = cnftrace.ProbabilityFlow(
        ClosedForm(MIX2, vp, "noise"), 2, kind="noise", schedule=vp, **SOLVE
    )
    z = pf.forward(x)
    gap = pf.base.log_prob(z) - _exact_prior(vp).log_prob(z)
    assert 1e-3 < float(jnp.max(jnp.abs(gap))) < 5e-3


@jax.jit
def MIX2_log_p0(x):
    return jax.vmap(lambda y: MIX2.log_prob_at(1.0, 0.0, y))(x)


# ------------------------------------------------------------- schedules and bases


SCHEDULES = [
    cnftrace.VPSchedule(),
    cnftrace.SubVPSchedule(beta_min=0.2, beta_max=15.0),
    cnftrace.VESchedule(),
    cnftrace.CosineSchedule(),
    cnftrace.LinearSchedule(),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_schedule_closed_forms_match_autodiff(schedule):
    """The closed-form derivatives, drift and diffusion that schedules give equal
    the generic ones derived from `alpha` and `sigma` by forward mode."""
    generic = cnftrace.AbstractSchedule
    for t in (0.01, 0.3, 0.9):
        np.testing.assert_allclose(
            schedule.derivatives(t), generic.derivatives(schedule, t), rtol=1e-12
        )
        np.testing.assert_allclose(
            schedule.drift(t), generic.drift(schedule, t), rtol=1e-12
        )
        np.testing.assert_allclose(
            schedule.diffusion(t), generic.diffusion(schedule, t), rtol=1e-12
        )
    if isinstance(schedule, (cnftrace.VPSchedule, cnftrace.CosineSchedule)):
        t = jnp.linspace(0.0, schedule.t_end, 7)
        np.testing.assert_allclose(
            schedule.alpha(t) ** 2 + schedule.sigma(t) ** 2, 1.0, rtol=1e-12
        )


def test_schedules_published_values():
    vp = cnftrace.VPSchedule()  # DDPM's betas 1e-4..0.02 over 1000 steps
    np.testing.assert_allclose(vp.alpha(1.0), math.exp(-0.5 * 10.05), rtol=1e-12)
    sub = cnftrace.SubVPSchedule()
    b = 0.1 * 0.4 + 0.5 * 19.9 * 0.4**2
    np.testing.assert_allclose(sub.sigma(0.4), 1 - math.exp(-b), rtol=1e-12)
    np.testing.assert_allclose(
        sub.diffusion(0.4) ** 2, (0.1 + 19.9 * 0.4) * (1 - math.exp(-2 * b))
    )
    ve = cnftrace.VESchedule(sigma_min=0.01, sigma_max=50.0)
    np.testing.assert_allclose(ve.sigma(0.5), 0.01 * 5000**0.5, rtol=1e-12)
    cos = cnftrace.CosineSchedule()  # iDDPM: alpha_bar = f(t) / f(0)
    f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    np.testing.assert_allclose(cos.alpha(0.3) ** 2, f(0.3) / f(0.0), rtol=1e-12)
    np.testing.assert_allclose(cos.sigma(1e-6) ** 2, 1 - f(1e-6) / f(0.0), rtol=1e-6)
    assert ve.prior_scale() == 50.0 and vp.prior_scale() == 1.0


def test_normal_base_and_the_default_priors():
    prior = cnftrace.Normal(3, loc=1.0, scale=2.0)
    z = jnp.array([[1.0, 2.0, -1.0]])
    expected = -0.5 * (0 + 0.25 + 1.0) - 3 * math.log(2.0) - 1.5 * math.log(2 * math.pi)
    np.testing.assert_allclose(prior.log_prob(z), [expected], rtol=1e-12)
    draws = prior.sample(jr.key(0), 4000)
    np.testing.assert_allclose(jnp.mean(draws), 1.0, atol=0.1)
    np.testing.assert_allclose(jnp.std(draws), 2.0, atol=0.1)
    with pytest.raises(ValueError, match="scale"):
        cnftrace.Normal(2, scale=0.0)
    model = ClosedForm(MIX2, cnftrace.VESchedule(), "score")
    ve = cnftrace.ProbabilityFlow(
        model, 2, kind="score", schedule=cnftrace.VESchedule(sigma_max=30.0)
    )
    assert isinstance(ve.base, cnftrace.Normal)
    np.testing.assert_allclose(ve.base.scale, 30.0)
    vp = cnftrace.ProbabilityFlow(
        model, 2, kind="score", schedule=cnftrace.VPSchedule()
    )
    assert isinstance(vp.base, cnftrace.StandardNormal)


# ------------------------------------------------------ cnftrace's own flow matching


@pytest.fixture(scope="module")
def fm_flow():
    """A small CNF trained by cnftrace's flow matching (data at t0, base at t1)."""
    field = cnftrace.MLPField(2, width=8, depth=1, key=jr.key(0))
    flow = cnftrace.CNF(field, 2, t1=1.0, rtol=1e-6, atol=1e-6)
    k1, k2 = jr.split(jr.key(1))
    which = jr.bernoulli(k1, MIX2.weights[1], (512,)).astype(jnp.int32)
    data = MIX2.means[which] + jnp.sqrt(MIX2.variances[which]) * jr.normal(k2, (512, 2))
    flow, _ = cnftrace.fit(
        flow,
        data,
        key=jr.key(2),
        steps=40,
        batch_size=64,
        objective="fm",
        progress=False,
    )
    return flow


def test_flow_matching_model_equals_its_flow_log_prob(fm_flow):
    """The ODE likelihood of cnftrace's own flow-matching model is the flow's
    `log_prob`, in cnftrace's time convention (`from_flow`) and in the reversed
    one (data at 1, noise at 0, the velocity negated)."""
    x = _points(4)
    expected = fm_flow.log_prob(x)
    pf = cnftrace.ProbabilityFlow.from_flow(fm_flow)
    assert (pf.data_time, pf.noise_time, pf.eps) == (0.0, 1.0, 0.0)
    np.testing.assert_allclose(pf.log_prob(x), expected, rtol=0, atol=1e-12)
    field = fm_flow.vector_field
    reversed_pf = cnftrace.ProbabilityFlow(
        lambda t, y: -field(1 - t, y, None),
        2,
        kind="velocity",
        data_time=1.0,
        noise_time=0.0,
        rtol=1e-6,
        atol=1e-6,
    )
    np.testing.assert_allclose(reversed_pf.log_prob(x), expected, rtol=0, atol=1e-9)


# ------------------------------------------------------- estimators and their errors


@pytest.fixture(scope="module")
def velocity_flow():
    """The exact velocity of MIX2 on the straight path: `log_prob` is MIX2's own
    log-density, in the model's units."""
    return cnftrace.ProbabilityFlow(
        ClosedForm(MIX2, cnftrace.LinearSchedule(), "velocity"),
        2,
        kind="velocity",
        **SOLVE,
    )


@pytest.mark.parametrize(
    "estimator",
    [cnftrace.Hutchinson(), cnftrace.HutchPlusPlus(3), cnftrace.XTrace(4)],
    ids=lambda e: type(e).__name__,
)
def test_stochastic_estimators_are_unbiased_with_their_standard_error(
    velocity_flow, estimator
):
    x = _points(4)
    exact = velocity_flow.log_prob(x)
    flow = velocity_flow.with_estimator(estimator)
    with pytest.raises(ValueError, match="key"):
        flow.log_prob_estimate(x)
    est = flow.log_prob_estimate(x, key=jr.key(4), repeats=300)
    assert est.unit == "nats" and est.repeats == 300 and est.values.shape == (4,)
    assert (
        est.matvecs
        == {"Hutchinson": 1, "HutchPlusPlus": 3, "XTrace": 4}[type(estimator).__name__]
    )
    assert bool(jnp.all(est.stderr > 0))
    assert bool(jnp.all(jnp.abs(est.values - exact) < 4 * est.stderr))
    np.testing.assert_allclose(
        est.monte_carlo_stderr, jnp.sqrt(jnp.sum(est.stderr**2)) / 4, rtol=1e-12
    )


def test_exact_estimate_and_its_standard_errors(velocity_flow):
    x = _points(4)
    est = velocity_flow.log_prob_estimate(x)
    np.testing.assert_allclose(est.values, velocity_flow.log_prob(x), rtol=1e-12)
    assert bool(jnp.all(est.stderr == 0)) and est.matvecs == 2 and int(est.nfe) > 0
    np.testing.assert_allclose(
        est.mean_stderr, jnp.std(est.values, ddof=1) / 2, rtol=1e-12
    )
    with pytest.raises(ValueError, match="repeats=1"):
        velocity_flow.log_prob_estimate(x, repeats=3)
    # One draw of a stochastic estimator cannot measure its own spread. The batch
    # is the estimator test's 300 copies of the points: the program it compiled.
    single = velocity_flow.with_estimator(cnftrace.Hutchinson()).log_prob_estimate(
        jnp.tile(x, (300, 1)), key=jr.key(5)
    )
    assert single.repeats == 1 and single.stderr.shape == (1200,)
    assert bool(jnp.all(jnp.isnan(single.stderr)))


# ----------------------------------------------------------------- bits per dimension


# Integer data 0..3 in two dimensions; the model sees [-1, 1]: y = -1 + (x + u) / 2.
LEVELS = np.array([[0, 3], [1, 2], [3, 0], [2, 2]], dtype=np.uint8)


def _hand_bits(y):
    """By hand: -(log p_y(y) + D log(a * bin_width)) / (D log 2), D = 2, a = 1/2."""
    logp = np.asarray(MIX2_log_p0(jnp.asarray(y)))
    return -(logp + 2 * math.log(0.5 * 1.0)) / (2 * math.log(2))


def test_bits_per_dim_of_dequantised_points_by_hand(velocity_flow):
    x = LEVELS + 0.3  # already dequantised
    bits = velocity_flow.bits_per_dim(
        x, bin_width=1, data_range=(0, 4), model_range=(-1, 1), dequantize=False
    )
    assert bits.unit == "bits/dim" and bool(jnp.all(bits.stderr == 0))
    np.testing.assert_allclose(
        bits.values, _hand_bits(-1 + x / 2), rtol=0, atol=TOL / (2 * math.log(2))
    )
    # The same data in units of a quarter: bins of width 1/4 over [0, 1].
    quarter = velocity_flow.bits_per_dim(
        x / 4,
        bin_width=0.25,
        data_range=(0, 1),
        model_range=(-1, 1),
        dequantize=False,
    )
    np.testing.assert_allclose(quarter.values, bits.values, rtol=1e-10)


def test_bits_per_dim_dequantised_expectation(velocity_flow):
    """Uniform dequantisation of integer data: the mean over draws is the bin's
    expected bound, `E_u`, here by 12 x 12 Gauss-Legendre quadrature."""
    nodes, weights = np.polynomial.legendre.leggauss(12)
    u = (nodes + 1) / 2
    w = np.outer(weights, weights).ravel() / 4
    uu = np.stack(np.meshgrid(u, u, indexing="ij"), -1).reshape(-1, 2)
    expected = [
        float(np.sum(w * _hand_bits(-1 + (level + uu) / 2))) for level in LEVELS
    ]
    bits = velocity_flow.bits_per_dim(
        LEVELS,
        bin_width=1,
        data_range=(0, 4),
        model_range=(-1, 1),
        key=jr.key(0),
        repeats=200,
    )
    assert bool(jnp.all(bits.stderr > 0))
    assert bool(jnp.all(jnp.abs(bits.values - np.array(expected)) < 4 * bits.stderr))


def test_bits_per_dim_refuses_bad_data(velocity_flow):
    key = jr.key(0)
    with pytest.raises(
        ValueError, match=r"integers \(uint8\) without their `bin_width`"
    ):
        velocity_flow.bits_per_dim(LEVELS, data_range=(0, 4), key=key)
    with pytest.raises(ValueError, match="outside the declared `data_range`"):
        velocity_flow.bits_per_dim(
            LEVELS, bin_width=1, data_range=(0, 2), model_range=(-1, 1), key=key
        )
    scaled = -1 + LEVELS / 1.5  # already in the model's range
    with pytest.raises(ValueError, match="outside the declared `data_range`"):
        velocity_flow.bits_per_dim(
            scaled, bin_width=1, data_range=(0, 4), model_range=(-1, 1), key=key
        )
    with pytest.raises(ValueError, match="pass `data_range` too"):
        velocity_flow.bits_per_dim(LEVELS, bin_width=1, model_range=(-1, 1), key=key)
    with pytest.raises(ValueError, match="dequantisation draws uniform noise"):
        velocity_flow.bits_per_dim(LEVELS, bin_width=1, data_range=(0, 4))
    with pytest.raises(ValueError, match="data_range"):
        velocity_flow.bits_per_dim(LEVELS, bin_width=1, data_range=(4, 0), key=key)


# ------------------------------------------------------------- sampling, jit, grads


def test_samples_carry_the_mixture_density(velocity_flow):
    x, logp = velocity_flow.sample_and_log_prob(jr.key(0), 4)
    np.testing.assert_allclose(logp, MIX2_log_p0(x), rtol=0, atol=TOL)
    np.testing.assert_allclose(velocity_flow.log_prob(x), logp, rtol=0, atol=TOL)


def test_first_step_heuristic_stays_inside_the_span():
    """A field undefined beyond its interval (a diffusion drift before t = 0):
    the initial-step heuristic's trial evaluation stays within the span, so a
    slow field's large trial step does not reach it."""

    def velocity(t, x):
        return jnp.where(t < 0, jnp.nan, 1e-8) * x

    pf = cnftrace.ProbabilityFlow(velocity, 2, kind="velocity")
    x = pf.sample(jr.key(0), 3)
    assert bool(jnp.all(jnp.isfinite(x)))


class NoiseNet(eqx.Module):
    mlp: eqx.nn.MLP

    def __call__(self, t, x):
        return self.mlp(jnp.concatenate([x, t[None]]))


def test_jit_vmap_and_gradients_through_the_model():
    """Fine-tuning by likelihood: the gradient of the mean log-likelihood (of
    samples taken one at a time under `vmap`, in a `jit`) with respect to a noise
    model's parameters, against central differences; the `vmap` of one sample at a
    time against the batch."""
    net = NoiseNet(eqx.nn.MLP(3, 2, 8, 1, activation=jnp.tanh, key=jr.key(0)))
    vp = cnftrace.VPSchedule()
    pf = cnftrace.ProbabilityFlow(
        net, 2, kind="noise", schedule=vp, eps=1e-3, rtol=1e-8, atol=1e-8
    )
    x = _points(3)
    params, static = eqx.partition(pf, eqx.is_inexact_array)
    flat, unravel = jax.flatten_util.ravel_pytree(params)

    @jax.jit
    @jax.value_and_grad
    def loss(p):
        flow = eqx.combine(unravel(p), static)
        return -jnp.mean(jax.vmap(lambda y: flow.log_prob(y))(x))

    value, grad = loss(flat)
    np.testing.assert_allclose(value, -jnp.mean(pf.log_prob(x)), rtol=1e-9)
    assert float(jnp.linalg.norm(grad)) > 0
    h = 1e-4
    for i in range(2):
        v = jr.normal(jr.key(10 + i), flat.shape)
        v = v / jnp.linalg.norm(v)
        fd = (loss(flat + h * v)[0] - loss(flat - h * v)[0]) / (2 * h)
        np.testing.assert_allclose(jnp.dot(grad, v), fd, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------ named errors


def test_named_errors_on_bad_models_schedules_and_truncations():
    vp = cnftrace.VPSchedule()
    good = ClosedForm(MIX2, vp, "score")
    with pytest.raises(ValueError, match=r"returned shape \(1,\) for one sample"):
        cnftrace.ProbabilityFlow(lambda t, x: x[:1], 2, kind="velocity")
    with pytest.raises(TypeError, match="returned dtype int32"):
        cnftrace.ProbabilityFlow(lambda t, x: x.astype(jnp.int32), 2, kind="velocity")
    with pytest.raises(TypeError, match="returned dtype float32 .* float64"):
        cnftrace.ProbabilityFlow(lambda t, x: x.astype(jnp.float32), 2, kind="velocity")
    with pytest.raises(TypeError, match="must be callable"):
        cnftrace.ProbabilityFlow(3.0, 2, kind="velocity")
    with pytest.raises(ValueError, match="`kind` must be one of"):
        cnftrace.ProbabilityFlow(good, 2, kind="v-prediction", schedule=vp)
    with pytest.raises(TypeError, match="needs its noise `schedule`"):
        cnftrace.ProbabilityFlow(good, 2, kind="score")
    with pytest.raises(ValueError, match="takes no `schedule`"):
        cnftrace.ProbabilityFlow(good, 2, kind="velocity", schedule=vp)
    with pytest.raises(ValueError, match="`data_time` and `noise_time` are for"):
        cnftrace.ProbabilityFlow(good, 2, kind="score", schedule=vp, data_time=1.0)
    # Truncations outside (0, T) for diffusion models, [0, T) for velocity models.
    for eps in (0.0, -1e-3, 1.0, 2.0, math.nan):
        with pytest.raises(ValueError, match=r"`eps`, the truncation .* \(0, 1\)"):
            cnftrace.ProbabilityFlow(good, 2, kind="score", schedule=vp, eps=eps)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        cnftrace.ProbabilityFlow(good, 2, kind="velocity", eps=-0.1)

    class Pinched(cnftrace.AbstractSchedule):
        t_end: float = 1.0

        def alpha(self, t):
            return jnp.cos(t)

        def sigma(self, t):  # no noise before t = 0.5
            return jnp.maximum(t - 0.5, 0.0)

    with pytest.raises(ValueError, match=r"sigma\(t\) is 0 .* t = 1e-05, inside"):
        cnftrace.ProbabilityFlow(good, 2, kind="data", schedule=Pinched())
    with pytest.raises(ValueError, match=r"alpha\(t\) is .*zero.*t_end"):
        cnftrace.ProbabilityFlow(
            good, 2, kind="score", schedule=cnftrace.CosineSchedule(t_end=1.0)
        )
    with pytest.raises(TypeError, match="one `cnftrace.CNF` block"):
        cnftrace.ProbabilityFlow.from_flow(good)
