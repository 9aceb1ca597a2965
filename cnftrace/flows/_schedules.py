"""Noise schedules of diffusion models, `x_t = alpha(t) x_0 + sigma(t) e`: what a
probability-flow ODE needs of a diffusion model (see
[`AbstractSchedule`][cnftrace.AbstractSchedule])."""

import abc
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import check_positive, is_number

# The linear rate of the VP and sub-VP SDEs of Song et al. (2021), score_sde's.
_BETA_MIN = 0.1
_BETA_MAX = 20.0

Time = float | Float[Array, ""]


class AbstractSchedule(eqx.Module):
    r"""The noise schedule of a diffusion model, `x_t = alpha(t) x_0 + sigma(t) e`
    with `e ~ N(0, I)`, data at `t = 0` and noise at `t = t_end`.

    Subclass it for a schedule of your own: give `t_end` and the two methods
    [`alpha`][cnftrace.AbstractSchedule.alpha] and
    [`sigma`][cnftrace.AbstractSchedule.sigma] of a scalar time (in `jnp`); the
    derivatives, the SDE's drift and diffusion (docs/likelihoods.md) and the prior's
    scale are derived from them.

    !!! example

        ```python
        class Quadratic(cnftrace.AbstractSchedule):
            # alpha = 1 - t^2, sigma = t: a schedule of one's own
            t_end: float = 0.99

            def alpha(self, t):
                return 1 - t**2

            def sigma(self, t):
                return t

        schedule = Quadratic()
        print(schedule.derivatives(0.5))  # (-1.0, 1.0)
        ```
    """

    t_end: eqx.AbstractVar[float]

    @abc.abstractmethod
    def alpha(self, t: Time) -> Float[Array, ""]:
        """The data's coefficient `alpha(t)` in `x_t = alpha(t) x_0 + sigma(t) e`."""

    @abc.abstractmethod
    def sigma(self, t: Time) -> Float[Array, ""]:
        """The noise's standard deviation `sigma(t)` in `x_t = alpha(t) x_0 +
        sigma(t) e`."""

    def derivatives(self, t: Time) -> tuple[Float[Array, ""], Float[Array, ""]]:
        """`(alpha'(t), sigma'(t))`, by forward-mode differentiation unless a
        schedule overrides it with closed forms."""
        t = jnp.asarray(t, jnp.result_type(t, float))
        one = jnp.ones_like(t)
        _, d_alpha = jax.jvp(self.alpha, (t,), (one,))
        _, d_sigma = jax.jvp(self.sigma, (t,), (one,))
        return d_alpha, d_sigma

    def drift(self, t: Time) -> Float[Array, ""]:
        """The SDE's drift coefficient `f(t) = alpha'(t) / alpha(t)` (the drift is
        `f(t) x`)."""
        d_alpha, _ = self.derivatives(t)
        return d_alpha / self.alpha(t)

    def diffusion(self, t: Time) -> Float[Array, ""]:
        """The SDE's diffusion coefficient `g(t)`, with
        `g^2 = 2 sigma sigma' - 2 f sigma^2`."""
        d_alpha, d_sigma = self.derivatives(t)
        sigma = self.sigma(t)
        g2 = 2 * sigma * d_sigma - 2 * (d_alpha / self.alpha(t)) * sigma**2
        return jnp.sqrt(g2)

    def prior_scale(self) -> float:
        """The scale `s` of the default prior `N(0, s^2 I)` at `t_end`:
        `sqrt(alpha(T)^2 + sigma(T)^2)`, the end marginal's scale for data of unit
        variance (exactly 1 for a variance-preserving schedule)."""
        t = self.t_end
        return float(jnp.sqrt(self.alpha(t) ** 2 + self.sigma(t) ** 2))


def _check_t_end(schedule, kind: str | None = None) -> None:
    """`t_end` positive, and at most 1 for a `kind` of schedule whose `alpha`
    vanishes there."""
    check_positive("t_end", schedule.t_end)
    if kind is not None and not schedule.t_end <= 1:
        raise ValueError(
            f"`t_end` of the {kind} schedule must be at most 1; got {schedule.t_end}."
        )


