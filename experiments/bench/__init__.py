"""The benchmarks B1-B6 (`experiments/README.md`): `python -m experiments.bench.run`."""
