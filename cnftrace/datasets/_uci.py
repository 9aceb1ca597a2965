"""The five tabular sets of MAF and FFJORD, read from MAF's archive and preprocessed
as github.com/gpapamak/maf does (each set's steps: docs/tabular.md)."""

import os
from collections.abc import Callable

import numpy as np

from ._real import Splits

UCI_DATASETS = ("power", "gas", "hepmass", "miniboone", "bsds300")
UCI_DIMS = {"power": 6, "gas": 8, "hepmass": 21, "miniboone": 43, "bsds300": 63}
# The files each set is read from, under `root`.
UCI_FILES = {
    "power": [("power", "data.npy")],
    "gas": [("gas", "ethylene_CO.pickle")],
    "hepmass": [("hepmass", "1000_train.csv"), ("hepmass", "1000_test.csv")],
    "miniboone": [("miniboone", "data.npy")],
    "bsds300": [("BSDS300", "BSDS300.hdf5")],
}

_SOURCE = (
    "Get MAF's preprocessed data from Zenodo, record 1161203 "
    "(https://zenodo.org/records/1161203, file data.tar.gz; the files FFJORD uses), "
    "unpack it and pass as `root` the folder holding power/, gas/, hepmass/, "
    "miniboone/ and BSDS300/, so that e.g. root/power/data.npy, "
    "root/gas/ethylene_CO.pickle, root/hepmass/1000_train.csv, "
    "root/hepmass/1000_test.csv, root/miniboone/data.npy and "
    "root/BSDS300/BSDS300.hdf5 exist."
)


def _path(root, *parts: str) -> str:
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"data directory {root!r} does not exist. {_SOURCE}")
    path = os.path.join(root, *parts)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"expected the file {path!r}, not found. {_SOURCE}")
    return path


