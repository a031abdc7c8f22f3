"""Benchmark cases of one FedSpeed local step (the optimizer part, without the two forward/backward passes).

On a ResNet-18-GN parameter list (its 62 tensors; at d = 10^6 the same 62 tensors scaled down proportionally):

Group "ref-code form" (clip at 10, α = 1, what FL-Simulator computes):

- ``pyfedkern``: ``sam_perturb`` (norm + x̆ into a second buffer) and ``fedspeed_update_`` with the clip: 10·d floats
  of traffic (norm 1, perturb 3, clip norm 2, update 4);
- ``torch per-tensor (FL-Simulator)``: what the reference code runs per step: ESAM's norm over a list of per-tensor
  norms, ``e_w = g·s`` and ``p.add_(e_w)`` per tensor, the restore ``p.sub_(e_w)``, ``param_to_vector`` and the
  correction loss Σ x·D/λ (its backward replaced by ``p.grad.add_(D/λ)`` per tensor), ``clip_grad_norm_`` and SGD
  with weight decay wd + 1/λ;
- ``torch flat``: the same math with torch ops on flat buffers;
- ``limit:copy``: a copy of 4.5·d floats (9·d floats of traffic), the machine's memory bandwidth.

Group "Alg. 1" (α = 0.9375, no clip; 9·d floats per step, docs/fedspeed.md): ``pyfedkern``, ``torch flat``, the copy and
``torch per-tensor``: the same math written the per-tensor way (global norm over a list of per-tensor norms,
perturb and restore each tensor in place, then per tensor x ← (1 − η(1/λ + wd))·x − η[(1−α)g1 + αg2 + D/λ] with one
``add_`` per term). The second backward is modelled by pointing ``p.grad`` at the g2 tensors (no copy), as a fresh
backward after ``zero_grad(set_to_none=True)`` would.
"""

from __future__ import annotations

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

RESNET18_GN_CIFAR10_D = 11_181_642
FULL_SIZES = [10**6, RESNET18_GN_CIFAR10_D]
QUICK_SIZES = [10**6]
RHO, LR, PROX, WD, CLIP, ALPHA = 0.1, 0.1, 0.1, 1e-3, 10.0, 0.9375


def resnet18_gn_shapes(num_classes: int = 10) -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-18 with GroupNorm (ImageNet stem), in ``named_parameters`` order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for out_ch, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            first_in = in_ch if block == 0 else out_ch
            shapes += [(out_ch, first_in, 3, 3), (out_ch,), (out_ch,), (out_ch, out_ch, 3, 3), (out_ch,), (out_ch,)]
            if block == 0 and (stride != 1 or in_ch != out_ch):
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
        in_ch = out_ch
    return [*shapes, (num_classes, 512), (num_classes,)]


