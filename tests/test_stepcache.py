"""The stored training step (cnftrace/_stepcache.py): its key tells apart everything
that changes the traced program and refuses what it cannot describe; entries that
cannot be read are traced again; the store is bounded. That a second process reads
the step back and computes the same is in test_cache.py."""

import functools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace
from cnftrace import _stepcache, _trainer

ARGS = ([jnp.zeros((4, 2))], jnp.zeros((8, 2)), None, jnp.zeros((2,), jnp.uint32))


def _static(flow):
    return eqx.partition(flow, eqx.is_inexact_array)[1]


def _flow(**kwargs):
    return cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1, **kwargs)


def _key(flow, objective=None, args=ARGS):
    objective = objective or cnftrace.MaximumLikelihood()
    return _stepcache.step_key((objective, _static(flow)), args)


def test_the_key_is_the_same_for_equal_models_and_changes_with_each_setting():
    base = _key(_flow())
    assert base is not None and base == _key(_flow())  # built twice, same key
    # Parameter values are inputs, not part of the key.
    assert _key(cnftrace.mlp_flow(2, key=jr.key(5), width=8, depth=1)) == base
    variants = {
        "activation": _key(_flow(activation=jax.nn.softplus)),
        "leaky 0.1": _key(
            _flow(activation=functools.partial(jax.nn.leaky_relu, negative_slope=0.1))
        ),
        "leaky 0.2": _key(
            _flow(activation=functools.partial(jax.nn.leaky_relu, negative_slope=0.2))
        ),
        "rtol": _key(_flow(rtol=1e-4)),
        "t1": _key(_flow(t1=1.0)),
        "solver": _key(_flow(solver="dopri5")),
        "field": _key(_flow(field="concatsquash")),
        "estimator": _key(_flow(estimator=cnftrace.Hutchinson(1, "rademacher"))),
        "max_steps": _key(_flow(max_steps=100)),
        "objective": _key(_flow(), cnftrace.MaximumLikelihood(kinetic_weight=0.1)),
        "batch": _key(_flow(), args=(*ARGS[:1], jnp.zeros((9, 2)), *ARGS[2:])),
        "dtype": _key(
            _flow(), args=(*ARGS[:1], jnp.zeros((8, 2), jnp.float32), *ARGS[2:])
        ),
        "context": _key(_flow(), args=(*ARGS[:2], jnp.zeros((8, 1)), ARGS[3])),
    }
    assert None not in variants.values(), variants
    seen = {base: "base"}
    for name, key in variants.items():
        assert key not in seen, f"{name} has the key of {seen.get(key)}"
        seen[key] = name


def test_the_key_describes_arrays_by_value_and_closures_by_content():
    out_a, out_b = [], []
    _stepcache._describe(np.array([1, 2], np.int32), out_a)
    _stepcache._describe(np.array([1, 3], np.int32), out_b)
    assert out_a != out_b
    assert _stepcache.step_key((np.arange(3),), ARGS) != _stepcache.step_key(
        (np.arange(3) + 1,), ARGS
    )


class _UserField(eqx.Module):
    """Defined outside cnftrace: its code is not in the key."""

    def __call__(self, t, y, args):
        return -y


def test_what_the_key_cannot_describe_is_not_cached():
    assert _stepcache.step_key((_UserField(),), ARGS) is None
    assert _key(_flow(activation=lambda x: jnp.tanh(x))) is None
    assert _stepcache.step_key((object(),), ARGS) is None
    user = cnftrace.CNF(_UserField(), 2)
    assert _key(user) is None


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("CNFTRACE_COMPILATION_CACHE", raising=False)
    saved = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    monkeypatch.setattr(_stepcache, "_LOADED", {})
    yield tmp_path
    jax.config.update("jax_compilation_cache_dir", saved)


def _double(x):
    return (2 * x,)


def test_an_unreadable_entry_is_traced_again_and_replaced(cache_dir):
    static, args = ("a test program", 1), (jnp.arange(3.0),)
    first = _stepcache.exported_grads(_double, static, args)
    assert first is not None and not first.loaded
    path = os.path.join(cache_dir, _stepcache.SUBDIR, first.key + _stepcache.SUFFIX)
    good = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(b"not a program")
    _stepcache._LOADED.clear()
    again = _stepcache.exported_grads(_double, static, args)
    assert not again.loaded and open(path, "rb").read() == good
    _stepcache._LOADED.clear()
    loaded = _stepcache.exported_grads(_double, static, args)
    assert loaded.loaded
    np.testing.assert_array_equal(loaded(*args)[0], [0.0, 2.0, 4.0])


