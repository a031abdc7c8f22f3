"""Local SGD of many clients at once: one vectorised step over stacked parameters instead of a loop over models.

FedPBC trains all m clients every round. For small models a Python loop over clients is dominated by per-call
overhead (module forward/backward, optimizer bookkeeping), so :func:`batched_local_sgd_` stacks the clients' flat
models as the rows of a [k, d] tensor and takes each SGD step for all of them with ``torch.func``:
``vmap(grad(objective))`` over (parameters, batch) pairs, where each client's parameters are views of its row.

The update is the one of :func:`~pyfedkern.algorithms.local_sgd` (weight decay, heavy-ball momentum, the model's own
``loss``/``penalty``), on the same minibatches (``ctx.batches``), so the two agree up to floating-point rounding.
Models with buffers (BatchNorm running statistics) cannot be vmapped this way and fall back to the loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.utils.rnn import pad_sequence

from pyfedkern.algorithms.base import Batch, FLContext, local_sgd
from pyfedkern.algorithms.local import LocalModel


class _Objective(nn.Module):
    """forward(x, y) = the local training objective, so that loss() and penalty() see the swapped parameters."""

    def __init__(self, local: LocalModel) -> None:
        super().__init__()
        self.model = local.module
        self.local = [local]  # a plain list: not registered as a submodule

    def forward(self, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor | None = None) -> torch.Tensor:
        local = self.local[0]
        if wb is None:
            return local.objective(self.model(xb), yb)
        # Σ_j wb[j]·loss(sample j) + penalty: one forward of the whole (padded) batch, the loss per sample.
        out = self.model(xb)
        per_sample = vmap(lambda o, y: local.data_loss(o.unsqueeze(0), y.unsqueeze(0)))(out, yb)
        penalty = getattr(self.model, "penalty", None)
        weighted = (per_sample * wb).sum()
        return weighted + penalty() if penalty is not None else weighted


def can_batch(local: LocalModel) -> bool:
    """Whether the model can be trained with the vmapped step (no buffers, one float dtype)."""
    return not any(True for _ in local.module.buffers())


class BatchedTrainer:
    """Vectorised SGD steps for the shared :class:`LocalModel` of an FL context (built once, reused each round)."""

    def __init__(self, local: LocalModel) -> None:
        self.local = local
        self.objective = _Objective(local)
        self.entries = [e for e in local.flat.layout.entries if not e.carried]

        def loss(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return functional_call(self.objective, params, (xb, yb))

        def masked_loss(
            params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor
        ) -> torch.Tensor:
            return functional_call(self.objective, params, (xb, yb, wb))

        self._step = vmap(grad_and_value(loss), in_dims=(0, 0, 0), randomness="different")
        self._masked_step = vmap(grad_and_value(masked_loss), in_dims=(0, 0, 0, 0), randomness="different")

    def _params(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        k = rows.shape[0]
        return {f"model.{e.name}": rows[:, e.offset : e.offset + e.numel].view(k, *e.shape) for e in self.entries}

    def gradients(
        self, rows: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row gradients [k, d] of the objective at each row's parameters on its batch, and the losses [k].

        With ``weights`` [k, B] the objective of row r is Σ_j weights[r, j]·objective(sample j) instead of the
        batch objective: padded batches of unequal size, with weight 1/b_r on the real samples and 0 on padding
        (exact for objectives that are a mean over samples plus a penalty, on models without batch statistics,
        which the vmapped step requires anyway).
        """
        self.local.module.train()
        params = self._params(rows)
        if weights is None:
            grads, losses = self._step(params, xb, yb)
        else:
            grads, losses = self._masked_step(params, xb, yb, weights)
        flat = torch.cat([grads[f"model.{e.name}"].reshape(rows.shape[0], -1) for e in self.entries], dim=1)
        return flat, losses.detach()


