"""A diffrax term for the instantaneous change of variables (see `CNFTerm`)."""

import contextlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from diffrax import ODETerm
from jaxtyping import Array, Float, PyTree

from .._custom_types import Key, VectorField
from .._defaults import MATMUL_PRECISION
from ..estimators import AbstractEstimator, Exact


class CNFArgs(eqx.Module):
    """What [`CNFTerm`][cnftrace.CNFTerm] expects as the solve's `args`, built by
    [`CNFTerm.make_args`][cnftrace.CNFTerm.make_args]: the vector field's `args` and
    the probes, shape `(*batch, num_probes, *event)` (`None` if deterministic).

    !!! example

        ```python
        term = cnftrace.CNFTerm(lambda t, z, args: -z, estimator=cnftrace.Hutchinson())
        args = term.make_args(jnp.ones((5, 2)), key=jr.key(0))
        print(args.probes.shape)  # (5, 1, 2): one probe per sample
        ```
    """

    args: PyTree[Any]
    probes: Array | None
    counter: Float[Array, ""] | None = None
    context: Array | None = None


def _count_vjps(fn: Callable, counter: Array, *inputs):
    """`fn(*inputs)`, whose VJP adds 1 to `counter`'s cotangent per pass: the
    gradient counts the backward evaluations of a discrete adjoint (not of
    `BacksolveAdjoint`, which integrates cotangents)."""
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


def checked_output(dz, z):
    """The vector field's output `dz` for one sample `z`, checked at trace time."""
    shape = getattr(dz, "shape", None)
    if shape is None or not hasattr(dz, "dtype"):
        raise TypeError(
            "the vector field must return an array, dz/dt for the sample; it "
            f"returned {type(dz).__name__}."
        )
    if tuple(shape) != tuple(z.shape):
        raise ValueError(
            f"the vector field returned shape {tuple(shape)} for a sample of shape "
            f"{tuple(z.shape)}; it must return dz/dt, of the sample's shape (does its "
            "output size match the flow's `dim`?)."
        )
    if not jnp.issubdtype(dz.dtype, jnp.floating):
        raise TypeError(
            f"the vector field returned dtype {dz.dtype}; it must return floating "
            f"dz/dt (the sample's dtype is {z.dtype})."
        )
    return dz


def check_matmul_precision(value):
    """`value` if JAX takes it as a matmul precision (or it is None), else a
    `ValueError` naming `matmul_precision`."""
    if value is None:
        return None
    try:
        with jax.default_matmul_precision(value):
            pass
    except (ValueError, TypeError) as e:
        raise ValueError(
            "`matmul_precision` must be None (JAX's default) or a precision JAX "
            "names, such as 'float32', 'tensorfloat32' or 'bfloat16'; got "
            f"{value!r}."
        ) from e
    return value


