"""The benchmarks of `shared/BENCHMARK.md`: `python -m experiments.bench.run`."""
