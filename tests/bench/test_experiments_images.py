"""The image reproduction scripts run end to end in their smoke settings: the digits
script on scikit-learn's digits, the MNIST script on a tiny IDX set in the real
format."""

import importlib.util
import json
import math
import os

import numpy as np
import pytest
from _paths import EXPERIMENTS

from cnftrace.datasets import write_idx
from cnftrace.datasets._mnist import MNIST_FILES


def _script(name):
    path = os.path.join(EXPERIMENTS, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_outputs(out, stem, payload):
    for ext in ("json", "md", "png"):
        assert os.path.getsize(os.path.join(out, f"{stem}.{ext}")) > 0
    with open(os.path.join(out, f"{stem}.json")) as f:
        saved = json.load(f)
    assert saved["test_bits_per_dim"] == pytest.approx(payload["test_bits_per_dim"])
    with open(os.path.join(out, f"{stem}.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    return saved


@pytest.mark.slow  # compiles a training step, validation, evaluation and sampling
def test_digits_quick(tmp_path, capsys):
    payload = _script("ffjord_digits").main(["--quick", "--out", str(tmp_path)])
    saved = _check_outputs(tmp_path, "ffjord_digits", payload)
    for key in ("test_bits_per_dim", "test_bits_per_dim_stderr", "eval_nfe"):
        assert math.isfinite(saved[key]) and saved[key] > 0
    # The Gaussian baseline is far below the uniform 4.09 bits/dim on these data.
    assert 1.0 < saved["gaussian_baseline_bits_per_dim"] < math.log2(17)
    printed = capsys.readouterr().out
    assert "| full-covariance Gaussian |" in printed
    assert "| multiscale CNF (this run) |" in printed


@pytest.mark.slow  # compiles a training step, evaluation and sampling
def test_mnist_quick_on_tiny_idx_files(tmp_path, capsys):
    rng = np.random.default_rng(0)
    data = tmp_path / "mnist"
    data.mkdir()
    suffix = ".gz"  # gzipped, as MNIST is distributed
    for name, n in ((MNIST_FILES[0], 16), (MNIST_FILES[2], 8)):
        images = np.zeros((n, 8, 8), np.uint8)
        images[:, 2:6, 3:5] = rng.integers(128, 256, (n, 4, 2))  # a bright stroke
        write_idx(data / (name + suffix), images)
    write_idx(data / (MNIST_FILES[1] + suffix), rng.integers(0, 10, 16, np.uint8))
    write_idx(data / (MNIST_FILES[3] + suffix), rng.integers(0, 10, 8, np.uint8))
    out = tmp_path / "out"
    payload = _script("ffjord_mnist").main(
        ["--data-dir", str(data), "--quick", "--out", str(out)]
    )
    saved = _check_outputs(out, "ffjord_mnist", payload)
    assert saved["n_test"] == 8 and math.isfinite(saved["test_bits_per_dim"])
    assert saved["published_bits_per_dim"] == 0.99
    assert "| multiscale CNF (FFJORD settings) |" in capsys.readouterr().out
