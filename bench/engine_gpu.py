"""One engine round per algorithm on the GPU, batched against the per-client loop (the loop only at m = 100, where
it takes seconds rather than minutes), medians of 3 rounds after a warm-up round; a markdown table on stdout.
The pytest-benchmark suite bench/test_bench_engine.py times the same rounds (``-k cuda``) with more repetitions.
Usage: python bench/engine_gpu.py [cuda|cpu]"""

from __future__ import annotations

import sys

from pyfedkern.benchmarks import engine
from pyfedkern.benchmarks.common import time_case


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    print(f"| group ({device}) | pyfedkern ms | per-client loop ms | speedup |")
    print("|---|---:|---:|---:|")
    by_group: dict[str, dict[str, float]] = {}
    for case in engine.cases(device=device):
        if not case.group.startswith("engine_round"):
            continue
        if case.name != "pyfedkern" and " m=100 " not in case.group:
            continue
        by_group.setdefault(case.group, {})[case.name] = time_case(case, min_time=0.0, max_rounds=3) * 1e3
        times = by_group[case.group]
        if len(times) == 2 or (case.name != "pyfedkern" or " m=100 " not in case.group):
            ours = times.get("pyfedkern", float("nan"))
            loop = next((v for k, v in times.items() if k != "pyfedkern"), float("nan"))
            print(f"| {case.group} | {ours:.1f} | {loop:.1f} | {loop / ours:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
