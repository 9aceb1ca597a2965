"""The default recipe: the settings that follow the data's dimension and
size, chosen in one place and used by `MLPField`, `mlp_flow`, `fit` and `cnftrace
train`. Nothing here trains: `fit` is replaced by a recorder where a run starts."""

import inspect
import json
import os

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest

import cnftrace
from cnftrace._defaults import default_batch_size
from cnftrace.cli import main

TINY = ["--steps", "2", "--batch-size", "16", "--depth", "1", "--no-progress"]


@pytest.mark.parametrize(
    "dim, width", [(1, 64), (2, 64), (5, 64), (6, 256), (10, 256), (11, 256),
                   (20, 256), (21, 512), (40, 512), (64, 512), (784, 512)],
)  # fmt: skip
def test_the_width_follows_the_dimension(dim, width):
    recipe = cnftrace.default_recipe(dim)
    assert recipe.width == width and recipe.depth == 3
    assert f"{dim} dimension" in recipe.reason and f"width {width}" in recipe.reason
    # Trainer's default batch is the recipe's, and so is fit's without a time budget
    # (with one, `default_batch_size` decides: test_budget.py).
    batch = inspect.signature(cnftrace.Trainer).parameters["batch_size"].default
    assert batch == recipe.batch_size
    assert inspect.signature(cnftrace.fit).parameters["batch_size"].default is None
    for likelihood in (True, False):
        assert default_batch_size(dim, likelihood, False, "cpu") == recipe.batch_size
    small = cnftrace.default_recipe(dim, rows=400)
    assert "400 training rows" in small.reason and small.width == 64
    # A table gets 64 units per 2,000 training rows (at least 64), up to the above.
    assert cnftrace.default_recipe(dim, rows=8000).width == min(width, 256)
    assert cnftrace.default_recipe(dim, rows=10**6).width == width


def test_the_recipe_refuses_what_is_not_a_size():
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="`dim` must be an int >= 1"):
            cnftrace.default_recipe(bad)
    with pytest.raises(ValueError, match="`rows` must be an int >= 1"):
        cnftrace.default_recipe(3, rows=0)


def _hidden_width(field) -> int:
    return field.mlp.layers[0].weight.shape[0]


def test_the_models_take_their_width_from_the_recipe():
    # Built abstractly (`eqx.filter_eval_shape` runs the same constructors on
    # shapes): only the layers' shapes are checked, and initialising the weights of
    # each size compiled a few dozen small programs.
    key = jr.key(0)
    shaped = eqx.filter_eval_shape
    assert _hidden_width(shaped(cnftrace.MLPField, 10, key=key)) == 256
    assert _hidden_width(shaped(cnftrace.MLPField, 2, key=key)) == 64
    assert _hidden_width(shaped(cnftrace.MLPField, 10, 32, key=key)) == 32  # kept
    assert _hidden_width(shaped(cnftrace.mlp_flow, 21, key=key).vector_field) == 512
    blocks = shaped(cnftrace.mlp_flow, 12, key=key, blocks=2, depth=1).blocks
    assert [_hidden_width(b.vector_field) for b in blocks] == [256, 256]
    squash = shaped(cnftrace.mlp_flow, 10, key=key, field="concatsquash").vector_field
    assert squash.layers[0].linear.weight.shape[0] == 256
    with pytest.raises(ValueError, match="`dim` must be an int >= 1"):
        cnftrace.mlp_flow(0, key=key)


def _train(tmp_path, monkeypatch, argv, capsys):
    """`cnftrace train ARGV` up to `fit`: the flow it would train, and stdout."""
    seen = {}

    def recorder(flow, data, *, steps, **kwargs):
        seen["flow"] = flow
        return flow, {"step": [steps], "loss": [0.0]}

    monkeypatch.setattr("cnftrace.cli._train.fit", recorder)
    with jax.enable_x64(False):
        assert main(["train", *argv, *TINY]) == 0
    return seen["flow"], capsys.readouterr().out


def test_train_says_what_it_chose_and_records_it(tmp_path, monkeypatch, capsys):
    x = np.random.default_rng(0).standard_normal((5000, 7))
    data = str(tmp_path / "seven.csv")
    np.savetxt(data, x, delimiter=",", fmt="%.6f")
    run = str(tmp_path / "run")
    # The standard normal base where the base is not what is checked (fitting one
    # takes seconds on these rows).
    argv = ["--data", data, "--run-dir", run, "--base", "normal"]
    flow, out = _train(tmp_path, monkeypatch, argv, capsys)
    assert _hidden_width(flow.vector_field) == 128
    lines = [ln for ln in out.splitlines() if ln.startswith("recipe:")]
    assert len(lines) == 1
    assert "7 dimensions, 4000 training rows: width 128" in lines[0]
    with open(os.path.join(run, "config.json")) as f:
        stored = json.load(f)
    assert stored["width"] == 128 and stored["recipe"] in lines[0]
    # A width given on the command line is the user's: nothing is chosen.
    run2 = str(tmp_path / "run2")
    argv = ["--data", data, "--run-dir", run2, "--width", "8"]
    flow, out = _train(tmp_path, monkeypatch, argv, capsys)
    assert _hidden_width(flow.vector_field) == 8 and "width" not in out
    with open(os.path.join(run2, "config.json")) as f:  # only the base was chosen
        assert json.load(f)["recipe"].startswith("base: ")
    # A small table keeps the field narrow, and says why.
    small = str(tmp_path / "small.csv")
    np.savetxt(small, x[:300], delimiter=",", fmt="%.6f")
    argv = ["--data", small, "--run-dir", str(tmp_path / "run3"), "--base", "normal"]
    flow, out = _train(tmp_path, monkeypatch, argv, capsys)
    assert _hidden_width(flow.vector_field) == 64
    assert "240 training rows: width 64 (a table this size" in out


