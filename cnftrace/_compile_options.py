"""An XLA:CPU compile option for the training step's programs that JAX's
`compiler_options` cannot express.

XLA:CPU offers each fusion to its experimental tiled emitter before its usual one.
For a CNF's gradient the tiled emitter declines nearly all of them ("... is not
supported by the tiled CPU emitter": a broadcast, a slice, a dynamic update), and the
attempt costs compile time: compiling B1's exact gradient took 4.30-4.43 CPU-seconds
without it against 4.63-5.60 with it (2.74-2.82 s against 2.90-3.43 s of wall time,
5 alternated pairs). XLA's switch, `xla_cpu_disable_tiled_emitter`, is an entry of
the map `DebugOptions.xla_backend_extra_options`, which JAX's per-compile options
cannot set (only the `XLA_FLAGS` environment variable can, for the whole process and
only before its first compile).

`without_tiled_emitter()` adds that entry to the compile options of the compiles
its thread makes: `_stepcache` compiles the step's gradient and update inside it. The
kernels come from the usual emitter either way, so the results are bit for bit the
same (`tests/test_stepcache.py` compares the stored step with the jitted one).
Anything unexpected (another JAX, another platform) leaves the options as they are:
only compile time is at stake.
"""

import contextlib
import threading

_OPTION = b"xla_cpu_disable_tiled_emitter"
_local = threading.local()
_installed = False
_install_lock = threading.Lock()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _message(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


# CompileOptionsProto.executable_build_options (3) -> ExecutableBuildOptionsProto.
# debug_options (3) -> DebugOptions.xla_backend_extra_options (500), a map entry
# {key: 1, value: 2}. Parsing serialized options with this appended merges it in.
_ENTRY = _message(1, _OPTION) + _message(2, b"")
_EXTRA = _message(3, _message(3, _message(500, _ENTRY)))


def with_option(options):
    """`options` (an `xla_client.CompileOptions`) with the tiled emitter turned off,
    or `options` unchanged where that cannot be done."""
    try:
        merged = type(options).ParseFromString(options.SerializeAsString() + _EXTRA)
    except Exception:
        return options
    return merged if _OPTION in merged.SerializeAsString() else options


def _install() -> None:
    """Wraps JAX's `get_compile_options` (once) so that it applies `with_option`
    for CPU compiles made inside `without_tiled_emitter`; another JAX without that
    function is left as it is."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        try:
            from jax._src import compiler
        except ImportError:
            return
        original = getattr(compiler, "get_compile_options", None)
        if original is None:
            return

        def get_compile_options(*args, **kwargs):
            options = original(*args, **kwargs)
            if getattr(_local, "active", 0):
                backend = kwargs.get("backend")
                if getattr(backend, "platform", None) == "cpu":
                    options = with_option(options)
            return options

        compiler.get_compile_options = get_compile_options


@contextlib.contextmanager
def without_tiled_emitter():
    """XLA:CPU compiles made by this thread inside skip the tiled emitter."""
    _install()
    _local.active = getattr(_local, "active", 0) + 1
    try:
        yield
    finally:
        _local.active -= 1
