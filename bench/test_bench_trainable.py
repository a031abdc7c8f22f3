"""Rounds of models with frozen parts: a frozen-backbone CNN and LoRA adapters of a tiny BERT at 100 clients a round,
batched against the per-client loop and against federating the whole model (everything unfrozen), seconds per round;
peak memory: ``python bench/peak_memory.py trainable`` (``trainable_chunk``: the memory one client chunk row adds,
LoRA adapters of a BERT of hidden 512). Record: bench/results/2026-11-28-cpu-trainable.md."""

import pytest

from pyfedkern.benchmarks import trainable

FAMILY = trainable  # bench/conftest.py parametrizes `case` over FAMILY.cases()


@pytest.mark.benchmark(disable_gc=True)
def test_trainable(run_benchmark, case):
    run_benchmark(case)
