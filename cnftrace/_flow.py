"""Continuous normalizing flows over a standard-normal base.

Conventions. A block maps data towards the base by solving `dz/dt = f(t, z)` from `t0`
to `t1`; this is the *forward* direction (`forward`, `log_prob`). Sampling runs the
*inverse* direction, from `t1` back to `t0`. With `log_det = log|det dz/dx|`,

    log p(x) = log N(z; 0, I) + log_det,    log_det = integral_{t0}^{t1} tr(df/dz) dt.

Each solve treats the whole batch as one ODE state (never a `vmap` of solves), and the
step-size controller uses the maximum over samples of each sample's RMS error.
"""

import abc
import math
from collections.abc import Callable, Sequence

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._checks import (
    check_context,
    check_int,
    check_key,
    check_positive,
    check_precision,
    is_int,
    is_number,
)
from ._custom_types import Key, VectorField
from ._estimators import AbstractEstimator, Exact, check_estimator
from ._norm import max_rms_norm, max_rms_seminorm
from ._stages import StageScan, scannable
from ._term import CNFTerm, StateTerm


class SolveStats(eqx.Module):
    """Solver statistics of the ODE solves behind one call, one entry per block.

    - `num_steps`: steps attempted (accepted and rejected).
    - `num_accepted`, `num_rejected`: their split.
    - `nfe`: evaluations of the vector field (for the whole batch at once). For
        explicit Runge--Kutta solvers this is counted exactly from the step count and
        the solver's stages: `stages` per step (one fewer for first-same-as-last
        solvers, plus the first evaluation) and one plain evaluation for the automatic
        initial step (two for solvers that are not first-same-as-last, and with
        `BacksolveAdjoint`, where also each rejection of the very first step costs an
        uncounted evaluation); the tests check it against a count of real
        evaluations. It is `-1` for solvers whose cost per step is not known.
    - `result`: how each solve ended, a `diffrax.RESULTS` (`successful`, or
        `max_steps_reached` when the solver hit the block's `max_steps`, ...).

    Each field has shape `(blocks,)`, in the order data passes the blocks. Every
    flow method returns one with `return_stats=True`.

    Solves never raise inside [`transform`][cnftrace.AbstractFlow.transform]: a
    failure travels as `result`. The public methods (`log_prob`, `sample`, ...)
    raise diffrax's message for it (an `equinox.error_if`, so under `jit` too);
    [`fit`][cnftrace.fit] reads it from each step and stops with a
    [`TrainingError`][cnftrace.TrainingError] naming the step.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.Chain([cnftrace.CNF(field, 2), cnftrace.CNF(field, 2)])
        logp, stats = flow.log_prob(jnp.zeros((8, 2)), return_stats=True)
        print(stats.nfe, stats.total_nfe)  # per block, and all together
        print(stats.max_steps_reached)  # [False False]
        ```
    """

    num_steps: Int[Array, " blocks"]
    num_accepted: Int[Array, " blocks"]
    num_rejected: Int[Array, " blocks"]
    nfe: Int[Array, " blocks"]
    result: diffrax.RESULTS

    @property
    def total_nfe(self) -> Int[Array, ""]:
        """The evaluations of all blocks together."""
        return jnp.sum(self.nfe)

    @property
    def failed(self) -> Bool[Array, " blocks"]:
        """Whether each block's solve failed (any result but `successful`)."""
        return self.result != diffrax.RESULTS.successful

    @property
    def max_steps_reached(self) -> Bool[Array, " blocks"]:
        """Whether each block's solve stopped at its `max_steps`."""
        return self.result == diffrax.RESULTS.max_steps_reached

    def first_failure(self) -> diffrax.RESULTS:
        """The result of the first block whose solve failed, in the order data
        passes the blocks; `diffrax.RESULTS.successful` if none did."""
        out = diffrax.RESULTS.successful
        for i in reversed(range(self.nfe.shape[0])):
            block = jax.tree_util.tree_map(lambda v, i=i: v[i], self.result)
            out = diffrax.RESULTS.where(block != diffrax.RESULTS.successful, block, out)
        return out

    @staticmethod
    def concatenate(stats: Sequence["SolveStats"]) -> "SolveStats":
        """The statistics of several flows' solves, one after the other: the blocks
        of `stats[0]`, then those of `stats[1]`, ..."""
        return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *stats)


def _evals_per_step(solver: diffrax.AbstractSolver) -> tuple[int, int] | None:
    """`(evaluations per step, evaluations at initialisation)`, where known."""
    if isinstance(solver, diffrax.AbstractERK):
        stages = len(solver.tableau.c) + 1
        if solver.tableau.fsal:
            return stages - 1, 1
        return stages, 0
    if isinstance(solver, diffrax.Euler):
        return 1, 0
    return None


def _state_and_log_density_norm(y) -> Array:
    """The error norm of a regularised solve: `max_rms_norm` over the state and the
    log-density only, leaving RNODE's integrals out of step-size control."""
    return max_rms_norm(y[:2])


def _standard_normal_log_prob(z: Array, event_ndim: int) -> Array:
    axes = tuple(range(z.ndim - event_ndim, z.ndim))
    size = math.prod(z.shape[z.ndim - event_ndim :])
    return -0.5 * jnp.sum(z**2, axis=axes) - 0.5 * size * math.log(2 * math.pi)


class _FromFirstStep(diffrax.AbstractAdaptiveStepSizeController):
    """A `PIDController` that starts from a given first step (a traced value, or the
    user's `dt0`).

    Given as `dt0`, a first step makes diffrax check its sign against the span, with
    an `eqx.error_if` (a host callback in the compiled program, which JAX's
    persistent compilation cache does not store) unless the step and the span are
    Python numbers. So `diffeqsolve` gets no `dt0` (or, for `BacksolveAdjoint`, a
    Python number of the right sign), and the controller starts from the magnitude
    of the step (diffrax solves in the direction of time)."""

    controller: diffrax.PIDController
    first_step: Float[Array, ""]
    rtol: float
    atol: float
    norm: Callable

    def __init__(self, controller: diffrax.PIDController, first_step):
        self.controller = controller
        self.first_step = jnp.abs(first_step)
        self.rtol, self.atol, self.norm = (
            controller.rtol,
            controller.atol,
            controller.norm,
        )

    def wrap(self, direction):
        return _FromFirstStep(self.controller.wrap(direction), self.first_step)

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        del dt0
        return self.controller.init(
            terms, t0, t1, y0, self.first_step, args, func, error_order
        )

    def adapt_step_size(self, *args, **kwargs):
        return self.controller.adapt_step_size(*args, **kwargs)


