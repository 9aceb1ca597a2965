"""The training step's gradient and update, each traced once and kept on disk beside
the compilation cache, with its executable.

JAX's persistent compilation cache (`_cache.py`) keys a compiled program by the
program itself, so a new process must trace and lower its training step before it can
find it: about 2 s for a CNF on a CPU, most of it diffrax's solve and its
checkpointed backward pass, and a few tenths of a second more to lower and hash it.
This module stores that traced program (the gradient of the objective with respect
to the flow's parameters, exported with `jax.export`) and its executable compiled for
this machine, so that a later process with the same flow, objective, shapes and
library versions reads both back and calls the executable (`_trainer.SplitStep`);
the optimiser's update (`_trainer.update_program`) is stored the same way, keyed by
the optimiser and the state.

A stored program is only correct for the exact Python objects it was traced from, so
its key describes all of them: every static field of the flow and the objective
(recursively, closures included), the shapes and dtypes of every input, the versions
of jax, jaxlib and the libraries the step calls, the source of cnftrace itself and the
JAX settings that change tracing. Anything the description cannot vouch for (a class,
function or object defined outside cnftrace and the libraries it versions, such as a
user's own vector field or optimiser) makes that program uncacheable, and it is
traced as usual.
"""

import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import os
import platform
import threading
import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.experimental import serialize_executable

from ._cache import OPT_OUT
from ._checkpoint import CheckpointError, _atomic_write
from ._compile_options import without_tiled_emitter

FORMAT = "cnftrace-step-v1"
SUBDIR = "cnftrace-steps"
SUFFIX = ".jaxexport"
# The program compiled for this machine, beside it: `<key>-<machine>.xlaexe`.
EXE_SUFFIX = ".xlaexe"
# The oldest stored programs are deleted beyond this many bytes (one is ~1 MB).
MAX_BYTES = 256 * 1024**2

# Code from these packages is described by its version (and cnftrace by a hash of its
# source); code from anywhere else is not described at all, so it is uncacheable.
_VERSIONED = (
    "jax",
    "jaxlib",
    "equinox",
    "diffrax",
    "lineax",
    "optimistix",
    "optax",
    "numpy",
    "jaxtyping",
)
_ROOTS = frozenset(_VERSIONED) | {"cnftrace", "builtins", "math", "operator"}
# The JAX settings that change what a function traces to.
_CONFIG = (
    "jax_enable_x64",
    "jax_numpy_rank_promotion",
    "jax_numpy_dtype_promotion",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_enable_checks",
    "jax_debug_nans",
    "jax_debug_infs",
)
_MAX_DEPTH = 64

# Programs found or exported by this process, by key: a second `fit` with the same
# model reuses the same object, and with it its executable.
# At most `_MAX_LOADED` of them, the least recently used dropped first: each holds an
# executable (hundreds of memory maps on XLA:CPU).
_LOADED: dict[str, "ExportedGrads"] = {}
_MAX_LOADED = 8


class _Uncacheable(Exception):
    pass