def field_precision(name: str | None):
    """The context in which a term traces its vector field: JAX's matmul precision
    `name` for 32-bit inputs ("float32", "tensorfloat32", "bfloat16"), or JAX's own
    default where `name` is None. The precision is written into each matrix product
    as it is traced, and their transposes in the backward pass keep it."""
    if name is None:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(name)


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

    per sample, with the trace from `estimator`, so `delta_logp(t1) = log p_t1(z(t1))
    - log p_t0(z(t0))`. With `regularize=True` the state
    gains RNODE's two integrals, `(z, delta_logp, kinetic, jacobian)`:

    $$\frac{d\,\text{kinetic}}{dt} = \lVert f \rVert^2,\qquad
    \frac{d\,\text{jacobian}}{dt} = \lVert \partial f/\partial z \rVert_F^2,$$

    from the same probes as the divergence; leave them out of the step-size control
    (`norm=lambda y: cnftrace.max_rms_norm(y[:2])`). Probes are drawn once per solve
    ([`make_args`][cnftrace.CNFTerm.make_args]).

    !!! example

        ```python
        def vector_field(t, z, args):  # one sample z of shape (2,)
            return jnp.tanh(z) * args

        z0 = jr.normal(jr.key(0), (100, 2))  # a batch of 100 samples
        term = cnftrace.CNFTerm(vector_field, estimator=cnftrace.Hutchinson())
        args = term.make_args(z0, key=jr.key(1), args=0.5)  # probes drawn once
        y0 = term.initial_state(z0)
        sol = diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 1.0, None, y0, args=args,
            stepsize_controller=diffrax.PIDController(
                rtol=1e-5, atol=1e-5, norm=cnftrace.max_rms_norm
            ),
        )
        z1, delta_logp = sol.ys  # each with a leading axis of length 1 (t1)
        print(z1.shape, delta_logp.shape)  # (1, 100, 2) (1, 100)
        ```

    **Arguments:**

    - `vector_field`: `f(t, z, args)` for *one* sample `z`, returning `z`'s shape.
    - `estimator`: the trace estimator, [`Exact`][cnftrace.Exact] by default.
    - `event_ndim`: how many trailing dimensions of `z` make one sample.
    - `regularize`: also integrate the kinetic energy and the Jacobian's squared
        Frobenius norm.
    - `matmul_precision`: the precision of the field's float32 matrix products,
        "float32" by default. On recent NVIDIA GPUs JAX's own default is
        TensorFloat-32, whose rounding (about 1e-3 relative) is far above the
        solver's usual tolerances: its error estimates then see the rounding, not the
        truncation, and the solve takes several times the steps. `None` keeps JAX's
        default (CPUs compute in float32 either way).
    """

    vector_field: VectorField
    estimator: AbstractEstimator = Exact()
    event_ndim: int = eqx.field(default=1, static=True)
    regularize: bool = eqx.field(default=False, static=True)
    matmul_precision: str | None = eqx.field(default=MATMUL_PRECISION, static=True)

    def __check_init__(self):
        check_matmul_precision(self.matmul_precision)

    def make_args(
        self,
        z0: Float[Array, "..."],
        *,
        key: Key | None = None,
        args=None,
        counter: Float[Array, ""] | None = None,
        context: Float[Array, "*batch context"] | None = None,
    ) -> CNFArgs:
        """The [`CNFArgs`][cnftrace.CNFArgs] to pass as `diffeqsolve`'s `args`: this
        solve's probes for `z0`, with the vector field's own `args`.

        **Arguments:**

        - `z0`: the initial state, shape `(*batch, *event)`.
        - `key`: a PRNG key; required by stochastic estimators.
        - `args`: the vector field's own `args`, the same for every sample.
        - `counter`: optional float scalar whose gradient counts the backward
            pass's vector-field evaluations.
        - `context`: optional per-sample conditioning, leading axes `z0`'s batch
            axes, passed as `f(t, z_i, context_i)` (`args` must be `None`).
        """
        probes = self.estimator.draw(
            key, z0.shape, z0.dtype, event_ndim=self.event_ndim
        )
        batch_shape = z0.shape[: z0.ndim - self.event_ndim]
        if context is not None:
            if args is not None:
                raise ValueError(
                    "a conditional solve passes each sample's `context` to the vector "
                    "field as its `args`; pass `args=None` (put constants in the "
                    "vector field itself)."
                )
            _check_context(context, batch_shape)
        return CNFArgs(args=args, probes=probes, counter=counter, context=context)

    def initial_state(self, z0: Float[Array, "..."]) -> tuple[Float[Array, "..."], ...]:
        """The augmented initial state for `z0`: `(z0, zeros)`, or
        `(z0, zeros, zeros, zeros)` with `regularize`."""
        batch_shape = z0.shape[: z0.ndim - self.event_ndim]
        zeros = jnp.zeros(batch_shape, z0.dtype)
        return (z0, zeros, zeros, zeros) if self.regularize else (z0, zeros)

    def vf(self, t, y, args: CNFArgs):
        z = y[0]
        if not isinstance(args, CNFArgs):
            raise TypeError(
                "`CNFTerm` needs `args=term.make_args(z0, key=..., args=...)` in "
                f"`diffeqsolve`; got args of type {type(args).__name__}."
            )
        inputs = (self, t, z, args.args, args.probes, args.context)
        if args.counter is not None:
            # The term itself is an input (not closed over), so that gradients reach
            # the vector field's parameters through the custom VJP.
            return _count_vjps(type(self)._vf, args.counter, *inputs)
        return self._vf(*inputs[1:])

    def _vf(self, t, z, user_args, probes, context):
        with field_precision(self.matmul_precision):
            return self._vf_batch(t, z, user_args, probes, context)

    def _vf_batch(self, t, z, user_args, probes, context):
        def one_sample(z_i, probes_i, context_i):
            field_args = user_args if context is None else context_i

            def fn(u):
                return checked_output(self.vector_field(t, u, field_args), u)

            if not self.regularize:
                dz, div = self.estimator.estimate(fn, z_i, probes_i)
                return dz, -div
            dz, div, frobenius = self.estimator.estimate_with_jacobian_norm(
                fn, z_i, probes_i
            )
            return dz, -div, jnp.sum(dz**2), frobenius

        batch_ndim = z.ndim - self.event_ndim
        context_axis = None if context is None else 0
        out = _vmap_n(one_sample, batch_ndim, (0, 0, context_axis))(z, probes, context)
        return (out[0],) + tuple(o.astype(z.dtype) for o in out[1:])


def _check_context(context, batch_shape: tuple[int, ...]) -> None:
    if jnp.shape(context)[: len(batch_shape)] != batch_shape:
        raise ValueError(
            f"`context` must have one entry per sample (leading shape {batch_shape}); "
            f"got shape {jnp.shape(context)}."
        )


class StateTerm(ODETerm):
    """The plain dynamics `dz/dt = f(t, z, args)` for a batch, where no log-density
    is needed; with `per_sample_args=True`, sample `i` gets `args[i]`. Matrix
    products in the field run at `matmul_precision`, as in
    [`CNFTerm`][cnftrace.CNFTerm]."""

    vector_field: VectorField
    event_ndim: int = eqx.field(default=1, static=True)
    per_sample_args: bool = eqx.field(default=False, static=True)
    matmul_precision: str | None = eqx.field(default=MATMUL_PRECISION, static=True)

    def __check_init__(self):
        check_matmul_precision(self.matmul_precision)

    def vf(self, t, y, args):
        batch_ndim = y.ndim - self.event_ndim
        axes = (0, 0 if self.per_sample_args else None)
        fn = lambda z_i, a: checked_output(self.vector_field(t, z_i, a), z_i)
        with field_precision(self.matmul_precision):
            return _vmap_n(fn, batch_ndim, axes)(y, args)
