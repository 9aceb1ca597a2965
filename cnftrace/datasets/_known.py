"""Densities whose log-density is known exactly, in any dimension, each fixed by its
`seed` (docs/quality.md scores models on them)."""

import abc
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from equinox import AbstractVar
from jax.scipy.special import gammaln, logsumexp
from jaxtyping import Array, Float

from .._checks import check_int
from .._custom_types import Key
from .._placement import committed

# Each marginal has mean 0 and variance 1.
MARGINALS: tuple[str, ...] = ("bimodal", "gumbel", "laplace", "student5", "gamma2")
_BIMODAL_MEAN, _BIMODAL_SD = 0.9, math.sqrt(1 - 0.9**2)
_GUMBEL_SCALE = math.pi / math.sqrt(6)  # standard deviation of a standard Gumbel
_EULER_GAMMA = 0.5772156649015329
_LAPLACE_B = 1 / math.sqrt(2)
_T_NU = 5.0
_T_SCALE = math.sqrt((_T_NU - 2) / _T_NU)  # a t_5 variable times this has variance 1
_GAMMA_K = 2.0
# Heavy tails at unit scale (a variance need not exist).
HEAVY_MARGINALS: tuple[str, ...] = ("heavymix", "t1.5", "t2.5", "t3.5", "t5")
_HEAVYMIX = ((0.6, -1.8, 0.5, None), (0.4, 1.8, 0.6, 2.0))  # (weight, loc, scale, df)


def _marginal_sample(name: str, key, n: int, dtype) -> Array:
    if name == "bimodal":
        k1, k2 = jr.split(key)
        sign = jnp.where(jr.bernoulli(k1, 0.5, (n,)), 1.0, -1.0).astype(dtype)
        return sign * _BIMODAL_MEAN + _BIMODAL_SD * jr.normal(k2, (n,), dtype)
    if name == "gumbel":
        return (jr.gumbel(key, (n,), dtype) - _EULER_GAMMA) / _GUMBEL_SCALE
    if name == "laplace":
        return _LAPLACE_B * jr.laplace(key, (n,), dtype)
    if name == "student5":
        return _T_SCALE * jr.t(key, _T_NU, (n,), dtype)
    if name == "gamma2":
        return (jr.gamma(key, _GAMMA_K, (n,), dtype) - _GAMMA_K) / math.sqrt(_GAMMA_K)
    if name.startswith("t"):
        return jr.t(key, float(name[1:]), (n,), dtype)
    if name == "heavymix":
        k1, k2, k3 = jr.split(key, 3)
        (w, loc0, sd0, _), (_, loc1, sd1, df1) = _HEAVYMIX
        first = jr.bernoulli(k1, w, (n,))
        normal = loc0 + sd0 * jr.normal(k2, (n,), dtype)
        heavy = loc1 + sd1 * jr.t(k3, df1, (n,), dtype)
        return jnp.where(first, normal, heavy)
    raise ValueError(f"unknown marginal {name!r}; choose from {MARGINALS}.")


def _t_log_prob(u: Array, nu: float) -> Array:
    log_norm = gammaln((nu + 1) / 2) - gammaln(nu / 2) - 0.5 * math.log(nu * math.pi)
    return log_norm - (nu + 1) / 2 * jnp.log1p(u**2 / nu)


def _marginal_log_prob(name: str, s: Array) -> Array:
    if name == "bimodal":
        parts = jnp.stack([s - _BIMODAL_MEAN, s + _BIMODAL_MEAN])
        log_n = -0.5 * (parts / _BIMODAL_SD) ** 2 - math.log(
            _BIMODAL_SD * math.sqrt(2 * math.pi)
        )
        return logsumexp(log_n, axis=0) - math.log(2)
    if name == "gumbel":
        g = s * _GUMBEL_SCALE + _EULER_GAMMA
        return -(g + jnp.exp(-g)) + math.log(_GUMBEL_SCALE)
    if name == "laplace":
        return -jnp.abs(s) / _LAPLACE_B - math.log(2 * _LAPLACE_B)
    if name == "student5":
        return _t_log_prob(s / _T_SCALE, _T_NU) - math.log(_T_SCALE)
    if name == "gamma2":
        g = s * math.sqrt(_GAMMA_K) + _GAMMA_K
        inside = g > 0
        safe = jnp.where(inside, g, 1.0)
        logp = (_GAMMA_K - 1) * jnp.log(safe) - safe - math.lgamma(_GAMMA_K)
        return jnp.where(inside, logp + 0.5 * math.log(_GAMMA_K), -jnp.inf)
    if name.startswith("t"):
        return _t_log_prob(s, float(name[1:]))
    if name == "heavymix":
        (w, loc0, sd0, _), (_, loc1, sd1, df1) = _HEAVYMIX
        normal = -0.5 * ((s - loc0) / sd0) ** 2 - math.log(sd0 * math.sqrt(2 * math.pi))
        heavy = _t_log_prob((s - loc1) / sd1, df1) - math.log(sd1)
        parts = jnp.stack([normal + math.log(w), heavy + math.log(1 - w)])
        return logsumexp(parts, axis=0)
    raise ValueError(f"unknown marginal {name!r}; choose from {MARGINALS}.")


