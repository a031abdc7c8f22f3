"""Local (record-level) DP-SGD in one backward pass: per-sample clipping by book-keeping, and seeded Gaussian noise.

Each step's gradient is (Σ_n w_n·min(1, C/‖∇ℓ_n‖)·∇ℓ_n + ξ/b), ξ ~ N(0, σ²C²·I) (Abadi et al. 2016), with
w_n = 1/b for every sample of a batch of b (fixed-size batches) or of expected size b (Poisson sampling). The
per-sample gradients ∇ℓ_n are never built for the supported layers (book-keeping, Bu et al. 2023): one forward pass
captures each layer's input, one backward pass from Σ_n ℓ_n stops at the layer outputs (no parameter gradient is
computed), the per-sample norms come from each layer's (input, output gradient) pair, and each layer's clipped
gradient sum is one product of the clip-weighted output gradients with the input (the product a plain backward
computes).

Supported layers: Linear, Conv1d, Conv2d (groups 1, zero padding), Embedding, LayerNorm, GroupNorm. A module of any
other kind that holds trainable parameters (LSTM, GRU, attention, a bare ``nn.Parameter``) is handled with
``torch.func`` (per-sample gradients of that module alone, vmap over grad), named once in a log line. BatchNorm in
training mode mixes samples and is refused.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pyfedkern.ops.norms import per_sample_grad_norms
from pyfedkern.persample import _loss_sum

logger = logging.getLogger("pyfedkern")

#: Layers whose per-sample norms and clipped sums are computed from (input, output gradient).
NATIVE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm)
#: Mixed into every noise stream's seed, so that DP noise never repeats another stream keyed by the same numbers.
_NOISE_TAG = 0x44505347
_LOGGED: set[str] = set()


def _native(module: nn.Module) -> bool:
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return module.groups == 1 and module.padding_mode == "zeros"
    if isinstance(module, nn.Embedding):
        return not module.sparse and not module.scale_grad_by_freq
    return isinstance(module, NATIVE)


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
        logger.info("dpsgd: per-sample gradients through torch.func for %s", kinds)
    return found


@dataclass
class _Captured:
    unit: _Unit
    args: tuple
    kwargs: dict
    outputs: list[torch.Tensor]  # the tensors of the unit's output, in pytree order


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

    def hook(unit: _Unit) -> Callable:
        def capture(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if id(unit) in captured:
                raise ValueError(
                    f"dpsgd: layer {unit.name or 'model'} was called more than once in one forward pass (shared "
                    "weights are not supported)"
                )
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            detach = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
            kw = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            captured[id(unit)] = _Captured(unit, tuple(detach), kw, leaves)

        return capture

    handles = [u.module.register_forward_hook(hook(u), with_kwargs=True) for u in found]
    try:
        with torch.enable_grad():
            out = model(x)
            if not isinstance(out, torch.Tensor) or out.shape[0] != x.shape[0]:
                raise ValueError("dpsgd: the model must return one [B, ...] tensor")
            total = _loss_sum(loss_fn, out, y)
    finally:
        for h in handles:
            h.remove()
    taken = [c for u in found if (c := captured.get(id(u))) is not None]
    targets = [(i, t) for i, c in enumerate(taken) for t in c.outputs if t.requires_grad]
    if not targets or not total.requires_grad:
        return [], total.detach()
    grads = torch.autograd.grad(total, [t for _, t in targets], allow_unused=True)
    per_unit: list[list[torch.Tensor | None]] = [[None] * len(c.outputs) for c in taken]
    position = {(i, id(t)): j for i, c in enumerate(taken) for j, t in enumerate(c.outputs)}
    for (i, t), g in zip(targets, grads, strict=True):
        per_unit[i][position[(i, id(t))]] = g
    result = [(c, g) for c, g in zip(taken, per_unit, strict=True) if any(x is not None for x in g)]
    return result, total.detach()


class _Layer:
    """Per-sample squared norms and clip-weighted gradient sums of one captured unit."""

    def __init__(self, cap: _Captured, grads: list[torch.Tensor | None]) -> None:
        self.unit, self.cap, self.grads = cap.unit, cap, grads
        module = cap.unit.module
        self.a = cap.args[0] if cap.args else None
        self.g = grads[0]
        self._per_sample: dict[str, torch.Tensor] | None = None  # fallback, LayerNorm, GroupNorm
        if cap.unit.fallback:
            self._per_sample = _fallback_grads(cap, grads)
        elif isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
            self._per_sample = _norm_layer_grads(module, self.a, self.g)

    def sq_norms(self) -> torch.Tensor:
        module, a, g = self.unit.module, self.a, self.g
        if self._per_sample is not None:
            B = next(iter(self._per_sample.values())).shape[0]
            total = torch.zeros(B, dtype=torch.float64 if g is None else g.dtype, device=self._device())
            for v in self._per_sample.values():
                total = total + v.reshape(B, -1).square().sum(1)
            return total
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            return per_sample_grad_norms(module, a, g, squared=True)
        if isinstance(module, nn.Conv1d):
            return per_sample_grad_norms(_conv1d_as_2d(module), a.unsqueeze(2), g.unsqueeze(2), squared=True)
        return _embedding_sq_norms(module, a, g)

    def _device(self) -> torch.device:
        return next(iter(self._per_sample.values())).device

    def clipped_sums(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """{parameter name: Σ_n factors[n]·∇_param ℓ_n} for the unit's trainable parameters."""
        if self._per_sample is not None:
            return {n: torch.tensordot(factors.to(v.dtype), v, dims=1) for n, v in self._per_sample.items()}
        module, a = self.unit.module, self.a
        gc = self.g * factors.to(self.g.dtype).view(-1, *([1] * (self.g.dim() - 1)))
        wanted = dict(self.unit.params)
        out: dict[str, torch.Tensor] = {}
        if isinstance(module, nn.Linear):
            g2, a2 = gc.reshape(-1, gc.shape[-1]), a.reshape(-1, a.shape[-1])
            if "weight" in wanted:
                out["weight"] = g2.T @ a2
            if "bias" in wanted:
                out["bias"] = g2.sum(0)
        elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
            if "weight" in wanted:
                out["weight"] = _conv_weight_grad(module, a, gc)
            if "bias" in wanted:
                out["bias"] = gc.sum([0, *range(2, gc.dim())])
        else:  # Embedding
            ids, rows = a.reshape(-1), gc.reshape(-1, gc.shape[-1])
            if module.padding_idx is not None:
                keep = ids != module.padding_idx
                ids, rows = ids[keep], rows[keep]
            out["weight"] = torch.zeros_like(module.weight).index_add_(0, ids, rows.to(module.weight.dtype))
        return out


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


