"""similarity_combine vs the authors' per-layer PyTorch loop, the loop batched over K, and the read limit.
Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import similarity

FAMILY = similarity  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_similarity_combine(run_benchmark, case):
    run_benchmark(case)
