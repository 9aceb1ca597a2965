"""A user's own table of samples, read from files (see
[`read_table`][cnftrace.datasets.read_table]). Each file is read once, as bytes,
so its SHA-256 is that of the bytes parsed."""

import bz2
import gzip
import hashlib
import io
import lzma
import os
import zipfile
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ._text import DROP, column_name, read_text, resolve_columns

TABLE_FORMATS = (".csv", ".tsv", ".npy", ".npz", ".parquet")
# Compressions of a .csv, .tsv or .npy (`points.csv.gz`), read as the inner file.
COMPRESSIONS = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
_COMPRESSIBLE = (".csv", ".tsv", ".npy")
# What the messages list.
FORMATS_SHOWN = (
    ".csv, .tsv, .npy, .npz, .parquet (.csv, .tsv and .npy also as .gz, .bz2 or "
    ".xz), or a .zip holding one of them"
)
_DELIMITERS = {".csv": ",", ".tsv": "\t"}
SPREADSHEETS = (".xlsx", ".xlsm", ".xls", ".ods", ".numbers")
# The first bytes of the formats a data file may be, and their extension.
_MAGIC = (
    (b"\x1f\x8b", "gzip-compressed", ".gz"),
    (b"BZh", "bzip2-compressed", ".bz2"),
    (b"\xfd7zXZ\x00", "xz-compressed", ".xz"),
    (b"PK\x03\x04", "a zip archive", ".zip"),
    (b"PK\x05\x06", "an empty zip archive", ".zip"),
    (b"\x93NUMPY", "a NumPy array file", ".npy"),
    (b"PAR1", "a Parquet file", ".parquet"),
    (b"\xd0\xcf\x11\xe0", "an old-format Office file (Excel's .xls?)", ".xls"),
)


