"""Benchmark cases of herding_select (BHerd's greedy selection, α = 0.5): pyfedkern vs the ways it is done today.

Peers on the same [τ, d] float32 gradients: the literal Algorithm 2 loop (:mod:`pyfedkern.reference`, float64
NumPy, K passes over the buffer; small sizes only), a vectorised torch greedy loop (one [τ, d] norm per step), and a
torch Gram matrix followed by a Python greedy loop. Limit: the GEMM Y·Yᵀ of the same size (what the Gram form
cannot beat); pyfedkern's target is within 1.3× of it.
"""

from __future__ import annotations

import numpy as np
import torch

from pyfedkern import ops, reference
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

FULL_SIZES = [(tau, d) for tau in (64, 128, 512) for d in (10**5, 430_698, 10**6)]
QUICK_SIZES = [(32, 10**4), (64, 10**5)]
ALPHA = 0.5
REFERENCE_MAX = 2 * 10**7  # τ·d above which the float64 reference loop is too slow to time
TORCH_LOOP_MAX = 2 * 10**10  # τ·d·K above which the vectorised torch loop is too slow to time


def torch_greedy_loop(y: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor]:
    """Algorithm 2 as a torch user writes it: each step computes ‖s + z_m‖ for every row at once."""
    z = y - y.mean(0)
    s = torch.zeros_like(z[0])
    taken = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
    order = []
    for _ in range(k):
        norms = (s + z).norm(dim=1)
        norms[taken] = float("inf")
        j = int(norms.argmin())
        order.append(j)
        taken[j] = True
        s += z[j]
    return order, y[order].sum(0)


def gram_python_loop(y: torch.Tensor, k: int) -> tuple[list[int], torch.Tensor]:
    """torch Gram matrix of the centred rows, then the greedy loop on it in Python/NumPy."""
    z = y - y.mean(0)
    gram = (z @ z.T).double().cpu().numpy()
    diag = np.diag(gram).copy()
    c = np.zeros(y.shape[0])
    taken = np.zeros(y.shape[0], dtype=bool)
    order = []
    for _ in range(k):
        score = np.where(taken, np.inf, 2 * c + diag)
        j = int(np.argmin(score))
        order.append(j)
        taken[j] = True
        c += gram[j]
    return order, y[order].sum(0)


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per (τ, d) on ``device`` ("cpu" or "cuda")."""
    cache = InputCache()
    out: list[Case] = []
    for tau, d in QUICK_SIZES if quick else FULL_SIZES:
        k = ops.herding.selection_size(tau, ALPHA)

        def inputs(tau: int = tau, d: int = d) -> dict:
            def build() -> dict:
                gen = torch.Generator().manual_seed(0)
                y = torch.randn(d, generator=gen) + 0.5 * torch.randn(tau, d, generator=gen)
                return {"Y": y.to(device)}

            return cache.get((tau, d, device), build)

        group = f"herding_select tau={tau} d={fmt_size(d)} alpha={ALPHA} float32 {device}"
        nbytes = tau * d * 4
        flops = 2 * tau * tau * d

        def ours(inputs=inputs):
            a = inputs()
            return lambda: ops.herding_select(a["Y"], ALPHA)

        def torch_loop(inputs=inputs, k=k):
            a = inputs()
            return lambda: torch_greedy_loop(a["Y"], k)

        def gram_loop(inputs=inputs, k=k):
            a = inputs()
            return lambda: gram_python_loop(a["Y"], k)

        def limit_gemm(inputs=inputs):
            a = inputs()
            y = a["Y"]
            return lambda: y @ y.T

        out += [
            Case(group, "pyfedkern", ours, nbytes, flops, device),
            Case(group, "torch Gram + Python greedy loop", gram_loop, nbytes, flops, device),
        ]
        if tau * d * k <= TORCH_LOOP_MAX:
            out.append(Case(group, "torch vectorised greedy loop", torch_loop, nbytes * k, 2 * tau * d * k, device))
        if device == "cpu" and tau * d <= REFERENCE_MAX:

            def ref_loop(inputs=inputs):
                a = inputs()
                y = a["Y"].numpy()
                return lambda: reference.herding_select(y, ALPHA)

            out.append(Case(group, "reference Algorithm 2 loop (float64)", ref_loop, nbytes * k, 2 * tau * d * k))
        out.append(Case(group, "limit:gemm Y·Yᵀ", limit_gemm, nbytes, flops, device))
    return out
