"""Turn a pytest-benchmark JSON file into the markdown ratio tables of bench/results/.

Usage: python bench/report.py RUN.json [--title TEXT] > bench/results/NAME.md
"""

import argparse
import json
import platform
import subprocess

from pyfedkern.benchmarks.runner import Row, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json_file")
    parser.add_argument("--title", default="pyfedkern benchmark")
    args = parser.parse_args()
    with open(args.json_file) as f:
        data = json.load(f)
    rows = [
        Row(
            b["group"],
            b["extra_info"].get("case", b["name"]),
            b["stats"][b["extra_info"].get("statistic", "median")],
            b["extra_info"].get("bytes_moved", 0),
            b["extra_info"].get("flops", 0),
            b["extra_info"].get("peak_memory_bytes", 0),
        )
        for b in data["benchmarks"]
    ]
    info = data.get("machine_info", {})
    commit = (
        data.get("commit_info", {}).get("id")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    print(f"# {args.title}\n")
    print(f"- date: {data.get('datetime', '')}")
    print(f"- commit: {commit}")
    print(
        f"- machine: {info.get('cpu', {}).get('brand_raw', platform.processor())}, "
        f"{info.get('cpu', {}).get('count', '?')} logical CPUs, {platform.system()} {platform.release()}"
    )
    python = info.get("python_version", platform.python_version())
    print(f"- python {python}; times are medians of 5–200 rounds (at least 0.5 s per case) unless the group's notes")
    print("  say otherwise\n")
    print(report(rows))


if __name__ == "__main__":
    main()
