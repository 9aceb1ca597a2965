"""The small flows the tests build: one builder, so that files differ only in the
settings they choose (and programs of the same settings compile alike)."""

import jax.random as jr

import cnftrace


def small_flow(key=None, d=2, *, width=8, depth=1, field=None, **kwargs):
    """A `CNF` of dimension `d` on a `field` class (`ConcatSquashMLP` by default)
    of `width` and `depth`, initialised from `key` (`jr.key(0)` by default); the
    keyword arguments go to `CNF`."""
    field = cnftrace.ConcatSquashMLP if field is None else field
    key = jr.key(0) if key is None else key
    return cnftrace.CNF(field(d, width=width, depth=depth, key=key), d, **kwargs)
