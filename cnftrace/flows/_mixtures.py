"""Bases fitted to the data: a product of Student-t marginals, and Gaussian and
Student-t mixtures, with parameters stored unconstrained."""

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.scipy.linalg as jsl
import numpy as np
from jax.scipy.special import gammaln
from jaxtyping import Array, Float

from .._checks import check_int
from ._distributions import (
    AbstractBase,
    _check_bool,
    _check_finite,
    _check_positive_finite,
    _dtype,
    _span,
    inverse_softplus,
)

# A Student-t mixture's starting degrees of freedom: close to its Gaussian mixture.
_MIXTURE_DF = 30.0


class StudentT(AbstractBase):
    """A product of independent Student-t distributions, one per coordinate, each
    with its own learnable location, scale and degrees of freedom: tails a flow's
    Lipschitz map cannot create from a normal base.

    **Arguments:**

    - `loc`, `scale`, `df`: one value per coordinate (shape `(d,)`, or scalars
        broadcast to `dim`); `scale` and `df` positive.
    - `dim`: the number of coordinates, when all three are scalars.
    - `trainable`: whether `fit` trains the parameters.

    !!! example

        ```python
        base = cnftrace.StudentT(loc=0.0, scale=1.0, df=[2.0, 30.0])
        print(base.df)  # [ 2. 30.]
        ```
    """

    loc: Float[Array, " d"]
    log_scale: Float[Array, " d"]
    df_raw: Float[Array, " d"]
    shape: tuple[int, ...] = eqx.field(static=True)
    trainable: bool = eqx.field(static=True)
    heavy_tailed: ClassVar[bool] = True

    def __init__(
        self,
        loc=0.0,
        scale=1.0,
        df=5.0,
        *,
        dim: int | None = None,
        trainable: bool = True,
        dtype=None,
    ):
        values = [np.asarray(v, np.float64) for v in (loc, scale, df)]
        sizes = {v.size for v in values if v.ndim}
        if any(v.ndim > 1 for v in values) or len(sizes) > 1:
            raise ValueError(
                "`loc`, `scale` and `df` must be scalars or vectors of one length; "
                f"got shapes {[v.shape for v in values]}."
            )
        if dim is None and not sizes:
            raise ValueError("pass `dim` when `loc`, `scale` and `df` are scalars.")
        d = dim if dim is not None else sizes.pop()
        check_int("dim", d)
        if sizes and d not in sizes:
            raise ValueError(f"`dim` is {d}, but the parameters have length {sizes}.")
        loc, scale, df = (np.broadcast_to(v, (d,)) for v in values)
        _check_positive_finite("scale", scale)
        _check_positive_finite("df", df)
        _check_finite("loc", loc)
        dtype = _dtype(dtype)
        self.loc = jnp.asarray(loc, dtype)
        self.log_scale = jnp.asarray(np.log(scale), dtype)
        self.df_raw = jnp.asarray(inverse_softplus(df), dtype)
        self.shape = (int(d),)
        self.trainable = _check_bool("trainable", trainable)

    @property
    def scale(self) -> Float[Array, " d"]:
        """The scale per dimension (stored as its logarithm)."""
        return jnp.exp(self.log_scale)

    @property
    def df(self) -> Float[Array, " d"]:
        """The degrees of freedom per dimension, `softplus(df_raw)`."""
        return jax.nn.softplus(self.df_raw)

    def _log_prob(self, z):
        df = jax.nn.softplus(self.df_raw)[None]
        log_scale = self.log_scale[None]
        u = (z - self.loc[None]) * jnp.exp(-log_scale)
        terms = (
            gammaln(0.5 * (df + 1))
            - gammaln(0.5 * df)
            - 0.5 * jnp.log(df * math.pi)
            - log_scale
            - 0.5 * (df + 1) * jnp.log1p(u**2 / df)
        )
        return jnp.sum(terms, axis=1)

    def _sample(self, key, n, dtype):
        df = jnp.broadcast_to(jax.nn.softplus(self.df_raw), (n, *self.shape))
        t = jr.t(key, df, (n, *self.shape), dtype)
        return self.loc[None] + jnp.exp(self.log_scale)[None] * t

    def describe(self) -> str:
        df = np.asarray(self.df, np.float64)
        return (
            f"product Student-t, {self.shape[0]} coordinate"
            f"{'s' if self.shape[0] != 1 else ''}, degrees of freedom "
            f"{_span(df)}"
        )


