"""Peak host memory of one call of each benchmark case, each case in a fresh process (a markdown table).

Usage: python bench/peak_memory.py FAMILY [GROUP_PREFIX] > bench/results/NAME.md

Each case's inputs and model are built, the kernel's peak-RSS counter is reset (/proc/self/clear_refs), and the case
is called once: the reported peak is that call's resident high-water mark minus the resident size just before it,
i.e. what one cold call holds at its peak (a repeated call would reuse memory the allocator kept). Linux, CPU only.
"""

import argparse
import importlib
import json
import subprocess
import sys


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def _measure(family: str, index: int) -> dict:
    case = importlib.import_module(f"pyfedkern.benchmarks.{family}").cases(quick=False, device="cpu")[index]
    fn = case.timed()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status_kib("VmRSS")
    fn()
    peak = _status_kib("VmHWM")
    return {"group": case.group, "name": case.name, "peak_mib": max(0, peak - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("family")
    parser.add_argument("group_prefix", nargs="?", default="")
    parser.add_argument("--index", type=int, default=None, help=argparse.SUPPRESS)  # child-process mode
    args = parser.parse_args()
    if args.index is not None:
        print(json.dumps(_measure(args.family, args.index)))
        return
    cases = importlib.import_module(f"pyfedkern.benchmarks.{args.family}").cases(quick=False, device="cpu")
    rows = []
    for i, case in enumerate(cases):
        if case.group.startswith(args.group_prefix) and not case.name.startswith("limit:"):
            cmd = [sys.executable, __file__, args.family, "--index", str(i)]
            rows.append(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# Peak memory per call: {args.family} {args.group_prefix}\n\n- commit: {commit}\n")
    for group in dict.fromkeys(r["group"] for r in rows):
        members = [r for r in rows if r["group"] == group]
        ours = next(r["peak_mib"] for r in members if r["name"] == "pyfedkern")
        print(f"### {group}\n\n| case | peak MiB | × pyfedkern |\n|---|---:|---:|")
        for r in members:
            ratio = f"{r['peak_mib'] / ours:.1f}×" if ours > 0 else ""
            print(f"| {r['name']} | {r['peak_mib']:.1f} | {ratio} |")
        print()


if __name__ == "__main__":
    main()
