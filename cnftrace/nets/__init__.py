"""Vector fields: cnftrace's MLP with sinusoidal time features, FFJORD's ConcatSquash
MLP, the conv nets of the multiscale image model, and an E(n)-equivariant graph
network for particle systems."""

from ._conv import ConcatConv2d as ConcatConv2d, ConvField as ConvField
from ._egnn import EGNNField as EGNNField
from ._mlp import (
    ConcatSquashLinear as ConcatSquashLinear,
    ConcatSquashMLP as ConcatSquashMLP,
    MLPField as MLPField,
)
