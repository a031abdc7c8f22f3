"""Whole simulation rounds: one round of FedAvg, SCAFFOLD, FedSpeed and BHerd at m = 100 and 1,000 clients,
batched against the per-client loop in the same run, and one FedAvg round of 500 clients against Flower's simulation
engine (Ray) on the same task. ``-k cuda`` selects the GPU groups when a GPU is present.
Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import engine

FAMILY = engine  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_engine(run_benchmark, case):
    run_benchmark(case)
