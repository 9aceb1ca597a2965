"""Nothing in a run directory is trusted before it is checked: settings
edited after training, stray or damaged log records, damaged entries of the directory,
a directory that cannot be written, and library arguments of the wrong kind. Numbered
as the cases of the issue; the trained runs are shared by the file and copied per
test."""

import json
import os
import pathlib
import shutil
import stat
import tempfile

import jax.random as jr
import numpy as np
import pytest
from _cli import fails

import cnftrace
from cnftrace._io import atomic_write
from cnftrace.cli import main
from cnftrace.cli._commands import read_metrics
from cnftrace.training import fit

TINY = ["--steps", "40", "--batch-size", "16", "--width", "8", "--depth", "1"]
TINY += ["--checkpoint-every", "10", "--no-progress", "--rtol", "1e-3"]
TINY += ["--atol", "1e-3"]
# Other settings, and a run of 10 steps: its checkpoint is older than any of RUN's.
OTHER = ["--activation", "tanh", "--t1", "0.9"]


def _permissions_apply() -> bool:
    """Whether this process is refused writing into a directory made read-only: root
    (anyone with CAP_DAC_OVERRIDE) is not."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o555)
        try:
            open(os.path.join(d, "probe"), "w").close()
        except PermissionError:
            return True
        finally:
            os.chmod(d, 0o755)
    return False


READ_ONLY_WORKS = _permissions_apply()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished 40-step run, and one of other settings (checkpoints at 20, 30, 40)."""
    root = tmp_path_factory.mktemp("runs")
    paths = {"run": str(root / "run"), "other": str(root / "other")}
    assert main(["train", "--run-dir", paths["run"], *TINY]) == 0
    assert main(["train", "--run-dir", paths["other"], *TINY, *OTHER]) == 0
    return paths


def _copy(runs, tmp_path, name="run") -> str:
    run = str(tmp_path / name)
    shutil.copytree(runs[name], run)
    return run


def _contents(directory: str) -> dict[str, bytes | str]:
    """Every entry under `directory`: a regular file's bytes, or what it is."""
    found = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(parent, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode):
                with open(path, "rb") as f:
                    found[path] = f.read()
            else:
                found[path] = stat.filemode(mode)
    return found


