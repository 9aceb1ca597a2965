"""B1, the toy training step, for cnftrace (`experiments/README.md`), and its compute
floor. The step itself (`cnftrace_b1`: `fit` on fresh 8gaussians batches, timed
between log records) is in `experiments/_common.py`, shared with B2, B3 and the GPU
run.

The compute floor prices the measured NFE at the cost of bare jitted evaluations of
the same network at the same batch size: `nfe_fwd * t(f + divergence) + nfe_bwd *
t(gradient of f + divergence)`, the cost of a step with no solver, adjoint or
optimiser overhead at all.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import cnftrace
from experiments._common import (
    B1_BATCH,
    b1_data,
    b1_flow,
    cnftrace_b1,
    time_call,
)


def evaluation_costs(estimator: str, batch: int = B1_BATCH) -> dict:
    """Seconds per bare jitted evaluation of B1's network at `batch` samples: `f`,
    `f` with the divergence (forward mode, as in the solve), and the gradient with
    respect to the parameters and the state of (f, divergence) against a random
    cotangent (the work of one backward evaluation)."""
    flow = b1_flow(estimator)
    term = cnftrace.CNFTerm(flow.vector_field, flow.estimator)
    z = b1_data(jr.key(1), batch)
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
