"""Runs: saving and loading flows, and the run directories of `cnftrace train`, whose
settings (`config.json`) rebuild the model, its optimiser and its objective."""

from ._build import (
    run_flow as run_flow,
    run_objective as run_objective,
    run_optimizer as run_optimizer,
)
from ._config import (
    GROUPS as GROUPS,
    RunConfig as RunConfig,
    read_config as read_config,
)
from ._files import (
    LoadedRun as LoadedRun,
    load as load,
    load_run as load_run,
    save as save,
)
