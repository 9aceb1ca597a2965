"""Training objectives: what one training step minimises."""

import abc
from typing import Any

import equinox as eqx
from jaxtyping import Array, Float

from .._custom_types import Key
from ..flows import AbstractFlow

Metrics = dict[str, Any]


class AbstractObjective(eqx.Module):
    """A training objective for [`fit`][cnftrace.fit] and
    [`Trainer`][cnftrace.Trainer]: [`MaximumLikelihood`][cnftrace.MaximumLikelihood],
    [`FlowMatching`][cnftrace.FlowMatching], or your own.

    Subclasses implement [`loss`][cnftrace.AbstractObjective.loss]; they may
    override [`check`][cnftrace.AbstractObjective.check] (what flows they can train)
    and [`config`][cnftrace.AbstractObjective.config] (what checkpoints record).

    !!! example

        ```python
        class MeanSquaredBase(cnftrace.AbstractObjective):
            # A toy objective: pull the data's images towards the origin.
            def loss(self, flow, x, context, key, counter=None):
                z, _, stats, _ = flow.transform(
                    x, inverse=False, log_det=False, key=None, context=context
                )
                loss = jnp.mean(z**2)
                return loss, {"stats": stats}

        field = cnftrace.ConcatSquashMLP(2, width=8, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-3, atol=1e-3)
        data = lambda key, n: jr.normal(key, (n, 2))
        flow, history = cnftrace.fit(
            flow, data, key=jr.key(1), steps=3, batch_size=16,
            objective=MeanSquaredBase(), progress=False,
        )
        ```
    """

    @abc.abstractmethod
    def loss(
        self,
        flow: AbstractFlow,
        x: Float[Array, "batch ..."],
        context: Float[Array, "batch context"] | None,
        key: Key,
        counter: Float[Array, ""] | None = None,
    ) -> tuple[Float[Array, ""], Metrics]:
        """The loss of `flow` on the batch `x` (inside the jitted training step).

        **Arguments:**

        - `flow`: the flow being trained.
        - `x`: a batch of data, shape `(batch, *event_shape)`.
        - `context`: one context row per sample for a conditional flow, else `None`.
        - `key`: this step's PRNG key (for probes, partners, times...).
        - `counter`: `None`, or a float zero whose gradient the step reads as the
            number of backward evaluations of the vector fields: pass it on to the
            flow's solves (`flow.transform(..., counter=counter)`).

        **Returns:**

        `(loss, metrics)`: the scalar to minimise, and a dict of scalars for the
        history. Some keys have a meaning: `"loss"`, the value the history records
        as the loss (by default the loss itself); `"stats"`, the
        [`SolveStats`][cnftrace.SolveStats] of the solves behind the loss, from
        which the step reads the forward NFE and the solver's result (a failed
        solve stops training); `"nfe"` and `"nfe_backward"`, the evaluation counts
        of an objective without solves. Every other key becomes a history column.
        """

    @property
    def needs_data(self) -> bool:
        """Whether training needs data. True by default; an objective that draws
        its own samples (such as [`ReverseKL`][cnftrace.ReverseKL]) says False, and
        then [`fit`][cnftrace.fit] and [`Trainer`][cnftrace.Trainer] take no data
        and hand its `loss` a placeholder batch of shape `(batch_size, 0)` in JAX's
        default float: its length is the batch size, its dtype the samples'."""
        return True

    def check(self, flow: AbstractFlow) -> None:
        """Raises a clear error if this objective cannot train `flow`; called once
        before training. Every flow is fine by default."""
        del flow

    def config(self) -> dict[str, Any]:
        """The entries this objective adds to a checkpoint's config (JSON values),
        so that a run is not resumed under another objective."""
        return {"fit.objective": repr(self)}
