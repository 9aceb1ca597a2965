"""The default experience: the README's first example (MLPField, CNF and fit with
their defaults) reaches a fixed quality bar on a density known in closed form."""

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace
from cnftrace.datasets import rotated_product


@pytest.mark.optimized  # 300 training steps
def test_default_recipe_reaches_the_quality_bar_in_300_steps():
    # A rotation of a two-mode mixture and a Gumbel: non-Gaussian, exact log-density.
    density = rotated_product(2, seed=0)
    data = lambda key, n: density.sample(key, n, jnp.float32)  # noqa: E731
    # float32, as a user runs it (the suite enables float64).
    field = cnftrace.MLPField(2, key=jr.key(0), dtype=jnp.float32)
    flow = cnftrace.CNF(field, dim=2)
    flow, history = cnftrace.fit(
        flow, data, key=jr.key(1), steps=300, batch_size=128, progress=False
    )
    test = density.sample(jr.key(7), 4000, jnp.float32)
    logq = np.asarray(cnftrace.log_prob_batched(flow, test), np.float64)
    diff = np.asarray(density.log_prob(test.astype(jnp.float64))) - logq
    gap, se = diff.mean(), diff.std(ddof=1) / np.sqrt(diff.size)
    # Measured 0.023 ± 0.003 nats (in float64); an untrained flow is ~0.9 away, and
    # FFJORD's ConcatSquash field at a constant 1e-3 reached 0.027 here. The gap
    # estimates a KL divergence, so it cannot be far below zero either.
    assert -3 * se < gap < 0.04, (gap, se)
    # The training tolerance of 1e-3 keeps the solves cheap; the flow keeps 1e-5.
    assert history["nfe"][-1] < 40 and flow.rtol == 1e-5
