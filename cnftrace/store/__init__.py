"""Storage: how training is kept on disk. The checkpoint file format, the history
log (one JSON record per step), the directory lock that keeps two processes from
training into one directory, and the care of JAX's persistent compilation cache.

These know nothing of flows or training: they write pytrees of arrays, JSON lines
and a lock file. So they sit below `training` (whose `fit` checkpoints through
them), and `runs` (run directories, `config.json`, `load`) builds on them."""

from ._cache import (
    default_cache_dir as default_cache_dir,
    enable_compilation_cache as enable_compilation_cache,
)
from ._checkpoint import CheckpointError as CheckpointError
