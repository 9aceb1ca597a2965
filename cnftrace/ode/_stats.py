"""The statistics of a flow's ODE solves: steps, evaluations of the vector field,
and how each solve ended."""

from collections.abc import Sequence

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


class SolveStats(eqx.Module):
    """Solver statistics of the ODE solves behind one call, one entry per block.

    - `num_steps`: steps attempted (accepted and rejected).
    - `num_accepted`, `num_rejected`: their split.
    - `nfe`: evaluations of the vector field (for the whole batch at once), counted
        exactly for explicit Runge--Kutta solvers from the steps and the solver's
        stages, with the initial step's plain evaluations (with `BacksolveAdjoint`,
        rejections of the very first step are not counted); `-1` for solvers whose
        cost per step is not known.
    - `result`: how each solve ended, a `diffrax.RESULTS` (`successful`, or
        `max_steps_reached` when the solver hit the block's `max_steps`, ...).

    Each field has shape `(blocks,)`, in the order data passes the blocks. Every
    flow method returns one with `return_stats=True`.

    A failed solve travels as `result`: the public methods (`log_prob`, `sample`,
    ...) raise diffrax's message for it, and [`fit`][cnftrace.fit] stops with a
    [`TrainingError`][cnftrace.TrainingError] naming the step.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.Chain([cnftrace.CNF(field, 2), cnftrace.CNF(field, 2)])
        logp, stats = flow.log_prob(jnp.zeros((8, 2)), return_stats=True)
        print(stats.nfe, stats.total_nfe)  # per block, and all together
        print(stats.max_steps_reached)  # [False False]
        ```
    """

    num_steps: Int[Array, " blocks"]
    num_accepted: Int[Array, " blocks"]
    num_rejected: Int[Array, " blocks"]
    nfe: Int[Array, " blocks"]
    result: diffrax.RESULTS

    @property
    def total_nfe(self) -> Int[Array, ""]:
        """The evaluations of all blocks together."""
        return jnp.sum(self.nfe)

    @property
    def failed(self) -> Bool[Array, " blocks"]:
        """Whether each block's solve failed (any result but `successful`)."""
        return self.result != diffrax.RESULTS.successful

    @property
    def max_steps_reached(self) -> Bool[Array, " blocks"]:
        """Whether each block's solve stopped at its `max_steps`."""
        return self.result == diffrax.RESULTS.max_steps_reached

    def first_failure(self) -> diffrax.RESULTS:
        """The result of the first block whose solve failed, in the order data
        passes the blocks; `diffrax.RESULTS.successful` if none did."""
        out = diffrax.RESULTS.successful
        for i in reversed(range(self.nfe.shape[0])):
            block = jax.tree_util.tree_map(lambda v, i=i: v[i], self.result)
            out = diffrax.RESULTS.where(block != diffrax.RESULTS.successful, block, out)
        return out

    @staticmethod
    def concatenate(stats: Sequence["SolveStats"]) -> "SolveStats":
        """The statistics of several flows' solves, one after the other: the blocks
        of `stats[0]`, then those of `stats[1]`, ..."""
        return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *stats)


def evals_per_step(solver: diffrax.AbstractSolver) -> tuple[int, int] | None:
    """`(evaluations per step, evaluations at initialisation)`, where known."""
    if isinstance(solver, diffrax.AbstractERK):
        stages = len(solver.tableau.c) + 1
        if solver.tableau.fsal:
            return stages - 1, 1
        return stages, 0
    if isinstance(solver, diffrax.Euler):
        return 1, 0
    return None
