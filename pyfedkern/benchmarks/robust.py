"""Benchmark cases of the robust ops: pyfedkern vs Flower's ``aggregate_*`` functions, NumPy and torch.

Peers on the same [K, d] float32 stack (Flower gets its format, one ndarray layer per client, views of the stack):
coordinate median vs Flower's ``aggregate_median``, ``np.median(axis=0)`` and ``torch.median(dim=0)`` (torch's
lower median for even K: a peer, not the same numbers); trimmed mean (β = 0.1) vs ``aggregate_trimmed_avg`` and a
``torch.sort``-based mean; Krum's choice (f = K/10) vs ``aggregate_krum`` and ``torch.cdist`` + topk; Bulyan vs
``aggregate_bulyan``. Limit: a copy of the rows (the memory limit of a one-pass rule). Krum is also timed against
torch's Gram product X·Xᵀ alone (a GEMM; pyfedkern's own Gram kernel does half its multiply-adds). Krum runs twice:
on the ``torch.randn`` rows (updates around 0) and on model-like rows (a common ``torch.randn`` vector plus 0.01
times other ``torch.randn`` rows), whose Gram product has to be taken around a row.

Sizes: K ∈ {10, 50, 100} × d ∈ {10⁵, 1.6·10⁶, 1.1·10⁷}; ``PYFEDKERN_BENCH_ROBUST="K:d,K:d"`` picks a subset
(``--quick``: 10:100000 and 50:100000). Flower's Krum and Bulyan compute K² distances in a Python loop (and Bulyan
θ times): they run only where K²·d (×θ) stays below :data:`FLOWER_KRUM_MAX` / :data:`FLOWER_BULYAN_MAX`. Sizes with
K·d above :data:`LARGE` (d = 1.1·10⁷ at K ≥ 50) time one call per case, of pyfedkern, X·Xᵀ and the limits only (no
Bulyan): the peers' copies and sorts of a 2–4 GB stack would take minutes and more memory than the machine has.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

FULL_SIZES = [(K, d) for K in (10, 50, 100) for d in (10**5, 1_626_442, 11_000_000)]
QUICK_SIZES = [(10, 10**5), (50, 10**5)]
BETA = 0.1
FLOWER_KRUM_MAX = 10**10  # K²·d above which Flower's Python distance loop is not timed
FLOWER_BULYAN_MAX = 10**10  # θ·K²·d likewise for Flower's Bulyan
GRAM = "torch X@X.T (the Gram product alone)"  # Krum's target: within 1.3× of it
LARGE = 2 * 10**8  # K·d above which a size runs one timed call per case, pyfedkern, X·Xᵀ and the limits only


def sizes(quick: bool) -> list[tuple[int, int]]:
    """The (K, d) pairs to run: ``PYFEDKERN_BENCH_ROBUST`` when set, else the quick or the full set."""
    chosen = os.environ.get("PYFEDKERN_BENCH_ROBUST", "").strip()
    if chosen:
        return [(int(k), int(float(d))) for k, d in (pair.split(":") for pair in chosen.split(","))]
    return QUICK_SIZES if quick else FULL_SIZES


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """Four groups (median, trimmed mean, Krum, Bulyan) per (K, d) on ``device``."""
    cache = InputCache()
    out: list[Case] = []
    for K, d in sizes(quick):

        def inputs(K: int = K, d: int = d) -> dict:
            def build() -> dict:
                gen = torch.Generator().manual_seed(0)
                X = torch.randn(K, d, generator=gen).to(device)
                host = X.cpu().numpy()
                return {"X": X, "copy": torch.empty_like(X), "results": [([host[k]], 1) for k in range(K)]}

            return cache.get((K, d, device), build)

        nbytes = (K + 1) * d * 4
        f = max(1, K // 10)
        where = f"K={K} d={fmt_size(d)} float32 {device}"

        def limit_copy(inputs=inputs):
            a = inputs()
            return lambda: a["copy"].copy_(a["X"])

        def limit_sum(inputs=inputs):  # read the rows once: what any coordinate rule must do
            a = inputs()
            return lambda: a["X"].sum(0)

        def median(inputs=inputs):
            a = inputs()
            return lambda: ops.coordinate_median(a["X"])

        def torch_median(inputs=inputs):
            a = inputs()
            return lambda: torch.median(a["X"], dim=0).values

        def trimmed(inputs=inputs):
            a = inputs()
            return lambda: ops.trimmed_mean(a["X"], BETA)

        def torch_trimmed(inputs=inputs, K=K):
            a = inputs()
            cut = int(BETA * K)
            return lambda: torch.sort(a["X"], dim=0).values[cut : K - cut].mean(0)

        def models(K: int = K, d: int = d) -> dict:  # a common part: K trained models (built when first timed)
            def build() -> dict:
                gen = torch.Generator().manual_seed(1)
                common = torch.randn(d, generator=gen)
                return {"X": (common + 0.01 * torch.randn(K, d, generator=gen)).to(device)}

            return cache.get((K, d, device, "models"), build)

        def krum(inputs=inputs, f=f):
            a = inputs()
            return lambda: a["X"][int(ops.krum_select(a["X"], f)[0])]

        def torch_cdist_krum(inputs=inputs, f=f, K=K):
            a = inputs()
            X = a["X"]

            def run():
                dist = torch.cdist(X, X) ** 2
                near = dist.topk(max(1, K - f - 2) + 1, dim=1, largest=False).values[:, 1:].sum(1)
                return X[int(near.argmin())]

            return run

        def gram(inputs=inputs):
            a = inputs()
            return lambda: a["X"] @ a["X"].T

        def bulyan(inputs=inputs, f=f):
            a = inputs()
            return lambda: ops.bulyan(a["X"], f)

        groups = [
            (
                f"coordinate_median {where}",
                [("pyfedkern", median), ("torch.median(dim=0)", torch_median), ("limit:sum", limit_sum)],
            ),
            (
                f"trimmed_mean beta={BETA} {where}",
                [("pyfedkern", trimmed), ("torch.sort trimmed mean", torch_trimmed), ("limit:sum", limit_sum)],
            ),
            (
                f"krum f={f} {where}",
                [("pyfedkern krum_select", krum), ("torch.cdist + topk", torch_cdist_krum), (GRAM, gram)],
            ),
            (f"bulyan f={f} {where}", [("pyfedkern", bulyan)]),
            (
                f"krum models f={f} {where}",
                [
                    ("pyfedkern krum_select", lambda krum=krum, models=models: krum(models)),
                    (GRAM, lambda gram=gram, models=models: gram(models)),
                ],
            ),
        ]
        large = K * d > LARGE
        if large:  # the peers copy or sort the stack (gigabytes at K=100, d=1.1e7; minutes per call): left out
            groups = [
                (group, [peer for peer in peers if peer[0].startswith(("pyfedkern", "limit", GRAM))])
                for group, peers in groups
                if not group.startswith("bulyan")
            ]
        if device == "cpu" and not large:
            from flwr.server.strategy import aggregate as flower

            def flower_median(inputs=inputs):
                a = inputs()
                return lambda: flower.aggregate_median(a["results"])

            def numpy_median(inputs=inputs):
                a = inputs()
                host = a["X"].numpy()
                return lambda: np.median(host, axis=0)

            def flower_trimmed(inputs=inputs):
                a = inputs()
                return lambda: flower.aggregate_trimmed_avg(a["results"], BETA)

            def flower_krum(inputs=inputs, f=f):
                a = inputs()
                return lambda: flower.aggregate_krum(a["results"], f, 0)

            def flower_bulyan(inputs=inputs, f=f):
                a = inputs()
                return lambda: flower.aggregate_bulyan(list(a["results"]), f, flower.aggregate_krum, to_keep=0)

            groups[0][1].extend([("flower aggregate_median", flower_median), ("np.median(axis=0)", numpy_median)])
            groups[1][1].append(("flower aggregate_trimmed_avg", flower_trimmed))
            if K * K * d <= FLOWER_KRUM_MAX:
                groups[2][1].append(("flower aggregate_krum", flower_krum))
            if K >= 4 * f + 3 and (K - 2 * f) * K * K * d <= FLOWER_BULYAN_MAX:
                groups[3][1].append(("flower aggregate_bulyan", flower_bulyan))
        if K < 4 * f + 3:  # Bulyan needs K >= 4f + 3
            groups = [(group, peers) for group, peers in groups if not group.startswith("bulyan")]
        rounds = 1 if large else None
        for group, peers in groups:
            out += [Case(group, name, make, nbytes, 0, device, rounds=rounds) for name, make in peers]
            out.append(Case(group, "limit:copy", limit_copy, 2 * K * d * 4, 0, device, rounds=rounds))
    return out
