"""The command line's checks of its arguments, made before anything is written.

Each failure is a `UsageError` whose message names the option and the accepted range;
`cnftrace` prints it as one line and exits with status 2.
"""

import math
import os

import jax
import jax.numpy as jnp


class UsageError(Exception):
    """An argument the command cannot run with (exit status 2)."""


class CommandFailed(Exception):
    """A command that could not run for a reason outside its arguments (exit status
    1)."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UsageError(f"{_flag(name)} must be a finite number > 0; got {value}.")


def _at_least(args, low: int, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise UsageError(f"{_flag(name)} must be at least {low}.")


def check_args(args) -> None:
    """Every numeric setting of `args` finite and in its range, and the combinations
    of options consistent."""
    _at_least(args, 1, "steps", "batch_size", "blocks", "width", "num_probes")
    _at_least(args, 1, "checkpoint_every", "print_every")
    _at_least(args, 0, "depth")
    if args.command == "eval":
        _at_least(args, 2, "n")  # a standard error needs two samples
    else:
        _at_least(args, 1, "n")
    seed = getattr(args, "seed", None)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise UsageError(f"--seed must fit in 64 bits; got {seed}.")
    _positive(args, "lr", "clip", "t1", "rtol", "atol")
    for name in ("kinetic_energy", "jacobian_norm"):
        value = getattr(args, name, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise UsageError(f"{_flag(name)} must be a finite weight >= 0.")
    objective = getattr(args, "objective", "mle")
    if objective != "mle":
        if args.learn_t1:
            raise UsageError(
                f"--objective {objective} fixes the integration time; drop "
                "--learn-t1 (or use --objective mle)."
            )
        if args.kinetic_energy or args.jacobian_norm:
            raise UsageError(
                f"--kinetic-energy and --jacobian-norm regularise --objective mle; "
                f"drop them with --objective {objective}."
            )
    sigma = getattr(args, "fm_sigma", None)
    if sigma is not None and not 0 <= sigma < 1:
        raise UsageError(f"--fm-sigma must be in [0, 1); got {sigma}.")
    _check_data_options(args)
    out = getattr(args, "out", None)
    if out:
        ext = os.path.splitext(out)[1].lower()
        if ext not in (".npy", ".csv", ".tsv"):
            raise UsageError(
                f"--out {out}: write samples to a file ending in .npy, .csv or .tsv."
            )
        parent = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(parent):
            raise UsageError(f"--out {out}: the directory {parent} does not exist.")
        if os.path.isdir(out):
            raise UsageError(f"--out {out} is a directory; give a file name (.npy).")


def _check_data_options(args) -> None:
    val, test = getattr(args, "val_fraction", None), getattr(args, "test_fraction", 0)
    if val is None:
        return
    if not (math.isfinite(val) and 0 <= val < 1):
        raise UsageError(f"--val-fraction must be in [0, 1); got {val}.")
    if not (math.isfinite(test) and 0 < test < 1):
        raise UsageError(f"--test-fraction must be in (0, 1); got {test}.")
    if val + test >= 1:
        raise UsageError(
            f"--val-fraction {val} and --test-fraction {test} leave no rows to train "
            "on; make them add up to less than 1."
        )
    if args.patience is not None and args.patience < 0:
        raise UsageError("--patience must be 0 (never stop early) or more.")
    from_file = not isinstance(args.data, str) or os.path.splitext(args.data)[1]
    if not from_file:
        for flag in ("columns", "array"):
            if getattr(args, flag) is not None:
                raise UsageError(
                    f"--{flag} picks from a data file; --data {args.data} is a "
                    "built-in data set."
                )


def check_run_dir(path: str) -> None:
    """`--run-dir` is a directory, or can become one: missing parents are made with
    it (`--run-dir runs/8g` in a fresh clone), but no part of it may be a file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--run-dir {path} is a file, not a directory.")
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(
            f"--run-dir {path}: {ancestor} is a file, so the directory cannot be made "
            "there."
        )


def memory_limit() -> tuple[int, str]:
    """The bytes one device can hold, and what they are: the accelerator's memory
    where JAX reports it, else the machine's."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # a backend without memory statistics
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"{jax.devices()[0].device_kind} memory"
    pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * page, "this machine's memory"


def check_model_fits_in_memory(args) -> None:
    """A `UsageError` when the model's weights alone, with Adam's two moments, cannot
    fit: at least `blocks * depth * width**2` numbers, three times."""
    itemsize = jnp.dtype(jnp.result_type(float)).itemsize
    need = 3 * args.blocks * max(args.depth, 1) * args.width**2 * itemsize
    limit, what = memory_limit()
    if need > limit:
        raise UsageError(
            f"--width {args.width} cannot fit: {args.blocks} block(s) of depth "
            f"{args.depth} need at least {need / 2**30:.3g} GiB for the weights and "
            f"the optimiser's state, more than the {limit / 2**30:.3g} GiB of {what}."
        )


def check_fits_in_memory(flag: str, n: int, dim: int) -> None:
    """A `UsageError` when `n` samples of size `dim` cannot fit: an ODE solve keeps
    at least ten arrays the size of the batch (the state, its probes and the solver's
    stages), so that is the lower bound compared with the memory."""
    itemsize = jnp.dtype(jnp.result_type(float)).itemsize
    need = 10 * n * dim * itemsize
    limit, what = memory_limit()
    if need > limit:
        raise UsageError(
            f"{flag} {n} cannot fit: solving for {n} samples of dimension {dim} needs "
            f"at least {need / 2**30:.3g} GiB, more than the {limit / 2**30:.3g} GiB "
            f"of {what}. Use a smaller {flag}."
        )
