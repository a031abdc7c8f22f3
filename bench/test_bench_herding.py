"""herding_select vs the reference loop, a torch greedy loop, torch Gram + Python loop and the GEMM.
Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import herding

FAMILY = herding  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_herding_select(run_benchmark, case):
    run_benchmark(case)
