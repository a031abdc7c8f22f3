"""Benchmark building blocks: a :class:`Case` (one timed callable of a group) and a one-group input cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Case:
    """One timed callable.

    Attributes:
        group: what is computed and at which size, e.g. ``"weighted_sum K=10 d=1e6 float32 cpu"``; every case of a
            group computes the same result (or is the group's machine limit).
        name: who computes it (``"pyfedkern"``, ``"torch-idiom"``, ``"limit:copy"``, ...).
        make: builds the inputs (through the group's :class:`InputCache`) and returns the zero-argument callable to
            time; called once per case, outside the timing.
        bytes_moved: bytes the op must read + write at minimum (for GB/s), or 0.
        flops: floating-point operations (for GFLOP/s), or 0.
        device: "cpu" or "cuda" (GPU timings synchronise the device).
        before: optional builder, like ``make``, of a step run before every timed call and not timed (e.g. the
            torch op a training loop interleaves with the timed one).
        rounds: a fixed number of timed calls, instead of as many as fit in the suite's time budget.
        statistic: "median" of the timed calls, or "mean" where rare long calls (stalls) are what is measured.
    """

    group: str
    name: str
    make: Callable[[], Callable[[], Any]]
    bytes_moved: int = 0
    flops: int = 0
    device: str = "cpu"
    info: dict[str, Any] = field(default_factory=dict)
    before: Callable[[], Callable[[], Any]] | None = None
    rounds: int | None = None
    statistic: str = "median"

    @property
    def id(self) -> str:
        return f"{self.group} | {self.name}"

    @property
    def is_limit(self) -> bool:
        return self.name.startswith("limit:")

    def timed(self) -> Callable[[], Any]:
        """The callable to time; on the GPU it waits for the device so the time covers the kernels."""
        fn = self.make()
        if self.device != "cuda":
            return fn

        def synced() -> Any:
            result = fn()
            torch.cuda.synchronize()
            return result

        return synced


class InputCache:
    """Holds the inputs of one group at a time, so a suite of large sizes never keeps two groups in memory."""

    def __init__(self) -> None:
        self._key: Any = None
        self._value: Any = None

    def get(self, key: Any, build: Callable[[], Any]) -> Any:
        if key != self._key:
            self._key, self._value = None, None
            self._value = build()
            self._key = key
        return self._value


def time_case(case: Case, *, min_time: float = 0.2, max_rounds: int = 50) -> float:
    """Seconds per call of a case, its ``statistic`` over the timed calls: a warm-up call, then ``case.rounds``
    calls, or at least 3 and up to ``min_time`` seconds; ``case.before``'s step runs untimed before each call."""
    fn = case.timed()
    before = case.before() if case.before else lambda: None
    before()
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while (
        len(times) < case.rounds
        if case.rounds
        else len(times) < 3 or (time.perf_counter() - start < min_time and len(times) < max_rounds)
    ):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if case.statistic == "mean":
        return sum(times) / len(times)
    times.sort()
    return times[len(times) // 2]


def fmt_size(n: float) -> str:
    """1000000 → '1e6', 11200000 → '1.12e7', 100 → '100'."""
    return f"{n:.3g}".replace("e+0", "e").replace("e+", "e")
