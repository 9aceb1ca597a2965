"""MAF's UCI sets and MNIST's IDX files, on small synthetic files in real formats."""

import gzip
import struct

import numpy as np
import pytest
from _formats import (
    write_bsds300,
    write_gas,
    write_hepmass,
    write_miniboone,
    write_power,
)

from cnftrace.datasets._mnist import load_mnist_idx, read_idx, write_idx
from cnftrace.datasets._uci import UCI_DATASETS, UCI_DIMS, load_uci


def _maf_sizes(n: int) -> tuple[int, int, int]:
    n_test = int(0.1 * n)
    n_val = int(0.1 * (n - n_test))
    return n - n_test - n_val, n_val, n_test


def _assert_standardised(x: np.ndarray, ddof: int) -> None:
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=1e-10)
    np.testing.assert_allclose(x.std(axis=0, ddof=ddof), 1.0, rtol=1e-10)


# ---------------------------------------------------------------- POWER


def _maf_power(raw: np.ndarray):
    """MAF's power.py, step by step, for comparison."""
    rng = np.random.RandomState(42)
    data = raw.copy()
    rng.shuffle(data)
    n = data.shape[0]
    data = np.delete(np.delete(data, 3, axis=1), 1, axis=1)
    voltage_noise = 0.01 * rng.rand(n, 1)
    gap_noise = 0.001 * rng.rand(n, 1)
    sm_noise = rng.rand(n, 3)
    data = data + np.hstack([gap_noise, voltage_noise, sm_noise, np.zeros((n, 1))])
    n_test = int(0.1 * n)
    test, data = data[-n_test:], data[:-n_test]
    n_val = int(0.1 * data.shape[0])
    val, train = data[-n_val:], data[:-n_val]
    both = np.vstack([train, val])
    mu, s = both.mean(axis=0), both.std(axis=0)
    return (train - mu) / s, (val - mu) / s, (test - mu) / s


def test_power_matches_maf(tmp_path):
    raw = write_power(tmp_path)
    out = load_uci("power", tmp_path)
    assert [a.shape for a in out] == [(k, 6) for k in _maf_sizes(2000)]
    assert UCI_DIMS["power"] == 6 and out.train.dtype == np.float64
    for got, want in zip(out, _maf_power(raw)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    _assert_standardised(np.vstack([out.train, out.val]), ddof=0)
    again = load_uci("power", tmp_path, dtype=np.float32)
    assert again.test.dtype == np.float32
    np.testing.assert_allclose(again.test, out.test, rtol=1e-6, atol=1e-6)


def test_power_rejects_wrong_column_count(tmp_path):
    (tmp_path / "power").mkdir()
    np.save(tmp_path / "power" / "data.npy", np.zeros((50, 7)))
    with pytest.raises(ValueError, match=r"\(n, 8\)"):
        load_uci("power", tmp_path)


# ---------------------------------------------------------------- GAS


def test_gas_drops_correlated_columns_and_standardises(tmp_path):
    sensors = write_gas(tmp_path)
    out = load_uci("gas", tmp_path)
    assert [a.shape for a in out] == [(k, UCI_DIMS["gas"]) for k in _maf_sizes(1000)]
    kept = sensors[:, 8:]  # A..H went, one at a time; I..P stay
    want = (kept - kept.mean(axis=0)) / kept.std(axis=0, ddof=1)
    np.testing.assert_allclose(np.vstack(out), want, rtol=1e-12, atol=1e-12)
    _assert_standardised(np.vstack(out), ddof=1)
    np.testing.assert_array_equal(np.vstack(load_uci("gas", tmp_path)), np.vstack(out))


def test_gas_needs_its_label_columns(tmp_path):
    pd = pytest.importorskip("pandas")
    (tmp_path / "gas").mkdir()
    pd.DataFrame(np.ones((20, 3)), columns=["Time", "Eth", "A"]).to_pickle(
        tmp_path / "gas" / "ethylene_CO.pickle"
    )
    with pytest.raises(ValueError, match="Meth"):
        load_uci("gas", tmp_path)


# ---------------------------------------------------------------- HEPMASS


def test_hepmass_follows_maf(tmp_path):
    frames = write_hepmass(tmp_path)
    out = load_uci("hepmass", tmp_path)
    train = frames["train"][frames["train"][:, 0] == 1][:, 1:]
    test = frames["test"][frames["test"][:, 0] == 1][:, 1:-1]
    n_val = int(0.1 * len(train))
    assert [a.shape for a in out] == [
        (len(train) - n_val, 21),
        (n_val, 21),
        (len(test), 21),
    ]
    assert UCI_DIMS["hepmass"] == 21
    mu, s = train.mean(axis=0), train.std(axis=0, ddof=1)
    keep = np.arange(6, 27)  # features 0-5 removed, 6 (max clipped) kept
    np.testing.assert_allclose(out.test, ((test - mu) / s)[:, keep], atol=1e-12)
    np.testing.assert_allclose(
        np.vstack([out.train, out.val]), ((train - mu) / s)[:, keep], atol=1e-12
    )
    _assert_standardised(np.vstack([out.train, out.val]), ddof=1)


def test_hepmass_test_file_needs_its_extra_column(tmp_path):
    write_hepmass(tmp_path, test_cols=28)  # no mass column: MAF's drop misaligns
    with pytest.raises(ValueError, match="one column more"):
        load_uci("hepmass", tmp_path)


# ---------------------------------------------------------------- MINIBOONE


def test_miniboone_split_and_standardise(tmp_path):
    raw = write_miniboone(tmp_path, 1000)
    out = load_uci("miniboone", tmp_path)
    sizes = _maf_sizes(1000)
    assert [a.shape for a in out] == [(k, UCI_DIMS["miniboone"]) for k in sizes]
    trval = raw[: sizes[0] + sizes[1]]  # no shuffle: the file's order
    mu, s = trval.mean(axis=0), trval.std(axis=0)
    np.testing.assert_allclose(out.test, (raw[-sizes[2] :] - mu) / s, atol=1e-12)
    np.testing.assert_allclose(out.val, (raw[sizes[0] : -sizes[2]] - mu) / s)
    _assert_standardised(np.vstack([out.train, out.val]), ddof=0)


# ---------------------------------------------------------------- BSDS300


def test_bsds300_reads_the_three_datasets(tmp_path):
    parts = write_bsds300(tmp_path, (50, 10, 20))
    out = load_uci("bsds300", tmp_path)
    assert out.train.shape == (50, UCI_DIMS["bsds300"]) and out.val.shape == (10, 63)
    for got, key in zip(out, ("train", "validation", "test")):
        assert got.dtype == np.float64
        np.testing.assert_array_equal(got, parts[key])


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("name", UCI_DATASETS)
def test_missing_files_say_where_to_get_them(tmp_path, name):
    with pytest.raises(FileNotFoundError) as missing_dir:
        load_uci(name, tmp_path / "nowhere")
    assert "nowhere" in str(missing_dir.value)
    with pytest.raises(FileNotFoundError) as missing_file:
        load_uci(name, tmp_path)
    message = str(missing_file.value)
    assert str(tmp_path) in message and "1161203" in message
    assert "data.tar.gz" in message and "root/power/data.npy" in message


def test_unknown_name_lists_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="miniboone"):
        load_uci("higgs", tmp_path)