def _validate_input(x, event_shape: tuple[int, ...], name: str) -> tuple[Array, bool]:
    """Checks `x` and returns it with a batch axis, and whether one was added.

    NaN and inf in data are refused on the host, before any program runs. A value
    being traced (under the caller's `jit`, `grad`, ...) is checked by an
    `eqx.error_if` instead, which puts a host callback in the caller's program (and
    JAX's persistent cache stores no program with one)."""
    on_host = not _tracing(x)
    if isinstance(x, (list, tuple)):
        x = jnp.asarray(x)
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"`{name}` must be an array; got {type(x).__name__}.")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` has dtype {x.dtype}; a flow needs floating-point input. Convert "
            f"it first, e.g. `{name}.astype(jnp.float32)` (dequantise integer data)."
        )
    check_precision(x.dtype, name)
    event_ndim = len(event_shape)
    shape = tuple(x.shape)
    if shape == event_shape:
        unbatched = True
    elif len(shape) == event_ndim + 1 and shape[1:] == event_shape:
        unbatched = False
    else:
        raise ValueError(
            f"`{name}` has shape {shape}, but this flow models samples of shape "
            f"{event_shape}: pass one sample of shape {event_shape} or a batch of "
            f"shape (n, {', '.join(map(str, event_shape))})."
        )
    if not unbatched and shape[0] == 0:
        raise ValueError(
            f"`{name}` is an empty batch (shape {shape}); pass at least one sample."
        )
    not_finite = (
        f"`{name}` contains NaN or inf; a density is only defined at finite points. "
        "Remove or impute those samples first."
    )
    if on_host:
        if not _all_finite(x):
            raise ValueError(not_finite)
        x = jnp.asarray(x)
        return (x[None] if unbatched else x), unbatched
    x = jnp.asarray(x)
    if unbatched:
        x = x[None]
    x = eqx.error_if(x, jnp.any(~jnp.isfinite(x)), not_finite)
    return x, unbatched


@jax.jit
def _all_finite_jit(x):
    return jnp.all(jnp.isfinite(x))


def _all_finite(x) -> bool:
    """Whether concrete `x` is all finite, checked where it lives: on the host for
    NumPy data and arrays in host memory, by a small program on an accelerator."""
    if isinstance(x, jax.Array) and any(d.platform != "cpu" for d in x.devices()):
        return bool(_all_finite_jit(x))
    return bool(np.isfinite(np.asarray(x)).all())


def _need_key(key, estimators: Sequence[AbstractEstimator]) -> None:
    if key is None and any(e.stochastic for e in estimators):
        raise ValueError(
            "this flow uses a stochastic trace estimator (e.g. Hutchinson) and needs "
            "`key=jax.random.key(seed)`; or evaluate with the exact trace via "
            "`flow.with_estimator(cnftrace.Exact())`."
        )
    if key is not None:
        check_key("key", key)


def _check_span(t0, t1) -> None:
    """`t0` and `t1` finite with `t1 > t0`, where they are numbers (or concrete
    scalar arrays); a traced span is checked when the flow is solved."""
    values = []
    for name, value in (("t0", t0), ("t1", t1)):
        if is_number(value):
            values.append(float(value))
            continue
        if isinstance(value, jax.core.Tracer):
            return
        if not isinstance(value, (jax.Array, np.ndarray)) or np.ndim(value) != 0:
            raise TypeError(f"`{name}` must be a number; got {value!r}.")
        values.append(float(value))
    t0, t1 = values
    if not (math.isfinite(t0) and math.isfinite(t1)):
        raise ValueError(f"the time span must be finite; got t0={t0}, t1={t1}.")
    if t1 <= t0:
        raise ValueError(f"need `t1 > t0`; got t0={t0}, t1={t1}.")


class Regularization(eqx.Module):
    """RNODE's integrals along each sample's trajectory (Finlay et al. 2020), summed
    over the blocks of a flow.

    - `kinetic`: `integral |f(t, z)|^2 dt`, shape `(n,)`.
    - `jacobian`: `integral |df/dz|_F^2 dt`, shape `(n,)`, estimated from the same
        probes as the divergence (exact with [`Exact`][cnftrace.Exact]).

    Returned by
    [`log_prob_and_regularization`][cnftrace.AbstractFlow.log_prob_and_regularization];
    [`MaximumLikelihood`][cnftrace.MaximumLikelihood] adds their batch means to the loss
    with its `kinetic_weight` and `jacobian_weight`.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, 2)
        logp, reg, stats = flow.log_prob_and_regularization(jnp.ones((8, 2)))
        print(reg.kinetic.shape, reg.jacobian.shape)  # (8,) (8,)
        ```
    """

    kinetic: Float[Array, " n"]
    jacobian: Float[Array, " n"]

    def __add__(self, other: "Regularization") -> "Regularization":
        return Regularization(
            self.kinetic + other.kinetic, self.jacobian + other.jacobian
        )


def _tracing(tree) -> bool:
    """Whether any leaf of `tree` is being traced (by a caller's `jit`, `grad`, ...);
    data that is not is checked on the host, before any program."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _compiled(fn: Callable) -> Callable:
    """`fn(flow, *args)` as one compiled program (per flow structure, shapes and
    static arguments) when called on concrete values: run op by op, a first call
    compiles about a hundred small programs. Inside a caller's transformation (any
    argument traced) it is inlined as it is, so that values the caller traces are
    never baked into a program of their own."""
    jitted = eqx.filter_jit(fn)

    def call(flow, *args):
        if _tracing((flow, args)):
            return fn(flow, *args)
        return jitted(flow, *args)

    return call


@_compiled
def _log_prob_program(flow, x, key, context, regularize):
    return flow._batch_log_prob(x, key, context=context, regularize=regularize)


@_compiled
def _transform_program(flow, x, inverse, log_det, key, context):
    return flow.transform(
        x, inverse=inverse, log_det=log_det, key=key, context=context
    )[:3]


@_compiled
def _sample_program(flow, key, n, dtype, context, log_det):
    if log_det:
        key, probe_key = jr.split(key)
    else:
        probe_key = None
    z = jr.normal(key, (n,) + flow.event_shape, dtype)
    x, ld, stats, _ = flow.transform(
        z, inverse=True, log_det=log_det, key=probe_key, context=context
    )
    if not log_det:
        return x, stats
    return x, _standard_normal_log_prob(z, len(flow.event_shape)) - ld, stats


class SolverError(RuntimeError):
    """An ODE solve failed (its step limit, say): raised on the host, with diffrax's
    message, by the flows' methods (`log_prob`, `sample`, ...) called outside a
    `jit`, and by [`log_prob_batched`][cnftrace.log_prob_batched] and
    [`evaluate_nll`][cnftrace.evaluate_nll] with the samples it failed on."""


def _raise_on_failure(out, stats: SolveStats):
    """`out`, after a check that every solve behind it succeeded: a failed solve
    raises diffrax's message for its result; on the host (a `SolverError`) for
    concrete statistics, by a runtime check inside a caller's transformation."""
    if _tracing(stats):
        result = stats.first_failure()
        return result.error_if(out, result != diffrax.RESULTS.successful)
    codes = np.asarray(jax.tree_util.tree_leaves(stats.result)[0]).reshape(-1)
    successful = np.asarray(jax.tree_util.tree_leaves(diffrax.RESULTS.successful)[0])
    failed = np.flatnonzero(codes != successful)
    if failed.size:
        block = int(failed[0])
        result = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(diffrax.RESULTS.successful),
            [np.asarray(codes[block], successful.dtype)],
        )
        where = f" of block {block} (of {codes.size})" if codes.size > 1 else ""
        raise SolverError(f"the ODE solve{where} failed: {diffrax.RESULTS[result]}")
    return out


