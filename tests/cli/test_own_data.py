"""Your own data, end to end: a file trained on the command line, evaluated
and sampled in its own units, opened in Python; every data set listed; bad files
refused before anything is written.

Training here is flow matching on tiny models (little to compile), and every run has
the same shapes, so the compiled programs are shared between the runs of the file.
"""

import json
import os
import shutil

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.scipy.linalg import expm

import cnftrace
from cnftrace.cli import main
from cnftrace.datasets import file_source, read_table, split_table, write_idx

TINY = ["--steps", "2", "--width", "4", "--depth", "1", "--batch-size", "16"]
TINY += ["--checkpoint-every", "2", "--rtol", "1e-3", "--atol", "1e-3"]
TINY += ["--objective", "fm", "--no-progress"]
N_ROWS = 60


def _table(n=N_ROWS, seed=0) -> np.ndarray:
    """Three correlated columns on very different scales and offsets."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 3)) @ np.array([[1.0, 0.5, 0.0], [0, 1, 0.3], [0, 0, 1]])
    return z * [2.0, 50.0, 0.01] + [10.0, -300.0, 0.5]


def _write(path, x: np.ndarray, header="a,b,c") -> str:
    path = str(path)
    ext = os.path.splitext(path)[1]
    if ext == ".npy":
        np.save(path, x)
    elif ext == ".npz":
        np.savez(path, samples=x, labels=np.arange(len(x)))
    else:
        sep = "\t" if ext == ".tsv" else ","
        head = "" if header is None else header.replace(",", sep)
        np.savetxt(path, x, delimiter=sep, header=head, comments="", fmt="%.17g")
    return path


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory):
    """One run on a CSV file with a text column left out by `--columns`."""
    root = tmp_path_factory.mktemp("own")
    x = _table()
    path = root / "measurements.csv"
    with open(path, "w") as f:
        f.write("a,site,b,c\n")
        for row in x:
            f.write(f"{row[0]:.17g},north,{row[1]:.17g},{row[2]:.17g}\n")
    run = str(root / "run")
    args = ["train", "--data", str(path), "--columns", "a,b,c", "--run-dir", run]
    assert main([*args, *TINY]) == 0
    return run, str(path), x


def test_csv_run_evaluates_samples_and_loads_in_data_units(csv_run, capsys):
    run, path, x = csv_run
    with open(os.path.join(run, "config.json")) as f:
        data_file = json.load(f)["data_file"]
    assert data_file["names"] == ["a", "b", "c"] and data_file["rows"] == [N_ROWS]
    assert data_file["sha256"][0] == read_table(path, columns="a,b,c").sha256[0]

    assert main(["eval", run]) == 0
    with open(os.path.join(run, "eval.json")) as f:
        result = json.load(f)
    assert result["n"] == 6 and result["units"] == "data"  # 10% of 60 rows
    assert np.isfinite(result["test_nll"]) and np.isfinite(
        result["gaussian_baseline_nll"]
    )

    # The loaded flow is in the data's units: its log_prob is the standardised
    # flow's minus the log scale, and eval reported exactly that.
    flow, info = cnftrace.load(run, return_info=True)
    assert isinstance(flow, cnftrace.StandardizedFlow)
    std = info["transform"]
    source = file_source(path, columns=["a", "b", "c"])
    test = source.test(0, 0)
    np.testing.assert_allclose(std.scale, source.standardization.scale)
    inner = cnftrace.log_prob_batched(flow.flow, std.forward(test))
    outer = cnftrace.log_prob_batched(flow, jnp.asarray(test))
    np.testing.assert_allclose(outer, inner - np.sum(np.log(std.scale)), rtol=1e-10)
    assert result["test_nll"] == pytest.approx(-outer.mean(), rel=1e-6)

    # (`plot` on a data file runs in the docs' page on your own data.)
    out_csv = os.path.join(run, "s.csv")
    assert main(["sample", run, "--n", "7", "--out", out_csv]) == 0
    with open(out_csv) as f:
        assert f.readline().strip() == "a,b,c"  # the data's column names
    table = read_table(out_csv)
    assert table.data.shape == (7, 3) and np.isfinite(table.data).all()
    with pytest.raises(SystemExit, match=r"\.npy, \.csv or \.tsv"):
        main(["sample", run, "--out", os.path.join(run, "s.txt")])


@pytest.mark.parametrize("ext", [".npy", ".npz", ".tsv", ".parquet"])
def test_each_format_round_trips(ext, csv_run, tmp_path):
    x = _table()
    if ext == ".parquet":
        pd = pytest.importorskip("pandas")
        path = str(tmp_path / "data.parquet")
        try:
            pd.DataFrame(x, columns=["a", "b", "c"]).to_parquet(path)
        except ImportError:  # no Parquet engine: the error says what to install
            open(path, "wb").write(b"PAR1")
            with pytest.raises(SystemExit, match="needs pandas with a Parquet engine"):
                main(["train", "--data", path, "--run-dir", str(tmp_path / "r")])
            assert not os.path.exists(tmp_path / "r")
            return
    else:
        path = _write(tmp_path / f"data{ext}", x)
    run = str(tmp_path / "run")
    extra = ["--array", "samples"] if ext == ".npz" else []
    assert main(["train", "--data", path, "--run-dir", run, *extra, *TINY]) == 0
    assert main(["eval", run]) == 0
    assert main(["sample", run, "--n", "3"]) == 0
    assert np.load(os.path.join(run, "samples.npy")).shape == (3, 3)
    flow = cnftrace.load(run)
    # The same rows split the same way as the CSV run: the same standardisation.
    reference = cnftrace.load(csv_run[0], return_info=True)[1]["transform"]
    np.testing.assert_allclose(flow.standardization.mean, reference.mean)
    test = file_source(path, array="samples" if ext == ".npz" else None).test(0, 0)
    assert np.isfinite(cnftrace.log_prob_batched(flow, test)).all()


def test_the_split_is_fixed_by_its_seed():
    x = _table()
    a, b = split_table(x, seed=3), split_table(x, seed=3)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    c = split_table(x, seed=4)
    assert not np.array_equal(a.test, c.test)
    assert [len(s) for s in a] == [48, 6, 6]
    # Every row in exactly one split.
    rows = np.concatenate(a)
    np.testing.assert_array_equal(np.sort(rows, axis=0), np.sort(x, axis=0))


class _Linear(eqx.Module):
    a: jnp.ndarray

    def __call__(self, t, z, args):
        return self.a @ z


def test_standardisation_is_undone_exactly_on_a_linear_flow():
    """A linear field `dz/dt = A z` maps data to `z = expm(A t1) y`: every density
    and sample is known in closed form, in standardised and in data units."""
    a = jnp.array([[0.3, -0.4], [0.2, -0.1]])
    t1 = 0.5
    inner = cnftrace.CNF(_Linear(a), 2, t1=t1, rtol=1e-8, atol=1e-8)
    mean, scale = np.array([10.0, -300.0]), np.array([2.0, 50.0])
    flow = cnftrace.StandardizedFlow(inner, cnftrace.Standardization(mean, scale))
    m = np.asarray(expm(a * t1))
    x = np.array([[11.0, -250.0], [7.0, -310.0], [10.0, -300.0]])
    z = ((x - mean) / scale) @ m.T
    want = (
        -0.5 * np.sum(z**2, axis=1)
        - np.log(2 * np.pi)
        + np.trace(np.asarray(a)) * t1
        - np.sum(np.log(scale))
    )
    np.testing.assert_allclose(flow.log_prob(jnp.asarray(x)), want, rtol=1e-6)
    # Samples: exactly the base noise mapped back, x = mean + scale expm(-A t1) z,
    # so their mean and covariance are the data's.
    samples = np.asarray(flow.sample(jr.key(0), 10_000))
    noise = np.asarray(jr.normal(jr.key(0), (10_000, 2)))
    b = np.linalg.inv(m) * scale[:, None]
    np.testing.assert_allclose(samples, mean + noise @ b.T, rtol=1e-6)
    np.testing.assert_allclose((samples.mean(axis=0) - mean) / scale, 0, atol=0.03)
    np.testing.assert_allclose(
        np.cov(samples.T) / np.outer(scale, scale),
        (b @ b.T) / np.outer(scale, scale),
        atol=0.05,
    )


BAD_FILES = {
    "nan": (
        "a,b\n1,2\n3,nan\n5,6\n",
        r"line 3 \(row 1\), column 1 \('b'\) holds 'nan', a missing value; .*"
        r"\(`--drop-missing`",
    ),
    "inf": ("a,b\n1,2\n3,4\n5,inf\n", r"row 2 \(line 4\), column 1 \('b'\) = inf\."),
    "text": ("a,b\n1,2\n3,oops\n", r"line 3 \(row 1\), column 1 \('b'\) holds 'oops'"),
    "empty": ("", r"is empty"),
    "header only": ("a,b\n", r"a header line but no rows"),
    "repeated header": ("a,b\n1,2\na,b\n3,4\n", r"line 3 repeats the header"),
    "ragged": ("a,b\n1,2\n3\n", r"line 3 has 1 fields where the header has 2"),
    "one row": ("a,b\n1,2\n", r"has 1 row\(s\).*needs at least"),
    "constant": (
        "a,b\n" + "".join(f"{i},7\n" for i in range(20)),
        r"column 1 \('b'\) is constant over the \d+ training rows \(always 7\.0\)"
        r".*Leave it out with `--columns`",
    ),
}


def test_a_constant_coordinate_is_named_with_its_value():
    data = np.stack([np.arange(5.0), np.full(5, 2.5)], axis=1)
    with pytest.raises(
        ValueError,
        match=r"column 1 of `x` is constant \(it takes the value 2\.5 in all 5 rows\)",
    ):
        cnftrace.Standardization.from_data(data, name="x")


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_files_never_half_train(case, tmp_path):
    text, message = BAD_FILES[case]
    path = tmp_path / "bad.csv"
    path.write_text(text)
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match=message) as e:
        main(["train", "--data", str(path), "--run-dir", str(run), *TINY])
    assert str(path) in str(e.value)  # the message names the file
    assert not run.exists()  # nothing written, no checkpoint


def test_files_with_different_columns_are_refused(tmp_path):
    one = _write(tmp_path / "one.csv", _table())
    two = _write(tmp_path / "two.csv", _table()[:, :2], header="a,b")
    run = tmp_path / "run"
    with pytest.raises(SystemExit, match="two.csv has 2 columns but .*one.csv has 3"):
        main(["train", "--data", one, two, "--run-dir", str(run), *TINY])
    assert not run.exists()
    # Files with the same columns are stacked (the same file twice is refused).
    three = _write(tmp_path / "three.csv", _table()[::-1])
    assert read_table([one, three]).data.shape == (2 * N_ROWS, 3)


def test_a_changed_data_file_is_refused(csv_run, tmp_path):
    run, _, x = csv_run
    path = _write(tmp_path / "data.csv", x)
    copy = str(tmp_path / "run")
    assert main(["train", "--data", path, "--run-dir", copy, *TINY]) == 0
    with open(path, "a") as f:
        f.write("1,2,3\n")
    with pytest.raises(SystemExit, match=r"data.csv \(SHA-256 .* now\)"):
        main(["train", "--data", path, "--run-dir", copy, *TINY])
    with pytest.raises(SystemExit, match="has changed since training"):
        main(["eval", copy])
    assert main(["sample", copy, "--n", "2"]) == 0  # sampling needs no data


def test_data_dir_sets_are_listed_and_train_by_name(tmp_path, capsys):
    root = tmp_path / "data"
    (root / "power").mkdir(parents=True)
    rng = np.random.default_rng(0)
    np.save(root / "power" / "data.npy", rng.random((300, 8)))
    write_idx(root / "train-images-idx3-ubyte", np.zeros((4, 28, 28), np.uint8))
    assert main(["datasets", "--data-dir", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    power = next(line for line in lines if line.startswith("power"))
    assert "found" in power and " 6 " in power
    mnist = next(line for line in lines if line.startswith("mnist"))
    assert "missing" in mnist and "train-labels-idx1-ubyte" in mnist

    run = str(tmp_path / "run")
    args = ["train", "--data", "power", "--data-dir", str(root), "--run-dir", run]
    with pytest.raises(SystemExit, match="pass --data-dir DIR"):
        main(args[:3] + args[5:] + TINY)
    assert main([*args, *TINY]) == 0
    assert cnftrace.load(run).event_shape == (6,)
    args[-1] = str(tmp_path / "again")
    np.save(root / "power" / "data.npy", np.zeros((3, 2)))  # now malformed
    with pytest.raises(SystemExit, match=r"power/data.npy.*Zenodo"):
        main([*args, *TINY])
    shutil.rmtree(root / "power")
    with pytest.raises(SystemExit, match=r"power/data.npy.*not found.*Zenodo"):
        main([*args, *TINY])
    assert not os.path.exists(args[-1])
