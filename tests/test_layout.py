"""The package's layout (docs/conventions.md, "The package's layout"): each layer
imports only the layers below it and only what their `__init__.py` names, no module
grows past 700 lines, and no module leans on JAX's internals or changes the process's
state."""

import ast
import glob
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "cnftrace")
# Bottom to top; a layer may import the layers before it. `_io`, `_checks`,
# `_custom_types` and `_defaults` (the default settings) are the bottom of all.
LAYERS = (
    "estimators",
    "ode",
    "nets",
    "flows",
    "objectives",
    "datasets",
    "training",
    "plot",
    "runs",
    "cli",
)
BASE = ("_io", "_checks", "_custom_types", "_defaults")
MODULES = sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))


def _name(path: str) -> str:
    return os.path.relpath(path, PACKAGE)


def _layer(path: str) -> str | None:
    """The layer of a module of the package (`None` for the top-level modules)."""
    first = _name(path).split(os.sep)[0].removesuffix(".py")
    return first if first in LAYERS or first in BASE else None


def _imports(path: str) -> list[tuple[str, ...]]:
    """The package's own modules that a module imports, as dotted parts below
    `cnftrace` (`("flows", "_cnf")`), resolving relative imports."""
    with open(path) as f:
        tree = ast.parse(f.read())
    here = ("cnftrace", *_name(path).removesuffix(".py").split(os.sep))
    package = here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                parts = (*base, *(node.module.split(".") if node.module else ()))
            else:
                parts = tuple((node.module or "").split("."))
            if parts[0] == "cnftrace":
                names = [a.name for a in node.names]
                out += [(*parts[1:], n) for n in names] if len(parts) == 1 else []
                out.append(parts[1:])
        elif isinstance(node, ast.Import):
            out += [
                tuple(a.name.split(".")[1:])
                for a in node.names
                if a.name.split(".")[0] == "cnftrace"
            ]
    return [p for p in out if p]


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_is_over_600_lines(path):
    with open(path) as f:
        assert sum(1 for _ in f) <= 600


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_layers_import_only_layers_below_and_only_their_interface(path):
    layer = _layer(path)
    for parts in _imports(path):
        target = parts[0].removesuffix(".py")
        if target in BASE or layer is None or target == layer:
            continue
        assert target in LAYERS, (parts, _name(path))
        if layer not in BASE:
            assert LAYERS.index(target) < LAYERS.index(layer), (
                f"{_name(path)} (layer {layer}) imports {'.'.join(parts)}"
            )
        # Another layer is reached through its `__init__.py`, never its privates.
        assert len(parts) == 1 or not parts[1].startswith("_"), (
            f"{_name(path)} imports the private {'.'.join(parts)}"
        )


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_internals_of_jax_and_no_process_wide_switches(path):
    with open(path) as f:
        source = f.read()
    for forbidden in (
        "jax._src",
        "serialize_executable",
        "gc.disable",
        "gc.freeze",
        "ThreadPoolExecutor",
        "monitoring.register",
    ):
        assert forbidden not in source, (forbidden, _name(path))


def test_the_layers_are_subpackages():
    packages = {
        os.path.basename(os.path.dirname(p))
        for p in glob.glob(os.path.join(PACKAGE, "*", "__init__.py"))
    }
    assert set(LAYERS) - {"plot"} <= packages


def _default_literals(path: str):
    """The numbers written as defaults in a module: a parameter's default in a
    signature (`steps: int = 1000`), a class field's (`depth: int = 3`) and the first
    argument of `RunConfig`'s `setting(...)`, as `(name, value, line)`. 0, 1 and -1
    are left out: they mean "none", "one" and "last" wherever they are written."""
    with open(path) as f:
        tree = ast.parse(f.read())

    def number(node):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = number(node.operand)
            return None if inner is None else -inner
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        return None

    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[::-1], args.defaults[::-1]))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d]
            out += [(a.arg, number(d), d.lineno) for a, d in pairs]
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and item.value is not None:
                    value = item.value
                    if (
                        isinstance(value, ast.Call)
                        and getattr(value.func, "id", None) == "setting"
                        and value.args
                    ):
                        value = value.args[0]
                    out.append((item.target.id, number(value), item.lineno))
    return [(n, v, line) for n, v, line in out if v is not None and v not in (0, 1, -1)]


def test_no_default_literal_is_written_twice():
    """Every default of the model and its training is decided once, in
    `cnftrace/_defaults.py` (issue 46): the same name with the same number as its
    default in two places means two places decide it, and they drift apart."""
    seen: dict[tuple, list[str]] = {}
    for path in MODULES:
        for name, value, line in _default_literals(path):
            seen.setdefault((name, value), []).append(f"{_name(path)}:{line}")
    twice = {key: where for key, where in seen.items() if len(where) > 1}
    assert not twice, (
        "defaults written in more than one place; decide them in "
        f"cnftrace/_defaults.py and import them: {twice}"
    )


def test_the_model_and_training_defaults_come_from_one_module():
    """The shared defaults are not written as literals anywhere but `_defaults.py`:
    a signature or setting that defaults `depth`, `t1`, `rtol`, `atol`, `max_steps`,
    `steps`, `batch_size`, `lr`, `clip` or a training tolerance to a number writes
    that number itself."""
    shared = {"depth", "t1", "rtol", "atol", "max_steps", "steps", "batch_size"}
    shared |= {"lr", "clip", "tolerance", "train_tol", "max_failures", "patience"}
    found = [
        f"{_name(path)}:{line} {name}={value}"
        for path in MODULES
        if not path.endswith("_defaults.py")
        for name, value, line in _default_literals(path)
        if name in shared
    ]
    assert not found, f"import these defaults from cnftrace/_defaults.py: {found}"
