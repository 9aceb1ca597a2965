"""The precision of matrix products inside a solve. On recent NVIDIA GPUs JAX computes
float32 matrix products in TensorFloat-32 unless told otherwise, rounding at about
1e-3, far above the solver's tolerances. A CNF's solves (the field, its trace, the
Runge-Kutta stage combinations and their backward pass) must ask for full float32.
The CPU computes in float32 either way, so these tests read the precision each
product was traced with (traced only, nothing is compiled)."""

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import jax.random as jr
import pytest

import cnftrace
from cnftrace.ode import StateTerm


def _dot_precisions(fn, *args) -> list:
    """The `precision` of every `dot_general` in `fn`'s program, sub-programs
    (scans, loops, custom derivatives) included."""
    jaxpr = eqx.filter_make_jaxpr(fn)(*args)[0]
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(eqn.params["precision"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return found


HIGHEST = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)


@pytest.fixture(scope="module")
def flow():
    return cnftrace.mlp_flow(2, key=jr.key(0), width=8, depth=1)


@pytest.mark.parametrize("what", ["log_prob", "gradient", "sample"])
def test_every_product_of_a_solve_runs_in_full_float32(flow, what):
    x = jnp.ones((4, 2), jnp.float32)
    fns = {
        "log_prob": lambda f: f.log_prob(x),
        # The backward pass: the transposed products keep the precision.
        "gradient": eqx.filter_grad(lambda f: f.log_prob(x, key=jr.key(1)).sum()),
        "sample": lambda f: f.sample(jr.key(2), 3),
    }
    precisions = _dot_precisions(fns[what], flow)
    assert precisions, "the program has no matrix products to check"
    assert all(p == HIGHEST for p in precisions), precisions


def test_a_term_keeps_jax_default_precision_when_asked(flow):
    """`matmul_precision=None` leaves the field's products at JAX's default (no
    precision recorded), so the default's effect above is the term's doing."""
    z = jnp.ones((4, 2), jnp.float32)

    def products(precision):
        term = cnftrace.CNFTerm(flow.vector_field, matmul_precision=precision)
        args = term.make_args(z, args=flow.args)
        return _dot_precisions(lambda y: term.vf(0.0, y, args), term.initial_state(z))

    ours, jax_default = products("float32"), products(None)
    assert ours and all(p == HIGHEST for p in ours)
    assert jax_default and all(p is None for p in jax_default), jax_default


def test_a_flow_passes_its_precision_to_every_solve(flow):
    """`CNF(..., matmul_precision=None)`: the field's products keep JAX's default;
    the Runge-Kutta stage combinations are the solver's own arithmetic and stay in
    full precision."""
    x = jnp.ones((4, 2), jnp.float32)
    plain = cnftrace.CNF(flow.vector_field, 2, matmul_precision=None)
    for fn in (lambda f: f.log_prob(x), lambda f: f.sample(jr.key(2), 3)):
        precisions = _dot_precisions(fn, plain)
        assert None in precisions and HIGHEST in precisions, precisions


@pytest.mark.parametrize("bad", ["fast", 3])
def test_an_unknown_precision_is_refused_by_name(flow, bad):
    for make in (
        lambda: cnftrace.CNF(flow.vector_field, 2, matmul_precision=bad),
        lambda: cnftrace.CNFTerm(flow.vector_field, matmul_precision=bad),
        lambda: StateTerm(flow.vector_field, matmul_precision=bad),
    ):
        with pytest.raises(ValueError, match="`matmul_precision` must be None"):
            make()
