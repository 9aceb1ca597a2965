"""Placing a compiled program's array arguments alike, so that one program serves
them however they were made.

JAX compiles a program again when an argument that was uncommitted (made by
operations run one at a time, or given as NumPy data) comes back committed to its
device (the output of a compiled program: a flow returned by `fit`, samples drawn
by `flow.sample`). Without this, a flow evaluated before and after training, or on
its own samples and on host data, would compile the same program two or three
times."""

import jax
import jax.numpy as jnp
import numpy as np


def committed(tree):
    """`tree` with every array committed to one device: JAX arrays already
    committed stay as they are, and the others (NumPy arrays too) are committed to
    the device of the committed ones, or to the device they are on when none is.
    A tree whose committed arrays are spread over several devices (a sharded flow,
    a data-parallel batch) or that holds traced values (a call inside a caller's
    transformation) is returned unchanged, and JAX places the rest as it would.
    Other leaves pass unchanged."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return tree
    placed = {x.sharding for x in leaves if isinstance(x, jax.Array) and x.committed}
    if len(placed) > 1:
        return tree
    target = None
    if placed:
        (target,) = placed
        if len(target.device_set) != 1:
            return tree
    loose = [_uncommitted(x) for x in leaves]
    if not any(loose):
        return tree
    out = []
    for x, place in zip(leaves, loose):
        if place:
            x = jnp.asarray(x) if isinstance(x, np.ndarray) else x
            x = jax.device_put(x, x.sharding if target is None else target)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _uncommitted(x) -> bool:
    if isinstance(x, np.ndarray):
        return x.dtype.kind in "biufc"
    return isinstance(x, jax.Array) and not x.committed
