"""Checkpoints: atomic files, checksums, config checks, resume after SIGKILL, and
skipped non-finite steps."""

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

import cnftrace
from cnftrace.store._checkpoint import (
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_for_resume.py")


def _run(run_dir, log, steps=40):
    out = subprocess.run(
        [sys.executable, SCRIPT, run_dir, log, str(steps)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_resume_after_sigkill_gives_the_same_losses(tmp_path):
    """Two processes, not three: the process that is killed first trains the
    reference, the same run uninterrupted, in a directory of its own (a process
    pays about 2 s of imports, and the first one the compiles, before it trains)."""
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

    resumed = _run(run_dir, log)
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


def test_resume_with_another_key_is_refused(tmp_path):
    field = cnftrace.ConcatSquashMLP(2, width=4, depth=1, key=jr.key(0))
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-3, atol=1e-3)
    data = lambda k, n: jr.normal(k, (n, 2))  # noqa: E731
    kwargs = dict(steps=2, batch_size=8, progress=False, checkpoints=str(tmp_path))
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
