"""FedPBC server ops (postponed broadcast, weighted delta, MIFA) vs the torch idiom and per-client loops, and the
engine's FedPBC round with batched vs looped local training (targets: bench/results/README.md)."""

import pytest

from pyfedkern.benchmarks import pbc

FAMILY = pbc  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_pbc(run_benchmark, case):
    run_benchmark(case)
