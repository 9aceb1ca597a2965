"""The experiments and benchmarks use cnftrace's public API only, and run as modules
of the `experiments` package (`python -m experiments.<name>`), with no `sys.path`
edits: if an experiment needs a private name, the public API is missing something."""

import ast
import glob
import os
import stat

import pytest
from _paths import ROOT

FILES = sorted(
    glob.glob(os.path.join(ROOT, "experiments", "**", "*.py"), recursive=True)
)


def _dotted(node) -> str | None:
    """`a.b.c` of an attribute chain rooted at a name, else `None`."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_cnftrace_names(source: str) -> list[str]:
    """Every private cnftrace name that `source` imports or reads: a module or name
    with a leading underscore under `cnftrace` (dunders such as `__version__` are
    public)."""
    found = []

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        hidden = [p for p in parts[1:] if p.startswith("_") and not p.endswith("__")]
        return parts[0] == "cnftrace" and bool(hidden)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [
                f"{node.module}.{a.name}"
                for a in node.names
                if private(f"{node.module}.{a.name}")
            ]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted is not None and private(dotted):
                found.append(dotted)
    return sorted(set(found))


def test_the_check_finds_private_names():
    source = (
        "import cnftrace._train\n"
        "from cnftrace._checkpoint import _atomic_write\n"
        "from cnftrace.plot import _atomic_savefig, density_grid\n"
        "from cnftrace import fit, _flow\n"
        "x = cnftrace._train.log_prob_and_stats\n"
        "from cnftrace.datasets import toy_sample\n"
    )
    assert private_cnftrace_names(source) == [
        "cnftrace._checkpoint._atomic_write",
        "cnftrace._flow",
        "cnftrace._train",
        "cnftrace._train.log_prob_and_stats",
        "cnftrace.plot._atomic_savefig",
    ]


def test_there_are_experiments():
    names = {os.path.relpath(f, ROOT) for f in FILES}
    assert {"experiments/demo.py", "experiments/bench/b2.py"} <= names
    assert "experiments/__init__.py" in names
    assert "experiments/bench/__init__.py" in names


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_experiment_uses_the_public_api_only(path):
    with open(path) as f:
        source = f.read()
    assert private_cnftrace_names(source) == []
    assert "sys.path" not in source, "run it as `python -m experiments.<name>`"


def test_results_are_written_with_the_mode_of_a_normal_file(tmp_path):
    from experiments._common import atomic_write

    umask = os.umask(0o022)
    try:
        path = tmp_path / "results.json"
        atomic_write(str(path), b"{}")
        assert path.read_bytes() == b"{}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o644  # not mkstemp's 0600
        assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    finally:
        os.umask(umask)


# The modules a script may import besides cnftrace: the one helper module, and the
# peers' code (torch's zuko, TFP) where that peer runs. The suite `bench/run.py` runs
# the sections B1 to B4 in one process, so it imports them too.
SHARED = {
    "experiments._common",
    "experiments.bench.zuko_peer",
    "experiments.bench.tfp_peer",
}
SUITE = {"experiments/bench/run.py": {f"experiments.bench.b{i}" for i in range(1, 5)}}


def experiment_imports(source: str) -> set[str]:
    """The `experiments` modules that `source` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("experiments.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "experiments" or node.module == "experiments.bench":
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif node.module.startswith("experiments."):
                found.add(node.module)
    return found


def test_the_import_check_finds_scripts():
    source = (
        "from experiments import _common\n"
        "from experiments.bench.b4 import Target\n"
        "def f():\n    from experiments.bench import b5, zuko_peer\n"
    )
    assert experiment_imports(source) == {
        "experiments._common",
        "experiments.bench.b4",
        "experiments.bench.b5",
        "experiments.bench.zuko_peer",
    }


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_scripts_do_not_import_each_other(path):
    with open(path) as f:
        source = f.read()
    allowed = SHARED | SUITE.get(os.path.relpath(path, ROOT), set())
    assert experiment_imports(source) <= allowed, "move what is shared to _common.py"
