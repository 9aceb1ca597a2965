"""Training: the state between steps, the `Trainer` and its jitted step, `fit`'s loop,
the optimiser, evaluation with the exact trace and data parallelism. Checkpoints and
the history file are written through `cnftrace.store`."""

from ._evaluate import (
    NLL as NLL,
    evaluate_nll as evaluate_nll,
    log_prob_batched as log_prob_batched,
)
from ._fit import fit as fit
from ._optim import (
    budget_cosine_adam as budget_cosine_adam,
    warmup_cosine_adam as warmup_cosine_adam,
)
from ._options import Checkpoints as Checkpoints, Validation as Validation
from ._parallel import data_mesh as data_mesh
from ._state import TrainingError as TrainingError, TrainState as TrainState
from ._trainer import Trainer as Trainer
