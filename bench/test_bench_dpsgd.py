"""One local DP-SGD step: pyfedkern's book-keeping vs Opacus 1.6 (hooks, ghost clipping) vs the non-private step.
Run at 1 thread: ``OMP_NUM_THREADS=1 pytest bench/test_bench_dpsgd.py``. Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import dpsgd

FAMILY = dpsgd  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_dpsgd(run_benchmark, case):
    run_benchmark(case)
