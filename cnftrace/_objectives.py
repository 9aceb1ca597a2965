"""Training objectives: what one training step minimises.

An objective is a small Module with one method, `loss(flow, x, context, key,
counter)`, returning the scalar to minimise and a dict of metrics for the history.
[`Trainer`][cnftrace.Trainer] and [`fit`][cnftrace.fit] take any of them, so a new
objective needs no change to the training loop.
"""

import abc
from typing import Any

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._checks import check_positive, check_weight
from ._custom_types import Key
from ._estimators import AbstractEstimator, Hutchinson, check_estimator
from ._flow import AbstractFlow

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

    def check(self, flow: AbstractFlow) -> None:
        """Raises a clear error if this objective cannot train `flow`; called once
        before training. Every flow is fine by default."""
        del flow

    def config(self) -> dict[str, Any]:
        """The entries this objective adds to a checkpoint's config (JSON values),
        so that a run is not resumed under another objective."""
        return {"fit.objective": repr(self)}


class MaximumLikelihood(AbstractObjective):
    """Maximum likelihood through the ODE solve, optionally with RNODE's
    regularisation (Finlay et al. 2020): the loss is

        NLL + kinetic_weight * E[int |f|^2 dt] + jacobian_weight * E[int |df/dz|_F^2 dt]

    on each batch, both integrals taken in the same solve as the log-density (the
    Frobenius norm from the estimator's own probes and Jacobian-vector products, so
    at no extra evaluations). Smoother dynamics need fewer solver steps; see the
    docs' regularisation page. [`fit`][cnftrace.fit]'s `objective="mle"` is
    `MaximumLikelihood()`.

    **Arguments:**

    - `estimator`: the trace estimator in training, one Rademacher
        [`Hutchinson`][cnftrace.Hutchinson] probe by default. The trained flow keeps
        its own estimator (for evaluation).
    - `kinetic_weight`, `jacobian_weight`: RNODE's weights, finite and `>= 0`.
    - `tolerance`: the solver's `rtol` and `atol` in training (`None`: each block's
        own). The default 1e-3 trains as well per step as 1e-5 at half its
        evaluations (see the docs' quality page): the loss only has to be good enough
        to follow downhill. The trained flow keeps its own, tighter tolerances for
        `log_prob`, validation and sampling.

    The history records the NLL as `loss` and, when regularised, the batch means of
    the integrals as `kinetic` and `jacobian`.

    !!! example

        ```python
        objective = cnftrace.MaximumLikelihood(
            cnftrace.Hutchinson(), kinetic_weight=0.1, jacobian_weight=0.1
        )
        # cnftrace.fit(flow, data, key=key, objective=objective)
        ```
    """

    estimator: AbstractEstimator
    kinetic_weight: float
    jacobian_weight: float
    tolerance: float | None

    def __init__(
        self,
        estimator: AbstractEstimator | None = None,
        kinetic_weight: float = 0.0,
        jacobian_weight: float = 0.0,
        tolerance: float | None = 1e-3,
    ):
        estimator = Hutchinson() if estimator is None else estimator
        check_estimator(estimator)
        check_weight("kinetic_weight", kinetic_weight)
        check_weight("jacobian_weight", jacobian_weight)
        if tolerance is not None:
            check_positive("tolerance", tolerance)
        self.estimator = estimator
        self.kinetic_weight = float(kinetic_weight)
        self.jacobian_weight = float(jacobian_weight)
        self.tolerance = None if tolerance is None else float(tolerance)

    @property
    def regularized(self) -> bool:
        """Whether either RNODE weight is positive."""
        return self.kinetic_weight > 0 or self.jacobian_weight > 0

    def loss(self, flow, x, context, key, counter=None):
        model = flow.with_estimator(self.estimator)
        if self.tolerance is not None:
            model = model.with_tolerance(self.tolerance, self.tolerance)
        if not self.regularized:
            logp, stats = model._batch_log_prob(x, key, counter, context=context)
            nll = -jnp.mean(logp)
            return nll, {"loss": nll, "stats": stats}
        logp, reg, stats = model._batch_log_prob(
            x, key, counter, context=context, regularize=True
        )
        nll = -jnp.mean(logp)
        kinetic, jacobian = jnp.mean(reg.kinetic), jnp.mean(reg.jacobian)
        loss = nll + self.kinetic_weight * kinetic + self.jacobian_weight * jacobian
        metrics = {"loss": nll, "stats": stats, "kinetic": kinetic}
        return loss, metrics | {"jacobian": jacobian}

    def config(self):
        out: dict[str, Any] = {"fit.estimator": repr(self.estimator)}
        if self.tolerance is not None:
            out["fit.tolerance"] = self.tolerance
        if self.regularized:
            out["fit.kinetic_weight"] = self.kinetic_weight
            out["fit.jacobian_weight"] = self.jacobian_weight
        return out
