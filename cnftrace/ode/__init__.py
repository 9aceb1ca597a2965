"""The ODE layer: the diffrax term that augments a vector field with its log-density
change, the max-over-samples error norm, a Runge-Kutta step's stages as one scan, the
controller's first step, and what a solve reports."""

from ._controller import (
    FirstStepController as FirstStepController,
    initial_step as initial_step,
)
from ._norm import (
    max_rms_norm as max_rms_norm,
    max_rms_seminorm as max_rms_seminorm,
    state_and_log_density_norm as state_and_log_density_norm,
)
from ._regularization import Regularization as Regularization
from ._stages import StageScan as StageScan, scannable as scannable
from ._stats import SolveStats as SolveStats, evals_per_step as evals_per_step
from ._term import (
    CNFArgs as CNFArgs,
    CNFTerm as CNFTerm,
    StateTerm as StateTerm,
    check_matmul_precision as check_matmul_precision,
)
