"""Flows: the base class every flow derives from, the CNF block, chains of blocks, the
multiscale image model and flows in a data file's units."""

from ._base import AbstractFlow as AbstractFlow
from ._builders import (
    ACTIVATIONS as ACTIVATIONS,
    DEFAULT_ACTIVATION as DEFAULT_ACTIVATION,
    FIELDS as FIELDS,
    SOLVERS as SOLVERS,
    mlp_flow as mlp_flow,
)
from ._chain import Chain as Chain, make_flow as make_flow
from ._cnf import CNF as CNF
from ._inputs import need_key as need_key, validate_input as validate_input
from ._multiscale import (
    MultiscaleFlow as MultiscaleFlow,
    default_n_scales as default_n_scales,
    squeeze as squeeze,
    unsqueeze as unsqueeze,
)
from ._programs import SolverError as SolverError
from ._standardized import (
    Standardization as Standardization,
    StandardizedFlow as StandardizedFlow,
    standardize_on_host as standardize_on_host,
)