def _saved(program):
    """`program` once its executable has been written, if it is to be."""
    saving = program.save_executable()
    if saving is not None:
        saving.result()
    return program


def _executables(cache_dir):
    found = os.listdir(os.path.join(cache_dir, _stepcache.SUBDIR))
    return [name for name in found if name.endswith(_stepcache.EXE_SUFFIX)]


def test_the_executable_is_stored_only_when_freshly_compiled(cache_dir):
    """XLA:CPU serializes an executable read from JAX's compilation cache without its
    kernels (it fails when run); the store must never hold one."""
    saved = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # all stored
    static, args = ("a compiled test program", 2), (jnp.arange(4.0),)
    try:
        first = _stepcache.exported_grads(_double, static, args)
        np.testing.assert_array_equal(first.executable()(*args)[0], [0, 2, 4, 6])
        # Written once saved (after the first step, in `fit`), and only once.
        assert _executables(cache_dir) == []
        assert not _saved(first).executable_loaded and len(_executables(cache_dir)) == 1
        assert first.save_executable().done() and len(_executables(cache_dir)) == 1
        # Read back by a later `fit`: the executable comes from the store.
        _stepcache._LOADED.clear()
        again = _stepcache.exported_grads(_double, static, args)
        assert again.loaded and again.executable_loaded
        np.testing.assert_array_equal(again.executable()(*args)[0], [0, 2, 4, 6])
        # Without it, the stored program compiles (the first process compiled its
        # own lowering, not the stored form) and its executable is written again.
        [executable] = _executables(cache_dir)
        os.remove(os.path.join(cache_dir, _stepcache.SUBDIR, executable))
        _stepcache._LOADED.clear()
        jax.clear_caches()
        third = _stepcache.exported_grads(_double, static, args)
        np.testing.assert_array_equal(third.executable()(*args)[0], [0, 2, 4, 6])
        assert not _saved(third).executable_loaded and _executables(cache_dir) == [
            executable
        ]
        # Without it once more, JAX's cache serves that compile: nothing is
        # written, and the program still computes the same.
        os.remove(os.path.join(cache_dir, _stepcache.SUBDIR, executable))
        _stepcache._LOADED.clear()
        jax.clear_caches()
        fourth = _stepcache.exported_grads(_double, static, args)
        np.testing.assert_array_equal(fourth.executable()(*args)[0], [0, 2, 4, 6])
        assert not _saved(fourth).executable_loaded and _executables(cache_dir) == []
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)


@pytest.mark.parametrize(
    "variable", ["CNFTRACE_COMPILATION_CACHE", "CNFTRACE_STEP_CACHE"]
)
def test_the_opt_outs_turn_it_off(cache_dir, monkeypatch, variable):
    monkeypatch.setenv(variable, "off")
    assert _stepcache.exported_grads(_double, ("x",), (jnp.ones(2),)) is None
    assert not os.path.exists(os.path.join(cache_dir, _stepcache.SUBDIR))
    monkeypatch.setenv(variable, "1")
    assert _stepcache.exported_grads(_double, ("x",), (jnp.ones(2),)) is not None


def test_the_store_keeps_the_newest_entries_within_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(_stepcache, "MAX_BYTES", 250)
    paths = []
    for i in range(4):
        path = tmp_path / f"{i}{_stepcache.SUFFIX}"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
        paths.append(str(path))
    (tmp_path / "other.txt").write_bytes(b"y" * 1000)  # not an entry: kept
    _stepcache._prune(str(tmp_path), keep=paths[0])
    left = sorted(os.listdir(tmp_path))
    # The oldest go first until the entries fit in 250 bytes, except `keep` (the
    # entry just used); files that are not entries are not counted or touched.
    assert left == sorted(["0.jaxexport", "3.jaxexport", "other.txt"])


