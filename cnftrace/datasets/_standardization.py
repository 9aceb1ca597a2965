"""The standardisation of a data set: its statistics and the refusal of columns that
cannot be standardised live here with the data; the map's arithmetic is the flows' own
(`cnftrace.flows.AbstractStandardization`), so that flows need nothing from here."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..flows import AbstractStandardization


class Standardization(AbstractStandardization):
    """The map `y = (x - mean) / scale` from data to standardised units, coordinate
    by coordinate, with its inverse and log-determinant.

    **Arguments:**

    - `mean`: the shift, one value per coordinate (shape `event_shape`).
    - `scale`: the positive scale, of the same shape.

    Build one from training data with
    [`Standardization.from_data`][cnftrace.Standardization.from_data]; a
    [`StandardizedFlow`][cnftrace.StandardizedFlow] applies it.

    !!! example

        ```python
        import numpy as np

        data = np.array([[1.0, 10.0], [3.0, 30.0], [5.0, 20.0]])
        std = cnftrace.Standardization.from_data(data)
        y = std.forward(data)                      # mean 0, standard deviation 1
        print(np.allclose(std.inverse(y), data), std.log_det)  # True, -sum(log scale)
        ```
    """

    mean: Float[Array, "..."]
    scale: Float[Array, "..."]

    def __check_init__(self):
        if jnp.shape(self.mean) != jnp.shape(self.scale):
            raise ValueError(
                f"`mean` and `scale` must have one shape; got {jnp.shape(self.mean)} "
                f"and {jnp.shape(self.scale)}."
            )

    @staticmethod
    def from_data(data, *, name: str = "data") -> "Standardization":
        """The mean and standard deviation of each coordinate of `data` (shape
        `(n, *event_shape)`, at least two rows), as a `Standardization`.

        Computed in float64 without overflow, even for values near float64's
        largest. A `ValueError` names the first coordinate whose standard deviation
        is zero (or not finite): it holds one value only, and has no density to
        learn; or whose values span a range beyond float64's.

        !!! example

            ```python
            import numpy as np

            std = cnftrace.Standardization.from_data(np.array([[0.0], [2.0]]))
            print(std.mean, std.scale)  # [1.] [1.]
            ```
        """
        data = np.asarray(data, dtype=np.float64)
        if data.ndim < 2 or data.shape[0] < 2:
            raise ValueError(
                f"`{name}` must hold at least two samples, shape (n, *event) with "
                f"n >= 2, to be standardised; got shape {data.shape}."
            )
        # Each coordinate divided by a power of two near its largest magnitude (an
        # exact division), so that neither the sum nor the squares of values near
        # float64's largest overflow.
        power = np.ldexp(1.0, np.frexp(np.abs(data).max(axis=0))[1] - 1)
        mean = (data / power).mean(axis=0) * power
        scale = (data / power).std(axis=0) * power
        with np.errstate(over="ignore"):
            spread = data.max(axis=0) - data.min(axis=0)
        wide = np.isinf(spread) & np.isfinite(data).all(axis=0)
        if wide.any():
            where = np.unravel_index(int(np.flatnonzero(wide)[0]), wide.shape)
            index = where[0] if len(where) == 1 else where
            values = data[(slice(None), *where)]
            raise ValueError(
                f"column {index} of `{name}` spans from {values.min().item()!r} to "
                f"{values.max().item()!r}, a range beyond float64's largest number "
                f"({np.finfo(np.float64).max:.4g}), so it cannot be standardised "
                "(the differences overflow). Rescale that column first, e.g. "
                "divide it by 1e10."
            )
        bad = ~(np.isfinite(scale) & (scale > 0))
        if bad.any():
            where = np.unravel_index(int(np.flatnonzero(bad)[0]), bad.shape)
            index = where[0] if len(where) == 1 else where
            value = data[(0, *where)].item()  # a Python number, printed as one
            raise ValueError(
                f"column {index} of `{name}` is constant (it takes the value "
                f"{value!r} in all {data.shape[0]} rows), so it cannot be "
                "standardised: a zero standard deviation. Drop that column."
            )
        return Standardization(mean, scale)  # float64 NumPy: no precision lost
