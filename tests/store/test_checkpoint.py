"""Checkpoints: atomic files, checksums, config checks, resume after SIGKILL,
skipped non-finite steps, pruning that keeps good files over unreadable newer ones,
and forged or special files skipped without being read."""

import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from _paths import SCRIPTS

import cnftrace
from cnftrace.store._checkpoint import (
    _leaf_specs,
    checkpoint_path,
    encode_checkpoint,
    latest_good_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

SCRIPT = os.path.join(
    SCRIPTS,
    "train_for_resume.py",
)


def _resume_here(run_dir, log):
    """The losses of the script's run, resumed in this process with JAX's settings
    of the script's process (float32: the suite's float64 is off there)."""
    spec = importlib.util.spec_from_file_location("train_for_resume", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    with jax.enable_x64(False):
        return script.train(run_dir, log, 40, 0.0)


def test_resume_after_sigkill_gives_the_same_losses(tmp_path):
    """One process, killed: it first trains the reference, the same run
    uninterrupted, in a directory of its own, then the run that is killed (a
    process pays about 2 s of imports, and the compiles, before it trains). The run
    resumes in this process, from what the killed one left on disk."""
    run_dir, log = str(tmp_path / "run"), str(tmp_path / "run.jsonl")
    ref_dir = str(tmp_path / "ref")
    # 0.1 s a step: 30 steps left after step 10 take 3 s, far longer than the 50 ms
    # between polls, so the kill lands mid-run even on a fast, idle machine.
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, run_dir, log, "40", "0.1", ref_dir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline:
        steps = [s for s, _ in list_checkpoints(run_dir)]
        if steps and max(steps) >= 10:
            break
        if proc.poll() is not None:
            pytest.fail("the training process ended before it could be killed")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(s for s, _ in list_checkpoints(run_dir))
    assert 10 <= killed_at < 40, killed_at
    # Written before the killed run began.
    with open(os.path.join(ref_dir, "losses.json")) as f:
        reference = json.load(f)
    assert len(reference) == 40

    resumed = _resume_here(run_dir, log)
    assert resumed == reference  # exactly the same, step for step
    # The log of the killed process and the resumed one agree with the reference too.
    with open(log) as f:
        logged = {}
        for line in f:
            rec = json.loads(line)
            logged[rec["step"]] = rec["loss"]
    for step, loss in logged.items():
        assert loss == reference[step - 1]
    assert [s for s, _ in list_checkpoints(run_dir)] == [35, 40]  # keep=2
    # fit's own history file, cut back to the checkpoint on resume: each step once.
    with open(os.path.join(run_dir, "history.jsonl")) as f:
        history = [json.loads(line) for line in f]
    assert [r["step"] for r in history] == list(range(1, 41))
    assert [r["loss"] for r in history] == reference


def _state():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.float32)}
    return params, jax.random.key_data(jr.key(3))


def test_round_trip_and_keep(tmp_path):
    d = str(tmp_path)
    state = _state()
    for step in [10, 20, 30, 40]:
        save_checkpoint(d, step, state, {"a": 1}, keep=3)
    assert [s for s, _ in list_checkpoints(d)] == [20, 30, 40]
    assert not [n for n in os.listdir(d) if n.startswith(".tmp")]
    like = jax.tree_util.tree_map(jnp.zeros_like, state)
    step, loaded = load_checkpoint(list_checkpoints(d)[-1][1], like, {"a": 1})
    assert step == 40
    for a, b in zip(
        jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(state)
    ):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corruption_is_detected_and_resume_falls_back(tmp_path, damage):
    d = str(tmp_path)
    state = _state()
    save_checkpoint(d, 10, state, {"a": 1})
    newer = jax.tree_util.tree_map(lambda x: x + 1, state)
    path = save_checkpoint(d, 20, newer, {"a": 1})
    with open(path, "rb") as f:
        data = f.read()
    if damage == "truncate":
        data = data[: len(data) - 7]
    else:
        data = data[:-3] + bytes([data[-3] ^ 0xFF]) + data[-2:]
    with open(path, "wb") as f:
        f.write(data)
    like = jax.tree_util.tree_map(jnp.zeros_like, state)
    with pytest.raises(cnftrace.CheckpointError, match="truncated|corrupted"):
        load_checkpoint(path, like)
    warnings = []
    from cnftrace.store._checkpoint import latest_good_checkpoint

    step, loaded, _ = latest_good_checkpoint(d, like, {"a": 1}, warn=warnings.append)
    assert step == 10 and len(warnings) == 1 and "step_000000020" in warnings[0]
    np.testing.assert_array_equal(loaded[0]["w"], state[0]["w"])


