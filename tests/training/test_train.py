"""fit, evaluate_nll and the 2-D plot, on tiny settings."""

import functools
import os

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from _flows import LOWERED, small_flow, traces_of

import cnftrace
from cnftrace import plot as cnftrace_plot
from cnftrace.plot import plot_flow_2d
from cnftrace.training._optim import horizon_rate


def _flow(key, **kwargs):
    return small_flow(key, t1=0.5, rtol=1e-4, atol=1e-4, **kwargs)


# The tests that train a `_flow` with the default objective use one batch size, so
# that `fit` compiles the gradient of their training step once for the file (it keeps
# that program by the flow, the objective and the shapes, not by the parameters'
# values). `fit` also keeps a step's other two programs for a second run with the
# same data function or array shape, optimiser object and batch size: the tests share
# `_gaussian` and `_ADAM` where they can, so that one run compiles for several.
BATCH = 32
_ADAM = optax.adam(1e-2)


def _gaussian(key, n):
    """N(mu, s^2 I) with mu = (1, -0.5) and s = 0.6."""
    return jnp.array([[1.0, -0.5]]) + 0.6 * jr.normal(key, (n, 2))


def test_fit_improves_gaussian_fit_and_is_reproducible():
    # Data: N(mu, s^2 I); the flow starts near the identity (standard normal).
    flow = _flow(jr.key(0))
    # As many test samples as the validation test's, so that their evaluations are
    # one program. The NLL improves by 0.92 here (by 0.74 to 0.94 over three seeds of
    # the flow, the run and the test set, with 300 or 2000 test samples and batches
    # of 32 or 128): far beyond the 0.3 asked.
    test = _gaussian(jr.key(99), 300)
    before = cnftrace.evaluate_nll(flow, test)
    run = functools.partial(
        cnftrace.fit,
        flow,
        _gaussian,
        key=jr.key(1),
        steps=60,
        batch_size=BATCH,
        optimizer=_ADAM,
        progress=False,
    )
    trained, hist = run()
    after = cnftrace.evaluate_nll(trained, test)
    assert after.mean < before.mean - 0.3
    assert len(hist["loss"]) == 60 and all(np.isfinite(hist["loss"]))
    assert all(n > 0 for n in hist["nfe"])
    # The caller's flow is untouched (the step donates only copies).
    np.testing.assert_array_equal(cnftrace.evaluate_nll(flow, test).mean, before.mean)
    # The same key gives the same run, with the first run's compiled step: nothing
    # is lowered to XLA again.
    (_, hist2), lowered = traces_of(run, LOWERED)
    assert hist2["loss"] == hist["loss"]
    assert lowered == []
    # The trained flow keeps its evaluation estimator (exact).
    assert isinstance(trained.estimator, cnftrace.Exact)


