"""The parsers of `cnftrace train`'s flag values, by the package's one rule for
numbers (`parse_int`, `parse_float`)."""

import argparse
import math

from .._checks import parse_float, parse_int


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
