"""BHerd (arXiv 2403.16557) and its relatives: BHerd-FedAvg, GraB-FedAvg, BHerd-FedNova, BHerd-SCAFFOLD and FedNova.

Follows shared specs/bherd.md. A BHerd client runs τ_i plain SGD steps w ← w − η·y_λ over its batches in a fixed
order (non-RR), records every minibatch gradient y_λ as a row of a [τ_i, d] buffer (:class:`GradientRecorder`,
float32 or bfloat16), selects K_i = round(α·τ_i) of them by greedy herding (:func:`pyfedkern.ops.herding_select`)
and sends g_i = Σ_{selected} y (raw gradients, never recomputed); its final local model is discarded. The server
applies w ← w − η·(E/α)·Σ p_i g_i (Eq. 7) with p_i = |D_i| / Σ_participants |D_j|.

Clients are simulated one after another and share one recorder, so the gradient buffer costs τ·d floats once, not
per client. Selection runs on each client's own buffer (the batched op form serves callers who hold all buffers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from pyfedkern import ops
from pyfedkern.algorithms.base import Algorithm, ClientMessage, ClientStore, FLContext, RoundStats, local_sgd
from pyfedkern.ops.herding import check_alpha, selection_size

BUFFER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ORDERS = ("fixed", "reshuffle")


class GradientRecorder:
    """The minibatch gradients of one client's round as rows of a [capacity, d] buffer, for herding selection.

    Drop it into any training loop::

        rec = GradientRecorder(dim=d, capacity=tau)
        for xb, yb in batches:                      # plain SGD, fixed batch order
            loss = loss_fn(model(xb), yb); model.zero_grad(); loss.backward()
            rec.record_module(model)                # or rec.record(flat_grad) for a flat [d] gradient
            with torch.no_grad():
                for p in model.parameters(): p -= lr * p.grad
        indices, g = rec.select(alpha=0.5)          # send g (the sum of the selected raw gradients)
        rec.reset()                                 # reuse the buffer next round

    Args:
        dim: gradient length d (number of model parameters).
        capacity: rows to allocate (τ); the buffer doubles if more gradients arrive.
        dtype: storage dtype, torch.float32 or torch.bfloat16 (half the memory; sums still accumulate in float32).
        device: where the buffer lives (the model's device).
    """

    def __init__(
        self,
        dim: int,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if dim < 1 or capacity < 1:
            raise ValueError(f"GradientRecorder needs dim >= 1 and capacity >= 1, got {dim} and {capacity}")
        if dtype not in BUFFER_DTYPES.values():
            raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
        self.buffer = torch.empty(capacity, dim, dtype=dtype, device=device)
        self.count = 0

    @property
    def dim(self) -> int:
        return self.buffer.shape[1]

    @property
    def grads(self) -> torch.Tensor:
        """The recorded gradients [count, d] (a view of the buffer)."""
        return self.buffer[: self.count]

    def reset(self) -> None:
        """Forget the recorded gradients (the memory is kept)."""
        self.count = 0

    def _next_row(self) -> torch.Tensor:
        if self.count == self.buffer.shape[0]:
            grown = torch.empty(2 * self.buffer.shape[0], self.dim, dtype=self.buffer.dtype, device=self.buffer.device)
            grown[: self.count].copy_(self.buffer)
            self.buffer = grown
        row = self.buffer[self.count]
        self.count += 1
        return row

    def record(self, grad: torch.Tensor) -> None:
        """Append one flat gradient [d] (copied and cast to the buffer's dtype)."""
        if grad.shape != (self.dim,):
            raise ValueError(f"grad must have shape ({self.dim},), got {tuple(grad.shape)}")
        self._next_row().copy_(grad.detach())

    def record_module(self, module: nn.Module) -> None:
        """Append the gradients of ``module.parameters()`` as one flat row (parameters without a gradient give 0)."""
        row = self._next_row()
        offset = 0
        for p in module.parameters():
            n = p.numel()
            if p.grad is None:
                row[offset : offset + n].zero_()
            else:
                row[offset : offset + n].copy_(p.grad.detach().reshape(-1))
            offset += n
        if offset != self.dim:
            self.count -= 1
            raise ValueError(f"module has {offset} parameters, the recorder holds gradients of length {self.dim}")

    def select(self, alpha: float, *, return_gap: bool = False) -> tuple[Any, ...]:
        """Herding selection of round(α·count) recorded gradients: (indices, Σ_selected y [d] float32[, gap])."""
        if self.count == 0:
            raise ValueError("no gradients recorded: call record() after each minibatch first")
        idx, total, *gap = ops.herding_select(self.grads, alpha, return_gap=return_gap)
        total = total.to(torch.float32)
        return (idx, total, float(gap[0][0])) if return_gap else (idx, total)


def planned_steps(ctx: FLContext, cid: int) -> int:
    """τ_i = ⌊E·|D_i|/B⌋ (or ctx.local_steps): the steps of ``ctx.batches(..., drop_last=True)``."""
    if ctx.local_steps is not None:
        return int(ctx.local_steps)
    n = int(ctx.client_sizes[cid])
    size = min(ctx.batch_size, n)
    return math.floor(ctx.local_epochs * n / size + 1e-9)


def _weights(messages: list[ClientMessage]) -> np.ndarray:
    w = np.array([m.weight for m in messages], dtype=np.float64)
    return w / w.sum()


def _check_common(alpha: float | None, order: str) -> None:
    if alpha is not None:
        check_alpha(alpha)
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


def _check_plain_sgd(ctx: FLContext, name: str) -> None:
    if ctx.momentum:
        raise ValueError(
            f"{name} runs plain SGD local steps (the paper's Eq. 3); set momentum to 0, got {ctx.momentum}"
        )


@dataclass
class BHerd(Algorithm):
    """BHerd-FedAvg: herding-selected gradient sums, server step w ← w − η·(E/α)·Σ p_i g_i (specs/bherd.md §1).

    Args:
        alpha: selection fraction α ∈ (0, 1]; K_i = round(α·τ_i) clamped to [1, τ_i].
        buffer_dtype: storage of the recorded gradients, "float32" or "bfloat16".
        order: batch order, "fixed" (one seeded order kept across rounds: the paper's non-RR) or "reshuffle" (RR).
        epoch_scale: the literal E/α factor of Eq. 7 (False: 1/α; they agree at E = 1).
    """

    name = "bherd"
    alpha: float = 0.5
    buffer_dtype: str = "float32"
    order: str = "fixed"
    epoch_scale: bool = True
    _extras: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_common(self.alpha, self.order)
        if self.buffer_dtype not in BUFFER_DTYPES:
            raise ValueError(f"buffer_dtype must be one of {', '.join(BUFFER_DTYPES)}, got {self.buffer_dtype!r}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        _check_plain_sgd(ctx, self.name)
        capacity = max(planned_steps(ctx, cid) for cid in range(ctx.num_clients))
        self.recorder = GradientRecorder(
            x0.numel(), max(capacity, 1), dtype=BUFFER_DTYPES[self.buffer_dtype], device=x0.device
        )

    def _herd_local(self, t: int, cid: int, ctx: FLContext, shift: torch.Tensor | None = None):
        """Local SGD recording each step's direction (gradient + weight decay [+ shift]); then herding selection.

        Returns (local result, τ_i, K_i, Σ_selected rows as float32 [d], gap ‖g/K − μ‖).
        """
        rec = self.recorder
        rec.reset()

        def record(g: torch.Tensor, x: torch.Tensor) -> None:
            if shift is not None:
                g.add_(shift)
            rec.record(g)

        result = local_sgd(ctx, cid, t, self.x, order=self.order, drop_last=True, correction=record)
        if rec.count == 0:
            return result, 0, 0, torch.zeros_like(self.x), 0.0
        _, total, gap = rec.select(self.alpha, return_gap=True)
        return result, rec.count, selection_size(rec.count, self.alpha), total.to(self.x.dtype), gap

    def _message(self, cid: int, ctx: FLContext, result, tau: int, k: int, vectors, gap: float) -> ClientMessage:
        extras = {"tau": float(tau), "k": float(k), "herd_gap": gap}
        return ClientMessage(cid, float(ctx.client_sizes[cid]), vectors, result.loss, tau, extras)

    def client_update(self, t: int, cid: int, ctx: FLContext) -> ClientMessage:
        result, tau, k, total, gap = self._herd_local(t, cid, ctx)
        return self._message(cid, ctx, result, tau, k, {"g": total}, gap)

    def server_scale(self, ctx: FLContext) -> float:
        """E/α (or 1/α without ``epoch_scale``); E = 1 when the context fixes local_steps."""
        epochs = ctx.local_epochs if ctx.local_steps is None else 1.0
        return (epochs if self.epoch_scale else 1.0) / self.alpha

    def server_step(self, t: int, messages: list[ClientMessage], ctx: FLContext) -> None:
        p = _weights(messages)
        step = ctx.lr(t) * self.server_scale(ctx)
        ops.weighted_sum([self.x, *(m.vectors["g"] for m in messages)], np.concatenate([[1.0], -step * p]), out=self.x)
        self._record_extras(messages)

    def _record_extras(self, messages: list[ClientMessage]) -> None:
        taus = np.array([m.extras["tau"] for m in messages])
        ks = np.array([m.extras["k"] for m in messages])
        gaps = np.array([m.extras["herd_gap"] for m in messages])
        self._extras = {"herd_k_frac": float(ks.sum() / max(taus.sum(), 1.0)), "herd_gap": float(gaps.mean())}

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        self._extras = {}
        stats = super().round(t, ctx)
        stats.extras.update(self._extras)
        return stats


@dataclass
class BHerdFedNova(BHerd):
    """BHerd-FedNova (our design, specs/bherd.md §1): d_i = g_i/K_i (the mean of the selected gradients),
    w ← w − η·τ_eff·Σ p_i d_i with τ_eff = Σ p_i τ_i."""

    name = "bherd-fednova"

    def server_step(self, t: int, messages: list[ClientMessage], ctx: FLContext) -> None:
        p = _weights(messages)
        taus = np.array([m.extras["tau"] for m in messages])
        ks = np.array([max(m.extras["k"], 1.0) for m in messages])
        tau_eff = float((p * taus).sum())
        coef = -ctx.lr(t) * tau_eff * p / ks
        ops.weighted_sum([self.x, *(m.vectors["g"] for m in messages)], np.concatenate([[1.0], coef]), out=self.x)
        self._record_extras(messages)


@dataclass
class BHerdScaffold(BHerd):
    """BHerd-SCAFFOLD (our design, specs/bherd.md §1).

    Local step v_λ = y_λ − c_i + c, w ← w − η·v_λ; herding selects K_i of the v_λ; the client sends
    Δw_i = −(η/α)·Σ_sel v and its new control c_i⁺ = c_i − c + (1/K_i)·Σ_sel v (the mean of the selected raw y).
    Server: w ← w + Σ p_i Δw_i and c ← Σ p_i c_i⁺ over the participants.
    """

    name = "bherd-scaffold"

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.c = torch.zeros_like(self.x)
        self.client_c = ClientStore(ctx.num_clients, self.x.numel(), device=self.x.device, dtype=self.x.dtype)

    def client_update(self, t: int, cid: int, ctx: FLContext) -> ClientMessage:
        c_i = self.client_c[cid]
        shift = self.c - c_i
        result, tau, k, total, gap = self._herd_local(t, cid, ctx, shift=shift)
        if k:
            delta = total.mul(-ctx.lr(t) / self.alpha)
            ops.weighted_sum([c_i, self.c, total], [1.0, -1.0, 1.0 / k], out=c_i)
        else:
            delta = torch.zeros_like(self.x)
        return self._message(cid, ctx, result, tau, k, {"delta": delta, "control": c_i.clone()}, gap)

    def server_step(self, t: int, messages: list[ClientMessage], ctx: FLContext) -> None:
        p = _weights(messages)
        ops.weighted_sum([self.x, *(m.vectors["delta"] for m in messages)], np.concatenate([[1.0], p]), out=self.x)
        ops.weighted_sum([m.vectors["control"] for m in messages], p, out=self.c)
        self._record_extras(messages)

    def broadcast_floats(self) -> int:
        return 2 * int(self.x.numel())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "c": self.c, "client_c": self.client_c.data}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.c.copy_(state["c"])
        self.client_c.data.copy_(state["client_c"])


@dataclass
class GrabFedAvg(Algorithm):
    """GraB-FedAvg (BHerd Algorithm 4): online balancing with O(d) client memory.

    Each client keeps μ, s, g: μ += y/τ_i (``running_mean``: μ += (y − μ)/λ), z = y − μ, and selects y when
    ⟨s, z⟩ < 0 (s += z, g += y; else s −= z); α_i = (number selected)/τ_i. Server: α_t = Σ p_i α_i and
    w ← w − (η/α_t)·Σ p_i g_i (no update when α_t = 0).

    Args:
        running_mean: the true running mean instead of Algorithm 4's literal /τ_i.
        order: batch order, "fixed" (non-RR) or "reshuffle".
    """

    name = "grab"
    running_mean: bool = False
    order: str = "fixed"
    _extras: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_common(None, self.order)

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        _check_plain_sgd(ctx, self.name)

    def client_update(self, t: int, cid: int, ctx: FLContext) -> ClientMessage:
        tau = planned_steps(ctx, cid)
        if tau < 1:
            result = local_sgd(ctx, cid, t, self.x, order=self.order, drop_last=True)
            return ClientMessage(cid, float(ctx.client_sizes[cid]), {"g": torch.zeros_like(self.x)}, result.loss, 0)
        balancer = ops.GrabBalancer(tau, running_mean=self.running_mean)

        def balance(g: torch.Tensor, x: torch.Tensor) -> None:
            balancer.step(g)

        result = local_sgd(ctx, cid, t, self.x, order=self.order, drop_last=True, correction=balance)
        if result.steps != tau:
            raise RuntimeError(f"GraB: client {cid} took {result.steps} steps, expected τ = {tau}")
        g = balancer.g.to(self.x.dtype)
        return ClientMessage(cid, float(ctx.client_sizes[cid]), {"g": g}, result.loss, tau, {"alpha_i": balancer.alpha})

    def server_step(self, t: int, messages: list[ClientMessage], ctx: FLContext) -> None:
        p = _weights(messages)
        alpha_t = float(sum(pi * m.extras.get("alpha_i", 0.0) for pi, m in zip(p, messages, strict=True)))
        self._extras = {"alpha_t": alpha_t}
        if alpha_t <= 0.0:
            return
        coef = -ctx.lr(t) / alpha_t * p
        ops.weighted_sum([self.x, *(m.vectors["g"] for m in messages)], np.concatenate([[1.0], coef]), out=self.x)

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        self._extras = {}
        stats = super().round(t, ctx)
        stats.extras.update(self._extras)
        return stats


@dataclass
class FedNova(Algorithm):
    """FedNova (Wang et al. 2020) with vanilla local SGD: d_i = (w − w_i)/(η·τ_i) (the mean local gradient),
    w ← w − η·τ_eff·Σ p_i d_i with τ_eff = Σ p_i τ_i.

    Args:
        order: batch order, "reshuffle" (RR, the paper's baseline) or "fixed".
    """

    name = "fednova"
    order: str = "reshuffle"

    def __post_init__(self) -> None:
        _check_common(None, self.order)

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        _check_plain_sgd(ctx, self.name)

    def client_update(self, t: int, cid: int, ctx: FLContext) -> ClientMessage:
        lr = ctx.lr(t)
        result = local_sgd(ctx, cid, t, self.x, lr=lr, order=self.order)
        if result.steps == 0:
            raise ValueError(f"FedNova: client {cid} took no local steps (empty local dataset?)")
        d_i = ops.weighted_sum([self.x, result.x], [1.0 / (lr * result.steps), -1.0 / (lr * result.steps)])
        return ClientMessage(cid, float(ctx.client_sizes[cid]), {"d": d_i}, result.loss, result.steps)

    def server_step(self, t: int, messages: list[ClientMessage], ctx: FLContext) -> None:
        p = _weights(messages)
        tau_eff = float(sum(pi * m.steps for pi, m in zip(p, messages, strict=True)))
        coef = -ctx.lr(t) * tau_eff * p
        ops.weighted_sum([self.x, *(m.vectors["d"] for m in messages)], np.concatenate([[1.0], coef]), out=self.x)
