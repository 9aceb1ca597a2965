"""Vector fields: cnftrace's MLP with sinusoidal time features, FFJORD's ConcatSquash
MLP, and the conv nets of the multiscale image model."""

from ._conv import ConcatConv2d as ConcatConv2d, ConvField as ConvField
from ._mlp import (
    ConcatSquashLinear as ConcatSquashLinear,
    ConcatSquashMLP as ConcatSquashMLP,
    MLPField as MLPField,
)
