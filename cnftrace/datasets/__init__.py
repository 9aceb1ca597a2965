"""Data sets: FFJORD's eight toy 2-D distributions, densities known exactly in any
dimension, targets known by their energy (a 2-D mixture with a known normaliser, the
DW4 and LJ13 particle systems) with reference samplers, scikit-learn's bundled data,
MAF's UCI sets and MNIST from files you provide, and your own tables of samples
(`.csv`, `.tsv`, `.npy`, `.npz`, `.parquet`; compressed, or in a `.zip`), each as
a training source of its own class, and the standardisation of a table."""

from ._file_source import DataFile, FileSource, file_source, grid_steps
from ._files import (
    Table,
    read_table,
)
from ._known import (
    MARGINALS,
    KnownDensity,
    gaussian_mixture,
    heavy_tailed,
    rotated_product,
    warped_product,
)
from ._mnist import MNIST_FILES, load_mnist_idx, read_idx, write_idx
from ._real import (
    DIGIT_LEVELS,
    TABULAR_DATASETS,
    Splits,
    bits_per_dim,
    dequantize,
    load_digits,
    load_tabular,
    logit_transform,
)
from ._sources import (
    LOGIT_ALPHA,
    MNIST_LEVELS,
    DataSource,
    ImageSource,
    TableSource,
    ToySource,
    data_source,
    digits_from_logit,
    gaussian_baseline_nll,
)
from ._split import split_table
from ._standardization import Standardization
from ._targets import (
    TARGETS,
    EnergyTarget,
    ParticleEnergy,
    dw4,
    energy_target,
    lj13,
    mixture_2d,
    random_walk_metropolis,
)
from ._toy import (
    TOY_DATASETS,
    toy_entropy,
    toy_entropy_is_exact,
    toy_log_prob,
    toy_sample,
)
from ._uci import UCI_DATASETS, UCI_DIMS, UCI_FILES, load_uci

__all__ = [
    "DIGIT_LEVELS",
    "LOGIT_ALPHA",
    "MARGINALS",
    "MNIST_FILES",
    "MNIST_LEVELS",
    "DataFile",
    "DataSource",
    "FileSource",
    "ImageSource",
    "KnownDensity",
    "EnergyTarget",
    "ParticleEnergy",
    "TABULAR_DATASETS",
    "TARGETS",
    "Table",
    "TOY_DATASETS",
    "UCI_DATASETS",
    "UCI_DIMS",
    "UCI_FILES",
    "Splits",
    "Standardization",
    "TableSource",
    "ToySource",
    "bits_per_dim",
    "data_source",
    "dequantize",
    "digits_from_logit",
    "dw4",
    "energy_target",
    "file_source",
    "grid_steps",
    "gaussian_baseline_nll",
    "gaussian_mixture",
    "load_digits",
    "load_mnist_idx",
    "load_tabular",
    "lj13",
    "load_uci",
    "logit_transform",
    "mixture_2d",
    "random_walk_metropolis",
    "read_idx",
    "read_table",
    "rotated_product",
    "heavy_tailed",
    "warped_product",
    "split_table",
    "toy_entropy",
    "toy_entropy_is_exact",
    "toy_log_prob",
    "toy_sample",
    "write_idx",
]
