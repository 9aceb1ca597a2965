"""Storage: the checkpoint format, the history log, the directory lock and the care
of JAX's persistent compilation cache. They know nothing of flows: they sit below
`training` (whose `fit` checkpoints through them) and `runs`."""

from ._cache import (
    default_cache_dir as default_cache_dir,
    enable_compilation_cache as enable_compilation_cache,
)
from ._checkpoint import CheckpointError as CheckpointError
