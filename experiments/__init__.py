"""The demo, the reproduction scripts and the benchmarks, on cnftrace's public API.

Run them from the repository root as modules: `python -m experiments.demo`,
`python -m experiments.ffjord_toy --quick`, `python -m experiments.bench.run`.
"""
