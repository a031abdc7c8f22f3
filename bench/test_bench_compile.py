"""A whole FedSpeed local step (two gradients, perturbation, fused update) eager and under torch.compile: pyfedkern's
operators vs the flat torch step, on an MLP and a small CNN."""

import pytest

from pyfedkern.benchmarks import compile as compiled_step

FAMILY = compiled_step  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_compiled_fedspeed_step(run_benchmark, case):
    run_benchmark(case)
