"""Conv-net vector fields for images: FFJORD's time-concatenated convolution and the
field it stacks."""

from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from .._checks import check_activation, check_int
from .._custom_types import Key


class ConcatConv2d(eqx.Module):
    """FFJORD's `ConcatConv2d`: a size-keeping convolution of one sample `x`
    `(channels, h, w)` with the time as an extra input channel; `layer(t, x)`.

    **Arguments:**

    - `in_channels`, `out_channels`: the channels of the input and the output.
    - `kernel_size`: an odd kernel size (3 by default).
    - `key`, `dtype`: PRNG key for the initialisation, parameter dtype.

    !!! example

        ```python
        layer = cnftrace.ConcatConv2d(1, 8, key=jr.key(0))
        layer(0.5, jnp.zeros((1, 8, 8))).shape  # (8, 8, 8)
        ```
    """

    conv: eqx.nn.Conv2d

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        *,
        kernel_size: int = 3,
        key: Key,
        dtype=None,
    ):
        dtype = jnp.result_type(float) if dtype is None else dtype
        self.conv = eqx.nn.Conv2d(
            in_channels + 1,
            out_channels,
            kernel_size,
            padding=kernel_size // 2,
            key=key,
            dtype=dtype,
        )

    def __call__(self, t, x: Float[Array, "c h w"]) -> Float[Array, "out h w"]:
        time = jnp.full((1,) + x.shape[1:], t, x.dtype)
        return self.conv(jnp.concatenate([time, x], axis=0))


class ConvField(eqx.Module):
    """FFJORD's conv vector field: [`ConcatConv2d`][cnftrace.ConcatConv2d] layers
    `channels -> *hidden -> channels`, called as `f(t, y, args)` on one image `y`
    `(channels, h, w)` of any size.

    **Arguments:**

    - `channels`: the channels of the image (input and output).
    - `hidden`: the hidden channels, one conv layer each.
    - `activation`: a smooth activation between layers; softplus by default.
    - `zero_last`: start at zero output (the identity flow).
    - `key`: PRNG key for the initialisation.
    - `dtype`: parameter dtype (JAX's default float if omitted).

    !!! example

        ```python
        field = cnftrace.ConvField(1, hidden=(8,), key=jr.key(0))
        flow = cnftrace.CNF(field, dim=(1, 8, 8), rtol=1e-3, atol=1e-3)
        logp = flow.log_prob(jnp.zeros((2, 1, 8, 8)))
        ```
    """

    layers: tuple[ConcatConv2d, ...]
    activation: Callable[[Array], Array]
    channels: int = eqx.field(static=True)

    def __init__(
        self,
        channels: int,
        hidden: Sequence[int] = (64, 64, 64),
        activation: Callable[[Array], Array] = jax.nn.softplus,
        *,
        zero_last: bool = False,
        key: Key,
        dtype=None,
    ):
        channels = check_int("channels", channels, 1)
        if isinstance(hidden, int) or not isinstance(hidden, Sequence):
            raise TypeError(
                "`hidden` must be a sequence of channel counts, one per hidden layer, "
                f"e.g. (64, 64, 64); got {hidden!r}."
            )
        hidden = [check_int(f"hidden[{i}]", h, 1) for i, h in enumerate(hidden)]
        check_activation(activation)
        sizes = [channels, *hidden, channels]
        keys = jr.split(key, len(sizes) - 1)
        layers = [
            ConcatConv2d(i, o, key=k, dtype=dtype)
            for i, o, k in zip(sizes[:-1], sizes[1:], keys)
        ]
        if zero_last:
            layers[-1] = eqx.tree_at(
                lambda m: (m.conv.weight, m.conv.bias),
                layers[-1],
                replace_fn=jnp.zeros_like,
            )
        self.layers = tuple(layers)
        self.activation = activation
        self.channels = channels

    def __call__(self, t, y: Float[Array, "c h w"], args=None) -> Float[Array, "c h w"]:
        del args
        if y.ndim != 3 or y.shape[0] != self.channels:
            raise ValueError(
                f"this field takes one image of shape ({self.channels}, h, w); got "
                f"shape {y.shape}."
            )
        t = jnp.asarray(t, y.dtype)
        h = y
        for layer in self.layers[:-1]:
            h = self.activation(layer(t, h))
        return self.layers[-1](t, h)
