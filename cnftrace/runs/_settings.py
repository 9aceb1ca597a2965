"""The description of one setting of `RunConfig`: its default, group, help, range,
whether it is stored, and how the command line reads it (as plain values, which
`cnftrace.cli` turns into `argparse`'s)."""

import dataclasses

from .. import _defaults as defaults
from .._defaults import cli_training


def by_data(name: str) -> str:
    """`--help`'s words for a setting that the data set decides (`cli_training`)."""
    words = [str(cli_training(None)[name])]
    words += [f"{v[name]} for {k}" for k, v in defaults.CLI_BY_DATA.items()]
    return "; ".join(words)


def setting(
    default,
    group: str,
    help: str,
    *,
    stored: bool = True,
    flag: bool = True,
    shown: str | None = None,
    low: int | None = None,
    check: str | None = None,
    **flag_kwargs,
):
    """A field of `RunConfig`.

    - `stored`: kept in `config.json` and compared on resume.
    - `flag`: whether it is a flag (`--` and the name with dashes); not for a
        setting the command derives itself.
    - `shown`: the default as `--help` states it, where it is not the value.
    - `low`: the least value of an integer; `check`: the range of a number,
        `"positive"` (finite, > 0), `"weight"` (finite, >= 0) or `"fraction"` (in
        [0, 1)).
    - `flag_kwargs`: how the command line reads the flag, as plain values that
        `cnftrace.cli` turns into `argparse`'s (`type`: `int`, `float`,
        `"tolerance"` or `"devices"`; `action`: `"store_true"` or `"on/off"`;
        `choices`, `nargs`, `metavar`, `required`). An `int` or `float` default
        gives the flag its type, a `bool` one makes it a switch.
    """
    if isinstance(default, bool):
        flag_kwargs.setdefault("action", "store_true")
    elif isinstance(default, (int, float)):
        flag_kwargs.setdefault("type", type(default))
    if flag_kwargs.get("type") in (int, float):
        flag_kwargs.setdefault("metavar", "N" if flag_kwargs["type"] is int else "X")
    metadata = dict(
        group=group,
        help=help,
        stored=stored,
        flag=flag,
        shown=shown,
        low=low,
        check=check,
        flag_kwargs=flag_kwargs,
    )
    return dataclasses.field(default=default, metadata=metadata)