def _conv_weight_grad(layer: nn.Module, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Σ over the batch of a Conv1d/Conv2d's weight gradient for input a and output gradient g (torch's kernel)."""
    padding = layer.padding
    if padding == "same":
        a = F.pad(a, layer._reversed_padding_repeated_twice)
        padding = 0
    elif padding == "valid":
        padding = 0
    weight_grad = torch.nn.grad.conv1d_weight if isinstance(layer, nn.Conv1d) else torch.nn.grad.conv2d_weight
    return weight_grad(a, layer.weight.shape, g, layer.stride, padding, layer.dilation, layer.groups)


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


def _fallback_grads(cap: _Captured, grads: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Per-sample gradients {name: [B, *shape]} of a fallback unit's parameters: torch.func's vmap over samples of
    the gradient of ⟨unit(inputs_n), output gradient_n⟩, the unit alone (its inputs held fixed)."""
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
    params = {n: p.detach() for n, p in unit.params}

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


def _rnn_zero_state(module: nn.RNNBase, x: torch.Tensor) -> Any:
    """The zero initial state an RNN uses when called without one: h0 (and c0 for an LSTM), [layers, B, size]."""
    B = x.shape[0 if module.batch_first else 1]
    layers = module.num_layers * (2 if module.bidirectional else 1)
    h = x.new_zeros(layers, B, module.proj_size or module.hidden_size)
    return (h, x.new_zeros(layers, B, module.hidden_size)) if isinstance(module, nn.LSTM) else h


