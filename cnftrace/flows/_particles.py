"""The base of a flow over particle systems: a standard normal on the positions whose
centre of mass is zero. A Boltzmann density of identical particles is invariant to
translations, so it is only normalisable on that subspace, and a translation-invariant,
mean-free vector field (such as [`EGNNField`][cnftrace.EGNNField]) keeps a flow in it,
with its divergence in `R^(n d)` equal to that within the subspace."""

import math

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from .._checks import check_int
from ._distributions import AbstractBase


def remove_center_of_mass(x: Float[Array, "... n d"]) -> Float[Array, "... n d"]:
    """`x` with each sample's centre of mass moved to the origin: the mean over the
    particle axis (the second to last) subtracted from every particle.

    **Arguments:**

    - `x`: positions of shape `(..., n_particles, spatial_dim)`.

    **Returns:**

    An array of `x`'s shape whose mean over the particle axis is zero.

    !!! example

        ```python
        x = jr.normal(jr.key(0), (5, 4, 2)) + 3.0  # 5 samples of 4 particles in 2-D
        centred = cnftrace.remove_center_of_mass(x)
        print(jnp.abs(centred.mean(axis=1)).max())  # 0 up to rounding
        ```
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(
            "`x` must hold positions of shape (..., n_particles, spatial_dim); got "
            f"shape {x.shape}."
        )
    return x - jnp.mean(x, axis=-2, keepdims=True)


class MeanFreeNormal(AbstractBase):
    """The standard normal on the positions of `n_particles` particles in
    `spatial_dim` dimensions whose centre of mass is zero: the base of an
    E(n)-equivariant flow for particle systems (Köhler et al. 2020; Garcia Satorras
    et al. 2021). No parameters.

    Samples are standard normal draws with their centre of mass removed; the
    log-density is that of the `(n - 1) d`-dimensional standard normal within the
    subspace, `-|z - mean(z)|^2 / 2 - (n - 1) d / 2 log(2 pi)`, invariant to
    translations, rotations, reflections and permutations of the particles. Test
    NLLs of a flow over it are per `(n - 1) d` degrees of freedom, the convention of
    the papers on DW4 and LJ13.

    **Arguments:**

    - `n_particles`: the number of particles, at least 2.
    - `spatial_dim`: the dimension of space each particle moves in.

    !!! example

        ```python
        base = cnftrace.MeanFreeNormal(4, 2)       # DW4's base: 4 particles in 2-D
        z = base.sample(jr.key(0), 3)              # (3, 4, 2), each mean-free
        print(base.log_prob(z).shape, base.shape)  # (3,) (4, 2)
        ```
    """

    shape: tuple[int, ...] = eqx.field(static=True)
    trainable: bool = eqx.field(default=False, static=True)

    def __init__(self, n_particles: int, spatial_dim: int):
        check_int("n_particles", n_particles, 2)
        check_int("spatial_dim", spatial_dim)
        self.shape = (int(n_particles), int(spatial_dim))
        self.trainable = False

    @property
    def n_particles(self) -> int:
        """The number of particles."""
        return self.shape[0]

    @property
    def spatial_dim(self) -> int:
        """The dimension of space each particle moves in."""
        return self.shape[1]

    @property
    def degrees_of_freedom(self) -> int:
        """`(n_particles - 1) * spatial_dim`: the dimension of the subspace."""
        return (self.shape[0] - 1) * self.shape[1]

    def _log_prob(self, z):
        centred = z - jnp.mean(z, axis=1, keepdims=True)
        r2 = jnp.sum(centred**2, axis=(1, 2))
        return -0.5 * r2 - 0.5 * self.degrees_of_freedom * math.log(2 * math.pi)

    def _sample(self, key, n, dtype):
        eps = jr.normal(key, (n, *self.shape), dtype)
        return eps - jnp.mean(eps, axis=1, keepdims=True)

    def describe(self) -> str:
        n, d = self.shape
        return f"mean-free standard normal, {n} particles in {d}-D"