def _ckpt(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", f"step_{step:09d}.ckpt")


def _history(run: str, name="metrics.jsonl") -> list[str]:
    with open(os.path.join(run, name)) as f:
        return f.read().splitlines()


# 1. eval, sample, plot and load check config.json against the checkpoints.


def _edit_config(run, **changes):
    path = os.path.join(run, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(config | changes, f)


@pytest.mark.parametrize(
    "damage, names",
    [
        (lambda run, other: _edit_config(run, activation="tanh"), ["activation"]),
        (lambda run, other: _edit_config(run, t1=0.9), ["t1"]),
        (lambda run, other: _edit_config(run, data="2spirals"), ["data"]),
        # Another run's newest checkpoint copied over this one's ...
        (lambda run, other: shutil.copy(_ckpt(other, 40), _ckpt(run, 40)),
         ["activation", "t1"]),
        # ... or only its oldest: a directory that mixes two runs is not trusted.
        (lambda run, other: shutil.copy(_ckpt(other, 20), _ckpt(run, 20)),
         ["activation", "t1"]),
    ],
    ids=["activation", "t1", "data", "newest-checkpoint", "oldest-checkpoint"],
)  # fmt: skip
def test_settings_edited_after_training_are_refused(
    runs, tmp_path, capsys, damage, names
):
    run = _copy(runs, tmp_path)
    damage(run, runs["other"])
    before = _contents(run)
    config = os.path.join(run, "config.json")
    for argv in (["eval", run], ["sample", run], ["plot", run]):
        line = fails(
            argv, capsys, 1, config, "checkpoints", "restore", *names, stdout=""
        )
        assert "step_0000000" in line
    with pytest.raises(cnftrace.CheckpointError, match=names[0]):
        cnftrace.load(run)
    assert _contents(run) == before  # nothing written


def test_a_run_loads_where_its_settings_agree(runs):
    flow, info = cnftrace.load(runs["run"], return_info=True)
    assert info["step"] == 40 and info["config"]["activation"] == "silu"


# 2. Logs: a later record never replaces a checkpointed one; bad lines are skipped
#    with one warning naming the file and the line.


def _final_loss(run) -> float:
    record = json.loads(_history(run)[-1])
    assert record["step"] == 40
    return record["loss"]


@pytest.mark.parametrize(
    "stray",
    [{"step": 40}, {"step": 40, "loss": 0.0, "nfe": 1, "nfe_backward": 0,
                    "seconds": 0.0, "skipped": 0}],
    ids=["fields-missing", "well-formed"],
)  # fmt: skip
def test_a_stray_history_record_never_replaces_a_checkpointed_one(
    runs, tmp_path, capsys, stray
):
    run = _copy(runs, tmp_path)
    loss = _final_loss(run)
    lines = _history(run)
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(stray) + "\n")
    assert main(["train", "--run-dir", run, *TINY]) == 0
    out, err = capsys.readouterr()
    assert f"had already trained 40 steps; final loss {loss:.4f}" in out
    assert _history(run) == lines  # the real record is kept, the stray one gone
    warned = [w for w in err.splitlines() if "metrics.jsonl" in w]
    assert len(warned) == 1 and "line 41" in warned[0], err


def test_damaged_history_lines_are_skipped_with_one_warning(runs, tmp_path, capsys):
    run = _copy(runs, tmp_path)
    history = os.path.join(run, "metrics.jsonl")
    lines = _history(run)
    bad = [json.dumps(json.loads(lines[i]) | {"loss": "abc"}) for i in (9, 10)]
    damaged = lines[:9] + bad + ["{not json", "[1, 2]"] + lines[11:]
    with open(history, "w") as f:
        f.write("\n".join(damaged) + "\n")
    assert main(["train", "--run-dir", run, *TINY]) == 0
    out, err = capsys.readouterr()
    assert "final loss" in out
    warned = err.strip().splitlines()
    assert len(warned) == 1, err
    assert history in warned[0] and "line 10" in warned[0] and "4 lines" in warned[0]
    # The same file as `cnftrace plot` reads it (steps 10 and 11, damaged above,
    # were dropped by that `train`): a loss that is not a number.
    metrics = history
    lines = _history(run)
    lines[2] = json.dumps(json.loads(lines[2]) | {"loss": "abc"})
    with open(metrics, "w") as f:
        f.write("\n".join(lines) + "\n")
    records = read_metrics(run)
    assert [r["step"] for r in records] == [
        s for s in range(1, 41) if s not in (3, 10, 11)
    ]
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1 and metrics in warned[0] and "line 3" in warned[0]
    import cnftrace.plot

    cnftrace.plot.plot_training_curves(records, str(tmp_path / "training.png"))


# 3. Damaged entries of the run directory: one line, nothing written.


def test_a_lock_that_is_a_fifo_and_checkpoints_that_are_a_file(runs, tmp_path, capsys):
    run = _copy(runs, tmp_path)
    lock = os.path.join(run, ".lock")
    os.mkfifo(lock)
    before = _contents(run)
    fails(
        ["train", "--run-dir", run, *TINY],
        capsys,
        1,
        lock,
        "a FIFO",
        "remove",
        stdout="",
    )
    assert _contents(run) == before
    os.remove(lock)
    checkpoints = os.path.join(run, "checkpoints")
    shutil.rmtree(checkpoints)
    with open(checkpoints, "w") as f:
        f.write("not a directory")
    before = _contents(run)
    config = os.path.join(run, "config.json")
    written = os.stat(config).st_mtime_ns
    fails(
        ["train", "--run-dir", run, *TINY],
        capsys,
        1,
        checkpoints,
        "a regular file, not a directory",
        "move it away",
        stdout="",
    )
    assert _contents(run) == before
    assert os.stat(config).st_mtime_ns == written  # not even rewritten alike
    # fit, given the file as its checkpoint directory (a path of any kind).
    flow = cnftrace.CNF(lambda t, z, a: -z, 2)
    data = np.ones((4, 2), np.float32)
    with pytest.raises(cnftrace.CheckpointError, match="not a directory"):
        fit(flow, data, key=jr.key(0), checkpoints=pathlib.Path(checkpoints))


# 4. A directory that cannot be written: refused before the work, by the target's
#    name.


@pytest.mark.skipif(not READ_ONLY_WORKS, reason="root writes into read-only dirs")
def test_a_read_only_run_directory_is_refused_before_the_work(runs, tmp_path, capsys):
    run = _copy(runs, tmp_path)
    os.chmod(run, 0o555)
    try:
        eval_json = os.path.join(run, "eval.json")
        fails(["eval", run], capsys, 1, eval_json, f"chmod u+w {run}", stdout="")
        samples = os.path.join(run, "samples.npy")
        fails(["sample", run], capsys, 1, samples, "--out", stdout="")
        out = os.path.join(run, "x.csv")
        fails(["sample", run, "--out", out], capsys, 1, out, "--out", stdout="")
        plots = os.path.join(run, "plots")
        fails(["plot", run], capsys, 1, plots, f"chmod u+w {run}", stdout="")
        # The atomic writer names its target, not its temporary file.
        target = os.path.join(run, "f.json")
        with pytest.raises(PermissionError) as e:
            atomic_write(target, b"{}")
        assert e.value.filename == target and ".tmp-" not in str(e.value)
    finally:
        os.chmod(run, 0o755)
    assert not os.path.exists(os.path.join(run, "plots"))


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="no /sys")
def test_the_atomic_writer_names_its_target():
    target = "/sys/cnftrace-test.json"  # read-only, even to root
    with pytest.raises(OSError) as e:
        atomic_write(target, b"{}")
    assert e.value.filename == target and e.value.filename2 is None
    assert ".tmp-" not in str(e.value)


