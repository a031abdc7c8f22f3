"""Time benchmark cases of two commits alternately, in one run: ``python bench/before_after.py BEFORE AFTER
--family engine [--quick] [--rounds N] [WORD ...]``.

Each commit is checked out into a temporary git worktree next to the installed compiled extension (the C++ must be
the same at both commits); one process per commit imports that tree's pyfedkern, builds the cases of the benchmark
family (:mod:`pyfedkern.benchmarks`) whose group contains every WORD, and warms each up once. Then the parent asks
the two processes for one timed call of every case in turn, BEFORE, AFTER, BEFORE, ..., so a changing machine load
hits both alike, and prints each case's median and minimum seconds and AFTER/BEFORE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyfedkern._C

# The child: the tree's pyfedkern ahead of the installed (editable) one, its cases built, then one timed call of
# every case per line read.
CHILD = r"""
import json, sys, time
tree, family, quick, words = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4:]
sys.meta_path = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]  # the editable install's
sys.path.insert(0, tree)
import importlib
import torch
torch.set_num_threads(1)
import pyfedkern
assert pyfedkern.__file__.startswith(tree), pyfedkern.__file__
module = importlib.import_module(f"pyfedkern.benchmarks.{family}")
cases = [c for c in module.cases(quick=quick) if all(w in c.group for w in words) and not c.is_limit]
cases = [c for c in cases if "pfl" not in c.name and "flower" not in c.name.lower()]
runs = [(c.id, c.make()) for c in cases]
for _, run in runs:
    run()
print(json.dumps([name for name, _ in runs]), flush=True)
for _ in sys.stdin:
    times = {}
    for name, run in runs:
        start = time.perf_counter()
        run()
        times[name] = time.perf_counter() - start
    print(json.dumps(times), flush=True)
"""


def checkout(ref: str, root: Path) -> Path:
    """A worktree of ``ref`` under ``root`` with the installed extension copied in."""
    tree = root / ref.replace("/", "_")
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), ref], check=True)
    extension = Path(pyfedkern._C.__file__)
    (tree / "pyfedkern" / extension.name).write_bytes(extension.read_bytes())
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("words", nargs="*")
    parser.add_argument("--family", default="engine")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_intermixed_args()
    with tempfile.TemporaryDirectory() as root:
        trees = [checkout(ref, Path(root)) for ref in (args.before, args.after)]
        try:
            children = [
                subprocess.Popen(
                    [sys.executable, "-c", CHILD, str(tree), args.family, str(int(args.quick)), *args.words],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for tree in trees
            ]
            names = [json.loads(child.stdout.readline()) for child in children]
            if names[0] != names[1]:
                raise SystemExit(f"the commits have different cases: {names[0]} vs {names[1]}")
            times = [{name: [] for name in names[0]} for _ in children]
            for _ in range(args.rounds):
                for child, record in zip(children, times, strict=True):
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    for name, seconds in json.loads(child.stdout.readline()).items():
                        record[name].append(seconds)
            for child in children:
                child.stdin.close()
                child.wait()
        finally:
            for tree in trees:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], check=False)
    print(f"| case | {args.before} median (min), s | {args.after} median (min), s | after/before (median) |")
    print("|---|---:|---:|---:|")
    for name in names[0]:
        before, after = times[0][name], times[1][name]
        ratio = statistics.median(after) / statistics.median(before)
        print(
            f"| {name} | {statistics.median(before):.4f} ({min(before):.4f}) "
            f"| {statistics.median(after):.4f} ({min(after):.4f}) | {ratio:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
