"""Per-call overhead of pyfedkern's ops against the torch one-liner they replace, on tiny inputs (K=2, d=8).

Prints, per op and device: the synchronised call time (call + device synchronise, median of 2000), and the host
time per call when 1000 calls are queued before one synchronise (what a training loop pays). ``--dispatch``
instead compares each public op with its direct path (the op without the torch.compile / autograd routing in front
of it), interleaved in one process (the fastest of 40 blocks each), which is what that routing costs an eager
call. Usage:
    python bench/overhead.py [--device cpu|cuda] [--json OUT.json] [--dispatch]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.ops import aggregate, fedspeed, norms, pbc


def cases(device: str) -> dict[str, tuple]:
    X = torch.randn(2, 8, device=device)
    w_host = [0.5, 0.5]
    w_dev = torch.tensor(w_host, device=device)
    acc = torch.zeros(8, device=device)
    store = torch.randn(4, 8, device=device)
    server = torch.zeros(8, device=device)
    active, active_dev = np.array([1, 3]), torch.tensor([1, 3], device=device)
    x, g = torch.randn(8, device=device), torch.randn(8, device=device)
    f, y = torch.randn(16, 8, device=device), torch.randint(0, 4, (16,), device=device)

    def torch_norms():
        n = torch.linalg.vector_norm(f, dim=1)
        return torch.zeros(4, device=device).index_add_(0, y, n), torch.bincount(y, minlength=4)

    return {
        "weighted_sum K=2 d=8": (lambda: ops.weighted_sum(X, w_host), lambda: torch.tensordot(w_dev, X, dims=1)),
        "weighted_sum (device weights)": (
            lambda: ops.weighted_sum(X, w_dev),
            lambda: torch.tensordot(w_dev, X, dims=1),
        ),
        "accumulate_ d=8": (lambda: ops.accumulate_(acc, x, 0.5), lambda: acc.add_(x, alpha=0.5)),
        "pbc_agg_bcast_ k=2 d=8": (
            lambda: ops.pbc_agg_bcast_(store, server, active),
            lambda: (server.copy_(store[active_dev].mean(0)), store.index_copy_(0, active_dev, server.expand(2, 8))),
        ),
        "fedspeed_update_ d=8": (
            lambda: ops.fedspeed_update_(x, g, 0.1, weight_decay=1e-4),
            lambda: x.add_(g + 1e-4 * x, alpha=-0.1),
        ),
        "class_feature_norms B=16 D=8": (lambda: ops.class_feature_norms(f, y, 4), torch_norms),
    }


def dispatch_cases(device: str) -> dict[str, tuple]:
    """(public op, its direct path, (module, name) of the direct path's function) on the inputs of :func:`cases`."""
    X, w = torch.randn(2, 8, device=device), [0.5, 0.5]
    acc, x, g = torch.zeros(8, device=device), torch.randn(8, device=device), torch.randn(8, device=device)
    store, server, active = torch.randn(4, 8, device=device), torch.zeros(8, device=device), np.array([1, 3])
    f, y = torch.randn(16, 8, device=device), torch.randint(0, 4, (16,), device=device)
    return {
        "weighted_sum": (
            lambda: ops.weighted_sum(X, w),
            lambda: aggregate._weighted_sum(X, w, None),
            (aggregate, "_weighted_sum"),
        ),
        "accumulate_": (
            lambda: ops.accumulate_(acc, x, 0.5),
            lambda: aggregate._accumulate(acc, x, 0.5),
            (aggregate, "_accumulate"),
        ),
        "pbc_agg_bcast_": (
            lambda: ops.pbc_agg_bcast_(store, server, active),
            lambda: pbc._pbc_agg_bcast(store, server, active),
            (pbc, "_pbc_agg_bcast"),
        ),
        "fedspeed_update_": (
            lambda: ops.fedspeed_update_(x, g, 0.1, weight_decay=1e-4),
            lambda: fedspeed._fedspeed_update(x, g, 0.1, None, 1.0, None, 0.0, 1e-4, None, None),
            (fedspeed, "_fedspeed_update"),
        ),
        "class_feature_norms": (
            lambda: ops.class_feature_norms(f, y, 4),
            lambda: norms._class_feature_norms(f, y, 4, None),
            (norms, "_class_feature_norms"),
        ),
    }


def fastest_blocks(calls: dict[str, Callable[[], Any]], device: str) -> dict[str, list[float]]:
    """µs per call of each of ``calls`` in 40 alternating blocks of 1000 calls."""
    samples: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(40):
        for label, fn in calls.items():
            samples[label].append(queued(fn, device, n=1000))
    return samples


def dispatch_report(device: str) -> None:
    """Per-call µs of the public op and of its direct path, the fastest of 40 alternating blocks of 1000 calls (a
    busy machine only ever slows a block down: the medians of a shared 2-core VM wander by 1–2 µs on a 15 µs call),
    and the median block for comparison. "routing alone": the same difference with the direct path's function
    replaced by one that returns at once, so that the kernel's own variation (about 1 µs) does not hide it."""
    print(f"| op ({device}) | public µs | direct µs | routing cost µs | routing alone µs | medians: public, direct |")
    print("|---|---:|---:|---:|---:|---|")
    for name, (public, direct, (module, attr)) in dispatch_cases(device).items():
        samples = fastest_blocks({"public": public, "direct": direct}, device)
        p, d = min(samples["public"]), min(samples["direct"])
        kernel = getattr(module, attr)
        setattr(module, attr, lambda *args, **kwargs: None)
        try:
            stubbed = fastest_blocks({"public": public, "direct": direct}, device)
        finally:
            setattr(module, attr, kernel)
        alone = min(stubbed["public"]) - min(stubbed["direct"])
        medians = f"{statistics.median(samples['public']):.2f}, {statistics.median(samples['direct']):.2f}"
        print(f"| {name} | {p:.2f} | {d:.2f} | {p - d:+.2f} | {alone:+.2f} | {medians} |")


def synced(fn, device: str, n: int = 2000) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def queued(fn, device: str, n: int = 1000) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json")
    parser.add_argument("--dispatch", action="store_true", help="public op vs its direct path, per call")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.dispatch:
        dispatch_report(args.device)
        return
    rows = []
    header = "pyfedkern synced µs | torch synced µs | ratio | pyfedkern queued µs | torch queued µs"
    print(f"| op ({args.device}) | {header} |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (ours, theirs) in cases(args.device).items():
        for fn in (ours, theirs):
            for _ in range(200):
                fn()
        s_ours, s_theirs = synced(ours, args.device), synced(theirs, args.device)
        q_ours, q_theirs = queued(ours, args.device), queued(theirs, args.device)
        rows.append(
            {
                "op": name,
                "device": args.device,
                "ours_synced_us": s_ours,
                "torch_synced_us": s_theirs,
                "ours_queued_us": q_ours,
                "torch_queued_us": q_theirs,
            }
        )
        print(f"| {name} | {s_ours:.1f} | {s_theirs:.1f} | {s_ours / s_theirs:.2f}× | {q_ours:.1f} | {q_theirs:.1f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