@dataclass(frozen=True)
class DPSGD:
    """Local DP-SGD settings: clip C, noise multiplier σ, the noise seed, and Poisson sampling's expected batch size.

    Args:
        clip: C > 0, the ℓ2 bound of each sample's gradient.
        noise_multiplier: σ ≥ 0; the noise added to a batch's clipped sum has standard deviation σ·C per coordinate.
        seed: the noise streams' seed; the noise of a step is keyed by (seed, *key) (e.g. round, client, step), so
            it is reproducible and the same for every thread count and path.
        expected_batch: None for fixed-size batches (the sum is divided by each batch's size); with Poisson
            sampling at rate q, q·|D|: every sum is divided by it, whatever the batch's size (b = 0 included).
    """

    clip: float
    noise_multiplier: float
    seed: int = 0
    expected_batch: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float)) or not 0 < self.clip < math.inf:
            raise ValueError(f"dpsgd: clip must be a finite number > 0, got {self.clip!r}")
        sigma = self.noise_multiplier
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma < math.inf:
            raise ValueError(f"dpsgd: noise_multiplier must be a finite number >= 0, got {sigma!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"dpsgd: seed must be an integer >= 0, got {self.seed!r}")
        b = self.expected_batch
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < math.inf):
            raise ValueError(f"dpsgd: expected_batch must be None or a finite number > 0, got {b!r}")

    def generator(self, key: Sequence[int], device: torch.device | str = "cpu") -> torch.Generator:
        """The noise generator of one step: a torch.Generator seeded from (seed, *key)."""
        words = np.random.SeedSequence([_NOISE_TAG, int(self.seed), *(int(k) for k in key)]).generate_state(2)
        gen = torch.Generator(device=device)
        gen.manual_seed(int(words[0]) << 32 | int(words[1]))
        return gen

    def add_noise_(self, grad: torch.Tensor, key: Sequence[int], scale: float) -> torch.Tensor:
        """grad += scale·σC·ξ, ξ ~ N(0, I) from the step's stream (``grad`` a flat [d] vector, in place)."""
        if self.noise_multiplier == 0:
            return grad
        noise = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        noise.normal_(generator=self.generator(key, grad.device))
        return grad.add_(noise, alpha=scale * self.noise_multiplier * self.clip)

    def clipped_sum(
        self, model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(Σ_n min(1, C/‖∇ℓ_n‖)·∇ℓ_n for each trainable parameter of ``model`` in ``parameters()`` order, the
        per-sample gradient norms [B], Σ_n ℓ_n), in one forward and one backward pass.

        ``loss_fn(output[n:n+1], y[n:n+1])`` is sample n's loss ℓ_n (e.g. ``F.cross_entropy``).
        """
        found = units(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        B = x.shape[0]
        sums: dict[int, torch.Tensor] = {}
        if B == 0:
            return [torch.zeros_like(p) for p in trainable], x.new_zeros(0), x.new_zeros(())
        captured, total = _capture(model, found, loss_fn, x, y)
        layers = [_Layer(c, g) for c, g in captured]
        dtype = trainable[0].dtype if trainable else x.dtype
        sq = torch.zeros(B, dtype=dtype, device=x.device)
        for layer in layers:
            sq = sq + layer.sq_norms().to(dtype)
        norms = sq.sqrt()
        factors = torch.where(norms > self.clip, self.clip / norms, torch.ones_like(norms))
        for layer in layers:
            named = layer.clipped_sums(factors)
            for n, p in layer.unit.params:
                if n in named:
                    sums[id(p)] = named[n].to(p.dtype)
        return [sums.get(id(p), torch.zeros_like(p)) for p in trainable], norms, total

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
        the mean (b = 0: NaN) loss of the batch plus the penalty. ``key``: the step's noise stream.
        """
        sums, _, total = self.clipped_sum(model, loss_fn, x, y)
        b = self.expected_batch if self.expected_batch is not None else x.shape[0]
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, s in zip(params, sums, strict=True):
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(s).div_(b if b else 1)
            if grad is not None:
                self.add_noise_(grad, key, 1.0 / b if b else 1.0)
            else:
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                self.add_noise_(flat, key, 1.0 / b if b else 1.0)
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        loss = float(total) / x.shape[0] if x.shape[0] else math.nan
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