def test_incompatible_config_is_refused_by_name(tmp_path):
    d = str(tmp_path)
    save_checkpoint(d, 5, _state(), {"lr": 0.001, "width": 64})
    like = jax.tree_util.tree_map(jnp.zeros_like, _state())
    with pytest.raises(cnftrace.CheckpointError, match="width: checkpoint has 64"):
        load_checkpoint(list_checkpoints(d)[0][1], like, {"lr": 0.001, "width": 32})


def test_not_a_checkpoint(tmp_path):
    path = tmp_path / "step_000000001.ckpt"
    path.write_bytes(b"hello\nworld")
    with pytest.raises(cnftrace.CheckpointError, match="not a cnftrace checkpoint"):
        load_checkpoint(str(path), _state())


class Poisoned(eqx.Module):
    """A field with finite values whose gradient is NaN: `0 * sqrt(0)` has value 0
    and derivative `0 * inf`."""

    inner: cnftrace.ConcatSquashMLP
    trigger: jax.Array

    def __call__(self, t, z, args):
        scale = 1.0 + 0.0 * jnp.sqrt(self.trigger - 1.0)
        return scale * self.inner(t, z, args)


def test_non_finite_steps_are_skipped_then_training_stops(tmp_path):
    # `jnp.ones(())`, not `jnp.asarray(1.0)`: a weakly typed parameter comes out of
    # the first update strongly typed, and the step compiled again for the second
    # step and the third (3 of the test's 8 s).
    field = Poisoned(
        cnftrace.ConcatSquashMLP(2, width=4, depth=1, key=jr.key(0)), jnp.ones(())
    )
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-3, atol=1e-3, dt0=0.1)
    data = lambda k, n: jr.normal(k, (n, 2))  # noqa: E731
    with pytest.raises(cnftrace.TrainingError, match="3 consecutive"):
        cnftrace.fit(
            flow,
            data,
            key=jr.key(1),
            steps=10,
            batch_size=8,
            progress=False,
            max_failures=3,
            optimizer=optax.adam(1e-3),
            checkpoints=cnftrace.Checkpoints(str(tmp_path), every=1),
        )
    # Every step so far was skipped, so the model never changed; no NaN was written.
    for _, path in list_checkpoints(str(tmp_path)):
        params, static = eqx.partition(flow, eqx.is_inexact_array)
        opt_state = optax.adam(1e-3).init(params)
        like = (params, opt_state, jax.random.key_data(jr.key(1)), params)
        _, (p, _, _, _) = load_checkpoint(path, like)
        for a, b in zip(
            jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(params)
        ):
            np.testing.assert_array_equal(a, b)


# A small run by flow matching (no ODE solve in the step: quick to compile) for the
# tests of resuming that do not depend on the objective. Its optimiser is one object,
# so that `fit` compiles the step once for the tests that share it.
_FM_ADAM = optax.adam(1e-3)


def _fm_run():
    """The flow, the data and `fit`'s settings (but the key) of the shared run."""
    flow = cnftrace.CNF(cnftrace.MLPField(2, width=4, depth=1, key=jr.key(0)), 2)
    data = np.asarray(jr.normal(jr.key(1), (64, 2)))
    return flow, data, dict(batch_size=8, optimizer=_FM_ADAM, objective="fm")


def test_resume_with_another_key_is_refused(tmp_path):
    # The shared run of `_fm_run`: its step program is the one the history test
    # compiles.
    flow, data, kwargs = _fm_run()
    kwargs |= dict(steps=2, progress=False, checkpoints=str(tmp_path))
    cnftrace.fit(flow, data, key=jr.key(1), **kwargs)
    with pytest.raises(cnftrace.CheckpointError, match="another `key`"):
        cnftrace.fit(flow, data, key=jr.key(2), **kwargs)


def test_solver_step_limit_is_reported():
    field = cnftrace.ConcatSquashMLP(2, width=4, depth=1, key=jr.key(0))
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-9, atol=1e-9, max_steps=2)
    with pytest.raises(cnftrace.TrainingError, match="max_steps=2"):
        cnftrace.fit(
            flow,
            lambda k, n: jr.normal(k, (n, 2)),
            key=jr.key(1),
            steps=2,
            batch_size=8,
            progress=False,
            # The solve at the flow's own tolerance, not fit's looser default.
            objective=cnftrace.MaximumLikelihood(tolerance=None),
        )


CONFIG = {"lr": 0.01}


def _vector_state(offset=0.0):
    return {"w": jnp.arange(3, dtype=jnp.float32) + offset}


def _steps(directory):
    return [s for s, _ in list_checkpoints(directory)]


def test_pruning_keeps_fresh_checkpoints_over_unreadable_newer_ones(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30):
        save_checkpoint(d, step, _vector_state(), CONFIG, keep=3)
    for _, path in list_checkpoints(d):
        open(path, "w").close()  # every old checkpoint emptied
    for step in (1, 2, 3):
        save_checkpoint(d, step, _vector_state(step), CONFIG, keep=2)
    # The fresh ones stay; the unreadable newer ones are left alone.
    assert _steps(d) == [2, 3, 10, 20, 30]
    found = latest_good_checkpoint(d, _vector_state(), CONFIG, warn=lambda m: None)
    assert found[0] == 3
    # A good file past them supersedes the unreadable ones, which then go.
    save_checkpoint(d, 40, _vector_state(), CONFIG, keep=2)
    assert _steps(d) == [3, 40]


