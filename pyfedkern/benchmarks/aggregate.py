"""Benchmark cases of weighted_sum: pyfedkern vs the ways FL code averages K model vectors today.

Peers on the same [K, d] float32 stack: the torch idiom ``(w[:, None] * X).sum(0)``, ``torch.tensordot``, the
in-place ``out.add_(X[k], alpha=w[k])`` loop, NumPy ``w @ X``, and Flower's per-layer
``reduce(np.add, [layer * w_k ...])`` over ResNet-18-like layer slices. Limits: a copy of the stack and a sum of it.
"""

from __future__ import annotations

from functools import reduce

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

FULL_SIZES = [(10, 10**6), (100, 10**6), (10, 11_200_000), (100, 11_200_000), (10, 10**7), (100, 10**7)]
QUICK_SIZES = [(10, 10**6), (100, 10**5)]
LAYERS = 62  # ResNet-18 has 62 parameter tensors


def _layer_bounds(d: int) -> list[tuple[int, int]]:
    """Split [0, d) into LAYERS slices of geometrically growing size, like a CNN's layers."""
    sizes = np.geomspace(1, 64, LAYERS)
    cuts = np.round(np.cumsum(sizes) / sizes.sum() * d).astype(np.int64)
    starts = np.concatenate([[0], cuts[:-1]])
    return [(int(a), int(b)) for a, b in zip(starts, cuts, strict=True) if b > a]


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per (K, d) on ``device`` ("cpu" or "cuda")."""
    cache = InputCache()
    out: list[Case] = []
    for K, d in QUICK_SIZES if quick else FULL_SIZES:

        def inputs(K: int = K, d: int = d) -> dict:
            def build() -> dict:
                gen = torch.Generator().manual_seed(0)
                X = torch.randn(K, d, generator=gen).to(device)
                w = torch.rand(K, generator=gen, dtype=torch.float64)
                w /= w.sum()
                return {
                    "X": X,
                    "w64": w.numpy(),
                    "w": w.to(device=device, dtype=torch.float32),
                    "out": torch.empty(d, device=device),
                    "copy": torch.empty_like(X),
                }

            return cache.get((K, d, device), build)

        group = f"weighted_sum K={K} d={fmt_size(d)} float32 {device}"
        nbytes = (K + 1) * d * 4

        def ours(inputs=inputs):
            a = inputs()
            return lambda: ops.weighted_sum(a["X"], a["w64"], out=a["out"])

        def idiom(inputs=inputs):
            a = inputs()
            return lambda: (a["w"][:, None] * a["X"]).sum(0)

        def tensordot(inputs=inputs):
            a = inputs()
            return lambda: torch.tensordot(a["w"], a["X"], dims=1)

        def add_loop(inputs=inputs):
            a = inputs()
            X, w, o = a["X"], a["w64"], a["out"]

            def run():
                o.zero_()
                for k in range(X.shape[0]):
                    o.add_(X[k], alpha=float(w[k]))
                return o

            return run

        def limit_copy(inputs=inputs):
            a = inputs()
            return lambda: a["copy"].copy_(a["X"])

        def limit_sum(inputs=inputs):
            a = inputs()
            return lambda: a["X"].sum()

        out += [
            Case(group, "pyfedkern", ours, nbytes, 2 * K * d, device),
            Case(group, "torch-idiom (w[:,None]*X).sum(0)", idiom, nbytes, 2 * K * d, device),
            Case(group, "torch.tensordot", tensordot, nbytes, 2 * K * d, device),
            Case(group, "torch add_ loop", add_loop, nbytes, 2 * K * d, device),
        ]
        if device == "cpu":

            def numpy_matvec(inputs=inputs):
                a = inputs()
                X, w = a["X"].numpy(), a["w64"].astype(np.float32)
                return lambda: w @ X

            def flower(inputs=inputs, d=d):
                a = inputs()
                X, w = a["X"].numpy(), a["w64"]
                clients = [[X[k, lo:hi] for lo, hi in _layer_bounds(d)] for k in range(X.shape[0])]

                def run():
                    weighted = [[layer * w[k] for layer in layers] for k, layers in enumerate(clients)]
                    return [reduce(np.add, layer_updates) for layer_updates in zip(*weighted, strict=True)]

                return run

            out += [
                Case(group, "numpy w @ X", numpy_matvec, nbytes, 2 * K * d, device),
                Case(group, "flower-style per-layer reduce", flower, nbytes, 2 * K * d, device),
            ]
        out += [
            Case(group, "limit:copy", limit_copy, 2 * K * d * 4, 0, device),
            Case(group, "limit:sum", limit_sum, K * d * 4, 0, device),
        ]
    return out
