"""A user's own table of samples, read from files: `.npy`, `.npz` (a named array),
`.csv`/`.tsv` (numeric columns, an optional header line) and, where pandas has a
Parquet engine (pyarrow or fastparquet), `.parquet`.

Everything is checked before anything trains, and every error names the file, the
row or column, and the fix: an empty file, text in a numeric column, a line with the
wrong number of fields, a header line repeated further down (files concatenated with
their headers), NaN or inf, a dimension that changes between files, a text file not
in UTF-8, lines that look separated by another character than the extension says
(`;` or tabs in a .csv, commas in a .tsv). Rows are counted from 0 (as NumPy indexes
them); the lines of a text file from 1 (as an editor shows them); columns from 0,
with their header names where there are some.

A missing value (a cell of a text file that is empty or reads NA, N/A, #N/A, <NA>,
NaN, null, None or ?, in any case, blanks around it aside; NaN in an array or a
Parquet file, and Parquet's nulls) is refused like any other problem, unless
`drop_missing` asks for the rows holding one in the chosen columns to be dropped.
inf is not missing: it is refused either way.

Text files are read as UTF-8, a byte-order mark (Excel's "CSV UTF-8") dropped. NumPy's
C parser reads them where every row is numbers; otherwise, and to name any problem,
a checking parser, line by line. Files of `PROGRESS_BYTES` or more show the progress
of their parsing on stderr.
"""

import csv
import hashlib
import io
import math
import os
import sys
import warnings
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from ._real import Splits

TABLE_FORMATS = (".csv", ".tsv", ".npy", ".npz", ".parquet")
_DELIMITERS = {".csv": ",", ".tsv": "\t"}
# Text files of at least this many bytes show the progress of their parsing on
# stderr (2 million rows of three numbers take about 120 MB, and 2 s to parse).
PROGRESS_BYTES = 32 * 2**20
_PROGRESS_EVERY = 2**16  # rows between updates of the progress bar
# What a missing value reads in a text file, once stripped and lower-cased.
_MISSING = frozenset(("", "na", "n/a", "#n/a", "<na>", "nan", "null", "none", "?"))
_DROP = "drop the rows with missing values (`--drop-missing`; `drop_missing=True` "
_DROP += "in Python)"


class Table(NamedTuple):
    """The samples of one or more files, as
    [`read_table`][cnftrace.datasets.read_table] returns them.

    - `data`: a float64 array of shape `(n, dim)`, the files' rows one after another.
    - `names`: the column names (from a header line or a Parquet file), or `None`.
    - `paths`: the files read, in order.
    - `sha256`: the SHA-256 of each file's bytes.
    - `rows`: the number of rows each file gave.
    - `dropped`: the number of rows of each file dropped for a missing value
        (`drop_missing`); zeros without it, `()` in a `Table` built without them.
    - `first_dropped`: where each file's first dropped row was, `"line 7"` in a text
        file (lines from 1) or `"row 6"` in an array (rows from 0); `None` for a
        file with none dropped.
    """

    data: np.ndarray
    names: tuple[str, ...] | None
    paths: tuple[str, ...]
    sha256: tuple[str, ...]
    rows: tuple[int, ...]
    dropped: tuple[int, ...] = ()
    first_dropped: tuple[str | None, ...] = ()


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def _is_missing(field: str) -> bool:
    """Whether a stripped field of a text file is a missing value."""
    return field.lower() in _MISSING or (_is_number(field) and math.isnan(float(field)))


def _column(j: int, names) -> str:
    return f"column {j} ({names[j]!r})" if names else f"column {j}"