def _check_points(x, dim: int) -> Array:
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"`x` must have shape (n, {dim}); got {x.shape}.")
    return x


class KnownDensity(eqx.Module):
    """A density with an exact log-density and a sampler, in `dim` dimensions.

    Build one with [`rotated_product`][cnftrace.datasets.rotated_product] or
    [`gaussian_mixture`][cnftrace.datasets.gaussian_mixture] (standardised).

    - `sample(key, n)`: `n` independent samples, shape `(n, dim)`.
    - `log_prob(x)`: the exact log-density of each row of `x`, shape `(n,)`.
    - `name`, `dim`: what it is.

    `sample` and `log_prob` each run as one compiled program (per `n`, dtype and
    input shape): called eagerly, their few dozen small operations would each
    compile a program of their own on first use.

    !!! example

        ```python
        from cnftrace.datasets import rotated_product

        density = rotated_product(5, seed=0)
        x = density.sample(jr.key(0), 1000)         # (1000, 5)
        print(-density.log_prob(x).mean())          # its entropy, estimated
        ```
    """

    name: AbstractVar[str]
    dim: AbstractVar[int]

    @abc.abstractmethod
    def sample(self, key: Key, n: int, dtype=None) -> Float[Array, "n dim"]:
        """`n` independent samples in `dtype` (JAX's default float if omitted)."""

    @abc.abstractmethod
    def log_prob(self, x: Float[Array, "n dim"]) -> Float[Array, " n"]:
        """The exact log-density of each row of `x`."""


class _Compiled(KnownDensity):
    """A known density whose `sample` and `log_prob` run the compiled programs
    `_sample` and `_log_prob`, with the arguments committed to one device (so that
    host data and samples from a compiled program share one program)."""

    def sample(self, key, n, dtype=None):
        dtype = jnp.result_type(float) if dtype is None else dtype
        density, key = committed((self, key))
        return density._sample(key, check_int("n", n), dtype)

    def log_prob(self, x):
        density, x = committed((self, x))
        return density._log_prob(x)

    @abc.abstractmethod
    def _sample(self, key: Key, n: int, dtype) -> Float[Array, "n dim"]:
        """`sample`'s compiled program."""

    @abc.abstractmethod
    def _log_prob(self, x: Float[Array, "n dim"]) -> Float[Array, " n"]:
        """`log_prob`'s compiled program."""


def mixture_log_prob(x, log_weights, means, cholesky) -> Array:
    """The log-density of each row of `x` under the mixture of Gaussians with these
    `means` and Cholesky factors of their covariances, weighted by
    `exp(log_weights)` (which need not sum to 1)."""
    diff = x[:, None, :] - means.astype(x.dtype)[None]
    chol = cholesky.astype(x.dtype)

    def solve(lower, rows):
        return jax.scipy.linalg.solve_triangular(lower, rows.T, lower=True).T

    white = jax.vmap(solve, in_axes=(0, 1), out_axes=1)(chol, diff)
    log_det = jnp.sum(jnp.log(jnp.diagonal(chol, axis1=1, axis2=2)), axis=1)
    log_n = (
        -0.5 * jnp.sum(white**2, axis=-1)
        - log_det[None]
        - 0.5 * x.shape[1] * math.log(2 * math.pi)
    )
    return logsumexp(log_n + log_weights.astype(x.dtype)[None], axis=1)


def mixture_sample(key, n, dtype, log_weights, means, cholesky) -> Array:
    """`n` draws, in `dtype`, of the mixture of `mixture_log_prob`."""
    k1, k2 = jr.split(key)
    which = jr.categorical(k1, log_weights, shape=(n,))
    eps = jr.normal(k2, (n, means.shape[1]), dtype)
    chol = cholesky.astype(dtype)[which]
    return means.astype(dtype)[which] + jnp.einsum("nij,nj->ni", chol, eps)


