"""FFJORD's eight 2-D toy distributions (Grathwohl, Chen et al., ICLR 2019),
sampled i.i.d. with `jax.random`, exactly `n` at a time."""

import functools
import math

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float

from .._checks import is_int
from .._custom_types import Key

TOY_DATASETS: tuple[str, ...] = (
    "swissroll",
    "8gaussians",
    "pinwheel",
    "circles",
    "moons",
    "2spirals",
    "checkerboard",
    "rings",
)


def _unit(angle):
    return jnp.stack([jnp.cos(angle), jnp.sin(angle)], axis=-1)


def _draws(key, n, dtype, n_uniform, n_normal):
    """`n_uniform` U[0, 1) and `n_normal` N(0, 1) columns from one `jr.uniform` call
    (each `jax.random` call adds compile time)."""
    u = jr.uniform(key, (n, n_uniform + n_normal), dtype)
    lo = jnp.nextafter(jnp.asarray(-1, dtype), jnp.asarray(0, dtype))
    z = math.sqrt(2) * jax.lax.erf_inv(jnp.maximum(2 * u[:, n_uniform:] - 1, lo))
    return [u[:, i] for i in range(n_uniform)], z


def _choice(u, k):
    """A uniform integer in {0, ..., k - 1} (as a float) from U[0, 1)."""
    return jnp.minimum(jnp.floor(k * u), k - 1)


def _swissroll(key, n, dtype):
    # make_swiss_roll(noise=1.0): t ~ U(1.5pi, 4.5pi), point (t cos t, 21 U, t sin t)
    # plus N(0, I_3); FFJORD keeps coordinates 0 and 2 and divides by 5.
    (u,), eps = _draws(key, n, dtype, 1, 2)
    t = 1.5 * jnp.pi * (1 + 2 * u)
    return (t[:, None] * _unit(t) + eps) / 5


def _8gaussians(key, n, dtype):
    (u,), eps = _draws(key, n, dtype, 1, 2)
    centres = 4 * _unit(_choice(u, 8) * (jnp.pi / 4))
    return (centres + 0.5 * eps) / 1.414


def _pinwheel(key, n, dtype):
    # 5 arms; features (r, tau) ~ N((1, 0), diag(0.3^2, 0.1^2)) rotated by
    # -(2 pi arm / 5 + 0.25 exp(r)), then doubled (FFJORD's einsum "ti,tij->tj").
    (u,), z = _draws(key, n, dtype, 1, 2)
    r, tau = 1 + 0.3 * z[:, 0], 0.1 * z[:, 1]
    a = 2 * jnp.pi * _choice(u, 5) / 5 + 0.25 * jnp.exp(r)
    c, s = jnp.cos(a), jnp.sin(a)
    return 2 * jnp.stack([r * c + tau * s, tau * c - r * s], axis=-1)


def _circles(key, n, dtype):
    # make_circles(factor=0.5, noise=0.08): radius 1 or 0.5 with equal probability,
    # uniform angle, N(0, 0.08^2 I) noise; FFJORD then multiplies by 3.
    (u_ring, u_angle), eps = _draws(key, n, dtype, 2, 2)
    radius = jnp.where(u_ring < 0.5, 1.0, 0.5).astype(dtype)
    return 3 * (radius[:, None] * _unit(2 * jnp.pi * u_angle) + 0.08 * eps)


def _moons(key, n, dtype):
    # make_moons(noise=0.1): theta ~ U(0, pi); upper moon (cos, sin), lower moon
    # (1 - cos, 0.5 - sin); N(0, 0.1^2 I) noise; FFJORD maps x -> 2 x + (-1, -0.2).
    (u_moon, u_theta), eps = _draws(key, n, dtype, 2, 2)
    theta = jnp.pi * u_theta
    upper = _unit(theta)
    lower = jnp.stack([1 - jnp.cos(theta), 0.5 - jnp.sin(theta)], axis=-1)
    x = jnp.where((u_moon < 0.5)[:, None], upper, lower) + 0.1 * eps
    return 2 * x + jnp.asarray([[-1.0, -0.2]], dtype)


def _2spirals(key, n, dtype):
    # An arm mirrored through the origin for half the points.
    (u_t, u_x, u_y, u_sign), eps = _draws(key, n, dtype, 4, 2)
    t = jnp.sqrt(u_t) * (3 * jnp.pi)
    arm = jnp.stack([-jnp.cos(t) * t + 0.5 * u_x, jnp.sin(t) * t + 0.5 * u_y], axis=-1)
    sign = jnp.where(u_sign < 0.5, 1.0, -1.0).astype(dtype)
    return sign[:, None] * arm / 3 + 0.1 * eps


def _checkerboard(key, n, dtype):
    # Uniform on the 8 "black" 2x2 squares of a 4x4 board on [-4, 4]^2 (area 32).
    (u1, u2, u_row), _ = _draws(key, n, dtype, 3, 0)
    x1 = 4 * u1 - 2
    x2 = u2 - 2 * _choice(u_row, 2) + jnp.floor(x1) % 2
    return 2 * jnp.stack([x1, x2], axis=-1)


def _rings(key, n, dtype):
    (u_ring, u_angle), eps = _draws(key, n, dtype, 2, 2)
    radius = 0.75 * (1 + _choice(u_ring, 4))
    return radius[:, None] * _unit(2 * jnp.pi * u_angle) + 0.08 * eps


