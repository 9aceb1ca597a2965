"""TFP's JAX FFJORD as a B1 peer (see `experiments/README.md`).

The peer a JAX user would pick instead of cnftrace: TensorFlow Probability's
`tfp.bijectors.FFJORD` on its JAX substrate, which needs no TensorFlow:

    pip install --pre tfp-nightly     # or: pip install --pre -e ".[peers]"

Set up as B1 asks and as TFP's own API does it:

- Model: `FFJORD` inside a `TransformedDistribution` over a standard normal base,
  with `ConcatSquashField` (below) as its `state_time_derivative_fn`: 2 -> 64 -> 64
  -> 64 -> 2, tanh, every layer's output gated and shifted by t as in FFJORD's
  ConcatSquash layers. The base sits at t = 0 and the data at t = 0.5 (TFP's
  convention), so `log_prob` solves the ODE backwards from the data.
- Solver: TFP's `tfp.math.ode.DormandPrince` at rtol = atol = 1e-5, its default
  first step of 1e-3 (no initial-step heuristic) and its default step control: the
  error norm is one RMS over every element of the whole batch's state, log-density
  included (cnftrace's is the max over samples of each sample's RMS, which is
  stricter).
- Gradients: TFP's adjoint method, its only one. The adjoint system is solved by
  the same Dormand--Prince settings backwards from t = 0.5; each of its evaluations
  is the vector field with its divergence, plus a VJP through both. The network's
  parameters reach the solver as FFJORD's `constants` (`bijector_kwargs`), the
  only way TFP's JAX adjoint differentiates with respect to them: a field that
  closed over traced parameters would leak tracers.
- Divergence: (A) the exact trace, our own `trace_augmentation_fn` (workaround b
  below): the Jacobian's diagonal from one forward-mode JVP per basis vector, under
  `vmap`; (B) TFP's own `trace_jacobian_hutchinson` (a VJP per probe) with one
  *Rademacher* probe per sample (its `sample_fn` set to `jax.random.rademacher`;
  TFP's default would be a Gaussian probe), drawn once per solve.
- Training: Adam at lr 1e-3 (optax), float32, 512 fresh 8gaussians samples per
  iteration from `cnftrace.datasets.toy_sample`; the loss, its gradient and the
  Adam update form one `jax.jit` program. Drawing each batch is a separate jitted
  call inside every timed iteration (warmed up before the clock starts), as for
  the zuko peer; `first_step_s` is the first iteration: tracing, XLA compilation
  and the run.

Two run-time workarounds for jax 0.10.x, both applied by `_patch_tfp()` and
`exact_trace` in this module:

(a) TFP's JAX `tf.size` builds a JAX array from the static shape, which under
    `jax.jit` is a tracer. TFP's adjoint then sizes a `TensorArray` with it and the
    gradient fails with `TypeError: Shapes must be 1D sequences of concrete values`.
    `_patch_tfp` replaces `tf.size` in TFP's JAX backend modules by a function that
    returns a NumPy scalar of the requested dtype (shapes are always static in JAX).
(b) TFP's own exact trace (`trace_jacobian_exact`, through `tfp.math.diag_jacobian`)
    loops with `lax.while_loop`, which reverse mode cannot differentiate, and its
    adjoint differentiates the augmented field. `exact_trace` is a drop-in
    `trace_augmentation_fn` without a loop.

NFE (network evaluations, each with the divergence) per iteration:

- `nfe_fwd`, the `log_prob` solve: the solver's own `num_ode_fn_evaluations`
  (diagnostics returned by `DormandPrince.solve`, read inside the jitted step and
  returned with the loss, so counting costs nothing) plus 1: TFP evaluates the
  field once at the initial state before stepping and leaves that out of its count.
  Six evaluations per attempted step (first-same-as-last reuse).
- `nfe_bwd`, the adjoint solve: the adjoint solver's `num_ode_fn_evaluations` plus
  1 for the derivative at its initial state. Its diagnostics never leave TFP's
  custom VJP, so the adjoint solver here is `DormandPrince` with the same settings
  whose `solve` also hands that count to the host with one `jax.debug.callback`
  per solve (one per iteration; microseconds against a step of tens of
  milliseconds). TFP's adjoint also evaluates the augmented field once to set up
  a solver state that its loop then discards (it restarts the solver at the
  cotangent's jump); that evaluation's result is never read, and it is not
  counted.

`tests/bench/test_bench_tfp.py` checks both counts against a counter on every call of
the field.
"""

