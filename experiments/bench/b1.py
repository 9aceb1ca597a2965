"""B1, the toy training step, for cnftrace (see `common.py`), and its compute floor.

The step is what a user runs: `cnftrace.fit` on fresh 8gaussians batches, logging
every step (so every step ends with a host sync, as a training loop that prints its
loss does). Iteration times are the gaps between consecutive log records; the first
step, which compiles, is timed from the call of `fit`.

The compute floor prices the measured NFE at the cost of bare jitted evaluations of
the same network at the same batch size: `nfe_fwd * t(f + divergence) + nfe_bwd *
t(gradient of f + divergence)`, the cost of a step with no solver, adjoint or
optimiser overhead at all.
"""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import cnftrace
from cnftrace.datasets import toy_sample
from experiments._common import time_call
from experiments.bench import common


def make_flow(estimator: str, solver: str = "tsit5", seed: int = 0) -> cnftrace.CNF:
    """B1's model: one block, ConcatSquash 2-64-64-64-2 (tanh), T = 0.5, float32."""
    if solver not in ("tsit5", "dopri5"):
        raise ValueError(f"solver must be 'tsit5' or 'dopri5'; got {solver!r}.")
    return cnftrace.mlp_flow(
        2,
        key=jr.key(seed),
        field="concatsquash",
        width=common.B1_WIDTH,
        depth=common.B1_DEPTH,
        t1=common.B1_T1,
        solver=solver,
        rtol=common.B1_TOL,
        atol=common.B1_TOL,
        estimator=make_estimator(estimator),
        dtype=jnp.float32,
    )


def make_estimator(name: str) -> cnftrace.AbstractEstimator:
    """B1's estimators by name: one Rademacher probe, or the exact trace."""
    if name == "exact":
        return cnftrace.Exact()
    if name == "hutchinson":
        return cnftrace.Hutchinson(1, "rademacher")
    raise ValueError(f"estimator must be 'exact' or 'hutchinson'; got {name!r}.")


def _data(key, n):
    return toy_sample("8gaussians", key, n, dtype=jnp.float32)


def cnftrace_b1(
    estimator: str,
    iters: int = common.B1_ITERS,
    batch: int = common.B1_BATCH,
    solver: str = "tsit5",
    seed: int = 0,
) -> dict:
    """B1 for cnftrace: seconds per iteration over B1's window, first-step time and
    NFE forward/backward per iteration (averaged over the window)."""
    if iters < 1:
        raise ValueError(f"iters must be positive; got {iters}.")
    flow = make_flow(estimator, solver, seed)
    _data(jr.key(0), batch).block_until_ready()  # the sampler alone, not the step
    stamps: list[float] = []
    start = time.perf_counter()
    _, history = cnftrace.fit(
        flow,
        _data,
        key=jr.key(seed + 1),
        steps=iters,
        batch_size=batch,
        objective=cnftrace.MaximumLikelihood(make_estimator(estimator), tolerance=None),
        optimizer=optax.adam(common.B1_LR),
        progress=False,
        on_log=lambda record: stamps.append(time.perf_counter()),
    )
    times = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
    return {
        "system": f"cnftrace {cnftrace.__version__}",
        "estimator": estimator,
        "solver": f"{solver}, PI control, max-over-samples RMS norm",
        "s_per_iter": common.window_avg(times),
        "first_step_s": times[0],
        "nfe_fwd": common.window_avg([float(n) for n in history["nfe"]]),
        "nfe_bwd": common.window_avg([float(n) for n in history["nfe_backward"]]),
        "iter_times": times,
    }


def evaluation_costs(estimator: str, batch: int = common.B1_BATCH) -> dict:
    """Seconds per bare jitted evaluation of B1's network at `batch` samples: `f`,
    `f` with the divergence (forward mode, as in the solve), and the gradient with
    respect to the parameters and the state of (f, divergence) against a random
    cotangent (the work of one backward evaluation)."""
    flow = make_flow(estimator)
    term = cnftrace.CNFTerm(flow.vector_field, flow.estimator)
    z = _data(jr.key(1), batch)
    args = term.make_args(z, key=jr.key(2))
    y = term.initial_state(z)
    t = jnp.asarray(0.25, jnp.float32)
    ct = jr.normal(jr.key(3), z.shape, jnp.float32), jr.normal(jr.key(4), z.shape[:1])
    ct = ct[0], ct[1].astype(jnp.float32)

    @eqx.filter_jit
    def plain(field, z):
        return jax.vmap(lambda zi: field(t, zi, None))(z)

    @eqx.filter_jit
    def with_div(term, y, args):
        return term.vf(t, y, args)

    @eqx.filter_jit
    def backward(term, y, args):
        def inner(term, y):
            out = term.vf(t, y, args)
            return sum(jnp.vdot(o, c) for o, c in zip(out, ct))

        return eqx.filter_grad(inner)(term, y)

    calls = {
        "f": (plain, flow.vector_field, z),
        "f_div": (with_div, term, y, args),
        "grad_f_div": (backward, term, y, args),
    }
    # The median wall time of 50 single calls, after the one that compiles.
    return {
        name: time_call(*call, repeats=50, min_seconds=0)[0]
        for name, call in calls.items()
    }


def floor_seconds(costs: dict, nfe_fwd: float, nfe_bwd: float) -> float:
    """The compute floor of one step at the given NFE."""
    return nfe_fwd * costs["f_div"] + nfe_bwd * costs["grad_f_div"]


if __name__ == "__main__":
    for est in ("hutchinson", "exact"):
        r = cnftrace_b1(est)
        c = evaluation_costs(est)
        floor = floor_seconds(c, r["nfe_fwd"], r["nfe_bwd"])
        print(
            f"{est}: {r['s_per_iter']:.4f} s/iter, first {r['first_step_s']:.2f} s, "
            f"NFE {r['nfe_fwd']:.1f}/{r['nfe_bwd']:.1f}; costs "
            + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in c.items())
            + f"; floor {floor:.4f} s (ratio {r['s_per_iter'] / floor:.2f})"
        )
