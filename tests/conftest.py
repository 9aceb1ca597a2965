"""Test configuration: float64 for numerical tests, strict rank promotion, and the
compiled programs of each test file released when the file is done."""

import gc
import os

# XLA:CPU's newer fusion emitters take most of the compile time of the suite's small
# programs: without them a flow's gradient compiles in 1.4 s instead of 3.4 s and
# runs about a tenth slower, a good trade for programs that run a few steps. Set
# before JAX starts its backend, and inherited by the processes the tests start.
# Two of XLA's loop optimisations are skipped too: hoisting invariant code out of
# while loops and simplifying the loops took about a fifth of the compile time of a
# CNF's gradient (diffrax's solves are nested while loops), and without them it
# computes the same numbers, no slower at these sizes. XLA:CPU also splits each
# program into parts that its threads generate code for in parallel: splitting took
# about a sixth of a gradient's compile, and on two cores the threads only compete
# with the suite's other worker, so the programs are generated whole (one part).
_FAST_COMPILE = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
    "--xla_disable_hlo_passes=while-loop-invariant-code-motion,simplify-while-loops",
)
_FLAGS = os.environ.get("XLA_FLAGS", "")
for _flag in _FAST_COMPILE:
    if _flag.split("=")[0] not in _FLAGS:
        _FLAGS = f"{_FLAGS} {_flag}".strip()
os.environ["XLA_FLAGS"] = _FLAGS

import ctypes  # noqa: E402
import ctypes.util  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

import cnftrace  # noqa: E402

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
# Python's cyclic garbage collector runs far less often in the test processes: JAX's
# tracing makes many short-lived objects while the worker holds many long-lived
# ones (compiled programs, cached traces), and at Python's default thresholds the
# collector took about 7% of a test file's time scanning them (docs/changelog.md).
# Memory stays bounded: the thresholds still collect, and `release_memory` below
# collects whenever a worker grows too large.
gc.set_threshold(100_000, 50, 100)
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


# The test files by their measured time, the longest first (docs/changelog.md), the
# rest after them: `make test` hands whole files to its workers (`--dist loadfile`) in
# this order (`--no-loadscope-reorder`), so that the last files handed out are short
# and the two workers finish together. pytest-xdist's own order (by the number of
# tests, the most first) hands out last the long files of a few tests (the user's
# lane, the default recipe, the two-process tests), and a worker can then run one
# alone at the end.
LONGEST_FIRST = (
    "test_docs_examples.py",
    "test_cnf.py",
    "test_user_lane.py",
    "test_docstring_examples.py",
    "test_train.py",
    "test_matching.py",
    "test_conditional.py",
    "test_probability_flow.py",
    "test_experiments_tabular.py",
    "test_parallel.py",
    "test_multiscale.py",
    "test_cli.py",
    "test_experiments_images.py",
    "test_bench_run.py",
    "test_bench_b3.py",
    "test_regularization.py",
    "test_bases.py",
    "test_defaults.py",
    "test_bench_b5.py",
    "test_reverse_kl.py",
    "test_cache_damage.py",
    "test_sketch_trace.py",
    "test_checkpoint.py",
    "test_nets.py",
    "test_cache.py",
    "test_budget.py",
    "test_file_values.py",
    "test_own_data.py",
    "test_stages.py",
    "test_learn_t1.py",
    "test_targets.py",
    "test_default_recipe.py",
    "test_run_directory.py",
    "test_bench_gpu.py",
    "test_run_files.py",
    "test_experiments_toy.py",
    "test_bench_b5_curves.py",
    "test_inputs.py",
    "test_estimators.py",
    "test_drop_missing.py",
    "test_trace.py",
    "test_particles.py",
    "test_dequantize.py",
    "test_resume.py",
    "test_bench_b2.py",
)
BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench")


def pytest_collection_modifyitems(config, items):
    """The longest files first; the smoke tests of the benchmarks and experiments
    (tests/bench/) marked `bench`, so that `-m "not bench"` leaves them out."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if os.path.dirname(str(item.path)) == BENCH:
            item.add_marker(pytest.mark.bench)


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


# A worker's memory maps and resident memory beyond which its compiled programs are
# dropped: every loaded XLA:CPU executable keeps a few hundred memory maps (about
# 200 for a flow's `log_prob`, 500 for its gradient), and a process that reaches the
# kernel's `vm.max_map_count` (65,530) crashes with a segmentation fault in XLA's
# next compile; the executables also held each worker above 5 GB when none were
# dropped. Higher limits released less often but did not shorten the suite
# (docs/changelog.md).
MAX_MAPS = 20_000
MAX_RESIDENT = 3 * 2**30


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test file, drop JAX's compiled programs if the worker holds too
    many. Dropping them after every file cost the next file its recompiles of
    what the two share (JAX's own small programs above all)."""
    yield
    release_if_large()


def _process_size() -> tuple[int, int] | None:
    """The number of memory maps and the resident bytes of this process, where
    /proc tells them (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            maps = sum(1 for _ in f)
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
    return maps, resident


def release_if_large():
    """`release_memory()` where the process holds more than `MAX_MAPS` memory maps
    or `MAX_RESIDENT` bytes, or where its size cannot be read."""
    size = _process_size()
    if size is None or size[0] > MAX_MAPS or size[1] > MAX_RESIDENT:
        release_memory()


def release_memory():
    """Drop JAX's compiled programs, collect garbage and hand freed memory back to
    the system: glibc keeps what XLA's compiler threads freed in their arenas, so a
    worker's resident memory only grew (to 3.5 GB) without the trim."""
    jax.clear_caches()
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
