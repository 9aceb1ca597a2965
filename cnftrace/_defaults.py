"""Every default of the model and its training, decided in this one module: the
builders, `fit`, `Trainer`, the optimiser, the objectives, `RunConfig` and the command
line import them (a test checks that no default literal is written twice). Where the
command line differs from `fit`, that is decided here too. The measurements behind
each choice are in docs/quality.md."""

import dataclasses

# The model: each block's field and its solve.
DEPTH = 3  # hidden layers of each block's field
T1 = 0.5  # integration time of a block
RTOL = 1e-5  # the solver's tolerances when a flow is evaluated or sampled
ATOL = 1e-5
MAX_STEPS = 4096  # the solver's step budget per solve (a solve that needs more fails)
# The field's float32 matrix products inside a solve: in full float32, not the
# TensorFloat-32 that JAX uses on recent NVIDIA GPUs by default, whose rounding the
# step-size controller would mistake for truncation error.
MATMUL_PRECISION = "float32"
PCOEFF = 0.4  # the PID step-size controller's coefficients (diffrax's advice for
ICOEFF = 0.3  # the adaptive solves of neural ODEs)
FREQS = 3  # sinusoidal time features of a field
CONCATSQUASH_WIDTH = 64  # FFJORD's ConcatSquash field, as FFJORD trained it
MULTISCALE_T1 = 1.0  # each block of FFJORD's multiscale image model
EGNN_WIDTH = 32  # the equivariant field of particle systems
EGNN_DEPTH = 3
# The width is what buys quality as the dimension grows: (up to this many
# dimensions, width), then `WIDTH_MAX` beyond.
WIDTH_BY_DIM = ((5, 64), (20, 256))
WIDTH_MAX = 512
# On a table a wider field overfits before it learns more: `TABLE_WIDTH` units of
# width per `TABLE_ROWS` training rows, and at least `TABLE_WIDTH`.
TABLE_ROWS = 2000
TABLE_WIDTH = 64

# A table's rows held out for validation and for the test, when a file is split.
VAL_FRACTION = 0.1
TEST_FRACTION = 0.1

# Training on samples without end (`fit`, `Trainer`).
STEPS = 1000  # `fit`'s optimiser steps
# From this many dimensions `fit` trains a flow on samples without end by flow
# matching rather than maximum likelihood: a likelihood step solves the ODE with a
# trace estimate and its gradient, a flow-matching step evaluates the field once, and
# from here the cheap steps reach a closer density in the same seconds.
FM_FROM_DIM = 15
# `fit`'s steps when it trains by flow matching: each step costs a fraction of a
# likelihood step, and the density keeps improving over this many.
FM_STEPS = 40_000
BATCH_SIZE = 512  # samples per step
# Under a time budget on a CPU, maximum likelihood's samples per step above
# `WIDTH_BY_DIM`'s first size (where the field is wide and a step slow): there a
# step costs about in proportion to its rows, the budget buys few steps, and twice
# the steps at half the batch reached a closer density in the same seconds. Below,
# where a budget buys thousands of steps, the larger batch did as well or better;
# a GPU's step costs about the same at either size, and keeps `BATCH_SIZE`.
BUDGET_BATCH_SIZE = 256
LR = 3e-3  # the peak of the warmup-cosine schedule
LR_END_DIVISOR = 20  # the schedule ends at the peak over this
WARMUP = 50  # the schedule's warmup steps, at most a quarter of the run
CONSTANT_LR = 1e-3  # Adam's rate where the run's length is unknown (a bare `Trainer`)
CLIP = 10.0  # the gradients' global norm is clipped at this
# The solver's rtol = atol in maximum-likelihood training: a looser solve trains as
# well per step at a fraction of the evaluations, so more steps fit in the same
# seconds; evaluation and sampling use the model's own tolerances.
TRAIN_TOLERANCE = 1e-2
# The same in reverse-KL training, where the solve's samples and their log-densities
# are the loss itself: kept at the tolerance that objective was measured at.
REVERSE_KL_TOLERANCE = 1e-3
ESTIMATOR = "rademacher"  # the trace estimator in training (one probe)
EVAL_BATCH_SIZE = 1000  # rows per compiled call when evaluating with the exact trace
MAX_FAILURES = 10  # consecutive non-finite steps `fit` skips before it stops

# The command line on a finite table (a data file, a `--data-dir` or a built-in set)
# differs from `fit`: a table has a few hundred to a few thousand rows, so a batch of
# 512 would be most of it, and smaller, noisier batches over more steps, with the
# best validation kept, learn more from the same rows.
CLI_STEPS = 2400
CLI_BATCH_SIZE = 128
# Data sets whose shape needs its own length and batch: checkerboard's sharp edges
# need more and less noisy steps.
CLI_BY_DATA = {"checkerboard": {"steps": 8000, "batch_size": 256}}
CLI_PATIENCE = 10  # validations without improvement before a table's run stops


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What [`default_recipe`][cnftrace.default_recipe] chose, and why.

    - `width`, `depth`: the hidden layers of each block's MLP field.
    - `batch_size`: samples per training step (`fit` halves it for maximum
        likelihood under a time budget on a CPU above 5 dimensions:
        `default_batch_size`).
    - `lr`: the peak learning rate of `warmup_cosine_adam`.
    - `objective`: `"mle"` (maximum likelihood) or `"fm"` (flow matching), what
        [`fit`][cnftrace.fit] trains by when no `objective` is given.
    - `steps`: `fit`'s optimiser steps when none are given.
    - `reason`: one line saying what the choice followed.
    """

    width: int
    depth: int
    batch_size: int
    lr: float
    objective: str
    steps: int
    reason: str


def default_width(dim: int, rows: int | None = None) -> int:
    """The default hidden width for `dim` dimensions: 64 up to 5 dimensions, 256 up
    to 20, 512 beyond; for a table of `rows` training rows, at most 64 per 2,000
    rows (and at least 64)."""
    width = next((w for most, w in WIDTH_BY_DIM if dim <= most), WIDTH_MAX)
    if rows is not None:
        width = min(width, TABLE_WIDTH * max(1, rows // TABLE_ROWS))
    return width


def width_rule() -> str:
    """The width rule in words, from `WIDTH_BY_DIM` and `WIDTH_MAX`, for the
    recipe's reason line and `train --help`."""
    steps = [f"{w} up to {d}" for d, w in WIDTH_BY_DIM]
    steps[0] += " dimensions"
    return ", ".join(steps) + f", {WIDTH_MAX} beyond"