# 5. The library: arguments of the wrong kind, paths that do not exist.


def test_library_arguments_of_the_wrong_kind(tmp_path):
    data = np.ones((4, 2), np.float32)
    with pytest.raises(TypeError, match=r"`flow` must be a cnftrace flow"):
        fit(lambda x: x, data, key=jr.key(0))
    flow = cnftrace.CNF(lambda t, z, a: -z, 2)
    with pytest.raises(TypeError, match=r"`checkpoints`.*cnftrace.Checkpoints"):
        fit(flow, data, key=jr.key(0), checkpoints=5)
    missing = str(tmp_path / "missing")
    for path, like in ((missing, None), (missing, flow), (missing + ".eqx", flow)):
        with pytest.raises(FileNotFoundError, match=f"{path} does not exist"):
            cnftrace.load(path, like=like)
    # `save` writes the path it is given; `load` reads it back from there.
    mlp = cnftrace.mlp_flow(2, key=jr.key(0), width=4, depth=1)
    path = cnftrace.save(str(tmp_path / "flow"), mlp)
    assert cnftrace.load(path, like=mlp).event_shape == (2,)


def test_a_float32_run_loads_in_a_64_bit_process(tmp_path):
    # Trained as users run it (float32); opened where 64-bit mode is on, as in this
    # suite. It was refused as "another architecture" (its dtypes differ).
    import jax

    run = str(tmp_path / "run32")
    argv = ["train", "--run-dir", run, "--steps", "2", "--batch-size", "16"]
    argv += ["--width", "8", "--depth", "1", "--no-progress"]
    with jax.enable_x64(False):
        assert main(argv) == 0
        flow32 = cnftrace.load(run)
        x = jr.normal(jr.key(0), (5, 2))
        expected = np.asarray(flow32.log_prob(x))
    assert jax.config.jax_enable_x64
    flow = cnftrace.load(run)
    leaves = jax.tree.leaves(flow)
    floats = {
        leaf.dtype
        for leaf in leaves
        if hasattr(leaf, "dtype") and leaf.dtype.kind == "f"
    }
    assert floats == {np.dtype(np.float32)}, floats
    got = np.asarray(flow.log_prob(np.asarray(x, np.float32)))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
