"""Per-sample gradient norms of a whole model without per-sample gradients: hooks + per-layer closed forms.

:func:`grad_norms` runs one forward pass capturing each Linear/Conv2d layer's input, then one backward pass, from
the sum of the per-sample losses to the layer outputs only (no parameter gradient is computed), which gives each
layer's per-sample output gradients, and combines them with :func:`pyfedkern.ops.per_sample_grad_norms`.
Cross-entropy (``F.cross_entropy`` or a plain ``nn.CrossEntropyLoss`` without class weights) on [B, C] logits is
summed over the batch directly; any other loss is evaluated per sample with a vmap over the loss alone. Parameter
``.grad`` fields are not touched. The model must treat samples independently (no BatchNorm in training mode).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pyfedkern.ops.norms import per_sample_grad_norms

SUPPORTED = (nn.Linear, nn.Conv2d)


def _check_model(model: nn.Module) -> list[nn.Module]:
    layers = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise ValueError(
                f"grad_norms: {name or 'model'} is a {type(module).__qualname__} in training mode, which mixes "
                "samples; call model.eval() first"
            )
        if not own:
            continue
        if not isinstance(module, SUPPORTED):
            raise TypeError(
                f"grad_norms: layer {name!r} of type {type(module).__qualname__} has trainable parameters but is "
                "not supported (supported: Linear, Conv2d); freeze it (requires_grad=False) or use torch.func"
            )
        extra = [n for n, p in module.named_parameters(recurse=False) if n not in ("weight", "bias")]
        if extra:
            raise TypeError(f"grad_norms: layer {name!r} has unexpected parameters {extra}")
        layers.append(module)
    if not layers:
        raise ValueError("grad_norms: the model has no trainable Linear or Conv2d layer")
    return layers


def capture_layer_grads(
    model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[tuple[nn.Module, torch.Tensor, torch.Tensor]], torch.Tensor]:
    """((layer, input, per-sample output gradient) for each trainable Linear/Conv2d layer, model output).

    The output gradients are those of each sample's own loss ``loss_fn(output[n:n+1], y[n:n+1])``; a layer whose
    output does not reach the loss is left out (its gradients are zero).
    """
    layers = _check_model(model)
    inputs: dict[nn.Module, torch.Tensor] = {}
    outputs: dict[nn.Module, torch.Tensor] = {}

    def capture(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if module in inputs:
            raise ValueError(
                f"grad_norms: a {type(module).__qualname__} layer was called more than once in one forward pass "
                "(shared weights are not supported)"
            )
        inputs[module] = args[0].detach()
        outputs[module] = out

    handles = [layer.register_forward_hook(capture) for layer in layers]
    try:
        with torch.enable_grad():
            out = model(x)
            if not isinstance(out, torch.Tensor) or out.shape[0] != x.shape[0]:
                raise ValueError("grad_norms: the model must return one [B, ...] tensor")
            total = _loss_sum(loss_fn, out, y)
    finally:
        for h in handles:
            h.remove()
    used = [m for m in layers if m in outputs and outputs[m].requires_grad]
    if not used or not total.requires_grad:  # the loss does not depend on any trainable layer: zero gradients
        return [], out.detach()
    grads = torch.autograd.grad(total, [outputs[m] for m in used], allow_unused=True)
    captured = [(m, inputs[m], g) for m, g in zip(used, grads, strict=True) if g is not None]
    return captured, out.detach()


def _cross_entropy_options(loss_fn: Any) -> dict | None:
    """Keyword arguments that make ``F.cross_entropy(..., reduction="sum")`` the sum of ``loss_fn``'s per-sample
    losses, or None when ``loss_fn`` is not a cross-entropy known to be one (class weights change the per-sample
    normalisation, and a subclass may change anything)."""
    if loss_fn is F.cross_entropy:
        return {}
    if type(loss_fn) is nn.CrossEntropyLoss and loss_fn.weight is None:
        return {"ignore_index": loss_fn.ignore_index, "label_smoothing": loss_fn.label_smoothing}
    return None


def _loss_sum(loss_fn: Any, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Σ_n loss_fn(out[n:n+1], y[n:n+1]), a scalar in out's autograd graph (its gradient with respect to out[n]
    is sample n's own output gradient)."""
    # [B, C] logits only: with [B, C, d1, ...] one sample's mean runs over its positions, not the batch's
    options = _cross_entropy_options(loss_fn) if out.dim() == 2 else None
    if options is not None:  # a sample whose target is ignore_index gets a zero gradient (per sample: 0/0)
        return F.cross_entropy(out, y, reduction="sum", **options)

    def loss_one(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss_fn(o.unsqueeze(0), t.unsqueeze(0))

    losses = torch.func.vmap(loss_one)(out, y)
    if not isinstance(losses, torch.Tensor) or losses.shape != (out.shape[0],):
        shape = tuple(losses.shape[1:]) if isinstance(losses, torch.Tensor) else type(losses).__qualname__
        raise ValueError(f"grad_norms: loss_fn must return a scalar for one sample, got {shape}")
    return losses.sum()


def grad_norms(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, *, squared: bool = False) -> Any:
    """[B] L2 norms of the per-sample gradients ∇_θ loss_fn(model(x_n[None]), y_n[None]) over all trainable params.

    Args:
        model: built from Linear / Conv2d layers (any parameter-free modules in between); each layer called once
            per forward pass.
        loss_fn: called as ``loss_fn(output[n:n+1], y[n:n+1])`` for one sample (e.g. ``F.cross_entropy``); must be
            vmap-compatible and return a scalar. ``F.cross_entropy`` and ``nn.CrossEntropyLoss`` without class
            weights on [B, C] logits are summed over the batch in one call instead (a sample whose target is the
            ignore_index then has norm 0, where the per-sample mean is 0/0).
        x, y: a batch of inputs [B, ...] and targets [B, ...].
        squared: return squared norms.

    Matches ``torch.func`` (vmap over grad) to float tolerance, at the cost of one forward pass and one backward
    pass to the layer outputs.
    """
    captured, out = capture_layer_grads(model, loss_fn, x, y)
    total = None
    for module, a, g in captured:
        sq = per_sample_grad_norms(module, a, g, squared=True)
        total = sq if total is None else total.add_(sq)
    if total is None:  # no trainable layer took part in the output
        total = torch.zeros(x.shape[0], dtype=out.dtype, device=out.device)
    return total if squared else total.sqrt()
