"""The likelihood of a diffusion or flow-matching model trained elsewhere, through
its probability-flow ODE, as a [`CNF`][cnftrace.CNF] block over the prior at the
noise end (see [`ProbabilityFlow`][cnftrace.ProbabilityFlow])."""

import math
from typing import Literal

import diffrax
import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from .._checks import check_int, is_number
from .._custom_types import Key
from .._defaults import ATOL, ICOEFF, MAX_STEPS, PCOEFF, RTOL
from ..estimators import AbstractEstimator
from ._base import AbstractFlow
from ._cnf import CNF
from ._distributions import AbstractBase, Normal, StandardNormal
from ._estimates import (
    LikelihoodEstimate,
    check_in_range,
    data_scaling,
    dequantized_bits,
    make_estimate,
)
from ._flow_checks import (
    check_eps,
    check_model_output,
    check_model_shape,
    check_schedule,
)
from ._inputs import need_key, tracing, validate_input
from ._programs import log_prob_program, raise_on_failure
from ._schedules import AbstractSchedule

ModelKind = Literal["velocity", "score", "noise", "data"]
MODEL_KINDS = ("velocity", "score", "noise", "data")

# score_sde's truncation at the data end.
DEFAULT_DIFFUSION_EPS = 1e-5


class _Drift(eqx.Module):
    """The probability-flow ODE as a CNF vector field on `tau`, with model time
    `t = data_time + direction * tau`: it runs from the data end to the noise end."""

    model: object
    kind: str = eqx.field(static=True)
    schedule: AbstractSchedule | None
    data_time: float
    direction: int = eqx.field(static=True)

    def drift(self, t, x):
        """`dx/dt` at the model's time `t` for one sample `x`."""
        out = check_model_output(self.model(t, x), x, self.kind)
        if self.kind == "velocity":
            return out
        schedule = self.schedule
        alpha, sigma = schedule.alpha(t), schedule.sigma(t)
        d_alpha, d_sigma = schedule.derivatives(t)
        if self.kind == "data":
            rate = d_sigma / sigma
            coeff_x, coeff_out = rate, d_alpha - rate * alpha
        else:
            f = d_alpha / alpha
            coeff_x = f
            if self.kind == "score":  # -g^2 / 2 = -(sigma sigma' - f sigma^2)
                coeff_out = -(sigma * d_sigma - f * sigma**2)
            else:  # noise: the score is -eps / sigma
                coeff_out = d_sigma - f * sigma
        return jnp.asarray(coeff_x, x.dtype) * x + jnp.asarray(coeff_out, x.dtype) * out

    def __call__(self, tau, x, args):
        del args
        t = self.data_time + self.direction * tau
        out = self.drift(jnp.asarray(t, x.dtype), x)
        return out if self.direction == 1 else -out


class _WithArgs(eqx.Module):
    """A vector field `f(t, z, args)` called as a model `v(t, x)`."""

    field: object
    args: object

    def __call__(self, t, x):
        return self.field(t, x, self.args)


