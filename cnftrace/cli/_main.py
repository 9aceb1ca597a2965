"""The `cnftrace` command line: the parser, and errors as one line on stderr."""

import argparse
import sys

import jax.numpy as jnp

from ..flows import SolverError
from ..store import CheckpointError, enable_compilation_cache
from ..training import TrainingError
from ._arguments import add_run_arguments, integer_argument
from ._checks import CommandFailed, UsageError, check_args, warnings_said
from ._commands import EVAL_SEED, cmd_datasets, cmd_eval, cmd_plot, cmd_sample
from ._train import cmd_train, initialize_distributed


class _Exit(SystemExit):
    """Ends the command with exit status `status` once its one-line message is
    printed; `str()` of it is the message."""

    def __init__(self, message: str, status: int):
        super().__init__(status)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit status 2."""

    def error(self, message):
        print(
            f"{self.prog}: error: {message} (see `{self.prog} --help`)",
            file=sys.stderr,
        )
        raise _Exit(message, 2)


def make_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cnftrace",
        description="Train, evaluate and sample continuous normalizing flows.",
    )
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="on an error, show the full traceback (otherwise one line)",
    )
    parser.add_argument("--debug", action="store_true", help=debug._actions[0].help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_parser(name, help):
        return sub.add_parser(name, help=help, parents=[debug])

    p = add_parser("train", "train a flow (a built-in data set or your file)")
    add_run_arguments(p)
    p.set_defaults(func=cmd_train)

    p = add_parser("eval", "exact-trace test NLL of a trained run")
    p.add_argument("run_dir")
    p.add_argument(
        "--n",
        type=integer_argument,
        help="test samples: for a data file or a table, the first N rows of its "
        "fixed test split (default: all of them); for a toy set, N drawn; for MNIST, "
        "its first N test images (default: 5000)",
    )
    p.add_argument(
        "--seed",
        type=integer_argument,
        default=EVAL_SEED,
        help="seed of a toy set's test samples and of images' dequantisation noise; "
        f"a table's test split is fixed (default: {EVAL_SEED})",
    )
    p.set_defaults(func=cmd_eval)

    p = add_parser("sample", "draw samples from a trained run (.npy or .csv)")
    p.add_argument("run_dir")
    p.add_argument(
        "--n", type=integer_argument, default=1000, help="samples (default: 1000)"
    )
    p.add_argument("--seed", type=integer_argument, default=0, help="seed (default: 0)")
    p.add_argument(
        "--out",
        help="output file, .npy, .csv or .tsv by its extension (default "
        "RUN_DIR/samples.npy); samples are in the data's units",
    )
    p.set_defaults(func=cmd_sample)

    p = add_parser("plot", "density, samples and training curves (PNG)")
    p.add_argument("run_dir")
    p.add_argument("--seed", type=integer_argument, default=0, help="seed (default: 0)")
    p.set_defaults(func=cmd_plot)

    p = add_parser("datasets", "list the data sets, with --data-dir those there")
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help="also list MAF's UCI sets and MNIST, found (or not) in DIR",
    )
    p.set_defaults(func=cmd_datasets)
    return parser


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _failure(e: BaseException) -> tuple[int, str]:
    """The exit status and the one-line message for an error that ends a command."""
    if isinstance(e, UsageError):
        return 2, _one_line(str(e))
    if isinstance(e, KeyboardInterrupt):
        return 130, "interrupted; what was checkpointed is kept."
    expected = (CommandFailed, CheckpointError, TrainingError, SolverError)
    expected += (ValueError, TypeError)
    if isinstance(e, expected):
        return 1, _one_line(str(e))
    if isinstance(e, OSError):
        where = f": {e.filename}" if e.filename else ""
        message = f"{e.strerror or e}{where}"
        if e.errno == 28:  # ENOSPC
            message += "; free some space and run the same command to resume"
        return 1, message
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return 1, f"{type(e).__name__}: {first} (run with --debug for the traceback)"


def main(argv=None) -> int:
    args = make_parser().parse_args(argv)
    try:
        check_args(args)
        if getattr(args, "distributed", False):
            initialize_distributed()  # before anything else touches JAX
        with warnings_said():  # a bad cache is one line
            enable_compilation_cache()
        jnp.zeros(())
        return args.func(args)
    except (Exception, KeyboardInterrupt) as e:
        if args.debug:
            raise
        status, message = _failure(e)
        print(f"cnftrace: error: {message}", file=sys.stderr)
        raise _Exit(message, status) from None


if __name__ == "__main__":
    sys.exit(main())
