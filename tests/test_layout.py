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
# `_checks`, `_custom_types` and `_recipe` (the default settings) are the bottom of
# all. `store` (checkpoint files, history logs, locks) knows nothing of flows: `fit`
# writes its checkpoints through it, and `runs` builds run directories on it.
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
BASE = ("_io", "_checks", "_custom_types", "_recipe")
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
def test_no_module_is_over_700_lines(path):
    with open(path) as f:
        assert sum(1 for _ in f) <= 700


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