class ProbabilityFlow(AbstractFlow):
    r"""The probability-flow ODE of a diffusion or flow-matching model trained
    elsewhere, as a flow: its exact likelihood (`log_prob`), samples, and bits per
    dimension of discrete data, through any trace estimator.

    Its one block is a [`CNF`][cnftrace.CNF] over the `prior`; `log_prob(x)` is
    `log p_eps(x)`, the marginal's density at the truncated data end.

    **Arguments:**

    - `model`: a JAX callable `model(t, x)` on *one* sample `x` and a scalar time
        `t` of `x`'s dtype, returning an array of `x`'s shape (wrap batched, flax
        or rescaled-time models in a lambda; see docs/likelihoods.md).
    - `dim`: the size of one sample, or its shape (a tuple, for images).
    - `kind`: what the model predicts, `"velocity"`, `"score"`, `"noise"` or
        `"data"` (the table in docs/likelihoods.md gives each one's ODE).
    - `schedule`: for score, noise and data models, their
        [`AbstractSchedule`][cnftrace.AbstractSchedule] (data at `t = 0`); the ODE
        runs over `[eps, schedule.t_end]`, where `sigma` (and for score and noise
        models `alpha`) must stay positive.
    - `data_time`, `noise_time`: a velocity model's data and noise times (0, 1).
    - `eps`: the truncation at the data end, where the ODE starts: `1e-5` by default
        for diffusion models, in `(0, T)`; `0` for velocity models, in `[0, T)`.
    - `prior`: the [`AbstractBase`][cnftrace.AbstractBase] at the noise end; by
        default normal with the schedule's `prior_scale()`.
    - `solver`, `rtol`, `atol`, `adjoint`, `estimator`, `max_steps`, `dt0`,
        `pcoeff`, `icoeff`: the solve's settings, as for [`CNF`][cnftrace.CNF].

    !!! example

        ```python
        # The exact score of N(0, I) data under the VP schedule is -x at all times.
        pf = cnftrace.ProbabilityFlow(
            lambda t, x: -x, 2, kind="score", schedule=cnftrace.VPSchedule()
        )
        print(pf.log_prob(jnp.zeros(2)))  # about -1.8379 = log N(0; 0, I)
        ```
    """

    cnf: CNF
    data_time: float
    noise_time: float
    eps: float

    def __init__(
        self,
        model,
        dim: int | tuple[int, ...],
        *,
        kind: ModelKind,
        schedule: AbstractSchedule | None = None,
        data_time: float | None = None,
        noise_time: float | None = None,
        eps: float | None = None,
        prior: AbstractBase | None = None,
        solver: diffrax.AbstractSolver | None = None,
        rtol: float = RTOL,
        atol: float = ATOL,
        adjoint: diffrax.AbstractAdjoint | None = None,
        estimator: AbstractEstimator | None = None,
        max_steps: int = MAX_STEPS,
        dt0: float | None = None,
        pcoeff: float = PCOEFF,
        icoeff: float = ICOEFF,
    ):
        if not callable(model):
            raise TypeError(
                "`model` must be callable as `model(t, x)` on one sample; got "
                f"{type(model).__name__}."
            )
        if kind not in MODEL_KINDS:
            raise ValueError(f"`kind` must be one of {MODEL_KINDS}; got {kind!r}.")
        if kind == "velocity":
            if schedule is not None:
                raise ValueError(
                    "a velocity model's ODE is its velocity: it takes no `schedule`. "
                    "Give its time convention with `data_time` and `noise_time`."
                )
            data_time = 0.0 if data_time is None else data_time
            noise_time = 1.0 if noise_time is None else noise_time
            for name, value in (("data_time", data_time), ("noise_time", noise_time)):
                if not (is_number(value) and math.isfinite(value)):
                    raise ValueError(
                        f"`{name}` must be a finite number; got {value!r}."
                    )
            if data_time == noise_time:
                raise ValueError(
                    f"`data_time` and `noise_time` must differ; got both {data_time!r}."
                )
            eps = 0.0 if eps is None else eps
        else:
            if not isinstance(schedule, AbstractSchedule):
                raise TypeError(
                    f"a {kind} model needs its noise `schedule`, e.g. "
                    "`schedule=cnftrace.VPSchedule()` (an AbstractSchedule); got "
                    f"{type(schedule).__name__}."
                )
            if data_time is not None or noise_time is not None:
                raise ValueError(
                    f"a {kind} model's times are its schedule's (data at 0, noise at "
                    "`schedule.t_end`): `data_time` and `noise_time` are for "
                    "velocity models. Wrap a model fed another time, e.g. "
                    "`lambda t, x: net(1000 * t, x)`."
                )
            data_time, noise_time = 0.0, schedule.t_end
            eps = DEFAULT_DIFFUSION_EPS if eps is None else eps
        length = abs(noise_time - data_time)
        check_eps(eps, length, kind)
        if schedule is not None and not tracing(schedule):
            check_schedule(schedule, kind, eps)
        direction = 1 if noise_time > data_time else -1
        drift = _Drift(model, kind, schedule, float(data_time), direction)
        cnf = CNF(
            drift,
            dim,
            t0=float(eps),
            t1=float(length),
            solver=solver,
            rtol=rtol,
            atol=atol,
            adjoint=adjoint,
            estimator=estimator,
            max_steps=max_steps,
            dt0=dt0,
            pcoeff=pcoeff,
            icoeff=icoeff,
        )
        if prior is None:
            scale = 1.0 if schedule is None else schedule.prior_scale()
            prior = (
                StandardNormal(cnf.shape)
                if scale == 1
                else Normal(cnf.shape, scale=scale)
            )
        self.cnf = cnf.with_base(prior)
        check_model_shape(model, self.cnf.shape, kind)
        self.data_time = float(data_time)
        self.noise_time = float(noise_time)
        self.eps = float(eps)

    @staticmethod
    def from_flow(flow: CNF) -> "ProbabilityFlow":
        """The velocity `ProbabilityFlow` of an unconditional [`CNF`][cnftrace.CNF]
        (data at `flow.t0`, noise at `flow.t1`, its base and solver settings); its
        `log_prob` equals `flow.log_prob`. Raises `TypeError` for a non-CNF.

        !!! example

            ```python
            field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
            flow = cnftrace.CNF(field, 2)
            pf = cnftrace.ProbabilityFlow.from_flow(flow)
            x = jnp.ones((8, 2))
            print(pf.log_prob(x) - flow.log_prob(x))  # zeros
            ```
        """
        if not isinstance(flow, CNF):
            raise TypeError(
                "`flow` must be one `cnftrace.CNF` block; got "
                f"{type(flow).__name__}. For a chain, evaluate `flow.log_prob`."
            )
        if flow.context_dim is not None:
            raise ValueError(
                "a conditional flow's field depends on its context; "
                "`ProbabilityFlow.from_flow` takes unconditional flows."
            )
        return ProbabilityFlow(
            _WithArgs(flow.vector_field, flow.args),
            flow.shape,
            kind="velocity",
            data_time=float(flow.t0),
            noise_time=float(flow.t1),
            eps=0.0,
            prior=flow.base,
            solver=flow.solver,
            rtol=flow.rtol,
            atol=flow.atol,
            adjoint=flow.adjoint,
            estimator=flow.estimator,
            max_steps=flow.max_steps,
            dt0=flow.dt0,
            pcoeff=flow.pcoeff,
            icoeff=flow.icoeff,
        )

    # ------------------------------------------------------------- the flow's parts

    @property
    def model(self):
        """The model the flow was built from."""
        return self.cnf.vector_field.model

    @property
    def kind(self) -> str:
        """What the model predicts (`"velocity"`, `"score"`, `"noise"`, `"data"`)."""
        return self.cnf.vector_field.kind

    @property
    def schedule(self) -> AbstractSchedule | None:
        """The schedule of a score, noise or data model (`None` for velocity)."""
        return self.cnf.vector_field.schedule

    @property
    def base(self) -> AbstractBase:
        """The prior at the noise end."""
        return self.cnf.base

    @property
    def blocks(self) -> tuple[CNF]:
        """`(cnf,)`: the one CNF block that solves the probability-flow ODE."""
        return (self.cnf,)

    @property
    def event_shape(self) -> tuple[int, ...]:
        return self.cnf.shape

    def with_estimator(self, estimator: AbstractEstimator) -> "ProbabilityFlow":
        return eqx.tree_at(lambda p: p.cnf, self, self.cnf.with_estimator(estimator))

    def with_base(self, base: AbstractBase) -> "ProbabilityFlow":
        return eqx.tree_at(lambda p: p.cnf, self, self.cnf.with_base(base))

    def transform(
        self,
        x,
        *,
        inverse,
        log_det,
        key,
        counter=None,
        context=None,
        regularize=False,
    ):
        return self.cnf.transform(
            x,
            inverse=inverse,
            log_det=log_det,
            key=key,
            counter=counter,
            context=context,
            regularize=regularize,
        )

    def drift(self, t, x: Float[Array, "..."]) -> Float[Array, "..."]:
        """The probability-flow ODE's right side `dx/dt` at the model's time `t`,
        for one sample `x`.

        !!! example

            ```python
            pf = cnftrace.ProbabilityFlow(
                lambda t, x: -x, 1, kind="score", schedule=cnftrace.VPSchedule()
            )
            print(pf.drift(0.5, jnp.ones(1)))  # f x - g^2 s / 2 = 0 for N(0, I)
            ```
        """
        x = jnp.asarray(x)
        return self.cnf.vector_field.drift(jnp.asarray(t, x.dtype), x)

    # ---------------------------------------------------------- estimates and bits

    def log_prob_estimate(
        self,
        x: Float[Array, "n ..."],
        *,
        key: Key | None = None,
        repeats: int = 1,
    ) -> LikelihoodEstimate:
        """`log_prob` of a batch with the Monte Carlo standard error of a stochastic
        trace estimator: `repeats` estimates per sample, averaged.

        **Arguments:**

        - `x`: a batch of shape `(n, *event_shape)`.
        - `key`: a PRNG key, required for a stochastic estimator.
        - `repeats`: independent estimates per sample; at least 2 for a standard
            error of a stochastic estimator.

        Returns a [`LikelihoodEstimate`][cnftrace.LikelihoodEstimate] in nats.
        """
        x, stochastic = self._batch_and_repeats(x, repeats, key, dequantize=False)
        logp, stats = self._solve_tiled(_tile(x, repeats), key)
        values = logp.reshape(repeats, -1)
        return make_estimate(values, stats, self, "nats", repeats, stochastic)

    def bits_per_dim(
        self,
        x,
        *,
        bin_width: float | None = None,
        data_range: tuple[float, float] | None = None,
        model_range: tuple[float, float] | None = None,
        key: Key | None = None,
        repeats: int = 1,
        dequantize: bool = True,
    ) -> LikelihoodEstimate:
        r"""Bits per dimension of discrete data (images, counts): the negative
        log2-likelihood per dimension of the bin each sample falls in, bounded by
        uniform dequantisation.

        A sample `x` on a grid of spacing `Delta = bin_width` is dequantised as
        `x + Delta u`, `u ~ U[0, 1)^D`, and mapped to the model's units by the affine
        map `y = m_lo + a (x + Delta u - d_lo)` that sends `data_range = (d_lo, d_hi)`
        onto `model_range = (m_lo, m_hi)`. Then

        $$\log P(\text{bin}) \ge \mathbb{E}_u \log p_y(y) + D \log(a\,\Delta),$$

        and each draw of `u` gives $-(\log p_y(y) + D\log(a\Delta)) / (D \log 2)$ bits
        per dimension. docs/likelihoods.md gives the arguments for common scalings.

        **Arguments:**

        - `x`: the discrete data, shape `(n, *event_shape)`, in the data's own units.
        - `bin_width`: the spacing `Delta` of the data's values; required.
        - `data_range`: `(d_lo, d_hi)`, which every `x` must lie in; without it,
            `a = 1`.
        - `model_range`: where `data_range`'s ends land in the model's units;
            `data_range` itself if omitted.
        - `key`: a PRNG key for the dequantisation noise and the probes.
        - `repeats`: independent draws of `u` (and probes) per sample, averaged; at
            least 2 for a standard error.
        - `dequantize`: `False` when `x` are already dequantised.

        Returns a [`LikelihoodEstimate`][cnftrace.LikelihoodEstimate] in bits/dim.

        !!! example

            ```python
            # N(0, I) data in the model's units: its exact score under VP is -x.
            pf = cnftrace.ProbabilityFlow(
                lambda t, x: -x, 2, kind="score", schedule=cnftrace.VPSchedule()
            )
            pixels = jnp.array([[0, 255], [128, 64]], dtype=jnp.uint8)
            bits = pf.bits_per_dim(
                pixels, bin_width=1, data_range=(0, 256), model_range=(-1, 1),
                key=jr.key(0), repeats=2,
            )
            print(bits.values, bits.stderr)  # bits/dim of each image, its s.e.
            ```
        """
        size = math.prod(self.event_shape)
        low, scale, bin_model = data_scaling(
            x, bin_width, data_range, model_range, dequantize
        )
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
            x = jnp.asarray(x, jnp.result_type(float))
        x, stochastic = self._batch_and_repeats(x, repeats, key, dequantize)
        if data_range is not None:
            x = check_in_range(x, data_range)
        probe_key = key
        tiled = _tile(x, repeats)
        if dequantize:
            noise_key, probe_key = jr.split(key)
            tiled = tiled + bin_width * jr.uniform(noise_key, tiled.shape, x.dtype)
        if data_range is not None:
            m_lo = model_range[0] if model_range is not None else data_range[0]
            tiled = m_lo + scale * (tiled - low)
        logp, stats = self._solve_tiled(tiled, probe_key)
        bits = dequantized_bits(logp, size, bin_model)
        values = bits.reshape(repeats, -1)
        return make_estimate(values, stats, self, "bits/dim", repeats, stochastic)

    # ------------------------------------------------------------------ helpers

    def _batch_and_repeats(self, x, repeats, key, dequantize):
        """`x` checked as a batch, and whether its estimates are random."""
        check_int("repeats", repeats)
        x, unbatched = validate_input(x, self.event_shape, "x")
        if unbatched:
            event = ", ".join(map(str, self.event_shape))
            raise ValueError(
                f"`x` must be a batch of shape (n, {event}); got one sample of shape "
                f"{self.event_shape}: pass `x[None]`."
            )
        stochastic = dequantize or any(e.stochastic for e in self.estimators())
        if repeats > 1 and not stochastic:
            raise ValueError(
                f"`repeats={repeats}` repeats a deterministic estimate (the exact "
                "trace, no dequantisation): pass `repeats=1`."
            )
        if dequantize and key is None:
            raise ValueError(
                "dequantisation draws uniform noise: pass `key=jax.random.key(seed)`, "
                "or `dequantize=False` for data that are already dequantised."
            )
        need_key(key, self.estimators())
        return x, stochastic

    def _solve_tiled(self, tiled, key):
        logp, stats = log_prob_program(self, tiled, key, None, False)
        return raise_on_failure(logp, stats), stats


def _tile(x, repeats):
    """`repeats` copies of the batch `x`, one after the other."""
    return jnp.tile(x, (repeats,) + (1,) * (x.ndim - 1))
