"""Local (record-level) DP-SGD in one backward pass: per-sample clipping by book-keeping, and seeded Gaussian noise.

Each step's gradient is (Σ_n w_n·min(1, C/‖∇ℓ_n‖)·∇ℓ_n + ξ/b), ξ ~ N(0, σ²C²·I) (Abadi et al. 2016), with
w_n = 1/b for every sample of a batch of b (fixed-size batches) or of expected size b (Poisson sampling). The
per-sample gradients ∇ℓ_n are never built for the supported layers (book-keeping, Bu et al. 2023): one forward pass
captures each layer's input, one backward pass from Σ_n ℓ_n stops at the layer outputs (no parameter gradient is
computed), the per-sample norms come from each layer's (input, output gradient) pair, and each layer's clipped
gradient sum is one product of the clip-weighted output gradients with the input (the product a plain backward
computes).

Supported layers: Linear, Conv1d, Conv2d (groups 1, zero padding), Embedding, LayerNorm, GroupNorm, LSTM and GRU
(one direction, no projection: torch's kernel forward, and a backward through time that also yields each layer's
gate pre-activation gradients, from which its weights are book-kept like a Linear's over time steps; on the batched
path, per-sample gradients row by row). A module of any other kind that holds trainable parameters (attention, a
bidirectional RNN, a bare ``nn.Parameter``) is handled with ``torch.func`` (per-sample gradients of that module
alone, vmap over grad; RNNs one sample at a time, as torch's fused RNN kernels run slowly under vmap), named once in
a log line. BatchNorm in training mode mixes samples and is refused.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pyfedkern.ops.dp import gaussian_noise_
from pyfedkern.ops.norms import gram_is_cheaper, per_sample_grad_norms
from pyfedkern.persample import _cross_entropy_options, _loss_sum

logger = logging.getLogger("pyfedkern")

#: Layers whose per-sample norms and clipped sums are computed from (input, output gradient).
NATIVE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm)
#: The first key of every DP-SGD noise stream, so that it never repeats another stream keyed by the same numbers.
_NOISE_TAG = 0x44505347
_LOGGED: set[str] = set()


def _native(module: nn.Module) -> bool:
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return module.groups == 1 and module.padding_mode == "zeros"
    if isinstance(module, nn.Embedding):
        return not module.sparse and not module.scale_grad_by_freq
    return isinstance(module, NATIVE) or _book_kept_rnn(module)


@dataclass
class _Unit:
    """A module whose trainable parameters are handled together: natively, or by torch.func (``fallback``)."""

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]  # trainable, named relative to ``module``
    fallback: bool


def units(model: nn.Module) -> list[_Unit]:
    """The model's units, top-down: a supported layer is one; any other module holding trainable parameters of its
    own is one fallback unit with every parameter below it; other modules are looked into. Raises ValueError for
    BatchNorm in training mode and for a parameter shared by two units."""
    found: list[_Unit] = []

    def visit(name: str, module: nn.Module) -> None:
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            raise ValueError(
                f"dpsgd: {name or 'model'} is a {type(module).__qualname__} in training mode, which mixes samples "
                "(a sample's gradient depends on the others); DP-SGD needs a model without it (e.g. GroupNorm)"
            )
        own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if own and _native(module):
            found.append(_Unit(name, module, own, False))
        elif own:
            for sub, child in module.named_modules():  # BatchNorm is refused inside a fallback unit too
                if sub and isinstance(child, nn.modules.batchnorm._BatchNorm) and child.training:
                    visit(f"{name}.{sub}" if name else sub, child)
            every = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            found.append(_Unit(name, module, every, True))
        else:
            for child_name, child in module.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    seen: set[int] = set()
    for unit in found:
        for n, p in unit.params:
            if id(p) in seen:
                raise ValueError(f"dpsgd: parameter {unit.name}.{n} is shared between layers (not supported)")
            seen.add(id(p))
    kinds = ", ".join(f"{u.name or 'model'} ({type(u.module).__qualname__})" for u in found if u.fallback)
    key = f"{type(model).__qualname__}: {kinds}"
    if kinds and key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(
            "dpsgd: no book-keeping for %s: per-sample gradients from torch.func (RNNs: sample by sample)", kinds
        )
    return found


@dataclass
class _Captured:
    unit: _Unit
    args: tuple
    kwargs: dict
    outputs: list[Any]  # the gradient edge of each tensor of the unit's output (None: none), in pytree order


def _batch_dims(unit: _Unit, count: int) -> list[int]:
    """The batch dimension of each output tensor of a fallback unit: RNNs put it second in their hidden states
    (and in their output unless batch_first); every other module first."""
    module = unit.module
    if isinstance(module, nn.RNNBase):
        first = 0 if module.batch_first else 1
        return [first] + [1] * (count - 1)
    return [0] * count


def _capture(
    model: nn.Module, found: list[_Unit], loss_fn: Any, x: torch.Tensor, y: torch.Tensor
) -> tuple[list[tuple[_Captured, list[torch.Tensor | None]]], torch.Tensor]:
    """Forward with hooks and one backward to the units' outputs: ((unit capture, output gradients) for each unit
    that took part, Σ_n ℓ_n detached)."""
    captured: dict[int, _Captured] = {}
    rnns = {id(u): [] for u in found if _book_kept_rnn(u.module)}  # each layer's (input, h_{t-1}, gate probes)

    def hook(unit: _Unit) -> Callable:
        def capture(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if id(unit) in captured:
                raise ValueError(
                    f"dpsgd: layer {unit.name or 'model'} was called more than once in one forward pass (shared "
                    "weights are not supported)"
                )
            if id(unit) in rnns:
                layers = rnns[id(unit)]
                probes = [get_gradient_edge(probe) for _, _, own in layers for probe in own]
                captured[id(unit)] = _Captured(unit, tuple((a, h) for a, h, _ in layers), {}, probes)
                return
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            detach = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            kw = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            edges = [get_gradient_edge(t) if t.requires_grad else None for t in leaves]  # not the outputs: no memory
            captured[id(unit)] = _Captured(unit, tuple(detach), kw, edges)

        return capture

    handles = [u.module.register_forward_hook(hook(u), with_kwargs=True) for u in found]
    for u in found:
        if id(u) in rnns:
            u.module.forward = functools.partial(_rnn_forward, u.module, rnns[id(u)])
    try:
        with torch.enable_grad():
            out = model(x)
            if not isinstance(out, torch.Tensor) or out.shape[0] != x.shape[0]:
                raise ValueError("dpsgd: the model must return one [B, ...] tensor")
            total = _loss_sum(loss_fn, out, y)
    finally:
        for h in handles:
            h.remove()
        for u in found:
            if id(u) in rnns:
                del u.module.forward  # the class's forward again
    taken = [c for u in found if (c := captured.get(id(u))) is not None]
    targets = [(i, j, e) for i, c in enumerate(taken) for j, e in enumerate(c.outputs) if e is not None]
    if not targets or not total.requires_grad:
        return [], total.detach()
    grads = torch.autograd.grad(total, [e for _, _, e in targets], allow_unused=True)
    per_unit: list[list[torch.Tensor | None]] = [[None] * len(c.outputs) for c in taken]
    for (i, j, _), g in zip(targets, grads, strict=True):
        per_unit[i][j] = g
    result = [(c, g) for c, g in zip(taken, per_unit, strict=True) if any(x is not None for x in g)]
    return result, total.detach()


class _Layer:
    """Per-sample squared norms and clip-weighted gradient sums of one captured unit.

    ``rows`` None: one model, the captured tensors [B, ...]. ``rows`` = k: k models (clients) captured under vmap,
    the tensors [k, B, ...]; a fallback unit then reads each row's parameters from ``row_params`` (full names).
    """

    def __init__(
        self,
        cap: _Captured,
        grads: list[torch.Tensor | None],
        rows: int | None = None,
        row_params: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.unit, self.rows = cap.unit, rows
        module = cap.unit.module
        self._per_sample: dict[str, torch.Tensor] | None = None  # fallback, LayerNorm, GroupNorm
        self._rnn: list[tuple[list[str], torch.Tensor | None, torch.Tensor, list[str]]] | None = None
        self.a = self.g = None
        if rows is not None and (cap.unit.fallback or isinstance(module, nn.RNNBase)):
            prefix = f"{cap.unit.name}." if cap.unit.name else ""
            parts = []
            for r in range(rows):
                own = {n: row_params[prefix + n][r] for n, _ in cap.unit.params}
                parts.append(_fallback_grads(_row(cap, r), [None if g is None else g[r] for g in grads], own))
            self._per_sample = {n: torch.cat([part[n] for part in parts]) for n in parts[0]}
            return
        if cap.unit.fallback:
            self._per_sample = _fallback_grads(cap, grads)
            return
        if isinstance(module, nn.RNNBase):
            self._rnn = _rnn_layers(cap.unit, cap.args, grads)
            return
        self.a, self.g = cap.args[0], grads[0]
        if rows is not None:  # the samples of every row as one batch
            self.a, self.g = self.a.flatten(0, 1), self.g.flatten(0, 1)
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
            self._per_sample = _norm_layer_grads(module, self.a, self.g)
        elif isinstance(module, (nn.Conv1d, nn.Conv2d)) and _materialise_conv(module, self.a, self.g):
            self._per_sample = _conv_per_sample_grads(module, self.a, self.g)
        if self._per_sample is not None:
            self.a = self.g = None  # not needed any more: free them before the next layer's work

    def sq_norms(self) -> torch.Tensor:
        """[k·B] squared norms of the unit's per-sample gradients."""
        module, a, g = self.unit.module, self.a, self.g
        if self._per_sample is not None:
            values = list(self._per_sample.values())
            B = values[0].shape[0]
            return torch.stack([v.reshape(B, -1).square().sum(1) for v in values]).sum(0)
        if self._rnn is not None:
            sq = 0
            for weights, a, dz, biases in self._rnn:
                if weights:
                    meta = nn.Linear(a.shape[-1], dz.shape[-1], bias=False, device="meta")
                    sq = sq + per_sample_grad_norms(meta, a, dz, squared=True)
                if biases:
                    sq = sq + len(biases) * dz.sum(1).square().sum(1)
            return sq
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            return per_sample_grad_norms(module, a, g, squared=True)
        if isinstance(module, nn.Conv1d):
            return per_sample_grad_norms(_conv1d_as_2d(module), a.unsqueeze(2), g.unsqueeze(2), squared=True)
        return _embedding_sq_norms(module, a, g)

    def clipped_sums(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """{parameter name: Σ_n factors[n]·∇_param ℓ_n} for the unit's trainable parameters, one sum per row
        ([k, *shape]; [*shape] for one model). ``factors``: [k·B]."""
        k = 1 if self.rows is None else self.rows
        out: dict[str, torch.Tensor] = {}
        if self._per_sample is not None:
            f = factors.reshape(k, -1)
            for n, v in self._per_sample.items():
                out[n] = torch.einsum("kb,kb...->k...", f.to(v.dtype), v.reshape(k, -1, *v.shape[1:]))
            return out if self.rows is not None else {n: v[0] for n, v in out.items()}
        if self._rnn is not None:
            for weights, a, dz, biases in self._rnn:
                gc = (dz * factors.to(dz.dtype)[:, None, None]).flatten(0, 1)
                if weights:
                    product = gc.T @ a.flatten(0, 1)
                    sizes = [self.unit.module.get_parameter(n).shape[1] for n in weights]
                    out.update(zip(weights, product.split(sizes, 1), strict=True))
                if biases:
                    out.update(dict.fromkeys(biases, gc.sum(0)))
            return out
        module, a = self.unit.module, self.a
        gc = self.g * factors.to(self.g.dtype).view(-1, *([1] * (self.g.dim() - 1)))
        wanted = dict(self.unit.params)
        if isinstance(module, nn.Linear):
            g3, a3 = gc.reshape(k, -1, gc.shape[-1]), a.reshape(k, -1, a.shape[-1])
            if "weight" in wanted:  # one model: a plain product (torch's bmm is slower on a batch of one)
                out["weight"] = torch.bmm(g3.mT, a3) if k > 1 else torch.mm(g3[0].T, a3[0])[None]
            if "bias" in wanted:
                out["bias"] = g3.sum(1)
        elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
            if "weight" in wanted:
                out["weight"] = _conv_weight_grads(module, a, gc, k)
            if "bias" in wanted:
                out["bias"] = gc.reshape(k, -1, gc.shape[1], gc[0, 0].numel()).sum((1, 3))
        else:  # Embedding: the rows' tables stacked, row r's token ids offset by r·V
            V = module.num_embeddings
            ids = (a.reshape(k, -1) + torch.arange(k, device=a.device)[:, None] * V).reshape(-1)
            vecs = gc.reshape(-1, gc.shape[-1])
            if module.padding_idx is not None:
                keep = a.reshape(-1) != module.padding_idx
                ids, vecs = ids[keep], vecs[keep]
            table = torch.zeros(k * V, module.embedding_dim, dtype=vecs.dtype, device=vecs.device)
            out["weight"] = table.index_add_(0, ids, vecs).reshape(k, V, -1)
        return out if self.rows is not None else {n: v[0] for n, v in out.items()}


def _row(cap: _Captured, r: int) -> _Captured:
    """Row r of a capture made under vmap over rows (every tensor's first dimension)."""

    def pick(v: Any) -> Any:
        return v[r] if isinstance(v, torch.Tensor) else v

    args = tuple(torch.utils._pytree.tree_map(pick, list(cap.args)))
    return _Captured(cap.unit, args, {k: pick(v) for k, v in cap.kwargs.items()}, cap.outputs)


def _conv1d_as_2d(layer: nn.Conv1d) -> nn.Conv2d:
    """A Conv2d with a (1, k) kernel on the meta device that does what ``layer`` does on inputs [B, C, 1, L]: only its
    shape and which parameters train are read (by per_sample_grad_norms)."""
    padding = layer.padding if isinstance(layer.padding, str) else (0, layer.padding[0])
    conv = nn.Conv2d(
        layer.in_channels,
        layer.out_channels,
        (1, layer.kernel_size[0]),
        stride=(1, layer.stride[0]),
        padding=padding,
        dilation=(1, layer.dilation[0]),
        bias=layer.bias is not None,
        device="meta",
    )
    conv.weight.requires_grad_(layer.weight.requires_grad)
    return conv


#: Elements of a conv layer's per-sample gradients [B, *weight shape] kept for its clipped sum (64 MiB of float32).
PER_SAMPLE_ELEMENTS = 1 << 24


def _materialise_conv(layer: nn.Module, a: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether a conv layer's per-sample weight gradients are the cheaper way to its norms (few weights a sample
    next to its output positions) and small enough to keep: then the clipped sum is a weighted sum of them, not a
    second weight-gradient convolution."""
    positions = g[0, 0].numel()
    return not gram_is_cheaper(positions, layer.weight[0].numel(), layer.out_channels) and (
        a.shape[0] * layer.weight.numel() <= PER_SAMPLE_ELEMENTS
    )


def _conv_per_sample_grads(layer: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample gradients {name: [B, *shape]} of a Conv1d/Conv2d's trainable weight and bias: the weight's as one
    weight-gradient convolution with one group per sample."""
    wanted = {n for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
    B, out = a.shape[0], {}
    if "weight" in wanted:
        padding = layer.padding
        if padding == "same":
            a = F.pad(a, layer._reversed_padding_repeated_twice)
            padding = 0
        elif padding == "valid":
            padding = 0
        weight_grad = torch.nn.grad.conv1d_weight if isinstance(layer, nn.Conv1d) else torch.nn.grad.conv2d_weight
        shape = (B * layer.out_channels, *layer.weight.shape[1:])
        grads = weight_grad(
            a.reshape(1, -1, *a.shape[2:]),
            shape,
            g.reshape(1, -1, *g.shape[2:]),
            layer.stride,
            padding,
            layer.dilation,
            B,
        )
        out["weight"] = grads.reshape(B, *layer.weight.shape)
    if "bias" in wanted:
        out["bias"] = g.flatten(2).sum(2)
    return out


def _conv_weight_grads(layer: nn.Module, a: torch.Tensor, g: torch.Tensor, k: int) -> torch.Tensor:
    """[k, *weight shape]: each row's Σ over its samples of a Conv1d/Conv2d's weight gradient, for inputs a and output
    gradients g of k rows' samples [k·B, C, ...] (torch's weight-gradient kernel, one group per row)."""
    padding = layer.padding
    if padding == "same":
        a = F.pad(a, layer._reversed_padding_repeated_twice)
        padding = 0
    elif padding == "valid":
        padding = 0
    if k > 1:  # [k·B, C, ...] → [B, k·C, ...]: row r's channels are group r
        a = a.reshape(k, -1, *a.shape[1:]).transpose(0, 1).flatten(1, 2)
        g = g.reshape(k, -1, *g.shape[1:]).transpose(0, 1).flatten(1, 2)
    weight_grad = torch.nn.grad.conv1d_weight if isinstance(layer, nn.Conv1d) else torch.nn.grad.conv2d_weight
    shape = (k * layer.out_channels, *layer.weight.shape[1:])
    grad = weight_grad(a, shape, g, layer.stride, padding, layer.dilation, k)
    return grad.reshape(k, *layer.weight.shape)


def _embedding_sq_norms(layer: nn.Embedding, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """‖Σ_t onehot(ids_t)·g_tᵀ‖² per sample = Σ_{t,s: ids_t = ids_s} ⟨g_t, g_s⟩ (padding tokens have no gradient)."""
    B = ids.shape[0]
    ids, g = ids.reshape(B, -1), g.reshape(B, -1, g.shape[-1])
    same = ids[:, :, None] == ids[:, None, :]
    if layer.padding_idx is not None:
        real = ids != layer.padding_idx
        same &= real[:, :, None] & real[:, None, :]
    return (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))


def _norm_layer_grads(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample gradients {name: [B, *shape]} of a LayerNorm's / GroupNorm's affine weight and bias: Σ g·x̂ and
    Σ g over the positions the parameters are shared by (x̂: the normalised input)."""
    if isinstance(module, nn.LayerNorm):
        x_hat = F.layer_norm(a, module.normalized_shape, None, None, module.eps)
        dims = list(range(1, a.dim() - len(module.normalized_shape)))
    else:
        x_hat = F.group_norm(a, module.num_groups, None, None, module.eps)
        dims = list(range(2, a.dim()))
    out = {}
    for name, _ in [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]:
        v = g * x_hat if name == "weight" else g
        out[name] = v.sum(dims) if dims else v
    return out


def _fallback_grads(
    cap: _Captured, grads: list[torch.Tensor | None], params: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Per-sample gradients {name: [B, *shape]} of a fallback unit's parameters (default: its own; ``params``: by
    name relative to the unit): torch.func's vmap over samples of the gradient of ⟨unit(inputs_n), output
    gradient_n⟩, the unit alone (its inputs held fixed)."""
    unit = cap.unit
    dims = _batch_dims(unit, len(cap.outputs))
    B = next(g.shape[d] for g, d in zip(grads, dims, strict=True) if g is not None)
    used = [(g, d) for g, d in zip(grads, dims, strict=True) if g is not None]
    keys = list(cap.kwargs)

    def in_dim(v: Any, first: int) -> int | None:
        return first if isinstance(v, torch.Tensor) and v.dim() > first and v.shape[first] == B else None

    args = list(cap.args)
    if isinstance(unit.module, nn.RNNBase):  # vmap needs the initial state as a batched input: zeros when absent
        args = [*args, cap.kwargs.pop("hx", None)] if len(args) == 1 else args
        keys = list(cap.kwargs)
        if args[1] is None:
            args[1] = _rnn_zero_state(unit.module, args[0])
        first = 0 if unit.module.batch_first else 1
        arg_dims: list[Any] = [first, (1, 1) if isinstance(args[1], tuple) else 1]
    else:
        nested = [i for i, v in enumerate(args) if isinstance(v, (tuple, list))]
        if nested:
            raise TypeError(
                f"dpsgd: layer {unit.name or 'model'} ({type(unit.module).__qualname__}) is called with a tuple "
                "argument; neither the per-sample norms nor the torch.func fallback handle it"
            )
        arg_dims = [in_dim(v, 0) for v in args]
    kw_dims = [in_dim(cap.kwargs[k], 0) for k in keys]
    params = {n: p.detach() for n, p in unit.params} if params is None else params

    def one(v: Any, dim: Any) -> Any:  # a sample as a batch of one
        if isinstance(dim, tuple):
            return tuple(one(u, d) for u, d in zip(v, dim, strict=True))
        return v if dim is None else v.unsqueeze(dim)

    def inner(p: dict, args: list, kwargs: list, gs: list) -> torch.Tensor:
        args = [one(v, d) for v, d in zip(args, arg_dims, strict=True)]
        kwargs = {k: one(v, d) for k, v, d in zip(keys, kwargs, kw_dims, strict=True)}
        out = torch.func.functional_call(unit.module, p, tuple(args), kwargs)
        leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        chosen = [t for t, g in zip(leaves, grads, strict=True) if g is not None]
        return sum((t * g.unsqueeze(d)).sum() for t, g, (_, d) in zip(chosen, gs, used, strict=True))

    if isinstance(unit.module, nn.RNNBase):  # torch's fused RNN kernels under vmap are ~50x slower than a loop
        return _per_sample_loop(inner, params, args, arg_dims, [cap.kwargs[k] for k in keys], kw_dims, used, B)
    per_sample = torch.func.vmap(
        torch.func.grad(inner),
        in_dims=(None, arg_dims, kw_dims, [d for _, d in used]),
        randomness="error",
    )
    try:
        result = per_sample(params, args, [cap.kwargs[k] for k in keys], [g for g, _ in used])
    except RuntimeError as err:
        raise TypeError(
            f"dpsgd: layer {unit.name or 'model'} ({type(unit.module).__qualname__}) is not supported by the "
            f"per-sample norms and torch.func failed on it ({str(err).splitlines()[0]})"
        ) from err
    return result


def _per_sample_loop(
    inner: Callable, params: dict, args: list, arg_dims: list, kwargs: list, kw_dims: list, used: list, B: int
) -> dict[str, torch.Tensor]:
    """What the vmap of :func:`_fallback_grads` computes, one sample at a time with autograd (for torch's fused RNN
    kernels, which vmap runs slowly)."""

    def pick(v: Any, dim: Any, n: int) -> Any:
        if isinstance(dim, tuple):
            return tuple(pick(u, d, n) for u, d in zip(v, dim, strict=True))
        return v if dim is None else v.select(dim, n)

    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    rows: list[tuple[torch.Tensor, ...]] = []
    with torch.enable_grad():
        for n in range(B):
            value = inner(
                leaves,
                [pick(v, d, n) for v, d in zip(args, arg_dims, strict=True)],
                [pick(v, d, n) for v, d in zip(kwargs, kw_dims, strict=True)],
                [g.select(d, n) for g, d in used],
            )
            rows.append(torch.autograd.grad(value, list(leaves.values()), allow_unused=True))
    return {
        name: torch.stack([torch.zeros_like(p) if r[i] is None else r[i] for r in rows])
        for i, (name, p) in enumerate(leaves.items())
    }


def _rnn_zero_state(module: nn.RNNBase, x: torch.Tensor) -> Any:
    """The zero initial state an RNN uses when called without one: h0 (and c0 for an LSTM), [layers, B, size]."""
    B = x.shape[0 if module.batch_first else 1]
    layers = module.num_layers * (2 if module.bidirectional else 1)
    h = x.new_zeros(layers, B, module.proj_size or module.hidden_size)
    return (h, x.new_zeros(layers, B, module.hidden_size)) if isinstance(module, nn.LSTM) else h


def _book_kept_rnn(module: nn.Module) -> bool:
    """Whether an LSTM's or GRU's per-sample norms come from its gate gradients (one direction, no projection)."""
    return isinstance(module, (nn.LSTM, nn.GRU)) and not module.bidirectional and not module.proj_size


class _LSTMLayer(torch.autograd.Function):
    """One LSTM layer whose backward also returns the gate pre-activations' gradient.

    forward(x [B, T, I], h0 [B, H], c0 [B, H], probe [B, T, 4H], w_ih, w_hh, b_ih, b_hh) → (y [B, T, H], h_T, c_T),
    torch's own LSTM kernel (i, f, g, o gates: Z_t = W_ih x_t + W_hh h_{t-1} + b). ``probe`` must be zero: it stands
    for an offset of Z, so its gradient is ∂L/∂Z [B, T, 4H], computed by the backward through time below from Z
    recomputed in one product (the forward keeps only y): the per-sample gradient of W_ih is Σ_t ∂L/∂Z_t ⊗ x_t, of
    W_hh Σ_t ∂L/∂Z_t ⊗ h_{t-1}, of each bias Σ_t ∂L/∂Z_t. Biases may be None.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, probe: torch.Tensor, *weights: Any
    ) -> tuple:
        used = [w for w in weights if w is not None]
        y, h, c = torch.lstm(x, (h0[None], c0[None]), used, len(used) == 4, 1, 0.0, False, False, True)
        ctx.save_for_backward(x, h0, c0, y, *weights)
        return y, h[0], c[0]

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor | None, dh_last: torch.Tensor | None, dc_last: torch.Tensor | None
    ) -> tuple:
        x, h0, c0, y, w_ih, w_hh, b_ih, b_hh = ctx.saved_tensors
        B, T, H = y.shape
        xt = x.transpose(0, 1)  # time-major: the loop's slices are contiguous
        h_prev = torch.cat([h0[None], y.transpose(0, 1)[:-1]])
        z = torch.matmul(xt, w_ih.T) + torch.matmul(h_prev, w_hh.T)
        if b_ih is not None:
            z += b_ih + b_hh
        z = z.view(T, B, 4, H)
        ifo = torch.sigmoid(z[:, :, [0, 1, 3]])
        i, f, o = ifo.unbind(2)
        g = torch.tanh(z[:, :, 2])
        c = torch.empty_like(g)
        state = c0
        for t in range(T):
            state = torch.addcmul(i[t] * g[t], f[t], state, out=c[t])
        tanh_c = torch.tanh(c)
        c_prev = torch.cat([c0[None], c[:-1]])
        slope = ifo * (1 - ifo)  # σ' of i, f, o
        keep = o * (1 - tanh_c.square())  # ∂c_t/∂h_t's factor: dc_t += dh_t·o_t·(1 − tanh² c_t)
        coef = torch.stack([g * slope[:, :, 0], c_prev * slope[:, :, 1], i * (1 - g.square())], 2)  # dc → di, df, dg
        out_coef = tanh_c * slope[:, :, 2]  # dh → do
        dz = torch.empty(T, B, 4, H, dtype=y.dtype, device=y.device)
        flat = dz.view(T, B, 4 * H)
        dyt = dy.transpose(0, 1) if dy is not None else torch.zeros_like(h_prev)
        dh = dh_last if dh_last is not None else torch.zeros_like(h0)
        dc = dc_last if dc_last is not None else torch.zeros_like(c0)
        for t in reversed(range(T)):
            dh = dyt[t] + dh if t == T - 1 else torch.addmm(dyt[t], flat[t + 1], w_hh)
            dc = torch.addcmul(dc if t == T - 1 else dc * f[t + 1], dh, keep[t])
            torch.mul(coef[t], dc[:, None], out=dz[t, :, :3])
            torch.mul(dh, out_coef[t], out=dz[t, :, 3])
        dh0 = flat[0] @ w_hh
        dc0 = dc * f[0]
        dx = torch.matmul(flat, w_ih).transpose(0, 1) if ctx.needs_input_grad[0] else None
        needs = ctx.needs_input_grad
        dw_ih = flat.flatten(0, 1).T @ xt.flatten(0, 1) if needs[4] else None
        dw_hh = flat.flatten(0, 1).T @ h_prev.flatten(0, 1) if needs[5] else None
        db = flat.sum((0, 1)) if b_ih is not None and (needs[6] or needs[7]) else None
        return dx, dh0, dc0, flat.transpose(0, 1), dw_ih, dw_hh, db, db


class _GRULayer(torch.autograd.Function):
    """One GRU layer whose backward also returns its gates' pre-activation gradients, as :class:`_LSTMLayer` does.

    forward(x [B, T, I], h0 [B, H], probe_ih, probe_hh [B, T, 3H], w_ih, w_hh, b_ih, b_hh) → (y [B, T, H], h_T),
    torch's GRU kernel: with A_t = W_ih x_t + b_ih and C_t = W_hh h_{t-1} + b_hh (r, z, n parts), r = σ(A_r + C_r),
    z = σ(A_z + C_z), n = tanh(A_n + r·C_n), h_t = (1 − z)·n + z·h_{t-1}. The zero probes stand for offsets of A and
    C: their gradients are ∂L/∂A and ∂L/∂C [B, T, 3H] (the per-sample gradient of W_ih is Σ_t ∂L/∂A_t ⊗ x_t, of W_hh
    Σ_t ∂L/∂C_t ⊗ h_{t-1}). Every gate is recomputed at once from y in the backward; only its loop runs over time.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, h0: torch.Tensor, probe_ih: torch.Tensor, probe_hh: torch.Tensor, *weights: Any
    ) -> tuple:
        used = [w for w in weights if w is not None]
        y, h = torch.gru(x, h0[None], used, len(used) == 4, 1, 0.0, False, False, True)
        ctx.save_for_backward(x, h0, y, *weights)
        return y, h[0]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor | None, dh_last: torch.Tensor | None) -> tuple:
        x, h0, y, w_ih, w_hh, b_ih, b_hh = ctx.saved_tensors
        B, T, H = y.shape
        xt = x.transpose(0, 1)
        h_prev = torch.cat([h0[None], y.transpose(0, 1)[:-1]])
        a, c = torch.matmul(xt, w_ih.T), torch.matmul(h_prev, w_hh.T)
        if b_ih is not None:
            a, c = a + b_ih, c + b_hh
        a, c = a.view(T, B, 3, H), c.view(T, B, 3, H)
        rz = torch.sigmoid(a[:, :, :2] + c[:, :, :2])
        r, z = rz.unbind(2)
        n = torch.tanh(a[:, :, 2] + r * c[:, :, 2])
        k_n = (1 - z) * (1 - n.square())  # dh_t → ∂L/∂A_n
        k_a = torch.stack([k_n * c[:, :, 2] * r * (1 - r), (h_prev - n) * z * (1 - z), k_n], 2)  # dh_t → ∂L/∂A
        k_c = torch.stack([k_a[:, :, 0], k_a[:, :, 1], k_n * r], 2)  # dh_t → ∂L/∂C
        da, dc = torch.empty_like(k_a), torch.empty_like(k_c)
        dyt = dy.transpose(0, 1) if dy is not None else torch.zeros_like(h_prev)
        dh = dyt[T - 1] + dh_last if dh_last is not None else dyt[T - 1]
        for t in reversed(range(T)):
            torch.mul(k_a[t], dh[:, None], out=da[t])
            torch.mul(k_c[t], dh[:, None], out=dc[t])
            dh = torch.addmm(dh * z[t], dc[t].view(B, 3 * H), w_hh)  # ∂L/∂h_{t-1} through step t
            if t:
                dh += dyt[t - 1]
        da, dc = da.view(T, B, 3 * H), dc.view(T, B, 3 * H)
        needs = ctx.needs_input_grad
        dx = torch.matmul(da, w_ih).transpose(0, 1) if needs[0] else None
        dw_ih = da.flatten(0, 1).T @ xt.flatten(0, 1) if needs[4] else None
        dw_hh = dc.flatten(0, 1).T @ h_prev.flatten(0, 1) if needs[5] else None
        db_ih = da.sum((0, 1)) if b_ih is not None and needs[6] else None
        db_hh = dc.sum((0, 1)) if b_hh is not None and needs[7] else None
        return dx, dh, da.transpose(0, 1), dc.transpose(0, 1), dw_ih, dw_hh, db_ih, db_hh


def _rnn_forward(module: nn.RNNBase, records: list, x: torch.Tensor, hx: Any = None) -> Any:
    """A book-kept LSTM's or GRU's forward, layer by layer through :class:`_LSTMLayer` / :class:`_GRULayer`; appends
    (layer input [B, T, I], its h_{t-1} sequence [B, T, H], its zero gate probes) of each layer to ``records``."""
    if isinstance(x, nn.utils.rnn.PackedSequence):
        raise TypeError(f"dpsgd: a {type(module).__name__} called on a PackedSequence is not supported")
    lstm = isinstance(module, nn.LSTM)
    batched = x.dim() == 3
    if not batched:
        x = x.unsqueeze(0 if module.batch_first else 1)
    if not module.batch_first:
        x = x.transpose(0, 1)
    B, T, H = x.shape[0], x.shape[1], module.hidden_size
    if hx is None:
        states = [x.new_zeros(module.num_layers, B, H)] * (2 if lstm else 1)
    else:
        states = [s if batched else s.unsqueeze(1) for s in (hx if lstm else (hx,))]
    finals: list[list[torch.Tensor]] = [[] for _ in states]
    for layer in range(module.num_layers):
        if layer and module.dropout and module.training:
            x = F.dropout(x, module.dropout, training=True)
        names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        weights = [None if w is None else w.detach() for w in (getattr(module, f"{n}_l{layer}", None) for n in names)]
        probes = [x.new_zeros(()).expand(B, T, (4 if lstm else 3) * H).requires_grad_() for _ in range(2 - lstm)]
        y, *last = (_LSTMLayer if lstm else _GRULayer).apply(x, *(s[layer] for s in states), *probes, *weights)
        records.append((x.detach(), torch.cat([states[0][layer][:, None], y[:, :-1]], 1).detach(), probes))
        for kept, state in zip(finals, last, strict=True):
            kept.append(state)
        x = y
    out = [torch.stack(kept) for kept in finals]
    if not module.batch_first:
        x = x.transpose(0, 1)
    if not batched:
        x, out = x.squeeze(0 if module.batch_first else 1), [v.squeeze(1) for v in out]
    return x, tuple(out) if lstm else out[0]


def _rnn_layers(
    unit: _Unit, records: tuple, grads: list[torch.Tensor | None]
) -> list[tuple[list[str], torch.Tensor | None, torch.Tensor, list[str]]]:
    """The book-kept products of an LSTM's or GRU's layers whose gates got a gradient: (trainable weights' names,
    their inputs side by side [B, T, ·] (x_t for W_ih, h_{t-1} for W_hh; None without trainable weights), the gate
    gradient they share [B, T, G·H], trainable biases' names). Each is then book-kept like a Linear over T steps: an
    LSTM's W_ih and W_hh share ∂L/∂Z (one product), a GRU's take ∂L/∂A and ∂L/∂C."""
    trainable = {n for n, _ in unit.params}
    shared = isinstance(unit.module, nn.LSTM)
    per_layer = len(grads) // len(records)
    out = []
    for layer, (x, h_prev) in enumerate(records):
        own = grads[layer * per_layer : (layer + 1) * per_layer]
        groups = [("ih", "hh")] if shared else [("ih",), ("hh",)]
        for kinds, g in zip(groups, own, strict=True):
            if g is None:
                continue
            inputs = {"ih": x, "hh": h_prev}
            weights = [f"weight_{k}_l{layer}" for k in kinds if f"weight_{k}_l{layer}" in trainable]
            parts = [inputs[w.split("_")[1]] for w in weights]
            a = torch.cat(parts, -1) if len(parts) > 1 else (parts[0] if parts else None)
            biases = [f"bias_{k}_l{layer}" for k in kinds if f"bias_{k}_l{layer}" in trainable]
            out.append((weights, a, g, biases))
    return out


@dataclass(frozen=True)
class _Leaf:
    """A tensor of a unit's inputs or output, as seen on one model's batch (the probe of :func:`_probe`)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Probe:
    """What each unit is called with and returns on one model's batch: the argument structure (non-tensor values
    kept, tensors as None) and the output's tensors; None for a unit that is not called."""

    calls: list[tuple[Any, list[Any], list[_Leaf]] | None]


