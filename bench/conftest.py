"""pytest-benchmark suites: ``pytest bench/ --benchmark-json=out.json`` then ``python bench/report.py out.json``.

Each suite sets ``FAMILY`` to one family module in :mod:`pyfedkern.benchmarks` (pyfedkern, its peers and the
machine limit on the same inputs). ``--quick`` runs the small sizes only.
"""

import math
import time

import pytest
import torch

MIN_SECONDS, MIN_ROUNDS, MAX_ROUNDS = 0.5, 5, 200
GPU_WARMUP_SECONDS = 2.0


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", help="small sizes only")


def pytest_generate_tests(metafunc):
    """Parametrize ``case`` over the cases of the module's ``FAMILY`` (CPU, and CUDA when a GPU is present)."""
    if "case" in metafunc.fixturenames:
        quick = metafunc.config.getoption("--quick")
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        family = metafunc.module.FAMILY
        cases = [case for dev in devices for case in family.cases(quick=quick, device=dev)]
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


@pytest.fixture(scope="session", autouse=True)
def busy_gpu_first():
    """Keep the GPU busy for a while before the first case, so that the first groups are not timed while its
    clocks ramp up (on an H100 the first pbc group timed the torch idiom 10× slower than the next group did)."""
    if torch.cuda.is_available():
        a = torch.randn(4096, 4096, device="cuda")
        start = time.perf_counter()
        while time.perf_counter() - start < GPU_WARMUP_SECONDS:
            for _ in range(10):
                a = (a @ a).tanh_()
            torch.cuda.synchronize()


def run_case(benchmark, case):
    benchmark.group = case.group
    benchmark.name = case.name
    benchmark.extra_info.update(
        {"bytes_moved": case.bytes_moved, "flops": case.flops, "case": case.name, "statistic": case.statistic}
    )
    fn = case.timed()
    before = case.before() if case.before else None
    if before:
        before()
    start = time.perf_counter()
    fn()  # warm-up outside the timing, also sizes the number of rounds
    once = time.perf_counter() - start
    rounds = case.rounds or min(MAX_ROUNDS, max(MIN_ROUNDS, math.ceil(MIN_SECONDS / max(once, 1e-9))))

    def setup():  # the case's untimed step before every call (returns nothing: the timed call takes no arguments)
        before()

    benchmark.pedantic(fn, setup=setup if before else None, rounds=rounds, iterations=1, warmup_rounds=1)


@pytest.fixture
def run_benchmark(benchmark):
    return lambda case: run_case(benchmark, case)