def _allowed(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in _ROOTS


def _describe(obj: Any, out: list[str], depth: int = 0) -> None:
    """Append a description of `obj` to `out` that two objects share only if tracing
    them gives the same program; raise `_Uncacheable` where that cannot be said."""
    if depth > _MAX_DEPTH:
        raise _Uncacheable("too deep")
    d = depth + 1
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        out.append(f"{type(obj).__name__}:{obj!r}")
    elif isinstance(obj, enum.Enum):
        _describe(type(obj), out, d)
        out.append(f"member:{obj.name}")
    elif isinstance(obj, type):
        if not _allowed(obj.__module__):
            raise _Uncacheable(f"class {obj.__module__}.{obj.__qualname__}")
        out.append(f"class:{obj.__module__}.{obj.__qualname__}")
    elif isinstance(obj, (np.dtype, np.generic)):
        out.append(f"{type(obj).__name__}:{obj!r}")
    elif isinstance(obj, (jax.Array, np.ndarray)):
        if isinstance(obj, jax.core.Tracer):
            raise _Uncacheable("a tracer")
        if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
            out.append(f"key:{jr.key_impl(obj)}")
            obj = jr.key_data(obj)
        a = np.asarray(obj)
        digest = hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
        out.append(f"array:{a.dtype}{a.shape}:{digest}")
    elif isinstance(obj, (tuple, list, frozenset, set)):
        out.append(f"{type(obj).__name__}[{len(obj)}]")
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        for item in items:
            _describe(item, out, d)
        if isinstance(obj, tuple) and type(obj) is not tuple:  # a namedtuple
            _describe(type(obj), out, d)
    elif isinstance(obj, dict):
        out.append(f"dict[{len(obj)}]")
        for k in sorted(obj, key=repr):
            _describe(k, out, d)
            _describe(obj[k], out, d)
    elif isinstance(obj, eqx.Module) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    ):
        _describe(type(obj), out, d)
        for field in dataclasses.fields(obj):
            out.append(f"field:{field.name}")
            _describe(getattr(obj, field.name, None), out, d)
    elif isinstance(obj, functools.partial):
        out.append("partial")
        _describe(obj.func, out, d)
        _describe(obj.args, out, d)
        _describe(obj.keywords, out, d)
    elif isinstance(obj, types.MethodType):
        out.append("method")
        _describe(obj.__func__, out, d)
        _describe(obj.__self__, out, d)
    elif isinstance(obj, types.FunctionType):
        if not _allowed(obj.__module__):
            raise _Uncacheable(f"function {obj.__module__}.{obj.__qualname__}")
        out.append(f"function:{obj.__module__}.{obj.__qualname__}")
        for cell in obj.__closure__ or ():
            _describe(cell.cell_contents, out, d)
        _describe(obj.__defaults__, out, d)
        _describe(obj.__kwdefaults__, out, d)
    elif isinstance(obj, (types.BuiltinFunctionType, np.ufunc)):
        module = getattr(obj, "__module__", None) or "numpy"
        if not _allowed(module):
            raise _Uncacheable(f"builtin {module}.{obj.__name__}")
        out.append(f"builtin:{module}.{obj.__name__}")
    elif _allowed(type(obj).__module__) and hasattr(obj, "__wrapped__"):
        # jax.jit's and functools.wraps's wrappers (jax.nn's activations).
        out.append(f"wrapper:{type(obj).__module__}.{type(obj).__qualname__}")
        _describe(obj.__wrapped__, out, d)
    elif _allowed(type(obj).__module__) and hasattr(obj, "fun"):
        # jax.custom_jvp and jax.custom_vjp functions (jax.nn.relu).
        out.append(f"custom:{type(obj).__module__}.{type(obj).__qualname__}")
        for name in ("fun", "jvp", "fwd", "bwd", "nondiff_argnums"):
            _describe(getattr(obj, name, None), out, d)
    else:
        raise _Uncacheable(f"an object of type {type(obj).__qualname__}")


@functools.cache
def _environment() -> str:
    """The library versions and a hash of cnftrace's own source."""
    parts = [FORMAT]
    for name in _VERSIONED:
        try:
            parts.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{name}=none")
    source = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                source.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    source.update(f.read())
    parts.append(f"cnftrace-source={source.hexdigest()}")
    return "\n".join(parts)


@functools.cache
def _machine() -> str:
    """What a compiled program depends on beyond the program itself: the backend and
    its version, the device, the CPU and its features, XLA's flags and JAX's
    compiler settings."""
    backend = jax.devices()[0].client
    parts = [
        backend.platform,
        backend.platform_version,
        jax.devices()[0].device_kind,
        platform.machine(),
        os.environ.get("XLA_FLAGS", ""),
    ]
    for name in (
        "jax_disable_most_optimizations",
        "jax_exec_time_optimization_effort",
        "jax_memory_fitting_effort",
    ):
        parts.append(f"{name}={getattr(jax.config, name, None)!r}")
    try:  # the instruction sets the compiled code may use (Linux)
        with open("/proc/cpuinfo") as f:
            lines = {line for line in f if line.startswith(("flags", "model name"))}
        parts += sorted(lines)
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _aval(x) -> str:
    return "none" if x is None else f"{jnp.dtype(x.dtype)}{tuple(x.shape)}"


def step_key(static: Any, args: tuple) -> str | None:
    """The key of a gradient program traced from `static` (the objective, the flow's
    static part, the parameters' tree structure and the key's implementation) for
    inputs like `args`; `None` if some part of `static` cannot be described."""
    out = [_environment(), f"backend:{jax.default_backend()}"]
    out += [f"{name}={getattr(jax.config, name, None)!r}" for name in _CONFIG]
    try:
        _describe(static, out)
    except _Uncacheable:
        return None
    out += [_aval(x) for x in jax.tree_util.tree_leaves(args)]
    out.append(str(jax.tree_util.tree_structure(args)))
    return hashlib.sha256("\n".join(out).encode()).hexdigest()


STEP_OPT_OUT = "CNFTRACE_STEP_CACHE"
"""The environment variable that turns off just the stored steps (`0`, `off`, ...),
leaving JAX's compilation cache on."""


