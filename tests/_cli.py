"""What the command-line tests share: running `main` where it must fail, and the
one line it must say then."""

import numpy as np
import pytest

from cnftrace.cli import main
from cnftrace.datasets import read_table


def fails(argv, capsys, status, *parts, stdout=None) -> str:
    """`main(argv)` exits with `status` (any, where `None`) and says one line on
    stderr holding every string of `parts`, and `stdout` on stdout where given;
    the line is returned."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    if status is not None:
        assert e.value.code == status
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, (out, err)
    for part in parts:
        assert part in lines[0], lines[0]
    if stdout is not None:
        assert out == stdout, out
    return lines[0]


def write_file(path, data) -> str:
    """Writes `data` (bytes, or text in UTF-8) to `path`; the path as a string."""
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())
    return str(path)


def dependent_table(n=40, seed=0) -> np.ndarray:
    """x, y and z = x + y: the third column is a sum of the others, so the
    covariance of any rows of the three is singular."""
    xy = np.random.default_rng(seed).standard_normal((n, 2))
    return np.c_[xy, xy.sum(axis=1)]


def csv_text(x, header="x,y,z") -> str:
    """The rows of `x` as CSV text, every digit kept, under `header` (none if
    empty)."""
    rows = "".join(",".join(f"{v:.17g}" for v in row) + "\n" for row in x)
    return (header + "\n" if header else "") + rows


def read_fails(error, paths, *parts, **kwargs) -> str:
    """`read_table(paths, **kwargs)` raises a one-line `error` holding every string
    of `parts`; its message is returned."""
    with pytest.raises(error) as e:
        read_table(paths, **kwargs)
    message = str(e.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message
    return message
