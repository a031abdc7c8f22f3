"""Benchmark cases of the DP ops and of a central-DP round.

- ``gaussian_noise d=...``: ``ops.gaussian_noise_(x, σ, seed, round)`` (x += σ·z in one pass) against what torch
  code writes, ``x.add_(buf.normal_(), alpha=σ)``, and torch's ``normal_`` alone (filling a buffer); the limits are
  a copy of the same floats and (CPU) the generator's Philox4x32-10 alone, one 32-bit word per float.
- ``clip_accumulate K=... d=...``: the clipped sum of K update rows around the global model against the torch idiom
  (norms of X − x, clip factors, their weighted sum); the limit is a sum of the stack.
- ``central_dp_round fedavg m=1000 synthetic(1,1) logreg``: one FedAvg round of 1,000 clients, all taking part
  (the engine benchmark's round), with central DP (clip 1, σ = 1, adaptive clip at the median) and without.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern._runtime import native
from pyfedkern.benchmarks import engine
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

NOISE_SIZES, QUICK_NOISE_SIZES = (1_630_000, 11_200_000), (1_630_000,)  # simple_cnn's and ResNet-18's parameters
CLIP_SIZES, QUICK_CLIP_SIZES = ((10, 1_630_000), (100, 100_000), (1000, 7850)), ((100, 100_000),)
DP_SETTINGS = {"dp": "central", "dp_clip": 1.0, "dp_delta": 1e-5, "dp_noise_multiplier": 1.0, "dp_adaptive_clip": 0.5}


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """Groups of the noise, the clipped sum and (on the CPU) the central-DP round."""
    cache = InputCache()
    out: list[Case] = []
    for d in QUICK_NOISE_SIZES if quick else NOISE_SIZES:
        out += _noise_cases(cache, d, device)
    for k, d in QUICK_CLIP_SIZES if quick else CLIP_SIZES:
        out += _clip_cases(cache, k, d, device)
    if device == "cpu":
        config = engine.round_config("fedavg", 1000, "logreg", device)
        group = "central_dp_round fedavg m=1000 synthetic(1,1) logreg cpu"
        out.append(Case(group, "pyfedkern central DP", lambda: engine.engine_round(replace(config, **DP_SETTINGS))))
        out.append(Case(group, "pyfedkern plain", lambda: engine.engine_round(config)))
    return out


def _noise_cases(cache: InputCache, d: int, device: str) -> list[Case]:
    def inputs() -> dict:
        return cache.get(("noise", d, device), lambda: {"x": torch.zeros(d, device=device), "buf": torch.empty(d)})

    group = f"gaussian_noise d={fmt_size(d)} float32 {device}"
    rounds = iter(range(10**9))

    def ours():
        x = inputs()["x"]
        return lambda: ops.gaussian_noise_(x, 0.1, 1234, next(rounds))

    def torch_normal_add():
        a = inputs()
        x, buf = a["x"], a["buf"].to(device)
        return lambda: x.add_(buf.normal_(), alpha=0.1)

    def torch_normal():
        buf = inputs()["buf"].to(device)
        return lambda: buf.normal_()

    def limit_copy():
        a = inputs()
        x, buf = a["x"], a["buf"].to(device)
        return lambda: buf.copy_(x)

    def limit_philox():
        words = np.empty((4, -(-d // 4)), np.uint32)
        return lambda: native().philox4x32_10(1234, 5, 0, words)

    nbytes = 2 * 4 * d
    out = [
        Case(group, "pyfedkern", ours, bytes_moved=nbytes, device=device),
        Case(group, "torch normal_+add_", torch_normal_add, bytes_moved=nbytes, device=device),
        Case(group, "torch normal_", torch_normal, bytes_moved=4 * d, device=device),
        Case(group, "limit:copy", limit_copy, bytes_moved=nbytes, device=device),
    ]
    if device == "cpu":
        out.append(Case(group, "limit:philox", limit_philox, bytes_moved=4 * d, device=device))
    return out


def _clip_cases(cache: InputCache, k: int, d: int, device: str) -> list[Case]:
    def inputs() -> dict:
        def build() -> dict:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(d, generator=gen)
            return {"x": x.to(device), "X": (x + 0.01 * torch.randn(k, d, generator=gen)).to(device)}

        return cache.get(("clip", k, d, device), build)

    group = f"clip_accumulate K={k} d={fmt_size(d)} float32 {device}"

    def ours():
        a = inputs()
        return lambda: ops.clip_accumulate(a["X"], 0.5, center=a["x"])

    def idiom():
        a = inputs()

        def run():
            diffs = a["X"] - a["x"]
            norms = torch.linalg.vector_norm(diffs, dim=1)
            return (torch.clamp(0.5 / norms, max=1.0)[:, None] * diffs).sum(0)

        return run

    def limit_sum():
        a = inputs()
        return lambda: a["X"].sum(0)

    nbytes = (k + 2) * d * 4
    return [
        Case(group, "pyfedkern", ours, bytes_moved=nbytes, device=device),
        Case(group, "torch-idiom", idiom, bytes_moved=nbytes, device=device),
        Case(group, "limit:sum", limit_sum, bytes_moved=nbytes, device=device),
    ]