class _GaussianMixture(_Compiled):
    name: str = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    log_weights: Float[Array, " k"]
    means: Float[Array, "k dim"]
    cholesky: Float[Array, "k dim dim"]

    @eqx.filter_jit
    def _sample(self, key, n, dtype):
        return mixture_sample(
            key, n, dtype, self.log_weights, self.means, self.cholesky
        )

    @eqx.filter_jit
    def _log_prob(self, x):
        x = _check_points(x, self.dim)
        return mixture_log_prob(x, self.log_weights, self.means, self.cholesky)


class _WarpedProduct(_Compiled):
    """`x = scale * (R @ warp(s))` for `s` a product of marginals; `warp` applies the
    volume-preserving `s_j += b (s_i**2 - 1)` for each `(i, j, b)` in order."""

    name: str = eqx.field(static=True)
    dim: int = eqx.field(static=True)
    marginals: tuple[str, ...] = eqx.field(static=True)
    warps: tuple[tuple[int, int, float], ...] = eqx.field(static=True)
    rotation: Float[Array, "dim dim"]
    scale: Float[Array, " dim"]

    @eqx.filter_jit
    def _unscaled(self, key, n, dtype):
        keys = jr.split(key, self.dim)
        # Column i is `_marginal_sample(marginals[i], keys[i], n)`. The columns of
        # one marginal are drawn by one vmapped call: the same numbers (a vmap over
        # keys draws what a loop over them would), but one rejection loop for all
        # the Student-t (or gamma) columns instead of one per column.
        columns = [None] * self.dim
        for name in dict.fromkeys(self.marginals):
            idx = [i for i, m in enumerate(self.marginals) if m == name]
            draw = functools.partial(_marginal_sample, name, n=n, dtype=dtype)
            block = jax.vmap(draw)(keys[np.asarray(idx)])
            for row, i in enumerate(idx):
                columns[i] = block[row]
        s = jnp.stack(columns, axis=1)
        for i, j, b in self.warps:
            s = s.at[:, j].add(b * (s[:, i] ** 2 - 1))
        return s @ self.rotation.T.astype(dtype)

    @eqx.filter_jit
    def _sample(self, key, n, dtype):
        return self._unscaled(key, n, dtype) * self.scale.astype(dtype)[None]

    @eqx.filter_jit
    def _log_prob(self, x):
        x = _check_points(x, self.dim)
        s = (x / self.scale.astype(x.dtype)[None]) @ self.rotation.astype(x.dtype)
        for i, j, b in reversed(self.warps):
            s = s.at[:, j].add(-b * (s[:, i] ** 2 - 1))
        parts = [_marginal_log_prob(m, s[:, i]) for i, m in enumerate(self.marginals)]
        log_det = jnp.sum(jnp.log(self.scale)).astype(x.dtype)
        return sum(parts[1:], parts[0]) - log_det


def _rotation(rng: np.random.Generator, dim: int) -> np.ndarray:
    """A random rotation (Haar-distributed orthogonal matrix)."""
    q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
    return q * np.sign(np.diag(r))


def rotated_product(dim: int, *, seed: int = 0) -> KnownDensity:
    """A fixed random rotation of a product of `dim` independent 1-D densities.

    The marginals cycle through a two-mode mixture, a Gumbel, a Laplace, a Student-t
    with 5 degrees of freedom and a Gamma(2), each of mean 0 and variance 1.

    **Arguments:**

    - `dim`: the dimension, an int >= 1.
    - `seed`: picks the rotation.

    !!! example

        ```python
        from cnftrace.datasets import rotated_product

        density = rotated_product(5, seed=0)
        x = density.sample(jr.key(0), 1000)
        print(x.shape, density.log_prob(x).shape)  # (1000, 5) (1000,)
        ```
    """
    return _rotated("rotated_product", MARGINALS, dim, seed, stream=1)


