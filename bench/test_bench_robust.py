"""Robust aggregation (coordinate median, trimmed mean, Krum, Bulyan) vs Flower's aggregate functions, NumPy and torch,
with a copy of the rows as the limit and torch's Gram product for Krum. ``PYFEDKERN_BENCH_ROBUST="K:d,..."`` picks
sizes. Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import robust

FAMILY = robust  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_robust(run_benchmark, case):
    run_benchmark(case)
