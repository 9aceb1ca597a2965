"""Training toward a density known only up to its normaliser: the reverse KL
divergence, estimated on samples drawn through the flow, optionally mixed with
maximum likelihood on samples that exist."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.nn import logsumexp

from .._checks import check_positive, check_weight
from .._defaults import REVERSE_KL_TOLERANCE
from ..estimators import AbstractEstimator, Hutchinson
from ..estimators._base import check_estimator
from ..ode import SolveStats
from ._base import AbstractObjective
from ._target import LogDensity, check_log_target, describe_target


def _frozen(tree):
    """`tree` with its floating arrays passed through `stop_gradient`."""
    return jax.tree_util.tree_map(
        lambda a: jax.lax.stop_gradient(a) if eqx.is_inexact_array(a) else a, tree
    )


class ReverseKL(AbstractObjective):
    """Trains a flow toward an unnormalised target log-density by minimising the
    reverse KL divergence `KL(q || p)`, from samples the flow draws itself: no data
    needed. [`fit`][cnftrace.fit]`(flow, target=log_target)` is
    `fit(flow, objective=ReverseKL(log_target))`.

    Each step draws `batch_size` base samples, maps them through the inverse flow
    with their log-density from the same solve, and minimises
    `mean(log q(x) - log_target(x))`, which is `KL(q || p) - log Z`: the history's
    `loss` falls towards `-log Z`. The reverse KL seeks modes: a missed mode is not
    pushed towards ([`importance_weights`][cnftrace.importance_weights] measures what
    the flow covers); a `forward_weight` adds maximum likelihood on samples of the
    target, which covers every mode they visit.

    **Arguments:**

    - `log_target`: the unnormalised log-density, a differentiable JAX function
        from a batch `(n, *event_shape)` to `(n,)`, checked on abstract values
        before training starts.
    - `estimator`: the trace estimator in the training loss, one Rademacher
        [`Hutchinson`][cnftrace.Hutchinson] probe by default (unbiased for the
        loss and its gradient); [`Exact`][cnftrace.Exact] removes the probes'
        variance at `d` products per evaluation.
    - `stick_the_landing`: the "sticking the landing" gradient (Roeder et al.
        2017; Vaitl et al. 2022): `log q` with the flow's parameters held constant,
        so the gradient vanishes sample by sample where `q = p`. It costs a second
        solve; the backward evaluations are then not counted (`nfe_backward` -1).
    - `forward_weight`: a weight `w >= 0` on maximum likelihood: the loss is then
        `mean(log q(x) - log_target(x)) + w * NLL(data batch)`, and
        [`fit`][cnftrace.fit] needs `data`. With `0` (the default), `fit` takes
        no data.
    - `tolerance`: the solver's `rtol` and `atol` in training (`None`: each
        block's own); 1e-3 by default, tighter than
        [`MaximumLikelihood`][cnftrace.MaximumLikelihood]'s, since the solve's
        samples and their log-densities are the loss itself.

    The history records `loss` (the reverse-KL term), `ess` (the batch's Kish
    effective sample size over its size, from the training estimator's `log q`),
    `target_nonfinite` (how many of the batch's `log_target` values were NaN or
    infinite: such a step's loss is not finite and the step is skipped) and, with a
    `forward_weight`, `nll`.

    !!! example

        ```python
        def log_target(x):  # N((1, -1), 0.5 I) times e^2, unnormalised
            return 2.0 - jnp.sum((x - jnp.array([[1.0, -1.0]])) ** 2, axis=1)

        objective = cnftrace.ReverseKL(log_target, estimator=cnftrace.Exact())
        print(objective.needs_data)  # False: fit takes no data
        # flow, history = cnftrace.fit(flow, key=key, objective=objective)
        # or, with the default settings: cnftrace.fit(flow, key=key, target=log_target)
        ```
    """

    log_target: LogDensity
    estimator: AbstractEstimator
    stick_the_landing: bool = eqx.field(static=True)
    forward_weight: float
    tolerance: float | None

    def __init__(
        self,
        log_target: LogDensity,
        *,
        estimator: AbstractEstimator | None = None,
        stick_the_landing: bool = False,
        forward_weight: float = 0.0,
        tolerance: float | None = REVERSE_KL_TOLERANCE,
    ):
        if not callable(log_target):
            raise TypeError(
                "`log_target` must be a function from a batch of samples (n, *event) "
                f"to their log-densities (n,); got {type(log_target).__name__}."
            )
        estimator = Hutchinson() if estimator is None else estimator
        check_estimator(estimator)
        if not isinstance(stick_the_landing, bool):
            raise TypeError(
                f"`stick_the_landing` must be a bool; got {stick_the_landing!r}."
            )
        check_weight("forward_weight", forward_weight)
        if tolerance is not None:
            check_positive("tolerance", tolerance)
        self.log_target = log_target
        self.estimator = estimator
        self.stick_the_landing = stick_the_landing
        self.forward_weight = float(forward_weight)
        self.tolerance = None if tolerance is None else float(tolerance)

    @property
    def needs_data(self) -> bool:
        """Whether `fit` must be given data: only with a `forward_weight`."""
        return self.forward_weight > 0

    def check(self, flow):
        if flow.context_dim is not None:
            raise ValueError(
                "`ReverseKL` trains a flow that is not conditional: its target is one "
                f"density, but this flow takes a context (context_dim="
                f"{flow.context_dim})."
            )
        check_log_target(
            self.log_target, flow.event_shape, gradient=True, name="log_target"
        )

    def loss(self, flow, x, context, key, counter=None):
        model = flow.with_estimator(self.estimator)
        if self.tolerance is not None:
            model = model.with_tolerance(self.tolerance, self.tolerance)
        n = x.shape[0]
        base_key, probe_key, data_key = jr.split(key, 3)
        z = model.base.sample(base_key, n, dtype=x.dtype)
        if self.stick_the_landing:
            samples, _, sample_stats, _ = model.transform(
                z, inverse=True, log_det=False, key=None
            )
            log_q, score_stats = _frozen(model).batch_log_prob(samples, probe_key)
            stats = SolveStats.concatenate([sample_stats, score_stats])
            count = None  # the sampling solve's backward evaluations are not counted
        else:
            samples, log_det, stats, _ = model.transform(
                z, inverse=True, log_det=True, key=probe_key, counter=counter
            )
            log_q = model.base.log_prob(z) - log_det
            count = counter
        log_p = self.log_target(samples)
        reverse = jnp.mean(log_q - log_p)
        log_w = jax.lax.stop_gradient(log_p - log_q)
        ess = jnp.exp(2 * logsumexp(log_w) - logsumexp(2 * log_w)) / n
        metrics: dict[str, Any] = {
            "loss": reverse,
            "ess": ess,
            "target_nonfinite": jnp.sum(~jnp.isfinite(log_p)),
        }
        if count is None:
            metrics["nfe_backward"] = jnp.asarray(-1)
        total = reverse
        if self.forward_weight > 0:
            logp_data, data_stats = model.batch_log_prob(x, data_key, count)
            nll = -jnp.mean(logp_data)
            total = total + self.forward_weight * nll
            stats = SolveStats.concatenate([stats, data_stats])
            metrics["nll"] = nll
        metrics["stats"] = stats
        return total, metrics

    def config(self):
        out: dict[str, Any] = {
            "fit.objective": "ReverseKL",
            "fit.target": describe_target(self.log_target),
            "fit.estimator": repr(self.estimator),
            "fit.stick_the_landing": self.stick_the_landing,
            "fit.forward_weight": self.forward_weight,
        }
        if self.tolerance is not None:
            out["fit.tolerance"] = self.tolerance
        return out