class _AbstractLinearRate(AbstractSchedule):
    """What the VP and sub-VP schedules share: the noise rate
    `beta(t) = beta_min + t (beta_max - beta_min)`, its integral `B(t)`, and
    `alpha(t) = exp(-B(t) / 2)`."""

    beta_min: eqx.AbstractVar[float]
    beta_max: eqx.AbstractVar[float]

    def __check_init__(self):
        _check_rates(self.beta_min, self.beta_max)
        _check_t_end(self)

    def _integral(self, t):
        return self.beta_min * t + 0.5 * (self.beta_max - self.beta_min) * t**2

    def _rate(self, t):
        return self.beta_min + (self.beta_max - self.beta_min) * t

    def alpha(self, t):
        return jnp.exp(-0.5 * self._integral(t))

    def drift(self, t):
        return -0.5 * self._rate(t)

    def prior_scale(self) -> float:
        return 1.0


class VPSchedule(_AbstractLinearRate):
    """The variance-preserving schedule of DDPM (Ho et al. 2020) in continuous time
    (Song et al. 2021): a noise rate `beta(t) = beta_min + t (beta_max - beta_min)`
    linear in `t` over `[0, 1]`, and

        alpha(t) = exp(-B(t) / 2),   sigma(t) = sqrt(1 - exp(-B(t))),
        B(t) = beta_min t + (beta_max - beta_min) t^2 / 2.

    DDPM's discrete linear betas from 1e-4 to 0.02 over `N = 1000` steps are
    `beta_min = 0.1`, `beta_max = 20` (the defaults, as in score_sde); a model fed the
    step index `i` sees `t = i / N`. The default prior is the standard normal.

    **Arguments:**

    - `beta_min`, `beta_max`: the noise rate at `t = 0` and `t = 1`.
    - `t_end`: the end time `T` (1 by default).

    !!! example

        ```python
        schedule = cnftrace.VPSchedule()
        print(schedule.alpha(1.0), schedule.sigma(1.0))  # about 0.0066 1.0
        ```
    """

    beta_min: float = _BETA_MIN
    beta_max: float = _BETA_MAX
    t_end: float = 1.0

    def sigma(self, t):
        return jnp.sqrt(-jnp.expm1(-self._integral(t)))

    def derivatives(self, t):
        alpha, sigma, rate = self.alpha(t), self.sigma(t), self._rate(t)
        # sigma' = beta e^-B / (2 sigma) = beta alpha^2 / (2 sigma)
        return -0.5 * rate * alpha, 0.5 * rate * alpha**2 / sigma

    def diffusion(self, t):
        return jnp.sqrt(self._rate(t))


class SubVPSchedule(_AbstractLinearRate):
    """The sub-variance-preserving schedule of Song et al. (2021): DDPM's `alpha`
    with a smaller noise, `sigma(t) = 1 - exp(-B(t))` (below the VP schedule's
    `sqrt(1 - exp(-B))`), with `B` and the arguments of
    [`VPSchedule`][cnftrace.VPSchedule]. Its SDE's diffusion is
    `g^2 = beta(t) (1 - exp(-2 B(t)))`. The default prior is the standard normal
    (score_sde's).
    """

    beta_min: float = _BETA_MIN
    beta_max: float = _BETA_MAX
    t_end: float = 1.0

    def sigma(self, t):
        return -jnp.expm1(-self._integral(t))

    def derivatives(self, t):
        alpha, rate = self.alpha(t), self._rate(t)
        return -0.5 * rate * alpha, rate * alpha**2

    def diffusion(self, t):
        return jnp.sqrt(-self._rate(t) * jnp.expm1(-2 * self._integral(t)))


