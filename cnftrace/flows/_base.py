"""Continuous normalizing flows over a base distribution. A block maps data towards
the base by solving `dz/dt = f(t, z)` from `t0` to `t1` (the *forward* direction);
sampling runs the *inverse* direction. With `q` the flow's base,

    log p(x) = log q(z) + log_det,    log_det = integral_{t0}^{t1} tr(df/dz) dt.

Each solve treats the whole batch as one ODE state, under the maximum over samples
of each sample's RMS error."""

import abc
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._checks import (
    check_context,
    check_int,
    check_key,
    check_positive,
    check_precision,
    check_solve_fits,
)
from .._custom_types import Key
from ..estimators import AbstractEstimator
from ..ode import Regularization, SolveStats
from ._distributions import AbstractBase
from ._inputs import need_key, tracing, validate_input
from ._programs import (
    check_draws,
    log_prob_program,
    raise_on_failure,
    sample_program,
    transform_program,
)


class AbstractFlow(eqx.Module):
    """A normalizing flow over a base distribution, built from CNF blocks.

    The methods take one sample of shape `event_shape` or a batch
    `(n, *event_shape)` (one ODE solve per block) and check it. `forward` maps data
    to the base, `inverse` and `sample` the other way. Every flow holds `blocks`,
    its [`CNF`][cnftrace.CNF] blocks in the order data passes them, and `base`, an
    [`AbstractBase`][cnftrace.AbstractBase]. Subclasses provide those two,
    [`transform`][cnftrace.AbstractFlow.transform], `event_shape`, `with_estimator`
    and `with_base`. Compile a method as `eqx.filter_jit(flow.log_prob)`.

    !!! example

        ```python
        field = cnftrace.ConcatSquashMLP(2, width=16, depth=1, key=jr.key(0))
        flow = cnftrace.CNF(field, 2, t1=0.5)
        x = flow.sample(jr.key(1), 8)      # (8, 2)
        z = flow.forward(x)                # back to the base
        logp = flow.log_prob(x)            # (8,)
        x2, logp2 = flow.sample_and_log_prob(jr.key(1), 8)
        print(len(flow.blocks))  # 1: a CNF is its own one block
        ```
    """

    # Each a `CNF`; `_cnf` imports this module, so the type says only "flow".
    blocks: eqx.AbstractVar[tuple["AbstractFlow", ...]]
    base: eqx.AbstractVar[AbstractBase]

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

    @abc.abstractmethod
    def with_base(self, base: AbstractBase) -> "AbstractFlow":
        """A copy of the flow over another base distribution (of the flow's
        `event_shape`)."""

    def with_tolerance(self, rtol: float, atol: float) -> "AbstractFlow":
        """A copy of the flow whose blocks all solve with these `rtol` and `atol`.

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
        `log|det dy/dx|` of the map (`None`, and not computed, when
        `log_det=False`), and
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
        """The log-density of `x`: `log q(z) + log|det dz/dx|`, with `q` the base.

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
        x, unbatched, context = self._checked(x, "x", context)
        need_key(key, self.estimators())
        out, stats = log_prob_program(self, x, key, context, False)
        out = raise_on_failure(out[0] if unbatched else out, stats)
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
        x, unbatched = validate_input(x, self.event_shape, "x")
        if unbatched:
            raise ValueError(f"`x` must be a batch of shape (n, *{self.event_shape}).")
        _check_batch_fits(x, "x")
        context = check_context(context, self.context_dim, x.shape[0])
        need_key(key, self.estimators())
        logp, reg, stats = log_prob_program(self, x, key, context, True)
        return raise_on_failure(logp, stats), reg, stats

    def batch_log_prob(
        self,
        x: Float[Array, "batch ..."],
        key: Key | None,
        counter: Float[Array, ""] | None = None,
        *,
        context: Float[Array, "batch context"] | None = None,
        regularize: bool = False,
    ):
        """The log-density of a batch, for code that calls it inside its own
        compiled program: what objectives and evaluation use.

        Unlike [`log_prob`][cnftrace.AbstractFlow.log_prob], the input is not
        checked (`x` must be a batch `(n, *event_shape)`, `context` one row per
        sample) and a failed solve does not raise: the statistics' `result` says
        so, for the caller to check. It is `base.log_prob(z) + log_det` of
        [`transform`][cnftrace.AbstractFlow.transform]'s forward map, with its
        arguments (`key` is `None` for the exact trace).

        **Returns:**

        `(log_prob, stats)` with `log_prob` of shape `(n,)` and the
        [`SolveStats`][cnftrace.SolveStats]; with `regularize`, `(log_prob,
        regularization, stats)`.
        """
        z, log_det, stats, reg = self.transform(
            x,
            inverse=False,
            log_det=True,
            key=key,
            counter=counter,
            context=context,
            regularize=regularize,
        )
        logp = self.base.log_prob(z) + log_det
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
        """Draws `n` samples: draws of the base mapped through the inverse flow.

        Base draws beyond the solver's range (`1 / eps` of the float) are drawn
        again, with a warning.

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
        n, dtype = self._base_dtype(n, dtype)
        context = check_context(context, self.context_dim, n)
        x, _, stats, counts = sample_program(self, key, n, dtype, context, False)
        x = check_draws(raise_on_failure(x, stats), counts, self.base, n, dtype)
        x = x.astype(dtype)
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
        n, dtype = self._base_dtype(n, dtype)
        context = check_context(context, self.context_dim, n)
        x, logp, stats, counts = sample_program(self, key, n, dtype, context, True)
        x, logp = raise_on_failure((x, logp), stats)
        x, logp = check_draws((x, logp), counts, self.base, n, dtype)
        x, logp = x.astype(dtype), logp.astype(dtype)
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
        """`(n, dtype)` checked: `n` a Python `int` (a shape cannot be an array) and
        one solve over `n` samples able to run."""
        n = check_int("n", n)
        dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"`dtype` must be a floating dtype; got {dtype}.")
        check_precision(dtype, "dtype", "pass `dtype=jnp.float32` (or float64)")
        check_solve_fits(
            "`n`",
            n,
            math.prod(self.event_shape),
            dtype,
            "draw them in batches, each from its own key (`jax.random.split`)",
        )
        return n, dtype

    def _checked(self, x, name, context):
        """`(x, unbatched, context)`: `x` checked and made a batch that one solve can
        hold, and `context` checked against it."""
        x, unbatched = validate_input(x, self.event_shape, name)
        _check_batch_fits(x, name)
        context = check_context(
            context, self.context_dim, x.shape[0], unbatched=unbatched
        )
        return x, unbatched, context

    def _map(self, x, inverse, context, return_stats, name):
        x, unbatched, context = self._checked(x, name, context)
        y, _, stats = transform_program(self, x, inverse, False, None, context)
        y = raise_on_failure(y[0] if unbatched else y, stats)
        return (y, stats) if return_stats else y

    def _map_and_log_det(self, x, inverse, context, key, return_stats, name):
        x, unbatched, context = self._checked(x, name, context)
        need_key(key, self.estimators())
        y, log_det, stats = transform_program(self, x, inverse, True, key, context)
        if unbatched:
            y, log_det = y[0], log_det[0]
        y, log_det = raise_on_failure((y, log_det), stats)
        return (y, log_det, stats) if return_stats else (y, log_det)


def _check_batch_fits(x, name: str) -> None:
    """A `ValueError` where one solve over the concrete batch `x` cannot run (see
    `check_solve_fits`); a traced batch is the caller's program's business."""
    if not tracing(x):
        check_solve_fits(
            f"`{name}`",
            x.shape[0],
            math.prod(x.shape[1:]),
            x.dtype,
            "evaluate it in batches (`cnftrace.log_prob_batched(flow, x, "
            "batch_size=...)` for log-densities)",
        )
