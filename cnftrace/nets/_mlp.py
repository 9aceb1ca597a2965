"""Vector-field networks: an MLP with sinusoidal time features (the default) and
FFJORD's ConcatSquash MLP."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from .._checks import check_activation, check_int
from .._custom_types import Key
from .._defaults import CONCATSQUASH_WIDTH, DEPTH, FREQS, default_width


def _linear(layer: eqx.nn.Linear, x: Array) -> Array:
    """`layer(x)` written `x @ W.T + b` so that vmapped axes stay in front: `W @ x`
    made XLA transpose activations and tangents, and slowed a training step."""
    out = x @ layer.weight.T
    return out if layer.bias is None else out + layer.bias


def _mlp(mlp: eqx.nn.MLP, x: Array) -> Array:
    """`mlp(x)` for a vector `x`, as equinox's own call, through `_linear`."""
    for layer in mlp.layers[:-1]:
        x = jax.vmap(mlp.activation)(_linear(layer, x))
    return jax.vmap(mlp.final_activation)(_linear(mlp.layers[-1], x))


class ConcatSquashLinear(eqx.Module):
    """FFJORD's ConcatSquash layer: a linear map of `x` gated and shifted by time,

    `out = (W x + b) * sigmoid(w_gate t + b_gate) + w_shift t`.

    With `context_dim`, the gate and the shift are linear in `(t, context)` instead:
    `sigmoid(w_gate t + G c + b_gate)` and `w_shift t + S c`. Called as
    `layer(t, x)`, or `layer(t, x, context)`.

    **Arguments:**

    - `in_size`, `out_size`: the sizes of `x` and of the output.
    - `context_dim`: the size of the context vector; 0 (default) for none.
    - `key`, `dtype`: PRNG key for the initialisation, parameter dtype.

    !!! example

        ```python
        layer = cnftrace.ConcatSquashLinear(2, 16, key=jr.key(0))
        layer(0.5, jnp.ones(2)).shape  # (16,)
        ```
    """

    linear: eqx.nn.Linear
    gate_weight: Float[Array, " out"]
    gate_bias: Float[Array, " out"]
    shift_weight: Float[Array, " out"]
    gate_context: Float[Array, "out context"] | None
    shift_context: Float[Array, "out context"] | None

    def __init__(
        self,
        in_size: int,
        out_size: int,
        *,
        context_dim: int = 0,
        key: Key,
        dtype=None,
    ):
        k1, k2, k3, k4 = jr.split(key, 4)
        dtype = jnp.result_type(float) if dtype is None else dtype
        self.linear = eqx.nn.Linear(in_size, out_size, key=k1, dtype=dtype)
        # The hyper-networks take the scalar t (fan-in 1): U(-1, 1), as torch does.
        self.gate_weight = jr.uniform(k2, (out_size,), dtype, -1.0, 1.0)
        self.gate_bias = jr.uniform(k3, (out_size,), dtype, -1.0, 1.0)
        self.shift_weight = jr.uniform(k4, (out_size,), dtype, -1.0, 1.0)
        if context_dim:
            # Fan-in 1 + context_dim, as a torch Linear over (t, context) would have.
            bound = 1.0 / (1.0 + context_dim) ** 0.5
            shape = (out_size, context_dim)
            k5, k6 = jr.split(jr.fold_in(key, 1), 2)
            self.gate_context = jr.uniform(k5, shape, dtype, -bound, bound)
            self.shift_context = jr.uniform(k6, shape, dtype, -bound, bound)
        else:
            self.gate_context = self.shift_context = None

    def __call__(
        self, t, x: Float[Array, " in"], context: Float[Array, " context"] | None = None
    ) -> Float[Array, " out"]:
        t = jnp.asarray(t, x.dtype)
        gate = self.gate_weight * t + self.gate_bias
        shift = self.shift_weight * t
        if self.gate_context is not None:
            gate = gate + self.gate_context @ context
            shift = shift + self.shift_context @ context
        # `self.linear(x)`, not `_linear`: FFJORD's layer trains faster this way with
        # one probe.
        return self.linear(x) * jax.nn.sigmoid(gate) + shift