import functools
import math
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import tensorflow_probability
from tensorflow_probability.python.internal.backend import jax as _tf_jax
from tensorflow_probability.python.internal.backend.jax import (
    numpy_array as _tf_numpy_array,
    v1 as _tf_v1,
    v2 as _tf_v2,
)
from tensorflow_probability.substrates import jax as tfp

from cnftrace.datasets import toy_sample
from experiments import _common

SOLVER = (
    "tfp.math.ode.DormandPrince: adaptive Dormand-Prince 5(4), first step 1e-3, "
    "one RMS error norm over the whole batch, atol = rtol = 1e-5; TFP's adjoint"
)
NOTES = (
    "tfp.bijectors.FFJORD (JAX substrate), ConcatSquash 2 -> 64 -> 64 -> 64 -> 2, "
    "tanh, span [0, 0.5]; exact trace by forward-mode JVPs (TFP's own cannot be "
    "differentiated); Hutchinson by TFP's estimator with one Rademacher probe."
)


def _static_size(input, out_type=np.int32, name=None):
    """`tf.size` for TFP's JAX backend: the number of elements, as a NumPy scalar
    of `out_type`, concrete under `jax.jit` (workaround (a) of the module)."""
    del name
    return np.dtype(out_type).type(math.prod(jnp.shape(input)))


def _patch_tfp() -> None:
    """Workaround (a): TFP's JAX `tf.size` (`numpy_array._size`) returns
    `jnp.asarray(prod(shape))`, a tracer under `jax.jit` since JAX traces every
    `jnp` call; TFP's adjoint sizes a `TensorArray` with it, and `jnp.zeros` then
    refuses the traced shape ("Shapes must be 1D sequences of concrete values").
    The backend's modules each hold their own reference to it (`from numpy_array
    import *`), so each one that does is rebound. Idempotent."""
    original = _tf_numpy_array.size
    if original is _static_size:
        return
    for module in (_tf_numpy_array, _tf_v1, _tf_v2, _tf_jax):
        if getattr(module, "size", None) is original:
            module.size = _static_size


_patch_tfp()


class _SquashLayer(eqx.Module):
    """`linear(h) * sigmoid(gate(t)) + shift(t)`: FFJORD's ConcatSquash form."""

    linear: eqx.nn.Linear
    gate: eqx.nn.Linear
    shift: eqx.nn.Linear

    def __init__(self, n_in: int, n_out: int, *, key, dtype):
        k1, k2, k3 = jr.split(key, 3)
        self.linear = eqx.nn.Linear(n_in, n_out, key=k1, dtype=dtype)
        self.gate = eqx.nn.Linear(1, n_out, key=k2, dtype=dtype)
        self.shift = eqx.nn.Linear(1, n_out, use_bias=False, key=k3, dtype=dtype)

    def __call__(self, t, h):
        t = jnp.reshape(jnp.asarray(t, h.dtype), (1,))
        return self.linear(h) * jax.nn.sigmoid(self.gate(t)) + self.shift(t)


class ConcatSquashField(eqx.Module):
    """B1's vector field, `f(t, y, args)` on one sample `y` of shape `(dim,)`
    (diffrax's signature, so a `cnftrace.CNF` can take it too): ConcatSquash layers
    dim -> width x depth -> dim with tanh between them."""

    layers: tuple[_SquashLayer, ...]

    def __init__(
        self,
        dim: int = 2,
        width: int = _common.B1_WIDTH,
        depth: int = _common.B1_DEPTH,
        *,
        key,
        dtype=jnp.float32,
    ):
        sizes = [dim] + [width] * depth + [dim]
        keys = jr.split(key, len(sizes) - 1)
        self.layers = tuple(
            _SquashLayer(a, b, key=k, dtype=dtype)
            for a, b, k in zip(sizes[:-1], sizes[1:], keys)
        )

    def __call__(self, t, y, args=None):
        for layer in self.layers[:-1]:
            y = jnp.tanh(layer(t, y))
        return self.layers[-1](t, y)


def exact_trace(ode_fn, state_shape, dtype):
    """Workaround (b): an exact-trace `trace_augmentation_fn` for `FFJORD` that
    reverse mode can differentiate. TFP's contract: given the field `ode_fn(t,
    state, **constants)` on a `(batch, dim)` state, return a function of `(t,
    (state, log_det))` giving `(d state/dt, the Jacobian's diagonal)` per element
    (FFJORD sums it over the event). Samples are independent, so one JVP with basis
    vector e_k in every row gives each sample's column k; `vmap` over k runs the
    `dim` JVPs as one batched pass, without a loop."""
    dim = state_shape[-1]
    basis = jnp.eye(dim, dtype=dtype)

    def augmented(t, state_and_log_det, **constants):
        state, _ = state_and_log_det

        def column(e):
            tangent = jnp.broadcast_to(e, state.shape)
            return jax.jvp(lambda s: ode_fn(t, s, **constants), (state,), (tangent,))

        values, columns = jax.vmap(column)(basis)  # (dim, batch, dim) each
        return values[0], jnp.einsum("kbk->bk", columns)

    return augmented