def _traced(call):
    """`call()` and the names of the functions JAX traced for it."""
    names = []
    listener = lambda name, *_, fun_name=None, **__: names.append(fun_name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        return call(), names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_fit_through_the_stored_step_computes_what_the_traced_step_does(
    cache_dir, monkeypatch
):
    """float64: the losses and the trained parameters agree to the last digit."""
    flow = cnftrace.CNF(cnftrace.MLPField(2, width=8, depth=1, key=jr.key(0)), 2)
    x = np.asarray(jr.normal(jr.key(3), (64, 2)))

    def train():
        return cnftrace.fit(
            flow, x, key=jr.key(1), steps=3, batch_size=16, log_every=1,
            progress=False,
        )  # fmt: skip

    (stored, stored_history), stored_names = _traced(train)
    # The stored update ran at every step, never the jitted one it falls back on
    # (under x64 too, where the state's types must come out as they went in).
    assert "_update_program" not in stored_names, stored_names
    programs = list(_stepcache._LOADED.values())  # the gradient and the update
    assert len(programs) == 2
    for program in programs:
        path = os.path.join(cache_dir, _stepcache.SUBDIR, program.key)
        assert os.path.exists(path + _stepcache.SUFFIX)
    # A second run, as a new process would, reads both, executables included.
    _stepcache._LOADED.clear()
    jax.clear_caches()
    again, again_history = train()
    assert all(p.loaded and p.executable_loaded for p in _stepcache._LOADED.values())
    np.testing.assert_array_equal(again_history["loss"], stored_history["loss"])
    monkeypatch.setenv("CNFTRACE_COMPILATION_CACHE", "0")
    (traced, traced_history), names = _traced(train)
    # Jitted, each of the step's programs is traced once: the states the step
    # returns have the types (and placement) of the first.
    for name in ("_draw_program", "_grads_program", "_update_program"):
        assert names.count(name) == 1, (name, names.count(name))
    np.testing.assert_array_equal(stored_history["loss"], traced_history["loss"])
    np.testing.assert_array_equal(stored_history["nfe"], traced_history["nfe"])
    for other in (again, traced):
        for a, b in zip(
            jax.tree_util.tree_leaves(eqx.filter(stored, eqx.is_array)),
            jax.tree_util.tree_leaves(eqx.filter(other, eqx.is_array)),
        ):
            np.testing.assert_array_equal(a, b)


def test_a_float32_flow_under_x64_is_stored_and_solves_in_float32(cache_dir):
    """Under x64 (as in these tests) a float32 flow's step used to hold host
    callbacks: its computed first step went to diffrax as a traced `dt0`, whose sign
    diffrax checks at run time. `jax.export` refuses such a program, so every
    process traced and compiled the step again, and JAX's cache kept none of it."""
    assert jax.config.jax_enable_x64
    flow = _flow(dtype=jnp.float32)
    x = np.asarray(jr.normal(jr.key(3), (64, 2)), np.float32)
    trainer = _trainer.Trainer(x, key=jr.key(1), batch_size=16)
    state = trainer.init(flow)
    program = _trainer.step_program(trainer, state)
    assert program is not None and not program.loaded
    batch, ctx, _, key = _trainer._draw(trainer, state)
    leaves = _trainer._grads_input(state.flow)
    info, grads, finite = program.executable()(leaves, batch, ctx, key)
    # The solve's time, and so its state, stays float32 (not promoted to float64).
    assert info["loss"].dtype == jnp.float32 and bool(finite)
    assert all(g.dtype == jnp.float32 for g in grads)


def test_the_step_compiles_without_the_tiled_emitter_and_nothing_else_does():
    """`_compile_options.without_tiled_emitter`: the compile options JAX builds in
    its thread carry XLA:CPU's `xla_cpu_disable_tiled_emitter` (and keep every other
    setting); outside it, or in another thread meanwhile, they do not."""
    import threading

    from jax._src import compiler
    from jax._src.lib import xla_client

    from cnftrace import _compile_options

    option = b"xla_cpu_disable_tiled_emitter"
    plain = xla_client.CompileOptions()
    plain.executable_build_options.debug_options.xla_backend_optimization_level = 1
    merged = _compile_options.with_option(plain)
    assert option in merged.SerializeAsString()
    assert (
        merged.executable_build_options.debug_options.xla_backend_optimization_level
        == 1
    )
    assert option not in plain.SerializeAsString()  # a copy, not the caller's

    backend = jax.devices()[0].client

    def options():
        built = compiler.get_compile_options(1, 1, backend=backend)
        return option in built.SerializeAsString()

    seen = {}
    with _compile_options.without_tiled_emitter():
        seen["inside"] = options()
        other = threading.Thread(target=lambda: seen.setdefault("other", options()))
        other.start()
        other.join()
    seen["after"] = options()
    assert seen == {"inside": True, "other": False, "after": False}
    # A program compiled inside computes what it computes outside, bit for bit.
    fn = jax.jit(lambda x: jnp.tanh(x[:3] * 2.0 + 1.0).sum(0) / 3.0)
    x = jnp.linspace(-2.0, 2.0, 40).reshape(8, 5)
    with _compile_options.without_tiled_emitter():
        inside = fn.lower(x).compile()(x)
    np.testing.assert_array_equal(inside, jax.jit(lambda x: fn(x) + 0.0)(x))
