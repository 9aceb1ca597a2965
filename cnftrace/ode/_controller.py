"""The step-size controller of a CNF's solve, and the first step it starts from."""

from collections.abc import Callable

import diffrax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ._norm import max_rms_norm


class FirstStepController(diffrax.AbstractAdaptiveStepSizeController):
    """A `PIDController` that starts from a given first step (a traced value, or the
    user's `dt0`).

    Given as `dt0`, a first step makes diffrax check its sign against the span, with
    an `eqx.error_if` (a host callback in the compiled program, which JAX's
    persistent compilation cache does not store) unless the step and the span are
    Python numbers. So `diffeqsolve` gets no `dt0` (or, for `BacksolveAdjoint`, a
    Python number of the right sign), and the controller starts from the magnitude
    of the step (diffrax solves in the direction of time)."""

    controller: diffrax.PIDController
    first_step: Float[Array, ""]
    rtol: float
    atol: float
    norm: Callable

    def __init__(self, controller: diffrax.PIDController, first_step):
        self.controller = controller
        self.first_step = jnp.abs(first_step)
        self.rtol, self.atol, self.norm = (
            controller.rtol,
            controller.atol,
            controller.norm,
        )

    def wrap(self, direction):
        return FirstStepController(self.controller.wrap(direction), self.first_step)

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        del dt0
        return self.controller.init(
            terms, t0, t1, y0, self.first_step, args, func, error_order
        )

    def adapt_step_size(self, *args, **kwargs):
        return self.controller.adapt_step_size(*args, **kwargs)


def initial_step(
    field: diffrax.AbstractTerm,
    t_start,
    t_end,
    z0: Array,
    args,
    *,
    rtol: float,
    atol: float,
    order: int,
    f0: Array | None = None,
) -> Float[Array, ""]:
    """Hairer, Norsett & Wanner's starting step (Solving ODEs I, II.4) with the
    max-over-samples norm, signed in the direction of time, from `f0 = f(t_start,
    z0)` (evaluated here if not given) and one more plain evaluation of `field`.

    diffrax's own heuristic is skipped for wrapped terms (it then starts at 0.01),
    which costs CNF solves a few wasted steps. The step is not differentiated."""
    z0 = lax.stop_gradient(z0)
    direction = jnp.sign(t_end - t_start)
    scale = atol + rtol * jnp.abs(z0)
    if f0 is None:
        f0 = field.vf(t_start, z0, args)
    f0 = lax.stop_gradient(f0)
    d0 = max_rms_norm(z0 / scale)
    d1 = max_rms_norm(f0 / scale)
    span = jnp.abs(t_end - t_start)
    # The trial step stays inside the span: beyond it a field may be singular (a
    # diffusion model's probability-flow drift at t = 0, where sigma vanishes).
    h0 = jnp.minimum(jnp.where((d0 < 1e-5) | (d1 < 1e-5), 1e-6, 0.01 * d0 / d1), span)
    z1 = z0 + direction * h0 * f0
    f1 = lax.stop_gradient(field.vf(t_start + direction * h0, z1, args))
    d2 = max_rms_norm((f1 - f0) / scale) / h0
    h1 = jnp.where(
        jnp.maximum(d1, d2) <= 1e-15,
        jnp.maximum(1e-6, h0 * 1e-3),
        (0.01 / jnp.maximum(d1, d2)) ** (1.0 / (order + 1)),
    )
    h = jnp.minimum(jnp.minimum(100 * h0, h1), span)
    return lax.stop_gradient(direction * h)
