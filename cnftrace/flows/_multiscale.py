"""FFJORD's multiscale image model ("ODENVP"). The latent is the factored-out
parts and the last scale's output, concatenated and reshaped to the data's shape."""

from collections.abc import Callable, Sequence

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from .._checks import check_int, is_int
from .._custom_types import Key
from .._defaults import ATOL, MAX_STEPS, MULTISCALE_T1, RTOL
from ..estimators import AbstractEstimator
from ..nets import ConvField
from ..ode import SolveStats
from ._base import AbstractFlow
from ._chain import Chain
from ._cnf import CNF
from ._distributions import AbstractBase, check_base


def squeeze(x: Float[Array, "*batch c h w"]) -> Float[Array, "*batch 4c h/2 w/2"]:
    """Space to depth by 2 of an image `x` `(c, h, w)` (or a batch), `h` and `w`
    even: channel `4c + 2i + j` of the output, shape `(*batch, 4c, h/2, w/2)`,
    holds pixel `(2y + i, 2x + j)` of channel `c`. A permutation (log-determinant
    0); [`unsqueeze`][cnftrace.unsqueeze] is its inverse.

    !!! example

        ```python
        x = jnp.arange(16.0).reshape(1, 4, 4)
        y = cnftrace.squeeze(x)                 # shape (4, 2, 2)
        assert (cnftrace.unsqueeze(y) == x).all()
        ```
    """
    *batch, c, h, w = x.shape
    if h % 2 or w % 2:
        raise ValueError(
            f"`squeeze` needs an even height and width; got an image of shape "
            f"{(c, h, w)}."
        )
    x = x.reshape(*batch, c, h // 2, 2, w // 2, 2)
    n = len(batch)
    x = jnp.moveaxis(x, (n + 2, n + 4), (n + 1, n + 2))
    return x.reshape(*batch, 4 * c, h // 2, w // 2)


def unsqueeze(x: Float[Array, "*batch c4 h w"]) -> Float[Array, "*batch c 2h 2w"]:
    """Depth to space by 2, the inverse of [`squeeze`][cnftrace.squeeze]: an image
    `(c4, h, w)` (or a batch), `c4` a multiple of 4, to `(*batch, c4/4, 2h, 2w)`.

    !!! example

        ```python
        cnftrace.unsqueeze(jnp.zeros((8, 2, 2))).shape  # (2, 4, 4)
        ```
    """
    *batch, c4, h, w = x.shape
    if c4 % 4:
        raise ValueError(
            f"`unsqueeze` needs a multiple of 4 channels; got shape {(c4, h, w)}."
        )
    x = x.reshape(*batch, c4 // 4, 2, 2, h, w)
    n = len(batch)
    x = jnp.moveaxis(x, (n + 1, n + 2), (n + 2, n + 4))
    return x.reshape(*batch, c4 // 4, 2 * h, 2 * w)


def default_n_scales(shape: tuple[int, int, int]) -> int:
    """FFJORD's number of scales for an image shape `(C, H, W)`, as
    [`MultiscaleFlow`][cnftrace.MultiscaleFlow] uses for `n_scales=None`: one more
    for every halving of an even height and width that leaves both at least 4.

    !!! example

        ```python
        assert cnftrace.default_n_scales((1, 28, 28)) == 3
        ```
    """
    _, h, w = shape
    n = 1
    while h % 2 == 0 and w % 2 == 0 and h // 2 >= 4 and w // 2 >= 4:
        n, h, w = n + 1, h // 2, w // 2
    return n


class MultiscaleFlow(AbstractFlow):
    """FFJORD's multiscale CNF for images (`ODENVP`): stacks of conv CNF blocks per
    scale, squeezes, and half the channels factored out at every scale but the last.

    The latent has the data's shape. Data is usually dequantised and
    logit-transformed first (`cnftrace.datasets.logit_transform`).

    **Arguments:**

    - `shape`: the image shape `(C, H, W)`; `H` and `W` divisible by
        `2 ** (n_scales - 1)`.
    - `n_scales`: the number of scales; `None` (default) picks FFJORD's number,
        [`default_n_scales`][cnftrace.default_n_scales].
    - `blocks_per_scale`: CNF blocks in each stack.
    - `hidden`: the hidden channels of each block's [`ConvField`][cnftrace.ConvField].
    - `activation`: the fields' activation, softplus by default.
    - `zero_last`: start every field at zero output (the identity flow).
    - `t1`, `learn_t1`: each block's end time, and whether it is trained.
    - `solver`, `rtol`, `atol`, `adjoint`, `estimator`, `max_steps`: each block's
        solver settings, as for [`CNF`][cnftrace.CNF].
    - `base`: the base distribution over the latent of shape `shape`
        ([`StandardNormal`][cnftrace.StandardNormal] if omitted).
    - `key`: PRNG key for the initialisation.
    - `dtype`: parameter dtype (JAX's default float if omitted).

    !!! example

        ```python
        flow = cnftrace.MultiscaleFlow(
            (1, 8, 8), blocks_per_scale=1, hidden=(8,), rtol=1e-3, atol=1e-3,
            key=jr.key(0),
        )
        logp = flow.log_prob(jnp.zeros((2, 1, 8, 8)))  # shape (2,)
        print(len(flow.blocks))  # 3: scale 0, its squeezed stack, scale 1
        ```
    """

    scales: tuple[Chain, ...]
    squeezed: tuple[Chain, ...]
    shape: tuple[int, int, int] = eqx.field(static=True)
    base: AbstractBase

    def __init__(
        self,
        shape: tuple[int, int, int],
        *,
        n_scales: int | None = None,
        blocks_per_scale: int = 2,
        hidden: Sequence[int] = (64, 64, 64),
        activation: Callable[[Array], Array] = jax.nn.softplus,
        zero_last: bool = False,
        t1: float = MULTISCALE_T1,
        learn_t1: bool = False,
        solver: diffrax.AbstractSolver | None = None,
        rtol: float = RTOL,
        atol: float = ATOL,
        adjoint: diffrax.AbstractAdjoint | None = None,
        estimator: AbstractEstimator | None = None,
        max_steps: int = MAX_STEPS,
        base: AbstractBase | None = None,
        key: Key,
        dtype=None,
    ):
        if not (
            isinstance(shape, (tuple, list))
            and len(shape) == 3
            and all(is_int(s) for s in shape)
            and all(s >= 1 for s in shape)
        ):
            raise ValueError(
                "`shape` must be the image shape (channels, height, width) as three "
                f"positive ints, e.g. (1, 28, 28); got {shape!r}."
            )
        shape = tuple(shape)
        if n_scales is None:
            n_scales = default_n_scales(shape)
        n_scales = check_int("n_scales", n_scales, 1)
        blocks_per_scale = check_int("blocks_per_scale", blocks_per_scale, 1)
        c, h, w = shape
        factor = 2 ** (n_scales - 1)
        if h % factor or w % factor:
            raise ValueError(
                f"`n_scales={n_scales}` squeezes the image {n_scales - 1} time(s), so "
                f"its height and width must be divisible by {factor}; got `shape` "
                f"{shape}. Use fewer scales (n_scales=None picks FFJORD's number) or "
                "pad the images."
            )
        cnf_kwargs = dict(
            t1=t1,
            learn_t1=learn_t1,
            solver=solver,
            rtol=rtol,
            atol=atol,
            adjoint=adjoint,
            estimator=estimator,
            max_steps=max_steps,
        )

        def stack(block_shape, key):
            fields = [
                ConvField(
                    block_shape[0],
                    hidden,
                    activation,
                    zero_last=zero_last,
                    key=k,
                    dtype=dtype,
                )
                for k in jr.split(key, blocks_per_scale)
            ]
            return Chain([CNF(f, block_shape, **cnf_kwargs) for f in fields])

        scale_keys = jr.split(key, 2 * n_scales - 1)
        scales, squeezed = [], []
        for i in range(n_scales):
            current = (c * 2**i, h // 2**i, w // 2**i)
            scales.append(stack(current, scale_keys[2 * i]))
            if i < n_scales - 1:
                after = (4 * current[0], current[1] // 2, current[2] // 2)
                squeezed.append(stack(after, scale_keys[2 * i + 1]))
        self.scales = tuple(scales)
        self.squeezed = tuple(squeezed)
        self.shape = shape
        self.base = check_base(base, shape)

    @property
    def event_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def n_scales(self) -> int:
        """The number of scales."""
        return len(self.scales)

    def chains(self) -> tuple[Chain, ...]:
        """The stacks of blocks in the order data passes them."""
        out = []
        for i, chain in enumerate(self.scales):
            out.append(chain)
            if i < len(self.squeezed):
                out.append(self.squeezed[i])
        return tuple(out)

    @property
    def blocks(self) -> tuple[CNF, ...]:
        """Every CNF block, in the order data passes them (the order of the
        [`SolveStats`][cnftrace.SolveStats] entries)."""
        return tuple(b for chain in self.chains() for b in chain.blocks)

    def with_estimator(self, estimator: AbstractEstimator) -> "MultiscaleFlow":
        return eqx.tree_at(
            lambda f: (f.scales, f.squeezed),
            self,
            (
                tuple(c.with_estimator(estimator) for c in self.scales),
                tuple(c.with_estimator(estimator) for c in self.squeezed),
            ),
        )

    def with_base(self, base: AbstractBase) -> "MultiscaleFlow":
        return eqx.tree_at(lambda f: f.base, self, check_base(base, self.shape))

    def _factored_shapes(self) -> list[tuple[int, int, int]]:
        """The shapes of the parts packed into the latent, in order."""
        c, h, w = self.shape
        parts = []
        for i in range(self.n_scales - 1):
            parts.append((2 * c * 2**i, h // 2 ** (i + 1), w // 2 ** (i + 1)))
        last = self.n_scales - 1
        parts.append((c * 2**last, h // 2**last, w // 2**last))
        return parts

    def transform(
        self,
        x,
        *,
        inverse,
        log_det,
        key,
        counter=None,
        context=None,
        regularize=False,
    ):
        if context is not None:
            raise ValueError(
                "`MultiscaleFlow` is not conditional and takes no `context`."
            )
        if regularize and not log_det:
            raise ValueError("`regularize=True` needs `log_det=True`.")
        chains = self.chains()
        keys = [None] * len(chains) if key is None else list(jr.split(key, len(chains)))
        total = jnp.zeros(x.shape[:1], x.dtype) if log_det else None
        all_stats: list[SolveStats] = []
        reg = None

        def run(index, h):
            nonlocal total, reg
            h, ld, stats, chain_reg = chains[index].transform(
                h,
                inverse=inverse,
                log_det=log_det,
                key=keys[index],
                counter=counter,
                regularize=regularize,
            )
            if log_det:
                total = total + ld
            if regularize:
                reg = chain_reg if reg is None else reg + chain_reg
            all_stats.append(stats)
            return h

        n = x.shape[0]
        last = self.n_scales - 1
        if not inverse:
            parts = []
            h = x
            for i in range(self.n_scales):
                h = run(2 * i, h)
                if i < last:
                    h = run(2 * i + 1, squeeze(h))
                    half = h.shape[1] // 2
                    parts.append(h[:, half:])
                    h = h[:, :half]
            parts.append(h)
            flat = [p.reshape(n, -1) for p in parts]
            y = jnp.concatenate(flat, axis=1).reshape(x.shape)
        else:
            flat = x.reshape(n, -1)
            parts, start = [], 0
            for part_shape in self._factored_shapes():
                size = part_shape[0] * part_shape[1] * part_shape[2]
                parts.append(flat[:, start : start + size].reshape(n, *part_shape))
                start += size
            h = parts[-1]
            for i in reversed(range(self.n_scales)):
                if i < last:
                    h = jnp.concatenate([h, parts[i]], axis=1)
                    h = unsqueeze(run(2 * i + 1, h))
                h = run(2 * i, h)
            y = h
            all_stats = all_stats[::-1]  # report stats in block order
        return y, total, SolveStats.concatenate(all_stats), reg
