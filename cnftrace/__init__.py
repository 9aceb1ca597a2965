"""cnftrace: continuous normalizing flows and ODE divergence estimators for JAX.

The public API lives here; the `_`-modules are private.
"""

from ._builders import mlp_flow as mlp_flow, warmup_cosine_adam as warmup_cosine_adam
from ._cache import (
    default_cache_dir as default_cache_dir,
    enable_compilation_cache as enable_compilation_cache,
)
from ._checkpoint import CheckpointError as CheckpointError
from ._estimators import (
    AbstractEstimator as AbstractEstimator,
    Exact as Exact,
    Hutchinson as Hutchinson,
    divergence as divergence,
)
from ._evaluate import (
    NLL as NLL,
    evaluate_nll as evaluate_nll,
    log_prob_batched as log_prob_batched,
)
from ._flow import (
    CNF as CNF,
    AbstractFlow as AbstractFlow,
    Chain as Chain,
    Regularization as Regularization,
    SolverError as SolverError,
    SolveStats as SolveStats,
    make_flow as make_flow,
)
from ._matching import (
    FlowMatching as FlowMatching,
    conditional_path as conditional_path,
    flow_matching_loss as flow_matching_loss,
    ot_pairing as ot_pairing,
)
from ._multiscale import (
    ConcatConv2d as ConcatConv2d,
    ConvField as ConvField,
    MultiscaleFlow as MultiscaleFlow,
    default_n_scales as default_n_scales,
    squeeze as squeeze,
    unsqueeze as unsqueeze,
)
from ._nets import (
    ConcatSquashLinear as ConcatSquashLinear,
    ConcatSquashMLP as ConcatSquashMLP,
    MLPField as MLPField,
)
from ._norm import max_rms_norm as max_rms_norm, max_rms_seminorm as max_rms_seminorm
from ._objectives import (
    AbstractObjective as AbstractObjective,
    MaximumLikelihood as MaximumLikelihood,
)
from ._parallel import data_mesh as data_mesh
from ._runs import load as load, save as save
from ._sketch import HutchPlusPlus as HutchPlusPlus, XTrace as XTrace
from ._standardized import (
    Standardization as Standardization,
    StandardizedFlow as StandardizedFlow,
)
from ._term import CNFArgs as CNFArgs, CNFTerm as CNFTerm
from ._trace import trace as trace
from ._train import Checkpoints as Checkpoints, Validation as Validation, fit as fit
from ._trainer import (
    Trainer as Trainer,
    TrainingError as TrainingError,
    TrainState as TrainState,
)

__version__ = "0.1.0"
