"""Training objectives: what one training step minimises. An objective is a small
Module with one method, `loss(flow, x, context, key, counter)`; `fit` and `Trainer`
take any of them. Beside them, importance weights of a flow's samples toward an
unnormalised target, and their diagnostics."""

from ._base import AbstractObjective as AbstractObjective
from ._likelihood import MaximumLikelihood as MaximumLikelihood
from ._matching import (
    FlowMatching as FlowMatching,
    conditional_path as conditional_path,
    flow_matching_loss as flow_matching_loss,
    ot_pairing as ot_pairing,
)
from ._names import OBJECTIVES as OBJECTIVES
from ._reverse_kl import ReverseKL as ReverseKL
from ._weights import (
    ImportanceWeights as ImportanceWeights,
    importance_weights as importance_weights,
    pareto_khat as pareto_khat,
)
