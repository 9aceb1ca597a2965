"""`mlp_flow`: the flow of the command line, the experiments and the benchmarks, with
cnftrace's default field or FFJORD's, by names of solvers and activations."""

from collections.abc import Callable

import diffrax
import jax
import jax.random as jr

from .._checks import check_int
from .._custom_types import Key
from .._defaults import (
    ATOL,
    DEPTH,
    MATMUL_PRECISION,
    MAX_STEPS,
    RTOL,
    T1,
    default_width,
)
from ..estimators import AbstractEstimator
from ..nets import ConcatSquashMLP, MLPField
from ._base import AbstractFlow
from ._chain import Chain
from ._cnf import CNF
from ._distributions import AbstractBase, StandardNormal, check_base

SOLVERS = {
    "tsit5": diffrax.Tsit5,
    "dopri5": diffrax.Dopri5,
    "dopri8": diffrax.Dopri8,
    "bosh3": diffrax.Bosh3,
}
ACTIVATIONS = {
    "tanh": jax.nn.tanh,
    "softplus": jax.nn.softplus,
    "elu": jax.nn.elu,
    "silu": jax.nn.silu,
}
FIELDS = ("mlp", "concatsquash")
# Each field's default activation: SiLU suits MLPField and tanh suits ConcatSquash
# (each measured against the other on docs/quality.md).
DEFAULT_ACTIVATION = {"mlp": "silu", "concatsquash": "tanh"}


def _lookup(table: dict, name: str, value):
    if not isinstance(value, str):
        return value
    if value not in table:
        raise ValueError(f"`{name}` must be one of {sorted(table)}; got {value!r}.")
    return table[value]


def mlp_flow(
    dim: int,
    *,
    key: Key,
    field: str = "mlp",
    blocks: int = 1,
    width: int | None = None,
    depth: int = DEPTH,
    activation: str | Callable | None = None,
    t1: float = T1,
    learn_t1: bool = False,
    solver: str | diffrax.AbstractSolver = "tsit5",
    rtol: float = RTOL,
    atol: float = ATOL,
    estimator: AbstractEstimator | None = None,
    max_steps: int = MAX_STEPS,
    dtype=None,
    zero_last: bool | None = None,
    base: AbstractBase | None = None,
    matmul_precision: str | None = MATMUL_PRECISION,
) -> AbstractFlow:
    """A flow of `blocks` CNF blocks, each an MLP vector field with `depth` hidden
    layers of `width` units: cnftrace's default model ([`MLPField`][cnftrace.MLPField]
    with SiLU, one block, T = 0.5, Tsit5 at rtol = atol = 1e-5), or with
    `field="concatsquash"` FFJORD's toy and tabular model
    ([`ConcatSquashMLP`][cnftrace.ConcatSquashMLP], tanh by default).

    **Arguments:**

    - `dim`: the size of one sample.
    - `key`: the PRNG key of the initialisation: the field's own for one block,
        split with `jax.random.split(key, blocks)` for several.
    - `field`: `"mlp"` ([`MLPField`][cnftrace.MLPField]) or `"concatsquash"`
        ([`ConcatSquashMLP`][cnftrace.ConcatSquashMLP]).
    - `blocks`, `width`, `depth`: the architecture. The width follows `dim` by
        default ([`default_recipe`][cnftrace.default_recipe]).
    - `activation`: `"silu"`, `"tanh"`, `"softplus"`, `"elu"` or any function;
        `None` for the field's default (SiLU for `"mlp"`, tanh for
        `"concatsquash"`).
    - `t1`, `learn_t1`: each block's end time, and whether it is trained.
    - `solver`: `"tsit5"`, `"dopri5"`, `"dopri8"`, `"bosh3"` or a diffrax solver.
    - `rtol`, `atol`, `estimator`, `max_steps`, `matmul_precision`: as for
        [`CNF`][cnftrace.CNF].
    - `dtype`: the parameters' dtype (JAX's default float if omitted).
    - `base`: the flow's base distribution (the standard normal if omitted), e.g.
        one fitted to training rows by [`fit_base`][cnftrace.fit_base].
    - `zero_last`: start each field's output layer at zero, so that the flow starts
        as its base; `None` (default): when a `base` other than the standard normal
        is given.

    **Returns:**

    A [`CNF`][cnftrace.CNF] for one block, else a [`Chain`][cnftrace.Chain].

    !!! example

        ```python
        flow = cnftrace.mlp_flow(2, key=jr.key(0), width=16, depth=2)
        chain = cnftrace.mlp_flow(6, key=jr.key(0), blocks=3, solver="dopri5")
        ffjord = cnftrace.mlp_flow(2, key=jr.key(0), field="concatsquash")
        print(len(chain.blocks))  # 3
        ```
    """
    blocks = check_int("blocks", blocks)
    if field not in FIELDS:
        raise ValueError(f"`field` must be one of {FIELDS}; got {field!r}.")
    if activation is None:
        activation = DEFAULT_ACTIVATION[field]
    act = _lookup(ACTIVATIONS, "activation", activation)
    if width is None:
        check_int("dim", dim)
        width = default_width(dim)
    if base is not None:
        base = check_base(base, (dim,))
    if zero_last is None:
        zero_last = base is not None and not isinstance(base, StandardNormal)
    make_field = MLPField if field == "mlp" else ConcatSquashMLP
    solver_type = _lookup(SOLVERS, "solver", solver)
    keys = [key] if blocks == 1 else list(jr.split(key, blocks))
    flows = [
        CNF(
            make_field(dim, width, depth, act, key=k, dtype=dtype, zero_last=zero_last),
            dim,
            t1=t1,
            learn_t1=learn_t1,
            solver=solver_type() if isinstance(solver, str) else solver_type,
            rtol=rtol,
            atol=atol,
            estimator=estimator,
            max_steps=max_steps,
            matmul_precision=matmul_precision,
        )
        for k in keys
    ]
    if base is not None:  # the last block's base is the flow's
        flows[-1] = flows[-1].with_base(base)
    return flows[0] if blocks == 1 else Chain(flows)
