"""Seeded permutations (the engine's minibatch orders): one native call vs one NumPy Generator per row."""

import pytest

from pyfedkern.benchmarks import sampling

FAMILY = sampling  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_sampling(run_benchmark, case):
    run_benchmark(case)
