"""A training run's state between steps, its counters, and the failures they raise
on the host."""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PyTree

from ..flows import AbstractFlow

_RESULT_TREE = jax.tree_util.tree_structure(diffrax.RESULTS.successful)


class TrainingError(RuntimeError):
    """Raised by [`fit`][cnftrace.fit] (and [`Trainer.check`][cnftrace.Trainer.check])
    when training cannot go on: too many consecutive non-finite steps, or an ODE solve
    that failed (its step limit, say). The message names the step and says what to
    change; the last checkpoint is left intact.

    !!! example

        ```python
        try:
            raise cnftrace.TrainingError("the ODE solver reached its step limit")
        except cnftrace.TrainingError as e:
            print(f"training stopped: {e}")
        ```
    """


class TrainState(eqx.Module):
    """The state of a training run between two steps of a
    [`Trainer`][cnftrace.Trainer]. Each step returns a new one; none is changed in
    place.

    **Fields:**

    - `step`: the number of steps taken.
    - `flow`: the flow with its current parameters.
    - `opt_state`: the optimiser's state.
    - `failures`: consecutive steps skipped for a non-finite loss or gradient.
    - `skipped`: all steps skipped so far.
    - `failed_step`: the step (1-based) whose ODE solve failed, or 0. From then on
        every step leaves the state as it is.
    - `result`: that solve's `diffrax.RESULTS` (`successful` if none failed).
    - `bad_batch_step`: the step (1-based) whose generated batch held NaN or inf, or
        0. It stops the run as a failed solve does.
    """

    step: Int[Array, ""]
    flow: AbstractFlow
    opt_state: PyTree
    failures: Int[Array, ""]
    skipped: Int[Array, ""]
    failed_step: Int[Array, ""]
    result: diffrax.RESULTS
    bad_batch_step: Int[Array, ""]


@eqx.filter_jit
def copy_arrays(tree):
    """`tree` with each array copied into a buffer of its own, in one program."""
    return jax.tree_util.tree_map(jnp.copy, tree)


class StepCounters(eqx.Module):
    """A training state's counters (see [`TrainState`][cnftrace.TrainState]), and
    all that [`Trainer.check`][cnftrace.Trainer.check] reads: `result` as the
    result code's integer."""

    step: Int[Array, ""]
    failures: Int[Array, ""]
    skipped: Int[Array, ""]
    failed_step: Int[Array, ""]
    result: Int[Array, ""]
    bad_batch_step: Int[Array, ""]

    @classmethod
    def of(cls, state: TrainState) -> "StepCounters":
        [result] = jax.tree_util.tree_leaves(state.result)
        s = state
        return cls(
            s.step, s.failures, s.skipped, s.failed_step, result, s.bad_batch_step
        )

    @classmethod
    def copied(cls, state: TrainState) -> "StepCounters":
        """The counters in buffers of their own (one small program): still readable
        once `state` has been given to the next step."""
        return _copy_counters(cls.of(state))


_copy_counters = jax.jit(copy_arrays)


def raise_for_failures(counters: StepCounters, flow, max_failures: int | None) -> None:
    """`Trainer.check` on counters fetched to the host."""
    failed_step = int(counters.failed_step)
    if failed_step:
        result = jax.tree_util.tree_unflatten(_RESULT_TREE, [counters.result])
        if bool(result == diffrax.RESULTS.max_steps_reached):
            raise TrainingError(
                f"the ODE solver reached its step limit at training step "
                f"{failed_step} ({solver_settings(flow)}): the dynamics have "
                "become too stiff for the tolerance. Loosen the training tolerance "
                "(MaximumLikelihood's `tolerance`; --train-tol on the command line), "
                "lower the learning rate (--lr), or regularise the dynamics "
                "(`kinetic_weight`, `jacobian_weight`; --kinetic-energy, "
                "--jacobian-norm); in Python the blocks' `max_steps` can be raised "
                "too. The last checkpoint is intact."
            )
        raise TrainingError(
            f"the ODE solve failed at training step {failed_step}: "
            f"{diffrax.RESULTS[result]} The last checkpoint is intact."
        )
    bad_batch_step = int(counters.bad_batch_step)
    if bad_batch_step:
        raise TrainingError(
            f"the training batch of step {bad_batch_step}, drawn from the data "
            "function, contains NaN or inf; make the function return finite "
            "samples. The model was not updated by that step and the last "
            "checkpoint is intact."
        )
    failures = int(counters.failures)
    if max_failures is not None and failures >= max_failures:
        raise TrainingError(
            f"{failures} consecutive training steps gave a non-finite loss "
            f"or gradient (up to step {int(counters.step)}); stopping. The model was "
            "not updated by those steps and the last checkpoint is intact. Lower "
            "the learning rate, clip gradients, or tighten the solver tolerance."
        )


def solver_settings(flow: AbstractFlow) -> str:
    """The blocks' tolerances and step limits, for error messages."""
    parts = {
        f"rtol={b.rtol}, atol={b.atol}, max_steps={b.max_steps}" for b in flow.blocks
    }
    return "; ".join(sorted(parts))
