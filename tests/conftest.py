"""Test configuration: float64 for numerical tests, strict rank promotion, and the
compiled programs of each test file released when the file is done."""

import gc
import os

# XLA:CPU's newer fusion emitters take most of the compile time of the suite's small
# programs: without them a flow's gradient compiles in 1.4 s instead of 3.4 s and
# runs about a tenth slower, a good trade for programs that run a few steps. Set
# before JAX starts its backend, and inherited by the processes the tests start.
_FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false"
_FLAGS = os.environ.get("XLA_FLAGS", "")
if _FAST_COMPILE not in _FLAGS:
    os.environ["XLA_FLAGS"] = f"{_FLAGS} {_FAST_COMPILE}".strip()

import ctypes  # noqa: E402
import ctypes.util  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

import cnftrace  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
# XLA without its expensive optimisation passes (LLVM's above all): the suite's time
# is mostly compiling small programs that then run a few steps, and compiling them
# unoptimised saves about a fifth of it. The same for the processes the tests start.
jax.config.update("jax_disable_most_optimizations", True)
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"

# The persistent compilation cache, shared by the workers and by the processes the
# tests start (the command line, the scripts): a program that two test files compile
# alike is compiled once, and a second run of the suite loads most of them. Kept in
# .pytest_cache/ unless JAX_COMPILATION_CACHE_DIR names another directory;
# CNFTRACE_COMPILATION_CACHE=0 turns it off.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# No size limit (JAX's default): with one, processes writing at once race on the
# entries' access-time files, and JAX warns of entries it could not write.
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
_CACHE = cnftrace.enable_compilation_cache(
    os.path.join(_ROOT, ".pytest_cache", "jax-compilation")
)
if _CACHE is not None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE


# glibc's malloc_trim, where there is one (Linux).
try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(_LIBC, "malloc_trim"):
        _LIBC = None
except OSError:
    _LIBC = None


# The files that take longest (mostly XLA compiling), first: pytest-xdist's
# `--dist loadfile` hands out whole files in collection order, so putting the long
# ones first keeps one worker from finishing a long file alone at the end.
LONGEST_FIRST = (  # by their measured time on one core, 2026-11-23
    "test_docs_examples.py",
    # Not in the measurement above: 45-52 s alone on 2 cores (2026-11-25), nearly
    # all of it in its own processes (the README's 1500 training steps first).
    "test_user_lane.py",
    # About 38 s alone (2026-11-26), in its own processes: a filled cache, damaged.
    "test_faults_cache.py",
    "test_flow.py",
    "test_docstring_examples.py",
    "test_train.py",
    "test_parallel.py",
    "test_conditional.py",
    "test_experiments_tabular.py",
    "test_experiments_images.py",
    "test_regularization.py",
    "test_matching.py",
    "test_bench_run.py",
    "test_cli.py",
    "test_multiscale.py",
    "test_checkpoint.py",
    "test_bench_b3.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _optimized(request):
    """A test marked `optimized` compiles with XLA's optimisations on: one that runs
    hundreds of training steps spends more time running its programs than compiling
    them, and unoptimised code runs them slower (measured from a cold cache: the
    conditional 8-Gaussians test 23 s against 31 s, the default recipe's 15 s
    against 18 s)."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test file. Every loaded XLA:CPU
    executable keeps a few hundred memory maps (about 200 for a flow's `log_prob`,
    500 for its gradient), so a worker that runs the whole suite in one process
    reaches the kernel's `vm.max_map_count` (65,530) and XLA crashes with a
    segmentation fault in its next compile; the executables also held each worker
    above 5 GB of resident memory. A file's programs are rarely reused by another."""
    yield
    release_memory()


def release_memory():
    """Drop JAX's compiled programs, collect garbage and hand freed memory back to
    the system: glibc keeps what XLA's compiler threads freed in their arenas, so a
    worker's resident memory only grew (to 3.5 GB) without the trim."""
    jax.clear_caches()
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