def _decode(path: str, raw: bytes) -> str:
    """The text of a file's bytes, read as UTF-8 (a byte-order mark dropped), or a
    `ValueError` naming the line and column of the first byte that is not."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        at = e.start + (3 if raw.startswith(b"\xef\xbb\xbf") else 0)
        line = raw.count(b"\n", 0, at) + 1
        start = raw.rfind(b"\n", 0, at) + 1
        column = len(raw[start:at].decode("utf-8-sig")) + 1  # in characters
        raise ValueError(
            f"{path}, line {line}, column {column}: byte 0x{raw[at]:02x} is not "
            "UTF-8 text, so the file was saved in another encoding (Latin-1 or "
            "Windows-1252, perhaps). Save it as UTF-8 (Excel: 'CSV UTF-8'), or "
            f"convert it, e.g. `iconv -f latin1 -t utf-8 {path}`."
        ) from None


def _delimiter_hint(text: str, delimiter: str) -> str | None:
    """What to do where the lines of a text file look separated by another
    character than its extension says: `;` or tabs in a .csv, commas in a .tsv."""
    lines = [line for line in text[: 2**20].splitlines()[:1000] if line.strip()]
    semicolons = (
        ";",
        "';'",
        "convert the semicolons to commas (and any decimal commas to points), or "
        "save it as 'CSV (comma delimited)'",
    )
    if delimiter == ",":
        candidates = (semicolons, ("\t", "tabs", "rename it to .tsv"))
    else:
        candidates = ((",", "commas", "rename it to .csv"),)
    for sep, shown, fix in candidates:
        if not lines or not all(sep in line for line in lines):
            continue
        alone = not any(delimiter in line for line in lines)
        # Semicolons beside commas: decimal commas, if every line has as many.
        if alone or (sep == ";" and len({line.count(sep) for line in lines}) == 1):
            other = "commas" if delimiter == "," else "tabs"
            return f"The file looks separated by {shown}, not {other}: {fix}."
    return None


def _progress(path: str, size: int, text: str):
    """A progress bar of the rows parsed, on stderr, for a file of at least
    `PROGRESS_BYTES` bytes; `None` for smaller files."""
    if size < PROGRESS_BYTES:
        return None
    return tqdm(
        total=text.count("\n") + 1,
        desc=f"reading {os.path.basename(path)}",
        unit=" rows",
        unit_scale=True,
        file=sys.stderr,
        leave=False,
    )


def _counted(lines, bar):
    """`lines`, counted on `bar` every `_PROGRESS_EVERY` of them."""
    if bar is None:
        yield from lines
        return
    for i, line in enumerate(lines, 1):
        if i % _PROGRESS_EVERY == 0:
            bar.update(_PROGRESS_EVERY)
        yield line


def _same_widths(raw: bytes, delimiter: str, skip: int, width: int) -> bool:
    """Whether every line after the first `skip` of a file without quotes holds
    `width` fields (blank lines aside): counted on the bytes, where no byte of a
    multi-byte UTF-8 character is a delimiter or a newline."""
    if b'"' in raw:
        return False
    b = np.frombuffer(raw, np.uint8)
    starts = np.r_[0, np.flatnonzero(b == ord("\n")) + 1]
    starts = starts[starts < b.size][skip:]
    if starts.size == 0:
        return False
    bounds = np.r_[starts, b.size]
    seps = np.diff(np.searchsorted(np.flatnonzero(b == ord(delimiter)), bounds))
    lengths = np.diff(bounds)
    blank = lengths <= 2  # "\n", "\r\n" or nothing (the last line)
    blank &= np.isin(b[starts], (ord("\n"), ord("\r")))
    return bool(np.all(seps[~blank] == width - 1))


def _read_fast(
    text: str, raw: bytes, delimiter: str, skip: int, width: int, picked: list[int], bar
):
    """The `picked` columns of every row after the first `skip` lines, parsed by
    NumPy's C parser; `None` where a row is not `width` fields split by `delimiter`
    alone, or a picked field is not a finite number (quotes, text, a missing
    field, a line of blanks, NaN): the checking parser then reads the file and
    names the problem. It accepts less than that parser, never more, and reads
    the same values, four to five times faster."""
    if text.count("\r") != text.count("\r\n"):
        return None  # a lone carriage return: the csv module's business
    usecols = None
    if picked != list(range(width)):  # the others may hold text: count fields
        if not _same_widths(raw, delimiter, skip, width):
            return None
        usecols = picked
    lines = io.StringIO(text)
    for _ in range(skip):
        next(lines, None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "input contained no data"
            data = np.loadtxt(
                _counted(lines, bar),
                delimiter=delimiter,
                comments=None,
                usecols=usecols,
                ndmin=2,
                dtype=np.float64,
            )
    except ValueError:
        return None
    if data.shape[0] == 0 or data.shape[1] != len(picked):
        return None
    return data if np.isfinite(data).all() else None


def _filled(row) -> bool:
    return bool(row) and any(field.strip() for field in row)


def _read_text(path: str, delimiter: str, columns, drop_missing: bool):
    """`(data, names, line_of_row, dropped, first_line)` of the picked columns of a
    delimited text file (the others are not read, so they may hold text), without
    the `dropped` rows with a missing value where `drop_missing`, the first on
    `first_line`. `line_of_row` is `None` where every row was read as finite
    numbers. An error gains a hint where the lines look separated by another
    character than the extension says."""
    with open(path, "rb") as f:
        raw = f.read()
    text = _decode(path, raw)
    bar = _progress(path, len(raw), text)
    try:
        return _parse_text(path, text, raw, delimiter, columns, drop_missing, bar)
    except ValueError as e:
        hint = _delimiter_hint(text, delimiter)
        if hint is None:
            raise
        raise ValueError(f"{e} {hint}") from None
    finally:
        if bar is not None:
            bar.close()


def _parse_text(path, text, raw, delimiter, columns, drop_missing, bar):
    rows = csv.reader(io.StringIO(text), delimiter=delimiter)
    head = next(((i + 1, row) for i, row in enumerate(rows) if _filled(row)), None)
    if head is None:
        raise ValueError(f"{path} is empty: it holds no rows. Give a file of samples.")
    header, first = head[0], [field.strip() for field in head[1]]
    names = None
    if not all(_is_number(field) or _is_missing(field) for field in first):
        names = tuple(first)
    width = len(first)
    if names is not None and len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ValueError(
            f"{path}: the header names the column {twice!r} twice; rename one."
        )
    picked = _resolve(path, columns, names, width)
    picked_names = None if names is None else tuple(names[j] for j in picked)
    skip = header if names is not None else header - 1
    data = _read_fast(text, raw, delimiter, skip, width, picked, bar)
    if data is not None:
        return data, picked_names, None, 0, None
    # The checking parser, record by record: the first problem, by its line.
    if bar is not None:
        bar.reset()
    data = np.empty((text.count("\n") + 1, len(picked)))
    lines, dropped = [], []
    rows = csv.reader(io.StringIO(text), delimiter=delimiter)
    for i, row in enumerate(rows):
        if bar is not None and i % _PROGRESS_EVERY == _PROGRESS_EVERY - 1:
            bar.update(_PROGRESS_EVERY)
        line = i + 1
        if (names is not None and line == header) or not _filled(row):
            continue
        r = len(lines)
        fields = [field.strip() for field in row]
        if names is not None and tuple(fields) == names:
            raise ValueError(
                f"{path}, line {line} repeats the header line (line 1): were files "
                "concatenated with their headers? Delete the repeated header lines "
                "(or pass the files one by one to `--data`)."
            )
        if len(fields) != width:
            what = "the header" if names is not None else "line 1"
            raise ValueError(
                f"{path}, line {line} has {len(fields)} fields where {what} has "
                f"{width}; every row needs one number per column."
            )
        missing = False
        for k, j in enumerate(picked):
            field = fields[j]
            try:
                data[r, k] = value = float(field)
            except ValueError:
                value = math.nan
                if not _is_missing(field):
                    raise ValueError(
                        f"{path}, line {line} (row {r}), {_column(j, names)} holds "
                        f"{field!r}, which is not a number; columns must be numeric: "
                        "fix the value, or leave the column out with `--columns`."
                    ) from None
            if value != value:  # NaN: a missing value
                if not drop_missing:
                    what = "is empty" if not field else f"holds {field!r}"
                    raise ValueError(
                        f"{path}, line {line} (row {r}), {_column(j, names)} {what}, "
                        f"a missing value; fill it in, or {_DROP}."
                    )
                missing = True
        (dropped if missing else lines).append(line)
    if not lines and not dropped:
        raise ValueError(f"{path} holds a header line but no rows of numbers under it.")
    first = dropped[0] if dropped else None
    return data[: len(lines)], picked_names, lines, len(dropped), first


def _from_array(path: str, x, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.names is not None or not (
        np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)
    ):
        raise ValueError(
            f"{path}{what} holds an array of dtype {x.dtype}; expected numbers "
            "(float or int). Convert it, e.g. `x.astype(np.float64)`."
        )
    if x.ndim != 2:
        raise ValueError(
            f"{path}{what} holds an array of shape {x.shape}; expected a table of "
            "shape (rows, columns). Reshape it, e.g. `x.reshape(-1, 1)` for one column."
        )
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{path}{what} holds an empty array of shape {x.shape}.")
    return x.astype(np.float64)


def _read_npy(path: str, array: str | None):
    try:
        loaded = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ValueError(
            f"{path} is not a NumPy array file of numbers ({e}); save it with "
            "`np.save(path, x)` where x is a float array of shape (rows, columns)."
        ) from None
    if isinstance(loaded, np.ndarray):
        if array is not None:
            raise ValueError(f"{path} is a .npy file of one array; drop `array`.")
        return _from_array(path, loaded, ""), None
    with loaded:
        keys = list(loaded.keys())
        if array is None:
            if len(keys) != 1:
                raise ValueError(
                    f"{path} holds the arrays {keys}; name the one to train on "
                    "(`--array NAME` on the command line)."
                )
            array = keys[0]
        if array not in keys:
            raise ValueError(f"{path} holds no array named {array!r}; it holds {keys}.")
        try:
            x = loaded[array]
        except ValueError as e:
            raise ValueError(f"{path}[{array!r}] cannot be read: {e}") from None
    return _from_array(path, x, f"[{array!r}]"), None


def _read_parquet(path: str, columns):
    try:
        import pandas as pd

        frame = pd.read_parquet(path)
    except ImportError as e:
        raise ValueError(
            f"reading {path} needs pandas with a Parquet engine ({e}): "
            "`pip install pandas pyarrow`, or save the table as .csv or .npy."
        ) from None
    names = tuple(str(c) for c in frame.columns)
    picked = _resolve(path, columns, names, frame.shape[1])
    frame, names = frame.iloc[:, picked], tuple(names[j] for j in picked)
    for j in range(frame.shape[1]):
        column = frame.iloc[:, j]
        if column.dtype.kind not in "fiu":
            values = pd.to_numeric(column, errors="coerce")
            bad = np.flatnonzero(values.isna() & column.notna())
            row = int(bad[0]) if bad.size else 0
            raise ValueError(
                f"{path}, {_column(j, names)} has dtype {column.dtype} (row {row} "
                f"holds {column.iloc[row]!r}); columns must be numeric: convert it, "
                "or leave it out with `--columns`."
            )
    if frame.shape[0] == 0 or frame.shape[1] == 0:
        raise ValueError(f"{path} holds an empty table of shape {frame.shape}.")
    return frame.to_numpy(dtype=np.float64, na_value=np.nan), names


def _resolve(path, columns, names, width) -> list[int]:
    """The 0-based positions of the columns picked by `columns` (header names or
    positions); all of them for `None`."""
    if columns is None:
        return list(range(width))
    picked = []
    for c in columns:
        if names is not None and str(c) in names:
            picked.append(names.index(str(c)))
            continue
        try:
            j = int(c)
        except (TypeError, ValueError):
            known = f"its columns are {list(names)}" if names else "it has no header"
            raise ValueError(
                f"{path} has no column named {c!r}; {known}. Pick columns by name or "
                "by 0-based position."
            ) from None
        if not 0 <= j < width:
            raise ValueError(
                f"{path} has {width} columns (positions 0 to {width - 1}); column "
                f"{j} does not exist."
            )
        picked.append(j)
    if len(set(picked)) != len(picked):
        raise ValueError(f"the columns {list(columns)} pick one column twice.")
    if not picked:
        raise ValueError("`columns` is empty; pick at least one column.")
    return picked


def _check_finite(path, data, names, lines, drop_missing: bool):
    """`(data, dropped, first_row)`: `data` without the rows holding NaN (a missing
    value) where `drop_missing`, their number and the first one's index; a
    `ValueError` naming the first row holding inf, or NaN without `drop_missing`."""
    nan = np.isnan(data)
    missing = nan.any(axis=1)
    inf = np.isinf(data)
    if drop_missing:
        inf &= ~missing[:, None]  # a row with NaN is dropped, whatever else it holds
    bad = inf if drop_missing else inf | nan
    if bad.any():
        r = int(np.flatnonzero(bad.any(axis=1))[0])
        j = int(np.flatnonzero(bad[r])[0])
        where = f"row {r}" + (f" (line {lines[r]})" if lines else "")
        if nan[r, j]:
            raise ValueError(
                f"{path} has {missing.sum()} row(s) with a missing value (NaN); the "
                f"first is {where}, {_column(j, names)}. Impute them, or {_DROP}."
            )
        raise ValueError(
            f"{path} has {inf.any(axis=1).sum()} row(s) with inf; the first is "
            f"{where}, {_column(j, names)} = {data[r, j].item()!r}. Correct or remove "
            "those rows: dropping missing values drops NaN, not infinite values."
        )
    if not (drop_missing and missing.any()):
        return data, 0, None
    return data[~missing], int(missing.sum()), int(np.flatnonzero(missing)[0])


def _read_one(path: str, columns, array, drop_missing: bool):
    """`(data, names, dropped, first_dropped)` of one file (see `Table`)."""
    if os.path.isdir(path):
        raise ValueError(
            f"{path} is a directory, not a data file: give a file ending in one of "
            f"{', '.join(TABLE_FORMATS)}; for MAF's UCI sets and MNIST, their name "
            "and the directory (`--data NAME --data-dir DIR` on the command line)."
        )
    ext = os.path.splitext(path)[1].lower()
    if ext not in TABLE_FORMATS:
        raise ValueError(
            f"{path}: cannot read files of type {ext or '(no extension)'!r}; give a "
            f"file ending in one of {', '.join(TABLE_FORMATS)}."
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist.")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path} is empty (0 bytes): it holds no rows.")
    if array is not None and ext != ".npz":
        raise ValueError(f"`array` names an array of a .npz file; {path} is {ext}.")
    lines, dropped, first = None, 0, None
    if ext in _DELIMITERS:
        read = _read_text(path, _DELIMITERS[ext], columns, drop_missing)
        data, names, lines, dropped, first = read
        first = None if first is None else f"line {first}"
    elif ext == ".parquet":
        data, names = _read_parquet(path, columns)
    else:
        data, names = _read_npy(path, array)
        data = data[:, _resolve(path, columns, None, data.shape[1])]
    n = data.shape[0] + dropped
    data, nan_rows, row = _check_finite(path, data, names, lines, drop_missing)
    if row is not None:  # NaN in an array (a text file's parser drops its own)
        dropped, first = nan_rows, f"row {row}"
    if data.shape[0] == 0:
        raise ValueError(
            f"{path}: every one of its {n} rows has a missing value in the chosen "
            f"columns (the first at {first}), so none is left to train on. Fill them "
            "in, or pick other columns (`--columns`)."
        )
    return data, names, dropped, first


def read_table(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    columns: Sequence[str | int] | None = None,
    array: str | None = None,
    drop_missing: bool = False,
) -> Table:
    """Reads a table of samples (one row per sample, one numeric column per
    coordinate) from one file or several, checking every value.

    **Arguments:**

    - `paths`: a file, or several files whose rows are stacked in order; each ends
        in `.npy`, `.npz`, `.csv`, `.tsv` or `.parquet` (Parquet needs pandas with
        pyarrow or fastparquet). A text file's first line is a header when one of
        its fields is not a number.
    - `columns`: the columns to keep, by header name or 0-based position; all by
        default.
    - `array`: for `.npz` files, the name of the array (needed when a file holds
        several).
    - `drop_missing`: drop the rows with a missing value in the chosen columns,
        instead of refusing the file: in a text file, a cell that is empty or reads
        `NA`, `N/A`, `#N/A`, `<NA>`, `NaN`, `null`, `None` or `?` (in any case,
        blanks around it aside); NaN in an array or a Parquet file, and Parquet's
        nulls. inf is not missing: it is refused either way, and so is text.

    **Returns:**

    A [`Table`][cnftrace.datasets.Table]: the float64 data, column names, paths,
    SHA-256 of each file, rows per file and, per file, the rows dropped and where
    the first of them was.

    A `ValueError` names the file, the row (and line) or column, and the fix, for an
    empty file, text where a number should be, a field missing from a line, a header
    line repeated further down, a missing value (without `drop_missing`; with it,
    a file whose every row has one), inf, files with different columns, a text
    file not in UTF-8 (a byte-order mark is dropped), or a directory; where the lines
    of a text file look separated by `;` or tabs (a .csv) or commas (a .tsv), its
    error says so. A text file of `PROGRESS_BYTES` (32 MiB) or more shows the
    progress of its parsing on stderr.

    !!! example

        ```python
        from cnftrace.datasets import read_table

        with open("points.csv", "w") as f:
            f.write("x,y,label\\n1.0,2.0,0\\n3.0,4.5,1\\n")
        table = read_table("points.csv", columns=["x", "y"])
        print(table.data.shape, table.names)  # (2, 2) ('x', 'y')
        ```
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = tuple(os.fspath(p) for p in paths)
    if not paths:
        raise ValueError("`paths` is empty; give at least one data file.")
    if columns is not None and isinstance(columns, str):
        columns = [c.strip() for c in columns.split(",")]
    parts, first_names, dropped, first_dropped = [], None, [], []
    for i, path in enumerate(paths):
        data, names, n, first = _read_one(path, columns, array, drop_missing)
        dropped.append(n)
        first_dropped.append(first)
        if i == 0:
            first_names = names
        elif data.shape[1] != parts[0].shape[1]:
            raise ValueError(
                f"{path} has {data.shape[1]} columns but {paths[0]} has "
                f"{parts[0].shape[1]}: every file must hold the same columns. Pick "
                "the same ones with `--columns`."
            )
        elif names is not None and first_names is not None and names != first_names:
            raise ValueError(
                f"{path} has the columns {list(names)} but {paths[0]} has "
                f"{list(first_names)}: every file must hold the same columns."
            )
        parts.append(data)
    return Table(
        data=np.concatenate(parts),
        names=first_names,
        paths=paths,
        sha256=tuple(file_sha256(p) for p in paths),
        rows=tuple(p.shape[0] for p in parts),
        dropped=tuple(dropped),
        first_dropped=tuple(first_dropped),
    )


