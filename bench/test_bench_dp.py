"""The DP ops against torch (noise: normal_; the clipped sum: the torch idiom) and a central-DP round against a
plain one. Targets: the noise at least 4× faster than normal_, a central-DP round at most 1.05× a plain one."""

import pytest

from pyfedkern.benchmarks import dp

FAMILY = dp  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_dp(run_benchmark, case):
    run_benchmark(case)
