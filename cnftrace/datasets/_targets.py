"""Boltzmann targets `p(x) = exp(-E(x)) / Z` known by their energy, each with a
sampler of reference samples (exact, or seeded replica-exchange Metropolis)."""

import abc
import math
from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from equinox import AbstractVar
from jaxtyping import Array, Float

from .._checks import check_int, check_key, check_positive
from .._custom_types import Key
from ._known import mixture_log_prob, mixture_sample

# Metropolis chains' steps discarded at the start and between kept samples.
_BURN_IN = 2000
_THIN = 50

TARGETS: tuple[str, ...] = ("mixture2d", "dw4", "lj13")


class EnergyTarget(eqx.Module):
    """A Boltzmann density `exp(-energy(x)) / Z` over samples of `event_shape`, known
    up to its normaliser `Z`. Build one with
    [`energy_target`][cnftrace.datasets.energy_target] (or
    [`mixture_2d`][cnftrace.datasets.mixture_2d], [`dw4`][cnftrace.datasets.dw4],
    [`lj13`][cnftrace.datasets.lj13]).

    - `energy(x)`: the energy of each sample of a batch `(n, *event_shape)`.
    - `log_prob(x)`: `-energy(x)`, the unnormalised log-density to hand to
        [`ReverseKL`][cnftrace.ReverseKL] or
        [`importance_weights`][cnftrace.importance_weights].
    - `log_z`: `log Z` where it is known exactly, else `None`.
    - `sample(key, n)`: reference samples, exact where `exact_samples` is True, else
        from a seeded MCMC run (its settings are the method's arguments).
    - `name`, `event_shape`: what it is.

    !!! example

        ```python
        from cnftrace.datasets import energy_target

        target = energy_target("mixture2d")
        x = target.sample(jr.key(0), 1000)                 # exact samples
        print(target.log_z, (-target.energy(x)).shape)     # log 3, (1000,)
        ```
    """

    name: AbstractVar[str]
    event_shape: AbstractVar[tuple[int, ...]]
    exact_samples: ClassVar[bool]

    @abc.abstractmethod
    def energy(self, x: Float[Array, "n ..."]) -> Float[Array, " n"]:
        """The energy of each sample of the batch `x`."""

    def log_prob(self, x: Float[Array, "n ..."]) -> Float[Array, " n"]:
        """The unnormalised log-density `-energy(x)` of each sample."""
        return -self.energy(x)

    @property
    def log_z(self) -> float | None:
        """`log Z`, the log of `exp(-energy)`'s integral, where known exactly."""
        return None

    @abc.abstractmethod
    def sample(self, key: Key, n: int, dtype=None) -> Float[Array, "n ..."]:
        """`n` reference samples in `dtype` (JAX's default float if omitted)."""

    def _checked(self, x) -> Array:
        x = jnp.asarray(x)
        event = tuple(self.event_shape)
        if x.ndim != 1 + len(event) or tuple(x.shape[1:]) != event:
            raise ValueError(
                f"`x` must be a batch of samples of shape (n, "
                f"{', '.join(map(str, event))}) for {self.name}; got {x.shape}."
            )
        return x


class _Mixture2D(EnergyTarget):
    name: str = eqx.field(static=True)
    event_shape: tuple[int, ...] = eqx.field(static=True)
    log_masses: Float[Array, " k"]
    means: Float[Array, "k 2"]
    cholesky: Float[Array, "k 2 2"]
    exact_samples: ClassVar[bool] = True

    def energy(self, x):
        x = self._checked(x)
        return -mixture_log_prob(x, self.log_masses, self.means, self.cholesky)

    log_normaliser: float = eqx.field(static=True)

    @property
    def log_z(self) -> float:
        return self.log_normaliser

    def sample(self, key, n, dtype=None):
        check_key("key", key)
        check_int("n", n)
        dtype = jnp.result_type(float) if dtype is None else dtype
        return mixture_sample(key, n, dtype, self.log_masses, self.means, self.cholesky)


def mixture_2d() -> EnergyTarget:
    """A 2-D energy whose `exp(-E)` is a mixture of four Gaussians with masses 1.2,
    0.9, 0.6 and 0.3, so `log Z = log 3`; its samples are exact.

    !!! example

        ```python
        from cnftrace.datasets import mixture_2d

        target = mixture_2d()
        print(target.log_z)  # 1.0986... = log 3
        ```
    """
    masses = np.array([1.2, 0.9, 0.6, 0.3])
    means = np.array([[-2.0, 0.0], [2.0, 0.5], [0.0, 2.5], [0.5, -2.0]])
    scales = [(0.6, 0.35, 0.5), (0.4, 0.55, -0.3), (0.5, 0.3, 0.0), (0.3, 0.3, 0.0)]
    covs = []
    for sx, sy, rho in scales:
        covs.append([[sx**2, rho * sx * sy], [rho * sx * sy, sy**2]])
    return _Mixture2D(
        name="mixture2d",
        event_shape=(2,),
        log_masses=jnp.asarray(np.log(masses)),
        means=jnp.asarray(means),
        cholesky=jnp.asarray(np.linalg.cholesky(np.array(covs))),
        log_normaliser=float(np.log(masses.sum())),
    )


