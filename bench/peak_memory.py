"""Peak host memory of one warm call of each benchmark case, each case in a fresh process (a markdown table).

Usage: python bench/peak_memory.py [--allocated] FAMILY [GROUP_PREFIX] > bench/results/NAME.md

What is measured, the same way for every case (pyfedkern, its peers and the ``limit:`` floor):

1. The child process runs with glibc's ``MALLOC_MMAP_THRESHOLD_=65536`` and ``MALLOC_TRIM_THRESHOLD_=0``: every
   buffer of 64 KiB or more is mapped when allocated and unmapped when freed, and the heap is trimmed on free, so the
   resident size follows the memory actually live. (glibc's defaults keep freed memory and raise the mapping
   threshold after the first large free, so a second call would reuse memory the first one left behind and look
   smaller than it is. torch's CPU tensors come from malloc; ``tracemalloc`` cannot see them.)
2. Warm-up: the family's quick-size cases of the same op (the group's first word) and the same name are called
   once each: other inputs and sizes, the same code paths. Library loading, thread pools, lazily built kernels and
   other one-time start-up allocations happen there, not in the measured call.
3. The case's own inputs and model are built, the resident high-water mark is reset (/proc/self/clear_refs) and the
   case is called once: the reported peak is VmHWM after the call minus VmRSS just before it, i.e. the call's own
   working set at its peak (inputs and model excluded). Linux, CPU only.

With ``--allocated`` step 3 reports instead the peak of the bytes torch's CPU allocator has handed out during the
call minus those at its start (torch.profiler's memory events): the tensors the call holds at once, to the byte,
blind to what malloc keeps or maps (buffers under 64 KiB stay in malloc's heap, so the resident size can miss them).
"""

import argparse
import datetime
import gc
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def _measure(family: str, index: int, allocated: bool) -> dict:
    module = importlib.import_module(f"pyfedkern.benchmarks.{family}")
    case = module.cases(quick=False, device="cpu")[index]
    op = case.group.split()[0]
    for warm in module.cases(quick=True, device="cpu"):
        if warm.name == case.name and warm.group.split()[0] == op:
            warm.timed()()
    fn = case.timed()
    gc.collect()
    if allocated:
        return {"group": case.group, "name": case.name, "peak_mib": _allocated_peak(fn) / 2**20}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    return {"group": case.group, "name": case.name, "peak_mib": max(0, peak - before) / 1024}


def _allocated_peak(fn) -> int:
    """Bytes: the most that torch's CPU allocator had handed out at once during ``fn()``, above its start."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    memory = sorted((e["ts"], e["args"]) for e in events if e.get("name") == "[memory]")
    if not memory:
        return 0
    start = memory[0][1]["Total Allocated"] - memory[0][1]["Bytes"]
    return max(0, max(args["Total Allocated"] for _, args in memory) - start)


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("family")
    parser.add_argument("group_prefix", nargs="?", default="")
    parser.add_argument("--allocated", action="store_true", help="the allocator's peak, not the resident size")
    parser.add_argument("--index", type=int, default=None, help=argparse.SUPPRESS)  # child-process mode
    args = parser.parse_args()
    if args.index is not None:
        print(json.dumps(_measure(args.family, args.index, args.allocated)))
        return
    cases = importlib.import_module(f"pyfedkern.benchmarks.{args.family}").cases(quick=False, device="cpu")
    rows = []
    env = {**os.environ, **MALLOC_ENV}
    for i, case in enumerate(cases):
        if case.group.startswith(args.group_prefix):
            cmd = [sys.executable, __file__, args.family, "--index", str(i)] + ["--allocated"] * args.allocated
            rows.append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout))
    malloc = " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# Peak memory per call: {args.family} {args.group_prefix}\n")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"- commit: {commit}")
    print(f"- machine: {_cpu_name()}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}")
    method = "torch's allocated bytes, --allocated" if args.allocated else malloc
    print(f"- python {platform.python_version()}; method: bench/peak_memory.py (warm call; {method})\n")
    for group in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == group]
        ours = next(r["peak_mib"] for r in members if r["name"].startswith("pyfedkern"))
        print(f"### {group}\n\n| case | peak MiB | × pyfedkern |\n|---|---:|---:|")
        for r in members:
            ratio = f"{r['peak_mib'] / ours:.1f}×" if ours > 0 else ""
            print(f"| {r['name']} | {r['peak_mib']:.1f} | {ratio} |")
        print()


if __name__ == "__main__":
    main()
