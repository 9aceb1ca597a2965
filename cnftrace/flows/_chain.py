"""Chains of flows, and `make_flow`, which builds a block or a chain of blocks."""

from collections.abc import Sequence

import jax.numpy as jnp
import jax.random as jr

from .._custom_types import VectorField
from ..ode import SolveStats
from ._base import AbstractFlow
from ._cnf import CNF
from ._distributions import AbstractBase, check_base


class Chain(AbstractFlow):
    """A chain of flows over one base distribution.

    Data passes through `flows[0]`, then `flows[1]`, ... towards the base;
    sampling runs them in reverse order. `log_prob` adds up their log-determinants.
    `blocks` lists every CNF block of the chain in data order, with chains of chains
    flattened. The chain's base is its last flow's: the bases of the other flows
    are not used.

    **Arguments:**

    - `flows`: a sequence of [`CNF`][cnftrace.CNF] blocks (or other flows, chains
        included) with the same `event_shape` (and the same `context_dim`, passed to
        every one).
    - `base`: the chain's base distribution; it replaces the last flow's (whose
        base is the chain's when omitted).

    !!! example

        ```python
        keys = jr.split(jr.key(0), 2)
        blocks = [
            cnftrace.CNF(cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=k), 2)
            for k in keys
        ]
        flow = cnftrace.Chain(blocks)
        logp = flow.log_prob(jnp.zeros((8, 2)))
        nested = cnftrace.Chain([flow, blocks[0]])
        print(len(nested.blocks))  # 3: chains are flattened
        ```
    """

    flows: tuple[AbstractFlow, ...]

    def __init__(
        self, flows: Sequence[AbstractFlow], *, base: AbstractBase | None = None
    ):
        flows = tuple(flows)
        if not flows:
            raise ValueError(
                "`flows` must hold at least one flow (CNF blocks, or chains of them)."
            )
        for i, b in enumerate(flows):
            if not isinstance(b, AbstractFlow):
                raise TypeError(
                    f"`flows[{i}]` must be a cnftrace flow (e.g. `cnftrace.CNF`); got "
                    f"{type(b).__name__}."
                )
        shapes = {b.event_shape for b in flows}
        if len(shapes) != 1:
            raise ValueError(
                f"all blocks must model samples of one shape; got shapes {shapes}."
            )
        contexts = {b.context_dim for b in flows}
        if len(contexts) != 1:
            raise ValueError(
                "all blocks must take the same context (the same `context_dim`, or "
                f"none); got context_dim values {contexts}."
            )
        if base is not None:
            flows = flows[:-1] + (flows[-1].with_base(base),)
        self.flows = flows

    @property
    def blocks(self) -> tuple["CNF", ...]:
        """Every CNF block of the chain, in data order (chains flattened)."""
        return tuple(b for f in self.flows for b in f.blocks)

    @property
    def base(self) -> AbstractBase:
        """The base distribution: the last flow's."""
        return self.flows[-1].base

    def with_base(self, base: AbstractBase) -> "Chain":
        base = check_base(base, self.event_shape)
        return Chain(self.flows[:-1] + (self.flows[-1].with_base(base),))

    @property
    def composes_blocks(self) -> bool:
        """Whether every flow of the chain composes its blocks."""
        return all(f.composes_blocks for f in self.flows)

    @property
    def event_shape(self):
        return self.flows[0].event_shape

    @property
    def context_dim(self):
        return self.flows[0].context_dim

    def with_estimator(self, estimator):
        return Chain([b.with_estimator(estimator) for b in self.flows])

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
        blocks = self.flows[::-1] if inverse else self.flows
        keys = [None] * len(blocks) if key is None else list(jr.split(key, len(blocks)))
        total = jnp.zeros(x.shape[:1], x.dtype) if log_det else None
        all_stats = []
        reg = None
        for block, k in zip(blocks, keys):
            x, ld, stats, block_reg = block.transform(
                x,
                inverse=inverse,
                log_det=log_det,
                key=k,
                counter=counter,
                context=context,
                regularize=regularize,
            )
            if log_det:
                total = total + ld
            if regularize:
                reg = block_reg if reg is None else reg + block_reg
            all_stats.append(stats)
        if inverse:
            all_stats = all_stats[::-1]  # report stats in block order
        return x, total, SolveStats.concatenate(all_stats), reg


def make_flow(
    vector_fields: Sequence[VectorField] | VectorField,
    dim: int | tuple[int, ...],
    **kwargs,
) -> AbstractFlow:
    """A [`CNF`][cnftrace.CNF] for one vector field, or a [`Chain`][cnftrace.Chain] of
    blocks sharing the keyword settings (`t1`, `solver`, `rtol`, ...) for several.

    **Arguments:**

    - `vector_fields`: one vector field `f(t, z, args)`, or a sequence of them (one
        block each, data passing the first one first).
    - `dim`: the size of one sample, or its shape.
    - `**kwargs`: [`CNF`][cnftrace.CNF]'s keyword arguments, given to every block.

    **Returns:**

    A [`CNF`][cnftrace.CNF] or a [`Chain`][cnftrace.Chain].

    !!! example

        ```python
        fields = [
            cnftrace.ConcatSquashMLP(2, width=16, key=k) for k in jr.split(jr.key(0), 2)
        ]
        flow = cnftrace.make_flow(fields, 2, t1=0.5, rtol=1e-4, atol=1e-4)
        ```
    """
    if callable(vector_fields) and not isinstance(vector_fields, (list, tuple)):
        return CNF(vector_fields, dim, **kwargs)
    return Chain([CNF(f, dim, **kwargs) for f in vector_fields])
