"""cnftrace: continuous normalizing flows and ODE divergence estimators for JAX.

The public API lives here. The subpackages hold the layers, bottom to top: `estimators`
(trace estimators), `ode` (the diffrax term and the solve's parts), `nets` (vector
fields), `flows`, `objectives`, `store` (checkpoint files, history logs, locks),
`training`, `datasets`, `runs` (run directories, saving and loading) and `cli`, with
`plot` beside it.
"""

from ._defaults import Recipe as Recipe, default_recipe as default_recipe
from .datasets import Standardization as Standardization
from .estimators import (
    AbstractEstimator as AbstractEstimator,
    Exact as Exact,
    Hutchinson as Hutchinson,
    HutchPlusPlus as HutchPlusPlus,
    XTrace as XTrace,
    divergence as divergence,
    trace as trace,
)
from .flows import (
    CNF as CNF,
    AbstractBase as AbstractBase,
    AbstractFlow as AbstractFlow,
    AbstractSchedule as AbstractSchedule,
    Chain as Chain,
    CosineSchedule as CosineSchedule,
    GaussianMixture as GaussianMixture,
    LikelihoodEstimate as LikelihoodEstimate,
    LinearSchedule as LinearSchedule,
    MeanFreeNormal as MeanFreeNormal,
    MultiscaleFlow as MultiscaleFlow,
    Normal as Normal,
    ProbabilityFlow as ProbabilityFlow,
    SolverError as SolverError,
    StandardizedFlow as StandardizedFlow,
    StandardNormal as StandardNormal,
    StudentT as StudentT,
    StudentTMixture as StudentTMixture,
    SubVPSchedule as SubVPSchedule,
    VESchedule as VESchedule,
    VPSchedule as VPSchedule,
    default_n_scales as default_n_scales,
    fit_base as fit_base,
    make_flow as make_flow,
    mlp_flow as mlp_flow,
    remove_center_of_mass as remove_center_of_mass,
    squeeze as squeeze,
    unsqueeze as unsqueeze,
)
from .nets import (
    ConcatConv2d as ConcatConv2d,
    ConcatSquashLinear as ConcatSquashLinear,
    ConcatSquashMLP as ConcatSquashMLP,
    ConvField as ConvField,
    EGNNField as EGNNField,
    MLPField as MLPField,
)
from .objectives import (
    AbstractObjective as AbstractObjective,
    FlowMatching as FlowMatching,
    ImportanceWeights as ImportanceWeights,
    MaximumLikelihood as MaximumLikelihood,
    ReverseKL as ReverseKL,
    conditional_path as conditional_path,
    flow_matching_loss as flow_matching_loss,
    importance_weights as importance_weights,
    ot_pairing as ot_pairing,
    pareto_khat as pareto_khat,
)
from .ode import (
    CNFArgs as CNFArgs,
    CNFTerm as CNFTerm,
    Regularization as Regularization,
    SolveStats as SolveStats,
    max_rms_norm as max_rms_norm,
    max_rms_seminorm as max_rms_seminorm,
)
from .runs import load as load, save as save
from .store import (
    CheckpointError as CheckpointError,
    default_cache_dir as default_cache_dir,
    enable_compilation_cache as enable_compilation_cache,
)
from .training import (
    NLL as NLL,
    Checkpoints as Checkpoints,
    Trainer as Trainer,
    TrainingError as TrainingError,
    TrainState as TrainState,
    Validation as Validation,
    budget_cosine_adam as budget_cosine_adam,
    data_mesh as data_mesh,
    evaluate_nll as evaluate_nll,
    fit as fit,
    log_prob_batched as log_prob_batched,
    warmup_cosine_adam as warmup_cosine_adam,
)

__version__ = "0.1.0"