def _rademacher(shape, dtype, seed):
    """`sample_fn` for TFP's Hutchinson estimator: +-1 entries of the state's
    floating dtype."""
    return jr.rademacher(seed, tuple(int(s) for s in shape), dtype)


def hutchinson_trace(key):
    """TFP's Hutchinson `trace_augmentation_fn` with one Rademacher probe per
    sample, drawn from `key` once per solve."""
    return functools.partial(
        tfp.bijectors.ffjord.trace_jacobian_hutchinson,
        sample_fn=_rademacher,
        num_samples=1,
        seed=key,
    )


class _ReportingDormandPrince(tfp.math.ode.DormandPrince):
    """TFP's Dormand--Prince solver that also hands each solve's
    `num_ode_fn_evaluations` to `sink` on the host (one callback per solve); used
    as the adjoint solver, whose diagnostics TFP keeps to itself."""

    def __init__(self, sink, **settings):
        super().__init__(**settings)
        self._sink = sink

    def solve(self, *args, **kwargs):
        results = super().solve(*args, **kwargs)
        jax.debug.callback(self._sink, results.diagnostics.num_ode_fn_evaluations)
        return results


class TFPModel(eqx.Module):
    """B1's model in TFP's terms, without its parameters (so that it hashes, and
    `jax.jit` can close over it): the field's structure, the estimator, the span
    [0, t1] and the solver's rtol = atol = `tol`. Build it with `tfp_model`, which
    also returns the parameters: a flat tuple, the form FFJORD's `constants` take."""

    treedef: object = eqx.field(static=True)
    static: object = eqx.field(static=True)
    exact: bool = eqx.field(static=True)
    t1: float = eqx.field(static=True)
    tol: float = eqx.field(static=True)

    def field(self, params) -> eqx.Module:
        return eqx.combine(jax.tree.unflatten(self.treedef, list(params)), self.static)

    def _time_derivative(self, t, state, params):
        field = self.field(params)
        return jax.vmap(lambda y: field(t, y))(state)

    def log_prob(self, params, x, key=None, adjoint_sink=None):
        """Per-sample log-density of `x` (batch, dim) under TFP's FFJORD, and the
        forward solve's NFE (TFP's count plus its initial evaluation)."""
        tol = self.tol
        if adjoint_sink is None:
            make_adjoint = None  # TFP's default: the forward solver itself
        else:
            make_adjoint = functools.partial(
                _ReportingDormandPrince, adjoint_sink, rtol=tol, atol=tol
            )
        solver = tfp.math.ode.DormandPrince(
            rtol=tol, atol=tol, make_adjoint_solver_fn=make_adjoint
        )
        counts = []

        def solve(**kwargs):
            results = solver.solve(**kwargs)
            counts.append(results.diagnostics.num_ode_fn_evaluations)
            return results

        if self.exact:
            trace_fn = exact_trace
        elif key is None:
            raise ValueError("Hutchinson's estimator needs a `key` for its probe.")
        else:
            trace_fn = hutchinson_trace(key)
        bijector = tfp.bijectors.FFJORD(
            self._time_derivative,
            ode_solve_fn=solve,
            trace_augmentation_fn=trace_fn,
            initial_time=0.0,
            final_time=self.t1,
            dtype=x.dtype,
        )
        base = tfp.distributions.MultivariateNormalDiag(
            loc=jnp.zeros(x.shape[-1], x.dtype)
        )
        dist = tfp.distributions.TransformedDistribution(base, bijector)
        # TFP broadcasts arrays of different ranks (its base's `x - loc`), which a
        # program under `jax_numpy_rank_promotion="raise"` (cnftrace's tests) refuses.
        with jax.numpy_rank_promotion("allow"):
            logp = dist.log_prob(x, bijector_kwargs={"params": params})
        if len(counts) != 1:  # FFJORD's cache shares one solve between the terms
            raise RuntimeError(f"expected one ODE solve in log_prob; got {len(counts)}")
        return logp, counts[0] + 1


