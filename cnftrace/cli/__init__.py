"""The `cnftrace` command line: train, eval, sample, plot, datasets."""

from ._main import main as main
