"""The docstring examples of every public name run as written, and every public name
has a docstring and a place in the API reference (see test_docs_examples.py)."""

import glob
import inspect
import os
import re

import jax
import pytest
from _docs import DOCS, documented_objects, public_names, python_blocks, read

import cnftrace


@pytest.fixture(autouse=True)
def _as_a_user_runs_it():
    """The examples run in JAX's default float32, as a reader would run them (the
    rest of the suite turns float64 on)."""
    with jax.enable_x64(False):
        yield


OBJECTS = documented_objects()
EXAMPLES = [
    pytest.param(block, id=f"{name}[{i}]")
    for name, obj in OBJECTS
    for i, block in enumerate(python_blocks(inspect.getdoc(obj) or ""))
]


def test_docstring_examples_found():
    assert len(EXAMPLES) >= 20


@pytest.mark.parametrize("block", EXAMPLES)
def test_docstring_example_runs(block, tmp_path, monkeypatch):
    (preamble,) = python_blocks(read(os.path.join("api", "index.md")))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docstring_example"}
    exec(compile(preamble, "docs/api/index.md", "exec"), namespace)
    exec(compile(block, "docstring", "exec"), namespace)


def test_every_public_name_has_a_docstring():
    missing = [name for name, obj in OBJECTS if not inspect.getdoc(obj)]
    assert not missing, f"public names without a docstring: {missing}"


def test_every_public_name_is_in_the_api_reference():
    """`::: cnftrace.X` (mkdocstrings) for every public name of `cnftrace`, and the
    two public submodules rendered whole."""
    text = "".join(
        read(os.path.relpath(p, DOCS))
        for p in glob.glob(os.path.join(DOCS, "api", "*.md"))
    )
    rendered = set(re.findall(r"^::: ([\w.]+)", text, flags=re.M))
    wanted = {f"cnftrace.{n}" for n in public_names(cnftrace)}
    wanted |= {"cnftrace.datasets", "cnftrace.plot"}
    missing = sorted(wanted - rendered)
    assert not missing, f"add these to a page under docs/api/: {missing}"