class AbstractFlow(eqx.Module):
    """A normalizing flow over a standard-normal base, built from CNF blocks.

    The methods below are those of every flow ([`CNF`][cnftrace.CNF],
    [`Chain`][cnftrace.Chain], [`MultiscaleFlow`][cnftrace.MultiscaleFlow]). They take
    one sample of shape `event_shape` or a batch `(n, *event_shape)` (a batch is one
    ODE solve per block), check it, and say what to pass when it is wrong. Data lives
    at each block's `t0`, the base at `t1`: `forward` maps data to the base, `inverse`
    and `sample` the other way.

    Every flow says what it holds: `blocks`, its CNF blocks in the order data passes
    them (a [`CNF`][cnftrace.CNF] is its own one block; chains of chains are
    flattened), which is also the order of its [`SolveStats`][cnftrace.SolveStats]
    entries. Subclasses provide `blocks` (an `equinox.AbstractVar`: a field or a
    property), [`transform`][cnftrace.AbstractFlow.transform], `event_shape` and
    `with_estimator`; everything else is defined here.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, 2, t1=0.5)
        x = flow.sample(jr.key(1), 5)      # (5, 2)
        z = flow.forward(x)                # back to the base
        logp = flow.log_prob(x)            # (5,)
        x2, logp2 = flow.sample_and_log_prob(jr.key(1), 5)
        print(len(flow.blocks))  # 1: a CNF is its own one block
        ```
    """

    blocks: eqx.AbstractVar[tuple["CNF", ...]]

    @property
    @abc.abstractmethod
    def event_shape(self) -> tuple[int, ...]:
        """The shape of one sample."""

    @property
    def context_dim(self) -> int | None:
        """The size of the context vector of a conditional flow; `None` if the flow
        is not conditional."""
        return None

    def estimators(self) -> tuple[AbstractEstimator, ...]:
        """The trace estimators of the blocks."""
        return tuple(b.estimator for b in self.blocks)

    @property
    def composes_blocks(self) -> bool:
        """Whether the flow's map is its blocks' maps one after the other, all on
        samples of `event_shape` (what flow matching needs). True for a `CNF` and a
        `Chain` of such flows; a `MultiscaleFlow` squeezes and factors out between
        its blocks."""
        return False

    @abc.abstractmethod
    def with_estimator(self, estimator: AbstractEstimator) -> "AbstractFlow":
        """A copy of the flow whose blocks all use `estimator`."""

    def with_tolerance(self, rtol: float, atol: float) -> "AbstractFlow":
        """A copy of the flow whose blocks all solve with these tolerances (the
        step-size controller's `rtol` and `atol`).

        [`MaximumLikelihood`][cnftrace.MaximumLikelihood] trains through a looser
        copy than the flow it returns, which keeps its own tolerances for
        evaluation and sampling.

        !!! example

            ```python
            flow = cnftrace.CNF(cnftrace.MLPField(2, width=8, key=jr.key(0)), 2)
            loose = flow.with_tolerance(1e-3, 1e-3)
            print(loose.rtol, flow.rtol)  # 0.001 1e-05
            ```
        """
        check_positive("rtol", rtol)
        check_positive("atol", atol)
        # The blocks are found by identity wherever the flow keeps them.
        ids = {id(b) for b in self.blocks}

        def retol(node):
            if id(node) not in ids:
                return node
            return eqx.tree_at(lambda b: (b.rtol, b.atol), node, (rtol, atol))

        return jax.tree_util.tree_map(retol, self, is_leaf=lambda n: id(n) in ids)

    @abc.abstractmethod
    def transform(
        self,
        x: Float[Array, "batch ..."],
        *,
        inverse: bool,
        log_det: bool,
        key: Key | None,
        counter: Float[Array, ""] | None = None,
        context: Float[Array, "batch context"] | None = None,
        regularize: bool = False,
    ) -> tuple[Array, Array | None, SolveStats, Regularization | None]:
        """Maps a checked batch through the flow (data to base, or base to data if
        `inverse`).

        Returns `(y, log_det, stats, regularization)`, where `log_det` is
        `log|det dy/dx|` of the map that was applied (or `None` when `log_det=False`:
        then no divergence is computed at all, which is much cheaper), and
        `regularization` the [`Regularization`][cnftrace.Regularization] integrals
        when `regularize=True` (which needs `log_det=True`), else `None`.

        `counter` (with `log_det=True`): a float scalar whose gradient counts the
        backward evaluations of the blocks' vector fields (see
        [`CNFTerm.make_args`][cnftrace.CNFTerm.make_args]). `context`: one row per
        sample, for conditional flows.

        A solve that fails (its step limit, say) does not raise here: its
        `stats.result` says so, for the caller to check.
        """

    # ------------------------------------------------------------------ public API

    def log_prob(
        self,
        x: Float[Array, "*batch event"],
        *,
        context: Float[Array, "*batch context"] | None = None,
        key: Key | None = None,
        return_stats: bool = False,
    ):
        """The log-density of `x`: `log N(z; 0, I) + log|det dz/dx|`.

        **Arguments:**

        - `x`: one sample of shape `event_shape` or a batch `(n, *event_shape)`.
        - `context`: for a conditional flow, the context: shape `(context_dim,)` for
            all samples, or `(n, context_dim)`, one row per sample. The density is
            then `p(x | context)`.
        - `key`: a PRNG key, required when a block uses a stochastic estimator.
        - `return_stats`: also return the [`SolveStats`][cnftrace.SolveStats].

        **Returns:**

        The log-density, a scalar or shape `(n,)`; with `return_stats`, a pair
        `(log_prob, stats)`.
        """
        x, unbatched = _validate_input(x, self.event_shape, "x")
        context = check_context(
            context, self.context_dim, x.shape[0], unbatched=unbatched
        )
        _need_key(key, self.estimators())
        out, stats = _log_prob_program(self, x, key, context, False)
        out = _raise_on_failure(out[0] if unbatched else out, stats)
        return (out, stats) if return_stats else out

    def log_prob_and_regularization(
        self,
        x: Float[Array, "n event"],
        *,
        context: Float[Array, "n context"] | None = None,
        key: Key | None = None,
    ) -> tuple[Float[Array, " n"], "Regularization", SolveStats]:
        """`log_prob` of a batch together with RNODE's regularisation integrals
        (kinetic energy and Jacobian Frobenius norm) from the same solves, at no
        extra evaluations of the vector field.

        **Arguments:**

        - `x`: a batch of shape `(n, *event_shape)`.
        - `context`, `key`: as for [`log_prob`][cnftrace.AbstractFlow.log_prob].

        **Returns:**

        `(log_prob, regularization, stats)` with a
        [`Regularization`][cnftrace.Regularization] of per-sample integrals.
        """
        x, unbatched = _validate_input(x, self.event_shape, "x")
        if unbatched:
            raise ValueError(f"`x` must be a batch of shape (n, *{self.event_shape}).")
        context = check_context(context, self.context_dim, x.shape[0])
        _need_key(key, self.estimators())
        logp, reg, stats = _log_prob_program(self, x, key, context, True)
        return _raise_on_failure(logp, stats), reg, stats

    def _batch_log_prob(
        self, x, key, counter=None, *, context=None, regularize: bool = False
    ):
        """`log_prob` of a checked batch `x` with the solver statistics, and with
        `regularize` also the [`Regularization`][cnftrace.Regularization] between
        them; `counter` as in [`transform`][cnftrace.AbstractFlow.transform]."""
        z, log_det, stats, reg = self.transform(
            x,
            inverse=False,
            log_det=True,
            key=key,
            counter=counter,
            context=context,
            regularize=regularize,
        )
        logp = _standard_normal_log_prob(z, len(self.event_shape)) + log_det
        return (logp, reg, stats) if regularize else (logp, stats)

    def sample(
        self,
        key: Key,
        n: int,
        *,
        context: Float[Array, "*n context"] | None = None,
        dtype=None,
        return_stats: bool = False,
    ):
        """Draws `n` samples: base noise mapped through the inverse flow.

        No divergence is computed, so this costs a plain ODE solve per block.

        **Arguments:**

        - `key`: a PRNG key for the base noise.
        - `n`: how many samples, a Python `int`.
        - `context`: for a conditional flow, shape `(context_dim,)` for all samples,
            or `(n, context_dim)`, one row per sample.
        - `dtype`: the samples' dtype; JAX's default float if omitted.
        - `return_stats`: also return the [`SolveStats`][cnftrace.SolveStats].

        **Returns:**

        An array of shape `(n, *event_shape)`; with `return_stats`, a pair.
        """
        check_key("key", key)
        dtype = self._base_dtype(n, dtype)
        context = check_context(context, self.context_dim, n)
        x, stats = _sample_program(self, key, n, dtype, context, False)
        x = _raise_on_failure(x, stats)
        return (x, stats) if return_stats else x

    def sample_and_log_prob(
        self,
        key: Key,
        n: int,
        *,
        context: Float[Array, "*n context"] | None = None,
        dtype=None,
        return_stats: bool = False,
    ):
        """Draws `n` samples together with their log-density, in one inverse solve
        per block (cheaper than `sample` followed by `log_prob`).

        **Arguments:**

        - `key`: a PRNG key, for the base noise and any probes.
        - `n`, `context`, `dtype`, `return_stats`: as for
            [`sample`][cnftrace.AbstractFlow.sample].

        **Returns:**

        `(samples, log_prob)`; with `return_stats`, `(samples, log_prob, stats)`.
        """
        check_key("key", key)
        dtype = self._base_dtype(n, dtype)
        context = check_context(context, self.context_dim, n)
        x, logp, stats = _sample_program(self, key, n, dtype, context, True)
        x, logp = _raise_on_failure((x, logp), stats)
        return (x, logp, stats) if return_stats else (x, logp)

    def forward(
        self,
        x: Float[Array, "*batch event"],
        *,
        context: Float[Array, "*batch context"] | None = None,
        return_stats: bool = False,
    ):
        """Maps data `x` (one sample or a batch) to the base space, with no
        divergence computed.

        **Arguments:**

        - `x`: one sample of shape `event_shape` or a batch `(n, *event_shape)`.
        - `context`: for a conditional flow, as for
            [`log_prob`][cnftrace.AbstractFlow.log_prob].
        - `return_stats`: also return the [`SolveStats`][cnftrace.SolveStats].

        **Returns:**

        `z` of `x`'s shape; with `return_stats`, a pair `(z, stats)`.
        """
        return self._map(x, False, context, return_stats, "x")

    def inverse(
        self,
        z: Float[Array, "*batch event"],
        *,
        context: Float[Array, "*batch context"] | None = None,
        return_stats: bool = False,
    ):
        """Maps base-space points `z` (one sample or a batch) to data space: the
        inverse of [`forward`][cnftrace.AbstractFlow.forward], with the same
        arguments.

        **Returns:**

        `x` of `z`'s shape; with `return_stats`, a pair `(x, stats)`.
        """
        return self._map(z, True, context, return_stats, "z")

    def forward_and_log_det(
        self,
        x: Float[Array, "*batch event"],
        *,
        context: Float[Array, "*batch context"] | None = None,
        key: Key | None = None,
        return_stats: bool = False,
    ):
        """Maps data `x` to the base space together with the log-determinant of the
        map's Jacobian.

        **Arguments:**

        - `x`, `context`, `return_stats`: as for
            [`forward`][cnftrace.AbstractFlow.forward].
        - `key`: a PRNG key, required when a block uses a stochastic estimator.

        **Returns:**

        `(z, log|det dz/dx|)`, the second of shape `()` or `(n,)`; with
        `return_stats`, `(z, log_det, stats)`.
        """
        return self._map_and_log_det(x, False, context, key, return_stats, "x")

    def inverse_and_log_det(
        self,
        z: Float[Array, "*batch event"],
        *,
        context: Float[Array, "*batch context"] | None = None,
        key: Key | None = None,
        return_stats: bool = False,
    ):
        """Maps base-space points `z` to data space together with the
        log-determinant of the map's Jacobian, with the arguments of
        [`forward_and_log_det`][cnftrace.AbstractFlow.forward_and_log_det].

        **Returns:**

        `(x, log|det dx/dz|)`; with `return_stats`, `(x, log_det, stats)`.
        """
        return self._map_and_log_det(z, True, context, key, return_stats, "z")

    # ------------------------------------------------------------------ helpers

    def _base_dtype(self, n, dtype):
        """The base samples' dtype, after checking `n` and `dtype`."""
        check_int("n", n)
        dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"`dtype` must be a floating dtype; got {dtype}.")
        check_precision(dtype, "dtype", "pass `dtype=jnp.float32` (or float64)")
        return dtype

    def _map(self, x, inverse, context, return_stats, name):
        x, unbatched = _validate_input(x, self.event_shape, name)
        context = check_context(
            context, self.context_dim, x.shape[0], unbatched=unbatched
        )
        y, _, stats = _transform_program(self, x, inverse, False, None, context)
        y = _raise_on_failure(y[0] if unbatched else y, stats)
        return (y, stats) if return_stats else y

    def _map_and_log_det(self, x, inverse, context, key, return_stats, name):
        x, unbatched = _validate_input(x, self.event_shape, name)
        context = check_context(
            context, self.context_dim, x.shape[0], unbatched=unbatched
        )
        _need_key(key, self.estimators())
        y, log_det, stats = _transform_program(self, x, inverse, True, key, context)
        if unbatched:
            y, log_det = y[0], log_det[0]
        y, log_det = _raise_on_failure((y, log_det), stats)
        return (y, log_det, stats) if return_stats else (y, log_det)


