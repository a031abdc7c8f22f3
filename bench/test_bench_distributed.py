"""Rounds spread over processes: FedAvg and SCAFFOLD rounds at 10,000 clients (logreg, mlp) and FedAvg at
the largest client count, in 1 and 2 gloo workers (one thread each) and in one process with two threads, in the same
run; each case records its peak resident memory per rank (``peak_rss_mb_per_rank``). ``--quick``: 200 clients."""

import pytest

from pyfedkern.benchmarks import distributed

FAMILY = distributed  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_distributed(run_benchmark, benchmark, case):
    run_benchmark(case)
    peaks = distributed.PEAKS[case.id]
    benchmark.extra_info["peak_rss_mb_per_rank"] = peaks
    benchmark.extra_info["peak_memory_bytes"] = int(max(peaks) * 2**20)  # the largest rank's, for bench/report.py
