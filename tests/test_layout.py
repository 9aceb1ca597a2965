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
# Bottom to top (DESIGN.md's order); a layer may import the layers before it. `_io`,
# `_checks`, `_custom_types`, `_defaults` (the default settings) and `_placement`
# (committing a program's arguments) are the bottom of all. `store` (checkpoint
# files, history logs, locks) knows nothing of flows: `fit` writes its checkpoints
# through it, and `runs` builds run directories on it.
LAYERS = (
    "estimators",
    "ode",
    "nets",
    "flows",
    "objectives",
    "store",
    "training",
    "datasets",
    "plot",
    "runs",
    "cli",
)
BASE = ("_io", "_checks", "_custom_types", "_defaults", "_placement")
MODULES = sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True))


def _name(path: str) -> str:
    return os.path.relpath(path, PACKAGE)


def _layer(path: str) -> str | None:
    """The layer of a module of the package (`None` for the top-level modules)."""
    first = _name(path).split(os.sep)[0].removesuffix(".py")
    return first if first in LAYERS or first in BASE else None


def _imports(path: str) -> list[tuple[str, ...]]:
    """The package's own modules that a module imports, as dotted parts below
    `cnftrace` (`("flows", "_cnf")`), resolving relative imports, each also with
    every name imported from it (`("flows", "_cnf", "CNF")`)."""
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
                out += [(*parts[1:], n) for n in names]
                out.append(parts[1:])
        elif isinstance(node, ast.Import):
            out += [
                tuple(a.name.split(".")[1:])
                for a in node.names
                if a.name.split(".")[0] == "cnftrace"
            ]
    return [p for p in out if p]


def _exported(layer: str) -> set[str]:
    """The names a subpackage's `__init__.py` imports (and so exports)."""
    path = os.path.join(PACKAGE, layer, "__init__.py")
    if not os.path.exists(path):
        return set()
    with open(path) as f:
        tree = ast.parse(f.read())
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


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
        # What another layer's `__init__.py` names is reached through it; its
        # private modules only for plumbing that the `__init__.py` does not name.
        if len(parts) == 3 and parts[1].startswith("_"):
            assert parts[2] not in _exported(parts[0]), (
                f"{_name(path)} imports {parts[2]} from {'.'.join(parts[:2])}, "
                f"past cnftrace.{parts[0]}, which names it"
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
    `cnftrace/_defaults.py`: the same name with the same number as its
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


def _module(path: str) -> tuple[str, ...]:
    """A module's dotted parts below `cnftrace` (a package's `__init__.py` is the
    package): `("flows", "_cnf")`, `("flows",)`, `()` for `cnftrace` itself."""
    parts = tuple(_name(path).removesuffix(".py").split(os.sep))
    return parts[:-1] if parts[-1] == "__init__" else parts


def test_no_import_circle_among_the_modules():
    """Every import counts, a `TYPE_CHECKING` one or one inside a function too: a
    circle that only a type annotation or a late import keeps from failing is still
    two modules that cannot be read one after the other."""
    modules = {_module(p): p for p in MODULES}
    graph = {
        name: {target for target in _imports(path) if target in modules} - {name}
        for name, path in modules.items()
    }
    # Tarjan's strongly connected components: a component of more than one module
    # is a circle.
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(".".join(("cnftrace", *member)))
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_the_files_ordered_longest_first_are_the_suites_files():
    """conftest.py's `LONGEST_FIRST` names test files by their base name: each names
    one file of the suite, so that a file renamed or removed does not leave the order
    silently short of it."""
    from conftest import LONGEST_FIRST

    files = glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
    names = [os.path.basename(f) for f in files]
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    for name in LONGEST_FIRST:
        assert names.count(name) == 1, (
            f"conftest.LONGEST_FIRST: {name!r} names {names.count(name)} files"
        )
