"""Kernels next to torch on a shared CPU: pyfedkern ops interleaved with torch ops while one busy process per CPU
loads the machine, against the same bursts on one thread (docs/cpu-threads.md). Meant to run under load: the
fixture makes it."""

import pytest

from pyfedkern.benchmarks import shared_cpu

FAMILY = shared_cpu  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.fixture(scope="module", autouse=True)
def loaded_cpus():
    with shared_cpu.background_load():
        yield


@pytest.mark.benchmark(disable_gc=True)
def test_shared_cpu(run_benchmark, case):
    run_benchmark(case)
