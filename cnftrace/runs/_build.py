"""How a run's settings become a flow, an optimiser, an objective and the data's
standardisation: the command line and `cnftrace.load` build them the same way."""

import jax.random as jr

from ..datasets import Standardization
from ..estimators import AbstractEstimator, Exact, Hutchinson
from ..flows import AbstractBase, AbstractFlow, mlp_flow
from ..flows._base_fit import base_template
from ..objectives import AbstractObjective, FlowMatching, MaximumLikelihood
from ..training import budget_cosine_adam, warmup_cosine_adam
from ._config import RunConfig

# The settings `mlp_flow` takes as they are.
_FLOW_SETTINGS = ("field", "blocks", "width", "depth", "activation", "t1")
_FLOW_SETTINGS += ("learn_t1", "solver", "rtol", "atol")


def run_flow(
    config: RunConfig, key, dim: int, dtype=None, base: AbstractBase | None = None
) -> AbstractFlow:
    """The flow described by a run's config, for data of dimension `dim`, with
    parameters of `dtype` (JAX's default float if `None`), over `base` (fitted to
    the training rows), or where it is `None` over a base of the config's kind with
    placeholder values (for a checkpoint's to be loaded into)."""
    if base is None and config.base not in (None, "normal"):
        base = base_template(config.base, dim, config.base_components, dtype=dtype)
    if config.blocks == 1:
        # The command line has always drawn a single block's key by a split.
        key = jr.split(key, 1)[0]
    settings = {name: getattr(config, name) for name in _FLOW_SETTINGS}
    zero_last = bool(config.zero_last)
    return mlp_flow(
        dim, key=key, dtype=dtype, zero_last=zero_last, base=base, **settings
    )


def run_standardization(config: RunConfig) -> Standardization | None:
    """The standardisation a run on a data file trained under, or `None`."""
    return None if config.data_file is None else config.data_file.standardization


def run_optimizer(config: RunConfig):
    """The schedule over the run's `minutes` where it has them, else over its
    `steps`."""
    settings = dict(clip=config.clip, weight_decay=config.weight_decay)
    if config.minutes is not None:
        return budget_cosine_adam(config.lr, **settings)
    return warmup_cosine_adam(config.steps, config.lr, **settings)


def run_estimator(config: RunConfig) -> AbstractEstimator:
    if config.estimator == "exact":
        return Exact()
    return Hutchinson(config.num_probes, config.estimator)


def run_objective(config: RunConfig) -> AbstractObjective:
    """`fit`'s `objective` for a run's config."""
    if config.objective == "mle":
        return MaximumLikelihood(
            run_estimator(config),
            config.kinetic_energy,
            config.jacobian_norm,
            tolerance=config.train_tol,
        )
    coupling = "ot" if config.objective == "ot-fm" else "independent"
    return FlowMatching(sigma=config.fm_sigma, coupling=coupling)