def layer_sizes(d: int) -> list[int]:
    """Element counts of the 62 ResNet-18-GN tensors, scaled so they add up to d."""
    full = [int(np.prod(s)) for s in resnet18_gn_shapes()]
    total = sum(full)
    if d == total:
        return full
    sizes = [max(1, round(n * d / total)) for n in full]
    sizes[int(np.argmax(sizes))] += d - sum(sizes)
    return sizes


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per d on ``device`` ("cpu" or "cuda")."""
    cache = InputCache()
    out: list[Case] = []
    for d in QUICK_SIZES if quick else FULL_SIZES:

        def inputs(d: int = d) -> dict:
            def build() -> dict:
                gen = torch.Generator().manual_seed(0)
                flat = {k: (torch.randn(d, generator=gen) * 0.05).to(device) for k in ("x", "g1", "g2", "anchor")}
                sizes = layer_sizes(d)
                params = [torch.nn.Parameter(t.clone()) for t in torch.split(flat["x"], sizes)]
                for p, g in zip(params, torch.split(flat["g1"], sizes), strict=True):
                    p.grad = g.clone()
                return {
                    **flat,
                    "perturbed": torch.empty(d, device=device),
                    "norm": torch.zeros(1, device=device),
                    "clip_norm": torch.zeros(1, device=device),
                    "params": params,
                    "g2_list": [g.clone() for g in torch.split(flat["g2"], sizes)],
                    "corr_list": [c.clone() * PROX for c in torch.split(flat["anchor"], sizes)],
                    "corr": flat["anchor"] * PROX,
                    "sgd": torch.optim.SGD(params, lr=LR, weight_decay=WD + PROX),
                    "copy_src": torch.randn(d * 9 // 2, generator=gen).to(device),
                    "copy_dst": torch.empty(d * 9 // 2, device=device),
                }

            return cache.get((d, device), build)

        group = f"fedspeed step ref-code form (clip, α=1) d={fmt_size(d)} float32 {device}"

        def fused(inputs=inputs, clip=True, alpha=1.0):
            a = inputs()

            def run():
                ops.sam_perturb(a["x"], a["g1"], RHO, out=a["perturbed"], norm_out=a["norm"])
                ops.fedspeed_update_(
                    a["x"],
                    a["g2"],
                    LR,
                    g1=a["g1"] if alpha < 1 else None,
                    alpha=alpha,
                    anchor=a["anchor"],
                    prox_coef=PROX,
                    weight_decay=WD,
                    clip_norm=CLIP if clip else None,
                    norm_out=a["clip_norm"] if clip else None,
                )
                return a["x"]

            return run

        def per_tensor(inputs=inputs):
            a = inputs()
            params, g2_list, corr_list, sgd = a["params"], a["g2_list"], a["corr_list"], a["sgd"]
            corr = a["corr"]

            def run():
                with torch.no_grad():
                    grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
                    scale = RHO / (grad_norm + 1e-7)
                    e_ws = []
                    for p in params:
                        e_w = p.grad * scale
                        p.add_(e_w)
                        e_ws.append(e_w)
                    for p, g in zip(params, g2_list, strict=True):  # the second backward's gradients
                        p.grad.copy_(g)
                    for p, e_w in zip(params, e_ws, strict=True):
                        p.sub_(e_w)
                    vec = torch.cat([p.reshape(-1) for p in params])
                    torch.sum(vec * corr)
                    for p, c in zip(params, corr_list, strict=True):
                        p.grad.add_(c)
                torch.nn.utils.clip_grad_norm_(params, max_norm=CLIP)
                sgd.step()
                return params

            return run

        def torch_flat(inputs=inputs):
            a = inputs()
            x, g1, g2, anchor, perturbed = a["x"], a["g1"], a["g2"], a["anchor"], a["perturbed"]

            def run():
                torch.addcmul(x, g1, RHO / (g1.norm() + 1e-7), out=perturbed)
                v = torch.add(g2, anchor, alpha=PROX)
                k = torch.clamp(CLIP / (v.norm() + 1e-6), max=1.0)
                return x.mul_(1 - LR * (PROX + WD)).addcmul_(v, k, value=-LR)

            return run

        def per_tensor_alg1(inputs=inputs):
            a = inputs()
            params, g2_list, corr_list = a["params"], a["g2_list"], a["corr_list"]

            def run():
                with torch.no_grad():
                    grad_norm = torch.norm(torch.stack([p.grad.norm(p=2) for p in params]), p=2)
                    scale = RHO / (grad_norm + 1e-7)
                    g1_list, e_ws = [p.grad for p in params], []
                    for p in params:
                        e_w = p.grad * scale
                        p.add_(e_w)
                        e_ws.append(e_w)
                    for p, g2 in zip(params, g2_list, strict=True):  # the second backward's fresh gradients
                        p.grad = g2
                    for p, e_w, g1, g2, c in zip(params, e_ws, g1_list, g2_list, corr_list, strict=True):
                        p.sub_(e_w)
                        p.mul_(1 - LR * (PROX + WD))
                        p.add_(g1, alpha=-LR * (1 - ALPHA))
                        p.add_(g2, alpha=-LR * ALPHA)
                        p.add_(c, alpha=-LR)
                    for p, g1 in zip(params, g1_list, strict=True):  # the next step's first gradient
                        p.grad = g1
                return params

            return run

        def torch_flat_alg1(inputs=inputs):
            a = inputs()
            x, g1, g2, anchor, perturbed = a["x"], a["g1"], a["g2"], a["anchor"], a["perturbed"]

            def run():
                torch.addcmul(x, g1, RHO / (g1.norm() + 1e-7), out=perturbed)
                direction = torch.add(g1, g2, alpha=ALPHA / (1 - ALPHA)).mul_(1 - ALPHA).add_(anchor, alpha=PROX)
                return x.mul_(1 - LR * (PROX + WD)).sub_(direction, alpha=LR)

            return run

        def limit_copy(inputs=inputs):
            a = inputs()
            return lambda: a["copy_dst"].copy_(a["copy_src"])

        alg1 = f"fedspeed step Alg. 1 (α={ALPHA}, no clip) d={fmt_size(d)} float32 {device}"
        out += [
            Case(group, "pyfedkern", fused, 10 * d * 4, 0, device),
            Case(group, "torch per-tensor (FL-Simulator)", per_tensor, 10 * d * 4, 0, device),
            Case(group, "torch flat", torch_flat, 10 * d * 4, 0, device),
            Case(group, "limit:copy", limit_copy, 9 * d * 4, 0, device),
            Case(alg1, "pyfedkern", lambda inputs=inputs: fused(inputs, False, ALPHA), 9 * d * 4, 0, device),
            Case(alg1, "torch per-tensor", per_tensor_alg1, 9 * d * 4, 0, device),
            Case(alg1, "torch flat", torch_flat_alg1, 9 * d * 4, 0, device),
            Case(alg1, "limit:copy", limit_copy, 9 * d * 4, 0, device),
        ]
    return out
