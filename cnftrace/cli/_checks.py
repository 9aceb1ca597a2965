"""The command line's checks of its arguments, made before anything is written.

Each failure is a `UsageError` whose message names the option and the accepted range;
`cnftrace` prints it as one line and exits with status 2.
"""

import contextlib
import os
import stat
import sys
import warnings

import jax.numpy as jnp

from .._checks import memory_limit
from .._io import file_kind
from ._arguments import run_config


@contextlib.contextmanager
def warnings_said():
    """A block whose warnings are printed on stderr as `cnftrace: ...` lines."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        print(f"cnftrace: {w.message}", file=sys.stderr, flush=True)


class UsageError(Exception):
    """An argument the command cannot run with (exit status 2)."""


class CommandFailed(Exception):
    """A command that could not run for a reason outside its arguments (exit status
    1)."""


def check_args(args) -> None:
    """Every setting of the command in range before anything runs: `train`'s by
    `RunConfig.check`, the others' here."""
    if args.command == "train":
        try:
            run_config(args).check()
        except ValueError as e:
            raise UsageError(str(e)) from None
        return
    for name in ("run_dir", "out", "data_dir"):
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            flag = "RUN_DIR" if name == "run_dir" else f"--{name.replace('_', '-')}"
            what = "a file name" if name == "out" else "a directory"
            raise UsageError(f"{flag} is empty ({value!r}); give {what}.")
    n = getattr(args, "n", None)
    if n is not None:
        low = 2 if args.command == "eval" else 1  # a standard error needs two
        if n < low:
            raise UsageError(f"--n must be at least {low}.")
    seed = getattr(args, "seed", None)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise UsageError(f"--seed must fit in 64 bits; got {seed}.")
    out = getattr(args, "out", None)
    if out is not None:
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


def nearest_existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists (as a link, too)."""
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def check_run_dir(path: str) -> None:
    """`--run-dir` is a directory, or can become one: missing parents are made with
    it (`--run-dir runs/8g` in a fresh clone), but no part of it may be a file."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--run-dir {path} is a file, not a directory.")
    # `fit` refuses a checkpoints path that is not a directory only after
    # config.json is written: refused here first. (`.lock` is checked by the run
    # directory's lock, and config.json by its reading, both before the write.)
    checkpoints = os.path.join(path, "checkpoints")
    mode = os.lstat(checkpoints).st_mode if os.path.lexists(checkpoints) else None
    if mode is not None and not stat.S_ISDIR(mode):
        raise CommandFailed(
            f"{checkpoints} is {file_kind(mode)}, not a directory, so it is not this "
            "run's; remove it or move it away, and run again."
        )
    ancestor = nearest_existing(os.path.dirname(os.path.abspath(path)))
    if not os.path.isdir(ancestor):
        raise UsageError(
            f"--run-dir {path}: {ancestor} is a file, so the directory cannot be made "
            "there."
        )


def _check_memory(numbers: int, setting: str, needs: str, fix: str = "") -> None:
    """A `UsageError` saying `SETTING cannot fit: NEEDS at least ... GiB, more than
    the ... GiB of` the memory, where `numbers` of JAX's default float do not fit."""
    need = numbers * jnp.dtype(jnp.result_type(float)).itemsize
    limit, what = memory_limit()
    if need > limit:
        raise UsageError(
            f"{setting} cannot fit: {needs} at least {need / 2**30:.3g} GiB, more "
            f"than the {limit / 2**30:.3g} GiB of {what}.{fix}"
        )


def check_model_fits_in_memory(config) -> None:
    """A `UsageError` when the model's weights alone, with Adam's two moments, cannot
    fit: at least `blocks * depth * width**2` numbers, three times."""
    _check_memory(
        3 * config.blocks * max(config.depth, 1) * config.width**2,
        f"--width {config.width}",
        f"{config.blocks} block(s) of depth {config.depth} need, for the weights and "
        "the optimiser's state,",
    )


def check_probes_fit_in_memory(config, dim: int) -> None:
    """A `UsageError` when the probes of a stochastic trace estimator cannot fit:
    each of the `--num-probes` probes is an array the size of the batch, carried
    through the solve with its tangent, so at least ten such arrays per probe."""
    if config.estimator == "exact" or config.objective != "mle":
        return  # no probes drawn
    _check_memory(
        10 * config.num_probes * config.batch_size * dim,
        f"--num-probes {config.num_probes}",
        f"that many probes for a batch of {config.batch_size} samples of dimension "
        f"{dim} need",
        " Use fewer probes (1 is the default), or --estimator exact.",
    )


def check_fits_in_memory(flag: str, n: int, dim: int) -> None:
    """A `UsageError` when `n` samples of size `dim` cannot fit: an ODE solve keeps
    at least ten arrays the size of the batch (the state, its probes and the solver's
    stages), so that is the lower bound compared with the memory."""
    _check_memory(
        10 * n * dim,
        f"{flag} {n}",
        f"solving for {n} samples of dimension {dim} needs",
        f" Use a smaller {flag}.",
    )
