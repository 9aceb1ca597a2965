"""Maximum likelihood through the ODE solve, with RNODE's regularisation."""

from typing import Any

import jax.numpy as jnp

from .._checks import check_positive, check_weight
from .._defaults import TRAIN_TOLERANCE
from ..estimators import AbstractEstimator, Hutchinson
from ..estimators._base import check_estimator
from ._base import AbstractObjective


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
        own). The default, looser than a flow's own, trains as well per step at
        fewer evaluations (see the docs' quality page); the trained flow keeps its
        own, tighter tolerances for `log_prob`, validation and sampling.

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
        tolerance: float | None = TRAIN_TOLERANCE,
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
        out = model.batch_log_prob(
            x, key, counter, context=context, regularize=self.regularized
        )
        nll, stats = -jnp.mean(out[0]), out[-1]
        if not self.regularized:
            return nll, {"loss": nll, "stats": stats}
        kinetic, jacobian = jnp.mean(out[1].kinetic), jnp.mean(out[1].jacobian)
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