class VESchedule(AbstractSchedule):
    """The variance-exploding schedule of Song & Ermon (NCSN) in continuous time
    (Song et al. 2021): `alpha(t) = 1` and a geometric
    `sigma(t) = sigma_min (sigma_max / sigma_min)^t` on `[0, 1]`.

    Its data end is already blurred: `sigma(0) = sigma_min`, so a VE model's
    likelihood is that of the data convolved with `N(0, sigma_min^2)`. The default
    prior is score_sde's `N(0, sigma_max^2 I)`.

    **Arguments:**

    - `sigma_min`, `sigma_max`: the noise at `t = 0` and `t = 1` (score_sde's
        CIFAR-10 values 0.01 and 50 by default; use your model's).
    - `t_end`: the end time `T` (1 by default).
    """

    sigma_min: float = 0.01
    sigma_max: float = 50.0
    t_end: float = 1.0

    def __check_init__(self):
        for name in ("sigma_min", "sigma_max"):
            check_positive(name, getattr(self, name))
        if not self.sigma_max > self.sigma_min:
            raise ValueError(
                "`sigma_max` must exceed `sigma_min`; got "
                f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max}."
            )
        _check_t_end(self)

    def alpha(self, t):
        return jnp.ones_like(jnp.asarray(t, jnp.result_type(t, float)))

    def sigma(self, t):
        return self.sigma_min * (self.sigma_max / self.sigma_min) ** t

    def derivatives(self, t):
        return jnp.zeros_like(self.alpha(t)), self.sigma(t) * math.log(
            self.sigma_max / self.sigma_min
        )

    def prior_scale(self) -> float:
        return float(self.sigma_max)


class CosineSchedule(AbstractSchedule):
    """The cosine schedule of improved DDPM (Nichol & Dhariwal 2021):
    `alpha(t)^2 = cos^2(theta(t)) / cos^2(theta(0))` with
    `theta(t) = (t + s) / (1 + s) pi / 2`, and `sigma(t)^2 = 1 - alpha(t)^2`.

    `alpha` reaches 0 at `t = 1`, where a score or noise model's drift divides by
    zero, so the default end time is DPM-Solver's `0.9946` (Lu et al. 2022).

    **Arguments:**

    - `s`: the offset that keeps `sigma` from being too small near `t = 0` (0.008).
    - `t_end`: the end time `T`, below 1.
    """

    s: float = 0.008
    t_end: float = 0.9946

    def __check_init__(self):
        check_positive("s", self.s)
        _check_t_end(self, "cosine")

    def _theta(self, t):
        return (t + self.s) / (1 + self.s) * (math.pi / 2)

    def alpha(self, t):
        return jnp.cos(self._theta(t)) / math.cos(self._theta(0.0))

    def sigma(self, t):
        # 1 - alpha^2 = (cos^2 theta0 - cos^2 theta) / cos^2 theta0
        #             = sin(theta - theta0) sin(theta + theta0) / cos^2 theta0,
        # without the cancellation of 1 - alpha^2 near t = 0.
        theta, theta0 = self._theta(t), self._theta(0.0)
        return jnp.sqrt(jnp.sin(theta - theta0) * jnp.sin(theta + theta0)) / math.cos(
            theta0
        )

    def prior_scale(self) -> float:
        return 1.0


class LinearSchedule(AbstractSchedule):
    """The straight path of rectified flow and flow matching, `alpha(t) = 1 - t`,
    `sigma(t) = t`, for a noise or data (x-) prediction model trained on it. (A
    velocity model needs no schedule.)

    `alpha` reaches 0 at `t = 1`: a data-prediction model can be integrated up to
    there, a score or noise model only to a `t_end` below 1.

    **Arguments:**

    - `t_end`: the end time `T` (1 by default).
    """

    t_end: float = 1.0

    def __check_init__(self):
        _check_t_end(self, "linear")

    def alpha(self, t):
        return 1 - jnp.asarray(t, jnp.result_type(t, float))

    def sigma(self, t):
        return jnp.asarray(t, jnp.result_type(t, float))

    def derivatives(self, t):
        one = jnp.ones_like(self.sigma(t))
        return -one, one

    def prior_scale(self) -> float:
        return 1.0


def _check_rates(beta_min, beta_max) -> None:
    for name, value in (("beta_min", beta_min), ("beta_max", beta_max)):
        if not is_number(value):
            raise TypeError(f"`{name}` must be a number; got {value!r}.")
    if not (0 < beta_min <= beta_max and math.isfinite(beta_max)):
        raise ValueError(
            "the noise rates need `0 < beta_min <= beta_max`; got "
            f"beta_min={beta_min}, beta_max={beta_max}."
        )
