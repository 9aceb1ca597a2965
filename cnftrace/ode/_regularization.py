"""RNODE's regularisation integrals, as a flow's solves report them."""

import equinox as eqx
from jaxtyping import Array, Float


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
