"""The documentation's Python examples run as written, so they cannot rot.

Two kinds of examples are run:

- **Pages.** Every page under `docs/` with ```python blocks: the blocks of a page run
  in order, in one namespace (a page is one script), in a temporary working
  directory (so files an example writes land there). A block whose first line is a
  comment starting with `# not run` is shown to readers but skipped here; the rest
  of that comment says why (a cluster, a download, minutes of training). Keep the
  others fast: seconds each, with small models and few steps.
- **Docstrings.** Every ```python block in the docstring of a public name (and of
  the public methods of public classes) of `cnftrace`, `cnftrace.datasets` and
  `cnftrace.plot`, each in a fresh namespace that holds the imports listed on the
  API reference's front page (`docs/api/index.md`).

The docstrings' examples, and the check that every public name has a docstring and
a place in the API reference, are in test_docstring_examples.py (a file of their own,
so that pytest-xdist runs the two halves on two workers).
"""

import jax
import pytest
from _docs import NOT_RUN, PAGES, python_blocks, read, runs


@pytest.fixture(autouse=True)
def _as_a_user_runs_it():
    """The examples run in JAX's default float32, as a reader would run them (the
    rest of the suite turns float64 on)."""
    with jax.enable_x64(False):
        yield


def test_pages_found():
    # The pages whose examples are the heart of the user guide.
    for page in ("getting-started.md", "training.md", "divergence.md"):
        assert page in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, tmp_path, monkeypatch):
    blocks = [b for b in python_blocks(read(page)) if runs(b)]
    if not blocks:
        pytest.skip(f"{page}: every example is marked `{NOT_RUN}`")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page}"}
    for block in blocks:
        exec(compile(block, f"docs/{page}", "exec"), namespace)
