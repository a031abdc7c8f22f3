"""Benchmark cases of similarity_combine: pyfedkern vs the per-layer PyTorch code of the dynamic initial-model
method, on ResNet-18's 62 parameter tensors (biases excluded from the similarity, as the authors do).

Each group holds K stored footprint gradients and K stored models of d floats (float32) and the current gradient,
and computes α = Softmin(R·d) with d_k the mean over the non-bias tensors of ‖ĝ_l − Ĝ_k,l‖, then Σ_k α_k·W_k.
Peers: the authors' loop (per tensor: normalise, subtract, norm, accumulate; ``Softmin``; per tensor blend of K
state dicts) and the same loop batched over K (one normalise/norm per tensor for all rows, ``α @ W``). The limit
sums the bank, the query, the models and the output: the (K + 1)·d_s + (K + 1)·d floats the op must read at
least (d_s is 99.9% of d here, so the limit reads the whole bank and query).
"""

from __future__ import annotations

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

FULL_SIZES = [(K, d) for d in (10**6, 11_200_000) for K in (4, 16, 64)]
QUICK_SIZES = [(4, 10**6), (16, 10**5)]
SCALE = 10.0


def resnet18_tensors(num_classes: int = 10) -> list[tuple[str, int]]:
    """(name, numel) of torchvision ResNet-18's 62 parameter tensors (11.2M parameters for 10 classes)."""
    out = [("conv1.weight", 64 * 3 * 7 * 7), ("bn1.weight", 64), ("bn1.bias", 64)]
    cin = 64
    for stage, cout in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            pre = f"layer{stage}.{block}"
            first_in = cin if block == 0 else cout
            for conv, fan_in in (("1", first_in), ("2", cout)):
                out += [(f"{pre}.conv{conv}.weight", cout * fan_in * 9)]
                out += [(f"{pre}.bn{conv}.weight", cout), (f"{pre}.bn{conv}.bias", cout)]
            if block == 0 and first_in != cout:
                out += [(f"{pre}.downsample.0.weight", cout * first_in)]
                out += [(f"{pre}.downsample.1.weight", cout), (f"{pre}.downsample.1.bias", cout)]
        cin = cout
    return [*out, ("fc.weight", 512 * num_classes), ("fc.bias", num_classes)]


def layout(d: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(offsets [63], include [62], names) of ResNet-18's tensors scaled to d floats in all."""
    tensors = resnet18_tensors()
    sizes = np.array([n for _, n in tensors], dtype=np.float64)
    cuts = np.round(np.cumsum(sizes) / sizes.sum() * d).astype(np.int64)
    offsets = np.concatenate([[0], cuts])
    names = [name for name, _ in tensors]
    return offsets, np.array(["bias" not in n for n in names]), names


def authors_loop(query, bank_layers, model_layers, include, scale):
    """Per tensor: normalise, distance, accumulate; Softmin; per tensor Σ_k α_k·W_k (K state dicts)."""
    K = len(bank_layers)
    used = [i for i, keep in enumerate(include) if keep]
    dist = torch.zeros(K, device=query[0].device)  # on the tensors' device (the authors ran on one device)
    for i in used:
        g = query[i] / query[i].norm()
        for k in range(K):
            dist[k] += (g - bank_layers[k][i] / bank_layers[k][i].norm()).norm()
    alpha = torch.nn.functional.softmin(scale * dist / len(used), dim=0)
    blended = []
    for i in range(len(model_layers[0])):
        acc = torch.zeros_like(model_layers[0][i])
        for k in range(K):
            acc += alpha[k] * model_layers[k][i]
        blended.append(acc)
    return blended


def batched_layers(query, bank, models, offsets, include, scale):
    """The same per-tensor normalised distances batched over the K rows, then one α @ W."""
    used = [i for i, keep in enumerate(include) if keep]
    dist = torch.zeros(bank.shape[0], device=bank.device)
    for i in used:
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        g = query[lo:hi] / query[lo:hi].norm()
        rows = bank[:, lo:hi]
        dist += (g - rows / rows.norm(dim=1, keepdim=True)).norm(dim=1)
    alpha = torch.softmax(-scale * dist / len(used), dim=0)
    return alpha @ models


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per (K, d) on ``device`` ("cpu" or "cuda")."""
    cache = InputCache()
    out: list[Case] = []
    for K, d in QUICK_SIZES if quick else FULL_SIZES:
        offsets, include, _ = layout(d)
        d_s = int(sum(offsets[i + 1] - offsets[i] for i in range(len(include)) if include[i]))

        def inputs(K: int = K, d: int = d, offsets: np.ndarray = offsets) -> dict:
            def build() -> dict:
                gen = torch.Generator().manual_seed(0)
                query = torch.randn(d, generator=gen)
                bank = query + torch.randn(K, d, generator=gen)
                models = torch.randn(K, d, generator=gen)
                query, bank, models = query.to(device), bank.to(device), models.to(device)
                bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True))
                return {
                    "query": query,
                    "bank": bank,
                    "models": models,
                    "out": torch.empty(d, device=device),
                    "query_layers": [query[a:b] for a, b in bounds],
                    "bank_layers": [[bank[k, a:b] for a, b in bounds] for k in range(K)],
                    "model_layers": [[models[k, a:b] for a, b in bounds] for k in range(K)],
                }

            return cache.get((K, d, device), build)

        group = f"similarity_combine K={K} d={fmt_size(d)} L=62 float32 {device}"
        nbytes = 4 * ((K + 1) * d_s + (K + 1) * d)
        flops = 8 * K * d_s + 2 * K * d

        def ours(inputs=inputs, offsets=offsets, include=include):
            a = inputs()
            return lambda: ops.similarity_combine(
                a["query"], a["bank"], a["models"], SCALE, "layer_l2", offsets, include, out=a["out"]
            )

        def loop(inputs=inputs, include=include):
            a = inputs()
            return lambda: authors_loop(a["query_layers"], a["bank_layers"], a["model_layers"], include, SCALE)

        def batched(inputs=inputs, offsets=offsets, include=include):
            a = inputs()
            return lambda: batched_layers(a["query"], a["bank"], a["models"], offsets, include, SCALE)

        def limit(inputs=inputs):
            a = inputs()
            # every float of the bank, query, models and output read once (d_s is 99.9% of d for ResNet-18)
            return lambda: (a["bank"].sum(), a["query"].sum(), a["models"].sum(), a["out"].sum())

        out += [
            Case(group, "pyfedkern", ours, nbytes, flops, device),
            Case(group, "torch per-layer loop (authors)", loop, nbytes, flops, device),
            Case(group, "torch per-layer batched over K", batched, nbytes, flops, device),
            Case(group, "limit:read (K+1)(d_s+d) floats", limit, nbytes, 0, device),
        ]
    return out