_READER = """
import json, os, resource, signal, sys
import jax.numpy as jnp
from cnftrace.store._checkpoint import latest_good_checkpoint

like = {"w": jnp.zeros(3, jnp.float32)}
root = sys.argv[1]
latest_good_checkpoint(os.path.join(root, "warm"), like)  # allocate what loads need
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))

def hung(*_):
    raise TimeoutError("the read hung")

signal.signal(signal.SIGALRM, hung)
out = {}
for case in ("fifo", "devzero", "directory"):
    signal.alarm(10)
    warnings = []
    try:
        found = latest_good_checkpoint(
            os.path.join(root, case), like, warn=warnings.append
        )
        out[case] = [found[0], warnings]
    except BaseException as e:
        out[case] = repr(e)
    signal.alarm(0)
print(json.dumps(out))
"""


def test_fifo_device_and_directory_are_skipped_without_reading(tmp_path):
    for case in ("warm", "fifo", "devzero", "directory"):
        d = str(tmp_path / case)
        save_checkpoint(d, 1, _vector_state(), CONFIG)
    os.mkfifo(checkpoint_path(str(tmp_path / "fifo"), 2))
    os.symlink("/dev/zero", checkpoint_path(str(tmp_path / "devzero"), 2))
    os.mkdir(checkpoint_path(str(tmp_path / "directory"), 2))
    out = subprocess.run(
        [sys.executable, "-c", _READER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,  # the child's own alarms fire first; this is the last guard
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    kinds = {"fifo": "a FIFO", "devzero": "a symbolic link", "directory": "a directory"}
    for case, kind in kinds.items():
        assert isinstance(result[case], list), result[case]
        step, warnings = result[case]
        assert step == 1 and len(warnings) == 1 and kind in warnings[0], result[case]


def _forge(d, step, header, payload):
    with open(checkpoint_path(d, step), "wb") as f:
        f.write(encode_checkpoint(header, payload))


def _payload(tree) -> bytes:
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, tree)
    return buffer.getvalue()


@pytest.mark.parametrize("forgery", ["pickle", "shapes", "step", "edited"])
def test_forged_checkpoints_are_skipped_for_the_previous_good_one(tmp_path, forgery):
    d = str(tmp_path)
    save_checkpoint(d, 1, _vector_state(), CONFIG)
    header = {"step": 2, "config": CONFIG, "leaves": _leaf_specs(_vector_state())}
    if forgery == "pickle":  # a pickled object array, checksum recomputed
        buffer = io.BytesIO()
        np.save(buffer, np.array([print, None, 3], dtype=object), allow_pickle=True)
        _forge(d, 2, header, buffer.getvalue())
        reason = "Python objects"
    elif forgery == "shapes":  # other shapes than the header says, checksum redone
        _forge(d, 2, header, _payload({"w": jnp.zeros(5, jnp.float32)}))
        reason = "shape (5,)"
    elif forgery == "step":  # a header whose step is not the file's
        _forge(d, 2, dict(header, step=7), _payload(_vector_state()))
        reason = "holds step 7"
    else:  # the header's step edited in place: the checksum covers the header
        path = save_checkpoint(d, 2, _vector_state(1.0), CONFIG)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data.replace(b'"step": 2', b'"step": 9'))
        reason = "checksum"
    warnings = []
    step, state, _ = latest_good_checkpoint(
        d, _vector_state(), CONFIG, warn=warnings.append
    )
    assert step == 1 and len(warnings) == 1 and reason in warnings[0], warnings
    np.testing.assert_array_equal(state["w"], _vector_state()["w"])


def test_checkpoints_do_not_grow_and_history_survives_resume(tmp_path):
    d = str(tmp_path)
    flow, data, kwargs = _fm_run()
    kwargs |= dict(key=jr.key(2))
    kwargs |= dict(progress=False, checkpoints=cnftrace.Checkpoints(d, every=1, keep=9))
    _, first = cnftrace.fit(flow, data, steps=4, **kwargs)
    sizes = [os.path.getsize(p) for _, p in list_checkpoints(d)]
    assert len(sizes) == 4 and max(sizes) - min(sizes) <= 16, sizes
    # fit(steps=6) resumes at 4 and returns the whole history, each step once.
    _, resumed = cnftrace.fit(flow, data, steps=6, **kwargs)
    assert resumed["step"] == [1, 2, 3, 4, 5, 6]
    assert resumed["loss"][:4] == first["loss"]
