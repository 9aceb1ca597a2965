"""The documentation's Python examples run as written, so they cannot rot.

Two kinds of examples are run:

- **Pages.** Every page under `docs/` with ```python blocks: the blocks of a page run
  in order, in one namespace (a page is one script), in a temporary working
  directory (so files an example writes land there). A block whose first line is a
  comment starting with `# not run` is shown to readers but skipped here; the rest
  of that comment says why (a cluster, a download, minutes of training). Keep the
  others fast: seconds each, with small models and few steps. A page that carries
  the line `<!-- the tests run this page's shell blocks -->` has its ```bash blocks
  run too, in page order: each line a `cnftrace ...` command, run through the
  command line's `main` in the same working directory.
- **Docstrings.** Every ```python block in the docstring of a public name (and of
  the public methods of public classes) of `cnftrace`, `cnftrace.datasets` and
  `cnftrace.plot`, each in a fresh namespace that holds the imports listed on the
  API reference's front page (`docs/api/index.md`).

The docstrings' examples, and the check that every public name has a docstring and
a place in the API reference, are in test_docstring_examples.py (a file of their own,
so that pytest-xdist runs the two halves on two workers).
"""

import ast
import os
import re

import jax
import pytest
from _docs import (
    NOT_RUN,
    PAGES,
    page_blocks,
    python_blocks,
    read,
    runs,
    shell_commands,
)
from conftest import release_if_large

from cnftrace.cli import main


@pytest.fixture(autouse=True)
def _as_a_user_runs_it():
    """The examples run in JAX's default float32, as a reader would run them (the
    rest of the suite turns float64 on). A page's compiled programs are released
    after it where the worker holds too many (conftest.py's `release_if_large`)."""
    with jax.enable_x64(False):
        yield
    release_if_large()


def test_pages_found():
    # The pages whose examples are the heart of the user guide.
    for page in ("getting-started.md", "training.md", "divergence.md"):
        assert page in PAGES


# Pages whose examples train for hundreds of steps run faster compiled with XLA's
# optimisations on (see conftest.py); the others compile more than they run.
OPTIMIZED = {"getting-started.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=pytest.mark.optimized) if p in OPTIMIZED else p
        for p in PAGES
    ],
)
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = [(lang, b) for lang, b in page_blocks(read(page)) if runs(b)]
    if not blocks:
        pytest.skip(f"{page}: every example is marked `{NOT_RUN}`")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page}"}
    for lang, block in blocks:
        if lang == "bash":
            for argv in shell_commands(block):
                assert main(argv) == 0, f"docs/{page}: cnftrace {' '.join(argv)}"
        else:
            exec(compile(block, f"docs/{page}", "exec"), namespace)


def test_shell_blocks_of_own_data_run():
    """The page on your own data runs its commands, in page order."""
    kinds = [lang for lang, b in page_blocks(read("own-data.md")) if runs(b)]
    assert kinds.count("bash") == 2 and kinds[0] == "python"


# The pages a new user copies first: there, an example that means "the default"
# builds the flow with the default builders, never a field sized by hand.
FIRST_PAGES = ("index.md", "getting-started.md", os.path.join(os.pardir, "README.md"))
DEFAULT_BUILDERS = {"MLPField", "mlp_flow"}
SIZES = {"width", "depth"}


def hand_built_fields(source: str) -> list[str]:
    """The calls of `source` that size a default builder by hand (`width=`,
    `depth=`, or positional sizes) or build another field (`ConcatSquashMLP`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        sized = {k.arg for k in node.keywords} & SIZES or len(node.args) > 1
        if (name in DEFAULT_BUILDERS and sized) or name == "ConcatSquashMLP":
            found.append(ast.unparse(node))
    return found


def test_the_check_finds_hand_built_fields():
    source = (
        "a = cnftrace.MLPField(2, key=k)\n"
        "b = cnftrace.mlp_flow(2, key=k, base=base)\n"
        "c = cnftrace.ConcatSquashMLP(2, width=32, depth=2, key=k)\n"
        "d = cnftrace.mlp_flow(2, key=k, width=16)\n"
        "e = MLPField(2, 64, key=k)\n"
    )
    assert hand_built_fields(source) == [
        "cnftrace.ConcatSquashMLP(2, width=32, depth=2, key=k)",
        "cnftrace.mlp_flow(2, key=k, width=16)",
        "MLPField(2, 64, key=k)",
    ]


@pytest.mark.parametrize("page", FIRST_PAGES)
def test_first_pages_use_the_default_builders(page):
    text = read(page)
    blocks = python_blocks(text)
    assert blocks, f"{page} has no Python example"
    found = [call for block in blocks for call in hand_built_fields(block)]
    assert not found, (
        f"{page}: an example a new user copies builds its field by hand; use "
        f"cnftrace.mlp_flow(dim, key=...) or MLPField(dim, key=...): {found}"
    )
    uses = "".join(blocks)
    assert any(f"{b}(" in uses for b in DEFAULT_BUILDERS), page
    # The command line the page shows trains with the defaults too.
    for line in re.findall(r"^\s*cnftrace train .*$", text, flags=re.M):
        assert "--width" not in line and "--depth" not in line, (page, line)
