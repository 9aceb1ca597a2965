"""The persistent compilation cache (a second process loads what the first compiled)
and the checks that moved out of the compiled programs to keep them cacheable."""

import json
import os
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from _flows import small_flow
from _paths import SCRIPTS
from jax.experimental.compilation_cache import compilation_cache

import cnftrace

PROBE = os.path.join(
    SCRIPTS,
    "cache_probe.py",
)
# The training step (one program) and the evaluation's program.
STEP, EVAL = "jit_loop_step", "jit__log_prob_nfe_result"


def _probe(cache_dir):
    # Neither the suite's cache nor its opt-out (CNFTRACE_COMPILATION_CACHE=0, as
    # when the suite is timed from cold): the probe turns on a cache of its own.
    suite = ("JAX_COMPILATION_CACHE_DIR", "CNFTRACE_COMPILATION_CACHE")
    env = {k: v for k, v in os.environ.items() if k not in suite}
    proc = subprocess.run(
        [sys.executable, PROBE, str(cache_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_training_step_and_the_evaluation(tmp_path):
    """Slow (two processes, each compiling or loading a training step): the cache is
    only seen across processes."""
    cache = tmp_path / "cache"
    cold = _probe(cache)
    assert cold["directory"] == str(cache) and cold["cache_dir"] == str(cache)
    assert cold["loaded"] == [] and {STEP, EVAL} <= set(cold["missed"])
    # No host callback in either program, so both were written.
    stored = os.listdir(cache)
    for name in (STEP, EVAL):
        assert any(f.startswith(name + "-") for f in stored), (name, stored)
    # Two steps, one program: the first state is committed to its device like the
    # ones the step returns (else the second step compiles again).
    assert cold["missed"].count(STEP) == 1, cold["missed"]
    assert cold["traced"] == 1
    warm = _probe(cache)
    # The warm process traces its step again, and loads it compiled.
    assert {STEP, EVAL} <= set(warm["loaded"])
    assert not {STEP, EVAL} & set(warm["missed"])
    assert warm["traced"] == 1
    assert warm["losses"] == cold["losses"] and len(cold["losses"]) == 2
    assert cold["finite"] and warm["finite"]


@pytest.fixture
def jax_cache_settings():
    """The test changes JAX's cache settings of this process: put them back."""
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_compilation_cache_max_size",
    )
    saved = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_the_cache_directory_and_the_opt_out(tmp_path, monkeypatch, jax_cache_settings):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("CNFTRACE_COMPILATION_CACHE", "off")
    assert cnftrace.enable_compilation_cache(str(tmp_path)) is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.delenv("CNFTRACE_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cnftrace.default_cache_dir() == str(tmp_path / "xdg" / "cnftrace" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    home = os.path.join(os.path.expanduser("~"), ".cache", "cnftrace", "jax")
    assert cnftrace.default_cache_dir() == home
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.warns(UserWarning, match="cannot create .*JAX_COMPILATION_CACHE_DIR"):
        assert cnftrace.enable_compilation_cache(str(blocked / "cache")) is None
    assert jax.config.jax_compilation_cache_dir is None
    chosen = str(tmp_path / "chosen")
    assert cnftrace.enable_compilation_cache(chosen) == chosen
    assert jax.config.jax_compilation_cache_dir == chosen and os.path.isdir(chosen)
    # A directory already chosen for JAX is kept.
    assert cnftrace.enable_compilation_cache(str(tmp_path / "other")) == chosen


def test_a_directory_chosen_for_jax_keeps_jaxs_size_setting(
    tmp_path, monkeypatch, jax_cache_settings
):
    """The size limit goes only with a directory that `enable_compilation_cache`
    chose: JAX's eviction reads each entry's access-time file, which a process
    without a limit does not write, so a limit set by some of the processes writing
    to a user's directory (JAX's default is none) would stop every later write."""
    from cnftrace.store._cache import MAX_BYTES

    monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
    jax.config.update("jax_compilation_cache_max_size", -1)
    users = str(tmp_path / "users")
    jax.config.update("jax_compilation_cache_dir", users)
    assert cnftrace.enable_compilation_cache(str(tmp_path / "ours")) == users
    assert jax.config.jax_compilation_cache_max_size == -1
    jax.config.update("jax_compilation_cache_dir", None)
    ours = str(tmp_path / "ours")
    assert cnftrace.enable_compilation_cache(ours) == ours
    assert jax.config.jax_compilation_cache_max_size == MAX_BYTES


def test_a_bad_generated_batch_stops_training_naming_its_step():
    flow = small_flow(width=4, field=cnftrace.MLPField)

    def data(key, n):  # about one batch in three is all NaN
        return jnp.where(jr.uniform(key) < 0.3, jnp.nan, 1.0) * jr.normal(key, (n, 2))

    trainer = cnftrace.Trainer(
        data, key=jr.key(3), batch_size=4, objective="fm", optimizer=optax.sgd(1e-2)
    )
    state = trainer.init(flow)
    skipped, flows = [], []
    for _ in range(8):
        state, info = trainer.step(state)
        skipped.append(bool(info["skipped"]))
        flows.append(state.flow)
    first_bad = skipped.index(True) + 1  # 1-based, like the state's steps
    assert first_bad > 1, "pick a key whose first batch is clean"
    assert int(state.bad_batch_step) == first_bad and all(skipped[first_bad - 1 :])
    # Updated before the bad batch, frozen from it on.
    leaves = lambda f: jax.tree_util.tree_leaves(eqx.filter(f, eqx.is_inexact_array))
    assert not np.array_equal(leaves(flows[0])[0], leaves(flow)[0])
    for a, b in zip(leaves(flows[first_bad - 2]), leaves(state.flow)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(
        cnftrace.TrainingError, match=f"batch of step {first_bad}, .*NaN or inf"
    ):
        trainer.check(state)


def test_log_prob_batched_checks_on_the_host():
    flow = small_flow(width=4, field=cnftrace.MLPField)
    x = np.zeros((5, 2))
    x[3, 1] = np.inf
    with pytest.raises(ValueError, match="`x` contains NaN or inf"):
        cnftrace.log_prob_batched(flow, x)
    with pytest.raises(ValueError, match="must be a batch"):
        cnftrace.log_prob_batched(flow, np.zeros(2))
    stiff = cnftrace.CNF(flow.vector_field, 2, max_steps=1, rtol=1e-9, atol=1e-9)
    with pytest.raises(cnftrace.SolverError, match="samples 0 to 4 of `x`"):
        cnftrace.log_prob_batched(stiff, np.ones((5, 2)), batch_size=5)
