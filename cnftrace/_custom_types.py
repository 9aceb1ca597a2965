"""Type aliases used across cnftrace's public signatures."""

from collections.abc import Callable
from typing import Any, TypeAlias

from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, PyTree

Args: TypeAlias = PyTree[Any]
Key: TypeAlias = PRNGKeyArray
VectorField: TypeAlias = Callable[[Any, Array, Args], Array]
"""A per-sample vector field `f(t, y, args) -> dy/dt` with `dy/dt` shaped like `y`."""

Sample: TypeAlias = Float[Array, "..."]
Batch: TypeAlias = Float[Array, "batch ..."]
Scalar: TypeAlias = Float[Array, ""]

__all__ = [
    "Args",
    "Array",
    "ArrayLike",
    "Batch",
    "Float",
    "Key",
    "PyTree",
    "Sample",
    "Scalar",
    "VectorField",
]
