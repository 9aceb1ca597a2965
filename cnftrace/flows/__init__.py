"""Flows: the base class every flow derives from, base distributions (their fit to
training rows, and the mean-free base of particle systems), the CNF block, chains of
blocks, the multiscale image model, flows in a data file's units, and the
probability-flow ODE of diffusion and flow-matching models trained elsewhere (with
their noise schedules)."""

from ._base import AbstractFlow as AbstractFlow
from ._base_fit import BASE_KINDS as BASE_KINDS, fit_base as fit_base
from ._builders import (
    ACTIVATIONS as ACTIVATIONS,
    DEFAULT_ACTIVATION as DEFAULT_ACTIVATION,
    FIELDS as FIELDS,
    SOLVERS as SOLVERS,
    mlp_flow as mlp_flow,
)
from ._chain import Chain as Chain, make_flow as make_flow
from ._cnf import CNF as CNF
from ._distributions import (
    AbstractBase as AbstractBase,
    Normal as Normal,
    StandardNormal as StandardNormal,
)
from ._mixtures import (
    GaussianMixture as GaussianMixture,
    StudentT as StudentT,
    StudentTMixture as StudentTMixture,
)
from ._multiscale import (
    MultiscaleFlow as MultiscaleFlow,
    default_n_scales as default_n_scales,
    squeeze as squeeze,
    unsqueeze as unsqueeze,
)
from ._particles import (
    MeanFreeNormal as MeanFreeNormal,
    remove_center_of_mass as remove_center_of_mass,
)
from ._probability_flow import (
    MODEL_KINDS as MODEL_KINDS,
    LikelihoodEstimate as LikelihoodEstimate,
    ProbabilityFlow as ProbabilityFlow,
)
from ._programs import SolverError as SolverError
from ._schedules import (
    AbstractSchedule as AbstractSchedule,
    CosineSchedule as CosineSchedule,
    LinearSchedule as LinearSchedule,
    SubVPSchedule as SubVPSchedule,
    VESchedule as VESchedule,
    VPSchedule as VPSchedule,
)
from ._standardized import (
    AbstractStandardization as AbstractStandardization,
    StandardizedFlow as StandardizedFlow,
)