def batched_local_sgd_(
    ctx: FLContext,
    t: int,
    models: torch.Tensor,
    clients: Sequence[int] | np.ndarray,
    *,
    trainer: BatchedTrainer | None = None,
    lr: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Local SGD of every client in ``clients`` from its row of ``models`` ([k, d], trained in place).

    Each step stacks the next minibatch of every client that still has one and updates all those rows in one
    vmapped step. The batches come from ``ctx.stacked_batches`` when the context has it (the engine gathers every
    client's batch of a step at once), else from each client's ``ctx.batches``. Batches of unequal size (clients
    holding fewer samples than the batch size) are padded to the largest and weighted per sample (see
    :meth:`BatchedTrainer.gradients`).

    Args:
        ctx: the FL context (data, learning rate, batch size, weight decay, momentum).
        t: round index (seeds the batch order, as for :func:`local_sgd`).
        models: [k, d] float tensor on ctx.device, row r the model of client ``clients[r]``.
        trainer: a :class:`BatchedTrainer` to reuse (built when None). Models with buffers use the per-client loop.

    Returns:
        (mean loss per client [k], steps per client [k]).
    """
    clients = [int(c) for c in clients]
    k = len(clients)
    if models.dim() != 2 or models.shape[0] != k:
        raise ValueError(f"models must be [{k}, d] (one row per client), got shape {tuple(models.shape)}")
    losses = np.zeros(k)
    counts = np.zeros(k, dtype=np.int64)
    if k == 0:
        return losses, counts
    if steps is None and epochs is None:
        steps, epochs = ctx.local_steps, ctx.local_epochs
    lr = ctx.lr(t) if lr is None else lr
    if not can_batch(ctx.local):
        for r, cid in enumerate(clients):
            result = local_sgd(ctx, cid, t, models[r], lr=lr, steps=steps, epochs=epochs)
            models[r].copy_(result.x)
            losses[r], counts[r] = result.loss, result.steps
        return losses, counts
    trainer = trainer or BatchedTrainer(ctx.local)
    stacked = getattr(ctx, "stacked_batches", None)
    if stacked is not None:
        batches = stacked(clients, t, steps=steps, epochs=epochs)
    else:
        batches = _stack_per_client(ctx, clients, t, steps=steps, epochs=epochs)
    momentum = torch.zeros_like(models) if ctx.momentum else None
    for rows, xb, yb, wb in batches:
        everyone = len(rows) == k
        index = None if everyone else torch.as_tensor(rows, device=models.device)
        current = models if everyone else models.index_select(0, index)
        g, batch_losses = trainer.gradients(current, xb, yb, wb)
        if ctx.weight_decay:
            g.add_(current, alpha=ctx.weight_decay)
        direction = g
        if momentum is not None:
            first = torch.as_tensor(counts[rows] == 0, device=models.device)[:, None]
            buf = momentum if everyone else momentum.index_select(0, index)
            buf = torch.where(first, g, buf * ctx.momentum + g)
            if everyone:
                momentum.copy_(buf)
            else:
                momentum.index_copy_(0, index, buf)
            direction = buf
        if everyone:
            models.add_(direction, alpha=-lr)
        else:
            models.index_copy_(0, index, current - lr * direction)
        losses[rows] += batch_losses.cpu().numpy()
        counts[rows] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, losses / np.maximum(counts, 1), np.nan), counts


def _stack_per_client(
    ctx: FLContext, clients: Sequence[int], t: int, **kwargs: Any
) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``stacked_batches`` for a context that only has ``batches``: the next batch of every client that still has
    one, stacked (rows, xb, yb, wb) per step."""
    iterators: list[Iterator[Batch] | None] = [ctx.batches(cid, t, **kwargs) for cid in clients]
    while True:
        ready: list[tuple[int, Batch]] = []
        for r, it in enumerate(iterators):
            batch = None if it is None else next(it, None)
            if batch is None:
                iterators[r] = None
            else:
                ready.append((r, batch))
        if not ready:
            return
        xb, yb, wb = _stack_batches([b for _, b in ready])
        yield np.array([r for r, _ in ready], dtype=np.int64), xb, yb, wb


def _stack_batches(batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stack k batches to [k, B, ...]; unequal sizes are zero-padded to the largest, with per-sample weights."""
    sizes = [int(b[1].shape[0]) for b in batches]
    if len(set(sizes)) == 1 and len({tuple(b[0].shape) for b in batches}) == 1:
        return torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]), None
    xb = pad_sequence([b[0] for b in batches], batch_first=True)
    yb = pad_sequence([b[1] for b in batches], batch_first=True)
    return xb, yb, padding_weights(sizes, xb)


def padding_weights(sizes: Sequence[int], xb: torch.Tensor) -> torch.Tensor:
    """[k, B] per-sample weights of k batches of ``sizes`` zero-padded into xb [k, B, ...]: 1/b_r on the b_r real
    samples of batch r, 0 on its padding (xb's float dtype, or the default one for integer inputs)."""
    n = torch.as_tensor(sizes, device=xb.device)
    dtype = xb.dtype if xb.is_floating_point() else torch.get_default_dtype()
    real = torch.arange(xb.shape[1], device=xb.device)[None, :] < n[:, None]
    return real.to(dtype) / n[:, None].to(dtype)
