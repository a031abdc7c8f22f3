"""Benchmark cases of kernels next to torch on a shared CPU: pyfedkern ops interleaved with torch ops while busy
processes load every core (docs/cpu-threads.md).

Every timed call of an op follows an untimed torch op (a Linear layer's forward on a batch of 64 MNIST-sized rows,
on torch's default threads unless the case says otherwise), as in a training loop, while
:func:`background_load` keeps one busy process per CPU running. Groups report the *mean* time of many calls:
a kernel that wakes a thread pool for microseconds of work stalls for a scheduler time slice (milliseconds)
whenever a woken thread is not scheduled, which leaves the median untouched and multiplies the mean.
Cases of a group compute the same op:

- ``pyfedkern``: pyfedkern's op on its default threads;
- ``pyfedkern on 1 thread``: pyfedkern on one thread (what pyfedkern's threads cost or gain here);
- ``pyfedkern, all on 1 thread``: pyfedkern and torch on one thread each, as with ``OMP_NUM_THREADS=1``;
- ``torch idiom`` and ``torch idiom, all on 1 thread``: the op written the usual torch way, default and one thread.

Sizes: the small ops of the issue (d = 7,850, a digits/MNIST logistic model; K×d = 10×20,000), which run on the
calling thread, and larger ones that use two threads.

``python -m pyfedkern.benchmarks.shared_cpu [quick|full] [busy processes]`` prints each case's per-call latency
(mean, median, 99th percentile, worst, calls over 1 ms) with the cases of a group alternating call by call, so that
all of them see the same background load.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import pyfedkern
from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

RHO = 0.05
DEFAULT_THREADS = torch.get_num_threads(), pyfedkern.get_num_threads()  # (torch, pyfedkern) when first imported


@contextlib.contextmanager
def background_load(processes: int | None = None) -> Iterator[None]:
    """Keep ``processes`` busy Python processes (default: one per CPU) running for the duration of the block; the
    thread counts of torch and pyfedkern (which the cases set) are restored at the end."""
    count = processes if processes is not None else os.cpu_count() or 1
    threads = torch.get_num_threads(), pyfedkern.get_num_threads()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()
        torch.set_num_threads(threads[0])
        pyfedkern.set_num_threads(threads[1])


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per op and size (CPU only: the contention is between CPU thread pools)."""
    if device != "cpu":
        return []
    cache = InputCache()
    big = 200_000 if quick else 1_000_000

    def inputs() -> dict:
        def build() -> dict:
            gen = torch.Generator().manual_seed(0)
            return {
                "batch": torch.randn(64, 784, generator=gen),
                "weight": torch.randn(784, 128, generator=gen),
                "bias": torch.randn(128, generator=gen),
                "store": torch.randn(20, 7850, generator=gen),
                "server": torch.empty(7850),
                "active": np.arange(0, 20, 4),
                "active_t": torch.arange(0, 20, 4),
                "small": torch.randn(10, 20_000, generator=gen),
                "big": torch.randn(10, big, generator=gen),
                "w": np.full(10, 0.1),
                "w_t": torch.full((10,), 0.1),
                "x": torch.randn(200_000, generator=gen),
                "g": torch.randn(200_000, generator=gen),
            }

        return cache.get(quick, build)

    def agg_ours(a: dict) -> Callable[[], Any]:
        return lambda: ops.pbc_agg_bcast_(a["store"], a["server"], a["active"])

    def agg_idiom(a: dict) -> Callable[[], Any]:
        def run() -> torch.Tensor:
            a["server"].copy_(a["store"][a["active_t"]].mean(0))
            a["store"][a["active_t"]] = a["server"]
            return a["server"]

        return run

    def sum_ours(key: str) -> Callable[[dict], Callable[[], Any]]:
        return lambda a: lambda: ops.weighted_sum(a[key], a["w"])

    def sum_idiom(key: str) -> Callable[[dict], Callable[[], Any]]:
        return lambda a: lambda: torch.tensordot(a["w_t"], a[key], dims=1)

    def perturb_ours(a: dict) -> Callable[[], Any]:
        return lambda: ops.sam_perturb(a["x"], a["g"], RHO)

    def perturb_idiom(a: dict) -> Callable[[], Any]:
        return lambda: a["x"] + (RHO / (a["g"].norm() + 1e-12)) * a["g"]

    groups = [  # label, pyfedkern, torch idiom, timed calls
        ("pbc_agg_bcast m=20 k=5 d=7850", agg_ours, agg_idiom, 3000),
        ("weighted_sum K=10 d=2e4", sum_ours("small"), sum_idiom("small"), 3000),
        ("sam_perturb d=2e5", perturb_ours, perturb_idiom, 1000),
        (f"weighted_sum K=10 d={fmt_size(big)}", sum_ours("big"), sum_idiom("big"), 200),
    ]
    if quick:
        groups = groups[:2]
    variants = [  # case name, pyfedkern's op?, (torch threads, pyfedkern threads)
        ("pyfedkern", True, DEFAULT_THREADS),
        ("pyfedkern on 1 thread", True, (DEFAULT_THREADS[0], 1)),
        ("pyfedkern, all on 1 thread", True, (1, 1)),
        ("torch idiom", False, DEFAULT_THREADS),
        ("torch idiom, all on 1 thread", False, (1, 1)),
    ]
    out: list[Case] = []
    for label, ours, idiom, rounds in groups:
        rounds = 100 if quick else rounds
        group = f"{label} float32 cpu after a torch op, all CPUs loaded (mean of {rounds} calls)"
        for name, is_ours, threads in variants:

            def make(op: Callable = ours if is_ours else idiom) -> Callable[[], Any]:
                return op(inputs())

            def torch_step(threads: tuple[int, int] = threads) -> Callable[[], Any]:
                a = inputs()
                batch, weight, bias = a["batch"], a["weight"], a["bias"]

                def run() -> None:
                    if torch.get_num_threads() != threads[0]:
                        torch.set_num_threads(threads[0])
                    pyfedkern.set_num_threads(threads[1])
                    torch.addmm(bias, batch, weight)

                return run

            out.append(Case(group, name, make, before=torch_step, rounds=rounds, statistic="mean"))
    return out


