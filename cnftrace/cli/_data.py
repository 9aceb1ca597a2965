"""The command line's data: the source a run trains on (a built-in set, a set from
`--data-dir`, or the user's files, with what pins them), the list of `cnftrace
datasets`, and samples written to a file."""

import dataclasses
import difflib
import io
import os
import warnings

import numpy as np

from .._io import atomic_write
from ..datasets import (
    MNIST_FILES,
    TABULAR_DATASETS,
    TOY_DATASETS,
    UCI_DATASETS,
    UCI_DIMS,
    UCI_FILES,
    DataSource,
    data_source,
    file_source,
    load_digits,
    load_tabular,
    toy_entropy,
    toy_entropy_is_exact,
)
from ..datasets._files import FORMATS_SHOWN, SPREADSHEETS, data_format, file_sha256
from ..datasets._sources import ALL_DATASETS, DIRECTORY_DATASETS, mnist_root
from ..runs import RunConfig
from ._checks import CommandFailed, UsageError, warnings_said


def _is_name(data) -> bool:
    return isinstance(data, str) and data in ALL_DATASETS + DIRECTORY_DATASETS


def _data_error(data) -> UsageError:
    shown = data if isinstance(data, str) else " ".join(data)
    names = ALL_DATASETS + DIRECTORY_DATASETS
    close = difflib.get_close_matches(shown, names, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    return UsageError(
        f"--data {shown}: not a data set name nor a data file.{hint} Give one of "
        f"{', '.join(names)} (the last six with "
        f"--data-dir DIR; `cnftrace datasets` lists them), or the path of a file "
        f"ending in {FORMATS_SHOWN}."
    )


def _directory_error(path: str) -> UsageError:
    found = sorted(f for f in os.listdir(path) if data_format(f) is not None)
    holds = f" (it holds {', '.join(found[:3])}{', ...' if found[3:] else ''})"
    return UsageError(
        f"--data {path} is a directory{holds if found else ''}: give a data file "
        f"(ending in {FORMATS_SHOWN}), or several; for MAF's UCI sets and "
        f"MNIST, the set's name with the directory: --data NAME --data-dir {path}."
    )


def eval_size(source: DataSource, n: int | None) -> int:
    """The number of test samples `cnftrace eval --n N` scores: N (by default all
    the rows of a fixed test split, else 5000); a `UsageError` past a split's size."""
    if not source.fixed_test:
        return 5000 if n is None else n
    size = source.test(0, None).shape[0]
    if n is not None and n > size:
        raise UsageError(
            f"--n {n} asks for more test rows than the {size} rows of the test split "
            f"of {source.name}: give --n {size} or fewer, or leave --n out to score "
            "them all."
        )
    return size if n is None else n


def training_source(config: RunConfig) -> tuple[DataSource, dict]:
    """The data source of `cnftrace train` and the settings that pin it in the run's
    config (`data`, `data_file`, `data_dir`). Every file is read and checked here,
    before anything is written; what the reading notes goes to stderr."""
    data = config.data
    if _is_name(data):
        directory = None
        if data in DIRECTORY_DATASETS:
            if config.data_dir is None:
                raise UsageError(
                    f"--data {data} is read from a directory: pass --data-dir DIR "
                    "(`cnftrace datasets --data-dir DIR` lists what it finds there)."
                )
            directory = os.path.abspath(config.data_dir)
        source = data_source(data, data_dir=directory)
        return source, {"data": data, "data_file": None, "data_dir": directory}
    paths = [data] if isinstance(data, str) else list(data)
    for path in paths:
        if path == "-":
            raise UsageError(
                "--data - (standard input) cannot be read: a run reads its data file "
                "again for `eval` and `plot`, pinned by its SHA-256. Save the data to "
                "a file (e.g. `... > data.csv`) and give --data data.csv."
            )
        if os.path.isdir(path):
            raise _directory_error(path)
        if data_format(path) is None and not path.lower().endswith(SPREADSHEETS):
            raise _data_error(data)
    paths = [os.path.abspath(p) for p in paths]
    columns = None  # stripped of blanks, as `eval` and `plot` find them again
    if config.columns is not None:
        columns = [c.strip() for c in config.columns.split(",")]
    with warnings_said():  # what the reading notes (a first line of numbers, say)
        source = file_source(
            paths,
            columns=columns,
            array=config.array,
            val_fraction=config.val_fraction,
            test_fraction=config.test_fraction,
            seed=config.split_seed,
            standardize=not config.no_standardize,
            drop_missing=config.drop_missing,
            header=HEADERS[config.header],
            dequantize=config.dequantize,
        )
    if config.drop_missing:
        print(_dropped_line(source.table), flush=True)
    if config.dequantize:
        print(_dequantized_line(source.grid, source.table.names), flush=True)
    shown = paths[0] if len(paths) == 1 else tuple(paths)
    return source, {"data": shown, "data_file": source.data_file, "data_dir": None}


# `--header` as `read_table`'s `header`.
HEADERS = {"auto": None, "yes": True, "no": False}


def _dequantized_line(grid: np.ndarray, names) -> str:
    """`cnftrace: dequantizing 2 of 4 columns on a grid: age (step 1), ...`."""
    on = [j for j, g in enumerate(grid) if not np.isnan(g)]
    shown = [f"{names[j] if names else f'column {j}'} (step {grid[j]:.6g})" for j in on]
    return (
        f"cnftrace: dequantizing {len(on)} of {len(grid)} columns on a grid: "
        + ", ".join(shown)
    )


def _dropped_line(table) -> str:
    """`cnftrace: dropped 12 of 400 rows with missing values in FILE (first: line
    7)`; for several files, their total, then each file that had some."""
    total = sum(table.dropped)
    read = sum(table.rows) + total
    each = [
        f"{n} of {rows + n} in {path} (first: {first})"
        for path, rows, n, first in zip(
            table.paths, table.rows, table.dropped, table.first_dropped
        )
        if n
    ]
    if len(table.paths) == 1:
        where = table.paths[0] + (
            f" (first: {table.first_dropped[0]})" if total else ""
        )
    else:
        where = f"{len(table.paths)} files" + (f": {', '.join(each)}" if each else "")
    return f"cnftrace: dropped {total} of {read} rows with missing values in {where}"


def as_pinned(config: RunConfig, old: RunConfig | None) -> RunConfig:
    """`config` with the column names as the run already in its directory (`old`)
    stored them, where they are the same names: a run that stored `--columns 'x, y'`
    as `["x", " y"]` resumes, its checkpoints holding that record."""
    if old is None or old.data_file is None or config.data_file is None:
        return config
    there, now = old.data_file, config.data_file
    same = there.settings()["columns"] == now.settings()["columns"]
    if there.columns is None or not same:
        return config
    pinned = dataclasses.replace(now, columns=there.columns)
    return dataclasses.replace(config, data_file=pinned)


def run_source(config: RunConfig) -> DataSource:
    """The data source of a trained run, for `eval` and `plot`: a file's rows split
    again as in training, after checking that the file is the one trained on."""
    pinned = config.data_file
    if pinned is None:
        return data_source(config.data, data_dir=config.data_dir)
    for path, sha in zip(pinned.paths, pinned.sha256):
        if not os.path.isfile(path):
            raise CommandFailed(
                f"the run's data file {path} is gone; put it back to evaluate or plot "
                "the run (`cnftrace sample` and `cnftrace.load` work without it)."
            )
        _check_unchanged(path, sha, file_sha256(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what reading it notes was said in training
        source = pinned.read()
    # The bytes read are the ones trained on (the file may change in between).
    for path, sha, now in zip(pinned.paths, pinned.sha256, source.table.sha256):
        _check_unchanged(path, sha, now)
    return source


def _check_unchanged(path: str, sha: str, now: str) -> None:
    if now != sha:
        raise CommandFailed(
            f"the run's data file {path} has changed since training (SHA-256 "
            f"{sha[:12]}... then, {now[:12]}... now), so its test split would not "
            "be the run's. Restore the file, or train a new run on it."
        )


def write_samples(path: str, x: np.ndarray, names=None) -> None:
    """Writes samples atomically as `.npy`, or as `.csv`/`.tsv` (one row per sample,
    flattened, under a header of the data's column names where known)."""
    ext = os.path.splitext(path)[1].lower()
    buffer = io.BytesIO()
    if ext == ".npy":
        np.save(buffer, x)
    else:
        rows = x.reshape(x.shape[0], -1)
        header = ""
        if names is not None and len(names) == rows.shape[1]:
            header = _DELIMITER[ext].join(names)
        text = io.StringIO()
        digits = 17 if rows.dtype == np.float64 else 9  # enough to read back exactly
        np.savetxt(
            text, rows, fmt=f"%.{digits}g", delimiter=_DELIMITER[ext],
            header=header, comments="",
        )  # fmt: skip
        buffer.write(text.getvalue().encode())
    atomic_write(path, buffer.getvalue())


_DELIMITER = {".csv": ",", ".tsv": "\t"}


def list_datasets(data_dir: str | None) -> list[tuple[str, ...]]:
    """The rows of `cnftrace datasets`: name, dimension, size, entropy and what it
    is, for every built-in set and, with `data_dir`, the sets found there."""
    rows = []
    for name in TOY_DATASETS:
        kind = "exact" if toy_entropy_is_exact(name) else "numerical estimate"
        rows.append(
            (name, "2", "unlimited", f"{toy_entropy(name):.4f}", f"toy 2-D ({kind})")
        )
    for name in TABULAR_DATASETS:
        splits = load_tabular(name)
        n = sum(len(s) for s in splits)
        dim = splits.train.shape[1]
        rows.append((name, str(dim), str(n), "-", "scikit-learn table, standardised"))
    n = sum(len(s) for s in load_digits())
    rows.append(("digits", "64", str(n), "-", "scikit-learn 8x8 digits, 17 levels"))
    if data_dir is None:
        return rows
    for name in UCI_DATASETS:
        files = [os.path.join(data_dir, *parts) for parts in UCI_FILES[name]]
        missing = [p for p in files if not os.path.isfile(p)]
        status = f"missing {missing[0]}" if missing else "found"
        rows.append((name, str(UCI_DIMS[name]), "-", "-", f"MAF's UCI set: {status}"))
    root = mnist_root(data_dir)
    missing = [
        os.path.join(root, f)
        for f in MNIST_FILES
        if not any(os.path.isfile(os.path.join(root, f + gz)) for gz in ("", ".gz"))
    ]
    status = f"missing {missing[0]}" if missing else f"found in {root}"
    rows.append(("mnist", "784", "-", "-", f"MNIST IDX files: {status}"))
    return rows
