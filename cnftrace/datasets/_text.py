"""Delimited text tables (`.csv`, `.tsv`, and the same compressed): their bytes
decoded (UTF-8, a byte-order mark dropped), their header found, their columns picked
and every field checked. NumPy's C parser reads a file where every row is numbers;
otherwise, and to name any problem, a checking parser reads it record by record,
naming the line each record starts on (a quoted field may hold a newline)."""

import codecs
import csv
import io
import math
import os
import sys
import warnings

import numpy as np
from tqdm.auto import tqdm

from .._checks import is_int, parse_float, parse_int

# Text files of at least this many bytes show the progress of their parsing on
# stderr (2 million rows of three numbers take about 120 MB, and 2 s to parse).
PROGRESS_BYTES = 32 * 2**20
_PROGRESS_EVERY = 2**16  # rows between updates of the progress bar
# What a missing value reads in a text file, once stripped and lower-cased.
_MISSING = frozenset(("", "na", "n/a", "#n/a", "<na>", "nan", "null", "none", "?"))
DROP = "drop the rows with missing values (`--drop-missing`; `drop_missing=True` "
DROP += "in Python)"


def is_number(field: str) -> bool:
    return parse_float(field) is not None


def is_missing(field: str) -> bool:
    """Whether a stripped field of a text file is a missing value."""
    value = parse_float(field)
    return field.lower() in _MISSING or (value is not None and math.isnan(value))


def column_name(j: int, names) -> str:
    return f"column {j} ({names[j]!r})" if names else f"column {j}"


def _where(raw: bytes, at: int) -> str:
    """`line L, column C` of byte `at` of a file (lines from 1, columns in
    characters from 1)."""
    line = raw.count(b"\n", 0, at) + 1
    start = raw.rfind(b"\n", 0, at) + 1
    column = len(raw[start:at].decode("utf-8-sig", errors="replace")) + 1
    return f"line {line}, column {column}"


