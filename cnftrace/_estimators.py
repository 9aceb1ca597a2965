"""Trace estimators and the divergence of a vector field.

An estimator turns a linear map `v -> J v` (a Jacobian-vector product, or a lineax
operator's `mv`) into its trace. [`Exact`][cnftrace.Exact] applies the map to every
basis vector; [`Hutchinson`][cnftrace.Hutchinson] averages `eps^T J eps` over a static
number of random probes with `E[eps eps^T] = I`.

Probes are drawn *separately* from their use (`draw` then `estimate`), so that a CNF can
draw them once per ODE solve and reuse them at every evaluation of the vector field.
"""

import abc
import math
from collections.abc import Callable
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from ._checks import check_key, is_int
from ._custom_types import Key

_SAMPLERS = ("rademacher", "gaussian", "sphere")


class AbstractEstimator(eqx.Module):
    """Base class for trace estimators.

    Subclasses say whether they need random probes (`stochastic`), how to draw them
    ([`draw`][cnftrace.AbstractEstimator.draw]) and how to turn a linear map into a
    trace estimate given those probes
    ([`estimate`][cnftrace.AbstractEstimator.estimate]). Drawing and estimating are
    separate so that a CNF draws its probes once per ODE solve and reuses them at
    every evaluation of the vector field.

    Every function that takes an `estimator=` ([`divergence`][cnftrace.divergence],
    [`trace`][cnftrace.trace], [`CNF`][cnftrace.CNF], [`fit`][cnftrace.fit], ...)
    accepts any subclass.

    !!! example

        ```python
        est = cnftrace.Hutchinson(num_probes=2)
        y = jnp.ones(3)
        probes = est.draw(jr.key(0), y.shape, y.dtype)  # shape (2, 3)
        fy, div = est.estimate(jnp.sin, y, probes)      # d/dy sin(y) = cos(y)
        ```
    """

    stochastic: ClassVar[bool]

    @abc.abstractmethod
    def draw(
        self, key: Key | None, shape: tuple[int, ...], dtype, *, event_ndim: int = 1
    ) -> Float[Array, "..."] | None:
        """Draws the probes for a state of shape `(*batch, *event)`.

        **Arguments:**

        - `key`: a JAX PRNG key (ignored, and may be `None`, for deterministic
            estimators).
        - `shape`: `(*batch, *event)`; `event_ndim` trailing dimensions are the sample.
        - `dtype`: the floating dtype of the state; probes have this dtype.
        - `event_ndim`: how many trailing dimensions of `shape` make one sample.

        **Returns:**

        An array of shape `(*batch, num_probes, *event)`, or `None`.
        """

    @abc.abstractmethod
    def estimate(
        self,
        fn: Callable[[Float[Array, "*event"]], Float[Array, "*event"]],
        y: Float[Array, "*event"],
        probes: Float[Array, " probes *event"] | None,
    ) -> tuple[Float[Array, "*event"], Float[Array, ""]]:
        """Evaluates `fn(y)` and estimates the trace of its Jacobian, for one sample.

        **Arguments:**

        - `fn`: a function from `y`'s shape to the same shape.
        - `y`: one sample.
        - `probes`: what [`draw`][cnftrace.AbstractEstimator.draw] returned for this
            sample: shape `(num_probes, *y.shape)`, or `None`.

        **Returns:**

        `(fn(y), estimate of tr(d fn / d y))`.
        """

    def estimate_with_jacobian_norm(
        self,
        fn: Callable[[Float[Array, "*event"]], Float[Array, "*event"]],
        y: Float[Array, "*event"],
        probes: Float[Array, " probes *event"] | None,
    ) -> tuple[Float[Array, "*event"], Float[Array, ""], Float[Array, ""]]:
        """Like [`estimate`][cnftrace.AbstractEstimator.estimate], and also estimates
        the squared Frobenius norm of `J = d fn / d y` from the same Jacobian-vector
        products (no extra evaluations of `fn`): RNODE's Jacobian regulariser.

        **Returns:**

        `(fn(y), trace estimate, squared Frobenius norm estimate)`. Estimators that
        do not support the norm raise `NotImplementedError`.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not estimate the Jacobian's Frobenius norm; "
            "use `cnftrace.Exact()` or `cnftrace.Hutchinson()` for Jacobian "
            "regularisation."
        )


def _check_floating(y: Array, name: str) -> None:
    if not jnp.issubdtype(y.dtype, jnp.inexact):
        raise TypeError(
            f"`{name}` has dtype {y.dtype}, but divergences and traces need a floating "
            f"dtype; convert it first, e.g. `{name}.astype(jnp.float32)`."
        )


# Up to this many tangents, `_jvps` applies the linearised function to each in turn
# rather than under `vmap`.
_UNROLL_TANGENTS = 4


def _jvps(fn, y, tangents):
    """`(fn(y), [J v for v in tangents])`: one forward-mode pass per tangent, with the
    primal output computed once.

    A few tangents (one probe, or the basis of a small state) go through one at a
    time: a `vmap` over them adds an axis that XLA meets with a transpose and a copy
    of every tangent activation, forward and backward (B1's training step was about
    a fifth faster without it). More tangents are batched with `vmap`."""

    def jvp(v):
        return jax.jvp(fn, (y,), (v,))

    n = tangents.shape[0]
    if n == 1:
        fy, jv = jvp(tangents[0])
        return fy, jv[None]
    if n <= _UNROLL_TANGENTS:
        fy, linear = jax.linearize(fn, y)
        return fy, jnp.stack([linear(tangents[i]) for i in range(n)])
    return jax.vmap(jvp, out_axes=(None, 0))(tangents)


class Exact(AbstractEstimator):
    """The exact trace: one Jacobian-vector product per basis vector (the function
    linearised once and applied to each basis vector for a state of up to 4 entries,
    batched with `vmap` beyond), so the cost is that of `d` forward-mode passes for a
    state of size `d`.

    Use it for evaluation (test NLL), and for training when `d` is small. It takes no
    arguments and needs no key; [`trace`][cnftrace.trace] uses `lineax.diagonal`
    instead, which is cheap for structured operators.

    !!! example

        ```python
        fy, div = cnftrace.divergence(jnp.sin, jnp.zeros(4), estimator=cnftrace.Exact())
        print(div)  # 4.0: the Jacobian is the identity at 0
        ```
    """

    stochastic: ClassVar[bool] = False

    def draw(self, key, shape, dtype, *, event_ndim=1) -> None:
        del key, shape, dtype, event_ndim
        return None

    def estimate(self, fn, y, probes=None):
        # The unused norm is removed by XLA's dead-code elimination under `jit`.
        fy, div, _ = self.estimate_with_jacobian_norm(fn, y, probes)
        return fy, div

    def estimate_with_jacobian_norm(self, fn, y, probes=None):
        del probes
        size = y.size
        basis = jnp.eye(size, dtype=y.dtype).reshape((size,) + y.shape)
        fy, columns = _jvps(fn, y, basis)
        # columns[i] = J e_i: the trace sums the i-th entry of each column, the
        # squared Frobenius norm every entry's square.
        columns = columns.reshape(size, size)
        return fy, jnp.trace(columns), jnp.sum(columns**2)


class Hutchinson(AbstractEstimator):
    """Hutchinson's stochastic trace estimator, `mean_k eps_k^T J eps_k`.

    **Arguments:**

    - `num_probes`: how many probes to average; a static Python `int`, at least 1.
        Each probe costs one Jacobian-vector product.
    - `sampler`: the probe distribution, each with `E[eps eps^T] = I`:
        `"rademacher"` (entries +-1; lowest variance for most Jacobians),
        `"gaussian"` (standard normal entries) or `"sphere"` (uniform on the sphere of
        radius `sqrt(d)`).

    Probes take the floating dtype of the state they are drawn for. The estimate is
    unbiased; its variance falls like `1 / num_probes`.

    !!! example

        ```python
        est = cnftrace.Hutchinson(num_probes=4, sampler="gaussian")
        y = jnp.zeros(4)
        fy, div = cnftrace.divergence(jnp.sin, y, estimator=est, key=jr.key(0))
        ```
    """

    stochastic: ClassVar[bool] = True
    num_probes: int = eqx.field(static=True)
    sampler: Literal["rademacher", "gaussian", "sphere"] = eqx.field(static=True)

    def __init__(
        self,
        num_probes: int = 1,
        sampler: Literal["rademacher", "gaussian", "sphere"] = "rademacher",
    ):
        # Checked before assignment: a JAX array must never become a static field.
        if not is_int(num_probes):
            raise ValueError(
                "`num_probes` must be a Python int (it fixes array shapes, so it "
                f"cannot be a JAX array or a float); got {num_probes!r} of type "
                f"{type(num_probes).__name__}. Use e.g. `num_probes=1`."
            )
        if num_probes < 1:
            raise ValueError(
                f"`num_probes` must be at least 1; got {num_probes}. "
                "Use `num_probes=1` for the usual single-probe estimator."
            )
        if sampler not in _SAMPLERS:
            raise ValueError(f"`sampler` must be one of {_SAMPLERS}; got {sampler!r}.")
        self.num_probes = num_probes
        self.sampler = sampler

    def draw(self, key, shape, dtype, *, event_ndim: int = 1):
        if key is None:
            raise ValueError(
                "`Hutchinson` draws random probes and needs a PRNG key; pass "
                "`key=jax.random.key(seed)`, or use `cnftrace.Exact()` for the exact "
                "trace."
            )
        check_key("key", key)
        shape = tuple(shape)
        batch, event = (
            shape[: len(shape) - event_ndim],
            shape[len(shape) - event_ndim :],
        )
        full = batch + (self.num_probes,) + event
        if self.sampler == "rademacher":
            return jr.rademacher(key, full, dtype=dtype)
        noise = jr.normal(key, full, dtype=dtype)
        if self.sampler == "gaussian":
            return noise
        axes = tuple(range(len(full) - len(event), len(full)))
        size = math.prod(event)
        norm = jnp.sqrt(jnp.sum(noise**2, axis=axes, keepdims=True))
        return noise * (math.sqrt(size) / norm)

    def _check_probes(self, y, probes):
        if probes is None:
            raise ValueError(
                "`Hutchinson.estimate` needs probes; draw them with `Hutchinson.draw`."
            )
        if probes.shape != (self.num_probes,) + y.shape:
            raise ValueError(
                f"probes have shape {probes.shape}, but a state of shape {y.shape} "
                f"with num_probes={self.num_probes} needs "
                f"{(self.num_probes,) + y.shape}."
            )

    def estimate(self, fn, y, probes):
        # The unused norm is removed by XLA's dead-code elimination under `jit`.
        fy, div, _ = self.estimate_with_jacobian_norm(fn, y, probes)
        return fy, div

    def estimate_with_jacobian_norm(self, fn, y, probes):
        # E[|J eps|^2] = tr(J^T J E[eps eps^T]) = |J|_F^2 for any probe with
        # E[eps eps^T] = I: the Frobenius estimate reuses the trace's JVPs.
        self._check_probes(y, probes)
        fy, jvps = _jvps(fn, y, probes)
        axes = tuple(range(1, probes.ndim))
        div = jnp.mean(jnp.sum(probes * jvps, axis=axes))
        return fy, div, jnp.mean(jnp.sum(jvps**2, axis=axes))


def check_estimator(estimator, name: str = "estimator") -> None:
    """A `TypeError` naming every trace estimator unless `estimator` is one."""
    if not isinstance(estimator, AbstractEstimator):
        raise TypeError(
            f"`{name}` must be a trace estimator: `cnftrace.Exact()`, "
            "`cnftrace.Hutchinson(...)`, `cnftrace.HutchPlusPlus(...)` or "
            f"`cnftrace.XTrace(...)`; got {type(estimator).__name__}."
        )


def divergence(
    fn: Callable[[Float[Array, "*shape"]], Float[Array, "*shape"]],
    y: Float[Array, "*shape"],
    *,
    estimator: AbstractEstimator = Exact(),
    key: Key | None = None,
) -> tuple[Float[Array, "*shape"], Float[Array, ""]]:
    """Evaluates `fn(y)` and the divergence `tr(d fn / d y)` together.

    Both come from forward-mode Jacobian-vector products: one per basis vector for
    [`Exact`][cnftrace.Exact], one per probe for [`Hutchinson`][cnftrace.Hutchinson],
    `num_matvecs` for [`HutchPlusPlus`][cnftrace.HutchPlusPlus] and
    [`XTrace`][cnftrace.XTrace]; the primal `fn(y)` is computed once. It works under
    `jit`, `vmap` and `grad`.

    **Arguments:**

    - `fn`: a function from `y`'s shape to the same shape, e.g. `(d,) -> (d,)`.
    - `y`: the point, a floating array.
    - `estimator`: any estimator; [`Exact`][cnftrace.Exact] by default.
    - `key`: a PRNG key; required by stochastic estimators.

    **Returns:**

    `(fn(y), divergence)`, the divergence a scalar of `y`'s dtype.

    !!! example

        ```python
        fy, div = cnftrace.divergence(lambda y: jnp.tanh(y), jnp.ones(3))
        # A stochastic estimate, and its gradient with respect to the point:
        fy, div = cnftrace.divergence(
            jnp.tanh, jnp.ones(3), estimator=cnftrace.Hutchinson(), key=jr.key(0)
        )
        grad = jax.grad(lambda y: cnftrace.divergence(jnp.tanh, y)[1])(jnp.ones(3))
        ```
    """
    y = jnp.asarray(y)
    _check_floating(y, "y")
    if not isinstance(estimator, AbstractEstimator):
        raise TypeError(
            "`estimator` must be a cnftrace estimator such as `cnftrace.Exact()` or "
            f"`cnftrace.Hutchinson()`; got {type(estimator).__name__}."
        )
    out = jax.eval_shape(fn, y)
    if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != y.shape:
        got = out.shape if isinstance(out, jax.ShapeDtypeStruct) else out
        raise ValueError(
            f"`fn` must map an array of shape {y.shape} to the same shape (its "
            f"Jacobian must be square to have a trace); it returned {got}."
        )
    probes = estimator.draw(key, y.shape, y.dtype, event_ndim=y.ndim)
    return estimator.estimate(fn, y, probes)