class _AbstractMixture(AbstractBase):
    """A mixture of `k` components, each with a mean and a Cholesky scale factor;
    subclasses give a component's log-density and radial scale."""

    logits: Float[Array, " k"]
    means: Float[Array, "k d"]
    log_diag: Float[Array, "k d"]
    tril: Float[Array, "k d d"] | None
    shape: tuple[int, ...] = eqx.field(static=True)
    covariance: str = eqx.field(static=True)
    trainable: bool = eqx.field(static=True)

    def _init_mixture(self, weights, means, covariances, covariance, trainable, dtype):
        if covariance not in ("full", "diag"):
            raise ValueError(
                f"`covariance` must be 'full' or 'diag'; got {covariance!r}."
            )
        weights = np.asarray(weights, np.float64)
        means = np.asarray(means, np.float64)
        covariances = np.asarray(covariances, np.float64)
        if weights.ndim != 1 or means.ndim != 2 or means.shape[0] != weights.size:
            raise ValueError(
                "`weights` must have shape (k,) and `means` shape (k, d); got "
                f"{weights.shape} and {means.shape}."
            )
        k, d = means.shape
        want = (k, d, d) if covariance == "full" else (k, d)
        if covariances.shape != want:
            raise ValueError(
                f"`covariances` must have shape {want} for covariance={covariance!r}; "
                f"got {covariances.shape}."
            )
        _check_positive_finite("weights", weights)
        _check_finite("means", means)
        dtype = _dtype(dtype)
        if covariance == "full":
            if not np.allclose(covariances, np.swapaxes(covariances, 1, 2)):
                raise ValueError("`covariances` must be symmetric matrices.")
            try:
                chol = np.linalg.cholesky(covariances)
            except np.linalg.LinAlgError:
                raise ValueError(
                    "`covariances` must be positive definite (a Cholesky "
                    "factorisation failed); add a small multiple of the identity."
                ) from None
            diag = np.diagonal(chol, axis1=1, axis2=2)
            self.tril = jnp.asarray(np.tril(chol, -1), dtype)
        else:
            _check_positive_finite("covariances", covariances)
            diag = np.sqrt(covariances)
            self.tril = None
        self.logits = jnp.asarray(np.log(weights / weights.sum()), dtype)
        self.means = jnp.asarray(means, dtype)
        self.log_diag = jnp.asarray(np.log(diag), dtype)
        self.shape = (int(d),)
        self.covariance = covariance
        self.trainable = _check_bool("trainable", trainable)

    @property
    def n_components(self) -> int:
        return int(self.logits.shape[0])

    @property
    def weights(self) -> Float[Array, " k"]:
        return jax.nn.softmax(self.logits)

    def cholesky(self) -> Float[Array, "k d d"]:
        """Each component's lower-triangular scale factor `L` (`cov = L L^T` for a
        Gaussian, the scale matrix for a Student-t)."""
        diag = jax.vmap(jnp.diag)(jnp.exp(self.log_diag))
        if self.tril is None:
            return diag
        return jnp.tril(self.tril, -1) + diag

    @property
    def covariances(self) -> Float[Array, "k d d"]:
        """Each component's scale matrix `L L^T` (the covariance of a Gaussian)."""
        chol = self.cholesky()
        return chol @ jnp.swapaxes(chol, 1, 2)

    @abc.abstractmethod
    def _component(self, r2, d) -> Float[Array, "n k"]:
        """Each component's log-density, less its log-determinant, of points at
        squared Mahalanobis distances `r2` (shape `(n, k)`) in `d` dimensions."""

    @abc.abstractmethod
    def _radial(self, key, n, components, dtype) -> Float[Array, " n"]:
        """The factor each standard-normal draw of a component is scaled by."""

    def _log_prob(self, z):
        d = self.shape[0]
        diff = z[:, None, :] - self.means[None]  # (n, k, d)
        if self.tril is None:
            white = diff * jnp.exp(-self.log_diag)[None]
        else:
            chol = self.cholesky()

            def solve(lower, rows):  # rows (n, d) -> L^-1 rows
                return jsl.solve_triangular(lower, rows.T, lower=True).T

            white = jax.vmap(solve, in_axes=(0, 1), out_axes=1)(chol, diff)
        r2 = jnp.sum(white**2, axis=2)  # (n, k)
        log_det = jnp.sum(self.log_diag, axis=1)  # (k,)
        per = self._component(r2, d) - log_det[None]
        return jax.nn.logsumexp(per + jax.nn.log_softmax(self.logits)[None], axis=1)

    def _sample(self, key, n, dtype):
        which_key, noise_key, radial_key = jr.split(key, 3)
        components = jr.categorical(which_key, self.logits, shape=(n,))
        eps = jr.normal(noise_key, (n, *self.shape), dtype)
        eps = eps * self._radial(radial_key, n, components, dtype)[:, None]
        chol = self.cholesky()
        out = jnp.zeros((n, *self.shape), dtype)
        for j in range(self.n_components):  # k is small: no (n, d, d) gather
            x_j = self.means[j][None] + eps @ chol[j].T
            out = jnp.where((components == j)[:, None], x_j, out)
        return out

    def _components_phrase(self, kind: str) -> str:
        k = self.n_components
        cov = "full-covariance" if self.covariance == "full" else "diagonal"
        return f"{k} {cov} {kind}{'s' if k != 1 else ''}"