def _off(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in ("0", "off", "false", "no")


def enabled() -> bool:
    """Whether steps are stored: with the compilation cache on, unless turned off."""
    if _off(OPT_OUT) or _off(STEP_OPT_OUT):
        return False
    return bool(jax.config.jax_enable_compilation_cache) and bool(
        jax.config.jax_compilation_cache_dir
    )


class ExportedGrads:
    """A deserialized gradient program (callable, inlined where it is called inside
    a jit). It may also carry the program compiled on its own (`has_executable`),
    which `_trainer.SplitStep` calls: read from disk, or being compiled in a
    background thread (`executable()` waits for it)."""

    def __init__(self, exported: jax.export.Exported, key: str, loaded: bool):
        self.exported = exported
        self.key = key
        self.loaded = loaded  # read from disk (True) or traced by this process
        self.executable_loaded = False  # its executable read from disk
        self._executable: jax.stages.Compiled | None = None
        self._future: concurrent.futures.Future | None = None
        self._unsaved: Callable[[], None] | None = None
        self._saving: concurrent.futures.Future | None = None

    def __call__(self, *args):
        return self.exported.call(*args)

    @property
    def has_executable(self) -> bool:
        return self._executable is not None or self._future is not None

    def executable(self) -> Callable:
        """The compiled program, once its compilation is done; where that failed,
        the program jitted the usual way (compiled at its first call)."""
        if self._future is not None:
            try:
                self._executable, self._unsaved = self._future.result()
            except Exception:
                self._executable = jax.jit(self.exported.call)
            self._future = None
        return self._executable

    def save_executable(self) -> concurrent.futures.Future | None:
        """Writes a freshly compiled executable (serialized when it was compiled) to
        disk, in a background thread, once: called after the first step that needs
        it, so that the step does not wait for the write and its `fsync`. The
        future of that write; `None` where there is nothing to write, or where the
        program is still compiling (it is saved at a later call)."""
        if self._future is not None and not self._future.done():
            return None  # not compiled yet: saved at a later call
        self.executable()
        unsaved, self._unsaved = self._unsaved, None
        if unsaved is not None:
            self._saving = _COMPILER.submit(unsaved)
        return self._saving


def _directory() -> str:
    return os.path.join(jax.config.jax_compilation_cache_dir, SUBDIR)


def _prune(directory: str, keep: str) -> None:
    entries = []
    for name in os.listdir(directory):
        if name.endswith((SUFFIX, EXE_SUFFIX)):
            path = os.path.join(directory, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= MAX_BYTES:
            break
        if path != keep:
            try:
                os.remove(path)
            except OSError:
                pass
            total -= size


def exported_grads(fn: Callable, static: Any, args: tuple) -> ExportedGrads | None:
    """`fn(*args)` as a stored program: read from the cache if there, else traced,
    exported and written. `fn` must be determined by `static` (see `step_key`).
    `None` where the cache is off or the program cannot be stored; the caller then
    traces `fn` itself."""
    if not enabled():
        return None
    key = step_key(static, args)
    if key is None:
        return None
    if key in _LOADED:
        _LOADED[key] = _LOADED.pop(key)  # the most recently used last
        return _LOADED[key]
    directory = _directory()
    path = os.path.join(directory, key + SUFFIX)
    program = None
    try:
        with open(path, "rb") as f:
            data = f.read()
        program = ExportedGrads(jax.export.deserialize(bytearray(data)), key, True)
        os.utime(path)  # most recently used
    except FileNotFoundError:
        pass
    except Exception:  # an unreadable or stale entry: trace again and replace it
        pass
    if program is not None:
        _attach_compiled(program, directory, args)
    else:
        jitted = jax.jit(fn)
        compiling = None
        try:
            if _on_first_device(args):
                # Compiled in the background from this process's own lowering as
                # soon as it is traced: exporting it (a second lowering) and writing
                # it happen meanwhile.
                lowered = jitted.trace(*_specs(args)).lower()
                compiling = _compile_in_background(
                    lowered,
                    directory,
                    key,
                    _in_tree(args),
                    lowered.out_tree,
                    jax_cache=False,
                )
            exported = jax.export.export(jitted, platforms=[jax.default_backend()])(
                *_specs(args)
            )
            data = exported.serialize()
        except Exception:  # something export does not support: trace as usual
            return None
        program = ExportedGrads(exported, key, False)
        program._future = compiling
        try:
            _atomic_write(path, bytes(data))
            _prune(directory, path)
        except (OSError, CheckpointError):
            pass  # nothing but speed is lost
    _LOADED[key] = program
    while len(_LOADED) > _MAX_LOADED:
        del _LOADED[next(iter(_LOADED))]
    return program


def _spec(x) -> jax.ShapeDtypeStruct:
    # An array committed to its device keeps its placement, so the program's
    # outputs are committed too, as a jitted program's are for committed inputs
    # (else a jitted program they are passed to compiles a second time).
    committed = isinstance(x, jax.Array) and x.committed
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=x.sharding if committed else None
    )


def _specs(args) -> Any:
    return jax.tree_util.tree_map(_spec, args)


def _on_first_device(args) -> bool:
    first = jax.devices()[0]
    for x in jax.tree_util.tree_leaves(args):
        if isinstance(x, jax.Array) and x.devices() != {first}:
            return False
    return True


def _attach_compiled(program: ExportedGrads, directory: str, args: tuple) -> None:
    """Gives `program` its executable for this machine: read from disk, or compiled
    (through JAX's compilation cache, in a background thread, so that the step's
    other programs compile meanwhile) and written beside it. Reading it back skips
    what the compilation cache cannot: lowering the program and hashing it into
    the cache's key. None for arguments on another device than the first."""
    if not _on_first_device(args):
        return
    in_tree = _in_tree(args)
    out_tree = program.exported.out_tree
    path = _executable_path(directory, program.key)
    try:
        with open(path, "rb") as f:
            payload = f.read()
        program._executable = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=jax.devices()[:1]
        )
        program.executable_loaded = True
        os.utime(path)
        return
    except FileNotFoundError:
        pass
    except Exception:  # unreadable or stale: compile again and replace it
        pass
    try:
        lowered = jax.jit(program.exported.call).lower(*_specs(args))
    except Exception:
        return  # the step inlines the program instead
    program._future = _compile_in_background(
        lowered, directory, program.key, in_tree, out_tree
    )


