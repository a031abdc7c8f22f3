"""BHerd (arXiv 2403.16557) and its relatives: BHerd-FedAvg, GraB-FedAvg, BHerd-FedNova, BHerd-SCAFFOLD and FedNova.

Specified in docs/bherd.md. A BHerd client runs τ_i plain SGD steps w ← w − η·y_λ over its batches in a fixed
order (non-RR), records every minibatch gradient y_λ as a row of a [τ_i, d] buffer (:class:`GradientRecorder`,
float32 or bfloat16), selects K_i = round(α·τ_i) of them by greedy herding (:func:`pyfedkern.ops.herding_select`)
and sends g_i = Σ_{selected} y (raw gradients, never recomputed); its final local model is discarded. The server
applies w ← w − η·(E/α)·Σ p_i g_i (Eq. 7) with p_i = |D_i| / Σ_participants |D_j|.

The clients of a chunk of participants (:meth:`BHerd.client_update`, batched or one after another) record their
per-step gradients into one [Σ τ_i, d] buffer (client after client, τ_i rows each) and the clients of equal τ_i are
selected in one batched :func:`~pyfedkern.ops.herding_select` call each. :class:`GradientRecorder` does the same
for one client of a user's own training loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from pyfedkern import ops
from pyfedkern.algorithms.base import (
    Algorithm,
    ClientStore,
    ClientUpdates,
    FLContext,
    RoundStats,
    RoundSums,
    owned_clients,
)
from pyfedkern.algorithms.batched import Step
from pyfedkern.algorithms.looped import LocalRun, local_run
from pyfedkern.flat import trainable_parameters
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
        """Append the gradients of the module's trainable parameters (:func:`pyfedkern.flat.trainable_parameters`, the
        federated vector's layout) as one flat row (parameters without a gradient give 0)."""
        row = self._next_row()
        offset = 0
        for _, p in trainable_parameters(module):
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


def most_steps(ctx: FLContext) -> int:
    """The largest τ_i = ⌊E·|D_i|/B⌋ (or ctx.local_steps) over the clients: the steps of
    ``ctx.batches(..., drop_last=True)``."""
    return int(ctx.planned_steps(np.arange(ctx.num_clients), drop_last=True).max(initial=0))


@dataclass
class HerdedRows:
    """The herded local updates of a run, in its row order: τ_i, K_i, Σ_selected y_i [k, d] (the model's
    dtype; zero for clients without steps), gap ‖g_i/K_i − μ_i‖ (0 without steps)."""

    taus: np.ndarray
    ks: np.ndarray
    totals: torch.Tensor
    gaps: np.ndarray


