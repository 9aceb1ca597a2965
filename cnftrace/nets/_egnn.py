"""An E(n)-equivariant graph network as a vector field for particle systems
(Satorras, Hoogeboom and Welling, 2021). Each particle carries features `h_i` (the
time) and a position `x_i`; a layer passes messages over every pair,

    m_ij = phi_e(h_i, h_j, |x_i - x_j|^2),
    x_i <- x_i + mean_{j != i} (x_i - x_j) / (|x_i - x_j| + 1) * phi_x(m_ij),
    h_i <- h_i + phi_h(h_i, mean_{j != i} m_ij),

and the velocity is the positions' total change, less its mean over the particles."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_activation, check_int
from .._custom_types import Key
from .._defaults import EGNN_DEPTH, EGNN_WIDTH, FREQS


def _dense(layer: eqx.nn.Linear, x: Array) -> Array:
    """`layer` applied over the last axis of `x` (any leading axes)."""
    out = x @ layer.weight.T
    if layer.bias is None:
        return out
    return out + layer.bias.reshape((1,) * (out.ndim - 1) + (-1,))


def _two_layers(first: eqx.nn.Linear, second: eqx.nn.Linear, x, activation):
    return _dense(second, activation(_dense(first, x)))


class _EGNNLayer(eqx.Module):
    """One round of messages: the edge, coordinate and node networks, each with one
    hidden layer of `width` units."""

    edge_i: eqx.nn.Linear
    edge_j: eqx.nn.Linear
    edge_d2: Float[Array, " width"]
    edge_out: eqx.nn.Linear
    coord: tuple[eqx.nn.Linear, eqx.nn.Linear]
    node: tuple[eqx.nn.Linear, eqx.nn.Linear]

    def __init__(self, width: int, coord_scale: float, *, key, dtype):
        keys = jr.split(key, 6)

        def linear(i, o, k, **kw):
            return eqx.nn.Linear(i, o, key=k, dtype=dtype, **kw)

        # The edge network's first layer, a linear map of (h_i, h_j, |x_i - x_j|^2),
        # held as its three blocks: h_i's and h_j's parts are applied once per
        # particle, not once per pair.
        first = linear(2 * width + 1, width, keys[0])
        self.edge_i = eqx.nn.Linear(width, width, key=keys[0], dtype=dtype)
        self.edge_i = eqx.tree_at(
            lambda m: (m.weight, m.bias),
            self.edge_i,
            (first.weight[:, :width], first.bias),
        )
        self.edge_j = linear(width, width, keys[0], use_bias=False)
        self.edge_j = eqx.tree_at(
            lambda m: m.weight, self.edge_j, first.weight[:, width : 2 * width]
        )
        self.edge_d2 = first.weight[:, 2 * width]
        self.edge_out = linear(width, width, keys[1])
        last = linear(width, 1, keys[3], use_bias=False)
        # A small last layer (E-NF's xavier gain of 0.001): the field starts near
        # zero, so the flow starts near the identity, at its base.
        last = eqx.tree_at(lambda m: m.weight, last, last.weight * coord_scale)
        self.coord = (linear(width, width, keys[2]), last)
        self.node = (linear(2 * width, width, keys[4]), linear(width, width, keys[5]))

    def __call__(self, h, x, others, activation):
        n = x.shape[0]
        # Particle i's messages come from the others, others[i] (n - 1 of them).
        diff = x[:, None, :] - x[others]  # (n, n - 1, d): x_i - x_j
        d2 = jnp.sum(diff**2, axis=-1)
        hidden = (
            _dense(self.edge_i, h)[:, None, :]
            + _dense(self.edge_j, h)[others]
            + d2[..., None] * self.edge_d2.reshape(1, 1, -1)
        )
        messages = activation(_dense(self.edge_out, activation(hidden)))
        weights = _two_layers(*self.coord, messages, activation)[..., 0]
        # Distances of distinct particles: sqrt is differentiable away from 0.
        scale = weights / (jnp.sqrt(d2) + 1.0)
        step = jnp.sum(diff * scale[..., None], axis=1) / (n - 1)
        aggregated = jnp.sum(messages, axis=1) / (n - 1)
        h = h + _two_layers(
            *self.node, jnp.concatenate([h, aggregated], -1), activation
        )
        return h, x + step


class EGNNField(eqx.Module):
    """An E(n)- and permutation-equivariant vector field (an EGNN) for `n_particles`
    identical particles in `spatial_dim` dimensions, called as `f(t, y, args)` on
    one sample `y` of shape `(n_particles, spatial_dim)`.

    `f(t, R y + a) = R f(t, y)` and `f(t, P y) = P f(t, y)` for rotations,
    reflections, translations and permutations, with zero mean over the particles:
    over a [`MeanFreeNormal`][cnftrace.MeanFreeNormal] base the density is invariant.

    **Arguments:**

    - `n_particles`, `spatial_dim`: the shape of one sample.
    - `width`: the size of the features and of the networks' hidden layers.
    - `depth`: the number of message-passing layers.
    - `activation`: a smooth activation; SiLU by default.
    - `freqs`: the number of time frequencies.
    - `coord_scale`: the initial scale of the coordinate networks' last layer.
    - `key`: PRNG key for the initialisation.
    - `dtype`: parameter dtype (JAX's default float if omitted).

    !!! example

        ```python
        field = cnftrace.EGNNField(4, 2, width=16, depth=2, key=jr.key(0))
        y = jr.normal(jr.key(1), (4, 2))        # one sample: 4 particles in 2-D
        print(field(0.5, y).shape)              # (4, 2), its mean over particles 0
        flow = cnftrace.CNF(field, (4, 2), base=cnftrace.MeanFreeNormal(4, 2))
        ```
    """

    embedding: eqx.nn.Linear
    layers: tuple[_EGNNLayer, ...]
    activation: Callable[[Array], Array]
    n_particles: int = eqx.field(static=True)
    spatial_dim: int = eqx.field(static=True)
    freqs: int = eqx.field(static=True)

    def __init__(
        self,
        n_particles: int,
        spatial_dim: int,
        width: int = EGNN_WIDTH,
        depth: int = EGNN_DEPTH,
        activation: Callable[[Array], Array] = jax.nn.silu,
        *,
        freqs: int = FREQS,
        coord_scale: float = 1e-3,
        key: Key,
        dtype=None,
    ):
        check_int("n_particles", n_particles, 2)
        check_int("spatial_dim", spatial_dim)
        check_int("width", width)
        check_int("depth", depth)
        check_int("freqs", freqs, 0)
        check_activation(activation)
        dtype = jnp.result_type(float) if dtype is None else dtype
        embed_key, *layer_keys = jr.split(key, depth + 1)
        self.embedding = eqx.nn.Linear(1 + 2 * freqs, width, key=embed_key, dtype=dtype)
        self.layers = tuple(
            _EGNNLayer(width, coord_scale, key=k, dtype=dtype) for k in layer_keys
        )
        self.activation = activation
        self.n_particles = n_particles
        self.spatial_dim = spatial_dim
        self.freqs = freqs

    def __call__(self, t, y: Float[Array, "n d"], args=None) -> Float[Array, "n d"]:
        del args
        shape = (self.n_particles, self.spatial_dim)
        if jnp.shape(y) != shape:
            raise ValueError(
                f"`y` must be one sample of {shape[0]} particles in {shape[1]}-D, "
                f"shape {shape}; got {jnp.shape(y)}. Build the flow with "
                f"`cnftrace.CNF(field, {shape})`."
            )
        t = jnp.asarray(t, y.dtype)
        features = [t[None]]
        if self.freqs:
            angle = jnp.arange(1, self.freqs + 1, dtype=y.dtype) * jnp.pi * t
            features += [jnp.cos(angle), jnp.sin(angle)]
        h0 = _dense(self.embedding, jnp.concatenate(features))
        h = jnp.broadcast_to(h0, (self.n_particles, h0.shape[0]))
        n = self.n_particles
        others = np.array([[j for j in range(n) if j != i] for i in range(n)])
        x = y
        for layer in self.layers:
            h, x = layer(h, x, others, self.activation)
        velocity = x - y
        return velocity - jnp.mean(velocity, axis=0, keepdims=True)