class ParticleEnergy(EnergyTarget):
    """The energy of `n_particles` identical particles in `spatial_dim` dimensions: a
    sum over pairs of a function of their distance, plus an optional harmonic trap
    `trap / 2 * sum_i |x_i - mean(x)|^2`; its density lives on positions with zero
    centre of mass. `sample(key, n, *, chains, burn_in, thin, temperatures)` runs
    [`random_walk_metropolis`][cnftrace.datasets.random_walk_metropolis].
    """

    name: AbstractVar[str]
    event_shape: AbstractVar[tuple[int, ...]]
    trap: AbstractVar[float]
    init_scale: AbstractVar[float]
    exact_samples: ClassVar[bool] = False

    @property
    def n_particles(self) -> int:
        """The number of particles."""
        return self.event_shape[0]

    @property
    def spatial_dim(self) -> int:
        """The dimension of space each particle moves in."""
        return self.event_shape[1]

    @abc.abstractmethod
    def pair_energy(self, d: Float[Array, "..."]) -> Float[Array, "..."]:
        """The energy of a pair of particles at distance `d`."""

    def distances(self, x: Float[Array, "n p d"]) -> Float[Array, "n pairs"]:
        """The distance of every pair `i < j` of each sample, shape
        `(n, p (p - 1) / 2)`."""
        x = self._checked(x)
        i, j = np.triu_indices(self.n_particles, 1)
        return jnp.sqrt(jnp.sum((x[:, i, :] - x[:, j, :]) ** 2, axis=-1))

    def energy(self, x):
        out = jnp.sum(self.pair_energy(self.distances(x)), axis=1)
        if self.trap:
            centred = x - jnp.mean(x, axis=1, keepdims=True)
            out = out + 0.5 * self.trap * jnp.sum(centred**2, axis=(1, 2))
        return out

    def sample(
        self,
        key,
        n,
        dtype=None,
        *,
        chains: int = 1000,
        burn_in: int = _BURN_IN,
        thin: int = _THIN,
        temperatures: tuple[float, ...] = (1.0, 1.5, 2.25, 3.4, 5.0),
    ):
        check_key("key", key)
        check_int("n", n)
        check_int("chains", chains)
        chains = min(chains, n)
        per_chain = -(-n // chains)
        dtype = jnp.result_type(float) if dtype is None else dtype
        init_key, run_key = jr.split(key)
        x0 = self.init_scale * jr.normal(init_key, (chains, *self.event_shape), dtype)
        samples = random_walk_metropolis(
            self.log_prob,
            x0,
            per_chain,
            key=run_key,
            burn_in=burn_in,
            thin=thin,
            mean_free=True,
            temperatures=temperatures,
        )
        return samples[:n]


class _DoubleWell(ParticleEnergy):
    name: str = eqx.field(static=True)
    event_shape: tuple[int, ...] = eqx.field(static=True)
    a: float = eqx.field(static=True)
    b: float = eqx.field(static=True)
    c: float = eqx.field(static=True)
    offset: float = eqx.field(static=True)
    trap: float = eqx.field(static=True, default=0.0)
    init_scale: float = eqx.field(static=True, default=2.5)

    def pair_energy(self, d):
        r = d - self.offset
        return self.a * r**4 + self.b * r**2 + self.c


class _LennardJones(ParticleEnergy):
    name: str = eqx.field(static=True)
    event_shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    rm: float = eqx.field(static=True)
    trap: float = eqx.field(static=True)
    init_scale: float = eqx.field(static=True, default=1.0)

    def pair_energy(self, d):
        s6 = (self.rm / d) ** 6
        return self.eps * (s6**2 - 2 * s6)


def dw4() -> ParticleEnergy:
    """DW4: four particles in 2-D with the double-well pair potential
    `0.9 (d - 4)^4 - 4 (d - 4)^2` (Köhler et al. 2020), temperature 1. Samples have
    shape `(4, 2)`.

    !!! example

        ```python
        from cnftrace.datasets import dw4

        target = dw4()
        square = jnp.array([[[0.0, 0.0], [2.5, 0.0], [2.5, 2.5], [0.0, 2.5]]])
        print(target.energy(square))  # a low energy: four pairs near 2.5 apart
        # x = target.sample(jr.key(0), 10_000)  # reference samples (about a minute)
        ```
    """
    return _DoubleWell(name="dw4", event_shape=(4, 2), a=0.9, b=-4.0, c=0.0, offset=4.0)


def lj13() -> ParticleEnergy:
    """LJ13: 13 Lennard-Jones particles in 3-D, `eps ((rm / d)^12 - 2 (rm / d)^6)`
    per pair with `eps = rm = 1`, in a harmonic trap `1/2 sum_i |x_i - mean(x)|^2`
    (Köhler et al. 2020; bgflow's `LennardJonesPotential`), temperature 1. Samples
    have shape `(13, 3)`.

    !!! example

        ```python
        from cnftrace.datasets import lj13

        target = lj13()
        print(target.event_shape)  # (13, 3)
        ```
    """
    return _LennardJones(name="lj13", event_shape=(13, 3), eps=1.0, rm=1.0, trap=1.0)


_BY_NAME: dict[str, Callable[[], EnergyTarget]] = {
    "mixture2d": mixture_2d,
    "dw4": dw4,
    "lj13": lj13,
}


def energy_target(name: str) -> EnergyTarget:
    """The target called `name`, one of `TARGETS`: `"mixture2d"`, `"dw4"`,
    `"lj13"`.

    !!! example

        ```python
        from cnftrace.datasets import TARGETS, energy_target

        print([energy_target(n).event_shape for n in TARGETS])
        ```
    """
    if name not in _BY_NAME:
        raise ValueError(f"unknown target {name!r}; choose one of {TARGETS}.")
    return _BY_NAME[name]()


@eqx.filter_jit
def _metropolis_run(
    log_prob, x0, key, samples, burn_in, thin, step_size, accept, mean_free, betas
):
    """`random_walk_metropolis` at the inverse temperatures `betas` (swaps of even
    pairs, then odd pairs, after every step): the kept states of the copy at
    `betas[0]` and its acceptance rate."""
    levels, chains = len(betas), x0.shape[0]
    event = x0.shape[1:]
    shape = (levels * chains,)
    beta = jnp.repeat(jnp.asarray(betas, x0.dtype), chains)

    def expand(v):  # per-chain values against states (levels * chains, *event)
        return v.reshape(shape + (1,) * len(event))

    def move(x, logp, log_sigma, key):
        move_key, accept_key = jr.split(key)
        eps = jr.normal(move_key, x.shape, x.dtype)
        if mean_free:
            eps = eps - jnp.mean(eps, axis=1, keepdims=True)
        y = x + expand(jnp.exp(log_sigma)) * eps
        logp_y = log_prob(y)
        log_u = jnp.log(jr.uniform(accept_key, shape, x.dtype))
        ok = (log_u < beta * (logp_y - logp)) & jnp.isfinite(logp_y)
        return jnp.where(expand(ok), y, x), jnp.where(ok, logp_y, logp), ok

    def swap(x, logp, key, parity):
        if levels == 1:
            return x, logp
        lp = logp.reshape(levels, chains)
        xs = x.reshape((levels, chains) + event)
        b = jnp.asarray(betas, x.dtype)
        log_u = jnp.log(jr.uniform(key, (levels - 1, chains), x.dtype))
        accept_pair = log_u < (b[:-1] - b[1:])[:, None] * (lp[1:] - lp[:-1])
        k = jnp.arange(levels - 1)
        accept_pair = accept_pair & ((k % 2) == parity)[:, None]
        # Level k takes level k+1's state where pair k swaps, and level k+1 takes
        # level k's; pairs of one parity never share a level.
        down = jnp.concatenate([accept_pair, jnp.zeros((1, chains), bool)])
        up = jnp.concatenate([jnp.zeros((1, chains), bool), accept_pair])
        lp_new = jnp.where(
            down, jnp.roll(lp, -1, 0), jnp.where(up, jnp.roll(lp, 1, 0), lp)
        )
        wide = (levels, chains) + (1,) * len(event)
        xs_new = jnp.where(
            down.reshape(wide),
            jnp.roll(xs, -1, 0),
            jnp.where(up.reshape(wide), jnp.roll(xs, 1, 0), xs),
        )
        return xs_new.reshape(x.shape), lp_new.reshape(shape)

    def step(carry, key, adapt):
        x, logp, log_sigma, parity = carry
        move_key, swap_key = jr.split(key)
        x, logp, ok = move(x, logp, log_sigma, move_key)
        if adapt:  # Robbins-Monro on each chain's log step size
            log_sigma = log_sigma + 0.05 * (ok.astype(x.dtype) - accept)
        x, logp = swap(x, logp, swap_key, parity)
        return (x, logp, log_sigma, 1 - parity), ok[:chains]

    x = jnp.tile(x0, (levels,) + (1,) * len(event))
    log_sigma = jnp.full(shape, jnp.log(step_size), x0.dtype)
    carry = (x, log_prob(x), log_sigma, jnp.asarray(0))
    burn_keys, run_key = jr.split(key)
    carry, _ = jax.lax.scan(
        lambda c, k: step(c, k, True), carry, jr.split(burn_keys, burn_in)
    )

    def record(carry, key):
        carry, ok = jax.lax.scan(
            lambda c, k: step(c, k, False), carry, jr.split(key, thin)
        )
        return carry, (carry[0][:chains], jnp.mean(ok))

    carry, (xs, rates) = jax.lax.scan(record, carry, jr.split(run_key, samples))
    return xs, jnp.mean(rates)


def random_walk_metropolis(
    log_prob: Callable[[Array], Array],
    x0: Float[Array, "chains ..."],
    samples_per_chain: int,
    *,
    key: Key,
    burn_in: int = _BURN_IN,
    thin: int = _THIN,
    step_size: float = 0.1,
    acceptance: float = 0.3,
    mean_free: bool = False,
    temperatures: tuple[float, ...] = (1.0,),
) -> Float[Array, "n ..."]:
    """Samples of an unnormalised density by seeded random-walk Metropolis on many
    chains at once, with replica exchange between neighbouring `temperatures` after
    every step; step sizes adapt during `burn_in`, then the temperature-1 copy is
    kept every `thin` steps.

    **Arguments:**

    - `log_prob`: the unnormalised log-density, a JAX function from a batch
        `(m, ...)` to `(m,)`.
    - `x0`: the chains' starting points, shape `(chains, ...)` (the centre of mass
        removed when `mean_free`: the proposals keep it where it starts).
    - `samples_per_chain`: how many samples each chain contributes.
    - `key`: the PRNG key.
    - `burn_in`, `thin`: steps before the first sample, and between samples.
    - `step_size`: the proposals' initial scale.
    - `acceptance`: the acceptance rate the step sizes adapt to in the burn-in.
    - `mean_free`: remove the centre of mass of the starting points and of every
        proposal (for particle systems, shape `(chains, particles, dim)`).
    - `temperatures`: increasing temperatures starting at 1; `(1.0,)` (the default)
        is plain random-walk Metropolis.

    **Returns:**

    The samples, shape `(samples_per_chain * chains, ...)`, in the order they were
    kept (the first sample of every chain, then the second, ...).

    !!! example

        ```python
        from cnftrace.datasets import random_walk_metropolis

        log_prob = lambda x: -0.5 * jnp.sum(x**2, axis=1)
        x = random_walk_metropolis(
            log_prob, jnp.zeros((100, 2)), 20, key=jr.key(0), burn_in=200, thin=5,
            step_size=1.0,
        )
        print(x.shape, x.std(axis=0))  # (2000, 2), about 1
        ```
    """
    check_key("key", key)
    check_int("samples_per_chain", samples_per_chain)
    check_int("burn_in", burn_in, 0)
    check_int("thin", thin)
    check_positive("step_size", step_size)
    if not 0 < acceptance < 1:
        raise ValueError(f"`acceptance` must be in (0, 1); got {acceptance!r}.")
    temperatures = tuple(float(t) for t in temperatures)
    if (
        not temperatures
        or temperatures[0] != 1.0
        or any(b <= a for a, b in zip(temperatures, temperatures[1:]))
        or not all(math.isfinite(t) for t in temperatures)
    ):
        raise ValueError(
            "`temperatures` must be finite, increasing and start at 1.0 (the "
            f"target); got {temperatures}."
        )
    x0 = jnp.asarray(x0)
    if x0.ndim < 2 or not jnp.issubdtype(x0.dtype, jnp.floating):
        raise ValueError(
            "`x0` must be floating starting points of shape (chains, ...); got "
            f"{x0.dtype} of shape {x0.shape}."
        )
    if mean_free:
        if x0.ndim != 3:
            raise ValueError(
                "`mean_free` needs particle positions, `x0` of shape (chains, "
                f"particles, dim); got {x0.shape}."
            )
        x0 = x0 - jnp.mean(x0, axis=1, keepdims=True)
    xs, _ = _metropolis_run(
        log_prob,
        x0,
        key,
        samples_per_chain,
        burn_in,
        thin,
        float(step_size),
        float(acceptance),
        bool(mean_free),
        tuple(1.0 / t for t in temperatures),
    )
    return xs.reshape((-1, *x0.shape[1:]))
