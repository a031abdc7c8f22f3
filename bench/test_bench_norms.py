"""class_feature_norms vs the torch idiom; per-sample grad norms vs torch.func and materialisation (issue 6)."""

import pytest

from pyfedkern.benchmarks import norms as FAMILY  # noqa: N812  (conftest parametrizes `case` from it)


@pytest.mark.benchmark(disable_gc=True)
def test_norms(run_benchmark, case):
    run_benchmark(case)
