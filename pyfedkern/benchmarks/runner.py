"""Run a family's cases without pytest (``pyfedkern bench``) and turn timings into ratio tables.

The same :func:`report` formats pytest-benchmark JSON (bench/report.py), so the CLI and the recorded runs in
bench/results/ read alike: per group, each case's time, GB/s or GFLOP/s, speed relative to pyfedkern, and
pyfedkern's fraction of the group's machine limit (flagged unreliable above 100 %).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from pyfedkern.benchmarks.common import time_case


@dataclass
class Row:
    """One timed case: group, name, median seconds per call, bytes moved and flops per call, and the peak memory
    of one call in bytes (0 when not measured)."""

    group: str
    name: str
    seconds: float
    bytes_moved: int = 0
    flops: int = 0
    peak_bytes: int = 0


#: Said of a fraction of a machine limit above 100 %, which no kernel can reach: the timings are unreliable.
_ABOVE_LIMIT = (
    " (above 100 %: unreliable, the machine's load changed between the timings; run again on an idle machine)"
)


def machine_load() -> str:
    """The machine's 1-minute load and CPU count, with a warning when other work would distort the timings."""
    load = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    line = f"machine load: {load:.2f} (1-minute average) on {cpus} CPUs"
    if load > 0.5 * cpus:
        line += (
            "\nwarning: the machine is busy; timings of multi-threaded kernels and ratios between them are "
            "unreliable (run on an idle machine, or compare within one run only)"
        )
    return line


def run(family: str, quick: bool = True, device: str | None = None, progress: bool = True) -> list[Row]:
    """Time every case of ``pyfedkern.benchmarks.<family>`` (on CUDA too when a GPU is present), inside the
    family's ``background_load()`` when it defines one.

    A group's machine limits (``limit:`` cases) are timed before and after its other cases, and the faster time
    kept: a limit measured while the machine was busier than during the cases would make them look faster than
    the machine allows. The limits come last in the group's rows."""
    module = importlib.import_module(f"pyfedkern.benchmarks.{family}")
    devices = [device] if device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows: list[Row] = []
    with getattr(module, "background_load", contextlib.nullcontext)():
        for dev in devices:
            cases = module.cases(quick=quick, device=dev)
            bar = tqdm(total=len(cases), desc=f"{family} ({dev})", disable=not progress, leave=False)
            for group in dict.fromkeys(case.group for case in cases):
                members = [case for case in cases if case.group == group]
                limits = [case for case in members if case.is_limit]
                before = [time_case(case) for case in limits]
                for case in members:
                    if not case.is_limit:
                        rows.append(Row(case.group, case.name, time_case(case), case.bytes_moved, case.flops))
                        bar.update(1)
                for case, first in zip(limits, before, strict=True):
                    seconds = min(first, time_case(case))
                    rows.append(Row(case.group, case.name, seconds, case.bytes_moved, case.flops))
                    bar.update(1)
            bar.close()
    return rows


def report(rows: list[Row]) -> str:
    """A markdown table per group with rates and ratios (higher ``speedup`` = pyfedkern faster than that case)."""
    lines: list[str] = []
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    for group, members in groups.items():
        ours = next((r for r in members if r.name == "pyfedkern"), None)
        # Peers are the other ways of doing it (pyfedkern's own variants of the group are not peers).
        peers = [r for r in members if not r.name.startswith(("pyfedkern", "limit:"))]
        limits = [r for r in members if r.name.startswith("limit:")]
        memory = any(r.peak_bytes for r in members)
        header = "| case | time (ms) | GB/s | GFLOP/s | pyfedkern speedup |"
        rule = "|---|---:|---:|---:|---:|"
        if memory:
            header, rule = header + " peak MiB | memory vs pyfedkern |", rule + "---:|---:|"
        lines += [f"### {group}", "", header, rule]
        for r in members:
            gbs = f"{r.bytes_moved / r.seconds / 1e9:.1f}" if r.bytes_moved else ""
            gfl = f"{r.flops / r.seconds / 1e9:.1f}" if r.flops else ""
            other = ours and r is not ours and not r.name.startswith("limit:")
            speed = f"{r.seconds / ours.seconds:.2f}×" if other else ""
            line = f"| {r.name} | {r.seconds * 1e3:.3f} | {gbs} | {gfl} | {speed} |"
            if memory:
                ratio = f"{r.peak_bytes / ours.peak_bytes:.1f}×" if other and r.peak_bytes and ours.peak_bytes else ""
                line += f" {r.peak_bytes / 2**20:.1f} | {ratio} |" if r.peak_bytes else " | |"
            lines.append(line)
        notes = []
        if ours and peers:
            best = min(peers, key=lambda r: r.seconds)
            notes.append(f"vs fastest peer ({best.name}): {best.seconds / ours.seconds:.2f}×")
        for lim in limits if ours else []:
            if lim.flops and ours.flops:  # a compute limit (a GEMM of the same size): compare work rates
                frac = (ours.flops / ours.seconds) / (lim.flops / lim.seconds)
                note = f"throughput vs {lim.name}: {100 * frac:.0f}% (time {ours.seconds / lim.seconds:.2f}×)"
            elif lim.bytes_moved and ours.bytes_moved:
                frac = (ours.bytes_moved / ours.seconds) / (lim.bytes_moved / lim.seconds)
                note = f"bandwidth vs {lim.name}: {100 * frac:.0f}%"
            else:
                continue
            notes.append(note + (_ABOVE_LIMIT if frac > 1 else ""))
        if notes:
            lines += ["", "pyfedkern " + "; ".join(notes) + "."]
        lines.append("")
    return "\n".join(lines)
