"""One FedSpeed local step: fused flat-buffer ops vs FL-Simulator's per-tensor PyTorch step and a copy.
Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import fedspeed

FAMILY = fedspeed  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_fedspeed_step(run_benchmark, case):
    run_benchmark(case)
