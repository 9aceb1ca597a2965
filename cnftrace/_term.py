"""A diffrax term for the instantaneous change of variables.

For `dz/dt = f(t, z, args)`, the log-density along a trajectory changes as
`d log p(z(t)) / dt = -tr(df/dz)` (Chen et al. 2018). `CNFTerm` augments any per-sample
vector field `f` with that second component, for a batch of samples at once.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from diffrax import ODETerm
from jaxtyping import Array, Float, PyTree

from ._custom_types import Key, VectorField
from ._estimators import AbstractEstimator, Exact


class CNFArgs(eqx.Module):
    """What [`CNFTerm`][cnftrace.CNFTerm] expects as the solve's `args`: the user's own
    `args` for the vector field, and the probes drawn for this solve.

    Build it with [`CNFTerm.make_args`][cnftrace.CNFTerm.make_args]. `counter`, when
    given, is a scalar whose gradient counts the backpropagated evaluations of the
    term (see [`make_args`][cnftrace.CNFTerm.make_args]).
    """

    args: PyTree[Any]
    probes: Array | None
    counter: Float[Array, ""] | None = None


def _count_vjps(fn: Callable, counter: Array, *inputs):
    """`fn(*inputs)`, whose reverse-mode derivative adds exactly 1 to the cotangent of
    `counter` each time it is backpropagated through, and is otherwise `fn`'s own.

    The gradient of a loss with respect to `counter` is then the number of
    evaluations of `fn` that reverse mode went through: for discrete adjoints
    (`RecursiveCheckpointAdjoint`, `DirectAdjoint`) the backward pass's vector-field
    VJPs. (`BacksolveAdjoint` integrates cotangents instead of summing them, so there
    the gradient is not a count.)
    """
    diff, static = eqx.partition(inputs, eqx.is_array)

    @jax.custom_vjp
    def counted(counter, diff):
        del counter
        return fn(*eqx.combine(diff, static))

    def counted_fwd(counter, diff):
        out, pullback = jax.vjp(lambda d: fn(*eqx.combine(d, static)), diff)
        return out, (pullback, counter)

    def counted_bwd(residuals, ct_out):
        pullback, counter = residuals
        (ct_diff,) = pullback(ct_out)
        return jnp.ones_like(counter), ct_diff

    counted.defvjp(counted_fwd, counted_bwd)
    return counted(counter, diff)


def _vmap_n(fn, n: int, in_axes):
    for _ in range(n):
        fn = jax.vmap(fn, in_axes=in_axes)
    return fn


class CNFTerm(ODETerm):
    r"""Wraps a per-sample vector field into the augmented CNF dynamics.

    The state is `(z, delta_logp)`, with `z` of shape `(*batch, *event)` and
    `delta_logp` of shape `(*batch,)`. The term's vector field is

    $$\frac{dz}{dt} = f(t, z, \text{args}),\qquad
    \frac{d\,\delta\log p}{dt} = -\operatorname{tr}\frac{\partial f}{\partial z},$$

    applied to every sample of the batch, with the trace from `estimator`. So
    `delta_logp(t1) = log p_t1(z(t1)) - log p_t0(z(t0))`.

    Probes are part of the solve's `args` (see
    [`make_args`][cnftrace.CNFTerm.make_args]): they are drawn once per solve and
    reused at every evaluation, so the ODE stays deterministic and adaptive solvers
    keep their step counts. The term works with any diffrax solver, step-size
    controller and adjoint. It is a `diffrax.ODETerm`, so solvers that ask for an ODE
    term accept it.

    !!! example

        ```python
        term = cnftrace.CNFTerm(vector_field, estimator=cnftrace.Hutchinson())
        args = term.make_args(z0, key=key)
        y0 = term.initial_state(z0)
        sol = diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 1.0, None, y0, args=args,
            stepsize_controller=diffrax.PIDController(
                rtol=1e-5, atol=1e-5, norm=cnftrace.max_rms_norm
            ),
        )
        z1, delta_logp = sol.ys  # each with a leading axis of length 1 (t1)
        ```

    **Arguments:**

    - `vector_field`: `f(t, z, args)` for *one* sample `z` of shape `event`; returns an
        array of the same shape.
    - `estimator`: the trace estimator, [`Exact`][cnftrace.Exact] by default.
    - `event_ndim`: how many trailing dimensions of `z` make one sample (1 for vectors
        of shape `(d,)`, 3 for images of shape `(c, h, w)`).
    """

    vector_field: VectorField
    estimator: AbstractEstimator = Exact()
    event_ndim: int = eqx.field(default=1, static=True)

    def make_args(
        self,
        z0: Array,
        *,
        key: Key | None = None,
        args=None,
        counter: Float[Array, ""] | None = None,
    ) -> CNFArgs:
        """Draws this solve's probes for the initial state `z0` and bundles them
        with the vector field's own `args`.

        `counter` (optional) is a float scalar, usually `jnp.zeros(())`, to count
        backward evaluations: the gradient of a loss with respect to it equals the
        number of times reverse mode backpropagates through the term's vector field
        (the backward NFE of a discrete adjoint such as diffrax's default
        `RecursiveCheckpointAdjoint`). Its value never changes the solution.
        """
        probes = self.estimator.draw(
            key, z0.shape, z0.dtype, event_ndim=self.event_ndim
        )
        return CNFArgs(args=args, probes=probes, counter=counter)

    def initial_state(self, z0: Array) -> tuple[Array, Float[Array, " *batch"]]:
        """`(z0, zeros)`: the augmented initial state."""
        batch_shape = z0.shape[: z0.ndim - self.event_ndim]
        return z0, jnp.zeros(batch_shape, z0.dtype)

    def vf(self, t, y, args: CNFArgs):
        z, _ = y
        if not isinstance(args, CNFArgs):
            raise TypeError(
                "`CNFTerm` needs `args=term.make_args(z0, key=..., args=...)` in "
                f"`diffeqsolve`; got args of type {type(args).__name__}."
            )
        if args.counter is not None:
            # The term itself is an input (not closed over), so that gradients reach
            # the vector field's parameters through the custom VJP.
            vf = type(self)._vf
            return _count_vjps(vf, args.counter, self, t, z, args.args, args.probes)
        return self._vf(t, z, args.args, args.probes)

    def _vf(self, t, z, user_args, probes):
        def one_sample(z_i, probes_i):
            def fn(u):
                return self.vector_field(t, u, user_args)

            dz, div = self.estimator.estimate(fn, z_i, probes_i)
            return dz, -div

        batch_ndim = z.ndim - self.event_ndim
        dz, dlogp = _vmap_n(one_sample, batch_ndim, (0, 0))(z, probes)
        return dz, dlogp.astype(z.dtype)


class StateTerm(ODETerm):
    """The plain dynamics `dz/dt = f(t, z, args)` for a batch of samples, used where no
    log-density is needed (sampling and the bare forward and inverse maps)."""

    vector_field: VectorField
    event_ndim: int = eqx.field(default=1, static=True)

    def vf(self, t, y, args):
        batch_ndim = y.ndim - self.event_ndim
        fn = _vmap_n(lambda z_i: self.vector_field(t, z_i, args), batch_ndim, 0)
        return fn(y)
