"""weighted_sum vs the torch idiom, tensordot, the add_ loop, NumPy and Flower's per-layer reduce.
Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import aggregate

FAMILY = aggregate  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_weighted_sum(run_benchmark, case):
    run_benchmark(case)
