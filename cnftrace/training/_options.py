"""`fit`'s option classes, `Validation` and `Checkpoints`, and its checks of them."""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import equinox as eqx
from jaxtyping import Array, Float

from .._checks import check_context, check_int, check_samples, check_weight
from ..estimators import AbstractEstimator, Exact
from ..estimators._base import check_estimator
from ..flows import AbstractFlow
from ..store._history import HISTORY_NAME


def _int(name: str, none: bool = False) -> Callable:
    """A field's converter to a checked Python `int`; `None` kept where `none`."""
    return lambda value: value if none and value is None else check_int(name, value)


class Validation(eqx.Module):
    """[`fit`][cnftrace.fit]'s validation settings: before the first step, every
    `every` steps and at the end, the NLL of held-out samples is computed, and the
    best validated parameters are the ones `fit` returns.

    A validation replaces the best one only where the mean of its per-sample
    log-density gains over the best one's exceeds `significance` standard errors.

    **Arguments:**

    - `data`: held-out samples, shape `(n, *event_shape)`.
    - `context`: for a conditional flow, one context row per sample.
    - `every`: steps between validations.
    - `patience`: stop early after this many validations without improvement
        (`None`: never).
    - `estimator`: the trace estimator, the **exact** trace by default; a
        stochastic one's noise is then part of the reported standard error.
    - `significance`: the standard errors a validation's gain must exceed to become
        the best (0: any lower NLL).

    !!! example

        ```python
        held_out = jr.normal(jr.key(0), (500, 2))
        validation = cnftrace.Validation(held_out, every=50, patience=5)
        # cnftrace.fit(flow, data, key=key, validation=validation)
        ```
    """

    data: Float[Array, "n ..."]
    context: Float[Array, "n context"] | None = None
    every: int = eqx.field(default=100, static=True, converter=_int("every"))
    patience: int | None = eqx.field(
        default=None, static=True, converter=_int("patience", none=True)
    )
    estimator: AbstractEstimator | None = None
    significance: float = eqx.field(default=1.0, static=True)

    def __check_init__(self):
        if self.estimator is not None:
            check_estimator(self.estimator)
        check_weight("significance", self.significance)


class Checkpoints(eqx.Module):
    """[`fit`][cnftrace.fit]'s checkpoint settings: the model, optimiser state, step,
    key and config are written to `directory` every `every` steps and at the end,
    keeping the newest `keep` that load. A directory holding checkpoints of the same
    config is resumed from the newest good one (bad ones are reported and skipped),
    exactly as an uninterrupted run would go on. The history (one JSON record per
    line) is cut back to the checkpoint's step on resume. While `fit` runs it holds
    the directory's lock (`directory/.lock`); a lock of a killed process is taken
    over.

    **Arguments:**

    - `directory`: where the checkpoint files go.
    - `every`: steps between checkpoints.
    - `keep`: how many of the newest checkpoints to keep.
    - `config`: a JSON-serialisable dict describing the run; a checkpoint written
        under another config is refused, naming the differences.
    - `history`: the history file; `None` for `directory/history.jsonl`.
    - `lock`: whether `fit` takes the directory's lock; `False` only where the
        caller already holds one covering it (as the command line does).

    !!! example

        ```python
        checkpoints = cnftrace.Checkpoints("run/checkpoints", every=200, keep=2)
        # cnftrace.fit(flow, data, key=key, checkpoints=checkpoints)
        ```
    """

    directory: str
    every: int = eqx.field(default=100, converter=_int("every"))
    keep: int = eqx.field(default=3, converter=_int("keep"))
    config: dict[str, Any] | None = None
    history: str | None = None
    lock: bool = True

    def __check_init__(self):
        if not isinstance(self.directory, str):
            raise TypeError(f"`directory` must be a str; got {self.directory!r}.")
        if not (self.history is None or isinstance(self.history, str)):
            raise TypeError(f"`history` must be a str or None; got {self.history!r}.")

    @property
    def history_file(self) -> str:
        """The history file: `history`, or `history.jsonl` in `directory`."""
        if self.history is None:
            return os.path.join(self.directory, HISTORY_NAME)
        return self.history


def checked_arguments(flow, checkpoints) -> Checkpoints | None:
    """A `TypeError` naming `flow` or `checkpoints` where it is of another kind;
    `checkpoints` as a `Checkpoints` (or `None`)."""
    if not isinstance(flow, AbstractFlow):
        raise TypeError(
            "`flow` must be a cnftrace flow (an AbstractFlow: a CNF, a Chain, a "
            f"MultiscaleFlow, ...); got {type(flow).__name__} {flow!r:.80}. Build one "
            "with cnftrace.CNF(field, dim) or cnftrace.mlp_flow(dim, key=...)."
        )
    if checkpoints is None or isinstance(checkpoints, Checkpoints):
        return checkpoints
    if isinstance(checkpoints, (str, os.PathLike)):
        directory = os.fspath(checkpoints)
        if isinstance(directory, str):
            return Checkpoints(directory)
    raise TypeError(
        "`checkpoints` must be a cnftrace.Checkpoints or a directory path (a str or "
        f"a pathlib.Path); got {type(checkpoints).__name__} {checkpoints!r:.80}."
    )


def checked_validation(validation: Validation, flow: AbstractFlow) -> Validation:
    data = check_samples(validation.data, "validation", flow.event_shape)
    if data.shape[0] < 2:
        raise ValueError(
            f"`validation` holds {data.shape[0]} sample; a validation NLL needs at "
            "least 2 (for its standard error): hold out more samples."
        )
    context = check_context(
        validation.context,
        flow.context_dim,
        data.shape[0],
        name="validation.context",
        broadcast=False,
        host=True,
    )
    estimator = Exact() if validation.estimator is None else validation.estimator
    return dataclasses.replace(
        validation, data=data, context=context, estimator=estimator
    )