class ConcatSquashMLP(eqx.Module):
    """FFJORD's vector field: ConcatSquash layers `dim -> width x depth -> dim` with an
    activation between layers. Callable as a diffrax vector field `f(t, y, args)` on one
    sample `y` of shape `(dim,)`.

    **Arguments:**

    - `dim`: the data dimension.
    - `width`, `depth`: hidden width and number of hidden layers.
    - `activation`: a smooth activation between layers; `jax.nn.tanh` by default.
    - `zero_last`: start at zero output (the identity flow).
    - `context_dim`: for a conditional flow, the context's size, taken as `args`
        and fed to every gate and shift; the same as the [`CNF`][cnftrace.CNF]'s.
    - `key`: PRNG key for the initialisation.
    - `dtype`: parameter dtype (JAX's default float if omitted).

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=64, depth=3, key=jr.key(0))
        field(0.0, jnp.ones(2)).shape  # (2,): f(t, y, args) on one sample
        flow = cnftrace.CNF(field, dim=2, t1=0.5)
        ```
    """

    layers: tuple[ConcatSquashLinear, ...]
    activation: Callable[[Array], Array]
    context_dim: int = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        width: int = CONCATSQUASH_WIDTH,
        depth: int = DEPTH,
        activation: Callable[[Array], Array] = jax.nn.tanh,
        *,
        zero_last: bool = False,
        context_dim: int = 0,
        key: Key,
        dtype=None,
    ):
        dim, width, depth, context_dim = (
            check_int(name, value, low)
            for name, value, low in (
                ("dim", dim, 1),
                ("width", width, 1),
                ("depth", depth, 0),
                ("context_dim", context_dim, 0),
            )
        )
        sizes = [dim] + [width] * depth + [dim]
        keys = jr.split(key, len(sizes) - 1)
        layers = [
            ConcatSquashLinear(i, o, context_dim=context_dim, key=k, dtype=dtype)
            for i, o, k in zip(sizes[:-1], sizes[1:], keys)
        ]
        if zero_last:
            layers[-1] = eqx.tree_at(
                lambda m: (m.linear.weight, m.linear.bias, m.shift_weight),
                layers[-1],
                replace_fn=jnp.zeros_like,
            )
        self.layers = tuple(layers)
        self.activation = activation
        self.context_dim = context_dim

    def __call__(self, t, y: Float[Array, " dim"], args=None) -> Float[Array, " dim"]:
        context = None
        if self.context_dim:
            context = args
            if context is None or jnp.shape(context) != (self.context_dim,):
                got = None if context is None else jnp.shape(context)
                raise ValueError(
                    f"this field is conditional (context_dim={self.context_dim}) and "
                    f"takes one context vector of shape ({self.context_dim},) as its "
                    f"`args`; got {got}. Use it in a `CNF(..., context_dim="
                    f"{self.context_dim})`."
                )
        h = y
        for layer in self.layers[:-1]:
            h = self.activation(layer(t, h, context))
        return self.layers[-1](t, h, context)


class MLPField(eqx.Module):
    """A plain MLP vector field fed the state, sinusoidal features of time and the
    context: `f(t, y) = MLP([y, cos(k pi t), sin(k pi t) for k = 1..freqs, context])`.

    cnftrace's default vector field (compared with
    [`ConcatSquashMLP`][cnftrace.ConcatSquashMLP] on the docs' quality page).
    Callable as a diffrax vector field `f(t, y, args)` on one sample `y`.

    **Arguments:**

    - `dim`: the data dimension.
    - `width`: hidden width; by default it follows `dim`
        ([`default_recipe`][cnftrace.default_recipe]).
    - `depth`: number of hidden layers.
    - `activation`: a smooth activation after every hidden layer; SiLU by default.
    - `freqs`: the number of time frequencies (0: an autonomous field).
    - `context_dim`: for a conditional flow, the context's size, taken as `args`
        and read as extra inputs; the same as the [`CNF`][cnftrace.CNF]'s.
    - `zero_last`: start at zero output (the identity flow).
    - `key`: PRNG key for the initialisation.
    - `dtype`: parameter dtype (JAX's default float if omitted).

    !!! example

        ```python
        field = cnftrace.MLPField(2, key=jr.key(0))
        field(0.0, jnp.ones(2)).shape  # (2,): f(t, y, args) on one sample
        flow = cnftrace.CNF(field, dim=2)
        ```
    """

    mlp: eqx.nn.MLP
    dim: int = eqx.field(static=True)
    freqs: int = eqx.field(static=True)
    context_dim: int = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        width: int | None = None,
        depth: int = DEPTH,
        activation: Callable[[Array], Array] = jax.nn.silu,
        *,
        freqs: int = FREQS,
        context_dim: int = 0,
        zero_last: bool = False,
        key: Key,
        dtype=None,
    ):
        dim, depth, freqs, context_dim = (
            check_int(name, value, low)
            for name, value, low in (
                ("dim", dim, 1),
                ("depth", depth, 0),
                ("freqs", freqs, 0),
                ("context_dim", context_dim, 0),
            )
        )
        width = default_width(dim) if width is None else check_int("width", width)
        check_activation(activation)
        dtype = jnp.result_type(float) if dtype is None else dtype
        mlp = eqx.nn.MLP(
            dim + 2 * freqs + context_dim,
            dim,
            width,
            depth,
            activation=activation,
            key=key,
            dtype=dtype,
        )
        if zero_last:
            mlp = eqx.tree_at(
                lambda m: (m.layers[-1].weight, m.layers[-1].bias),
                mlp,
                replace_fn=jnp.zeros_like,
            )
        self.mlp = mlp
        self.dim = dim
        self.freqs = freqs
        self.context_dim = context_dim

    def __call__(self, t, y: Float[Array, " dim"], args=None) -> Float[Array, " dim"]:
        if jnp.shape(y) != (self.dim,):
            raise ValueError(
                f"`y` must be one sample of shape ({self.dim},); got {jnp.shape(y)}. "
                "A flow calls its field once per sample."
            )
        inputs = [y]
        if self.freqs:
            k = jnp.arange(1, self.freqs + 1, dtype=y.dtype) * jnp.pi
            angle = k * jnp.asarray(t, y.dtype)
            inputs += [jnp.cos(angle), jnp.sin(angle)]
        if self.context_dim:
            if args is None or jnp.shape(args) != (self.context_dim,):
                got = None if args is None else jnp.shape(args)
                raise ValueError(
                    f"this field is conditional (context_dim={self.context_dim}) and "
                    f"takes one context vector of shape ({self.context_dim},) as its "
                    f"`args`; got {got}. Use it in a `CNF(..., context_dim="
                    f"{self.context_dim})`."
                )
            inputs.append(jnp.asarray(args, y.dtype))
        return _mlp(self.mlp, jnp.concatenate(inputs))
