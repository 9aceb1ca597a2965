"""Hutchinson's estimator: `eps^T J eps` averaged over a static number of random
probes with `E[eps eps^T] = I`."""

import math
from typing import ClassVar, Literal

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr

from .._checks import check_key
from ._base import AbstractEstimator, check_settings, jvp_columns, need_probe_key

_SAMPLERS = ("rademacher", "gaussian", "sphere")


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
        self.num_probes, self.sampler = check_settings(
            "Hutchinson", "num_probes", num_probes, sampler, _SAMPLERS
        )

    def draw(self, key, shape, dtype, *, event_ndim: int = 1):
        need_probe_key(self, key, "random probes")
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
        fy, jvps = jvp_columns(fn, y, probes)
        axes = tuple(range(1, probes.ndim))
        div = jnp.mean(jnp.sum(probes * jvps, axis=axes))
        return fy, div, jnp.mean(jnp.sum(jvps**2, axis=axes))
