"""One CNF block: a vector field, its time span and the settings of its solve."""

import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_int, check_positive, is_number
from .._custom_types import VectorField
from .._defaults import ATOL, ICOEFF, MATMUL_PRECISION, MAX_STEPS, PCOEFF, RTOL, T1
from ..estimators import AbstractEstimator, Exact
from ..estimators._base import check_estimator
from ..ode import (
    CNFTerm,
    FirstStepController,
    Regularization,
    SolveStats,
    StageScan,
    StateTerm,
    check_matmul_precision,
    evals_per_step,
    initial_step,
    max_rms_norm,
    max_rms_seminorm,
    scannable,
    state_and_log_density_norm,
)
from ._base import AbstractFlow
from ._distributions import AbstractBase, check_base, event_shape_of
from ._inputs import check_span


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
    - `t0`, `t1`: the time span; `t1 > t0` (the default's measurements:
        docs/quality.md).
    - `solver`: an adaptive diffrax solver; `diffrax.Tsit5()` by default (its
        stages run as one `lax.scan`; `diffrax.Tsit5(scan_kind="checkpointed")`
        keeps diffrax's stage loop).
    - `rtol`, `atol`: tolerances of the step-size controller (per sample).
    - `adjoint`: how to differentiate the solve; `diffrax.RecursiveCheckpointAdjoint()`
        by default. `diffrax.BacksolveAdjoint()` (O(1) memory, FFJORD's choice) and
        `diffrax.DirectAdjoint()` work too.
    - `estimator`: the trace estimator: [`Exact`][cnftrace.Exact] (default),
        [`Hutchinson`][cnftrace.Hutchinson], [`HutchPlusPlus`][cnftrace.HutchPlusPlus]
        or [`XTrace`][cnftrace.XTrace].
    - `max_steps`: the solver's step limit.
    - `dt0`: the initial step, a positive number; `None` (default) chooses it per
        solve with Hairer's heuristic (counted in the NFE).
    - `pcoeff`, `icoeff`: the PID controller's coefficients.
    - `args`: passed to `vector_field` as its `args`.
    - `context_dim`: makes the flow conditional on a context vector of this size:
        each sample's field is called as `f(t, z, context)`, and `log_prob`,
        `sample` and the maps take `context=`; `args` must be `None`.
    - `learn_t1`: make the end time a trainable parameter (FFJORD's `train_T`),
        kept positive as `t1 = t0 + exp(log_span)`; read it as `flow.t1`.
    - `base`: the [`AbstractBase`][cnftrace.AbstractBase] at `t1` (the standard
        normal if omitted), trained with the field unless it is frozen.
    - `matmul_precision`: the precision of the field's float32 matrix products and
        convolutions in a solve, "float32" by default (see
        [`CNFTerm`][cnftrace.CNFTerm]); `None` keeps JAX's default, TensorFloat-32
        on recent NVIDIA GPUs: faster products, rounded at about 1e-3.

    !!! example

        ```python
        key = jax.random.key(0)
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=key)
        flow = cnftrace.CNF(field, dim=2, t1=0.5)
        logp = flow.log_prob(jnp.zeros((8, 2)))
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
    base: AbstractBase
    matmul_precision: str | None = eqx.field(static=True)

    def __init__(
        self,
        vector_field: VectorField,
        dim: int | tuple[int, ...],
        *,
        t0: float = 0.0,
        t1: float = T1,
        solver: diffrax.AbstractSolver | None = None,
        rtol: float = RTOL,
        atol: float = ATOL,
        adjoint: diffrax.AbstractAdjoint | None = None,
        estimator: AbstractEstimator | None = None,
        max_steps: int = MAX_STEPS,
        dt0: float | None = None,
        pcoeff: float = PCOEFF,
        icoeff: float = ICOEFF,
        args=None,
        context_dim: int | None = None,
        learn_t1: bool = False,
        base: AbstractBase | None = None,
        matmul_precision: str | None = MATMUL_PRECISION,
    ):
        if not callable(vector_field):
            raise TypeError(
                "`vector_field` must be callable as `f(t, z, args)`; got "
                f"{type(vector_field).__name__}."
            )
        shape = event_shape_of(dim, "dim")
        check_span(t0, t1)
        if not (rtol > 0 and atol > 0):
            raise ValueError(f"`rtol` and `atol` must be positive; got {rtol}, {atol}.")
        max_steps = check_int("max_steps", max_steps)
        if dt0 is not None:
            check_positive("dt0", dt0)  # a magnitude: solves go either way in time
        if context_dim is not None:
            context_dim = check_int("context_dim", context_dim)
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
        self.matmul_precision = check_matmul_precision(matmul_precision)
        self.base = check_base(base, shape)
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

    def with_base(self, base: AbstractBase) -> "CNF":
        return eqx.tree_at(lambda f: f.base, self, check_base(base, self.shape))

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
        # The solve runs in the wider of the input's dtype and the field's: float32
        # data on a float64 flow (under x64) would otherwise meet float64 values
        # in a float32 state.
        params = jax.tree_util.tree_leaves(
            eqx.filter(self.vector_field, eqx.is_inexact_array)
        )
        x = x.astype(jnp.result_type(x.dtype, *(p.dtype for p in params)))
        term, y0, args = self._term(x, log_det, regularize, key, counter, context)
        t1 = self._end_time(x.dtype)
        t_start, t_end = (t1, self.t0) if inverse else (self.t0, t1)
        solver, solver_state, f0 = self._first_evaluation(term, t_start, y0, args)
        controller, dt0 = self._controller(
            t_start, t_end, x, f0, log_det, regularize, inverse, context
        )
        if is_number(t_start) and is_number(t_end):
            if jnp.dtype(x.dtype) != jnp.result_type(float):
                # A state narrower than JAX's default float (float32 under x64):
                # Python numbers would make the solve's time, and so its state,
                # float64. The span goes in the state's dtype instead.
                t_start, t_end = (np.asarray(t, x.dtype) for t in (t_start, t_end))
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
            adjoint=self._adjoint(),
            max_steps=self.max_steps,
            saveat=diffrax.SaveAt(t1=True),
            # A failure travels in the stats' `result`: the public methods raise it,
            # `fit` reads it at its next host sync.
            throw=False,
        )
        if not log_det:
            return sol.ys[0], None, self._stats(sol), None
        z, delta_logp = sol.ys[:2]
        # delta_logp = log p_end(z_end) - log p_start(z_start), and
        # log|det dz_end/dz_start| = -delta_logp.
        reg = None
        if regularize:
            # Integrated backwards in time when inverse: report them positive.
            sign = -1 if inverse else 1
            reg = Regularization(sign * sol.ys[2][0], sign * sol.ys[3][0])
        return z[0], -delta_logp[0], self._stats(sol), reg

    def _term(self, x, log_det, regularize, key, counter, context):
        """`(term, y0, args)` of the solve: with `log_det`, the state augmented with
        the log-density change (and RNODE's integrals), and its probes drawn once
        for the solve; else the plain state."""
        if not log_det:
            term = self._state_term(context is not None)
            return term, x, self.args if context is None else context
        term = CNFTerm(
            self.vector_field,
            self.estimator,
            len(self.shape),
            regularize,
            self.matmul_precision,
        )
        args = term.make_args(
            x, key=key, args=self.args, counter=counter, context=context
        )
        return term, term.initial_state(x), args

    def _state_term(self, conditional: bool) -> StateTerm:
        """The plain dynamics of this flow's field (no log-density), as its solves
        and its first-step heuristic evaluate them."""
        return StateTerm(
            self.vector_field, len(self.shape), conditional, self.matmul_precision
        )

    def _end_time(self, dtype):
        """`t1` as the solve takes it: a learned end time in the state's dtype (it
        would otherwise promote a float32 solve to float64 under x64); an array span
        checked where it is known (a span of numbers was checked at construction)."""
        t1 = self.t1
        if self.learn_t1:
            return t1.astype(dtype)
        if is_number(self.t0) and is_number(t1):
            return t1
        ok = jnp.isfinite(self.t0) & jnp.isfinite(t1) & (t1 > self.t0)
        return eqx.error_if(
            t1, ~ok, "the CNF's time span must be finite with `t1 > t0`."
        )

    def _first_evaluation(self, term, t_start, y0, args):
        """`(solver, solver_state, f0)`. For first-same-as-last solvers the first
        evaluation `f0 = f(t_start, y0)` is made here and handed to the solver as
        its state: the initial-step heuristic reuses it, and a rejected first step
        does not evaluate it again (diffrax would), so the evaluation count is
        exact. Under the default adjoint a Runge-Kutta step's stages then run as one
        scan (`StageScan`). BacksolveAdjoint cannot differentiate a given solver
        state, so it keeps diffrax's own start (`f0` is `None`)."""
        if not self._shares_first_evaluation():
            return self.solver, None, None
        f0 = term.vf(t_start, y0, args)
        if scannable(self.solver) and isinstance(
            self.adjoint, diffrax.RecursiveCheckpointAdjoint
        ):
            return StageScan(self.solver), f0, f0
        return self.solver, (jnp.asarray(False), f0), f0

    def _controller(self, t_start, t_end, x, f0, log_det, regularize, inverse, ctx):
        """`(stepsize_controller, dt0)`: a PI controller over the max-over-samples
        norm (RNODE's integrals outside error control) holding the first step;
        `diffeqsolve` gets no `dt0` (it would check its sign by a host callback),
        except under BacksolveAdjoint, which needs a Python number of its sign."""
        controller = diffrax.PIDController(
            rtol=self.rtol,
            atol=self.atol,
            pcoeff=self.pcoeff,
            icoeff=self.icoeff,
            norm=state_and_log_density_norm if regularize else max_rms_norm,
        )
        if self.dt0 is not None:
            dt0 = -self.dt0 if inverse else self.dt0
        else:
            field = self._state_term(ctx is not None)
            dt0 = initial_step(
                field,
                t_start,
                t_end,
                x,
                self.args if ctx is None else ctx,
                rtol=self.rtol,
                atol=self.atol,
                order=self.solver.order(field) or 4,
                f0=None if f0 is None else (f0[0] if log_det else f0),
            )
        if not isinstance(self.adjoint, diffrax.BacksolveAdjoint):
            return FirstStepController(controller, jnp.asarray(dt0, x.dtype)), None
        if self.dt0 is None and dt0.dtype == jnp.result_type(float):
            return FirstStepController(controller, dt0), (-1.0 if inverse else 1.0)
        return controller, dt0

    def _shares_first_evaluation(self) -> bool:
        return (
            isinstance(self.solver, diffrax.AbstractERK)
            and self.solver.tableau.fsal
            and not isinstance(self.adjoint, diffrax.BacksolveAdjoint)
        )

    def _stats(self, sol: diffrax.Solution) -> SolveStats:
        num_steps = jnp.asarray(sol.stats["num_steps"])
        accepted = jnp.asarray(sol.stats["num_accepted_steps"])
        rejected = jnp.asarray(sol.stats["num_rejected_steps"])
        costs = evals_per_step(self.solver)
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
