"""Benchmark cases of the feature-norm ops against the ways FL / DP code computes them today.

- ``class_feature_norms`` on a [B, D] float32 feature matrix with C classes: pyfedkern vs the torch idiom
  (``vector_norm`` + ``index_add_`` + ``bincount``) and a loop over classes; limit: a sum over the same bytes (the
  op must read the features once).
- per-sample gradient norms (``pyfedkern.persample.grad_norms``) of an MLP and BHerd's CNN on MNIST-shaped
  batches: pyfedkern vs ``torch.func`` vmap(grad), vs Opacus-style materialisation (per-layer einsum of the
  per-sample gradients [B, P_layer]), and vs Opacus' GradSampleModule when installed; limit: one ordinary
  forward + backward of the batch. ``info["materialised_floats"]`` is the B·P the materialising peers hold.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from pyfedkern import ops, persample
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

NORM_FULL = [(B, D, C) for B in (256, 4096) for D in (512, 2048) for C in (10, 100)]
NORM_QUICK = [(256, 512, 10), (4096, 512, 100)]
GRAD_FULL = [("mlp", 256), ("cnn", 256)]
GRAD_QUICK = [("mlp", 32), ("cnn", 8)]


def _torch_idiom(f: torch.Tensor, y: torch.Tensor, C: int) -> tuple[torch.Tensor, ...]:
    norms = torch.linalg.vector_norm(f, dim=1)
    sums = torch.zeros(C, dtype=f.dtype, device=f.device).index_add_(0, y, norms)
    counts = torch.bincount(y, minlength=C)
    return norms, sums, sums / counts.clamp(min=1), counts


def _class_loop(f: torch.Tensor, y: torch.Tensor, C: int) -> tuple[torch.Tensor, ...]:
    norms = f.norm(dim=1)
    means = torch.stack([norms[y == c].mean() if bool((y == c).any()) else norms.new_zeros(()) for c in range(C)])
    return norms, means


def _norm_cases(quick: bool, device: str) -> list[Case]:
    cache = InputCache()
    out: list[Case] = []
    for B, D, C in NORM_QUICK if quick else NORM_FULL:

        def inputs(B: int = B, D: int = D, C: int = C) -> dict:
            def build() -> dict:
                gen = torch.Generator().manual_seed(0)
                return {
                    "f": torch.randn(B, D, generator=gen).relu().to(device),
                    "y": torch.randint(0, C, (B,), generator=gen).to(device),
                }

            return cache.get((B, D, C, device), build)

        group = f"class_feature_norms B={B} D={fmt_size(D)} C={C} float32 {device}"
        nbytes = B * D * 4 + B * 8

        def ours(inputs=inputs, C=C):
            a = inputs()
            return lambda: ops.class_feature_norms(a["f"], a["y"], C)

        def idiom(inputs=inputs, C=C):
            a = inputs()
            return lambda: _torch_idiom(a["f"], a["y"], C)

        def loop(inputs=inputs, C=C):
            a = inputs()
            return lambda: _class_loop(a["f"], a["y"], C)

        def limit_sum(inputs=inputs):
            a = inputs()
            return lambda: a["f"].sum()

        out += [
            Case(group, "pyfedkern", ours, nbytes, 2 * B * D, device),
            Case(group, "torch-idiom vector_norm+index_add_+bincount", idiom, nbytes, 2 * B * D, device),
            Case(group, "torch loop over classes", loop, nbytes, 2 * B * D, device),
            Case(group, "limit:sum", limit_sum, B * D * 4, 0, device),
        ]
    return out


def _model(name: str) -> torch.nn.Module:
    from pyfedkern.models import build_model

    return build_model(name, (1, 28, 28), 10)


def _materialised_grad_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Opacus-style: per-layer per-sample gradients [B, out, in] by einsum, then their norms."""
    captured, out = persample.capture_layer_grads(model, F.cross_entropy, x, y)
    total = torch.zeros(x.shape[0], dtype=out.dtype, device=out.device)
    for layer, a, g in captured:
        if isinstance(layer, torch.nn.Conv2d):
            a = F.unfold(a, layer.kernel_size, dilation=layer.dilation, padding=layer.padding, stride=layer.stride)
            g = g.flatten(2)
            grad_w = torch.einsum("bol,bil->boi", g, a)
            grad_b = g.sum(2)
        else:
            grad_w = torch.einsum("bo,bi->boi", g, a)
            grad_b = g
        total += grad_w.flatten(1).square().sum(1) + grad_b.square().sum(1)
    return total.sqrt()


