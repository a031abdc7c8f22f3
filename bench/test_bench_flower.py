"""Server aggregation in Flower: pyfedkern's strategy and drop-ins vs Flower's aggregate/aggregate_inplace and
message-API FedAvg on the same results. Peak memory (tracemalloc) goes to each benchmark's extra_info.
Targets: bench/results/README.md."""

import pytest

from pyfedkern.benchmarks import flower

pytest.importorskip("flwr")

FAMILY = flower  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_flower_aggregation(run_benchmark, benchmark, case):
    benchmark.extra_info["peak_memory_bytes"] = flower.peak_memory(case)
    run_benchmark(case)
