"""Sketch-based trace estimators: Hutch++ (Meyer, Musco, Musco and Woodruff, 2021)
and XTrace (Epperly, Tropp and Webber, 2024).

Both run on a batched matrix-vector product `mv: (k, n) -> (k, n)` on rows; real
operators only."""

import abc
import math
from collections.abc import Callable
from typing import ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._base import AbstractEstimator, check_settings, need_probe_key
from ._hutchinson import Hutchinson

_SAMPLERS = ("rademacher", "gaussian")

BatchedMatvec = Callable[[Float[Array, "k n"]], Float[Array, "k n"]]
"""`mv(V)` returns the rows `A v` for the rows `v` of `V`."""


def _hutchpp_trace(mv: BatchedMatvec, probes: Float[Array, "2k n"]) -> Array:
    """Hutch++ from `2k` random vectors: the first `k` sketch, the last `k` probe."""
    k = probes.shape[0] // 2
    sketch, g = probes[:k], probes[k:]
    q, _ = jnp.linalg.qr(mv(sketch).T)  # (n, k), orthonormal columns
    g_perp = g - (g @ q) @ q.T  # rows (I - Q Q^T) g_j
    # Second round, batched: A Q for the exact part, A (I - QQ^T) G for the rest.
    out = mv(jnp.concatenate([q.T, g_perp]))
    exact_part = jnp.sum(q.T * out[:k])  # tr(Q^T A Q)
    residual = jnp.sum(g_perp * out[k:]) / k
    return exact_part + residual


def _inverse_rows(r: Float[Array, "m m"]) -> Float[Array, "m m"]:
    """`R^{-1}` of an upper-triangular `R` by unrolled back substitution (no LAPACK
    or loop primitive: see `_xtrace_trace`)."""
    m = r.shape[0]
    eye = jnp.eye(m, dtype=r.dtype)
    inverse = jnp.zeros_like(r)
    for i in reversed(range(m)):  # rows below i are done, rows i and above are zero
        inverse = inverse.at[i].set((eye[i] - r[i] @ inverse) / r[i, i])
    return inverse


def _leave_one_out_projectors(r: Float[Array, "m m"]) -> Float[Array, "m m m"]:
    """Per `i`, the projector `M_i` onto the columns of `R` but the `i`-th, in `Q`'s
    coordinates: `I - s_i s_i^T` from `R^{-T}`, or from singular vectors if `R` is
    singular."""
    m = r.shape[0]
    # Neither construction changes when R is scaled: make max|R_jj| = 1.
    scale = jax.lax.stop_gradient(jnp.max(jnp.abs(jnp.diagonal(r))))
    r = r / jnp.where(scale > 0, scale, 1)
    tol = m * jnp.finfo(r.dtype).eps
    diag = jnp.diagonal(r)
    singular = jnp.any(jnp.abs(diag) < tol)

    # Invertible R; tiny diagonal entries lifted to keep the unselected branch finite.
    lift = jnp.where(diag < 0, -tol, tol) - diag
    s = _inverse_rows(r + jnp.diag(jnp.where(jnp.abs(diag) < tol, lift, 0))).T
    s = s / jax.lax.stop_gradient(jnp.max(jnp.abs(s), axis=0, keepdims=True))
    s = s / jnp.linalg.norm(s, axis=0, keepdims=True)
    invertible = jnp.eye(m, dtype=r.dtype)[None] - jnp.einsum("ai,bi->iab", s, s)

    # Singular R; a harmless input where unselected keeps its derivative finite.
    harmless = jnp.diag(jnp.arange(1, m + 1, dtype=r.dtype))
    others = np.array([[j for j in range(m) if j != i] for i in range(m)])
    r_others = jnp.moveaxis(jnp.where(singular, r, harmless)[:, others], 1, 0)
    u, sv, _ = jnp.linalg.svd(r_others, full_matrices=False)
    kept = (sv > tol).astype(r.dtype)
    rank_deficient = jnp.einsum("iak,ik,ibk->iab", u, kept, u)
    return jnp.where(singular, rank_deficient, invertible)


