"""`RunConfig`: the settings of a run of `cnftrace train`, one field each (default,
flag, help, group, range, whether `config.json` stores it: see `_settings.setting`).
The flags, `config.json`, the check on resume and `cnftrace.load` come from it."""

import dataclasses
import json
import math
import os
from typing import Any

from .. import _defaults as defaults
from .._defaults import cli_training, default_width, width_reason
from .._io import FileKindError, read_regular_file
from ..datasets import TABULAR_DATASETS, TOY_DATASETS, UCI_DATASETS, DataFile
from ..datasets._sources import ALL_DATASETS, DIRECTORY_DATASETS
from ..flows import ACTIVATIONS, BASE_KINDS, DEFAULT_ACTIVATION, FIELDS, SOLVERS
from ..objectives import OBJECTIVES
from ..store import CheckpointError
from ..store._checkpoint import same_value
from ._settings import by_data, setting

# Stored settings that describe the others or the run: never compared on resume.
DERIVED = ("recipe", "seconds")
GROUPS = ("data", "model", "training", "run")
# The built-in sets that are tables of rows (a base can be fitted to them).
TABLE_SETS = tuple(TABULAR_DATASETS) + tuple(UCI_DATASETS)


_DATA, _MODEL, _TRAINING, _RUN = GROUPS
# The settings of a data file alone, and what each says given a built-in set.
_FILE_ONLY = {
    "columns": "picks from a data file; --data {data} is a built-in data set.",
    "array": "picks from a data file; --data {data} is a built-in data set.",
    "drop_missing": "reads a data file; --data {data} is a built-in data set, which "
    "has no missing values.",
    "dequantize": "spreads a data file's grid columns; --data {data} is a built-in "
    "data set: give a data file.",
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The settings of a run of `cnftrace train`; a `None` whose default depends on
    the data is filled by `resolved` and `for_data` before the run starts."""

    # The data.
    data: str | tuple[str, ...] = setting(
        "8gaussians",
        _DATA,
        "a built-in data set (`cnftrace datasets` lists them), or one or more files "
        "of samples (.csv, .tsv, .npy, .npz, .parquet; several are stacked)",
        metavar="NAME|FILE",
        nargs="+",
    )
    data_dir: str | None = setting(
        None,
        _DATA,
        "where MAF's UCI sets (power, gas, hepmass, miniboone, bsds300) and MNIST's "
        "files are",
        metavar="DIR",
    )
    columns: str | None = setting(
        None,
        _DATA,
        "the columns of a data file to train on, by header name or 0-based position",
        stored=False,
        shown="all",
        metavar="A,B,...",
    )
    array: str | None = setting(
        None, _DATA, "the array of a .npz file", stored=False, metavar="NAME"
    )
    val_fraction: float = setting(
        defaults.VAL_FRACTION,
        _DATA,
        "share of a data file's rows held out for validation (0: none)",
        stored=False,
        check="fraction",
    )
    test_fraction: float = setting(
        defaults.TEST_FRACTION,
        _DATA,
        "share of a data file's rows held out for `eval`",
        stored=False,
    )
    split_seed: int = setting(
        0, _DATA, "picks a data file's train/validation/test split", stored=False, low=0
    )
    no_standardize: bool = setting(
        False,
        _DATA,
        "train on a data file's values as they are (by default each column is "
        "standardised by its training mean and standard deviation, and `eval`, "
        "`sample` and `cnftrace.load` undo it)",
        stored=False,
    )
    # Pinned in `data_file` (compared on resume), as are header and dequantize.
    drop_missing: bool = setting(
        False,
        _DATA,
        "drop the rows of a data file with a missing value in the chosen columns "
        "(an empty cell, NA, N/A, #N/A, <NA>, NaN, null, None or ?, in any case), "
        "and say how many (by default such a file is refused; inf is never missing)",
        stored=False,
    )
    header: str = setting(
        "auto",
        _DATA,
        "whether the first line of a .csv or .tsv file names its columns: auto (when "
        "one of its fields is not a number), yes (even if all are numbers: years, "
        "wavelengths) or no",
        stored=False,
        choices=["auto", "yes", "no"],
    )
    dequantize: bool = setting(
        False,
        _DATA,
        "spread each column of a data file whose values lie on a grid (counts, "
        "rounded values) over its grid cells with uniform noise, so that the flow "
        "learns a density rather than spikes on the grid; `eval` then also reports "
        "the NLL of the test rows' cells, and `sample` rounds those columns back to "
        "the grid",
        stored=False,
    )
    # What pins a data file (paths, SHA-256, split, standardisation): derived.
    data_file: DataFile | None = setting(None, _DATA, "", flag=False)
    # The model.
    field: str = setting(
        "mlp",
        _MODEL,
        "vector field: an MLP with sinusoidal time features (mlp) or FFJORD's "
        "ConcatSquash layers (concatsquash)",
        choices=list(FIELDS),
    )
    blocks: int = setting(1, _MODEL, "number of CNF blocks", low=1)
    width: int | None = setting(
        None,
        _MODEL,
        "hidden units",
        shown=f"follows the data: {defaults.width_rule()}; for a file, at most "
        f"{defaults.table_width_rule('training rows')}",
        low=1,
        type=int,
    )
    depth: int = setting(defaults.DEPTH, _MODEL, "hidden layers per block", low=0)
    activation: str | None = setting(
        None,
        _MODEL,
        "the field's activation",
        shown="silu for --field mlp, tanh for concatsquash",
        choices=sorted(ACTIVATIONS),
    )
    t1: float = setting(defaults.T1, _MODEL, "integration time", check="positive")
    learn_t1: bool = setting(
        False,
        _MODEL,
        "train the integration time too (FFJORD's train_T), starting at --t1",
    )
    base: str | None = setting(
        None,
        _MODEL,
        "the base distribution, fitted to the training rows (standardised) before "
        "training: a Gaussian mixture with its components chosen by BIC (mixture), "
        "that mixture with Student-t tails (t-mixture), a Student-t per column "
        "(student-t), the better of mixture and t-mixture on the validation rows "
        "(auto), or the standard normal (normal)",
        shown="auto for a table: a data file, a --data-dir or scikit-learn set; "
        "normal for the toy sets and images",
        choices=list(BASE_KINDS),
    )
    # The fitted base's components (derived; stored to rebuild the model).
    base_components: int | None = setting(None, _MODEL, "", flag=False)
    zero_last: bool | None = setting(
        None,
        _MODEL,
        "start each field's output layer at zero, so that the flow starts as its "
        "base distribution",
        shown="on with a fitted --base, off with the standard normal",
        action="on/off",
    )
    solver: str = setting("tsit5", _MODEL, "ODE solver", choices=sorted(SOLVERS))
    rtol: float = setting(
        defaults.RTOL, _MODEL, "solver tolerance of the model", check="positive"
    )
    atol: float = setting(
        defaults.ATOL, _MODEL, "solver tolerance of the model", check="positive"
    )
    # The training.
    objective: str = setting(
        "mle",
        _TRAINING,
        "maximum likelihood through the ODE solve (mle), conditional flow matching "
        "(fm), or flow matching with minibatch optimal-transport pairing (ot-fm); "
        "flow matching needs no solve in training",
        choices=list(OBJECTIVES),
    )
    steps: int | None = setting(
        None,
        _TRAINING,
        "total optimiser steps (with --minutes, a cap on them)",
        shown=f"{by_data('steps')}; with --minutes none",
        low=1,
        type=int,
    )
    minutes: float | None = setting(
        None,
        _TRAINING,
        "train for this many minutes (validation and checkpoints not counted) on a "
        "cosine schedule over them; the same command resumes with the minutes left",
        shown="none: train for --steps",
        check="positive",
        type=float,
    )
    batch_size: int | None = setting(
        None,
        _TRAINING,
        "samples per step",
        shown=by_data("batch_size"),
        low=1,
        type=int,
    )
    lr: float = setting(defaults.LR, _TRAINING, "peak learning rate", check="positive")
    clip: float = setting(
        defaults.CLIP, _TRAINING, "gradient-norm clip", check="positive"
    )
    weight_decay: float = setting(
        0.0,
        _TRAINING,
        "AdamW's decoupled weight decay, scaled by the learning rate (0: Adam)",
        check="weight",
    )
    train_tol: float | None = setting(
        defaults.TRAIN_TOLERANCE,
        _TRAINING,
        "solver rtol = atol in maximum-likelihood training ('none': train at "
        "--rtol/--atol)",
        type="tolerance",
        metavar="TOL|none",
    )
    estimator: str = setting(
        defaults.ESTIMATOR,
        _TRAINING,
        "trace estimator in training (evaluation always uses the exact trace)",
        choices=["rademacher", "gaussian", "sphere", "exact"],
    )
    num_probes: int = setting(1, _TRAINING, "probes of the estimator", low=1)
    kinetic_energy: float = setting(
        0.0,
        _TRAINING,
        "RNODE weight of the kinetic energy integral (0: off)",
        check="weight",
    )
    jacobian_norm: float = setting(
        0.0,
        _TRAINING,
        "RNODE weight of the Jacobian Frobenius-norm integral (0: off)",
        check="weight",
    )
    fm_sigma: float = setting(
        0.0,
        _TRAINING,
        "width of flow matching's Gaussian paths at the data end, in [0, 1)",
        check="fraction",
    )
    patience: int | None = setting(
        None,
        _TRAINING,
        "stop after this many validations without improvement (0: never)",
        shown=f"{defaults.CLI_PATIENCE} for a data file and the --data-dir sets, "
        "never for the others",
        low=0,
        type=int,
    )
    seed: int = setting(0, _TRAINING, "seed of the initialisation and the batches")
    # Derived (`DERIVED`): the recipe's line, and the run's training seconds so far.
    recipe: str | None = setting(None, _TRAINING, None, flag=False)
    seconds: float | None = setting(None, _TRAINING, None, flag=False)
    # The run.
    run_dir: str = setting(
        None, _RUN, "directory of this run", stored=False, required=True
    )
    checkpoint_every: int = setting(
        100, _RUN, "steps between checkpoints (and validations)", stored=False, low=1
    )
    print_every: int = setting(
        50, _RUN, "steps between log lines (without a terminal)", stored=False, low=1
    )
    no_progress: bool = setting(False, _RUN, "plain log lines", stored=False)
    devices: int | str | None = setting(
        None,
        _RUN,
        "train data-parallel on the first N devices, or all of them (the batch size "
        "must be a multiple of the number)",
        stored=False,
        shown="one device",
        type="devices",
        metavar="N|all",
    )
    distributed: bool = setting(
        False,
        _RUN,
        "join a multi-host run via jax.distributed.initialize (one process per "
        "host; see the docs' scaling page)",
        stored=False,
    )

    def check(self) -> None:
        """A `ValueError` naming the flag and the range of any setting out of its
        range, or of two settings that do not go together."""
        ranges = {
            "positive": (lambda v: v > 0, "a finite number > 0"),
            "weight": (lambda v: v >= 0, "a finite weight >= 0"),
            "fraction": (lambda v: 0 <= v < 1, "in [0, 1)"),
        }
        for f in dataclasses.fields(self):
            value, low = getattr(self, f.name), f.metadata["low"]
            flag = "--" + f.name.replace("_", "-")
            if low is not None and value is not None and value < low:
                raise ValueError(f"{flag} must be at least {low}.")
            if f.metadata["check"] is not None and value is not None:
                ok, what = ranges[f.metadata["check"]]
                if not (math.isfinite(value) and ok(value)):
                    raise ValueError(f"{flag} must be {what}; got {value}.")
        if not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"--seed must fit in 64 bits; got {self.seed}.")
        if not (math.isfinite(self.test_fraction) and 0 < self.test_fraction < 1):
            raise ValueError(
                f"--test-fraction must be in (0, 1); got {self.test_fraction}."
            )
        if self.val_fraction + self.test_fraction >= 1:
            raise ValueError(
                f"--val-fraction {self.val_fraction} and --test-fraction "
                f"{self.test_fraction} leave no rows to train on; make them add up "
                "to less than 1."
            )
        for name, what in _FILE_ONLY.items():
            if getattr(self, name) not in (None, False) and not self.from_files():
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} {what.format(data=self.data)}")
        if self.base not in (None, "normal", "auto") and not self.fits_base():
            raise ValueError(
                f"--base {self.base} is fitted to a table's training rows; --data "
                f"{self.data} is drawn afresh at every step (or is images): use "
                "--base normal, or give a data file."
            )
        if self.objective != "mle":
            if self.learn_t1:
                raise ValueError(
                    f"--objective {self.objective} fixes the integration time; drop "
                    "--learn-t1 (or use --objective mle)."
                )
            if self.kinetic_energy or self.jacobian_norm:
                raise ValueError(
                    "--kinetic-energy and --jacobian-norm regularise --objective "
                    f"mle; drop them with --objective {self.objective}."
                )
        self._check_every_setting_acts()

    def _check_every_setting_acts(self) -> None:
        """A `ValueError` for an empty path or name, and for a setting given a value
        other than its default where the other settings make it do nothing (it
        would be stored, and believed, while the run ignored it)."""
        for name in ("data", "data_dir", "columns", "array", "run_dir"):
            values = getattr(self, name)
            for value in values if isinstance(values, tuple) else (values,):
                if isinstance(value, str) and not value.strip():
                    raise ValueError(
                        f"--{name.replace('_', '-')} is empty ({value!r}); give "
                        + ("a directory." if name.endswith("dir") else "a value.")
                    )
        given = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["flag"] and not same_value(getattr(self, f.name), f.default)
        }
        shown = {n: "" if v is True else f" {v}" for n, v in given.items()}

        def refuse(names, why):
            for name in names:
                if name in given:
                    flag = f"--{name.replace('_', '-')}{shown[name]}"
                    raise ValueError(f"{flag} does nothing here: {why}; drop it.")

        if self.objective == "mle":
            refuse(["fm_sigma"], "it widens flow matching's paths (--objective fm)")
        else:
            refuse(
                ["estimator", "num_probes", "train_tol"],
                f"--objective {self.objective} trains without solving the ODE, so "
                "without a trace estimator or a training tolerance",
            )
        if self.estimator == "exact":
            refuse(["num_probes"], "--estimator exact draws no probes")
        data = self.data if isinstance(self.data, str) else None
        if not self.from_files():
            refuse(
                ["val_fraction", "test_fraction", "split_seed", "no_standardize"],
                f"it splits or scales a data file, and --data {data} is a built-in "
                "data set (with its own split and scaling)",
            )
            refuse(["header"], f"it reads a text file; --data {data} is a data set")
        if data not in DIRECTORY_DATASETS:
            refuse(
                ["data_dir"],
                f"it is where MAF's UCI sets and MNIST are read from, and --data "
                f"{data or ' '.join(self.data)} is not one of them",
            )
        if self.patience:  # 0: never stop early, which needs no validation
            if data in TOY_DATASETS:
                refuse(["patience"], f"--data {data} has no validation set to stop on")
            if self.from_files() and self.val_fraction == 0:
                refuse(["patience"], "--val-fraction 0 holds no rows out to validate")

    def fits_base(self) -> bool:
        """Whether the data are a table whose training rows a base can be fitted to
        (a data file, or a built-in table), not samples drawn afresh or images."""
        if self.from_files():
            return True
        return isinstance(self.data, str) and self.data in TABLE_SETS

    def from_files(self) -> bool:
        """Whether `data` names files (by their extension, or `-` for standard
        input, which is refused when it is read) rather than a data set."""
        if not isinstance(self.data, str):
            return True
        return self.data == "-" or bool(os.path.splitext(self.data)[1])

    def resolved(self) -> "RunConfig":
        """The settings left to the data filled in: the steps (none with `minutes`)
        and batch size by data set (`_defaults.cli_training`), the patience (none for
        the built-in sets), the activation."""
        values = {
            name: value
            for name, value in cli_training(self.data).items()
            if getattr(self, name) is None
            and not (name == "steps" and self.minutes is not None)  # no cap
        }
        if self.patience is None:
            built_in = isinstance(self.data, str) and self.data in ALL_DATASETS
            values["patience"] = None if built_in else defaults.CLI_PATIENCE
        if self.activation is None:
            values["activation"] = DEFAULT_ACTIVATION[self.field]
        return dataclasses.replace(self, **values)

    def for_data(
        self, dim: int, rows: int | None, run: "RunConfig | None" = None
    ) -> "RunConfig":
        """The width filled in from [`default_recipe`][cnftrace.default_recipe]'s
        rule for the data's dimension `dim` and training `rows` (`None`: samples
        without end), with `recipe` saying why; or from the `run` being resumed, so
        that it resumes as it began."""
        if self.width is not None:
            return self
        if run is not None and run.width is not None:
            return dataclasses.replace(self, width=run.width, recipe=run.recipe)
        return dataclasses.replace(
            self, width=default_width(dim, rows), recipe=width_reason(dim, rows)
        )

    def base_to_fit(self, run: "RunConfig | None" = None) -> str:
        """The kind of base this run fits: the flag's, else the resumed `run`'s, else
        `"auto"` for a table and `"normal"` otherwise."""
        if self.base is not None:
            return self.base
        if run is not None:
            return run.base
        return "auto" if self.fits_base() else "normal"

    def with_base(
        self, kind: str, components: int | None, line: str, run=None
    ) -> "RunConfig":
        """These settings with the fitted base (`kind`, its `components`), the field
        started at zero for a fitted base unless `--zero-last` decided (here or in
        the resumed `run`), and `line` added to the recipe's line."""
        zero_last = self.zero_last
        if zero_last is None:
            zero_last = run.zero_last if run is not None else kind != "normal"
        recipe = self.recipe
        if run is None or run.recipe is None or self.recipe != run.recipe:
            parts = [p for p in (recipe, f"base: {line}") if p]
            if zero_last and kind != "normal":
                parts[-1] += ", the field started at zero"
            recipe = "; ".join(parts)
        values = dict(base=kind, base_components=components, zero_last=zero_last)
        return dataclasses.replace(self, recipe=recipe, **values)

    # ------------------------------------------------------------ config.json

    def compared(self) -> dict[str, Any]:
        """The stored settings that a resumed run and its checkpoints must share:
        `stored()` less the `DERIVED` ones."""
        return {k: v for k, v in self.stored().items() if k not in DERIVED}

    def stored(self) -> dict[str, Any]:
        """The settings kept in `config.json`, as JSON values."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata["stored"]:
                value = getattr(self, f.name)
                if isinstance(value, DataFile):
                    value = value.to_json()
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_stored(cls, stored: dict[str, Any], path: str) -> "RunConfig":
        """The settings of a `config.json` (at `path`, for messages); an unknown
        key, or a missing one, is a `CheckpointError`."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.metadata["stored"]}
        unknown = sorted(set(stored) - set(fields))
        if unknown:
            raise CheckpointError(
                f"{path} holds settings cnftrace does not know: {', '.join(unknown)}; "
                "restore the file, or start a new run directory."
            )
        missing = [name for name in fields if name not in stored]
        if missing:
            raise CheckpointError(
                f"{path} lacks the settings {', '.join(missing)}; restore it, or "
                "start a new run directory."
            )
        values = {
            k: tuple(v) if isinstance(v, list) else v
            for k, v in stored.items()
            if k != "data_file"
        }
        if stored["data_file"] is not None:
            try:
                values["data_file"] = DataFile.from_json(stored["data_file"])
            except ValueError as e:
                raise CheckpointError(
                    f"{path}: {e} Restore the file, or start a new run directory."
                ) from None
        return cls(**values)

    def differences(self, other: "RunConfig") -> list[str]:
        """The stored settings where `other` (a run already in the directory)
        differs from this one, as `name: other's value there, this one now`; the
        data file is compared by the caller, by content."""
        there = other.stored()
        return [
            f"{name}: {there[name]!r} there, {value!r} now"
            for name, value in self.stored().items()
            if name != "data_file"
            and name not in DERIVED
            and not same_value(there[name], value)
        ]


def read_config(path: str) -> RunConfig:
    """A run's `config.json`, or a `CheckpointError` saying what is wrong with it."""
    try:
        stored = json.loads(read_regular_file(path, limit=2**20).decode())
    except FileKindError as e:
        raise CheckpointError(str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not a JSON settings file ({e}); restore it, or start a new "
            "run directory."
        ) from None
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path} does not hold a JSON object of settings.")
    return RunConfig.from_stored(stored, path)
