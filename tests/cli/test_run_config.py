"""`RunConfig`, the one source of `cnftrace train`'s settings: its flags, `config.json`,
the check on resume and what `cnftrace.load` reads."""

import dataclasses
import importlib
import json
import os
import re

import pytest
from _paths import ROOT

from cnftrace import CheckpointError
from cnftrace.cli._arguments import run_config
from cnftrace.cli._main import make_parser
from cnftrace.runs import RunConfig, read_config


def _train_parser():
    parser = make_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    return sub.choices["train"]


def _parse(*argv) -> RunConfig:
    args = make_parser().parse_args(["train", "--run-dir", "r", *argv])
    return run_config(args)


def test_every_setting_is_a_flag_whose_help_states_its_default():
    parser = _train_parser()
    by_dest = {a.dest: a for a in parser._actions}
    fields = dataclasses.fields(RunConfig)
    flagged = [f for f in fields if f.metadata["flag"]]
    assert {f.name for f in flagged} <= set(by_dest)
    for f in flagged:
        action = by_dest[f.name]
        assert re.search(r"\((default: [^()]+|required)\)$", action.help), f.name
        assert action.default == f.default
    # The flags come in argument groups, one per kind of setting.
    titles = [g.title for g in parser._action_groups]
    assert {"data settings", "model settings", "training settings"} <= set(titles)
    # Only the derived settings have no flag: the data file, the number of the
    # fitted base's components, the recipe's line and the run's seconds.
    unflagged = [f.name for f in fields if f not in flagged]
    assert unflagged == ["data_file", "base_components", "recipe", "seconds"]


def test_flags_become_settings():
    config = _parse("--width", "8", "--data", "a.csv", "b.csv", "--learn-t1")
    assert config.width == 8 and config.learn_t1 and config.data == ("a.csv", "b.csv")
    assert config.train_tol == 1e-2 and _parse("--train-tol", "none").train_tol is None
    resolved = _parse().resolved()
    assert (resolved.steps, resolved.batch_size, resolved.patience) == (2400, 128, None)
    assert resolved.activation == "silu"
    on_file = _parse("--data", "x.csv", "--field", "concatsquash").resolved()
    assert on_file.patience == 10 and on_file.activation == "tanh"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--lr", "nan"], "--lr must be a finite number > 0"),
        (["--kinetic-energy", "-1"], "--kinetic-energy must be a finite weight"),
        (["--val-fraction", "0.5", "--test-fraction", "0.5"], "leave no rows"),
        (["--test-fraction", "0"], r"--test-fraction must be in \(0, 1\)"),
        (["--objective", "fm", "--learn-t1"], "fixes the integration time"),
        (["--columns", "a"], "--columns picks from a data file"),
        (["--seed", str(2**63)], "--seed must fit in 64 bits"),
    ],
)
def test_settings_out_of_range_are_refused_by_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(*argv).check()


def test_config_json_round_trip_and_unknown_keys(tmp_path):
    config = dataclasses.replace(_parse("--data", "a.csv", "b.csv").resolved())
    stored = config.stored()
    # Only the settings that define a run are stored; JSON has lists, not tuples.
    assert "run_dir" not in stored and "columns" not in stored
    assert stored["data"] == ["a.csv", "b.csv"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(stored))
    again = read_config(str(path))
    assert again.stored() == stored and again.differences(config) == []
    # A misspelt key is an error naming it, not a setting quietly ignored.
    path.write_text(json.dumps({**stored, "widht": 8}))
    with pytest.raises(CheckpointError, match="does not know: widht"):
        read_config(str(path))
    # Every stored setting is required: a file without one is refused by name.
    path.write_text(json.dumps({k: v for k, v in stored.items() if k != "width"}))
    with pytest.raises(CheckpointError, match="lacks the settings width"):
        read_config(str(path))


def test_differences_name_each_changed_setting():
    a, b = _parse("--width", "8").resolved(), _parse("--width", "16").resolved()
    assert b.differences(a) == ["width: 8 there, 16 now"]
    # Settings that are not stored (where to log, how often) may change on resume.
    moved = _parse("--width", "8", "--print-every", "7", "--run-dir", "elsewhere")
    assert moved.resolved().differences(a) == []


def test_the_installed_command_is_the_command_line():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        [(module, name)] = re.findall(r'^cnftrace = "([\w.]+):(\w+)"$', f.read(), re.M)
    assert (
        getattr(importlib.import_module(module), name)
        is importlib.import_module("cnftrace.cli").main
    )
