"""The exact trace, from one Jacobian-vector product per basis vector."""

from typing import ClassVar

import jax.numpy as jnp

from ._base import AbstractEstimator, jvp_columns


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
        fy, columns = jvp_columns(fn, y, basis)
        # columns[i] = J e_i: the trace sums the i-th entry of each column, the
        # squared Frobenius norm every entry's square.
        columns = columns.reshape(size, size)
        return fy, jnp.trace(columns), jnp.sum(columns**2)
