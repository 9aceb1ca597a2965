# The README's two commands: `make demo` and `make test`. Both bootstrap .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Python keeps the bytecode of the modules it imports (in __pycache__/, which git
# ignores), so that the next process loads them instead of compiling their sources.
# Some environments turn that off (PYTHONDONTWRITEBYTECODE, which container images
# often set): then every process that starts JAX compiles JAX's sources again, several
# seconds of CPU for each of the test suite's processes. These targets run the
# project's own .venv and tree, so they keep Python's default.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv demo test lint format docs docs-build clean

venv: $(STAMP)

# `--no-compile`: Python compiles the modules a run imports on first use, instead of
# pip compiling every module of every package at install (half the install's time).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e ".[dev]"
	touch $(STAMP)

demo: venv
	$(PY) -m experiments.demo

# One pytest worker per core (`-n auto`): the suite's time is mostly XLA compiling
# small programs, one core each. A test file runs whole on one worker, so its
# module-scoped fixtures are built once; the files are handed out in the order that
# tests/conftest.py gives them, the longest first (`--no-loadscope-reorder`). A
# worker that crashes is not replaced: the run ends with its failure instead of
# waiting on the crashed worker's files.
test: venv
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder \
		--max-worker-restart=0 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo 'make test: pytest collected no tests' >&2; fi; exit $$rc

# The documentation site (mkdocs.yml, docs/): `docs-build` builds it into site/ and
# fails on any warning, such as a broken cross-reference (CI runs it); `docs` builds
# it the same way and then serves it with live reload on http://127.0.0.1:8000.
docs-build: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs: docs-build
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --strict

lint: venv
	$(VENV)/bin/ruff check cnftrace tests experiments
	$(VENV)/bin/ruff format --check cnftrace tests experiments

format: venv
	$(VENV)/bin/ruff format cnftrace tests experiments
	$(VENV)/bin/ruff check --fix cnftrace tests experiments

clean:
	rm -rf $(VENV) demo_output .pytest_cache site