class GaussianMixture(_AbstractMixture):
    """A mixture of `k` Gaussians over vectors of size `d`, with full or diagonal
    covariances, all learnable. See also
    [`from_sklearn`][cnftrace.GaussianMixture.from_sklearn] and
    [`fit_base`][cnftrace.fit_base].

    **Arguments:**

    - `weights`: shape `(k,)`, positive (normalised here).
    - `means`: shape `(k, d)`.
    - `covariances`: shape `(k, d, d)` (positive definite) for
        `covariance="full"`, or the variances `(k, d)` for `"diag"`.
    - `covariance`: `"full"` or `"diag"`.
    - `trainable`: whether `fit` trains the parameters.
    - `dtype`: the parameters' dtype (JAX's default float if omitted).

    !!! example

        ```python
        base = cnftrace.GaussianMixture(
            [0.5, 0.5], [[-2.0, 0.0], [2.0, 0.0]], [np.eye(2), np.eye(2)]
        )
        print(base.log_prob(jnp.zeros(2)))  # log N(0; (2, 0), I)
        ```
    """

    def __init__(
        self,
        weights,
        means,
        covariances,
        *,
        covariance: str = "full",
        trainable: bool = True,
        dtype=None,
    ):
        self._init_mixture(weights, means, covariances, covariance, trainable, dtype)

    @staticmethod
    def from_sklearn(mixture, *, trainable: bool = True, dtype=None):
        """The mixture of a fitted `sklearn.mixture.GaussianMixture` whose
        `covariance_type` is `"full"` or `"diag"`."""
        kind = getattr(mixture, "covariance_type", None)
        if kind not in ("full", "diag") or not hasattr(mixture, "means_"):
            raise ValueError(
                "`mixture` must be a fitted sklearn GaussianMixture with "
                f"covariance_type 'full' or 'diag'; got {mixture!r:.80}."
            )
        return GaussianMixture(
            mixture.weights_,
            mixture.means_,
            mixture.covariances_,
            covariance=kind,
            trainable=trainable,
            dtype=dtype,
        )

    def _component(self, r2, d):
        return -0.5 * r2 - 0.5 * d * math.log(2 * math.pi)

    def _radial(self, key, n, components, dtype):
        del key, components
        return jnp.ones((n,), dtype)

    def describe(self) -> str:
        if self.n_components == 1:
            cov = "full-covariance" if self.covariance == "full" else "diagonal"
            return f"one {cov} Gaussian"
        return f"mixture of {self._components_phrase('Gaussian')}"