_GENERATORS = {
    "swissroll": _swissroll,
    "8gaussians": _8gaussians,
    "pinwheel": _pinwheel,
    "circles": _circles,
    "moons": _moons,
    "2spirals": _2spirals,
    "checkerboard": _checkerboard,
    "rings": _rings,
}


@functools.partial(jax.jit, static_argnums=(0, 2, 3))
def _sample(name, key, n, dtype):
    return _GENERATORS[name](key, n, dtype)


def _check_name(name) -> str:
    if not isinstance(name, str) or name not in _GENERATORS:
        raise ValueError(
            f"unknown toy dataset {name!r}; valid names are {', '.join(TOY_DATASETS)}."
        )
    return name


def toy_sample(name: str, key: Key, n: int, dtype=None) -> Float[Array, "n 2"]:
    """Draws `n` i.i.d. samples from the 2-D toy distribution `name` (jitted; may
    be called inside `jax.jit`).

    **Arguments:**

    - `name`: one of `TOY_DATASETS`.
    - `key`: a JAX PRNG key.
    - `n`: the number of samples, a positive integer.
    - `dtype`: a floating dtype; JAX's default float if omitted.

    Returns an array of shape `(n, 2)`. Raises `ValueError` for an unknown `name`,
    a bad `n`, or a `dtype` that is not floating.

    !!! example

        ```python
        from cnftrace.datasets import toy_sample

        x = toy_sample("moons", jr.key(0), 500)
        print(x.shape, x.dtype)  # (500, 2) float32
        ```
    """
    _check_name(name)
    if not is_int(n) or n <= 0:
        raise ValueError(f"n must be a positive integer; got {n!r}.")
    dtype = jnp.result_type(float) if dtype is None else jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype; got {dtype}.")
    return _sample(name, key, int(n), dtype)


# Differential entropies in nats; how each was computed is on docs/quality.md.
_ENTROPY = {
    "8gaussians": math.log(8)
    + math.log(2 * math.pi * math.e * (0.5 / 1.414) ** 2)
    - 0.006299,
    "checkerboard": math.log(32),
    "swissroll": 2.6699,
    "pinwheel": 2.3174,
    "circles": 3.2678,
    "moons": 2.3938,
    "2spirals": 2.6452,
    "rings": 2.6235,
}
_EXACT = frozenset({"8gaussians", "checkerboard"})


def toy_entropy(name: str) -> float:
    """The differential entropy in nats (a float) of the toy distribution `name`
    (one of `TOY_DATASETS`): the lower bound of any model's expected NLL. Exact or
    a Monte Carlo estimate (see
    [`toy_entropy_is_exact`][cnftrace.datasets.toy_entropy_is_exact] and the
    "Quality" page). Raises `ValueError` for an unknown `name`.

    !!! example

        ```python
        import math

        from cnftrace.datasets import toy_entropy

        print(toy_entropy("checkerboard") == math.log(32))  # True
        print(round(toy_entropy("moons"), 4))  # 2.3938
        ```
    """
    return _ENTROPY[_check_name(name)]


def toy_entropy_is_exact(name: str) -> bool:
    """Whether [`toy_entropy`][cnftrace.datasets.toy_entropy]`(name)` is exact rather
    than a Monte Carlo estimate. Raises `ValueError` for an unknown `name`.

    !!! example

        ```python
        from cnftrace.datasets import toy_entropy_is_exact

        print(toy_entropy_is_exact("8gaussians"))  # True
        print(toy_entropy_is_exact("moons"))  # False
        ```
    """
    return _check_name(name) in _EXACT


def toy_log_prob(name: str, x: Float[Array, "n 2"]) -> Float[Array, " n"]:
    """The true log-density of the points `x` under the toy distribution `name`:
    the floor that a model's test NLL is compared with.

    **Arguments:**

    - `name`: `"8gaussians"` (the full mixture, overlap included) or
        `"checkerboard"` (`-log 32` on the black squares, `-inf` elsewhere).
    - `x`: the points, an array of shape `(n, 2)`.

    Raises `ValueError` for another `name`, or for `x` not of shape `(n, 2)`.

    !!! example

        ```python
        from cnftrace.datasets import toy_log_prob

        x = jnp.array([[1.0, 1.0], [3.0, 1.0]])  # a black square, then a white one
        print(toy_log_prob("checkerboard", x))  # [-3.465736 -inf]: -log 32, -inf
        ```
    """
    _check_name(name)
    x = jnp.asarray(x)
    if x.ndim != 2 or x.shape[1] != 2:
        raise ValueError(f"`x` must have shape (n, 2); got {x.shape}.")
    if name == "8gaussians":
        sigma = 0.5 / 1.414
        centres = 4 * _unit(jnp.arange(8, dtype=x.dtype) * (jnp.pi / 4)) / 1.414
        sq = jnp.sum((x[:, None, :] - centres[None, :, :]) ** 2, axis=-1)
        log_comp = -sq / (2 * sigma**2) - jnp.log(2 * jnp.pi * sigma**2)
        return jax.scipy.special.logsumexp(log_comp, axis=-1) - jnp.log(8.0)
    if name == "checkerboard":
        u = x / 2  # back to the unscaled board on [-2, 2]^2
        inside = jnp.all(jnp.abs(u) <= 2, axis=-1)
        black = (jnp.floor(u[:, 0]) + jnp.floor(u[:, 1])) % 2 == 0
        return jnp.where(inside & black, -math.log(32), -jnp.inf)
    raise ValueError(
        f"the true density of {name!r} has no closed form here; "
        "toy_log_prob knows '8gaussians' and 'checkerboard'."
    )
