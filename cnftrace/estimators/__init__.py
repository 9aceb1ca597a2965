"""Trace estimators: the exact trace, Hutchinson's, Hutch++ and XTrace; the
divergence of a function and the trace of a lineax operator.

[`Exact`][cnftrace.Exact] applies a linear map to every basis vector;
[`Hutchinson`][cnftrace.Hutchinson] averages `eps^T J eps` over random probes;
[`HutchPlusPlus`][cnftrace.HutchPlusPlus] and [`XTrace`][cnftrace.XTrace] spend part
of their matrix-vector products on a low-rank sketch.
"""

from ._base import AbstractEstimator as AbstractEstimator
from ._divergence import divergence as divergence
from ._exact import Exact as Exact
from ._hutchinson import Hutchinson as Hutchinson
from ._sketch import HutchPlusPlus as HutchPlusPlus, XTrace as XTrace
from ._trace import trace as trace