_PROBES: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Probe]] = weakref.WeakKeyDictionary()


def _probe(model: nn.Module, found: list[_Unit], x: torch.Tensor) -> _Probe:
    """The units' call structure on one model's batch ``x`` (one forward without gradients, kept per input shape)."""
    cache = _PROBES.setdefault(model, {})
    key = (tuple(x.shape), x.dtype, tuple(id(u.module) for u in found))
    if key not in cache:
        calls: list[Any] = [None] * len(found)

        def hook(i: int) -> Callable:
            def record(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
                leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
                outs = [_Leaf(tuple(t.shape), t.dtype) for t in torch.utils._pytree.tree_leaves(out)]
                kept = [None if isinstance(v, torch.Tensor) else v for v in leaves]
                calls[i] = (spec, kept, outs)

            return record

        handles = [u.module.register_forward_hook(hook(i), with_kwargs=True) for i, u in enumerate(found)]
        try:
            with torch.no_grad():
                model(x)
        finally:
            for h in handles:
                h.remove()
        cache[key] = _Probe(calls)
    return cache[key]


def _masked_loss_sum(loss_fn: Any, out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Σ_n mask_n·ℓ_n (mask None: Σ_n ℓ_n) in out's autograd graph."""
    if mask is None:
        return _loss_sum(loss_fn, out, y)
    options = _cross_entropy_options(loss_fn) if out.dim() == 2 else None
    if options is not None:
        return (F.cross_entropy(out, y, reduction="none", **options) * mask).sum()
    losses = torch.func.vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(out, y)
    return (losses * mask).sum()


def _batched_capture(
    model: nn.Module,
    found: list[_Unit],
    loss_fn: Any,
    params: dict[str, torch.Tensor],
    xb: torch.Tensor,
    yb: torch.Tensor,
    mask: torch.Tensor | None,
) -> tuple[list[tuple[_Captured, list[torch.Tensor | None]]], torch.Tensor]:
    """The capture of :func:`_capture` for k models at once (``params`` {name: [k, *shape]}, batches xb [k, B, ...],
    yb [k, B]), under torch.func: each unit's output gets a zero probe added, whose gradient is the output gradient.
    Returns ((unit capture, output gradients), [k, B, ...] tensors) for each unit called, and the [k] loss sums."""
    k = xb.shape[0]
    probe = _probe(model, found, xb[0])
    floating = [[leaf.dtype.is_floating_point for leaf in c[2]] if c else [] for c in probe.calls]
    zs = [
        [
            torch.zeros((k, *leaf.shape), dtype=leaf.dtype, device=xb.device)
            for leaf in c[2]
            if leaf.dtype.is_floating_point
        ]
        if c
        else []
        for c in probe.calls
    ]

    def objective(z: list, p: dict, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor | None) -> tuple:
        inputs: list[list[torch.Tensor]] = [[] for _ in found]

        def hook(i: int) -> Callable:
            def add_probe(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
                leaves = torch.utils._pytree.tree_leaves((args, kwargs))
                inputs[i] = [v for v in leaves if isinstance(v, torch.Tensor)]
                outs, spec = torch.utils._pytree.tree_flatten(out)
                probes = iter(z[i])
                outs = [o + next(probes) if f else o for o, f in zip(outs, floating[i], strict=True)]
                return torch.utils._pytree.tree_unflatten(outs, spec)

            return add_probe

        handles = [u.module.register_forward_hook(hook(i), with_kwargs=True) for i, u in enumerate(found)]
        try:
            total = _masked_loss_sum(loss_fn, torch.func.functional_call(model, p, (x,)), y, m)
        finally:
            for h in handles:
                h.remove()
        return total, (inputs, total.detach())

    step = torch.func.grad(objective, has_aux=True)
    in_dims = (0, 0, 0, 0, None if mask is None else 0)
    grads, (inputs, totals) = torch.func.vmap(step, in_dims=in_dims, randomness="different")(zs, params, xb, yb, mask)
    result = []
    for i, unit in enumerate(found):
        call = probe.calls[i]
        if call is None:
            continue
        spec, kept, outs = call
        tensors = iter(inputs[i])
        args, kwargs = torch.utils._pytree.tree_unflatten([next(tensors) if v is None else v for v in kept], spec)
        g = iter(grads[i])
        out_grads = [next(g) if leaf.dtype.is_floating_point else None for leaf in outs]
        result.append((_Captured(unit, tuple(args), dict(kwargs), [None] * len(outs)), out_grads))
    return result, totals


class _Penalty(nn.Module):
    """forward() = penalty(model), so that torch.func can swap the model's parameters under it."""

    def __init__(self, model: nn.Module, penalty: Callable[[nn.Module], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.penalty = [penalty]  # a plain list: not a submodule

    def forward(self) -> torch.Tensor:
        return self.penalty[0](self.model)


def _check_expected(b: Any, where: str) -> float:
    if isinstance(b, bool) or not isinstance(b, (int, float, np.integer, np.floating)) or not 0 < b < math.inf:
        raise ValueError(f"dpsgd: expected_batch must be None or a finite number > 0{where}, got {b!r}")
    return float(b)


@dataclass(frozen=True)
class DPSGD:
    """Local DP-SGD settings: clip C, noise multiplier σ, the noise seed, and Poisson sampling's expected batch size.

    Args:
        clip: C > 0, the ℓ2 bound of each sample's gradient.
        noise_multiplier: σ ≥ 0; the noise added to a batch's clipped sum has standard deviation σ·C per coordinate.
        seed: the noise streams' seed; the noise of a step is keyed by (seed, *key) (e.g. round, client, step), so
            it is reproducible and the same for every thread count and path.
        expected_batch: None for fixed-size batches (the sum is divided by each batch's size); with Poisson
            sampling at rate q, q·|D|: every sum is divided by it, whatever the batch's size (b = 0 included), and
            a step's loss is Σ_n ℓ_n divided by it (an empty batch's: 0), the objective whose gradient the step
            estimates. A callable gives it per step, from the step's noise key (e.g. clients of unequal q·|D_i|: the
            engine's key (round, client, step)); it must return a finite number > 0.
    """

    clip: float
    noise_multiplier: float
    seed: int = 0
    expected_batch: float | Callable[[Sequence[int]], float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not 0 < self.clip < math.inf:
            raise ValueError(f"dpsgd: clip must be a finite number > 0, got {self.clip!r}")
        sigma = self.noise_multiplier
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma < math.inf:
            raise ValueError(f"dpsgd: noise_multiplier must be a finite number >= 0, got {sigma!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"dpsgd: seed must be an integer >= 0, got {self.seed!r}")
        b = self.expected_batch
        if b is not None and not callable(b):
            _check_expected(b, "")

    def expected_size(self, key: Sequence[int]) -> float | None:
        """The expected batch size of the step ``key`` (Poisson sampling), or None (fixed-size batches)."""
        b = self.expected_batch
        if b is None or not callable(b):
            return b
        return _check_expected(b(key), f" (for key {tuple(key)})")

    def add_noise_(self, grad: torch.Tensor, key: Sequence[int], scale: float) -> torch.Tensor:
        """grad += scale·σC·ξ in one pass, ξ ~ N(0, I) from the step's stream (seed, *key) of
        :func:`pyfedkern.ops.gaussian_noise_` (counter-based: the same numbers for every thread count and path;
        ``grad`` a [d] vector, in place)."""
        if self.noise_multiplier == 0:
            return grad
        return gaussian_noise_(grad, scale * self.noise_multiplier * self.clip, int(self.seed), _NOISE_TAG, *key)

    def clipped_sum(
        self, model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(scale·Σ_n min(1, C/‖∇ℓ_n‖)·∇ℓ_n for each trainable parameter of ``model`` in ``parameters()`` order,
        the per-sample gradient norms [B], Σ_n ℓ_n), in one forward and one backward pass.

        ``loss_fn(output[n:n+1], y[n:n+1])`` is sample n's loss ℓ_n (e.g. ``F.cross_entropy``).
        """
        found = units(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        B = x.shape[0]
        sums: dict[int, torch.Tensor] = {}
        if B == 0:
            return [torch.zeros_like(p) for p in trainable], x.new_zeros(0), x.new_zeros(())
        captured, total = _capture(model, found, loss_fn, x, y)
        layers = []
        while captured:  # each layer's input and output gradient freed as soon as its work no longer needs them
            layers.append(_Layer(*captured.pop(0)))
        dtype = trainable[0].dtype if trainable else x.dtype
        sq = torch.zeros(B, dtype=dtype, device=x.device)
        for layer in layers:
            sq = sq + layer.sq_norms().to(dtype)
        norms = sq.sqrt()
        factors = torch.where(norms > self.clip, self.clip / norms, torch.ones_like(norms)) * scale
        for layer in layers:
            named = layer.clipped_sums(factors)
            for n, p in layer.unit.params:
                if n in named:
                    sums[id(p)] = named[n].to(p.dtype)
        return [sums[id(p)] if id(p) in sums else torch.zeros_like(p) for p in trainable], norms, total

    def batched_clipped_sums(
        self,
        model: nn.Module,
        loss_fn: Any,
        params: dict[str, torch.Tensor],
        xb: torch.Tensor,
        yb: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """:meth:`clipped_sum` of k models at once, as one batched step (torch.func over the rows).

        Args:
            params: {name: [k, *shape]}: every trainable parameter of ``model`` (its ``named_parameters`` names),
                row r model r's.
            xb, yb: the rows' batches [k, B, ...], [k, B].
            mask: [k, B] 1 on real samples, 0 on padding (padding adds nothing); None: all real.

        Returns ({name: [k, *shape]} clipped sums, per-sample gradient norms [k, B], [k] loss sums).
        """
        found = units(model)
        k, B = xb.shape[:2]
        captured, totals = _batched_capture(model, found, loss_fn, params, xb, yb, mask)
        layers = [_Layer(c, g, rows=k, row_params=params) for c, g in captured]
        dtype = next(iter(params.values())).dtype
        sq = torch.zeros(k * B, dtype=dtype, device=xb.device)
        for layer in layers:
            sq = sq + layer.sq_norms().to(dtype)
        norms = sq.sqrt()
        factors = torch.where(norms > self.clip, self.clip / norms, torch.ones_like(norms))
        if mask is not None:
            factors = factors * mask.reshape(-1).to(dtype)
        sums: dict[str, torch.Tensor] = {}
        for layer in layers:
            prefix = f"{layer.unit.name}." if layer.unit.name else ""
            for n, v in layer.clipped_sums(factors).items():
                sums[prefix + n] = v.to(dtype)
        out = {n: sums[n] if n in sums else torch.zeros_like(p) for n, p in params.items()}
        return out, norms.reshape(k, B), totals

    def batched_gradients(
        self,
        model: nn.Module,
        loss_fn: Any,
        params: dict[str, torch.Tensor],
        xb: torch.Tensor,
        yb: torch.Tensor,
        keys: Sequence[Sequence[int]],
        weights: torch.Tensor | None = None,
        *,
        penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """:meth:`gradient_` of k models at once: ({name: [k, *shape]} gradients, [k] objective values).

        Row r's gradient is (its clipped sum + σC·ξ_r)/b_r plus ∇penalty at its parameters, ξ_r from the stream
        ``keys[r]`` drawn over the parameters in ``params``' order: with ``params`` in the flat layout's order, the
        loop's gradient for the same key. ``weights`` [k, B]: > 0 on row r's b_r real samples, 0 on its padding
        (None: every row has B samples; a row may have none). With ``expected_batch``, b_r is row r's expected size
        (:meth:`expected_size` of ``keys[r]``), and so is its loss's divisor.
        """
        k, B = xb.shape[:2]
        dtype = next(iter(params.values())).dtype
        mask = None if weights is None else (weights > 0).to(dtype)
        sums, _, totals = self.batched_clipped_sums(model, loss_fn, params, xb, yb, mask)
        sizes = torch.full((k,), float(B), dtype=dtype, device=xb.device) if mask is None else mask.sum(1)
        if self.expected_batch is not None:  # Poisson sampling: the expected size, and the loss over it too
            sizes = torch.tensor([self.expected_size(key) for key in keys], dtype=dtype, device=xb.device)
        b = torch.where(sizes > 0, sizes, torch.ones_like(sizes))
        flat = torch.cat([sums[n].reshape(k, -1) for n in params], 1).div_(b[:, None])
        for r, scale in enumerate((1.0 / b).tolist()):
            self.add_noise_(flat[r], keys[r], scale)
        losses = totals.to(torch.float64) / sizes.to(torch.float64)
        if penalty is not None:
            wrapper = _Penalty(model, penalty)

            def value(p: dict[str, torch.Tensor]) -> torch.Tensor:
                return torch.func.functional_call(wrapper, {f"model.{n}": v for n, v in p.items()}, ())

            extra, values = torch.func.vmap(torch.func.grad_and_value(value))(params)
            flat += torch.cat([extra[n].reshape(k, -1) for n in params], 1)
            losses = losses + values.detach().to(torch.float64)
        out, offset = {}, 0
        for n, p in params.items():
            size = p[0].numel()
            out[n] = flat[:, offset : offset + size].view_as(p)
            offset += size
        return out, losses

    def gradient_(
        self,
        model: nn.Module,
        loss_fn: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        key: Sequence[int],
        grad: torch.Tensor | None = None,
        *,
        penalty: Callable[[nn.Module], torch.Tensor] | None = None,
    ) -> float:
        """One DP-SGD gradient: each trainable parameter's ``.grad`` (or, when given, the flat [d] buffer ``grad``
        they are views of) ← (clipped sum + σC·ξ)/b, plus ∇penalty(model) (data-independent, not clipped); returns
        the batch's loss Σ_n ℓ_n/b (fixed-size batches of b = 0: NaN) plus the penalty. ``key``: the step's noise
        stream; b the batch's size, or with ``expected_batch`` its expected size (:meth:`expected_size` of ``key``).
        """
        expected = self.expected_size(key)
        b = expected if expected is not None else x.shape[0]
        sums, _, total = self.clipped_sum(model, loss_fn, x, y, 1.0 / b if b else 1.0)
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, s in zip(params, sums, strict=True):
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(s)
            if grad is not None:
                self.add_noise_(grad, key, 1.0 / b if b else 1.0)
            else:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                self.add_noise_(flat, key, 1.0 / b if b else 1.0)
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        loss = float(total) / b if b else math.nan
        if penalty is not None:
            with torch.enable_grad():
                value = penalty(model)
                extra = torch.autograd.grad(value, params, allow_unused=True)
            with torch.no_grad():
                for p, e in zip(params, extra, strict=True):
                    if e is not None:
                        p.grad.add_(e)
            loss += float(value.detach())
        return loss
