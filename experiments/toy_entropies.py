"""Recompute the differential entropies hard-coded in `cnftrace/datasets/_toy.py`.

For each toy distribution whose entropy has no closed form, the density p is written
down from the generative definition and evaluated to ~1e-7 or better (a Bessel
function for the rings, 1-D Gauss-Legendre quadrature along the curve for the others,
root-finding for pinwheel); the entropy is then the Monte Carlo mean of -log p(x) over
samples drawn with `cnftrace.datasets.toy_sample`, with its standard error. As checks,
each density's total mass is integrated on a grid, and each entropy is compared with a
Kozachenko-Leonenko k-nearest-neighbour estimate on the same samples.

Run: `python -m experiments.toy_entropies [--n 2000000]` (about 10 minutes on two
CPU cores; most of it in pinwheel and 2spirals). Quadrature sizes were chosen so that
doubling them changes log p by < 1e-6 at every test point.
"""

import argparse
import math
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.scipy.special import i0e, logsumexp, ndtr  # noqa: E402
from scipy.spatial import cKDTree  # noqa: E402
from scipy.special import digamma  # noqa: E402

from cnftrace.datasets import toy_sample  # noqa: E402

LOG2PI = math.log(2 * math.pi)


def gauss_legendre(a, b, panels, order=16):
    """Nodes and log-weights of a composite Gauss-Legendre rule on [a, b]."""
    x, w = np.polynomial.legendre.leggauss(order)
    edges = np.linspace(a, b, panels + 1)
    half = (edges[1:] - edges[:-1])[:, None] / 2
    nodes = (edges[:-1, None] + half * (x[None, :] + 1)).ravel()
    return jnp.asarray(nodes), jnp.asarray(np.log((half * w[None, :]).ravel()))


def log_normal2(x, centre, s):
    """log N(x; centre, s^2 I_2) for x of shape (m, 2), centre of shape (q, 2)."""
    d2 = jnp.sum((x[:, None, :] - centre[None, :, :]) ** 2, axis=-1)
    return -d2 / (2 * s**2) - LOG2PI - 2 * math.log(s)


def log_rings(x, radii, s):
    """Equal mixture of circles of the given radii convolved with N(0, s^2 I)."""
    rho = jnp.linalg.norm(x, axis=-1)[:, None]
    radii = jnp.asarray(radii)[None, :]
    log_k = -((rho - radii) ** 2) / (2 * s**2) + jnp.log(i0e(rho * radii / s**2))
    return (
        logsumexp(log_k, axis=-1) - math.log(radii.shape[1]) - LOG2PI - 2 * math.log(s)
    )


def log_circles(x):
    return log_rings(x, [3.0, 1.5], 0.24)


def log_rings_ds(x):
    return log_rings(x, [3.0, 2.25, 1.5, 0.75], 0.08)


_SW_T, _SW_LW = gauss_legendre(1.5 * math.pi, 4.5 * math.pi, 32)


def log_swissroll(x):
    # 5 x = t (cos t, sin t) + N(0, I), t ~ U(1.5 pi, 4.5 pi).
    centre = _SW_T[:, None] * jnp.stack([jnp.cos(_SW_T), jnp.sin(_SW_T)], axis=-1)
    log_q = logsumexp(log_normal2(5 * x, centre, 1.0) + _SW_LW[None, :], axis=-1)
    return log_q - math.log(3 * math.pi) + 2 * math.log(5)


_MO_T, _MO_LW = gauss_legendre(0.0, math.pi, 8)


def log_moons(x):
    # (x - shift) / 2 = moon point + N(0, 0.1^2 I), theta ~ U(0, pi), two moons.
    z = (x - jnp.asarray([[-1.0, -0.2]])) / 2
    c, s = jnp.cos(_MO_T), jnp.sin(_MO_T)
    centre = jnp.concatenate(
        [jnp.stack([c, s], axis=-1), jnp.stack([1 - c, 0.5 - s], axis=-1)]
    )
    lw = jnp.concatenate([_MO_LW, _MO_LW])[None, :]
    log_q = logsumexp(log_normal2(z, centre, 0.1) + lw, axis=-1)
    return log_q - math.log(2 * math.pi) - 2 * math.log(2)


_SP_T, _SP_LW = gauss_legendre(0.0, 3 * math.pi, 32)


def _box_gauss(z):
    # density of U(0, 1/6) + N(0, 0.1^2) at z; the difference of normal CDFs is
    # taken in whichever tail avoids cancellation.
    a, b = z / 0.1, (z - 1 / 6) / 0.1
    flip = b > 0
    return 6 * (ndtr(jnp.where(flip, -b, a)) - ndtr(jnp.where(flip, -a, b)))


def log_2spirals(x):
    # x = +-(c(t) + U(0, 0.5)^2) / 3 + N(0, 0.1^2 I), c(t) = (-t cos t, t sin t),
    # t = 3 pi sqrt(U) with density 2 t / (3 pi)^2. Evaluated in linear space (fast;
    # underflows only where p < 1e-300, never at a sample).
    t = _SP_T[None, :]
    w = 2 * t / (3 * math.pi) ** 2 * jnp.exp(_SP_LW)[None, :]

    def q(y):
        h1 = _box_gauss(y[:, :1] + t * jnp.cos(t) / 3)
        h2 = _box_gauss(y[:, 1:] - t * jnp.sin(t) / 3)
        return jnp.sum(h1 * h2 * w, axis=-1)

    return jnp.log((q(x) + q(-x)) / 2)


_PW_GRID = 256


