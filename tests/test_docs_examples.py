"""The docs' Python examples run as written, so they cannot rot."""

import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
# Pages whose ```python blocks form one runnable script each (small settings).
PAGES = ["regularization.md", "conditional.md", "trace-estimators.md", "scaling.md"]


def python_blocks(page: str) -> list[str]:
    with open(os.path.join(DOCS, page)) as f:
        text = f.read()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, capsys):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no python examples"
    namespace: dict = {"__name__": f"docs_{page}"}
    for block in blocks:
        exec(compile(block, f"docs/{page}", "exec"), namespace)
    assert capsys.readouterr().out.strip()  # every page prints its results