def _in_tree(args: tuple):
    return jax.tree_util.tree_structure((tuple(args), {}))


def _executable_path(directory: str, key: str) -> str:
    return os.path.join(directory, f"{key}-{_machine()}{EXE_SUFFIX}")


def _compile_in_background(
    lowered, directory: str, key: str, in_tree, out_tree, jax_cache: bool = True
) -> concurrent.futures.Future:
    """`lowered`, compiled in a background thread (XLA compiles without holding
    Python's lock, so the step's other programs are traced and compiled meanwhile):
    the future of `(executable, save)`, where `save` writes a freshly compiled
    executable beside the stored program (`ExportedGrads.save_executable`), or is
    `None` (read from JAX's cache, or not serializable). `jax_cache=False`: the
    compile is not written to JAX's compilation cache either (for a program this
    process traced itself: a later process reads the stored program and its
    executable, never that entry)."""
    path = _executable_path(directory, key)

    def compile_():
        # XLA compiles without holding Python's lock.
        thread = threading.get_ident()
        _CACHE_HITS.discard(thread)
        with (
            contextlib.nullcontext() if jax_cache else _no_cache_write(),
            without_tiled_emitter(),  # less to compile, the same kernels
        ):
            compiled = lowered.compile()
        if thread in _CACHE_HITS:
            # Read from JAX's compilation cache, not compiled: XLA:CPU serializes
            # such an executable without its kernels (it fails when run), so only
            # a freshly compiled one is written.
            return compiled, None

        # Serialized now: XLA:CPU cannot serialize some executables (a sort's)
        # once they have run. Only the write waits for `save_executable`.
        try:
            payload, saved_in, saved_out = serialize_executable.serialize(compiled)
        except Exception:  # nothing but the next process's speed is lost
            return compiled, None
        if saved_in != in_tree or saved_out != out_tree:
            return compiled, None  # written only where it can be read back as above

        def save():
            try:
                _atomic_write(path, payload)
                _prune(directory, path)
            except (OSError, CheckpointError):  # nothing but speed is lost
                pass

        return compiled, save

    return _COMPILER.submit(compile_)


try:  # JAX's setting as a context manager, for this thread only
    from jax._src.config import persistent_cache_min_compile_time_secs as _MIN_TIME
except ImportError:  # another JAX: the entry is written, nothing else changes
    _MIN_TIME = None


def _no_cache_write():
    return contextlib.nullcontext() if _MIN_TIME is None else _MIN_TIME(float("inf"))


# Two threads: the gradient and the update compile side by side.
_COMPILER = concurrent.futures.ThreadPoolExecutor(2, "cnftrace-step-compile")
# The threads whose last compile JAX's compilation cache served.
_CACHE_HITS: set[int] = set()


def _note_cache_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS.add(threading.get_ident())


jax.monitoring.register_event_listener(_note_cache_hit)