def tfp_model(
    field: eqx.Module,
    exact: bool,
    t1: float = _common.B1_T1,
    tol: float = _common.B1_TOL,
    model_type: type[TFPModel] = TFPModel,
) -> tuple[TFPModel, tuple]:
    """`(model, params)` for `field`, a vector field `f(t, y, args)` on one sample."""
    arrays, static = eqx.partition(field, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    return model_type(treedef, static, exact, t1, tol), tuple(leaves)


def _make_step(model: TFPModel, optimizer, adjoint_sink):
    """The jitted training step: (params, opt_state, x, key) -> (params, opt_state,
    loss, nfe_fwd)."""

    def loss_fn(params, x, key):
        logp, nfe = model.log_prob(params, x, key, adjoint_sink)
        return -jnp.mean(logp), nfe

    @jax.jit
    def step(params, opt_state, x, key):
        (loss, nfe), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, nfe

    return step


def _data(key, n: int):
    return toy_sample("8gaussians", key, n, dtype=jnp.float32)


def tfp_b1(
    exact: bool,
    iters: int = _common.B1_ITERS,
    batch: int = _common.B1_BATCH,
    seed: int = 0,
    *,
    width: int = _common.B1_WIDTH,
    depth: int = _common.B1_DEPTH,
    model_type: type[TFPModel] = TFPModel,
) -> dict:
    """B1: wall seconds per training iteration of TFP's JAX FFJORD (data + forward +
    adjoint + Adam update), with the first iteration (compile) on its own and NFE
    per iteration averaged over B1's window (each iteration's in `nfe_fwd_iters`
    and `nfe_bwd_iters`). `width`, `depth` and `model_type` (a `TFPModel`
    subclass) are B1's unless a test makes them smaller or instruments them."""
    if iters < 1:
        raise ValueError(f"iters must be positive; got {iters}.")
    key = jr.key(seed)
    field = ConcatSquashField(
        2, width, depth, key=jr.fold_in(key, 0), dtype=jnp.float32
    )
    model, params = tfp_model(field, exact, model_type=model_type)
    adjoint_counts: list[int] = []
    step = _make_step(
        model, optax.adam(_common.B1_LR), lambda n: adjoint_counts.append(int(n))
    )
    opt_state = optax.adam(_common.B1_LR).init(params)
    data_key, probe_key = jr.fold_in(key, 1), jr.fold_in(key, 2)
    _data(jr.fold_in(data_key, 2**31 - 1), batch).block_until_ready()  # the sampler

    times, nfe_fwd = [], []
    for i in range(iters):
        t0 = time.perf_counter()
        x = _data(jr.fold_in(data_key, i), batch)
        params, opt_state, loss, nfe = step(
            params, opt_state, x, jr.fold_in(probe_key, i)
        )
        jax.block_until_ready((params, opt_state, loss, nfe))
        times.append(time.perf_counter() - t0)
        nfe_fwd.append(float(nfe))
        if not math.isfinite(float(loss)):
            raise FloatingPointError(f"TFP's loss is {float(loss)} at step {i + 1}.")
    jax.effects_barrier()  # every adjoint count has reached the host
    if len(adjoint_counts) != iters:
        raise RuntimeError(
            f"expected one adjoint solve per step; got {len(adjoint_counts)} "
            f"in {iters} steps."
        )
    nfe_bwd = [float(n + 1) for n in adjoint_counts]
    return {
        "system": f"TFP (JAX) {tensorflow_probability.__version__}",
        "estimator": "exact" if exact else "hutchinson",
        "solver": SOLVER,
        "notes": NOTES,
        "s_per_iter": _common.window_avg(times),
        "first_step_s": times[0],
        "nfe_fwd": _common.window_avg(nfe_fwd),
        "nfe_bwd": _common.window_avg(nfe_bwd),
        "iter_times": times,
        "nfe_fwd_iters": nfe_fwd,
        "nfe_bwd_iters": nfe_bwd,
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="B1 for TFP's JAX FFJORD.")
    parser.add_argument("--iters", type=int, default=_common.B1_ITERS)
    parser.add_argument("--batch", type=int, default=_common.B1_BATCH)
    cli = parser.parse_args()
    for exact in (False, True):
        r = tfp_b1(exact, iters=cli.iters, batch=cli.batch)
        print(
            f"{r['system']} {r['estimator']}: {r['s_per_iter']:.4f} s/iter, first "
            f"{r['first_step_s']:.2f} s, NFE fwd {r['nfe_fwd']:.1f} "
            f"bwd {r['nfe_bwd']:.1f}"
        )
