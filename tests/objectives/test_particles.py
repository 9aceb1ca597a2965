"""Particle systems: the EGNN field's equivariance, the mean-free base's density, and
a flow over both whose density is invariant to rotations, reflections, translations
and permutations of the particles (float64)."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import cnftrace

N, D = 4, 2


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def _orthogonal(angle: float, reflect: bool) -> jnp.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    rotation = jnp.array([[c, -s], [s, c]])
    return rotation @ jnp.diag(jnp.array([1.0, -1.0])) if reflect else rotation


# A rotation with a reflection, a translation and a permutation of the particles.
R = _orthogonal(0.7, reflect=True)
SHIFT = np.array([3.0, -2.0])


def _shift(x):
    """`x` translated by SHIFT (every particle of every sample): a NumPy array for
    NumPy positions, a JAX array for JAX ones."""
    return x + SHIFT.reshape((1,) * (x.ndim - 1) + (D,))


PERM = np.array([2, 0, 3, 1])
R_NP = np.asarray(R)


@eqx.filter_jit
def _field_at(field, t, y):
    """`field(t, y)` as one compiled program: called eagerly, each of the EGNN's
    operations would compile a program of its own."""
    return field(t, y)


@eqx.filter_jit
def _jacobian(field, t, y):
    """The Jacobian of the flattened field at the flattened positions `y`."""
    return jax.jacfwd(lambda u: field(t, u.reshape(N, D)).reshape(-1))(y.reshape(-1))


@pytest.fixture(scope="module")
def field():
    with jax.enable_x64(True):
        # A large coordinate scale: the field is far from zero (about 0.4 here),
        # so equivariance is tested on real motion.
        return cnftrace.EGNNField(
            N, D, width=8, depth=2, coord_scale=10.0, key=jr.key(4)
        )


@pytest.fixture(scope="module")
def flow(field):
    with jax.enable_x64(True):
        base = cnftrace.MeanFreeNormal(N, D)
        return cnftrace.CNF(field, (N, D), base=base, rtol=1e-10, atol=1e-10)


def test_field_is_equivariant_and_mean_free(field):
    y = np.asarray(jr.normal(jr.key(1), (N, D)))
    t = jnp.asarray(0.3)
    f = np.asarray(_field_at(field, t, jnp.asarray(y)))
    assert np.abs(f).max() > 0.1  # not trivially zero
    np.testing.assert_allclose(f.mean(axis=0), 0.0, atol=1e-15)
    moved = jnp.asarray(_shift(y @ R_NP.T))
    np.testing.assert_allclose(_field_at(field, t, moved), f @ R_NP.T, atol=1e-13)
    permuted = _field_at(field, t, jnp.asarray(y[PERM]))
    np.testing.assert_allclose(permuted, f[PERM], atol=1e-14)
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        field(0.3, jnp.zeros(8))


def test_full_trace_is_the_trace_within_the_mean_free_subspace(field):
    """What lets the CNF integrate the divergence in R^(n d): the field has no
    component out of the subspace and does not change along translations, so
    tr(J) = tr(P J P) with P the projection onto the mean-free positions."""
    y = jr.normal(jr.key(2), (N, D))
    jac = np.asarray(_jacobian(field, jnp.asarray(0.4), y))
    centre = np.eye(N) - np.ones((N, N)) / N
    proj = np.kron(centre, np.eye(D))
    np.testing.assert_allclose(np.trace(jac), np.trace(proj @ jac @ proj), atol=1e-13)
    np.testing.assert_allclose((np.eye(N * D) - proj) @ jac, 0.0, atol=1e-13)
    np.testing.assert_allclose(jac @ (np.eye(N * D) - proj), 0.0, atol=1e-13)


def test_mean_free_normal_density_and_samples():
    base = cnftrace.MeanFreeNormal(N, D)
    # Two particles on a line: x = (u, -u) is s = sqrt(2) u along the unit vector
    # (1, -1)/sqrt(2) of the subspace, so log q = log N(s; 0, 1).
    pair = cnftrace.MeanFreeNormal(2, 1)
    u = jnp.array([0.3, -1.2])
    x = jnp.stack([u, -u], axis=1)[..., None]
    s = math.sqrt(2) * u
    np.testing.assert_allclose(
        pair.log_prob(x), -0.5 * s**2 - 0.5 * math.log(2 * math.pi), rtol=1e-14
    )
    # The density removes the centre of mass: invariant to translations.
    z = base.sample(jr.key(3), 20_000)
    np.testing.assert_allclose(z.mean(axis=1), 0.0, atol=1e-14)
    np.testing.assert_allclose(
        base.log_prob(_shift(z[:5])), base.log_prob(z[:5]), rtol=1e-13
    )
    # The samples' covariance is the projection onto the subspace.
    flat = np.asarray(z).reshape(z.shape[0], -1)
    proj = np.kron(np.eye(N) - np.ones((N, N)) / N, np.eye(D))
    np.testing.assert_allclose(np.cov(flat.T), proj, atol=0.03)
    assert base.degrees_of_freedom == (N - 1) * D
    with pytest.raises(ValueError, match="n_particles"):
        cnftrace.MeanFreeNormal(1, 3)
    centred = cnftrace.remove_center_of_mass(_shift(z[:3]))
    np.testing.assert_allclose(centred, z[:3], atol=1e-13)


def test_flow_density_is_invariant_and_its_map_equivariant(flow):
    x = flow.sample(jr.key(4), 3)
    np.testing.assert_allclose(x.mean(axis=1), 0.0, atol=1e-12)
    logp = flow.log_prob(x)
    moved = _shift(x @ R.T)
    np.testing.assert_allclose(flow.log_prob(moved), logp, rtol=0, atol=1e-8)
    np.testing.assert_allclose(flow.log_prob(x[:, PERM]), logp, rtol=0, atol=1e-8)
    # The map itself commutes with them (a translation moves the whole trajectory).
    z = flow.forward(x)
    np.testing.assert_allclose(flow.forward(moved), _shift(z @ R.T), atol=1e-8)
    np.testing.assert_allclose(flow.forward(x[:, PERM]), z[:, PERM], atol=1e-8)
