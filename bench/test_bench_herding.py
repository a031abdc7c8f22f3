"""herding_select vs the reference loop, a torch greedy loop, torch Gram + Python loop and the GEMM (issue 4)."""

import pytest


@pytest.mark.benchmark(disable_gc=True)
def test_herding_select(run_benchmark, case):
    run_benchmark(case)