def herd_rows(run: LocalRun, x0: torch.Tensor, alpha: float, dtype: torch.dtype, shift=None) -> HerdedRows:
    """Plain SGD of the run's rows from x0, each step's direction (gradient + weight decay [+ shift rows]) recorded
    into a [Σ τ_i, d] buffer of ``dtype``; then herding selection, one :func:`~pyfedkern.ops.herding_select` call
    per group of clients with equal τ_i (consecutive rows: the run orders clients by τ)."""
    taus = run.steps
    offsets = np.cumsum(taus) - taus
    buffer = torch.empty(int(taus.sum()), x0.numel(), dtype=dtype, device=x0.device)
    first = torch.as_tensor(offsets, device=x0.device)

    def record(g: torch.Tensor, step: Step) -> None:
        if shift is not None:
            g.add_(shift[step.span])
        buffer.index_copy_(0, first[step.span] + step.index, g.to(dtype))

    run.sgd_(run.start(x0), correction=record)
    totals = torch.zeros(len(run), x0.numel(), dtype=x0.dtype, device=x0.device)
    ks = np.zeros(len(run), dtype=np.int64)
    gaps = np.zeros(len(run))
    for tau in np.unique(taus[taus > 0]).tolist():
        rows = np.flatnonzero(taus == tau)
        a, b = int(rows[0]), int(rows[-1]) + 1
        grads = buffer[int(offsets[a]) : int(offsets[a]) + (b - a) * tau].view(b - a, tau, -1)
        _, total, gap = ops.herding_select(grads, alpha, return_gap=True)
        totals[a:b] = total.to(torch.float32)
        ks[a:b] = selection_size(tau, alpha)
        gaps[a:b] = gap
    return HerdedRows(taus, ks, totals, gaps)


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
    """BHerd-FedAvg: herding-selected gradient sums, server step w ← w − η·(E/α)·Σ p_i g_i (docs/bherd.md §3).

    Args:
        alpha: selection fraction α ∈ (0, 1]; K_i = round(α·τ_i) clamped to [1, τ_i].
        buffer_dtype: storage of the recorded gradients, "float32" or "bfloat16".
        order: batch order, "fixed" (one seeded order kept across rounds: the paper's non-RR) or "reshuffle" (RR).
        epoch_scale: the literal E/α factor of Eq. 7 (False: 1/α; they agree at E = 1).
    """

    name = "bherd"
    local_dp = True
    distributed = True  # its round wraps Algorithm.round
    alpha: float = 0.5
    buffer_dtype: str = "float32"
    order: str = "fixed"
    epoch_scale: bool = True
    _extras: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_common(self.alpha, self.order)
        if self.buffer_dtype not in BUFFER_DTYPES:
            raise ValueError(f"buffer_dtype must be one of {', '.join(BUFFER_DTYPES)}, got {self.buffer_dtype!r}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        _check_plain_sgd(ctx, self.name)

    def state_rows_per_client(self, ctx: FLContext) -> int:
        return 2 + most_steps(ctx)  # the recorded gradients

    def _run(self, t: int, clients: np.ndarray, ctx: FLContext) -> LocalRun:
        return local_run(ctx, t, clients, order=self.order, drop_last=True)

    def _herd_rows(self, run: LocalRun, shift: torch.Tensor | None = None) -> HerdedRows:
        """Local SGD of the run's rows recording each step's direction (gradient + weight decay [+ ``shift``, [k, d]
        rows]), then herding selection (:func:`herd_rows`)."""
        return herd_rows(run, self.x, self.alpha, BUFFER_DTYPES[self.buffer_dtype], shift)

    def _updates(self, run: LocalRun, ctx: FLContext, herd: HerdedRows, vectors) -> ClientUpdates:
        extras = {"tau": herd.taus.astype(np.float64), "k": herd.ks.astype(np.float64), "herd_gap": herd.gaps}
        return ClientUpdates.of(run, ctx, vectors, extras=extras)

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = self._run(t, clients, ctx)
        herd = self._herd_rows(run)
        return self._updates(run, ctx, herd, {"g": herd.totals})

    def server_scale(self, ctx: FLContext) -> float:
        """E/α (or 1/α without ``epoch_scale``); E = 1 when the context fixes local_steps."""
        epochs = ctx.local_epochs if ctx.local_steps is None else 1.0
        return (epochs if self.epoch_scale else 1.0) / self.alpha

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        sums.add("g", updates.vectors["g"], updates.weights)
        self._add_common(sums, updates)

    def _add_common(self, sums: RoundSums, updates: ClientUpdates) -> None:
        """Σ w_i, and the per-client values of the logged extras."""
        sums.add_scalar("weight", updates.weights.sum())
        for name in ("tau", "k", "herd_gap"):
            sums.add_scalar(name, updates.extras[name].sum())
        sums.add_scalar("count", len(updates))

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        step = ctx.lr(t) * self.server_scale(ctx)
        ops.weighted_sum([self.x, sums.vector("g")], [1.0, -step / sums.scalar("weight")], out=self.x)
        self._record_extras(sums)

    def _record_extras(self, sums: RoundSums) -> None:
        self._extras = {
            "herd_k_frac": sums.scalar("k") / max(sums.scalar("tau"), 1.0),
            "herd_gap": sums.scalar("herd_gap") / sums.scalar("count"),
        }

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        self._extras = {}
        stats = super().round(t, ctx)
        stats.extras.update(self._extras)
        return stats


@dataclass
class BHerdFedNova(BHerd):
    """BHerd-FedNova (our design, docs/bherd.md §5): d_i = g_i/K_i (the mean of the selected gradients),
    w ← w − η·τ_eff·Σ p_i d_i with τ_eff = Σ p_i τ_i."""

    name = "bherd-fednova"

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        w, ks = updates.weights, np.maximum(updates.extras["k"], 1.0)
        sums.add("g", updates.vectors["g"], w / ks)
        sums.add_scalar("w_tau", (w * updates.extras["tau"]).sum())
        self._add_common(sums, updates)

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        weight = sums.scalar("weight")
        tau_eff = sums.scalar("w_tau") / weight
        ops.weighted_sum([self.x, sums.vector("g")], [1.0, -ctx.lr(t) * tau_eff / weight], out=self.x)
        self._record_extras(sums)


@dataclass
class BHerdScaffold(BHerd):
    """BHerd-SCAFFOLD (our design, docs/bherd.md §5).

    Local step v_λ = y_λ − c_i + c, w ← w − η·v_λ; herding selects K_i of the v_λ; the client sends
    Δw_i = −(η/α)·Σ_sel v and its new control c_i⁺ = c_i − c + (1/K_i)·Σ_sel v (the mean of the selected raw y).
    Server: w ← w + Σ p_i Δw_i and c ← Σ p_i c_i⁺ over the participants.
    """

    name = "bherd-scaffold"

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.c = torch.zeros_like(self.x)
        self.client_c = ClientStore(
            ctx.num_clients, self.x.numel(), device=self.x.device, dtype=self.x.dtype, owned=owned_clients(ctx)
        )

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = self._run(t, clients, ctx)
        c_i = self.client_c.take(run.clients)
        herd = self._herd_rows(run, shift=self.c - c_i)
        delta = herd.totals.mul(-ctx.lr(t) / self.alpha)  # zero rows without steps
        selected = herd.ks > 0
        ks = torch.as_tensor(np.maximum(herd.ks, 1), dtype=self.x.dtype, device=self.x.device)
        fresh = (c_i - self.c).add_(herd.totals / ks[:, None])  # c_i − c + (1/K_i)·Σ_sel v
        c_i = torch.where(torch.as_tensor(selected, device=self.x.device)[:, None], fresh, c_i)
        self.client_c.put_(run.clients, c_i)
        return self._updates(run, ctx, herd, {"delta": delta, "control": c_i})

    def state_rows_per_client(self, ctx: FLContext) -> int:
        return 3 + super().state_rows_per_client(ctx)

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        sums.add("delta", updates.vectors["delta"], updates.weights)
        sums.add("control", updates.vectors["control"], updates.weights)
        self._add_common(sums, updates)

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        weight = sums.scalar("weight")
        ops.weighted_sum([self.x, sums.vector("delta")], [1.0, 1.0 / weight], out=self.x)
        ops.weighted_sum([sums.vector("control")], [1.0 / weight], out=self.c)
        self._record_extras(sums)

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
    local_dp = True
    distributed = True  # its round wraps Algorithm.round
    running_mean: bool = False
    order: str = "fixed"
    _extras: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_common(None, self.order)

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        _check_plain_sgd(ctx, self.name)

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        """:class:`~pyfedkern.ops.GrabBalancer`'s rule for every row (row-wise torch operations; the balancing state
        in float64 for float64 models, else float32, as the op keeps it)."""
        run = local_run(ctx, t, clients, order=self.order, drop_last=True)
        k, d, device = len(run), self.x.numel(), self.x.device
        state = torch.float64 if self.x.dtype == torch.float64 else torch.float32
        mean, s, g_sum = (torch.zeros(k, d, dtype=state, device=device) for _ in range(3))
        picked = torch.zeros(k, dtype=state, device=device)
        tau = torch.as_tensor(np.maximum(run.steps, 1), dtype=state, device=device)

        def balance(g: torch.Tensor, step: Step) -> None:
            r, y = step.span, g.to(state)
            if self.running_mean:
                mean[r].add_((y - mean[r]) / (step.index + 1))
            else:
                mean[r].add_(y / tau[r, None])
            z = y - mean[r]
            pick = (s[r].double() * z.double()).sum(1) < 0
            s[r].add_(torch.where(pick[:, None], z, -z))
            g_sum[r].add_(y * pick[:, None])
            picked[r] += pick

        run.sgd_(run.start(self.x), correction=balance)
        alpha = (picked / tau).double().cpu().numpy()
        return ClientUpdates.of(run, ctx, {"g": g_sum.to(self.x.dtype)}, extras={"alpha_i": alpha})

    def state_rows_per_client(self, ctx: FLContext) -> int:
        return 4  # the balancing state μ, s, g and a copy of the gradient

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        sums.add("g", updates.vectors["g"], updates.weights)
        sums.add_scalar("weight", updates.weights.sum())
        sums.add_scalar("w_alpha", (updates.weights * updates.extras["alpha_i"]).sum())

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        weight = sums.scalar("weight")
        alpha_t = sums.scalar("w_alpha") / weight
        self._extras = {"alpha_t": alpha_t}
        if alpha_t <= 0.0:
            return
        ops.weighted_sum([self.x, sums.vector("g")], [1.0, -ctx.lr(t) / alpha_t / weight], out=self.x)

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
    local_dp = True
    order: str = "reshuffle"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_common(None, self.order)

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        _check_plain_sgd(ctx, self.name)

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = local_run(ctx, t, clients, order=self.order)
        if np.any(run.steps == 0):
            raise ValueError(f"FedNova: clients {run.clients[run.steps == 0].tolist()} take no local steps")
        models = run.sgd_(run.start(self.x))
        scale = torch.as_tensor(1.0 / (run.lr * run.steps), dtype=self.x.dtype, device=self.x.device)
        d = torch.sub(self.x, models).mul_(scale[:, None])  # (w − w_i)/(η·τ_i)
        return ClientUpdates.of(run, ctx, {"d": d})

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        sums.add("d", updates.vectors["d"], updates.weights)
        sums.add_scalar("weight", updates.weights.sum())
        sums.add_scalar("w_tau", (updates.weights * updates.steps).sum())

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        weight = sums.scalar("weight")
        tau_eff = sums.scalar("w_tau") / weight
        ops.weighted_sum([self.x, sums.vector("d")], [1.0, -ctx.lr(t) * tau_eff / weight], out=self.x)