def _xtrace_trace(mv: BatchedMatvec, omega: Float[Array, "m n"]) -> Array:
    """XTrace from `m` test vectors (rows of `omega`), with `2m` matvecs."""
    y = mv(omega)  # rows y_i = A w_i
    q, _ = jnp.linalg.qr(y.T)  # Y = Q R, Q (n, m)
    # R = Q^T Y, recomputed so the SVD below depends on Q: two concurrent LAPACK
    # kernels (or loop thunks) can deadlock XLA's CPU pool (docs/trace-estimators.md).
    r = q.T @ y.T
    z = mv(q.T)  # rows A q_j, i.e. z = Z^T with Z = A Q
    h = q.T @ z.T  # H = Q^T A Q
    proj = _leave_one_out_projectors(r)  # P_i = Q proj[i] Q^T
    w = q.T @ omega.T  # column i: Q^T w_i
    t = z @ omega.T  # column i: Z^T w_i = Q^T A^T w_i
    u = jnp.einsum("iab,bi->ia", proj, w)  # row i: Q^T P_i w_i
    # Per i: tr(P_i A P_i) + w_i^T (I - P_i) A (I - P_i) w_i, in Q-coordinates:
    # w^T A w - w^T P A w - w^T A P w + w^T P A P w.
    projected_trace = jnp.einsum("iab,ba->i", proj, h)
    residual = (
        jnp.sum(omega * y, axis=1)
        - jnp.sum(u * r.T, axis=1)
        - jnp.sum(u * t.T, axis=1)
        + jnp.einsum("ia,ab,ib->i", u, h, u)
    )
    return jnp.mean(projected_trace + residual)


class AbstractSketchEstimator(AbstractEstimator):
    """Base class of the estimators that need only a batched matrix-vector product.

    Subclasses give `num_vectors`, `sketch_size` and `_trace(mv, probes)`.
    """

    stochastic: ClassVar[bool] = True
    num_matvecs: eqx.AbstractVar[int]
    sampler: eqx.AbstractVar[str]

    @property
    @abc.abstractmethod
    def num_vectors(self) -> int:
        """How many random vectors of the operator's size one estimate draws."""

    @property
    @abc.abstractmethod
    def sketch_size(self) -> int:
        """The number of columns of the sketch; the operator's size must be at least
        this."""

    @abc.abstractmethod
    def _trace(self, mv: BatchedMatvec, probes: Float[Array, "v n"]) -> Array:
        """The estimate, for already checked probes."""

    def _check_size(self, size: int) -> None:
        if self.sketch_size > size:
            raise ValueError(
                f"`num_matvecs={self.num_matvecs}` is too large for an operator of "
                f"size {size}: `{type(self).__name__}` would sketch "
                f"{self.sketch_size} vectors in a space of dimension {size}. Use "
                f"`cnftrace.Exact()`, which costs {size} matrix-vector products and is "
                "exact, or a smaller `num_matvecs`."
            )

    def draw(self, key, shape, dtype, *, event_ndim: int = 1):
        need_probe_key(self, key, "random test vectors")
        shape = tuple(shape)
        self._check_size(math.prod(shape[len(shape) - event_ndim :]))
        # The same distributions as Hutchinson's probes, `num_vectors` per sample.
        probes = Hutchinson(self.num_vectors, self.sampler)
        return probes.draw(key, shape, dtype, event_ndim=event_ndim)

    def trace_of_matvec(
        self, mv: BatchedMatvec, probes: Float[Array, "v n"]
    ) -> Float[Array, ""]:
        """The trace estimate of the real `n x n` matrix `A` given by `mv`.

        **Arguments:**

        - `mv`: a batched matrix-vector product, `mv(V)[j] = A V[j]` for `V` of
            shape `(k, n)`. It is called twice (two rounds of products).
        - `probes`: the random vectors, shape `(num_vectors, n)`, from
            [`draw`][cnftrace.AbstractEstimator.draw] with `shape=(n,)`.

        **Returns:**

        A scalar, differentiable with respect to whatever `mv` closes over.
        """
        if probes.ndim != 2 or probes.shape[0] != self.num_vectors:
            raise ValueError(
                f"`probes` must have shape (num_vectors, n) = ({self.num_vectors}, n) "
                f"for `{type(self).__name__}(num_matvecs={self.num_matvecs})`; got "
                f"{probes.shape}. Draw them with `draw(key, (n,), dtype)`."
            )
        if not jnp.issubdtype(probes.dtype, jnp.floating):
            raise TypeError(
                f"`{type(self).__name__}` supports real operators only; got probes "
                f"of dtype {probes.dtype}. Use `cnftrace.Hutchinson` for complex ones."
            )
        self._check_size(probes.shape[1])
        return self._trace(mv, probes)

    def estimate(self, fn, y, probes):
        expected = (self.num_vectors,) + y.shape
        if probes is None or probes.shape != expected:
            got = None if probes is None else probes.shape
            raise ValueError(
                f"`{type(self).__name__}.estimate` needs probes of shape {expected} "
                f"for a state of shape {y.shape}; got {got}. Draw them with "
                f"`{type(self).__name__}.draw`."
            )
        if not jnp.issubdtype(y.dtype, jnp.floating):
            raise TypeError(
                f"`{type(self).__name__}` supports real states only; got dtype "
                f"{y.dtype}. Use `cnftrace.Hutchinson` for complex ones."
            )
        # One primal pass; the linear map is then applied in two batched rounds.
        fy, jvp = jax.linearize(fn, y)

        def mv(vs):
            return jax.vmap(lambda v: jvp(v.reshape(y.shape)).reshape(-1))(vs)

        return fy, self.trace_of_matvec(mv, probes.reshape(self.num_vectors, -1))


