"""class_feature_norms vs the torch idiom; per-sample grad norms vs torch.func and materialisation.
Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import norms

FAMILY = norms  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_norms(run_benchmark, case):
    run_benchmark(case)