class CNF(AbstractFlow):
    """One continuous normalizing flow block, also a flow on its own.

    Solves `dz/dt = f(t, z, args)` from `t0` (data) to `t1` (base) with diffrax, for a
    whole batch in one solve, with the log-density change from `estimator`.

    **Arguments:**

    - `vector_field`: `f(t, z, args)` on *one* sample `z` of shape `event_shape`
        (the diffrax signature), e.g. a [`ConcatSquashMLP`][cnftrace.ConcatSquashMLP].
        Its parameters are the flow's trainable parameters.
    - `dim`: the size `d` of one sample, or the shape of one sample (a tuple) for
        structured data such as images.
    - `t0`, `t1`: the time span; `t1 > t0`. The default span [0, 0.5] learned as
        well as [0, 1] and cost 25-50% fewer evaluations on the densities of the
        docs' quality page.
    - `solver`: an adaptive diffrax solver; `diffrax.Tsit5()` by default. Under the
        default adjoint, an explicit first-same-as-last Runge-Kutta solver (Tsit5,
        Dopri5, Dopri8, Bosh3) runs each step's stages as one `lax.scan`: diffrax's
        arithmetic, with a gradient that traces in about half the time. Pass
        `diffrax.Tsit5(scan_kind="checkpointed")` to keep diffrax's stage loop.
    - `rtol`, `atol`: tolerances of the step-size controller (per sample).
    - `adjoint`: how to differentiate the solve; `diffrax.RecursiveCheckpointAdjoint()`
        by default. `diffrax.BacksolveAdjoint()` (O(1) memory, FFJORD's choice) and
        `diffrax.DirectAdjoint()` work too.
    - `estimator`: the trace estimator: [`Exact`][cnftrace.Exact] (default),
        [`Hutchinson`][cnftrace.Hutchinson], [`HutchPlusPlus`][cnftrace.HutchPlusPlus]
        or [`XTrace`][cnftrace.XTrace].
    - `max_steps`: the solver's step limit.
    - `dt0`: the initial step, a positive number (the inverse solve takes it
        backwards in time); `None` (default) chooses it per solve with Hairer's
        heuristic from two plain evaluations of the field (counted in the NFE).
    - `pcoeff`, `icoeff`: the PID controller's coefficients. The default `(0.4, 0.3)`
        is a PI controller: on FFJORD's toy model it rejected fewer steps and needed
        8-15% fewer evaluations over training than the integral controller `(0, 1)`.
    - `args`: passed to `vector_field` as its `args`.
    - `context_dim`: makes the flow conditional on a context vector of this size
        (FFJORD-style conditioning on a class embedding or features). Each sample's
        vector field is then called as `f(t, z, context)` with its own context, and
        `log_prob`, `sample` and the maps take `context=`; `args` must be `None`.
    - `learn_t1`: make the end time a trainable parameter (FFJORD's `train_T`),
        kept positive as `t1 = t0 + exp(log_span)` and initialised at `t1`. Read it as
        `flow.t1`.

    !!! example

        ```python
        key = jax.random.key(0)
        field = cnftrace.ConcatSquashMLP(2, width=64, depth=3, key=key)
        flow = cnftrace.CNF(field, dim=2, t1=0.5)
        logp = flow.log_prob(jnp.zeros((10, 2)))
        ```
    """

    vector_field: VectorField
    shape: tuple[int, ...] = eqx.field(static=True)
    t0: float
    _end: float | Float[Array, ""]
    solver: diffrax.AbstractAdaptiveSolver
    rtol: float
    atol: float
    adjoint: diffrax.AbstractAdjoint
    estimator: AbstractEstimator
    max_steps: int = eqx.field(static=True)
    dt0: float | None
    pcoeff: float
    icoeff: float
    args: object
    context_size: int | None = eqx.field(static=True)
    learn_t1: bool = eqx.field(static=True)

    def __init__(
        self,
        vector_field: VectorField,
        dim: int | tuple[int, ...],
        *,
        t0: float = 0.0,
        t1: float = 0.5,
        solver: diffrax.AbstractSolver | None = None,
        rtol: float = 1e-5,
        atol: float = 1e-5,
        adjoint: diffrax.AbstractAdjoint | None = None,
        estimator: AbstractEstimator | None = None,
        max_steps: int = 4096,
        dt0: float | None = None,
        pcoeff: float = 0.4,
        icoeff: float = 0.3,
        args=None,
        context_dim: int | None = None,
        learn_t1: bool = False,
    ):
        if not callable(vector_field):
            raise TypeError(
                "`vector_field` must be callable as `f(t, z, args)`; got "
                f"{type(vector_field).__name__}."
            )
        if is_int(dim):
            shape = (int(dim),)
        elif isinstance(dim, tuple) and all(is_int(s) for s in dim):
            shape = dim
        else:
            raise ValueError(
                f"`dim` must be a positive int (or a tuple of them); got {dim!r}."
            )
        if len(shape) == 0 or any(s < 1 for s in shape):
            raise ValueError(f"`dim` must be positive; got {dim!r}.")
        _check_span(t0, t1)
        if not (rtol > 0 and atol > 0):
            raise ValueError(f"`rtol` and `atol` must be positive; got {rtol}, {atol}.")
        check_int("max_steps", max_steps)
        if dt0 is not None:
            check_positive("dt0", dt0)  # a magnitude: solves go either way in time
        if context_dim is not None:
            check_int("context_dim", context_dim)
        if context_dim is not None and args is not None:
            raise ValueError(
                "a conditional flow passes each sample's context to the vector field "
                "as its `args`, so `args` must be None; put constants in the vector "
                "field itself."
            )
        if not isinstance(learn_t1, bool):
            raise TypeError(f"`learn_t1` must be a bool; got {learn_t1!r}.")
        if learn_t1 and not (
            isinstance(t0, (int, float)) and isinstance(t1, (int, float))
        ):
            raise TypeError(
                "with `learn_t1=True`, `t0` and `t1` must be Python numbers (the "
                "initial end time); the flow then holds the span as a parameter."
            )
        estimator = Exact() if estimator is None else estimator
        check_estimator(estimator)
        self.vector_field = vector_field
        self.shape = shape
        self.t0 = t0
        # With `learn_t1`, `_end` holds log(t1 - t0), a trainable array.
        # A strongly typed array: a weakly typed one becomes strong after the first
        # optimiser update, and `fit`'s step would then be compiled again (twice).
        self._end = (
            jnp.asarray(math.log(t1 - t0), dtype=jnp.result_type(float))
            if learn_t1
            else t1
        )
        self.solver = diffrax.Tsit5() if solver is None else solver
        self.rtol = rtol
        self.atol = atol
        self.adjoint = (
            diffrax.RecursiveCheckpointAdjoint() if adjoint is None else adjoint
        )
        self.estimator = estimator
        self.max_steps = max_steps
        self.dt0 = dt0
        self.pcoeff = pcoeff
        self.icoeff = icoeff
        self.args = args
        self.context_size = context_dim
        self.learn_t1 = learn_t1

    @property
    def t1(self):
        """The end time: a float, or with `learn_t1` a scalar array (trainable)."""
        return self.t0 + jnp.exp(self._end) if self.learn_t1 else self._end

    @property
    def blocks(self) -> tuple["CNF"]:
        """`(self,)`: a CNF is its own one block."""
        return (self,)

    @property
    def composes_blocks(self) -> bool:
        """True: a CNF's map is its one block's."""
        return True

    @property
    def event_shape(self) -> tuple[int, ...]:
        return self.shape

    @property
    def context_dim(self) -> int | None:
        return self.context_size

    def with_estimator(self, estimator: AbstractEstimator) -> "CNF":
        return eqx.tree_at(lambda f: f.estimator, self, estimator)

    def _adjoint(self) -> diffrax.AbstractAdjoint:
        # The backward solve of BacksolveAdjoint runs on the augmented state
        # (y, a_y, a_args, a_terms): give it a norm that understands that state.
        adjoint = self.adjoint
        if isinstance(adjoint, diffrax.BacksolveAdjoint) and (
            "stepsize_controller" not in adjoint.kwargs
        ):
            controller = diffrax.PIDController(
                rtol=self.rtol, atol=self.atol, norm=max_rms_seminorm
            )
            adjoint = diffrax.BacksolveAdjoint(
                **adjoint.kwargs, stepsize_controller=controller
            )
        return adjoint

    def transform(
        self,
        x,
        *,
        inverse,
        log_det,
        key,
        counter=None,
        context=None,
        regularize=False,
    ):
        if regularize and not log_det:
            raise ValueError("`regularize=True` needs `log_det=True`.")
        if (context is None) != (self.context_size is None):
            raise ValueError(
                "`context` must be given exactly when the flow is conditional "
                f"(context_dim={self.context_size})."
            )
        event_ndim = len(self.shape)
        if log_det:
            term = CNFTerm(self.vector_field, self.estimator, event_ndim, regularize)
            y0 = term.initial_state(x)
            args = term.make_args(
                x, key=key, args=self.args, counter=counter, context=context
            )
        else:
            term = StateTerm(self.vector_field, event_ndim, context is not None)
            y0 = x
            args = self.args if context is None else context
        t1 = self.t1
        if self.learn_t1:
            # A learned end time is an array; in the state's dtype it does not
            # promote a float32 solve to float64.
            t1 = t1.astype(x.dtype)
        elif not (is_number(self.t0) and is_number(t1)):
            # An array span (a traced one, say) is checked where it is known.
            t1 = eqx.error_if(
                t1,
                ~(jnp.isfinite(self.t0) & jnp.isfinite(t1) & (t1 > self.t0)),
                "the CNF's time span must be finite with `t1 > t0`.",
            )
        t_start, t_end = (t1, self.t0) if inverse else (self.t0, t1)
        adjoint = self._adjoint()
        # For first-same-as-last solvers the first evaluation f(t_start, y0) is made
        # here and handed to the solver as its state: the initial-step heuristic
        # reuses it, and a rejected first step does not evaluate it again (diffrax
        # would), so the evaluation count is exact. BacksolveAdjoint cannot
        # differentiate a given solver state, so it keeps diffrax's own start.
        solver = self.solver
        solver_state = None
        f0 = None
        if self._shares_first_evaluation():
            f0 = term.vf(t_start, y0, args)
            if scannable(solver) and isinstance(
                adjoint, diffrax.RecursiveCheckpointAdjoint
            ):
                # Its stages as one scan: the same step, its gradient traced in
                # about half the time (see `_stages.py`). diffrax's other adjoints
                # pick their own stage loop.
                solver, solver_state = StageScan(solver), f0
            else:
                solver_state = (jnp.asarray(False), f0)
        controller = diffrax.PIDController(
            rtol=self.rtol,
            atol=self.atol,
            pcoeff=self.pcoeff,
            icoeff=self.icoeff,
            # The regularisation integrals are left out of error control, so a
            # regularised solve takes the steps of a plain one.
            norm=_state_and_log_density_norm if regularize else max_rms_norm,
        )
        if self.dt0 is None:
            dz0 = None if f0 is None else (f0[0] if log_det else f0)
            dt0 = self._initial_step(t_start, t_end, x, dz0, context)
        else:
            dt0 = -self.dt0 if inverse else self.dt0
        if (
            is_number(t_start)
            and is_number(t_end)
            and jnp.dtype(x.dtype) != jnp.result_type(float)
        ):
            # A state narrower than JAX's default float (float32 under x64): Python
            # numbers would make the solve's time, and so its state, float64. The
            # span goes in the state's dtype instead.
            t_start, t_end = (np.asarray(t, x.dtype) for t in (t_start, t_end))
        if not isinstance(adjoint, diffrax.BacksolveAdjoint):
            # The controller starts from the first step, and diffeqsolve gets no
            # `dt0`: it would check its sign against the span, at run time (a host
            # callback, which keeps the program out of JAX's persistent cache)
            # wherever the span is not a Python number.
            controller = _FromFirstStep(controller, jnp.asarray(dt0, x.dtype))
            dt0 = None
        elif self.dt0 is None and dt0.dtype == jnp.result_type(float):
            # BacksolveAdjoint starts its backward solve from `-dt0`, so it gets a
            # `dt0`: a Python number of the step's sign, which diffeqsolve checks
            # while tracing where the span is a Python number too; the controller
            # starts from the step itself.
            controller = _FromFirstStep(controller, dt0)
            dt0 = -1.0 if inverse else 1.0
        sol = diffrax.diffeqsolve(
            term,
            solver,
            t_start,
            t_end,
            dt0,
            y0,
            args=args,
            solver_state=solver_state,
            stepsize_controller=controller,
            adjoint=adjoint,
            max_steps=self.max_steps,
            saveat=diffrax.SaveAt(t1=True),
            # A failure travels in the stats' `result`: the public methods raise it,
            # `fit` reads it at its next host sync.
            throw=False,
        )
        reg = None
        if log_det:
            z, delta_logp = sol.ys[:2]
            # delta_logp = log p_end(z_end) - log p_start(z_start), and
            # log|det dz_end/dz_start| = -delta_logp.
            out, ld = z[0], -delta_logp[0]
            if regularize:
                # Integrated backwards in time when inverse: report them positive.
                sign = -1 if inverse else 1
                reg = Regularization(sign * sol.ys[2][0], sign * sol.ys[3][0])
        else:
            out, ld = sol.ys[0], None
        return out, ld, self._stats(sol), reg

    def _shares_first_evaluation(self) -> bool:
        return (
            isinstance(self.solver, diffrax.AbstractERK)
            and self.solver.tableau.fsal
            and not isinstance(self.adjoint, diffrax.BacksolveAdjoint)
        )

    def _initial_step(self, t_start, t_end, z0, f0=None, context=None):
        """Hairer, Norsett & Wanner's starting step (Solving ODEs I, II.4) with the
        max-over-samples norm, from `f0 = f(t_start, z0)` (evaluated here if not
        given) and one more plain evaluation of the field.

        diffrax's own heuristic is skipped for wrapped terms (it then starts at 0.01),
        which costs CNF solves a few wasted steps. The step is not differentiated.
        """
        z0 = lax.stop_gradient(z0)
        field = StateTerm(self.vector_field, len(self.shape), context is not None)
        args = self.args if context is None else context
        direction = jnp.sign(t_end - t_start)
        scale = self.atol + self.rtol * jnp.abs(z0)
        if f0 is None:
            f0 = field.vf(t_start, z0, args)
        f0 = lax.stop_gradient(f0)
        d0 = max_rms_norm(z0 / scale)
        d1 = max_rms_norm(f0 / scale)
        h0 = jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1)
        z1 = z0 + direction * h0 * f0
        f1 = lax.stop_gradient(field.vf(t_start + direction * h0, z1, args))
        d2 = max_rms_norm((f1 - f0) / scale) / h0
        order = self.solver.order(field) or 4
        h1 = jnp.where(
            jnp.maximum(d1, d2) <= 1e-15,
            jnp.maximum(1e-6, h0 * 1e-3),
            (0.01 / jnp.maximum(d1, d2)) ** (1.0 / (order + 1)),
        )
        span = jnp.abs(t_end - t_start)
        h = jnp.minimum(jnp.minimum(100 * h0, h1), span)
        return lax.stop_gradient(direction * h)

    def _stats(self, sol: diffrax.Solution) -> SolveStats:
        num_steps = jnp.asarray(sol.stats["num_steps"])
        accepted = jnp.asarray(sol.stats["num_accepted_steps"])
        rejected = jnp.asarray(sol.stats["num_rejected_steps"])
        costs = _evals_per_step(self.solver)
        if costs is None:
            nfe = jnp.asarray(-1)
        else:
            per_step, at_init = costs
            # Hairer's heuristic costs one plain evaluation beside f0 when f0 is
            # shared with the solver, two otherwise.
            if self.dt0 is None:
                at_init += 1 if self._shares_first_evaluation() else 2
            nfe = num_steps * per_step + at_init
        return SolveStats(
            num_steps=num_steps[None],
            num_accepted=accepted[None],
            num_rejected=rejected[None],
            nfe=jnp.asarray(nfe)[None],
            result=jax.tree_util.tree_map(lambda v: jnp.asarray(v)[None], sol.result),
        )


