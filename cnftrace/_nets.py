"""Vector-field networks: FFJORD's ConcatSquash MLP."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from ._custom_types import Key


class ConcatSquashLinear(eqx.Module):
    """FFJORD's ConcatSquash layer: a linear map of `x` gated and shifted by time,

    `out = (W x + b) * sigmoid(w_gate t + b_gate) + w_shift t`.
    """

    linear: eqx.nn.Linear
    gate_weight: Float[Array, " out"]
    gate_bias: Float[Array, " out"]
    shift_weight: Float[Array, " out"]

    def __init__(self, in_size: int, out_size: int, *, key: Key, dtype=None):
        k1, k2, k3, k4 = jr.split(key, 4)
        dtype = jnp.result_type(float) if dtype is None else dtype
        self.linear = eqx.nn.Linear(in_size, out_size, key=k1, dtype=dtype)
        # The hyper-networks take the scalar t (fan-in 1): U(-1, 1), as torch does.
        self.gate_weight = jr.uniform(k2, (out_size,), dtype, -1.0, 1.0)
        self.gate_bias = jr.uniform(k3, (out_size,), dtype, -1.0, 1.0)
        self.shift_weight = jr.uniform(k4, (out_size,), dtype, -1.0, 1.0)

    def __call__(self, t, x: Float[Array, " in"]) -> Float[Array, " out"]:
        t = jnp.asarray(t, x.dtype)
        gate = jax.nn.sigmoid(self.gate_weight * t + self.gate_bias)
        return self.linear(x) * gate + self.shift_weight * t


class ConcatSquashMLP(eqx.Module):
    """FFJORD's vector field: ConcatSquash layers `dim -> width x depth -> dim` with an
    activation between layers. Callable as a diffrax vector field `f(t, y, args)` on one
    sample `y` of shape `(dim,)`.

    **Arguments:**

    - `dim`: the data dimension.
    - `width`: hidden width (64 in FFJORD's toy experiments).
    - `depth`: number of hidden layers (3 gives `dim -> 64 -> 64 -> 64 -> dim`).
    - `activation`: applied between layers; `jax.nn.tanh` by default (softplus is the
        other common choice). Anything smooth: the divergence differentiates it.
    - `zero_last`: initialise the last layer to output zero, so the flow starts at the
        identity map.
    - `key`: PRNG key for the initialisation.
    - `dtype`: parameter dtype (JAX's default float if omitted).
    """

    layers: tuple[ConcatSquashLinear, ...]
    activation: Callable[[Array], Array]

    def __init__(
        self,
        dim: int,
        width: int = 64,
        depth: int = 3,
        activation: Callable[[Array], Array] = jax.nn.tanh,
        *,
        zero_last: bool = False,
        key: Key,
        dtype=None,
    ):
        for name, value, low in (
            ("dim", dim, 1),
            ("width", width, 1),
            ("depth", depth, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"`{name}` must be an int >= {low}; got {value!r}.")
        sizes = [dim] + [width] * depth + [dim]
        keys = jr.split(key, len(sizes) - 1)
        layers = [
            ConcatSquashLinear(i, o, key=k, dtype=dtype)
            for i, o, k in zip(sizes[:-1], sizes[1:], keys)
        ]
        if zero_last:
            last = layers[-1]
            layers[-1] = eqx.tree_at(
                lambda m: (m.linear.weight, m.linear.bias, m.shift_weight),
                last,
                (
                    jnp.zeros_like(last.linear.weight),
                    jnp.zeros_like(last.linear.bias),
                    jnp.zeros_like(last.shift_weight),
                ),
            )
        self.layers = tuple(layers)
        self.activation = activation

    def __call__(self, t, y: Float[Array, " dim"], args=None) -> Float[Array, " dim"]:
        del args
        h = y
        for layer in self.layers[:-1]:
            h = self.activation(layer(t, h))
        return self.layers[-1](t, h)
