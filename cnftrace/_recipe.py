"""The default recipe: the model and training settings that measured best, as they
follow the data's dimension and size. One place decides them; `MLPField`,
`mlp_flow`, `fit` and `cnftrace train` take what they leave unset from here."""

import dataclasses

# Measured on B5's constructed densities (`warped_product(d)`, 2,000 steps of 512;
# `experiments/recipe_sweep.py`, `experiments/bench/b5.py`, docs/quality.md): the
# width is what buys quality as the dimension grows. At 10-D the 64-wide field ended
# 0.18 nats above the truth; 128 wide, 0.036, 0.031, 0.088 and 0.089 by the key (two
# runs in four missed a feature of the density); 256 wide, 0.021 and 0.020 with the
# keys that gave 0.036 and 0.088 at 128. At 20-D 0.87 at 64 against 0.093 at 256; at
# 5-D and below 64 is as good (0.010 against 0.008 at 128) and cheaper. Depth, T, the
# batch, the learning rate and the solver's training tolerance changed little.
_WIDTH_BY_DIM = ((5, 64), (20, 256))  # (up to this many dimensions, width)
_WIDTH_MAX = 512  # beyond
# On small tables a wider field overfits before it learns more: on B5's files
# (142 to 836 training rows) the dimension's width lost to 64 (wine, 13 columns,
# 142 rows: 21.15 nats at width 192 against 18.61 at 64; the best validation came
# at step 100). A table gets 64 units of width per 2,000 training rows, at least 64.
_ROWS_PER_STEP = 2000
_ROWS_WIDTH = 64  # units per 2,000 training rows
# The same at every size measured so far: `fit`'s and `Trainer`'s defaults.
BATCH_SIZE = 512
LR = 3e-3


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What [`default_recipe`][cnftrace.default_recipe] chose, and why.

    - `width`, `depth`: the hidden layers of each block's MLP field.
    - `batch_size`: samples per training step.
    - `lr`: the peak learning rate of `warmup_cosine_adam`.
    - `reason`: one line saying what the choice followed.
    """

    width: int
    depth: int
    batch_size: int
    lr: float
    reason: str


def default_width(dim: int, rows: int | None = None) -> int:
    """The default hidden width for `dim` dimensions: 64 up to 5 dimensions, 256 up
    to 20, 512 beyond; for a table of `rows` training rows, at most 64 per 2,000
    rows (and at least 64)."""
    width = next((w for most, w in _WIDTH_BY_DIM if dim <= most), _WIDTH_MAX)
    if rows is not None:
        width = min(width, _ROWS_WIDTH * max(1, rows // _ROWS_PER_STEP))
    return width


def default_recipe(dim: int, rows: int | None = None) -> Recipe:
    """The default model and training settings for data of `dim` dimensions, and,
    where the data are a table, `rows` training rows (`None`: fresh samples without
    end, as from a sampler).

    **Arguments:**

    - `dim`: the size of one sample, an int >= 1.
    - `rows`: the number of training rows, or `None`.

    **Returns:**

    A [`Recipe`][cnftrace.Recipe]. The width grows with the dimension (64 up to 5
    dimensions, 256 up to 20, 512 beyond): at 10-D that took the default recipe
    from 0.18 nats above the truth to 0.02 (`docs/quality.md`). On a table
    it grows with the rows too, by 64 per 2,000 training rows: on small tables a
    wider field overfits. The other settings are the same for every size today.

    `MLPField` and `mlp_flow` see only the dimension: to train a small table in
    Python, pass `width=cnftrace.default_recipe(dim, rows=len(train)).width`
    (`cnftrace train` does this itself).

    !!! example

        ```python
        print(cnftrace.default_recipe(2).width)    # 64
        print(cnftrace.default_recipe(10).width)   # 256
        print(cnftrace.default_recipe(10, rows=400).width)  # 64: a small table
        print(cnftrace.default_recipe(10, rows=400).reason)
        ```
    """
    for name, value, low in (("dim", dim, 1), ("rows", rows, 1)):
        if value is None and name == "rows":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}; got {value!r}.")
    width = default_width(dim, rows)
    where = f"{dim} dimension{'s' if dim != 1 else ''}"
    why = "64 up to 5 dimensions, 256 up to 20, 512 beyond"
    if rows is not None:
        where += f", {rows} training row{'s' if rows != 1 else ''}"
        if width < default_width(dim):
            why = "a table this size gets 64 per 2,000 rows: a wider field overfits"
    return Recipe(
        width=width,
        depth=3,
        batch_size=BATCH_SIZE,
        lr=LR,
        reason=f"{where}: width {width} ({why})",
    )
