"""`cnftrace train`'s flags: one per setting of `RunConfig`, with the parsers of
their values by the package's one rule for numbers (`parse_int`, `parse_float`)."""

import argparse
import dataclasses
import math

from .._checks import parse_float, parse_int
from ..runs import GROUPS, RunConfig


def integer_argument(value: str) -> int:
    """An integer flag by the package's one rule for numbers (`parse_int`): ASCII
    digits, refusing the `1_000` and full-width digits that Python's `int` takes."""
    n = parse_int(value)
    if n is None:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}")
    return n


def number_argument(value: str) -> float:
    """A number flag by the package's one rule for numbers (`parse_float`)."""
    x = parse_float(value)
    if x is None:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}")
    return x


def tolerance_argument(value: str) -> float | None:
    """A tolerance flag: a positive number, or `none` (fixed steps)."""
    if value.strip().lower() == "none":
        return None
    tol = parse_float(value)
    tol = math.nan if tol is None else tol
    if not (math.isfinite(tol) and tol > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive tolerance or 'none', got {value!r}"
        )
    return tol


def devices_argument(value: str) -> int | str:
    """`--devices`: `all`, or a number of devices of at least one."""
    if value == "all":
        return value
    n = parse_int(value)
    if n is None or n < 1:
        raise argparse.ArgumentTypeError(
            f"expected 'all' or a number of devices >= 1, got {value!r}"
        )
    return n


def flag_value(value) -> str:
    """A setting's value as its flag's help states it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


class DataAction(argparse.Action):
    """`--data`: one name or file is kept as a string, several files as a tuple."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values[0] if len(values) == 1 else tuple(values))


# The plain values of a setting's `type` and `action` (see `RunConfig`'s settings)
# as argparse's.
_TYPES = {
    int: integer_argument,
    float: number_argument,
    "tolerance": tolerance_argument,
    "devices": devices_argument,
}
_ACTIONS = {"on/off": argparse.BooleanOptionalAction}


def _flagged() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RunConfig) if f.metadata["flag"]]


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per setting of `RunConfig` to `parser`, in argument groups,
    each help ending with the default."""
    groups = {name: parser.add_argument_group(f"{name} settings") for name in GROUPS}
    for f in _flagged():
        kwargs = dict(f.metadata["flag_kwargs"])
        if "type" in kwargs:
            kwargs["type"] = _TYPES[kwargs["type"]]
        if "action" in kwargs:
            kwargs["action"] = _ACTIONS.get(kwargs["action"], kwargs["action"])
        flags = ["--" + f.name.replace("_", "-")]
        if f.name == "data":
            flags.append("--dataset")
            kwargs["action"] = DataAction
        shown = f.metadata["shown"] or flag_value(f.default)
        ending = "required" if kwargs.get("required") else f"default: {shown}"
        groups[f.metadata["group"]].add_argument(
            *flags,
            dest=f.name,
            default=f.default,
            help=f"{f.metadata['help']} ({ending})",
            **kwargs,
        )


def run_config(args: argparse.Namespace) -> RunConfig:
    """The settings of parsed flags (those `add_run_arguments` added)."""
    return RunConfig(**{f.name: getattr(args, f.name) for f in _flagged()})