class HutchPlusPlus(AbstractSketchEstimator):
    """Hutch++: the trace on a random sketch, exactly, plus Hutchinson on the rest.

    With `k = num_matvecs / 3`, it takes `Q`, an orthonormal basis of `A S` for `k`
    random vectors `S`, and `k` further probes `G`, and returns

        tr(Q^T A Q) + (1/k) sum_j g_j^T (I - QQ^T) A (I - QQ^T) g_j,

    at a cost of `3k` products with `A`: unbiased, and exact when `rank(A) <= k`.

    **Arguments:**

    - `num_matvecs`: the budget of matrix-vector products, a static Python `int`, a
        multiple of 3, at least 3, and at most three times the operator's size.
    - `sampler`: `"gaussian"` (default) or `"rademacher"`, for both `S` and `G`.
        Rademacher vectors of a small operator may coincide (up to sign), and such
        a draw has no gradient.

    [`draw`][cnftrace.AbstractEstimator.draw] returns `2k` vectors per sample
    (sketch, then probes). Gradients need `A S` of full column rank.

    !!! example

        ```python
        a = jnp.diag(2.0 ** -jnp.arange(30))  # a fast-decaying spectrum
        op = lineax.MatrixLinearOperator(a)
        est = cnftrace.HutchPlusPlus(num_matvecs=12)
        cnftrace.trace(op, estimator=est, key=jr.key(0))  # close to 2
        ```
    """

    num_matvecs: int = eqx.field(static=True)
    sampler: Literal["rademacher", "gaussian"] = eqx.field(static=True)

    def __init__(
        self,
        num_matvecs: int,
        sampler: Literal["rademacher", "gaussian"] = "gaussian",
    ):
        self.num_matvecs, self.sampler = check_settings(
            "HutchPlusPlus", "num_matvecs", num_matvecs, sampler, _SAMPLERS, 3, 3
        )

    @property
    def num_vectors(self) -> int:
        return 2 * (self.num_matvecs // 3)

    @property
    def sketch_size(self) -> int:
        return self.num_matvecs // 3

    def _trace(self, mv, probes):
        return _hutchpp_trace(mv, probes)


class XTrace(AbstractSketchEstimator):
    """XTrace: every test vector sketches and probes, leaving itself out of the sketch.

    With `m = num_matvecs / 2` test vectors `w_1..w_m`, it computes `Y = A W = QR` and
    `Z = A Q` (`2m` products). For each `i`, `P_i` projects onto the span of `Y`
    without its column `i`, which does not depend on `w_i`, so

        tr(P_i A P_i) + w_i^T (I - P_i) A (I - P_i) w_i

    is an unbiased estimate; XTrace returns their mean. It is exact when
    `rank(A) <= m - 1`.

    **Arguments:**

    - `num_matvecs`: the budget of matrix-vector products, a static Python `int`,
        even, at least 4, and at most twice the operator's size (`m` test vectors
        must be linearly independent).
    - `sampler`: `"gaussian"` (default) or `"rademacher"` (see
        [`HutchPlusPlus`][cnftrace.HutchPlusPlus] on the choice).

    A rank-deficient `A W` still gives a finite, unbiased estimate; gradients need
    `A W` of full column rank.

    !!! example

        ```python
        a = jnp.diag(2.0 ** -jnp.arange(30))
        op = lineax.MatrixLinearOperator(a)
        cnftrace.trace(op, estimator=cnftrace.XTrace(12), key=jr.key(0))
        # In a CNF: the divergence of its vector field, 8 products per evaluation.
        field = cnftrace.ConcatSquashMLP(16, width=32, depth=2, key=jr.key(1))
        flow = cnftrace.CNF(field, dim=16, estimator=cnftrace.XTrace(8))
        ```
    """

    num_matvecs: int = eqx.field(static=True)
    sampler: Literal["rademacher", "gaussian"] = eqx.field(static=True)

    def __init__(
        self,
        num_matvecs: int,
        sampler: Literal["rademacher", "gaussian"] = "gaussian",
    ):
        self.num_matvecs, self.sampler = check_settings(
            "XTrace", "num_matvecs", num_matvecs, sampler, _SAMPLERS, 4, 2
        )

    @property
    def num_vectors(self) -> int:
        return self.num_matvecs // 2

    @property
    def sketch_size(self) -> int:
        return self.num_matvecs // 2

    def _trace(self, mv, probes):
        return _xtrace_trace(mv, probes)
