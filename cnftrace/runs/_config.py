"""A run directory's settings (`config.json`): which keys define a run, and reading
them back."""

import json

from .._io import FileKindError, read_regular_file
from ..training import CheckpointError


# Settings that define the model and the optimisation; a checkpoint written under other
# values of these is refused on resume.
MODEL_KEYS = (
    "data", "blocks", "width", "depth", "activation", "t1", "solver", "rtol", "atol",
    "lr", "batch_size", "estimator", "num_probes", "seed", "clip", "steps",
    "kinetic_energy", "jacobian_norm", "learn_t1", "objective", "fm_sigma", "field",
    "train_tol", "data_file", "data_dir", "patience",
)  # fmt: skip
# Values of settings added after a run's config may have been written.
LATER_KEYS = {
    "kinetic_energy": 0.0,
    "jacobian_norm": 0.0,
    "learn_t1": False,
    "objective": "mle",
    "fm_sigma": 0.0,
    # Runs written before MLPField became the default trained FFJORD's ConcatSquash
    # field at the flow's own tolerance.
    "field": "concatsquash",
    "train_tol": None,
    # Runs on built-in data sets: no file, no directory, no early stopping.
    "data_file": None,
    "data_dir": None,
    "patience": None,
}


def with_defaults(config: dict) -> dict:
    return {**LATER_KEYS, **config}


def read_config(path: str) -> dict:
    """A run's `config.json` with the settings added since filled in, or a
    `CheckpointError` saying what is wrong with it."""
    try:
        text = read_regular_file(path, limit=2**20).decode()
        config = json.loads(text)
    except FileKindError as e:
        raise CheckpointError(str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not a JSON settings file ({e}); restore it, or start a new "
            "run directory."
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} does not hold a JSON object of settings.")
    config = with_defaults(config)
    missing = [k for k in MODEL_KEYS if k not in config]
    if missing:
        raise CheckpointError(
            f"{path} lacks the settings {', '.join(missing)}; restore it, or start a "
            "new run directory."
        )
    return config
