"""What an unnormalised target log-density must be, checked before anything runs."""

from collections.abc import Callable

import jax
import jax.numpy as jnp

LogDensity = Callable[[jax.Array], jax.Array]


def describe_target(log_target) -> str:
    """A name for `log_target` that is the same in every process (no addresses): a
    checkpoint records it, and a resumed run must give the same one."""
    owner = getattr(log_target, "__self__", None)
    if owner is not None and isinstance(getattr(owner, "name", None), str):
        return f"{owner.name}.{log_target.__name__}"
    if isinstance(getattr(log_target, "name", None), str):
        return log_target.name
    name = getattr(log_target, "__qualname__", None) or type(log_target).__qualname__
    module = getattr(log_target, "__module__", None) or type(log_target).__module__
    return f"{module}.{name}"


def check_log_target(
    log_target, event_shape: tuple[int, ...], *, gradient: bool, name: str
) -> None:
    """A clear error, naming `name`, unless `log_target` maps a batch of samples of
    `event_shape` to one floating log-density per sample, traced by JAX (and, with
    `gradient`, differentiable by it). Traced on abstract values only: nothing
    runs."""
    if not callable(log_target):
        raise TypeError(
            f"`{name}` must be a function from a batch of samples (n, *event) to "
            f"their unnormalised log-densities (n,); got {type(log_target).__name__}."
        )
    event = tuple(event_shape)
    x = jax.ShapeDtypeStruct((2, *event), jnp.result_type(float))
    want = f"a batch of shape (n, {', '.join(map(str, event))})"
    try:
        out = jax.eval_shape(log_target, x)
    except Exception as e:
        raise TypeError(
            f"`{name}` could not be traced by JAX on {want}: {type(e).__name__}: "
            f"{e} It must be written with jax.numpy (no NumPy on its input, no "
            "Python branches on its values) and take the whole batch at once."
        ) from e
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != (2,):
        raise ValueError(
            f"`{name}` must return one log-density per sample: given {want} with "
            f"n = 2 it returned {_what(out)}, not an array of shape (2,)."
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`{name}` must return floating values; it returned {dtype}.")
    if not gradient:
        return
    try:
        jax.eval_shape(jax.grad(lambda x: jnp.sum(log_target(x))), x)
    except Exception as e:
        raise TypeError(
            f"`{name}` is not differentiable by JAX ({type(e).__name__}: {e}); "
            "training toward it follows its gradient through the samples. Write it "
            "with jax.numpy, or give a host callback a custom JVP."
        ) from e


def _what(out) -> str:
    shape = getattr(out, "shape", None)
    return f"shape {shape}" if shape is not None else type(out).__name__
