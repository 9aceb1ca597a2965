"""Conditional flow matching: training a CNF's vector field by regression, with no
ODE solve in the training step (Lipman et al. 2023; Tong et al. 2024).

The time convention is the likelihood side's: a block maps data at `t0` to the base
at `t1`, and the path time is `s = (t - t0) / (t1 - t0)`, so the field's velocity in
path time is `(t1 - t0) f(t, x_s)`. A chain of `k` blocks covers the path in `k`
equal parts, block `i` the part `[i/k, (i+1)/k]`; a batch is split between the
blocks (stratified in `s`), so a step costs one evaluation of a field per sample."""

from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jaxtyping import Array, Float

from .._checks import is_number
from .._custom_types import Key
from ..flows import AbstractFlow
from ._base import AbstractObjective

Coupling = Literal["independent", "ot"]


class FlowMatching(AbstractObjective):
    """The conditional flow-matching objective, for [`fit`][cnftrace.fit]'s
    `objective` (the strings `"fm"` and `"ot-fm"` stand for its two couplings with
    `sigma = 0`): the loss of [`flow_matching_loss`][cnftrace.flow_matching_loss],
    with no ODE solve in the training step. It trains a `CNF` or a `Chain` of them
    with fixed end times; the history records one forward and one backward
    evaluation of the field per step.

    **Arguments:**

    - `sigma`: the width of the Gaussian path at the data end, `0 <= sigma < 1`.
        The path from a data point `x` to a base draw `e` is
        `x_s = (1 - s) x + (sigma + (1 - sigma) s) e` on the path time `s` in
        `[0, 1]`, so the model learns the data convolved with `N(0, sigma^2)`;
        `0` (the default) learns the data itself.
    - `coupling`: how data points and base draws are paired within a batch:
        `"independent"` (at random; Lipman et al. 2023) or `"ot"` (the minibatch's
        exact optimal-transport assignment under squared Euclidean cost, by the
        Hungarian algorithm of `scipy.optimize.linear_sum_assignment`; Tong et al.
        2024). The OT pairing makes the learned paths straighter, so solves take
        fewer steps.

    !!! example

        ```python
        objective = cnftrace.FlowMatching(sigma=0.01, coupling="ot")
        # cnftrace.fit(flow, data, key=key, objective=objective)
        ```
    """

    sigma: float = 0.0
    coupling: Coupling = eqx.field(static=True, default="independent")

    def __check_init__(self):
        if not is_number(self.sigma):
            raise TypeError(f"`sigma` must be a number; got {self.sigma!r}.")
        if not 0 <= self.sigma < 1:
            raise ValueError(f"`sigma` must be in [0, 1); got {self.sigma!r}.")
        if self.coupling not in ("independent", "ot"):
            raise ValueError(
                f"`coupling` must be 'independent' or 'ot'; got {self.coupling!r}."
            )

    def loss(self, flow, x, context, key, counter=None):
        loss = flow_matching_loss(flow, x, key=key, objective=self, context=context)
        # One evaluation of the field forward and one backward, and no solve.
        return loss, {"nfe": jnp.asarray(1), "nfe_backward": jnp.asarray(1)}

    def check(self, flow):
        check_flow_matching(flow, self)


# The strings `fit` and `flow_matching_loss` take for the two couplings.
BY_NAME = {"fm": FlowMatching(), "ot-fm": FlowMatching(coupling="ot")}


def check_flow_matching(flow: AbstractFlow, objective: FlowMatching) -> None:
    """A clear error for a flow that flow matching cannot train: one whose map is
    not its blocks' maps one after the other, one that learns its end times, or a
    conditional flow under the OT coupling."""
    if not flow.composes_blocks:
        raise TypeError(
            "flow matching trains a `cnftrace.CNF` or a `cnftrace.Chain` of them, "
            "whose map is its blocks' maps one after the other; a "
            f"{type(flow).__name__} transforms its samples between its blocks. "
            "Train it with `objective='mle'`."
        )
    for i, block in enumerate(flow.blocks):
        if block.learn_t1:
            raise ValueError(
                "flow matching fixes the time span, so it cannot learn the end time: "
                f"block {i} was built with `learn_t1=True`. Build it with a fixed "
                "`t1`, or train with `objective='mle'`."
            )
    if objective.coupling == "ot" and flow.context_dim is not None:
        raise ValueError(
            "the OT coupling (`objective='ot-fm'`) is not available for a "
            "conditional flow: pairing across contexts would bias each context's "
            "base distribution. Use the independent coupling (`objective='fm'`)."
        )


def conditional_path(
    x: Float[Array, "n ..."],
    noise: Float[Array, "n ..."],
    s: Float[Array, " n"],
    sigma: float = 0.0,
) -> tuple[Float[Array, "n ..."], Float[Array, "n ..."]]:
    """The point `x_s` on each sample's Gaussian path from data `x` (at `s = 0`) to
    base draw `noise` (at `s = 1`), and the path's velocity `d x_s / ds`.

    **Returns:**

    `(x_s, u)` with `x_s = (1 - s) x + (sigma + (1 - sigma) s) noise` and
    `u = (1 - sigma) noise - x`.
    """
    s = s.reshape(s.shape + (1,) * (x.ndim - 1))
    xs = (1 - s) * x + (sigma + (1 - sigma) * s) * noise
    return xs, (1 - sigma) * noise - x