def _torch_func_grad_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Any:
    from pyfedkern.reference import grad_norms

    return grad_norms(model, F.cross_entropy, x, y)


def _opacus_grad_norms(model: torch.nn.Module) -> Any:
    """A callable (x, y) → norms through Opacus' GradSampleModule, or None when Opacus is not installed."""
    try:
        from opacus import GradSampleModule
    except ImportError:
        return None
    gsm = GradSampleModule(model, loss_reduction="sum")  # the loss below is summed: its grad_sample is per sample

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        gsm.zero_grad(set_to_none=True)
        F.cross_entropy(gsm(x), y, reduction="sum").backward()
        sq = sum(p.grad_sample.flatten(1).square().sum(1) for p in gsm.parameters() if p.requires_grad)
        return sq.sqrt()

    return run


def _grad_cases(quick: bool, device: str) -> list[Case]:
    cache = InputCache()
    out: list[Case] = []
    for name, B in GRAD_QUICK if quick else GRAD_FULL:

        def inputs(name: str = name, B: int = B) -> dict:
            def build() -> dict:
                torch.manual_seed(0)
                model = _model(name).to(device)
                gen = torch.Generator().manual_seed(1)
                x = torch.randn(B, 1, 28, 28, generator=gen).to(device)
                y = torch.randint(0, 10, (B,), generator=gen).to(device)
                return {"model": model, "x": x, "y": y}

            return cache.get((name, B, device), build)

        params = sum(p.numel() for p in _model(name).parameters())
        group = f"grad_norms {name} B={B} P={fmt_size(params)} float32 {device}"
        info = {"materialised_floats": B * params}

        def ours(inputs=inputs):
            a = inputs()
            return lambda: persample.grad_norms(a["model"], F.cross_entropy, a["x"], a["y"])

        def func(inputs=inputs):
            a = inputs()
            return lambda: _torch_func_grad_norms(a["model"], a["x"], a["y"])

        def materialised(inputs=inputs):
            a = inputs()
            return lambda: _materialised_grad_norms(a["model"], a["x"], a["y"])

        def limit_backward(inputs=inputs):
            a = inputs()

            def run():
                a["model"].zero_grad(set_to_none=True)
                F.cross_entropy(a["model"](a["x"]), a["y"]).backward()

            return run

        out += [
            Case(group, "pyfedkern", ours, 0, 0, device, dict(info)),
            Case(group, "torch.func vmap(grad)", func, 0, 0, device, dict(info)),
            Case(group, "opacus-style einsum materialisation", materialised, 0, 0, device, dict(info)),
        ]
        if _opacus_grad_norms(torch.nn.Linear(1, 1)) is not None:

            def opacus(inputs=inputs, name=name):
                a = inputs()
                run = _opacus_grad_norms(copy.deepcopy(a["model"]))  # the same weights; its hooks stay on the copy
                return lambda: run(a["x"], a["y"])

            out.append(Case(group, "opacus GradSampleModule", opacus, 0, 0, device, dict(info)))
        out.append(Case(group, "limit:forward+backward", limit_backward, 0, 0, device, dict(info)))
    return out


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """class_feature_norms groups, then per-sample gradient norm groups, on ``device``."""
    return _norm_cases(quick, device) + _grad_cases(quick, device)