def _split_sizes(n: int, val_fraction: float, test_fraction: float):
    n_test = int(round(test_fraction * n))
    n_val = int(round(val_fraction * n))
    return n - n_val - n_test, n_val, n_test


def _min_rows(val_fraction: float, test_fraction: float) -> int:
    n = 1
    while True:
        n_train, n_val, n_test = _split_sizes(n, val_fraction, test_fraction)
        # Two of each: a validation or test NLL comes with its standard error.
        if n_train >= 2 and n_test >= 2 and (n_val >= 2 or val_fraction == 0):
            return n
        n += 1


def split_table(
    data: np.ndarray,
    *,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    seed: int = 0,
    name: str = "data",
) -> Splits:
    """A fixed train/validation/test split of the rows of `data`: a permutation drawn
    from `seed` (`numpy.random.default_rng(seed)`), then `round(test_fraction * n)`
    test rows, `round(val_fraction * n)` validation rows, and the rest for training.
    The same `data` and `seed` always give the same split.

    **Arguments:**

    - `data`: the samples, shape `(n, dim)`.
    - `val_fraction`: the share of validation rows, in `[0, 1)` (0: none).
    - `test_fraction`: the share of test rows, in `(0, 1)`.
    - `seed`: picks the permutation.
    - `name`: what to call `data` in an error (a file name, say).

    **Returns:**

    [`Splits`][cnftrace.datasets.Splits]`(train, val, test)`. A `ValueError` says how
    many rows the fractions need when `data` has too few (two training rows, two
    test rows and, unless `val_fraction` is 0, two validation rows: a held-out NLL
    comes with its standard error).

    !!! example

        ```python
        import numpy as np
        from cnftrace.datasets import split_table

        train, val, test = split_table(np.arange(40.0).reshape(20, 2), seed=1)
        print(train.shape, val.shape, test.shape)  # (16, 2) (2, 2) (2, 2)
        ```
    """
    for label, value, low_open in (
        ("val_fraction", val_fraction, False),
        ("test_fraction", test_fraction, True),
    ):
        if not (0 < value < 1 if low_open else 0 <= value < 1):
            interval = "(0, 1)" if low_open else "[0, 1)"
            raise ValueError(f"`{label}` must be in {interval}; got {value!r}.")
    if val_fraction + test_fraction >= 1:
        raise ValueError(
            f"`val_fraction` + `test_fraction` = {val_fraction + test_fraction} leaves "
            "no rows for training; make them add up to less than 1."
        )
    data = np.asarray(data)
    n = data.shape[0]
    n_train, n_val, n_test = _split_sizes(n, val_fraction, test_fraction)
    need = _min_rows(val_fraction, test_fraction)
    if n < need:
        raise ValueError(
            f"{name} has {n} row(s); a split with validation fraction {val_fraction} "
            f"and test fraction {test_fraction} needs at least {need} (two to train "
            "on, two to test, two to validate). Add rows, or change the fractions."
        )
    perm = np.random.default_rng(seed).permutation(n)
    test, val, train = np.split(perm, [n_test, n_test + n_val])
    return Splits(data[train], data[val], data[test])