@pytest.mark.parametrize("x64", [False, True])
def test_warmup_cosine_schedule_is_the_closed_form_with_its_horizon_in_the_state(x64):
    """The rate of `warmup_cosine_adam` at every step: a linear warmup from 0 to
    `lr`, then a cosine to `end` at the horizon, held there (float64 to rounding;
    in float32, optax's own schedule to rounding). Its warmup and horizon are arrays
    of the state: runs of 5 and 500 steps lower one update program."""
    lr, end = 3e-3, 3e-3 / 20
    at_counts = functools.partial(horizon_rate, lr=lr, end=end)
    rates = jax.jit(jax.vmap(at_counts, in_axes=(0, None, None)))
    c = np.arange(310.0)  # every count up to past the longest horizon here
    with jax.enable_x64(x64):
        count = jnp.arange(310, dtype=jnp.int32)
        for steps, warmup in [(1, None), (7, None), (300, None), (300, 0), (10, 9)]:
            opt = cnftrace.warmup_cosine_adam(steps, lr, warmup=warmup)
            state = opt.init(jnp.zeros(3))[-1]  # the schedule's, after clip and Adam
            w, h = int(state.warmup), int(state.horizon)
            assert h == max(steps, 2) and w == (
                min(50, max(1, steps // 4)) if warmup is None else warmup
            )
            # One program for every schedule: the warmup and horizon are arguments.
            rate = rates(count, state.warmup, state.horizon)
            since = np.minimum(c - w, h - w)
            cosine = end + (lr - end) * (1 + np.cos(np.pi * since / (h - w))) / 2
            closed = np.where(c < w, lr * c / max(w, 1), cosine)
            if x64:
                np.testing.assert_allclose(rate, closed, rtol=1e-13, atol=0)
            else:
                schedule = optax.warmup_cosine_decay_schedule(0.0, lr, w, h, end)
                # optax's, compiled as in a training step, to float32's rounding
                # (its constants let XLA round a few rates otherwise).
                optaxs = jax.jit(jax.vmap(schedule))(count)
                np.testing.assert_allclose(rate, optaxs, rtol=1e-6, atol=1e-12)
                np.testing.assert_allclose(rate, closed, rtol=2e-6, atol=1e-12)
        assert cnftrace.warmup_cosine_adam(5, lr) is cnftrace.warmup_cosine_adam(5, lr)
        params = jnp.zeros(3)
        texts = []
        for steps in (5, 500):
            opt = cnftrace.warmup_cosine_adam(steps, lr)
            update = jax.jit(opt.update)
            texts.append(update.lower(params, opt.init(params), params).as_text())
        assert texts[0] == texts[1]
    with pytest.raises(ValueError, match="`warmup`"):
        cnftrace.warmup_cosine_adam(10, lr, warmup=10)


def test_validation_returns_the_best_model_and_stops_early():
    # Train towards N(3, 0.5^2) but validate on N(0, 1), which the initial flow (near
    # the identity) already fits well: the validation NLL can only get worse.
    data = lambda k, n: 3.0 + 0.5 * jr.normal(k, (n, 2))  # noqa: E731
    val = jr.normal(jr.key(20), (300, 2))
    flow = _flow(jr.key(21))
    runs = {}
    for significance in (1.0, 0.0):
        runs[significance] = cnftrace.fit(
            flow,
            data,
            key=jr.key(22),
            steps=40,
            batch_size=BATCH,
            optimizer=optax.adam(3e-2),
            progress=False,
            validation=cnftrace.Validation(
                val, every=2, patience=2, significance=significance
            ),
        )
    for significance, (trained, hist) in runs.items():
        nll = np.asarray(hist["val_nll"])
        steps = hist["val_step"]
        # Validated as given (step 0), then every 2 steps until 2 validations in a
        # row did not replace the best.
        assert steps[0] == 0 and steps == list(range(0, 2 * len(steps), 2))
        assert steps[-1] < 40
        kept = cnftrace.evaluate_nll(trained, val).mean
        if significance == 0:  # any lower NLL replaces the best: the lowest is kept
            best = int(np.argmin(nll))
            assert len(nll) - 1 - best == 2
            np.testing.assert_allclose(kept, nll[best])
    # With the default rule, step 2's gain of under a thousandth of a nat (within
    # one standard error of the paired difference) does not replace the flow as
    # given: it is kept, and the run stops 2 validations after step 0.
    nll = np.asarray(runs[1.0][1]["val_nll"])
    assert nll[1] < nll[0] and runs[1.0][1]["val_step"] == [0, 2, 4]
    np.testing.assert_allclose(cnftrace.evaluate_nll(runs[1.0][0], val).mean, nll[0])


def test_fit_from_array():
    x = jr.normal(jr.key(2), (300, 2)) * 0.5
    trained, hist = cnftrace.fit(
        _flow(jr.key(3)), x, key=jr.key(4), steps=3, batch_size=BATCH,
        optimizer=_ADAM, progress=False,
    )  # fmt: skip
    assert len(hist["step"]) == 3


def test_fit_bad_arguments():
    flow = _flow(jr.key(0))
    with pytest.raises(ValueError, match="steps"):
        cnftrace.fit(flow, jnp.ones((10, 2)), key=jr.key(0), steps=0)
    with pytest.raises(ValueError, match="batch_size"):
        cnftrace.fit(flow, jnp.ones((10, 2)), key=jr.key(0), batch_size=-1)
    with pytest.raises(ValueError, match="data"):
        cnftrace.fit(flow, jnp.ones(10), key=jr.key(0))


def test_fit_refuses_bad_data_before_training(tmp_path):
    flow = _flow(jr.key(0))
    good = np.asarray(jr.normal(jr.key(1), (50, 2)))
    nan_row = good.copy()
    nan_row[7, 1] = np.nan
    cases = [
        (dict(data=nan_row), ValueError, r"`data` has 1 sample.*index 7"),
        (dict(data=good[:, :1]), ValueError, r"`data` holds samples of shape \(1,\)"),
        (dict(data=good[:0]), ValueError, "`data` must be an array"),
        (dict(data=good.astype(int)), TypeError, "`data` has dtype"),
        (dict(data=good, validation=nan_row), ValueError, "`validation` has 1"),
        (
            dict(data=lambda k, n: jr.normal(k, (n, 3))),
            ValueError,
            r"`data\(key, batch_size\)` holds samples of shape \(3,\)",
        ),
    ]
    for kwargs, error, match in cases:
        ckpt = os.path.join(tmp_path, "ckpt")
        with pytest.raises(error, match=match):
            cnftrace.fit(
                flow, key=jr.key(0), steps=2, progress=False, checkpoints=ckpt,
                **kwargs,
            )  # fmt: skip
        assert not os.path.exists(ckpt)  # nothing was written

    # A generator whose batches are bad stops the step before any update: the
    # up-front check traces it (its shapes, its dependence on the key), never runs it.
    def turns_bad(k, n):
        return jr.normal(k, (n, 2)) * jnp.nan

    with pytest.raises(Exception, match="NaN or inf"):
        cnftrace.fit(
            flow, turns_bad, key=jr.key(0), steps=2, batch_size=BATCH, progress=False
        )


def test_history_counts_backward_evaluations():
    x = np.asarray(jr.normal(jr.key(2), (300, 2)))
    _, hist = cnftrace.fit(
        _flow(jr.key(3)), x, key=jr.key(4), steps=3, batch_size=BATCH,
        optimizer=_ADAM, progress=False,
    )  # fmt: skip
    # Tsit5: 1 + 6 per step differentiated, 1 (initial step) not: nfe - 1.
    assert hist["nfe_backward"] == [n - 1 for n in hist["nfe"]]
    backsolve = _flow(jr.key(3), adjoint=diffrax.BacksolveAdjoint())
    _, hist = cnftrace.fit(
        backsolve, x, key=jr.key(4), steps=2, batch_size=16, progress=False
    )
    assert hist["nfe_backward"] == [-1, -1] and min(hist["nfe"]) > 0


def test_backward_evaluations_are_counted_through_nested_chains():
    x = np.asarray(jr.normal(jr.key(2), (300, 2)))
    keys = jr.split(jr.key(3), 3)
    inner = cnftrace.Chain([_flow(keys[0]), _flow(keys[1])])
    nested = cnftrace.Chain([inner, _flow(keys[2])])
    assert len(nested.blocks) == 3 and nested.blocks[1] is inner.flows[1]
    _, hist = cnftrace.fit(
        nested, x, key=jr.key(4), steps=2, batch_size=16, progress=False
    )
    assert hist["nfe_backward"] == [n - 3 for n in hist["nfe"]]


def test_trainer_step_is_public_and_state_is_replaced():
    flow = _flow(jr.key(8))
    trainer = cnftrace.Trainer(
        _gaussian, key=jr.key(1), optimizer=_ADAM, batch_size=BATCH
    )
    state = trainer.init(flow)
    losses = []
    for _ in range(3):
        new, info = trainer.step(state)
        assert int(new.step) == int(state.step) + 1  # the old state is untouched
        state = new
        losses.append(float(info["loss"]))
    trainer.check(state)
    # The same run through `fit` (which donates the state to the step).
    _, hist = cnftrace.fit(
        flow, _gaussian, key=jr.key(1), steps=3, batch_size=BATCH,
        optimizer=_ADAM, progress=False,
    )  # fmt: skip
    assert hist["loss"] == losses


def _scripted_step(skipped_steps, calls):
    """A stand-in for `fit`'s training step: step n's loss is n, the steps in
    `skipped_steps` are skipped, and each call deletes the counters of the state it
    was given, as donating them to the device would."""

    def step(trainer, state):
        n, failures, total = (
            int(x) for x in (state.step, state.failures, state.skipped)
        )
        calls.append(n + 1)
        skip = n + 1 in skipped_steps
        counters = dict(
            step=n + 1,
            failures=failures + 1 if skip else 0,
            skipped=total + skip,
            failed_step=0,
            bad_batch_step=0,
        )
        for name in counters:
            getattr(state, name).delete()
        new = eqx.tree_at(
            lambda s: [getattr(s, name) for name in counters],
            state,
            [jnp.asarray(v, jnp.int32) for v in counters.values()],
        )
        info = dict(loss=jnp.asarray(n + 1.0), nfe=jnp.asarray(7))
        info.update(nfe_backward=jnp.asarray(6), skipped=jnp.asarray(skip))
        return new, info

    return step


def test_fit_logs_each_step_from_its_own_counters(monkeypatch):
    """`fit` logs a step once the next one is dispatched (its state is then donated):
    every record and failure check must come from that step's own counters."""
    calls, records = [], []
    scripted = _scripted_step({3, 4}, calls)
    monkeypatch.setattr(
        cnftrace.training._fit,
        "LoopStep",
        lambda trainer, _: lambda state: scripted(trainer, state),
    )
    run = lambda **kw: cnftrace.fit(  # noqa: E731
        _flow(jr.key(8)), _gaussian, key=jr.key(1), batch_size=BATCH,
        optimizer=_ADAM, progress=False, on_log=records.append, **kw,
    )  # fmt: skip
    _, hist = run(steps=7, max_failures=3)
    assert calls == [1, 2, 3, 4, 5, 6, 7]
    assert [r["step"] for r in records] == hist["step"] == [1, 2, 3, 4, 5, 6, 7]
    assert hist["loss"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert hist["skipped"] == [0, 0, 1, 2, 2, 2, 2]
    # Two skipped steps in a row stop the run at the second; step 5 had already
    # been dispatched when step 4 was checked.
    calls.clear(), records.clear()
    with pytest.raises(
        cnftrace.TrainingError, match=r"2 consecutive .*\(up to step 4\)"
    ):
        run(steps=7, max_failures=2)
    assert calls == [1, 2, 3, 4, 5]
    assert [(r["step"], r["skipped"]) for r in records] == [(1, 0), (2, 0), (3, 1)]


def test_solver_failure_freezes_the_state_and_names_the_step():
    field = cnftrace.ConcatSquashMLP(2, width=4, depth=1, key=jr.key(0))
    # Loose enough for the first steps; a large learning rate then stiffens it.
    flow = cnftrace.CNF(field, 2, t1=0.5, rtol=1e-9, atol=1e-9, max_steps=3)
    trainer = cnftrace.Trainer(
        lambda k, n: jr.normal(k, (n, 2)),
        key=jr.key(1),
        objective=cnftrace.MaximumLikelihood(tolerance=None),  # the flow's 1e-9
    )
    state = trainer.init(flow)
    for _ in range(2):
        state, _ = trainer.step(state)
    assert int(state.failed_step) == 1 and int(state.step) == 2
    assert bool(state.result == diffrax.RESULTS.max_steps_reached)
    # Nothing was updated after the failure.
    params = lambda f: jax.tree.leaves(eqx.filter(f, eqx.is_inexact_array))  # noqa: E731
    for a, b in zip(params(state.flow), params(flow)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(cnftrace.TrainingError, match="at training step 1 "):
        trainer.check(state)
    # Outside training, the same solve raises diffrax's message.
    with pytest.raises(cnftrace.SolverError, match="maximum number of solver steps"):
        flow.log_prob(jnp.ones((4, 2)))
    # As one program: run op by op, the solve's first evaluation and the statistics
    # compiled some ninety small ones.
    transform = eqx.filter_jit(
        lambda f, x: f.transform(x, inverse=False, log_det=True, key=None)
    )
    stats = transform(flow, jnp.ones((4, 2)))[2]
    assert bool(stats.max_steps_reached[0]) and bool(stats.failed[0])


def test_log_prob_batched_matches_log_prob():
    flow = _flow(jr.key(5))
    x = jr.normal(jr.key(6), (25, 2))
    (logp, nfe), traces = traces_of(
        lambda: cnftrace.log_prob_batched(flow, x, batch_size=10, return_nfe=True)
    )
    # Chunks of another size take other adaptive steps: equal to the tolerance.
    np.testing.assert_allclose(logp, flow.log_prob(x), rtol=1e-6)
    assert logp.shape == (25,) and nfe > 0
    # The last chunk (5 rows) is filled up to 10 with its own rows repeated: one
    # program for the three chunks, and the values of the 5 rows solved alone (the
    # repeats leave the maximum over samples, and so the steps, as they were).
    assert traces.count("_log_prob_nfe_result") <= 1, traces
    np.testing.assert_allclose(logp[20:], flow.log_prob(x[20:]), rtol=1e-13)
    # The exact trace draws nothing: a key (fit's validation passes one) is dropped,
    # so the evaluation with it is the program already compiled without it.
    keyed, traces = traces_of(
        lambda: cnftrace.log_prob_batched(flow, x, batch_size=10, key=jr.key(0))
    )
    np.testing.assert_array_equal(keyed, logp)
    assert traces == []


def test_save_and_load_a_flow(tmp_path):
    flow = _flow(jr.key(7))
    path = cnftrace.save(str(tmp_path / "flow.eqx"), flow)
    loaded = cnftrace.load(path, like=_flow(jr.key(8)))
    x = jr.normal(jr.key(9), (5, 2))
    np.testing.assert_array_equal(loaded.log_prob(x), flow.log_prob(x))
    with pytest.raises(ValueError, match="like="):
        cnftrace.load(path)
    with pytest.raises(cnftrace.CheckpointError, match="another architecture"):
        cnftrace.load(path, like=cnftrace.mlp_flow(2, key=jr.key(0), width=4))


def test_evaluate_nll_matches_log_prob_and_closed_form():
    # A linear flow A z: exact NLL in closed form.
    class Linear(eqx.Module):
        a: jax.Array

        def __call__(self, t, z, args):
            return self.a @ z

    a = jnp.array([[0.3, 0.1], [-0.2, 0.1]])
    flow = cnftrace.CNF(Linear(a), 2, t1=1.0, rtol=1e-10, atol=1e-10)
    x = jr.normal(jr.key(5), (1234, 2))
    nll = cnftrace.evaluate_nll(flow, x, batch_size=500)
    lp = flow.log_prob(x)
    np.testing.assert_allclose(nll.mean, -jnp.mean(lp), rtol=1e-12)
    np.testing.assert_allclose(
        nll.stderr, jnp.std(lp, ddof=1) / np.sqrt(1234), rtol=1e-10
    )
    z = x @ jax.scipy.linalg.expm(a).T
    ref = -jnp.mean(jnp.sum(jax.scipy.stats.norm.logpdf(z), axis=-1) + jnp.trace(a))
    np.testing.assert_allclose(nll.mean, ref, rtol=1e-8)
    assert nll.nfe > 0
    with pytest.raises(ValueError, match="at least 2"):
        cnftrace.evaluate_nll(flow, x[:1])


def test_plot_writes_png(tmp_path):
    flow = _flow(jr.key(6))
    data = np.asarray(jr.normal(jr.key(7), (500, 2)))
    path = os.path.join(tmp_path, "sub", "flow.png")
    out = plot_flow_2d(flow, data, data, path, resolution=20)
    assert out == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert [p for p in os.listdir(os.path.dirname(path))] == ["flow.png"]


def test_plot_samples_says_where_data_and_samples_are(tmp_path, monkeypatch):
    """The grid's title says which triangle holds the data and, when the table has
    more columns than the grid shows, which columns those are."""
    titles = []
    save = cnftrace_plot._atomic_savefig

    def saving(fig, path):
        titles.append(fig.get_suptitle())
        save(fig, path)

    monkeypatch.setattr(cnftrace_plot, "_atomic_savefig", saving)
    rng = np.random.default_rng(0)
    wide, narrow = rng.normal(size=(50, 5)), rng.normal(size=(50, 2))
    path = str(tmp_path / "pairs.png")
    cnftrace_plot.plot_samples(wide, wide, path, title="step 3")
    cnftrace_plot.plot_samples(narrow, narrow, path)
    assert titles == [
        "step 3\ndata (below the diagonal) and samples (above), the first 4 of 5 "
        "columns",
        "data (below the diagonal) and samples (above)",
    ]
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_training_curves_show_the_validation_and_a_running_mean(tmp_path, monkeypatch):
    """Both forms of a run's records (fit's history, and the command line's
    metrics.jsonl lines with a validation in a step's record or on its own) give
    the same curves: each step's loss, its running mean, and the validation NLL
    with its standard error."""
    figures = []
    monkeypatch.setattr(
        cnftrace_plot, "_atomic_savefig", lambda fig, path: figures.append(fig)
    )
    steps = list(range(1, 101))
    loss = [3.0 + 0.01 * (s % 7) for s in steps]
    history = {
        "step": steps,
        "loss": loss,
        "nfe": [20] * 100,
        "val_step": [50, 100],
        "val_nll": [3.2, 3.1],
        "val_stderr": [0.05, 0.04],
    }
    lines = [{"step": s, "loss": v, "nfe": 20} for s, v in zip(steps, loss)]
    lines[49] = dict(lines[49], val_nll=3.2, val_stderr=0.05)
    lines.append({"step": 100, "val_nll": 3.1, "val_stderr": 0.04})
    for records in (history, lines):
        cnftrace_plot.plot_training_curves(records, str(tmp_path / "t.png"))
    for fig in figures:
        ax = fig.axes[0]
        labels = ax.get_legend_handles_labels()[1]
        assert labels == [
            "training NLL",
            "training NLL, mean of 2 steps",
            "validation NLL",
        ]
        raw, mean = ax.get_lines()[:2]
        np.testing.assert_allclose(raw.get_ydata(), loss)
        np.testing.assert_allclose(
            mean.get_ydata(), (np.array(loss[:-1]) + np.array(loss[1:])) / 2
        )
        validation = ax.containers[0]  # the error bars
        points = validation.lines[0]
        np.testing.assert_allclose(np.asarray(points.get_xdata(), float), [50, 100])
        np.testing.assert_allclose(np.asarray(points.get_ydata(), float), [3.2, 3.1])