def decode(path: str, raw: bytes) -> str:
    """The text of a file's bytes, read as UTF-8 (a byte-order mark dropped), or a
    `ValueError` naming the encoding where it is recognisably another (UTF-16 or
    UTF-32 with their byte-order marks, UTF-16 without one), the first NUL byte of a
    file that is not text, or the line and column of the first byte that is not
    UTF-8."""
    boms = (
        (codecs.BOM_UTF32_LE, "UTF-32", "utf-32"),
        (codecs.BOM_UTF32_BE, "UTF-32", "utf-32"),
        (codecs.BOM_UTF16_LE, "UTF-16", "utf-16"),
        (codecs.BOM_UTF16_BE, "UTF-16", "utf-16"),
    )
    for bom, name, code in boms:
        if raw.startswith(bom):
            raise ValueError(
                f"{path} is {name} text (it begins with {name}'s byte-order mark, as "
                "Excel's 'Unicode Text' saves it), not UTF-8. Save it as UTF-8 (Excel: "
                f"'CSV UTF-8'), or convert it, e.g. `iconv -f {code} -t utf-8 {path}`."
            )
    nul = raw.find(b"\x00")
    if nul >= 0:
        head = raw[:4096]
        if head[1::2].count(0) > len(head) // 4 or head[0::2].count(0) > len(head) // 4:
            raise ValueError(
                f"{path}, {_where(raw, nul)}: a NUL byte, every other byte: the file "
                "looks like UTF-16 text without a byte-order mark, not UTF-8. Save it "
                f"as UTF-8, or convert it, e.g. `iconv -f utf-16le -t utf-8 {path}`."
            )
        raise ValueError(
            f"{path}, {_where(raw, nul)}: a NUL byte, which text does not hold: the "
            "file is not a text table (a binary file named .csv or .tsv?). Give the "
            "table as text, or with the extension of its format."
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        at = e.start + (3 if raw.startswith(codecs.BOM_UTF8) else 0)
        raise ValueError(
            f"{path}, {_where(raw, at)}: byte 0x{raw[at]:02x} is not UTF-8 text, so "
            "the file was saved in another encoding (Latin-1 or Windows-1252, "
            "perhaps). Save it as UTF-8 (Excel: 'CSV UTF-8'), or convert it, e.g. "
            f"`iconv -f latin1 -t utf-8 {path}`."
        ) from None
    if "\r" in text and "\n" not in text:
        raise ValueError(
            f"{path}, line 1: its lines end in a carriage return alone (old Mac OS "
            "line endings), so the whole file is one line. Convert them to newlines, "
            f"e.g. `tr '\\r' '\\n' < {path} > fixed{os.path.splitext(path)[1]}`."
        )
    return text


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
    names the problem. It accepts less than that parser, never more (it takes no
    `_` in a number, nor digits other than ASCII's), and reads the same values,
    four to five times faster."""
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


class _Records:
    """The records of a text file with the line each starts on (from 1): a quoted
    field may hold a newline, so the n-th record is not always on line n. A record
    the csv module cannot parse (a carriage return alone inside a line) is a
    `ValueError` naming its line."""

    def __init__(self, path: str, text: str, delimiter: str):
        self.path = path
        self.reader = csv.reader(io.StringIO(text), delimiter=delimiter)

    def __iter__(self):
        end = 0
        while True:
            try:
                row = next(self.reader)
            except StopIteration:
                return
            except csv.Error as e:
                line = self.reader.line_num
                raise ValueError(
                    f"{self.path}, line {line} cannot be read as delimited text ({e}): "
                    "a carriage return alone inside a line? Save the file with one "
                    "kind of line ending (newlines, or carriage return and newline)."
                ) from None
            start, end = end + 1, self.reader.line_num
            yield start, end, row


def resolve_columns(path, columns, names, width) -> list[int]:
    """The 0-based positions of the columns picked by `columns` (header names or
    positions, blanks around them aside); all of them for `None`. A name the header
    gives two columns is refused where it is picked (or all are), since the pick
    would be ambiguous; a repeated name left out is no concern."""
    if columns is None:
        if names is not None and len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(
                f"{path}: the header names the column {twice!r} twice; rename one, "
                "or pick the columns to train on with `--columns`."
            )
        return list(range(width))
    picked = []
    for c in columns:
        name = str(c).strip()
        if names is not None and name in names:
            if names.count(name) > 1:
                at = [j for j, n in enumerate(names) if n == name]
                raise ValueError(
                    f"{path}: the header names the column {name!r} twice (positions "
                    f"{', '.join(map(str, at))}), so the name picks neither; pick it "
                    "by its 0-based position, or rename one."
                )
            picked.append(names.index(name))
            continue
        j = int(c) if is_int(c) else parse_int(name)
        if j is None:
            known = f"its columns are {list(names)}" if names else "it has no header"
            raise ValueError(
                f"{path} has no column named {name!r}; {known}. Pick columns by name "
                "or by 0-based position."
            )
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


def read_text(
    path: str, raw: bytes, delimiter: str, columns, drop_missing: bool, header
):
    """`(data, names, line_of_row, dropped, first_line)` of the picked columns of a
    delimited text file's bytes `raw` (the other columns are not read, so they may
    hold text), without the `dropped` rows with a missing value where
    `drop_missing`, the first on `first_line`. `line_of_row` is `None` where every
    row was read as finite numbers. `header`: whether the first line is a header
    (`None`: where one of its fields is not a number; a first line of numbers alone
    is then read as data, and a warning says so). An error gains a hint where the
    lines look separated by another character than the extension says."""
    text = decode(path, raw)
    bar = _progress(path, len(raw), text)
    try:
        return _parse_text(
            path, text, raw, delimiter, columns, drop_missing, header, bar
        )
    except ValueError as e:
        hint = _delimiter_hint(text, delimiter)
        if hint is None:
            raise
        raise ValueError(f"{e} {hint}") from None
    finally:
        if bar is not None:
            bar.close()


def _empty_last_column(path, text, delimiter, width) -> bool:
    """Whether the last field of every record of a file is empty (Excel ends every
    line with a delimiter when a blank column follows the table): a column without
    any value, left out when all columns are read."""
    return width > 1 and all(
        len(row) == width and not row[-1].strip()
        for _, _, row in _Records(path, text, delimiter)
        if _filled(row)
    )


def _parse_text(path, text, raw, delimiter, columns, drop_missing, header, bar):
    head = next(
        ((s, e, row) for s, e, row in _Records(path, text, delimiter) if _filled(row)),
        None,
    )
    if head is None:
        raise ValueError(f"{path} is empty: it holds no rows. Give a file of samples.")
    header_line, header_end = head[0], head[1]
    first = [field.strip() for field in head[2]]
    width = len(first)
    numbers = all(is_number(field) or is_missing(field) for field in first)
    names = tuple(first) if (not numbers if header is None else header) else None
    if header is None and numbers:
        shown = ", ".join(first[:4]) + (", ..." if width > 4 else "")
        warnings.warn(
            f"{path}: line {header_line} ({shown}) holds only numbers, so it is read "
            "as data, not as a header; if it names the columns, pass --header yes "
            "(`header=True` in Python), or --header no to say it is data.",
            stacklevel=5,  # the caller of `read_table`
        )
    if (
        columns is None
        and not first[-1]
        and _empty_last_column(path, text, delimiter, width)
    ):
        columns = list(range(width - 1))  # a trailing delimiter on every line
    picked = resolve_columns(path, columns, names, width)
    picked_names = None if names is None else tuple(names[j] for j in picked)
    skip = header_end if names is not None else header_line - 1
    data = _read_fast(text, raw, delimiter, skip, width, picked, bar)
    if data is not None:
        return data, picked_names, None, 0, None
    # The checking parser, record by record: the first problem, by its line.
    if bar is not None:
        bar.reset()
    data = np.empty((text.count("\n") + 1, len(picked)))
    lines, dropped = [], []
    for i, (line, _, row) in enumerate(_Records(path, text, delimiter)):
        if bar is not None and i % _PROGRESS_EVERY == _PROGRESS_EVERY - 1:
            bar.update(_PROGRESS_EVERY)
        if (names is not None and line == header_line) or not _filled(row):
            continue
        r = len(lines)
        fields = [field.strip() for field in row]
        if names is not None and tuple(fields) == names:
            raise ValueError(
                f"{path}, line {line} repeats the header line (line {header_line}): "
                "were files concatenated with their headers? Delete the repeated "
                "header lines (or pass the files one by one to `--data`)."
            )
        if len(fields) != width:
            what = "the header" if names is not None else f"line {header_line}"
            raise ValueError(
                f"{path}, line {line} has {len(fields)} fields where {what} has "
                f"{width}; every row needs one number per column."
            )
        missing = False
        for k, j in enumerate(picked):
            field = fields[j]
            value = parse_float(field)
            if value is None:
                value = math.nan
                if not is_missing(field):
                    raise ValueError(
                        f"{path}, line {line} (row {r}), {column_name(j, names)} "
                        f"holds {field!r}, which is not a number{_lenient(field)}; "
                        "columns must be numeric: fix the value, or leave the column "
                        "out with `--columns`."
                    )
            data[r, k] = value
            if value != value:  # NaN: a missing value
                if not drop_missing:
                    what = "is empty" if not field else f"holds {field!r}"
                    raise ValueError(
                        f"{path}, line {line} (row {r}), {column_name(j, names)} "
                        f"{what}, a missing value; fill it in, or {DROP}."
                    )
                missing = True
        (dropped if missing else lines).append(line)
    if not lines and not dropped:
        raise ValueError(f"{path} holds a header line but no rows of numbers under it.")
    first = dropped[0] if dropped else None
    return data[: len(lines)], picked_names, lines, len(dropped), first


def _lenient(field: str) -> str:
    """Why a field that Python's `float` would read is not a number here."""
    try:
        float(field)
    except ValueError:
        return ""
    return (
        " (numbers are written in ASCII digits 0-9, with no digit separators such "
        "as '_' and no other script's digits)"
    )
