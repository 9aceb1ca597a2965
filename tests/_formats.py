"""Writers of small synthetic files in the formats of MAF's archive (Zenodo record
1161203, `data.tar.gz`), shared by the loader tests and the experiment smoke tests.

Each writer creates its data set's folder under `root` (a `pathlib.Path`) and returns
what it wrote, so that a test can repeat the preprocessing by hand.
"""

import string

import numpy as np
import pytest


def write_power(root, n: int = 2000, seed: int = 0) -> np.ndarray:
    """8 columns as in MAF's data.npy: active and reactive power, voltage,
    intensity, 3 sub-meterings (integers), time of day in minutes."""
    rng = np.random.default_rng(seed)
    active = rng.gamma(2.0, 0.5, n)
    raw = np.column_stack(
        [
            active,
            rng.gamma(1.0, 0.1, n),
            rng.normal(240.0, 3.0, n),
            4.2 * active + rng.normal(0, 0.1, n),
            rng.integers(0, 40, (n, 3)).astype(np.float64),
            rng.integers(0, 1440, n).astype(np.float64),
        ]
    )
    (root / "power").mkdir(parents=True)
    np.save(root / "power" / "data.npy", raw)
    return raw


GAS_SENSORS = list(string.ascii_uppercase[:16])  # columns A..P after Time, Meth, Eth


def write_gas(root, n: int = 1000):
    """Sensors I..P are near copies (corr > 0.99) of A..H, which MAF's loop must
    drop; B and A are correlated 0.95 only, which it must keep."""
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(1)
    z = rng.normal(size=(n, 8))
    z[:, 1] = 0.95 * z[:, 0] + np.sqrt(1 - 0.95**2) * z[:, 1]
    sensors = np.hstack([5.0 * z + 10.0, 3.0 * z + 0.05 * rng.normal(size=(n, 8))])
    frame = pd.DataFrame(sensors, columns=GAS_SENSORS)
    frame.insert(0, "Eth", rng.uniform(0, 20, n))
    frame.insert(0, "Meth", rng.uniform(0, 600, n))
    frame.insert(0, "Time", np.arange(n) * 0.01)
    (root / "gas").mkdir(parents=True)
    frame.to_pickle(root / "gas" / "ethylene_CO.pickle")
    return sensors


def _hepmass_features(rng, n: int) -> np.ndarray:
    """27 features; 0-3 b-tag like {0, 1, 2}, 4 a jet count, 5 clipped at its
    minimum: the 6 with a repeated smallest value. 6 is clipped at its maximum,
    which MAF's rule (count of the smallest value) keeps."""
    x = rng.normal(size=(n, 27))
    x[:, :4] = rng.choice([0.0, 1.0, 2.0], size=(n, 4))
    x[:, 4] = rng.integers(2, 6, n)
    x[:, 5] = np.maximum(x[:, 5], -0.5)
    x[:, 6] = np.minimum(x[:, 6], 0.5)
    return x


def write_hepmass(root, n_train: int = 600, n_test: int = 300, test_cols=None):
    """`1000_train.csv` and `1000_test.csv` with a header line and the label first;
    the test file has the trailing mass column of the real one (`test_cols` cuts
    the test file to that many columns). Returns the two tables as read back."""
    rng = np.random.default_rng(2)
    names = ["# label"] + [f"f{i}" for i in range(27)]
    (root / "hepmass").mkdir(parents=True)
    frames = {}
    for split, n in (("train", n_train), ("test", n_test)):
        label = rng.integers(0, 2, n).astype(np.float64)
        table = np.column_stack([label, _hepmass_features(rng, n)])
        header = names
        if split == "test":  # the real test file has a trailing mass column
            table = np.column_stack([table, np.full(n, 1000.0)])
            header = names + ["mass"]
        if test_cols is not None and split == "test":
            table, header = table[:, :test_cols], header[:test_cols]
        np.savetxt(
            root / "hepmass" / f"1000_{split}.csv",
            table,
            delimiter=",",
            fmt="%.8g",
            header=",".join(header),
            comments="",
        )
        frames[split] = np.loadtxt(
            root / "hepmass" / f"1000_{split}.csv", delimiter=",", skiprows=1
        )
    return frames


def write_miniboone(root, n: int = 1000) -> np.ndarray:
    """MAF's cleaned `miniboone/data.npy`: 43 positive, skewed columns."""
    rng = np.random.default_rng(3)
    raw = rng.lognormal(size=(n, 43)) * rng.uniform(1, 100, 43)
    (root / "miniboone").mkdir(parents=True)
    np.save(root / "miniboone" / "data.npy", raw)
    return raw


def write_bsds300(root, sizes=(50, 10, 20)) -> dict[str, np.ndarray]:
    """`BSDS300/BSDS300.hdf5` with float32 datasets `train`, `validation`, `test` of
    63-D patches (`sizes` rows each)."""
    h5py = pytest.importorskip("h5py")
    rng = np.random.default_rng(4)
    names = ("train", "validation", "test")
    parts = {
        k: rng.normal(size=(n, 63)).astype(np.float32) for k, n in zip(names, sizes)
    }
    (root / "BSDS300").mkdir(parents=True)
    with h5py.File(root / "BSDS300" / "BSDS300.hdf5", "w") as f:
        for k, v in parts.items():
            f.create_dataset(k, data=v)
    return parts


WRITERS = {
    "power": write_power,
    "gas": write_gas,
    "hepmass": write_hepmass,
    "miniboone": write_miniboone,
    "bsds300": write_bsds300,
}
