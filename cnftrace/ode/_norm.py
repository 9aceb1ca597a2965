"""Step-size error norms for solves over a batch of independent samples."""

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float, PyTree


def max_rms_norm(tree: PyTree[Array], batch_ndim: int = 1) -> Float[Array, ""]:
    """The maximum over samples of each sample's root-mean-square.

    Use it as the `norm` of a `diffrax.PIDController` when the state holds a batch
    of independent samples, so that every sample meets the tolerance as if it were
    solved on its own: `diffrax.PIDController(rtol, atol, norm=cnftrace.max_rms_norm)`.
    diffrax's default RMS over the whole state would let a few badly resolved
    samples hide among many easy ones.

    **Arguments:**

    - `tree`: a pytree of arrays (a CNF's state `(z, delta_logp)`, say). Every leaf
        must have the same `batch_ndim` leading (sample) dimensions; the RMS of a
        sample runs over all its entries in all leaves.
    - `batch_ndim`: how many leading dimensions index the samples.

    !!! example

        ```python
        z = jnp.array([[3.0, 4.0], [0.0, 0.0]])  # two samples
        logp = jnp.array([0.0, 0.0])
        cnftrace.max_rms_norm((z, logp))  # sqrt((9 + 16) / 3), from the first sample
        ```
    """
    leaves = jtu.tree_leaves(tree)
    if not leaves:
        return jnp.asarray(0.0)
    batch_shape = jnp.shape(leaves[0])[:batch_ndim]
    total = 0
    count = 0
    for leaf in leaves:
        leaf = jnp.asarray(leaf)
        if leaf.shape[:batch_ndim] != batch_shape:
            raise ValueError(
                f"every leaf must share the batch shape {batch_shape}; got a leaf of "
                f"shape {leaf.shape}."
            )
        flat = leaf.reshape(batch_shape + (-1,))
        total = total + jnp.sum(jnp.abs(flat) ** 2, axis=-1)
        count += flat.shape[-1]
    mean_square = jnp.max(total) / count
    return jnp.sqrt(mean_square)


def max_rms_seminorm(tree: PyTree[Array], batch_ndim: int = 1) -> Float[Array, ""]:
    """[`max_rms_norm`][cnftrace.max_rms_norm] for the augmented state of
    `diffrax.BacksolveAdjoint`'s backward solve, `(y, a_y, a_args, a_terms)`.

    Only `(y, a_y)` are batched; the parameter adjoints are integrals that do not feed
    back into the dynamics, so they are left out of error control (a seminorm, as in
    Kidger et al. 2021, "Hey, that's not an ODE"). [`CNF`][cnftrace.CNF] uses it by
    itself when its `adjoint` is a `diffrax.BacksolveAdjoint`.

    **Arguments:**

    - `tree`: the backward solve's state `(y, a_y, a_args, a_terms)`.
    - `batch_ndim`: how many leading dimensions of `y` and `a_y` index the samples.

    !!! example

        ```python
        controller = diffrax.PIDController(
            rtol=1e-5, atol=1e-5, norm=cnftrace.max_rms_seminorm
        )
        adjoint = diffrax.BacksolveAdjoint(stepsize_controller=controller)
        ```
    """
    y, a_y, _, _ = tree
    return max_rms_norm((y, a_y), batch_ndim)


def state_and_log_density_norm(y) -> Float[Array, ""]:
    """The error norm of a regularised solve: `max_rms_norm` over the state and the
    log-density only, leaving RNODE's integrals out of step-size control."""
    return max_rms_norm(y[:2])