class Chain(AbstractFlow):
    """A chain of flows over one standard-normal base.

    Data passes through `flows[0]`, then `flows[1]`, ... towards the base;
    sampling runs them in reverse order. `log_prob` adds up their log-determinants.
    `blocks` lists every CNF block of the chain in data order, with chains of chains
    flattened.

    **Arguments:**

    - `flows`: a sequence of [`CNF`][cnftrace.CNF] blocks (or other flows, chains
        included) with the same `event_shape` (and the same `context_dim`, passed to
        every one).

    !!! example

        ```python
        keys = jr.split(jr.key(0), 3)
        blocks = [
            cnftrace.CNF(cnftrace.ConcatSquashMLP(2, width=16, key=k), 2, t1=0.5)
            for k in keys
        ]
        flow = cnftrace.Chain(blocks)
        logp = flow.log_prob(jnp.zeros((4, 2)))
        nested = cnftrace.Chain([flow, blocks[0]])
        print(len(nested.blocks))  # 4: chains are flattened
        ```
    """

    flows: tuple[AbstractFlow, ...]

    def __init__(self, flows: Sequence[AbstractFlow]):
        flows = tuple(flows)
        if not flows:
            raise ValueError(
                "`flows` must hold at least one flow (CNF blocks, or chains of them)."
            )
        for i, b in enumerate(flows):
            if not isinstance(b, AbstractFlow):
                raise TypeError(
                    f"`flows[{i}]` must be a cnftrace flow (e.g. `cnftrace.CNF`); got "
                    f"{type(b).__name__}."
                )
        shapes = {b.event_shape for b in flows}
        if len(shapes) != 1:
            raise ValueError(
                f"all blocks must model samples of one shape; got shapes {shapes}."
            )
        contexts = {b.context_dim for b in flows}
        if len(contexts) != 1:
            raise ValueError(
                "all blocks must take the same context (the same `context_dim`, or "
                f"none); got context_dim values {contexts}."
            )
        self.flows = flows

    @property
    def blocks(self) -> tuple["CNF", ...]:
        """Every CNF block of the chain, in data order (chains flattened)."""
        return tuple(b for f in self.flows for b in f.blocks)

    @property
    def composes_blocks(self) -> bool:
        """Whether every flow of the chain composes its blocks."""
        return all(f.composes_blocks for f in self.flows)

    @property
    def event_shape(self):
        return self.flows[0].event_shape

    @property
    def context_dim(self):
        return self.flows[0].context_dim

    def with_estimator(self, estimator):
        return Chain([b.with_estimator(estimator) for b in self.flows])

    def transform(
        self,
        x,
        *,
        inverse,
        log_det,
        key,
        counter=None,
        context=None,
        regularize=False,
    ):
        blocks = self.flows[::-1] if inverse else self.flows
        keys = [None] * len(blocks) if key is None else list(jr.split(key, len(blocks)))
        total = jnp.zeros(x.shape[:1], x.dtype) if log_det else None
        all_stats = []
        reg = None
        for block, k in zip(blocks, keys):
            x, ld, stats, block_reg = block.transform(
                x,
                inverse=inverse,
                log_det=log_det,
                key=k,
                counter=counter,
                context=context,
                regularize=regularize,
            )
            if log_det:
                total = total + ld
            if regularize:
                reg = block_reg if reg is None else reg + block_reg
            all_stats.append(stats)
        if inverse:
            all_stats = all_stats[::-1]  # report stats in block order
        return x, total, SolveStats.concatenate(all_stats), reg


