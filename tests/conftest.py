"""Test configuration: float64 for numerical tests, strict rank promotion."""

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")


# The files that take longest (mostly XLA compiling), first: pytest-xdist's
# `--dist loadfile` hands out whole files in collection order, so putting the long
# ones first keeps one worker from finishing a long file alone at the end.
LONGEST_FIRST = (
    "test_flow.py",
    "test_docs_examples.py",
    "test_experiments_images.py",
    "test_parallel.py",
    "test_cli.py",
    "test_matching.py",
    "test_checkpoint.py",
    "test_regularization.py",
    "test_conditional.py",
    "test_bench_run.py",
    "test_docstring_examples.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
