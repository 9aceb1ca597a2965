"""Base distributions: the density at the base end of a flow (`t1`).

A base that already knows the data (a Gaussian mixture fitted to the training rows,
or heavy Student-t tails) lets the vector field start at zero, so that the flow starts
as the classical model; heavy tails have to come from the base, since a Lipschitz map
of a light-tailed base keeps light tails (Jaini et al., ICML 2020). Parameters are
stored unconstrained (log-scales, a Cholesky factor with a log-diagonal, logits,
degrees of freedom through a softplus), so that any optimiser update leaves a valid
distribution."""

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_int, check_key, is_int
from .._custom_types import Key


class AbstractBase(eqx.Module):
    """A base distribution of a flow: an exact log-density and a sampler over
    samples of shape `shape`.

    Subclasses hold their parameters as arrays (trained with the flow's vector field
    unless `trainable` is `False`) and implement `_log_prob` and `_sample` on a batch;
    [`log_prob`][cnftrace.AbstractBase.log_prob] and
    [`sample`][cnftrace.AbstractBase.sample] are defined here. A frozen base
    (`trainable=False`) passes its parameters through `jax.lax.stop_gradient`, so
    that `fit` leaves them where they are; the default optimiser's weight decay never
    touches a base.

    !!! example

        ```python
        base = cnftrace.StandardNormal((2,))
        z = base.sample(jr.key(0), 5)        # (5, 2)
        print(base.log_prob(z).shape)        # (5,)
        flow = cnftrace.CNF(cnftrace.MLPField(2, key=jr.key(1)), 2, base=base)
        ```
    """

    shape: eqx.AbstractVar[tuple[int, ...]]
    trainable: eqx.AbstractVar[bool]
    # Whether draws can exceed what a float (or the ODE solver) can hold: the flows
    # then check them (`sample`).
    heavy_tailed: ClassVar[bool] = False

    @abc.abstractmethod
    def _log_prob(self, z: Float[Array, "n ..."]) -> Float[Array, " n"]:
        """The log-density of a batch `z` of shape `(n, *shape)`, with the
        parameters already in `z`'s dtype."""

    @abc.abstractmethod
    def _sample(self, key: Key, n: int, dtype) -> Float[Array, "n ..."]:
        """`n` samples of `dtype`, with the parameters already in that dtype."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line saying what the base is, e.g. `"mixture of 3 full-covariance
        Gaussians"`."""

    def ready(self, dtype) -> "AbstractBase":
        """This base with its parameters in `dtype`, and stopped from gradients when
        it is frozen: what the flows call before `_log_prob` and `_sample`."""

        def prepare(leaf):
            if not eqx.is_inexact_array(leaf):
                return leaf
            leaf = jnp.asarray(leaf, dtype)
            return leaf if self.trainable else jax.lax.stop_gradient(leaf)

        return jax.tree_util.tree_map(prepare, self)

    def log_prob(self, z: Float[Array, "..."]) -> Float[Array, "..."]:
        """The log-density of `z`: one sample of shape `shape`, or any batch of them
        `(*batch, *shape)`.

        **Returns:**

        An array of shape `batch`.
        """
        z = jnp.asarray(z)
        if not jnp.issubdtype(z.dtype, jnp.floating):
            raise TypeError(f"`z` must be floating point; got dtype {z.dtype}.")
        event = len(self.shape)
        if tuple(z.shape[z.ndim - event :]) != tuple(self.shape) or z.ndim < event:
            raise ValueError(
                f"`z` has shape {z.shape}; this base has samples of shape "
                f"{self.shape}: pass (*batch, {', '.join(map(str, self.shape))})."
            )
        batch = z.shape[: z.ndim - event]
        flat = z.reshape((-1, *self.shape))
        return self.ready(z.dtype)._log_prob(flat).reshape(batch)

    def sample(self, key: Key, n: int, *, dtype=None) -> Float[Array, "n ..."]:
        """`n` samples, shape `(n, *shape)`, of `dtype` (JAX's default float if
        omitted)."""
        check_key("key", key)
        check_int("n", n)
        dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
        return self.ready(dtype)._sample(key, int(n), dtype)


class StandardNormal(AbstractBase):
    """The standard normal over samples of shape `shape`: no parameters. The base of
    every flow unless another is given.

    **Arguments:**

    - `shape`: the shape of one sample, an int `d` or a tuple.
    """

    shape: tuple[int, ...] = eqx.field(static=True)
    trainable: bool = eqx.field(default=False, static=True)

    def __init__(self, shape: int | tuple[int, ...]):
        self.shape = event_shape_of(shape)
        self.trainable = False

    def _log_prob(self, z):
        axes = tuple(range(1, z.ndim))
        size = math.prod(z.shape[1:])
        return -0.5 * jnp.sum(z**2, axis=axes) - 0.5 * size * math.log(2 * math.pi)

    def _sample(self, key, n, dtype):
        return jr.normal(key, (n, *self.shape), dtype)

    def describe(self) -> str:
        return "standard normal"