def gaussian_mixture(dim: int, components: int = 6, *, seed: int = 0) -> KnownDensity:
    """A mixture of `components` Gaussians in `dim` dimensions with random means,
    random full covariances and unequal weights, drawn from `seed` and standardised
    (the mixture's mean is 0 and every coordinate has variance 1).

    **Arguments:**

    - `dim`: the dimension, an int >= 1.
    - `components`: the number of Gaussians, an int >= 1.
    - `seed`: picks the means, covariances and weights.

    !!! example

        ```python
        from cnftrace.datasets import gaussian_mixture

        density = gaussian_mixture(12, components=6, seed=0)
        x = density.sample(jr.key(0), 4)
        print(density.log_prob(x).shape)  # (4,)
        ```
    """
    dim = check_int("dim", dim)
    components = check_int("components", components)
    rng = np.random.default_rng([seed, dim, components, 2])
    weights = rng.dirichlet(np.full(components, 3.0))
    means = rng.standard_normal((components, dim)) * 1.5
    covs = []
    for _ in range(components):
        # Anisotropic: a rotation of axis scales between 0.15 and 0.6.
        q = _rotation(rng, dim)
        scales = rng.uniform(0.15, 0.6, dim)
        covs.append((q * scales**2) @ q.T)
    covs = np.stack(covs)
    mean = weights @ means
    means = means - mean
    total = np.einsum("k,kij->ij", weights, covs) + np.einsum(
        "k,ki,kj->ij", weights, means, means
    )
    # Per-coordinate standardisation, as a user would standardise their columns.
    scale = np.sqrt(np.diag(total))
    means, covs = means / scale, covs / np.outer(scale, scale)
    return _GaussianMixture(
        name=f"gaussian_mixture(dim={dim}, components={components}, seed={seed})",
        dim=dim,
        log_weights=jnp.asarray(np.log(weights)),
        means=jnp.asarray(means),
        cholesky=jnp.asarray(np.linalg.cholesky(covs)),
    )


def warped_product(dim: int, *, seed: int = 0) -> KnownDensity:
    """The marginals of [`rotated_product`][cnftrace.datasets.rotated_product], bent
    by `max(1, dim // 3)` volume-preserving warps `s_j += b (s_i**2 - 1)` (`b` in
    [0.4, 0.8]), rotated and scaled to variances about 1: benchmark B5's density.

    **Arguments:**

    - `dim`: the dimension, an int >= 2.
    - `seed`: picks the warps and the rotation.

    !!! example

        ```python
        from cnftrace.datasets import warped_product

        density = warped_product(10, seed=0)
        x = density.sample(jr.key(0), 3)
        print(x.shape, density.log_prob(x).shape)  # (3, 10) (3,)
        ```
    """
    dim = check_int("dim", dim, low=2)
    rng = np.random.default_rng([seed, dim, 3])
    marginals = tuple(MARGINALS[i % len(MARGINALS)] for i in range(dim))
    # Sources are light-tailed and never warped, so no warp squares a heavy tail.
    light = [
        i for i, m in enumerate(marginals) if m in ("bimodal", "gumbel", "laplace")
    ]
    order = rng.permutation(light)
    count = max(1, dim // 3)
    sources = [int(i) for i in order[:count]]
    targets = rng.permutation([j for j in range(dim) if j not in sources])[:count]
    warps = [
        (i, int(j), float(rng.uniform(0.4, 0.8))) for i, j in zip(sources, targets)
    ]
    unscaled = _WarpedProduct(
        name=f"warped_product(dim={dim}, seed={seed})",
        dim=dim,
        marginals=marginals,
        warps=tuple(warps),
        rotation=jnp.asarray(_rotation(rng, dim)),
        scale=jnp.ones(dim),
    )
    x = np.asarray(unscaled._unscaled(jr.key(seed), 100_000, jnp.float32))
    return eqx.tree_at(lambda d: d.scale, unscaled, jnp.asarray(1 / x.std(axis=0)))


def heavy_tailed(dim: int, *, seed: int = 0) -> KnownDensity:
    """A fixed random rotation of a product of `dim` heavy-tailed 1-D densities (B5's
    heavy-tailed rows): a two-mode Gaussian/t_2 mixture and Student-t's with 1.5,
    2.5, 3.5 and 5 degrees of freedom, at unit scale.

    **Arguments:**

    - `dim`: the dimension, an int >= 1.
    - `seed`: picks the rotation.

    !!! example

        ```python
        from cnftrace.datasets import heavy_tailed

        density = heavy_tailed(5, seed=0)
        x = density.sample(jr.key(0), 3)
        print(x.shape, density.log_prob(x).shape)  # (3, 5) (3,)
        ```
    """
    return _rotated("heavy_tailed", HEAVY_MARGINALS, dim, seed, stream=4)


def _rotated(name: str, table, dim, seed: int, stream: int) -> KnownDensity:
    """The product of `dim` marginals cycling through `table`, rotated by a rotation
    drawn from `seed` (and `stream`, which keeps each family's draws its own)."""
    dim = check_int("dim", dim)
    rng = np.random.default_rng([seed, dim, stream])
    return _WarpedProduct(
        name=f"{name}(dim={dim}, seed={seed})",
        dim=dim,
        marginals=tuple(table[i % len(table)] for i in range(dim)),
        warps=(),
        rotation=jnp.asarray(_rotation(rng, dim)),
        scale=jnp.ones(dim),
    )
