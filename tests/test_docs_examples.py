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

import jax
import pytest
from _docs import NOT_RUN, PAGES, page_blocks, read, runs, shell_commands
from conftest import release_memory

from cnftrace.cli import main


@pytest.fixture(autouse=True)
def _as_a_user_runs_it():
    """The examples run in JAX's default float32, as a reader would run them (the
    rest of the suite turns float64 on). Each page's compiled programs are released
    after it: the pages share none, and kept together they held a worker above
    3 GB."""
    with jax.enable_x64(False):
        yield
    release_memory()


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
