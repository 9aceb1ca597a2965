"""Training: the state between steps, the `Trainer` and its jitted step, `fit`'s loop,
the optimiser, evaluation with the exact trace, checkpoints, the history log, the run
directory's lock, data parallelism and JAX's persistent compilation cache."""

from ._cache import (
    default_cache_dir as default_cache_dir,
    enable_compilation_cache as enable_compilation_cache,
)
from ._checkpoint import (
    CheckpointError as CheckpointError,
    deserialise as deserialise,
    latest_good_checkpoint as latest_good_checkpoint,
    list_checkpoints as list_checkpoints,
    read_header as read_header,
    same_value as same_value,
)
from ._evaluate import (
    NLL as NLL,
    evaluate_nll as evaluate_nll,
    log_prob_batched as log_prob_batched,
)
from ._fit import fit as fit
from ._history import (
    Log as Log,
    dedupe as dedupe,
    read_records as read_records,
    truncate as truncate,
)
from ._lock import DirectoryLock as DirectoryLock
from ._optim import warmup_cosine_adam as warmup_cosine_adam
from ._options import Checkpoints as Checkpoints, Validation as Validation
from ._parallel import (
    check_batch_size as check_batch_size,
    data_mesh as data_mesh,
    is_main_process as is_main_process,
)
from ._state import TrainingError as TrainingError, TrainState as TrainState
from ._trainer import Trainer as Trainer
