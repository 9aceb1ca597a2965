"""Data-parallel training: 4 devices against 1, checkpoints across device counts, the
CLI's --devices and --distributed, and the batch-size rule.

The multi-device runs happen in child processes started with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (this file run as a script), so
the rest of the suite keeps its single device. One child does all the 4-device work,
to pay for one start-up and few compilations; two more, of 2 devices each, stand in
for a 2-host cluster. Every run is compared with the same run on this process's one
device.
"""

import json
import os
import shutil
import socket
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from _flows import small_flow
from _paths import TESTS

import cnftrace
from cnftrace.cli import main
from cnftrace.runs import load_run
from cnftrace.store._checkpoint import key_to_data, load_checkpoint
from cnftrace.training._fit import checkpoint_config
from cnftrace.training._parallel import check_batch_size, resolve_mesh

BATCH = 32
STEPS = 3
KEY = 2
CLI = ["--steps", "3", "--width", "8", "--depth", "1", "--batch-size", "16"]
CLI += ["--checkpoint-every", "3", "--no-progress", "--print-every", "1"]


def _flow():
    """A tiny float32 flow (whatever the x64 setting)."""
    flow = small_flow(t1=0.5)
    f32 = lambda x: x.astype(jnp.float32) if eqx.is_inexact_array(x) else x
    return jax.tree_util.tree_map(f32, flow)


def _data():
    x = jr.normal(jr.key(1), (256, 2)) * jnp.array([[1.0, 0.5]]) + 1.0
    return np.asarray(x, np.float32)


def _fit(checkpoint_dir=None, keep=3, **kwargs):
    """Three steps with a checkpoint after each and an exact-trace validation at the
    end (whose parameters are the ones returned)."""
    settings = dict(steps=STEPS, batch_size=BATCH, progress=False)
    if checkpoint_dir is not None:
        settings["checkpoints"] = cnftrace.Checkpoints(
            checkpoint_dir, every=1, keep=keep
        )
    validation = np.asarray(_data()[:16] + 0.1)
    return cnftrace.fit(
        _flow(), _data(), key=jr.key(KEY), validation=validation, **settings | kwargs
    )


def _arrays(tree) -> list[np.ndarray]:
    return [
        np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))
    ]


def _child_env(devices: int) -> dict:
    # Added to the suite's own XLA flags (conftest.py), not in place of them; the
    # tests' shared modules (tests/_flows.py) on the child's path.
    flags = os.environ.get("XLA_FLAGS", "")
    flags = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=path)


def _load(path):
    """A checkpoint of `_fit` loaded in this (one-device) process."""
    flow = _flow()
    params = eqx.filter(flow, eqx.is_inexact_array)
    # fit's default optimiser for a run of STEPS steps.
    opt_state = cnftrace.warmup_cosine_adam(STEPS, 3e-3).init(params)
    like = (params, opt_state, key_to_data(jr.key(KEY)), params)
    config = checkpoint_config(flow, BATCH, cnftrace.MaximumLikelihood(), None)
    return load_checkpoint(path, like, config)


def _ckpt(directory, step: int) -> str:
    return os.path.join(directory, f"step_{step:09d}.ckpt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 3-step run on this process's one device, and the child's 4-device work."""
    tmp = str(tmp_path_factory.mktemp("parallel"))
    one = os.path.join(tmp, "one")
    flow, history = _fit(checkpoint_dir=one, keep=STEPS)
    # The 4-device run resumes from this run's first checkpoint.
    os.makedirs(os.path.join(tmp, "four"))
    shutil.copy(_ckpt(one, 1), os.path.join(tmp, "four"))
    # The history lives beside the checkpoints (cut back to step 1 on resume).
    shutil.copy(os.path.join(one, "history.jsonl"), os.path.join(tmp, "four"))
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "child", tmp],
        env=_child_env(4),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    return {"tmp": tmp, "flow": flow, "history": history, "child": child}


