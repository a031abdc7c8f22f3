"""Reference feature-norm ops: per-class loops and explicit per-sample gradients, in float64.

The torch versions keep the autograd graph, so autograd through them is the oracle for the op's backward kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pyfedkern.ops.norms import FeatureNorms


def class_feature_norms(features: Any, labels: Any, num_classes: int, logits: Any = None) -> FeatureNorms:
    """Row norms, per-class sums/means (0.0 for empty classes) and counts by a loop over classes, in float64."""
    if isinstance(features, np.ndarray):
        f = features.astype(np.float64)
        y = np.asarray(labels).astype(np.int64)
        if y.min() < 0 or y.max() >= num_classes:
            raise ValueError(f"labels out of range [0, {num_classes})")
        norms = np.sqrt((f * f).sum(1))
        sums = np.array([norms[y == c].sum() for c in range(num_classes)])
        counts = np.array([(y == c).sum() for c in range(num_classes)], dtype=np.int64)
        means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
        correct = None if logits is None else np.array(int((np.argmax(logits, axis=1) == y).sum()))
        dt = features.dtype
        return FeatureNorms(norms.astype(dt), sums.astype(dt), means.astype(dt), counts, correct)
    import torch

    f = features.to(torch.float64)
    y = labels.long()
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"labels out of range [0, {num_classes})")
    norms = torch.sqrt((f * f).sum(1))
    sums = torch.stack([norms[y == c].sum() for c in range(num_classes)])
    counts = torch.stack([(y == c).sum() for c in range(num_classes)]).to(torch.int64)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    correct = None if logits is None else (logits.argmax(1) == y).sum()
    dt = features.dtype
    return FeatureNorms(norms.to(dt), sums.to(dt), means.to(dt), counts, correct)


def row_norms(x: Any) -> Any:
    """[B] L2 norms of the rows of a [B, D] array, in float64, returned in x's dtype (torch: keeps the graph)."""
    if isinstance(x, np.ndarray):
        return np.sqrt((x.astype(np.float64) ** 2).sum(1)).astype(x.dtype)
    import torch

    return torch.sqrt((x.to(torch.float64) ** 2).sum(1)).to(x.dtype)


def per_sample_grad_norms(layer: Any, activations: Any, grad_outputs: Any, *, squared: bool = False) -> Any:
    """Per-sample gradient norms of one Linear/Conv2d layer from explicitly materialised per-sample gradients."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    a, g = activations.detach().double(), grad_outputs.detach().double()
    B = a.shape[0]
    if isinstance(layer, nn.Linear):
        a, g = a.reshape(B, -1, a.shape[-1]), g.reshape(B, -1, g.shape[-1])
    elif isinstance(layer, nn.Conv2d):
        padding = layer.padding
        if isinstance(padding, str):
            if padding == "same":
                a = F.pad(a, layer._reversed_padding_repeated_twice)
            padding = 0
        a = F.unfold(a, layer.kernel_size, dilation=layer.dilation, padding=padding, stride=layer.stride)
        a, g = a.transpose(1, 2), g.reshape(B, g.shape[1], -1).transpose(1, 2)
    else:
        raise TypeError(f"unsupported layer {type(layer).__qualname__}")
    sq = torch.zeros(B, dtype=torch.float64)
    if layer.weight.requires_grad:
        sq += torch.einsum("bto,bti->boi", g, a).pow(2).sum((1, 2))
    if layer.bias is not None and layer.bias.requires_grad:
        sq += g.sum(1).pow(2).sum(1)
    sq = sq.to(grad_outputs.dtype)
    return sq if squared else sq.sqrt()


def grad_norms(model: Any, loss_fn: Any, x: Any, y: Any) -> Any:
    """[B] per-sample gradient norms by torch.func: vmap over grad of each sample's own loss."""
    import torch
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    buffers = dict(model.named_buffers())

    def loss_one(p: dict, xb: Any, yb: Any) -> Any:
        out = functional_call(model, (p, buffers), (xb.unsqueeze(0),))
        return loss_fn(out, yb.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    sq = sum(gr.reshape(gr.shape[0], -1).pow(2).sum(1) for gr in grads.values())
    return torch.sqrt(sq)