def test_a_run_begun_under_an_older_recipe_resumes_as_it_began(
    tmp_path, monkeypatch, capsys
):
    x = np.random.default_rng(1).standard_normal((5000, 10))
    data = str(tmp_path / "ten.csv")
    np.savetxt(data, x, delimiter=",", fmt="%.6f")
    run = str(tmp_path / "run")
    # The standard normal base: fitting one (seconds on these rows) is no part of
    # what is resumed here.
    argv = ["--data", data, "--run-dir", run, "--base", "normal"]
    # A run 64 wide, as an older recipe chose (today's gives these rows 128).
    _train(tmp_path, monkeypatch, [*argv, "--width", "64"], capsys)
    flow, out = _train(tmp_path, monkeypatch, argv, capsys)  # no --width: resumes
    assert _hidden_width(flow.vector_field) == 64  # not the 128 of today's recipe
    # Another width given on purpose is still another run.
    with pytest.raises(SystemExit):
        _train(tmp_path, monkeypatch, [*argv, "--width", "128"], capsys)
    assert "width: 64 there, 128 now" in capsys.readouterr().err


@pytest.mark.optimized  # 400 training steps of the recipe's field, and validations
def test_the_small_data_default_does_not_overfit(tmp_path):
    # 300 rows of a density whose log-density is known, trained with the command
    # line's defaults for a file (its recipe, validation every 50 steps, early
    # stopping) for a fixed 400 steps: the flow it keeps must hold up on the test
    # rows it never saw, within a bar of the truth and below the Gaussian's NLL.
    density = cnftrace.datasets.warped_product(2, seed=3)
    x = np.asarray(density.sample(jr.key(7), 300, np.float64))
    data = str(tmp_path / "small.csv")
    np.savetxt(data, x, delimiter=",", fmt="%.17g")
    run = str(tmp_path / "run")
    argv = ["train", "--data", data, "--run-dir", run, "--steps", "400"]
    argv += ["--checkpoint-every", "50", "--no-progress"]
    with jax.enable_x64(False):
        assert main(argv) == 0
        flow = cnftrace.load(run)
        test = cnftrace.datasets.split_table(x, seed=0).test
        model = cnftrace.log_prob_batched(flow, test)
    truth = np.asarray(density.log_prob(test))
    gap = float(np.mean(truth - model))
    baseline = cnftrace.datasets.gaussian_baseline_nll(
        cnftrace.datasets.split_table(x, seed=0).train, test
    )
    assert gap < 0.35, gap  # the truth's NLL is about 2.1 nats
    assert -model.mean() < baseline, (-model.mean(), baseline)


def test_weight_decay_reaches_the_command_lines_optimizer():
    """`--weight-decay` makes the run's Adam an AdamW: with a zero gradient, after
    the warmup, each step shrinks every parameter by `lr_t * weight_decay`."""
    from cnftrace.runs._build import run_optimizer
    from cnftrace.runs._config import RunConfig

    params = {"w": jax.numpy.asarray([1.0, -2.0, 4.0], jax.numpy.float64)}
    zero = {"w": jax.numpy.zeros(3, jax.numpy.float64)}
    for decay in (0.0, 0.5):
        config = RunConfig(run_dir="unused", steps=400, lr=1e-2, weight_decay=decay)
        opt = run_optimizer(config)
        state = opt.init(params)
        p = params
        for _ in range(60):  # past the 50-step warmup
            updates, state = opt.update(zero, state, p)
            p = jax.tree_util.tree_map(lambda a, b: a + b, p, updates)
        updates, _ = opt.update(zero, state, p)
        # The schedule's rate at step 60 of 400 (cosine from 1e-2 to 5e-4 after 50).
        lr = 5e-4 + 0.5 * (1e-2 - 5e-4) * (1 + np.cos(np.pi * 10 / 350))
        np.testing.assert_allclose(
            np.asarray(updates["w"]),
            -lr * decay * np.asarray(p["w"]),
            rtol=1e-6,  # the schedule is computed in float32
            atol=0,
        )
        if decay:
            assert np.all(np.abs(np.asarray(p["w"])) < np.abs(np.asarray(params["w"])))


def test_zero_last_starts_the_flow_as_the_identity():
    """`mlp_flow(..., zero_last=True)` (the command line's `--zero-last`): before
    training, the flow's log-density is the standard normal's, exactly."""
    x = np.random.default_rng(1).standard_normal((5, 3))
    for field in ("mlp", "concatsquash"):
        flow = cnftrace.mlp_flow(3, key=jr.key(0), field=field, width=8, zero_last=True)
        logp = np.asarray(flow.log_prob(x), np.float64)
        normal = -0.5 * (x**2).sum(-1) - 1.5 * np.log(2 * np.pi)
        np.testing.assert_allclose(logp, normal, rtol=0, atol=1e-10)
        moved = cnftrace.mlp_flow(3, key=jr.key(0), field=field, width=8)
        assert np.max(np.abs(np.asarray(moved.log_prob(x)) - normal)) > 1e-3
