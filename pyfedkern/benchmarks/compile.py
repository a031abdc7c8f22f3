"""Benchmark cases of a whole FedSpeed local step, eager and under ``torch.compile``.

One step on a flat parameter vector x (Algorithm 1's form, α = 0.9375, no clip): the gradient g1 at x, the ascent
point x̆ = x + ρ·g1/(‖g1‖ + ε), the gradient g2 at x̆ (``torch.func.grad`` over ``functional_call``), then
x ← x − η[(1−α)g1 + αg2 + c·(x + D) + wd·x]. Per model (an MLP and a small CNN) and device, one group:

- ``pyfedkern eager`` / ``pyfedkern compiled``: the perturbation and the update are ``ops.sam_perturb`` and
  ``ops.fedspeed_update_`` (in the compiled step: the registered operators, with forward and backward compiled
  around them; on the CPU inductor generates the two ops' code from their lowerings, docs/torch.md);
- ``torch flat eager`` / ``torch flat compiled``: the same update in torch ops on the flat buffers (the ``torch
  flat`` peer of the fedspeed family), compiled by inductor together with the rest of the step;
- ``FedSpeedOptimizer eager`` / ``FedSpeedOptimizer compiled``: the same step as a user's training loop takes it,
  ``opt.step(closure)`` on the model itself (its parameters views of the optimizer's flat buffer; the closure's
  forward and backward compiled into the step's graph with ``trace_autograd_ops``).

The compiled functions are compiled and warmed up when a case is built, outside the timing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pyfedkern import ops
from pyfedkern.algorithms.fedspeed import FedSpeedOptimizer
from pyfedkern.benchmarks.common import Case, InputCache

RHO, LR, PROX, WD, ALPHA, EPS = 0.05, 0.01, 0.1, 1e-3, 0.9375, 1e-7


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def small_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 10),
    )


MODELS = {"mlp 784-256-10 B=64": (mlp, (64, 1, 28, 28)), "cnn 2conv+fc B=32": (small_cnn, (32, 3, 32, 32))}


def flat_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """loss(flat, xb, yb): cross-entropy of ``model`` with its parameters read from the flat [d] vector."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]

    def loss(flat: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        params, start = {}, 0
        for name, shape in zip(names, shapes, strict=True):
            params[name] = flat[start : start + shape.numel()].view(shape)
            start += shape.numel()
        return F.cross_entropy(torch.func.functional_call(model, params, (xb,)), yb)

    return loss


def pyfedkern_step(loss: Callable) -> Callable:
    def step(x, anchor, xb, yb):
        g1 = torch.func.grad(loss)(x, xb, yb)
        g2 = torch.func.grad(loss)(ops.sam_perturb(x, g1, RHO, eps=EPS), xb, yb)
        return ops.fedspeed_update_(x, g2, LR, g1=g1, alpha=ALPHA, anchor=anchor, prox_coef=PROX, weight_decay=WD)

    return step


def torch_flat_step(loss: Callable) -> Callable:
    def step(x, anchor, xb, yb):
        g1 = torch.func.grad(loss)(x, xb, yb)
        g2 = torch.func.grad(loss)(x + RHO / (g1.norm() + EPS) * g1, xb, yb)
        direction = (1 - ALPHA) * g1 + ALPHA * g2 + PROX * anchor
        return x.mul_(1 - LR * (PROX + WD)).sub_(direction, alpha=LR)

    return step


def optimizer_step(factory: Callable[[], torch.nn.Module], inputs: dict, device: str, compiled: bool) -> Callable:
    """``FedSpeedOptimizer.step(closure)`` on a fresh ``factory()`` model (the same initial x and, to rounding, the
    same D = h − x^t as the other cases), eager or compiled; the step returns the flat parameters."""
    torch.manual_seed(0)
    model = factory().to(device)
    opt = FedSpeedOptimizer(model.parameters(), lr=LR, rho=RHO, alpha=ALPHA, lam=1 / PROX, weight_decay=WD, eps=EPS)
    opt.begin_round(h=inputs["anchor"] + opt.flat_params)
    xb, yb = inputs["xb"], inputs["yb"]

    def step() -> torch.Tensor:
        def closure() -> torch.Tensor:
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            return loss

        opt.step(closure)
        return opt.flat_params

    if not compiled:
        return step
    compiled_step = torch.compile(step, fullgraph=True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):  # backward() in the graph; needed while tracing only
        compiled_step()
        compiled_step()
    return compiled_step


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per model on ``device`` (the same sizes with ``quick``: they are small already)."""
    cache = InputCache()
    out: list[Case] = []
    for label, (factory, input_shape) in MODELS.items():

        def inputs(factory=factory, input_shape=input_shape) -> dict:
            def build() -> dict:
                torch.manual_seed(0)
                model = factory().to(device)
                x = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                gen = torch.Generator().manual_seed(1)
                return {
                    "loss": flat_loss(model),
                    "x": x,
                    "anchor": (0.01 * torch.randn(x.shape, generator=gen)).to(device),
                    "xb": torch.randn(input_shape, generator=gen).to(device),
                    "yb": torch.randint(0, 10, input_shape[:1], generator=gen).to(device),
                }

            return cache.get((factory, device), build)

        def make(inputs=inputs, build_step=pyfedkern_step, compiled=False) -> Callable[[], torch.Tensor]:
            a = inputs()
            step = build_step(a["loss"])
            if compiled:
                step = torch.compile(step, fullgraph=True)
            x = a["x"].clone()  # each case steps its own copy

            def run() -> torch.Tensor:
                return step(x, a["anchor"], a["xb"], a["yb"])

            if compiled:  # compile and warm up outside the timing
                run()
                run()
            return run

        d = sum(p.numel() for p in factory().parameters())
        group = f"fedspeed local step {label} d={d} float32 {device}"
        out += [
            Case(group, "pyfedkern eager", make, device=device),
            Case(group, "pyfedkern compiled", lambda i=inputs: make(i, pyfedkern_step, True), device=device),
            Case(group, "torch flat eager", lambda i=inputs: make(i, torch_flat_step, False), device=device),
            Case(group, "torch flat compiled", lambda i=inputs: make(i, torch_flat_step, True), device=device),
            Case(
                group,
                "FedSpeedOptimizer eager",
                lambda f=factory, i=inputs: optimizer_step(f, i(), device, False),
                device=device,
            ),
            Case(
                group,
                "FedSpeedOptimizer compiled",
                lambda f=factory, i=inputs: optimizer_step(f, i(), device, True),
                device=device,
            ),
        ]
    return out