def check_base(base, event_shape: tuple[int, ...]) -> "AbstractBase":
    """`base`, after checking that it is a base over samples of `event_shape`;
    `None` stands for the standard normal."""
    if base is None:
        return StandardNormal(tuple(event_shape))
    if not isinstance(base, AbstractBase):
        raise TypeError(
            "`base` must be a cnftrace base distribution (an AbstractBase, e.g. "
            "cnftrace.StandardNormal(d), cnftrace.GaussianMixture(...) or one from "
            f"cnftrace.fit_base(rows)); got {type(base).__name__}."
        )
    if tuple(base.shape) != tuple(event_shape):
        raise ValueError(
            f"`base` has samples of shape {tuple(base.shape)}, but the flow models "
            f"samples of shape {tuple(event_shape)}."
        )
    return base


def inverse_softplus(y) -> np.ndarray:
    """`x` with `softplus(x) = y` for positive `y`, in float64 NumPy (exact for
    large `y`, where `softplus(x) = x` to float64's precision)."""
    y = np.asarray(y, np.float64)
    with np.errstate(over="ignore"):
        return np.where(y > 30, y, np.log(np.expm1(np.minimum(y, 30))))


def event_shape_of(value, name: str = "shape") -> tuple[int, ...]:
    """The shape of one sample given as a positive int `d` or a tuple of them."""
    shape = (value,) if is_int(value) else value
    if (
        not isinstance(shape, tuple)
        or not shape
        or not all(is_int(s) and s >= 1 for s in shape)
    ):
        raise ValueError(
            f"`{name}` must be a positive int or a tuple of them; got {value!r}."
        )
    return tuple(int(s) for s in shape)


def _dtype(dtype):
    return jnp.result_type(float) if dtype is None else jnp.dtype(dtype)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool; got {value!r}.")
    return value


def _check_finite(name: str, value: np.ndarray) -> None:
    if not np.isfinite(value).all():
        raise ValueError(f"`{name}` must be finite; got {value}.")


def _check_positive_finite(name: str, value: np.ndarray) -> None:
    if not (np.isfinite(value) & (value > 0)).all():
        raise ValueError(f"`{name}` must be finite and positive; got {value}.")


def _span(values: np.ndarray) -> str:
    low, high = float(values.min()), float(values.max())
    return (
        f"{low:.3g}"
        if math.isclose(low, high, rel_tol=5e-3)
        else (f"{low:.3g} to {high:.3g}")
    )


class Normal(AbstractBase):
    """An isotropic Gaussian `N(loc, scale^2 I)` over samples of shape `shape`: one
    location and one scale shared by every coordinate (the scale kept positive as
    `exp(log_scale)`). The prior of a diffusion model at its noise end: the standard
    normal of a VP schedule, or the wide `N(0, sigma_max^2 I)` of a VE one.

    **Arguments:**

    - `shape`: the shape of one sample, an int `d` or a tuple.
    - `loc`, `scale`: the location and the positive scale, scalars.
    - `trainable`: whether `fit` trains them (`False` by default: a prior is fixed).
    - `dtype`: the parameters' dtype (JAX's default float if omitted).

    !!! example

        ```python
        prior = cnftrace.Normal(2, scale=50.0)
        print(prior.log_prob(jnp.zeros(2)))  # -log(2 pi 50^2), about -9.66
        ```
    """

    loc: Float[Array, ""]
    log_scale: Float[Array, ""]
    shape: tuple[int, ...] = eqx.field(static=True)
    trainable: bool = eqx.field(static=True)

    def __init__(
        self,
        shape: int | tuple[int, ...],
        *,
        loc=0.0,
        scale=1.0,
        trainable: bool = False,
        dtype=None,
    ):
        loc, scale = (np.asarray(v, np.float64) for v in (loc, scale))
        if loc.ndim or scale.ndim:
            raise ValueError(
                "`loc` and `scale` of `Normal` must be scalars (one for every "
                "coordinate); for one per coordinate use `cnftrace.GaussianMixture` "
                "with one component and `covariance='diag'`."
            )
        _check_finite("loc", loc)
        _check_positive_finite("scale", scale)
        dtype = _dtype(dtype)
        self.shape = event_shape_of(shape)
        self.loc = jnp.asarray(loc, dtype)
        self.log_scale = jnp.asarray(np.log(scale), dtype)
        self.trainable = _check_bool("trainable", trainable)

    @property
    def scale(self) -> Float[Array, ""]:
        """The scale, `exp(log_scale)`."""
        return jnp.exp(self.log_scale)

    def _log_prob(self, z):
        axes = tuple(range(1, z.ndim))
        size = math.prod(z.shape[1:])
        u = (z - self.loc) * jnp.exp(-self.log_scale)
        return (
            -0.5 * jnp.sum(u**2, axis=axes)
            - size * self.log_scale
            - 0.5 * size * math.log(2 * math.pi)
        )

    def _sample(self, key, n, dtype):
        eps = jr.normal(key, (n, *self.shape), dtype)
        return self.loc + jnp.exp(self.log_scale) * eps

    def describe(self) -> str:
        loc, scale = float(self.loc), float(jnp.exp(self.log_scale))
        return f"isotropic normal (loc {loc:.3g}, scale {scale:.3g})"
