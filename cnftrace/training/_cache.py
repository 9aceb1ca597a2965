"""JAX's persistent compilation cache, on for the command line, the demo and the tests.

A new process otherwise compiles its training step, its `log_prob` and its sampler
again (seconds each on a CPU). With the cache on, the first process writes each
compiled program to disk and every later one with the same program (same flow
structure, shapes, dtypes, jax and XLA versions) loads it instead.
"""

import os
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

OPT_OUT = "CNFTRACE_COMPILATION_CACHE"
"""The environment variable that turns the cache off: `0`, `off`, `false` or `no`."""

# Programs that compile faster than this are not written: the smallest ones (a single
# operation run eagerly) cost about as much to read back as to compile, and the cache
# would fill with thousands of them.
MIN_COMPILE_SECONDS = 0.03
# The least recently used programs are deleted beyond this size.
MAX_BYTES = 2 * 1024**3


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/cnftrace/jax`, or `~/.cache/cnftrace/jax` without it."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return os.path.join(home, "cnftrace", "jax")


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turn on JAX's persistent compilation cache for this process, and return its
    directory (or `None` where it stays off).

    - A directory already chosen for JAX (the environment variable
        `JAX_COMPILATION_CACHE_DIR`, or `jax.config.update("jax_compilation_cache_dir",
        ...)`) is kept as it is.
    - Otherwise the cache goes to `path`, or to
        [`default_cache_dir()`][cnftrace.default_cache_dir] without one.
    - `CNFTRACE_COMPILATION_CACHE=0` (or `off`, `false`, `no`) in the environment
        leaves the cache off; so does a directory that cannot be created (with a
        warning: nothing but speed is lost).

    `cnftrace train`/`eval`/`sample`, `make demo` and the test suite call this at
    start; call it yourself at the top of a script to get the same. Programs that
    compile in less than 0.03 s are not stored, and the least recently used ones are
    deleted beyond 2 GiB (JAX's `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` and
    `JAX_COMPILATION_CACHE_MAX_SIZE` override both). A compiled program is found
    again only by a process with the same flow structure, shapes, dtypes and jax
    version; one that holds a host callback (`jax.debug.print`, `eqx.error_if`) is
    never stored: `fit`'s step and the flows' methods called on data hold none (see
    `docs/training.md`, "Compiling once").

    !!! example

        ```python
        import tempfile

        print(cnftrace.enable_compilation_cache(tempfile.mkdtemp()) is not None)
        ```
    """
    if os.environ.get(OPT_OUT, "").strip().lower() in ("0", "off", "false", "no"):
        return None
    chosen = jax.config.jax_compilation_cache_dir
    directory = chosen or path or default_cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        warnings.warn(
            f"the compilation cache stays off: cannot create {directory!r} ({e}); "
            f"set JAX_COMPILATION_CACHE_DIR to a writable directory, or "
            f"{OPT_OUT}=0 to silence this.",
            stacklevel=2,
        )
        return None
    if chosen is None:
        jax.config.update("jax_compilation_cache_dir", directory)
    # JAX's own settings where the user chose none (their defaults: every program
    # that compiles in a second or more, with no size limit).
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS
        )
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    jax.config.update("jax_enable_compilation_cache", True)
    # JAX decides once per process whether the cache is used, at its first compile:
    # start over so that a process that has already compiled something uses it too.
    _jax_cache.reset_cache()
    return directory