def make_flow(
    vector_fields: Sequence[VectorField] | VectorField,
    dim: int | tuple[int, ...],
    **kwargs,
) -> AbstractFlow:
    """A [`CNF`][cnftrace.CNF] for one vector field, or a [`Chain`][cnftrace.Chain] of
    blocks sharing the keyword settings (`t1`, `solver`, `rtol`, ...) for several.

    **Arguments:**

    - `vector_fields`: one vector field `f(t, z, args)`, or a sequence of them (one
        block each, data passing the first one first).
    - `dim`: the size of one sample, or its shape.
    - `**kwargs`: [`CNF`][cnftrace.CNF]'s keyword arguments, given to every block.

    **Returns:**

    A [`CNF`][cnftrace.CNF] or a [`Chain`][cnftrace.Chain].

    !!! example

        ```python
        fields = [
            cnftrace.ConcatSquashMLP(2, width=16, key=k) for k in jr.split(jr.key(0), 2)
        ]
        flow = cnftrace.make_flow(fields, 2, t1=0.5, rtol=1e-4, atol=1e-4)
        ```
    """
    if callable(vector_fields) and not isinstance(vector_fields, (list, tuple)):
        return CNF(vector_fields, dim, **kwargs)
    return Chain([CNF(f, dim, **kwargs) for f in vector_fields])


__all__ = ["AbstractFlow", "CNF", "Chain", "Regularization", "SolveStats", "make_flow"]