def _assignment(cost: np.ndarray) -> np.ndarray:
    from scipy.optimize import linear_sum_assignment

    cost = np.asarray(cost, np.float64)
    if not np.isfinite(cost).all():
        # The step rejects a non-finite batch itself; give it any pairing.
        return np.arange(cost.shape[0], dtype=np.int32)
    _, cols = linear_sum_assignment(cost)  # its rows come back as 0, 1, ..., n-1
    return cols.astype(np.int32)


def ot_pairing(x: Float[Array, "n ..."], noise: Float[Array, "n ..."]) -> Array:
    """`noise` reordered so that `noise[i]` is paired with `x[i]` by the exact
    optimal-transport assignment of the batch under squared Euclidean cost (the
    Hungarian algorithm, on the host)."""
    n = x.shape[0]
    a = jax.lax.stop_gradient(x).reshape(n, -1)
    b = noise.reshape(n, -1)
    cost = jnp.sum(a**2, 1)[:, None] + jnp.sum(b**2, 1)[None, :] - 2 * a @ b.T
    shape = jax.ShapeDtypeStruct((n,), jnp.int32)
    order = jax.pure_callback(_assignment, shape, cost, vmap_method="sequential")
    return noise[order]


def flow_matching_loss(
    flow: AbstractFlow,
    x: Float[Array, "n ..."],
    *,
    key: Key,
    objective: FlowMatching | str = "fm",
    context: Float[Array, "n context"] | None = None,
) -> Float[Array, ""]:
    """The conditional flow-matching loss of `flow` on the batch `x`.

    Each sample gets a partner drawn from the base (paired at random, or by minibatch
    optimal transport) and a path time `s ~ U[0, 1]`; the loss is the mean over
    samples and elements of `((t1 - t0) f(t, x_s) - u)^2`, the field's velocity in
    path time against the path's (see [`FlowMatching`][cnftrace.FlowMatching]).
    Its minimiser is the field whose flow carries the data to the base, so the
    trained flow's `log_prob` and `sample` need no change.

    **Arguments:**

    - `flow`: a [`CNF`][cnftrace.CNF], or a [`Chain`][cnftrace.Chain] of them
        (block `i` of `k` covers path times `[i/k, (i+1)/k]`), with fixed end times.
    - `x`: a batch of data, shape `(n, *event_shape)`.
    - `key`: draws the partners and the times.
    - `objective`: `"fm"`, `"ot-fm"` or a [`FlowMatching`][cnftrace.FlowMatching].
    - `context`: for a conditional flow, one context row per sample (only with the
        independent coupling: an OT pairing across contexts would bias each
        context's base distribution).

    !!! example

        ```python
        key = jax.random.key(0)
        field = cnftrace.ConcatSquashMLP(2, width=32, depth=2, key=key)
        flow = cnftrace.CNF(field, dim=2)
        x = jax.random.normal(key, (64, 2))
        loss = cnftrace.flow_matching_loss(flow, x, key=key, objective="ot-fm")
        ```
    """
    if isinstance(objective, str):
        objective = BY_NAME.get(objective, objective)
    if not isinstance(objective, FlowMatching):
        raise ValueError(
            "`objective` must be a flow-matching objective ('fm', 'ot-fm' or a "
            "`cnftrace.FlowMatching`); the maximum-likelihood loss is "
            f"`-flow.log_prob(x).mean()`. Got {objective!r}."
        )
    check_flow_matching(flow, objective)
    blocks = flow.blocks
    x = jnp.asarray(x)
    if x.ndim != 1 + len(flow.event_shape) or x.shape[1:] != flow.event_shape:
        raise ValueError(
            f"`x` must have shape (n, *{flow.event_shape}); got {x.shape}."
        )
    if (context is None) != (flow.context_dim is None):
        raise ValueError(
            "`context` must be given exactly when the flow is conditional "
            f"(context_dim={flow.context_dim})."
        )
    n, k = x.shape[0], len(blocks)
    time_key, noise_key = jr.split(key)
    # The path's other end is a draw of the base (the standard normal by default);
    # a trainable base is a constant here: flow matching fits the field to it.
    noise = jax.lax.stop_gradient(flow.base.sample(noise_key, n, dtype=x.dtype))
    if objective.coupling == "ot":
        noise = ot_pairing(x, noise)
    # Sample i goes to block i % k, at a time uniform on that block's part of [0, 1].
    part = jnp.asarray(np.arange(n) % k, x.dtype)
    s = (part + jr.uniform(time_key, (n,), x.dtype)) / k
    xs, u = conditional_path(x, noise, s, objective.sigma)
    total = jnp.zeros((), x.dtype)
    for i, block in enumerate(blocks):
        rows = np.arange(i, n, k)
        if rows.size == 0:
            continue
        span = block.t1 - block.t0
        t = block.t0 + (s[rows] * k - i) * span
        args = None if context is None else context[rows]

        def field(t_j, z_j, c_j, block=block):
            return block.vector_field(t_j, z_j, block.args if c_j is None else c_j)

        in_axes = (0, 0, None if args is None else 0)
        v = jax.vmap(field, in_axes)(t, xs[rows], args)
        # The block runs a 1/k share of the path in `span` time units.
        total = total + jnp.sum((k * span * v - u[rows]) ** 2)
    return total / x.size


__all__ = [
    "FlowMatching",
    "conditional_path",
    "flow_matching_loss",
    "ot_pairing",
]