def log_pinwheel(x):
    # z = x / 2 = R(-phi) f, f = (r, tau) ~ N((1, 0), diag(.09, .01)), phi = 2 pi k / 5
    # + 0.25 e^r. In polar form |f| = |z| and angle(f) = beta solves
    # G(beta) = beta - psi - 2 pi k / 5 - 0.25 exp(|z| cos beta) = 0 (mod 2 pi);
    # p(z | k) = sum over roots of p_f(f) / |1 + 0.25 e^r tau|.
    z = x / 2
    rho = jnp.linalg.norm(z, axis=-1)[:, None, None]
    psi = jnp.arctan2(z[:, 1], z[:, 0])[:, None, None]
    arm = (2 * math.pi / 5) * jnp.arange(5.0)[None, :, None]
    beta = jnp.linspace(-math.pi, math.pi, _PW_GRID + 1)[None, None, :]

    def level(b):
        return (b - psi - arm - 0.25 * jnp.exp(rho * jnp.cos(b))) / (2 * math.pi)

    h = level(beta)
    m = jnp.floor(h)
    cross = m[..., 1:] != m[..., :-1]  # at most one integer level per small step
    target = jnp.maximum(m[..., 1:], m[..., :-1])
    h0, h1 = h[..., :-1], h[..., 1:]
    b0, b1 = beta[..., :-1], beta[..., 1:]
    b = b0 + (b1 - b0) * jnp.clip((target - h0) / jnp.where(cross, h1 - h0, 1), 0, 1)
    for _ in range(3):  # Newton polish
        dh = (1 + 0.25 * rho * jnp.sin(b) * jnp.exp(rho * jnp.cos(b))) / (2 * math.pi)
        b = jnp.clip(b - (level(b) - target) / jnp.where(cross, dh, 1), b0, b1)
    r, tau = rho * jnp.cos(b), rho * jnp.sin(b)
    log_f = -((r - 1) ** 2) / (2 * 0.09) - tau**2 / (2 * 0.01) - LOG2PI - math.log(0.03)
    log_w = log_f - jnp.log(jnp.abs(1 + 0.25 * jnp.exp(r) * tau))
    log_w = jnp.where(cross, log_w, -jnp.inf).reshape(x.shape[0], -1)
    return logsumexp(log_w, axis=-1) - math.log(5) - 2 * math.log(2)


LOG_DENSITIES = {
    "swissroll": (log_swissroll, 50_000),
    "pinwheel": (log_pinwheel, 1_000),
    "circles": (log_circles, 200_000),
    "moons": (log_moons, 50_000),
    "2spirals": (log_2spirals, 10_000),
    "rings": (log_rings_ds, 200_000),
}


def chunked(fn, x, chunk):
    fn = jax.jit(fn)
    out = [fn(x[i : i + chunk]) for i in range(0, x.shape[0], chunk)]
    return np.asarray(jnp.concatenate(out))


def grid_mass(fn, chunk, half_width=5.5, step=0.025):
    g = np.arange(-half_width, half_width, step) + step / 2
    pts = jnp.asarray(np.stack(np.meshgrid(g, g), axis=-1).reshape(-1, 2))
    return float(np.exp(chunked(fn, pts, chunk)).sum() * step**2)


def kl_entropy(x, ks=(1, 2, 3, 4, 5)):
    """Kozachenko-Leonenko estimates for a 2-D sample, one per k."""
    n = x.shape[0]
    dist, _ = cKDTree(x).query(x, k=max(ks) + 1, workers=-1)
    return {
        k: float(
            digamma(n) - digamma(k) + math.log(math.pi) + 2 * np.log(dist[:, k]).mean()
        )
        for k in ks
    }


def eight_gaussians_overlap(step=0.002):
    """log 8 + log(2 pi e sigma^2) minus the true entropy, by midpoint quadrature."""
    s, radius = 0.5 / 1.414, 4 / 1.414
    angles = np.arange(8) * np.pi / 4
    centres = jnp.asarray(radius * np.stack([np.cos(angles), np.sin(angles)], axis=-1))

    def plogp(pts):
        lp = logsumexp(log_normal2(pts, centres, s), axis=-1) - math.log(8)
        return jnp.exp(lp) * lp

    g = np.arange(-5.5, 5.5, step) + step / 2
    pts = jnp.asarray(np.stack(np.meshgrid(g, g), axis=-1).reshape(-1, 2))
    entropy = -chunked(plogp, pts, 500_000).sum() * step**2
    return math.log(8) + math.log(2 * math.pi * math.e * s**2) - entropy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2_000_000)
    parser.add_argument("--seed", type=int, default=20240601)
    args = parser.parse_args()

    for step in (0.004, 0.002):
        overlap = eight_gaussians_overlap(step)
        print(f"8gaussians overlap correction (quadrature step {step}): {overlap:.9f}")
    print(f"checkerboard: log 32 = {math.log(32):.6f}")
    keys = jr.split(jr.key(args.seed), len(LOG_DENSITIES))
    for key, (name, (fn, chunk)) in zip(keys, LOG_DENSITIES.items(), strict=True):
        start = time.perf_counter()
        mass = grid_mass(fn, chunk)
        x = toy_sample(name, key, args.n, jnp.float64)
        neg_log_p = -chunked(fn, x, chunk)
        mc, se = neg_log_p.mean(), neg_log_p.std() / math.sqrt(args.n)
        kl = kl_entropy(np.asarray(x))
        kl_str = ", ".join(f"k={k}: {v:.4f}" for k, v in kl.items())
        print(
            f"{name}: entropy {mc:.5f} (se {se:.5f}, n {args.n}); "
            f"grid mass {mass:.6f}; KL {kl_str}; {time.perf_counter() - start:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