def latencies(group_cases: list[Case], rounds: int) -> dict[str, np.ndarray]:
    """Seconds of each timed call of every case, the cases alternating call by call (each after its torch step)."""
    steps = [(case.name, case.before() if case.before else (lambda: None), case.make()) for case in group_cases]
    times: dict[str, list[float]] = {name: [] for name, _, _ in steps}
    for _ in range(rounds + 1):  # the first round warms up
        for name, before, fn in steps:
            before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: np.asarray(t[1:]) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    """Per-call latency tables of every group, under ``background_load``."""
    args = sys.argv[1:] if argv is None else argv
    quick = (args[0] if args else "full") == "quick"
    processes = int(args[1]) if len(args) > 1 else None
    print(f"load before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with background_load(processes):
        all_cases = cases(quick=quick)
        for group in dict.fromkeys(c.group for c in all_cases):
            members = [c for c in all_cases if c.group == group]
            print(f"\n### {group.replace('(mean of', '(alternating,')}\n")
            print("| case | mean (ms) | median (ms) | p99 (ms) | worst (ms) | calls over 1 ms |")
            print("|---|---:|---:|---:|---:|---:|")
            for name, t in latencies(members, members[0].rounds or 100).items():
                ms = t * 1e3
                print(
                    f"| {name} | {ms.mean():.3f} | {np.median(ms):.3f} | {np.percentile(ms, 99):.3f} | "
                    f"{ms.max():.2f} | {int((ms > 1).sum())}/{ms.size} |",
                    flush=True,
                )
    print(f"\nload after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
