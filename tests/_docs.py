"""What the documentation tests share: the pages, their python blocks, and the
public names of the package with their docstrings (see test_docs_examples.py)."""

import glob
import inspect
import os
import re
import shlex
import textwrap

from _paths import ROOT

import cnftrace
import cnftrace.datasets
import cnftrace.plot

DOCS = os.path.join(ROOT, "docs")
NOT_RUN = "# not run"
# A page with this line has its ```bash blocks run too, in page order with its
# ```python blocks: each line a `cnftrace ...` command (see `shell_commands`).
RUN_SHELL = "<!-- the tests run this page's shell blocks -->"
MODULES = (cnftrace, cnftrace.datasets, cnftrace.plot)


def read(page: str) -> str:
    with open(os.path.join(DOCS, page)) as f:
        return f.read()


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a page or docstring, dedented."""
    blocks = re.findall(r"^([ \t]*)```python\n(.*?)^\1```", text, flags=re.S | re.M)
    return [textwrap.dedent(body) for _, body in blocks]


def page_blocks(text: str) -> list[tuple[str, str]]:
    """`(language, body)` of the ```python and ```bash blocks of a page, in order,
    dedented; the bash blocks only where the page carries `RUN_SHELL`."""
    languages = "python|bash" if RUN_SHELL in text else "python"
    blocks = re.findall(
        rf"^([ \t]*)```({languages})\n(.*?)^\1```", text, flags=re.S | re.M
    )
    return [(lang, textwrap.dedent(body)) for _, lang, body in blocks]


def shell_commands(block: str) -> list[list[str]]:
    """The arguments of each `cnftrace` command of a bash block (comments dropped).
    Any other command is an error: a page must not show commands the tests skip."""
    commands = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] != "cnftrace":
            raise ValueError(f"only `cnftrace` commands are run; got {line!r}.")
        commands.append(words[1:])
    return commands


def runs(block: str) -> bool:
    return not block.lstrip().startswith(NOT_RUN)


PAGES = sorted(
    os.path.relpath(path, DOCS)
    for path in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True)
    if python_blocks(read(os.path.relpath(path, DOCS)))
)


def public_names(module) -> list[str]:
    names = getattr(module, "__all__", None) or dir(module)
    return sorted(
        n
        for n in names
        if not n.startswith("_") and not inspect.ismodule(getattr(module, n))
    )


def documented_objects():
    """`(qualified name, object)` of every public function and class, and of the
    public methods and properties that classes define in cnftrace."""
    out = []
    for module in MODULES:
        for name in public_names(module):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or callable(obj)):
                continue  # constants such as TOY_DATASETS
            qualified = f"{module.__name__}.{name}"
            out.append((qualified, obj))
            if inspect.isclass(obj):
                for attr, value in vars(obj).items():
                    if attr.startswith("_"):
                        continue
                    if isinstance(
                        value, (staticmethod, property)
                    ) or inspect.isfunction(value):
                        # Looked up on the class, so that `inspect.getdoc` finds the
                        # docstring of the method an override implements.
                        out.append((f"{qualified}.{attr}", getattr(obj, attr)))
    return out