def test_four_devices_give_the_numbers_of_one(runs):
    child, history = runs["child"], runs["history"]
    assert child["devices"] == 4
    # Steps 2 and 3 ran on 4 devices, from step 1's state written on one device.
    assert child["history"]["step"] == [1, 2, 3]
    assert child["history"]["nfe"] == history["nfe"]
    np.testing.assert_allclose(child["history"]["loss"], history["loss"], rtol=1e-6)
    # The validations ran before training (step 0, kept in the checkpoint's history)
    # and at the end, on the parameters trained on 4 devices.
    assert child["history"]["val_step"] == history["val_step"] == [0, STEPS]
    np.testing.assert_allclose(
        child["history"]["val_nll"], history["val_nll"], rtol=1e-5
    )
    expected = _arrays(runs["flow"])
    got = [np.asarray(x, np.float32) for x in child["params"]]
    assert [x.shape for x in got] == [x.shape for x in expected]
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    # The trained parameters are replicated over the 4 devices...
    assert child["param_shardings"] == [[4, True]] * len(expected)
    # ... and a batch is split four ways.
    assert child["batch_shards"] == [[8, 2]] * 4


def test_checkpoint_from_four_devices_loads_on_one(runs):
    tmp = runs["tmp"]
    step, (params, opt_state, _, _) = _load(_ckpt(os.path.join(tmp, "four"), STEPS))
    ref_step, (ref_params, ref_opt_state, _, _) = _load(
        _ckpt(os.path.join(tmp, "one"), STEPS)
    )
    assert step == ref_step == STEPS
    assert jax.device_count() == 1
    for got, want in zip(
        _arrays((params, opt_state)), _arrays((ref_params, ref_opt_state))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    devices = {
        d for x in jax.tree_util.tree_leaves((params, opt_state)) for d in x.devices()
    }
    assert devices == {jax.devices()[0]}


def test_batch_size_must_split_over_the_devices(runs):
    message = runs["child"]["batch_error"]
    assert "`batch_size` must be a multiple of the number of devices" in message
    assert "(4)" in message and "got 30" in message and "28 or 32" in message
    with pytest.raises(ValueError, match=r"got 2\. Use a batch size of 4 "):
        check_batch_size(2, 4)
    with pytest.raises(ValueError, match="or train on 3 device"):
        check_batch_size(6, 4)
    check_batch_size(64, 8)


def test_bad_mesh_and_devices_are_named():
    with pytest.raises(TypeError, match="`mesh` must be None"):
        cnftrace.fit(_flow(), _data(), key=jr.key(0), steps=1, mesh="gpus")
    with pytest.raises(ValueError, match="`devices` asks for 5 devices, but 1"):
        cnftrace.data_mesh(5)
    mesh = cnftrace.data_mesh()
    assert mesh.axis_names == ("data",) and mesh.size == jax.device_count()
    with pytest.raises(SystemExit):
        main(["train", "--run-dir", "x", "--devices", "0"])
    with pytest.raises(SystemExit, match="--devices 2 asks for more devices"):
        main(["train", "--run-dir", "x", "--devices", "2"])


def test_distributed_flag_reads_the_environment(monkeypatch):
    monkeypatch.setenv("JAX_PROCESS_ID", "first")
    with pytest.raises(SystemExit, match="JAX_PROCESS_ID='first' is not an integer"):
        main(["train", "--run-dir", "x", "--distributed"])


def test_cli_trains_on_four_devices_and_loads_on_one(runs):
    child = runs["child"]
    assert [r["step"] for r in child["cli_metrics"]] == [1, 2, 3]
    assert (
        "--batch-size must be a multiple of the number of devices in --devices (3)"
        in (child["cli_error"])
    )
    assert "15 or 18" in child["cli_error"]
    # The run directory written on 4 devices loads here, on one.
    run = load_run(os.path.join(runs["tmp"], "cli"))
    flow, step = run.flow, run.step
    assert step == 3 and "devices" not in run.config.stored()
    assert all(np.all(np.isfinite(x)) for x in _arrays(flow))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes, each compiling the training step
def test_two_processes_give_the_numbers_of_one(runs, tmp_path):
    """Two processes of 2 devices each, joined by `jax.distributed.initialize` (a
    2-host cluster on this machine), train like one device; only process 0 writes
    checkpoints and calls `on_log`."""
    env = dict(_child_env(2), JAX_COORDINATOR_ADDRESS=f"localhost:{_free_port()}")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "process",
                str(tmp_path),
                str(i),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    history = runs["history"]
    for result in results:
        assert result["devices"] == 4 and result["history"]["nfe"] == history["nfe"]
        np.testing.assert_allclose(
            result["history"]["loss"], history["loss"], rtol=1e-6
        )
        np.testing.assert_allclose(
            result["history"]["val_nll"], history["val_nll"], rtol=1e-5
        )
        for g, e in zip(result["params"], _arrays(runs["flow"])):
            np.testing.assert_allclose(
                np.asarray(g, np.float32), e, rtol=1e-5, atol=1e-6
            )
    # Process 0 logs the validation before training (step 0), then every step.
    assert [r["logged"] for r in results] == [[0, 1, 2, 3], []]
    checkpoints = sorted(os.listdir(tmp_path / "ckpt"))
    assert checkpoints == [
        "history.jsonl",
        *(f"step_{i:09d}.ckpt" for i in (1, 2, 3)),
    ]


def _fit_ot_fm(mesh) -> list[float]:
    """The losses of three OT flow-matching steps (the pairing runs on the host)."""
    settings = dict(steps=STEPS, batch_size=BATCH, progress=False, mesh=mesh)
    _, history = cnftrace.fit(
        _flow(), _data(), key=jr.key(KEY), objective="ot-fm", **settings
    )
    return history["loss"]


def test_ot_flow_matching_on_four_devices(runs):
    np.testing.assert_allclose(runs["child"]["fm_loss"], _fit_ot_fm(None), rtol=1e-6)


def _process(tmp: str, index: int) -> None:
    """Process `index` of 2 in `test_two_processes_give_the_numbers_of_one`."""
    jax.distributed.initialize(num_processes=2, process_id=index)
    logged = []
    flow, history = _fit(
        checkpoint_dir=os.path.join(tmp, "ckpt"),
        keep=STEPS,
        mesh="all",
        on_log=lambda record: logged.append(record["step"]),
    )
    params = [x.tolist() for x in _arrays(flow)]
    out = {"devices": jax.device_count(), "history": history, "params": params}
    print(json.dumps(dict(out, logged=logged)))


def _child(tmp: str) -> None:
    """The 4-device side of the fixture `runs`; prints one JSON line."""
    out: dict = {"devices": jax.device_count()}
    # A 2 x 2 mesh with explicit axes, as `jax.make_mesh` builds: the batch is split
    # over both axes, four ways.
    mesh = jax.make_mesh((2, 2), ("hosts", "local"))
    flow, history = _fit(checkpoint_dir=os.path.join(tmp, "four"), mesh=mesh)
    out["history"] = history
    out["params"] = [x.tolist() for x in _arrays(flow)]
    out["param_shardings"] = [
        [len(x.sharding.device_set), x.sharding.is_fully_replicated]
        for x in jax.tree_util.tree_leaves(eqx.filter(flow, eqx.is_array))
    ]
    parallel = resolve_mesh(mesh)
    batch = jax.jit(parallel.shard_batch)(jnp.zeros((BATCH, 2)))
    out["batch_shards"] = [list(s.data.shape) for s in batch.addressable_shards]
    out["fm_loss"] = _fit_ot_fm(mesh)
    try:
        _fit(batch_size=30, mesh=cnftrace.data_mesh())
    except ValueError as e:
        out["batch_error"] = str(e)

    # This run checks what --devices does, so it trains by flow matching, which
    # compiles in seconds less: the maximum-likelihood step on 4 devices is trained
    # above (2 x 2 mesh) and by the 2-process test (the one-axis mesh of --devices).
    run = os.path.join(tmp, "cli")
    cli = [*CLI, "--objective", "fm", "--devices", "all"]
    assert main(["train", "--run-dir", run, *cli]) == 0
    with open(os.path.join(run, "metrics.jsonl")) as f:
        out["cli_metrics"] = [json.loads(line) for line in f]
    try:
        main(["train", "--run-dir", run + "3", *CLI, "--devices", "3"])
    except SystemExit as e:
        out["cli_error"] = str(e)
    print(json.dumps(out))


if __name__ == "__main__":
    # The settings of tests/conftest.py, so that the numbers match the parent's.
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_numpy_rank_promotion", "raise")
    if sys.argv[1] == "child":
        _child(sys.argv[2])
    else:
        _process(sys.argv[2], int(sys.argv[3]))