def table_width_rule(rows: str = "rows") -> str:
    """The table rule in words, from `TABLE_WIDTH` and `TABLE_ROWS` (`rows`: what
    the rows are called)."""
    return f"{TABLE_WIDTH} per {TABLE_ROWS:,} {rows}"


def default_objective(dim: int, sampler: bool) -> str:
    """`"fm"` (flow matching) for samples without end (`sampler`) of at least
    `FM_FROM_DIM` dimensions, else `"mle"` (maximum likelihood): a table keeps
    maximum likelihood, whose validation and early stopping are measured there."""
    return "fm" if sampler and dim >= FM_FROM_DIM else "mle"


def default_steps(objective: str) -> int:
    """`fit`'s optimiser steps when none are given, for the `objective` it chose:
    `FM_STEPS` for flow matching, whose steps are cheap, else `STEPS`."""
    return FM_STEPS if objective == "fm" else STEPS


def default_batch_size(dim: int, likelihood: bool, budget: bool, backend: str) -> int:
    """`fit`'s samples per step for `dim` dimensions: `BUDGET_BATCH_SIZE` when it
    trains by maximum `likelihood` under a time `budget` on a CPU (`backend`: JAX's,
    as `jax.default_backend()` names it) above `WIDTH_BY_DIM`'s first size, else
    `BATCH_SIZE`."""
    wide = dim > WIDTH_BY_DIM[0][0]
    return (
        BUDGET_BATCH_SIZE
        if wide and likelihood and budget and backend == "cpu"
        else BATCH_SIZE
    )


def batch_rule() -> str:
    """The batch rule in words, for `fit`'s note."""
    return (
        f"a time budget on a CPU above {WIDTH_BY_DIM[0][0]} dimensions trains by "
        f"maximum likelihood on batches of {BUDGET_BATCH_SIZE}, not {BATCH_SIZE}: a "
        "wide field's step costs in proportion to its rows, and more steps reach a "
        "closer density in the same seconds"
    )


def objective_rule() -> str:
    """The objective rule in words, for the recipe's reason line and `fit`'s note."""
    return f"flow matching from {FM_FROM_DIM} dimensions on samples without end"


def cli_training(data: object) -> dict:
    """The command line's steps and batch size for `data` (a built-in set's name,
    or anything else for a file or a directory)."""
    default = {"steps": CLI_STEPS, "batch_size": CLI_BATCH_SIZE}
    return CLI_BY_DATA.get(data, default) if isinstance(data, str) else default


def width_reason(dim: int, rows: int | None = None) -> str:
    """The width `default_width(dim, rows)` and why, in one line: the command line's
    recipe line (it trains by `--objective`, not by `fit`'s default objective)."""
    width = default_width(dim, rows)
    where = f"{dim} dimension{'s' if dim != 1 else ''}"
    why = width_rule()
    if rows is not None:
        where += f", {rows} training row{'s' if rows != 1 else ''}"
        if width < default_width(dim):
            why = f"a table this size gets {table_width_rule()}: a wider field overfits"
    return f"{where}: width {width} ({why})"


def default_recipe(dim: int, rows: int | None = None) -> Recipe:
    """The default model and training settings for data of `dim` dimensions, and,
    where the data are a table, `rows` training rows (`None`: fresh samples without
    end, as from a sampler).

    **Arguments:**

    - `dim`: the size of one sample, an int >= 1.
    - `rows`: the number of training rows, or `None`.

    **Returns:**

    A [`Recipe`][cnftrace.Recipe]. The width grows with the dimension (64 up to 5
    dimensions, 256 up to 20, 512 beyond) and, on a table, is at most 64 per 2,000
    training rows (a wider field overfits); samples without end of 15 dimensions or
    more train by flow matching for 40,000 steps instead of maximum likelihood for
    1,000; the other settings are the same for every size (but for `fit`'s batch
    under a time budget: [`fit`][cnftrace.fit]). `MLPField` and
    `mlp_flow` see only the dimension: for a small table in Python, pass
    `width=cnftrace.default_recipe(dim, rows=len(train)).width`.

    !!! example

        ```python
        print(cnftrace.default_recipe(2).width)    # 64
        print(cnftrace.default_recipe(10).width)   # 256
        print(cnftrace.default_recipe(10, rows=400).width)  # 64: a small table
        print(cnftrace.default_recipe(10, rows=400).reason)
        print(cnftrace.default_recipe(40).objective)  # fm
        ```
    """
    for name, value, low in (("dim", dim, 1), ("rows", rows, 1)):
        if value is None and name == "rows":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an int >= {low}; got {value!r}.")
    width = default_width(dim, rows)
    objective = default_objective(dim, sampler=rows is None)
    reason = width_reason(dim, rows)
    if objective == "fm":
        reason += f"; flow matching ({objective_rule()})"
    return Recipe(
        width=width,
        depth=DEPTH,
        batch_size=BATCH_SIZE,
        lr=LR,
        objective=objective,
        steps=default_steps(objective),
        reason=reason,
    )