# ---------------------------------------------------------------- MNIST

_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
_TEST_NAMES = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _write_mnist(root, shape=(28, 28), n=(12, 5), gz=(False, True)):
    rng = np.random.default_rng(5)
    arrays = []
    for names, count, zipped in zip((_NAMES, _TEST_NAMES), n, gz):
        images = rng.integers(0, 256, (count, *shape), dtype=np.uint8)
        labels = rng.integers(0, 10, count, dtype=np.uint8)
        suffix = ".gz" if zipped else ""
        write_idx(root / (names[0] + suffix), images)
        write_idx(root / (names[1] + suffix), labels)
        arrays += [images, labels]
    return arrays


def test_idx_round_trip_plain_and_gzip(tmp_path):
    arrays = _write_mnist(tmp_path)
    out = load_mnist_idx(tmp_path)
    assert [a.shape for a in out] == [(12, 28, 28), (12,), (5, 28, 28), (5,)]
    for got, want in zip(out, arrays):
        assert got.dtype == np.uint8
        np.testing.assert_array_equal(got, want)


def test_idx_header_is_the_real_format(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "x", images)
    raw = (tmp_path / "x").read_bytes()
    assert raw[:16] == struct.pack(">IIII", 2051, 2, 3, 4)
    assert raw[16:] == bytes(range(24))
    write_idx(tmp_path / "y.gz", np.array([7, 1], dtype=np.uint8))
    assert gzip.decompress((tmp_path / "y.gz").read_bytes()) == bytes(
        [0, 0, 8, 1, 0, 0, 0, 2, 7, 1]
    )


def test_idx_other_image_sizes(tmp_path):
    _write_mnist(tmp_path, shape=(7, 5), n=(3, 2), gz=(True, False))
    train_images, _, test_images, _ = load_mnist_idx(tmp_path)
    assert train_images.shape == (3, 7, 5) and test_images.shape == (2, 7, 5)


def test_idx_truncated_and_corrupt_files(tmp_path):
    _write_mnist(tmp_path, gz=(False, False))
    path = tmp_path / _NAMES[0]
    full = path.read_bytes()
    path.write_bytes(full[:-1])
    with pytest.raises(ValueError, match="truncated"):
        load_mnist_idx(tmp_path)
    path.write_bytes(full[:10])
    with pytest.raises(ValueError, match="truncated.*header"):
        load_mnist_idx(tmp_path)
    path.write_bytes(full + b"\0")
    with pytest.raises(ValueError, match="longer than its header"):
        load_mnist_idx(tmp_path)
    path.write_bytes((tmp_path / _NAMES[1]).read_bytes())  # labels as images
    with pytest.raises(ValueError, match="magic number 2049.*expected 2051"):
        load_mnist_idx(tmp_path)
    path.write_bytes(full)
    write_idx(tmp_path / _NAMES[1], np.zeros(11, dtype=np.uint8))
    with pytest.raises(ValueError, match="12 images.*11 labels"):
        load_mnist_idx(tmp_path)
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ValueError, match="gzip"):
        read_idx(tmp_path / "bad.gz")


def test_idx_missing_files_and_bad_dtype(tmp_path):
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte.*MNIST"):
        load_mnist_idx(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist_idx(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="uint8"):
        write_idx(tmp_path / "f", np.zeros(3, dtype=np.float32))