def _split_tail(x: np.ndarray, frac: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(head, tail): the tail is the last `int(frac * n)` rows, as in MAF."""
    cut = x.shape[0] - int(frac * x.shape[0])
    return x[:cut], x[cut:]


def _maf_split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rest, test = _split_tail(x)
    train, val = _split_tail(rest)
    return train, val, test


def _standardise(x: np.ndarray, ddof: int, *others: np.ndarray) -> list[np.ndarray]:
    """Standardise `x` and `others` with the mean and std of `x`."""
    mean = x.mean(axis=0)
    std = x.std(axis=0, ddof=ddof)
    std = np.where(std > 0, std, 1.0)
    return [(a - mean) / std for a in (x, *others)]


def _as_2d(x: np.ndarray, path: str, n_cols: int | None = None) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or (n_cols is not None and x.shape[1] != n_cols):
        want = f"(n, {n_cols})" if n_cols is not None else "a 2-D array"
        raise ValueError(
            f"{path!r} holds an array of shape {x.shape}; expected {want}."
        )
    return x


def _power(root) -> tuple[np.ndarray, ...]:
    path = _path(root, "power", "data.npy")
    x = _as_2d(np.load(path), path, 8)
    rng = np.random.RandomState(42)  # MAF's generator: same shuffle, same noise
    rng.shuffle(x)
    x = np.delete(x, [1, 3], axis=1)  # reactive power and intensity
    n = x.shape[0]
    voltage = 0.01 * rng.rand(n, 1)  # drawn in MAF's order: voltage first
    active = 0.001 * rng.rand(n, 1)
    metering = rng.rand(n, 3)
    x = x + np.hstack([active, voltage, metering, np.zeros((n, 1))])
    train, val, test = _maf_split(x)
    trval, test = _standardise(np.vstack([train, val]), 0, test)
    return trval[: len(train)], trval[len(train) :], test


def _read_gas_pickle(path: str):
    try:
        import pandas as pd
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("GAS is a pandas pickle: `pip install pandas`.") from e
    try:
        return pd.read_pickle(path)
    except Exception as e:
        raise ValueError(
            f"could not unpickle {path!r} with pandas {pd.__version__} ({e!r}). MAF's "
            "pickle was written by pandas < 2: re-save it there, e.g. as CSV, or "
            "unpickle it with pandas < 2 and `df.to_pickle` it again."
        ) from e


def _gas(root) -> tuple[np.ndarray, ...]:
    path = _path(root, "gas", "ethylene_CO.pickle")
    frame = _read_gas_pickle(path)
    names = [str(c) for c in frame.columns]
    missing = {"Meth", "Eth", "Time"} - set(names)
    if missing:
        raise ValueError(f"{path!r} lacks the columns {sorted(missing)}; has {names}.")
    keep = [i for i, c in enumerate(names) if c not in ("Meth", "Eth", "Time")]
    x = _as_2d(frame.iloc[:, keep].to_numpy(dtype=np.float64), path)
    while True:  # drop the first column correlated > 0.98 with another, repeat
        with np.errstate(invalid="ignore", divide="ignore"):
            corr = np.corrcoef(x, rowvar=False).reshape(x.shape[1], x.shape[1])
        n_high = (corr > 0.98).sum(axis=1)
        if not np.any(n_high > 1):
            break
        x = np.delete(x, int(np.flatnonzero(n_high > 1)[0]), axis=1)
    (x,) = _standardise(x, 1)
    return _maf_split(x)


def _read_csv(path: str) -> np.ndarray:
    """A numeric CSV with one header line; fields past the header's are ignored
    (as pandas' `index_col=False`, which MAF uses, does)."""
    with open(path) as f:
        n_cols = len(f.readline().split(","))
        x = np.loadtxt(f, delimiter=",", usecols=range(n_cols), comments=None, ndmin=2)
    return _as_2d(x, path)


def _hepmass(root) -> tuple[np.ndarray, ...]:
    train_path = _path(root, "hepmass", "1000_train.csv")
    test_path = _path(root, "hepmass", "1000_test.csv")
    trval, test = _read_csv(train_path), _read_csv(test_path)
    trval = trval[trval[:, 0] == 1][:, 1:]  # signal rows, label dropped
    test = test[test[:, 0] == 1][:, 1:-1]  # ... and MAF drops the last column too
    if trval.shape[1] != test.shape[1]:
        raise ValueError(
            f"{test_path!r} should have one column more than {train_path!r} "
            f"(MAF drops it); after dropping it has {test.shape[1]} features, "
            f"the train file {trval.shape[1]}."
        )
    trval, test = _standardise(trval, 1, test)
    n_min = (trval == trval.min(axis=0)).sum(axis=0)  # MAF's Counter rule
    keep = n_min <= 5
    train, val = _split_tail(trval[:, keep])
    return train, val, test[:, keep]


def _miniboone(root) -> tuple[np.ndarray, ...]:
    path = _path(root, "miniboone", "data.npy")
    train, val, test = _maf_split(_as_2d(np.load(path), path))
    trval, test = _standardise(np.vstack([train, val]), 0, test)
    return trval[: len(train)], trval[len(train) :], test


def _bsds300(root) -> tuple[np.ndarray, ...]:
    path = _path(root, "BSDS300", "BSDS300.hdf5")
    try:
        import h5py
    except ImportError as e:
        raise ImportError("BSDS300 is an HDF5 file: `pip install h5py`.") from e
    with h5py.File(path, "r") as f:
        missing = [k for k in ("train", "validation", "test") if k not in f]
        if missing:
            raise ValueError(f"{path!r} lacks the datasets {missing}.")
        return tuple(_as_2d(f[k][:], path) for k in ("train", "validation", "test"))


_LOADERS: dict[str, Callable] = {
    "power": _power,
    "gas": _gas,
    "hepmass": _hepmass,
    "miniboone": _miniboone,
    "bsds300": _bsds300,
}


def load_uci(name: str, root: str | os.PathLike, dtype=np.float64) -> Splits:
    """Loads one of the five tabular sets of MAF and FFJORD, preprocessed and split
    as MAF does (docs/tabular.md). Nothing is downloaded.

    **Arguments:**

    - `name`: one of `UCI_DATASETS`: `"power"` (6-D), `"gas"` (8-D), `"hepmass"`
        (21-D), `"miniboone"` (43-D) or `"bsds300"` (63-D).
    - `root`: the unpacked `data/` folder of MAF's archive (Zenodo record 1161203,
        file `data.tar.gz`). It holds `power/data.npy`, `gas/ethylene_CO.pickle`,
        `hepmass/1000_train.csv` and `1000_test.csv`, `miniboone/data.npy` and
        `BSDS300/BSDS300.hdf5`.
    - `dtype`: the floating dtype of the returned arrays; float64 by default (MAF
        trains in float32).

    **Returns:**

    [`Splits`][cnftrace.datasets.Splits]`(train, val, test)`, each of shape
    `(n, UCI_DIMS[name])`.

    Raises `ValueError` for an unknown `name` or a file with unexpected contents,
    and `FileNotFoundError` if `root` or the set's file is missing (the message says
    where to get it). GAS needs pandas, BSDS300 needs h5py.

    !!! example

        ```python
        import os

        import numpy as np

        from cnftrace.datasets import load_uci

        # A tiny stand-in for MAF's POWER file: 100 rows of 8 columns.
        os.makedirs("data/power")
        np.save("data/power/data.npy", np.random.default_rng(0).random((100, 8)))

        train, val, test = load_uci("power", "data", dtype=np.float32)
        print(train.shape, val.shape, test.shape)  # (81, 6) (9, 6) (10, 6)
        ```
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown UCI data set {name!r}; choose from {UCI_DATASETS}.")
    train, val, test = _LOADERS[name](root)
    return Splits(*(np.ascontiguousarray(a, dtype=dtype) for a in (train, val, test)))
