"""Per-thread CPU time of a bench family's cases, for a machine shared with other jobs: wall clock counts the time
a job waits for a core, ``time.thread_time`` does not (it still counts the other jobs' use of the caches and memory).

    python bench/cpu_time.py robust [--rounds 11] [--quick] [--cache cold|warm] [--group krum]

One thread (torch's and pyfedkern's). Per group, every case is built and called twice, then timed ``--rounds`` times
(fewer where the family caps them). ``cold`` (the default): the cases are called in turn, one call each per round,
each after a 64 MiB buffer is written (not timed), so every case starts with its inputs, and the Python and library
code it runs, out of the caches, whatever ran before it. ``warm``: each case's calls run back to back, as
pytest-benchmark times them (inputs that fit stay in the caches). The table gives each case's median in ms and its
ratio to the group's first case. Sizes come from the family (e.g. ``PYFEDKERN_BENCH_ROBUST``). CPU cases only.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from itertools import groupby

import torch

import pyfedkern


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("family", help="a module of pyfedkern.benchmarks, e.g. robust")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--group", default="", help="time only the groups whose name contains this")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    pyfedkern.set_num_threads(1)
    family = importlib.import_module(f"pyfedkern.benchmarks.{args.family}")
    cases = [c for c in family.cases(quick=args.quick) if c.device == "cpu" and args.group in c.group]
    evict = torch.empty(16 << 20)  # 64 MiB: more than this machine's last-level cache
    print("| group | case | ms | ratio |\n|---|---|---:|---:|")
    for group, grouped in groupby(cases, key=lambda c: c.group):
        members = list(grouped)
        calls = {c.name: c.make() for c in members}
        for fn in calls.values():
            fn(), fn()
        times: dict[str, list[float]] = {name: [] for name in calls}
        rounds = min([args.rounds] + [c.rounds for c in members if c.rounds])  # a family's cap for huge sizes
        order = (
            [name for _ in range(rounds) for name in calls]
            if args.cache == "cold"
            else [name for name in calls for _ in range(rounds)]
        )
        for name in order:
            if args.cache == "cold":
                evict.fill_(1.0)
            start = time.thread_time()
            calls[name]()
            times[name].append(time.thread_time() - start)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        first = next(iter(medians.values()))
        for name, ms in medians.items():
            print(f"| {group} | {name} | {ms:.3f} | {ms / first:.2f} |", flush=True)


if __name__ == "__main__":
    main()