class Table(NamedTuple):
    """The samples of one or more files, as
    [`read_table`][cnftrace.datasets.read_table] returns them.

    - `data`: a float64 array `(n, dim)`, the files' rows one after another.
    - `names`: the column names, or `None`.
    - `paths`: the files read, in order.
    - `sha256`: the SHA-256 of each file's bytes.
    - `rows`: the number of rows each file gave.
    - `dropped`: the rows of each file dropped for a missing value.
    - `first_dropped`: where each file's first dropped row was (`"line 7"`,
        `"row 6"`), or `None`.
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


def _read_npy(path: str, raw: bytes, array: str | None):
    try:
        loaded = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, EOFError, OSError, zipfile.BadZipFile) as e:
        if "allow_pickle" in str(e) or "pickled" in str(e):
            # NumPy's advice (load it with allow_pickle=True) would run the file's
            # code: a file of numbers holds no Python objects.
            raise ValueError(
                f"{path} holds Python objects (a pickle), not an array of numbers; it "
                "is not read. Save the numbers with `np.save(path, x)` where x is a "
                "float array of shape (rows, columns)."
            ) from None
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


def _read_parquet(path: str, raw: bytes, columns):
    try:
        import pandas as pd

        frame = pd.read_parquet(io.BytesIO(raw))
    except ImportError as e:
        raise ValueError(
            f"reading {path} needs pandas with a Parquet engine ({e}): "
            "`pip install pandas pyarrow`, or save the table as .csv or .npy."
        ) from None
    names = tuple(str(c) for c in frame.columns)
    picked = resolve_columns(path, columns, names, frame.shape[1])
    frame, names = frame.iloc[:, picked], tuple(names[j] for j in picked)
    for j in range(frame.shape[1]):
        column = frame.iloc[:, j]
        if column.dtype.kind not in "fiu":
            values = pd.to_numeric(column, errors="coerce")
            bad = np.flatnonzero(values.isna() & column.notna())
            row = int(bad[0]) if bad.size else 0
            raise ValueError(
                f"{path}, {column_name(j, names)} has dtype {column.dtype} (row {row} "
                f"holds {column.iloc[row]!r}); columns must be numeric: convert it, "
                "or leave it out with `--columns`."
            )
    if frame.shape[0] == 0 or frame.shape[1] == 0:
        raise ValueError(f"{path} holds an empty table of shape {frame.shape}.")
    return frame.to_numpy(dtype=np.float64, na_value=np.nan), names


def data_format(path: str) -> tuple[str, str | None] | None:
    """`(format, compression)` of a data file by its name (`(".csv", ".gz")` for
    `x.csv.gz`); `None` for a name of no format read here."""
    name = os.path.basename(os.fspath(path)).lower()
    root, ext = os.path.splitext(name)
    if ext in COMPRESSIONS:
        inner = os.path.splitext(root)[1]
        return (inner, ext) if inner in _COMPRESSIBLE else None
    if ext == ".zip":
        return None, ".zip"
    return (ext, None) if ext in TABLE_FORMATS else None


def _sniffed(raw: bytes) -> tuple[str, str] | None:
    """What the first bytes of a file say it is, and the extension for that."""
    for magic, what, ext in _MAGIC:
        if raw.startswith(magic) and (ext != ".bz2" or raw[3:4].isdigit()):
            if ext == ".zip" and _is_spreadsheet(raw):
                return "an Excel or OpenDocument spreadsheet", ".xlsx"
            return what, ext
    return None


def _is_spreadsheet(raw: bytes) -> bool:
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return False
    return any(n.startswith(("xl/", "content.xml", "Index/")) for n in names)


def _check_kind(path: str, raw: bytes, ext: str) -> None:
    """Raises `ValueError` where a file's bytes are of another kind than its name
    says."""
    found = _sniffed(raw)
    wanted = {".npy": ".npy", ".npz": ".zip", ".parquet": ".parquet"}.get(ext)
    if wanted is None:  # text: no binary format's first bytes
        if found is None:
            return
        what, right = found
        fix = f"rename it to end in {ext}{right}" if right in COMPRESSIONS else ""
        fix = fix or f"give it the extension of its format ({right})"
        if right == ".xlsx":
            fix = "save it as CSV (in Excel: File > Save As > 'CSV UTF-8')"
        raise ValueError(f"{path} is {what}, not {ext} text: {fix}.")
    if found is not None and found[1] == wanted:
        return
    if found is not None:
        what = found[0]
    else:
        try:
            raw[:4096].decode("utf-8")
            first = raw.split(b"\n", 1)[0][:60].decode("utf-8", errors="replace")
            what = f"text (its first line reads {first!r}): a table of text?"
            what += " Give it the extension .csv (or .tsv)"
        except UnicodeDecodeError:
            what = "of no format read here"
    name = {".npy": "a NumPy .npy file", ".npz": "a NumPy .npz archive"}.get(ext)
    name = name or "a Parquet file"
    raise ValueError(f"{path} is not {name}: it is {what}.")


def _contents(path: str, raw: bytes, compression: str | None):
    """`(where, bytes, format)` of the table a file holds, decompressed or taken
    from its archive; `where` names it in messages."""
    if compression is None:
        return path, raw, data_format(path)[0]
    if compression == ".zip":
        found = _sniffed(raw)
        if found is None or found[1] != ".zip":
            what = found[0] if found else "not a zip archive"
            raise ValueError(f"{path} ends in .zip but is {what}.")
        try:
            return _zipped_table(path, raw)
        except (zipfile.BadZipFile, RuntimeError, NotImplementedError, EOFError) as e:
            raise ValueError(
                f"{path} cannot be read as a zip archive ({e}): it is damaged, cut "
                "short or encrypted; unzip it and give the table."
            ) from None
    magic = {".gz": b"\x1f\x8b", ".bz2": b"BZh", ".xz": b"\xfd7zXZ\x00"}[compression]
    if not raw.startswith(magic):
        found = _sniffed(raw)
        what = found[0] if found else "not compressed"
        raise ValueError(
            f"{path} ends in {compression} but is {what}: rename it to the extension "
            f"of its format{f' ({found[1]})' if found else ''}."
        )
    try:
        inner = COMPRESSIONS[compression](raw)
    except (OSError, EOFError, ValueError, lzma.LZMAError) as e:
        raise ValueError(
            f"{path} cannot be decompressed ({e}): it is damaged or cut short; "
            "compress it again, or give the table uncompressed."
        ) from None
    return path, inner, data_format(path)[0]


def _zipped_table(path: str, raw: bytes):
    """`_contents` of a `.zip` archive: its one table, folders and dot files
    aside."""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        files = [
            info
            for info in z.infolist()
            if not info.is_dir()
            and not info.filename.startswith("__MACOSX/")
            and not os.path.basename(info.filename).startswith(".")
        ]
        tables = [
            i for i in files if (data_format(i.filename) or (None, ""))[1] is None
        ]
        if len(tables) != 1:
            held = ", ".join(i.filename for i in (tables or files)[:5]) or "nothing"
            raise ValueError(
                f"{path} holds {len(tables)} data tables where one is read (it holds "
                f"{held}): unzip it and give the table to train on (several tables: "
                "each to --data)."
            )
        inner = z.read(tables[0])
    name = tables[0].filename
    return f"{path} ({name})", inner, data_format(name)[0]


def _check_finite(path, data, names, lines, drop_missing: bool):
    """`(data, dropped, first_row)`: `data` less its NaN rows with `drop_missing`;
    raises `ValueError` naming the first row holding inf (or NaN without it)."""
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
                f"first is {where}, {column_name(j, names)}. Impute them, or {DROP}."
            )
        raise ValueError(
            f"{path} has {inf.any(axis=1).sum()} row(s) with inf; the first is "
            f"{where}, {column_name(j, names)} = {data[r, j].item()!r}. Correct or "
            "remove those rows: dropping missing values drops NaN, not infinite values."
        )
    if not (drop_missing and missing.any()):
        return data, 0, None
    return data[~missing], int(missing.sum()), int(np.flatnonzero(missing)[0])


def _read_bytes(path: str) -> bytes:
    """The bytes of a data file, after the checks of its name."""
    if path == "-":
        raise ValueError(
            "- (standard input) cannot be read as data: a run reads its data file "
            "again for `eval` and `plot`, pinned by its SHA-256. Save the data to a "
            "file (e.g. `... > data.csv`) and give its path."
        )
    if os.path.isdir(path):
        raise ValueError(
            f"{path} is a directory, not a data file: give a file ending in "
            f"{FORMATS_SHOWN}; for MAF's UCI sets and MNIST, their name and the "
            "directory (`--data NAME --data-dir DIR` on the command line)."
        )
    ext = os.path.splitext(path)[1].lower()
    if ext in SPREADSHEETS:
        raise ValueError(
            f"{path} is a spreadsheet, which is not read: save it as CSV (in Excel: "
            "File > Save As > 'CSV UTF-8'), and give the .csv file."
        )
    if data_format(path) is None:
        raise ValueError(
            f"{path}: cannot read files of type {ext or '(no extension)'!r}; give a "
            f"file ending in {FORMATS_SHOWN}."
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist.")
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise ValueError(f"{path} is empty (0 bytes): it holds no rows.")
    return raw


def _read_one(path: str, raw: bytes, columns, array, drop_missing: bool, header):
    """`(data, names, dropped, first_dropped)` of one file's bytes (see `Table`)."""
    where, raw, ext = _contents(path, raw, data_format(path)[1])
    _check_kind(where, raw, ext)
    if array is not None and ext != ".npz":
        raise ValueError(f"`array` names an array of a .npz file; {where} is {ext}.")
    if header is not None and ext not in _DELIMITERS:
        raise ValueError(
            f"`header` (--header) says whether a text file's first line names its "
            f"columns; {where} is {ext}, which has no header line: drop it."
        )
    lines, dropped, first = None, 0, None
    if ext in _DELIMITERS:
        read = read_text(where, raw, _DELIMITERS[ext], columns, drop_missing, header)
        data, names, lines, dropped, first = read
        first = None if first is None else f"line {first}"
    elif ext == ".parquet":
        data, names = _read_parquet(where, raw, columns)
    else:
        data, names = _read_npy(where, raw, array)
        data = data[:, resolve_columns(where, columns, None, data.shape[1])]
    n = data.shape[0] + dropped
    data, nan_rows, row = _check_finite(where, data, names, lines, drop_missing)
    if row is not None:  # NaN in an array (a text file's parser drops its own)
        dropped, first = nan_rows, f"row {row}"
    if data.shape[0] == 0:
        raise ValueError(
            f"{where}: every one of its {n} rows has a missing value in the chosen "
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
    header: bool | None = None,
) -> Table:
    """Reads a table of samples (one row per sample, one numeric column per
    coordinate) from one file or several, checking every value.

    **Arguments:**

    - `paths`: a file, or several whose rows are stacked in order: `.npy`, `.npz`,
        `.csv`, `.tsv` or `.parquet`, text and `.npy` optionally compressed (`.gz`,
        `.bz2`, `.xz`), or a `.zip` holding one such table (docs/own-data.md lists
        the details). The same bytes given twice are refused.
    - `columns`: the columns to keep, by header name or 0-based position; all by
        default, less a last column empty on every line.
    - `array`: for `.npz` files, the name of the array.
    - `drop_missing`: drop the rows with a missing value (an empty cell, `NA`,
        `NaN`, `null`, ...) in the chosen columns instead of refusing the file.
    - `header`: whether a text file's first line names its columns; `None`: when
        one of its fields is not a number.

    Returns a [`Table`][cnftrace.datasets.Table]. A `ValueError` names the file,
    the row or column, and the fix, for anything not a table of finite numbers.

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
    parts, first_names, dropped, first_dropped, sha256 = [], None, [], [], []
    seen: dict[str, str] = {}
    for i, path in enumerate(paths):
        real = os.path.realpath(path)
        if real in seen:
            both = "" if seen[real] == path else f" (as {seen[real]} and {path})"
            raise ValueError(
                f"{path} is given twice{both}: its rows would be stacked twice, and "
                "test rows trained on. Give each file once."
            )
        seen[real] = path
        raw = _read_bytes(path)
        sha256.append(hashlib.sha256(raw).hexdigest())
        if sha256[-1] in sha256[:-1]:
            other = paths[sha256.index(sha256[-1])]
            raise ValueError(
                f"{path} and {other} hold the same bytes (SHA-256 "
                f"{sha256[-1][:12]}...): their rows would be stacked twice, and test "
                "rows trained on. Give each table once."
            )
        data, names, n, first = _read_one(
            path, raw, columns, array, drop_missing, header
        )
        del raw
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
        sha256=tuple(sha256),
        rows=tuple(p.shape[0] for p in parts),
        dropped=tuple(dropped),
        first_dropped=tuple(first_dropped),
    )