class StudentTMixture(_AbstractMixture):
    """A mixture of `k` multivariate Student-t distributions over vectors of size
    `d`, each with a learnable weight, location, scale matrix and degrees of
    freedom `df`.

    **Arguments:**

    - `weights`, `means`, `covariances`, `covariance`, `trainable`, `dtype`: as for
        [`GaussianMixture`][cnftrace.GaussianMixture]; `covariances` are the scale
        matrices (the covariance is `df / (df - 2)` times that for `df > 2`).
    - `df`: each component's degrees of freedom, shape `(k,)` or a scalar.

    !!! example

        ```python
        gm = cnftrace.GaussianMixture([1.0], [[0.0, 0.0]], [np.eye(2)])
        base = cnftrace.StudentTMixture.from_gaussian(gm, df=4.0)
        print(base.df)  # [4.]
        ```
    """

    df_raw: Float[Array, " k"]
    heavy_tailed: ClassVar[bool] = True

    def __init__(
        self,
        weights,
        means,
        covariances,
        df=_MIXTURE_DF,
        *,
        covariance: str = "full",
        trainable: bool = True,
        dtype=None,
    ):
        self._init_mixture(weights, means, covariances, covariance, trainable, dtype)
        df = np.broadcast_to(np.asarray(df, np.float64), (self.n_components,))
        _check_positive_finite("df", df)
        self.df_raw = jnp.asarray(inverse_softplus(df), self.logits.dtype)

    @staticmethod
    def from_gaussian(
        mixture: GaussianMixture, df=_MIXTURE_DF, *, trainable: bool | None = None
    ) -> "StudentTMixture":
        """The Student-t mixture with `mixture`'s parameters (covariances as scale
        matrices) and `df` degrees of freedom."""
        if not isinstance(mixture, GaussianMixture):
            raise TypeError(
                f"`mixture` must be a cnftrace.GaussianMixture; got "
                f"{type(mixture).__name__}."
            )
        return StudentTMixture(
            np.asarray(mixture.weights, np.float64),
            np.asarray(mixture.means, np.float64),
            np.asarray(
                mixture.covariances
                if mixture.covariance == "full"
                else jnp.exp(2 * mixture.log_diag),
                np.float64,
            ),
            df,
            covariance=mixture.covariance,
            trainable=mixture.trainable if trainable is None else trainable,
            dtype=mixture.logits.dtype,
        )

    @property
    def df(self) -> Float[Array, " k"]:
        """The degrees of freedom per component, `softplus(df_raw)`."""
        return jax.nn.softplus(self.df_raw)

    def _component(self, r2, d):
        df = jax.nn.softplus(self.df_raw)[None]
        return (
            gammaln(0.5 * (df + d))
            - gammaln(0.5 * df)
            - 0.5 * d * jnp.log(df * math.pi)
            - 0.5 * (df + d) * jnp.log1p(r2 / df)
        )

    def _radial(self, key, n, components, dtype):
        # A multivariate t is a Gaussian scaled by sqrt(df / chi2_df).
        df = jax.nn.softplus(self.df_raw)[components].astype(dtype)
        chi2 = 2 * jr.gamma(key, 0.5 * df, dtype=dtype)
        return jnp.sqrt(df / chi2)

    def describe(self) -> str:
        df = _span(np.asarray(self.df, np.float64))
        if self.n_components == 1:
            cov = "full-covariance" if self.covariance == "full" else "diagonal"
            return f"one {cov} Student-t (df {df})"
        return f"mixture of {self._components_phrase('Student-t')} (df {df})"
