"""Whole FedAvg rounds on real models: pfl-research's CIFAR-10 cross-device setup (simple_cnn, 1,000 users
× 50 images, 50 a round, batch 10) and a LEAF-shaped Shakespeare task (2-layer LSTM, 715 users, 10 a round), at 1 and
2 threads: the engine's own path choice, its per-client loop, its batched path and pfl 0.6 when installed, next to
the machine's GEMM and convolution limits. ``python -m pyfedkern.benchmarks.engine_models`` times the same cases
alternately, round after round."""

import pytest

from pyfedkern.benchmarks import engine_models

FAMILY = engine_models  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_engine_models(run_benchmark, case):
    run_benchmark(case)
