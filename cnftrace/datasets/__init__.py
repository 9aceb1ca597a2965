"""Data sets: FFJORD's eight toy 2-D distributions, densities known exactly in any
dimension, targets known by their energy (a 2-D mixture with a known normaliser, the
DW4 and LJ13 particle systems) with reference samplers, scikit-learn's bundled data,
MAF's UCI sets and MNIST from files you provide, and your own tables of samples
(`.csv`, `.tsv`, `.npy`, `.npz`, `.parquet`; compressed, or in a `.zip`), each as
a training source of its own class, and the standardisation of a table."""

from ._file_source import (
    DataFile as DataFile,
    FileSource as FileSource,
    file_source as file_source,
    grid_steps as grid_steps,
)
from ._files import (
    FORMATS_SHOWN as FORMATS_SHOWN,
    SPREADSHEETS as SPREADSHEETS,
    TABLE_FORMATS as TABLE_FORMATS,
    Table as Table,
    data_format as data_format,
    file_sha256 as file_sha256,
    read_table as read_table,
)
from ._known import (
    MARGINALS as MARGINALS,
    KnownDensity as KnownDensity,
    gaussian_mixture as gaussian_mixture,
    heavy_tailed as heavy_tailed,
    rotated_product as rotated_product,
    warped_product as warped_product,
)
from ._mnist import (
    MNIST_FILES as MNIST_FILES,
    load_mnist_idx as load_mnist_idx,
    read_idx as read_idx,
    write_idx as write_idx,
)
from ._real import (
    DIGIT_LEVELS as DIGIT_LEVELS,
    TABULAR_DATASETS as TABULAR_DATASETS,
    Splits as Splits,
    bits_per_dim as bits_per_dim,
    dequantize as dequantize,
    load_digits as load_digits,
    load_tabular as load_tabular,
    logit_transform as logit_transform,
)
from ._sources import (
    ALL_DATASETS as ALL_DATASETS,
    DIRECTORY_DATASETS as DIRECTORY_DATASETS,
    LOGIT_ALPHA as LOGIT_ALPHA,
    MNIST_LEVELS as MNIST_LEVELS,
    DataSource as DataSource,
    ImageSource as ImageSource,
    TableSource as TableSource,
    ToySource as ToySource,
    data_source as data_source,
    digits_from_logit as digits_from_logit,
    gaussian_baseline_nll as gaussian_baseline_nll,
    mnist_root as mnist_root,
)
from ._split import split_table as split_table
from ._standardization import Standardization as Standardization
from ._targets import (
    TARGETS as TARGETS,
    EnergyTarget as EnergyTarget,
    ParticleEnergy as ParticleEnergy,
    dw4 as dw4,
    energy_target as energy_target,
    lj13 as lj13,
    mixture_2d as mixture_2d,
    random_walk_metropolis as random_walk_metropolis,
)
from ._toy import (
    TOY_DATASETS as TOY_DATASETS,
    toy_entropy as toy_entropy,
    toy_entropy_is_exact as toy_entropy_is_exact,
    toy_log_prob as toy_log_prob,
    toy_sample as toy_sample,
)
from ._uci import (
    UCI_DATASETS as UCI_DATASETS,
    UCI_DIMS as UCI_DIMS,
    UCI_FILES as UCI_FILES,
    load_uci as load_uci,
)

__all__ = [
    "ALL_DATASETS",
    "DIGIT_LEVELS",
    "DIRECTORY_DATASETS",
    "LOGIT_ALPHA",
    "MARGINALS",
    "MNIST_FILES",
    "MNIST_LEVELS",
    "DataFile",
    "DataSource",
    "FileSource",
    "FORMATS_SHOWN",
    "ImageSource",
    "KnownDensity",
    "SPREADSHEETS",
    "EnergyTarget",
    "ParticleEnergy",
    "TABLE_FORMATS",
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
    "data_format",
    "data_source",
    "dequantize",
    "digits_from_logit",
    "dw4",
    "energy_target",
    "file_sha256",
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
    "mnist_root",
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
