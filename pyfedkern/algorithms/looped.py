"""Local training of clients one after another on the context's one model, behind the interface of the batched path.

An algorithm writes its client side once, against rows of clients: it asks :func:`local_run` for the run of a
chunk of participants and calls ``run.start``, ``run.sgd_`` (or its own step loop over ``run.run`` with
``run.gradients``), ``run.clients``, ``run.steps`` and ``run.losses``. :func:`local_run` returns a
:class:`~pyfedkern.algorithms.batched.BatchedLocal` (every row trained at once) when the context and the model
allow it, else a :class:`LoopedLocal`: the same rows, each trained in turn on ``ctx.local`` (the loaded model's own
parameters and gradient buffers), so the loop keeps what makes it fast (plain SGD without a flat gradient when
nothing else is added, the model's memory layout) and an algorithm's step terms see the same [rows, d] tensors on
both paths (a row's slice of per-client state is ``state[step.span]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pyfedkern.algorithms.batched import BatchedLocal, Step, use_batched
from pyfedkern.algorithms.context import FLContext

Correction = Callable[[torch.Tensor, Step], None]


class LoopedLocal:
    """The local training of k clients in round t, one client at a time on ``ctx.local``; the interface of
    :class:`~pyfedkern.algorithms.batched.BatchedLocal` (the arguments and attributes are the same).

    Row r is client ``clients[r]``, ordered by descending number of steps as on the batched path. Each
    :class:`~pyfedkern.algorithms.batched.Step` of :meth:`run` covers one row (``step.span`` = r:r+1): ``step.x`` is
    a [1, d] view of the loaded model's parameters, ``step.xb``/``step.yb`` the client's minibatch with a leading
    dimension of 1. The row of ``models`` is written when the client's last step is done.
    """

    def __init__(
        self,
        ctx: FLContext,
        t: int,
        clients: Sequence[int] | np.ndarray,
        *,
        order: str = "reshuffle",
        drop_last: bool = False,
        epochs: float | None = None,
        steps: int | None = None,
        lr: float | None = None,
    ) -> None:
        if steps is None and epochs is None:
            steps, epochs = ctx.local_steps, ctx.local_epochs
        self.ctx, self.t = ctx, t
        clients = np.asarray(clients, dtype=np.int64).reshape(-1)
        self._plan = {"epochs": epochs, "steps": steps, "order": order, "drop_last": drop_last}
        steps = np.asarray(ctx.planned_steps(clients, epochs=epochs, steps=steps, drop_last=drop_last))
        order = np.argsort(-steps, kind="stable")  # as the batched path: rows of equal steps are consecutive
        self.clients, self.steps = clients[order], steps[order]
        self.index = torch.as_tensor(self.clients, device=ctx.device)
        self.lr = ctx.lr(t) if lr is None else lr
        self.dp = ctx.dpsgd
        self._loss_sum = np.zeros(len(self.clients))  # each row's summed minibatch losses, on the host
        self._saved: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.clients)

    def start(self, x0: torch.Tensor) -> torch.Tensor:
        """Every row's starting model: [k, d] copies of the global model x0 [d]."""
        return x0.expand(len(self), -1).clone()

    def _batches(self, r: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(step, xb, yb) of row r's client; ValueError when the context yields another number of steps than its
        ``planned_steps``."""
        cid = int(self.clients[r])
        n = 0
        for n, (xb, yb) in enumerate(self.ctx.batches(cid, self.t, **self._plan), start=1):
            yield n - 1, xb, yb
        if n != self.steps[r]:
            raise ValueError(
                f"the context's batches gave client {cid} {n} steps, its planned_steps {int(self.steps[r])}: "
                "FLContext.planned_steps must count what FLContext.batches yields"
            )

    def run(self, models: torch.Tensor) -> Iterator[Step]:
        """The local steps over ``models`` [k, d]: row after row, one :class:`~pyfedkern.algorithms.batched.Step`
        per minibatch step."""
        if models.dim() != 2 or models.shape[0] != len(self):
            raise ValueError(f"models must be a [{len(self)}, d] tensor, got shape {tuple(models.shape)}")
        local = self.ctx.local
        for r in range(len(self)):
            local.load_(models[r])
            x = local.flat.data.unsqueeze(0)
            for s, xb, yb in self._batches(r):
                yield Step(s, 1, x, xb.unsqueeze(0), yb.unsqueeze(0), None, start=r)
            models[r].copy_(local.flat.data)

    def gradients(self, step: Step, x: torch.Tensor | None = None, *, record: bool = True) -> torch.Tensor:
        """The gradient [1, d] of the step's row at ``x`` (default: its model) on its minibatch (a view of the
        model's gradient buffer, overwritten by the next call); its loss counts in :meth:`losses` unless ``record``
        is False."""
        local = self.ctx.local
        saved = None
        if x is not None and x.data_ptr() != step.x.data_ptr():
            if self._saved is None:  # one buffer for the run's model while another point is evaluated
                self._saved = torch.empty_like(local.flat.data)
            saved = self._saved.copy_(local.flat.data)
            local.flat.data.copy_(x.reshape(-1))
        xb, yb = step.xb[0], step.yb[0]
        if self.dp is not None:
            loss = local.private_loss_and_grad(self.dp, xb, yb, (self.t, int(self.clients[step.start]), step.index))
        else:
            loss = local.loss_and_grad(xb, yb)
        if saved is not None:
            local.flat.data.copy_(saved)
        if record:
            self._loss_sum[step.start] += loss
        return local.flat.grad.unsqueeze(0)

    def sgd_(
        self,
        models: torch.Tensor,
        *,
        correction: Correction | None = None,
        weight_decay: float | None = None,
    ) -> torch.Tensor:
        """Minibatch SGD of every row in place, as :meth:`BatchedLocal.sgd_
        <pyfedkern.algorithms.batched.BatchedLocal.sgd_>`: x ← x − lr·(g + wd·x [+ correction]), heavy-ball
        momentum when ctx.momentum > 0. Plain SGD (no correction, decay, momentum or DP) steps the model straight
        from its parameters' gradients (:meth:`~pyfedkern.algorithms.LocalModel.sgd_step_`). Returns ``models``."""
        ctx = self.ctx
        wd = ctx.weight_decay if weight_decay is None else weight_decay
        momentum = ctx.momentum
        if correction is None and not wd and not momentum and self.dp is None:
            local = ctx.local
            for r in range(len(self)):
                local.load_(models[r])
                for _, xb, yb in self._batches(r):
                    self._loss_sum[r] += local.sgd_step_(xb, yb, self.lr)
                models[r].copy_(local.flat.data)
            return models
        buffer = None
        for step in self.run(models):
            g = self.gradients(step)
            if wd:
                g.add_(step.x, alpha=wd)
            if correction is not None:
                correction(g, step)
            direction = g
            if momentum:
                if step.index == 0:
                    buffer = g.clone()
                else:
                    buffer.mul_(momentum).add_(g)
                direction = buffer
            step.x.add_(direction, alpha=-self.lr)
        return models

    def losses(self) -> torch.Tensor:
        """Mean minibatch loss of each row, float64 [k] on the device (NaN for rows without steps)."""
        with np.errstate(invalid="ignore"):
            return torch.as_tensor(self._loss_sum / self.steps, dtype=torch.float64, device=self.ctx.device)


LocalRun = BatchedLocal | LoopedLocal


def local_run(ctx: FLContext, t: int, clients: Sequence[int] | np.ndarray, **options: Any) -> LocalRun:
    """The local training of ``clients`` in round t: batched (:class:`~pyfedkern.algorithms.batched.BatchedLocal`)
    when the context and its model allow it (:func:`~pyfedkern.algorithms.batched.use_batched`), else one client
    after another (:class:`~pyfedkern.algorithms.looped.LoopedLocal`); ``options`` (order, drop_last, epochs, steps,
    lr) as for either."""
    kind = BatchedLocal if use_batched(ctx) else LoopedLocal
    return kind(ctx, t, clients, **options)


def local_sgd_rows_(ctx: FLContext, t: int, models: torch.Tensor, clients: Sequence[int] | np.ndarray) -> torch.Tensor:
    """Plain local SGD (the context's weight decay and momentum) of each of ``clients`` (distinct int ids [k]) from
    its row of ``models`` [k, d], trained in place through :func:`local_run` (batched or one client after another);
    returns each row's mean loss, float64 [k] on the device (NaN for a client without steps)."""
    clients = np.asarray(clients, dtype=np.int64).reshape(-1)
    k = len(clients)
    if models.dim() != 2 or models.shape[0] != k:
        raise ValueError(f"models must be [{k}, d] (one row per client), got shape {tuple(models.shape)}")
    if k == 0:
        return torch.zeros(0, dtype=torch.float64, device=models.device)
    if len(np.unique(clients)) != k:
        raise ValueError("clients has duplicates")
    run = local_run(ctx, t, clients)
    if np.array_equal(run.clients, clients) and models.is_contiguous():  # the rows in place: the run's order
        run.sgd_(models)
        return run.losses()
    sorter = np.argsort(clients)  # row r of the run is client run.clients[r], at position where[r] of `clients`
    where = torch.as_tensor(sorter[np.searchsorted(clients, run.clients, sorter=sorter)], device=models.device)
    models.index_copy_(0, where, run.sgd_(models.index_select(0, where)))
    losses = run.losses()
    return torch.empty_like(losses).index_copy_(0, where, losses)


@dataclass
class LocalResult:
    """Outcome of :func:`local_sgd`: final local model [d], mean loss, steps taken."""

    x: torch.Tensor
    loss: float
    steps: int


def local_sgd(
    ctx: FLContext,
    cid: int,
    t: int,
    x0: torch.Tensor,
    *,
    lr: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    order: str = "reshuffle",
    drop_last: bool = False,
    correction: Correction | None = None,
    weight_decay: float | None = None,
) -> LocalResult:
    """Minibatch SGD of client cid from x0 [d] on ``ctx.local`` (a user's own loop):
    :meth:`~pyfedkern.algorithms.looped.LoopedLocal.sgd_` of one row, ``correction(g, step)`` called with g the
    [1, d] direction after weight decay (default ``ctx.weight_decay``). epochs / steps: local work (defaults:
    ctx.local_steps if set, else ctx.local_epochs)."""
    run = LoopedLocal(ctx, t, [cid], order=order, drop_last=drop_last, epochs=epochs, steps=steps, lr=lr)
    models = run.sgd_(run.start(x0), correction=correction, weight_decay=weight_decay)
    loss = float(run.losses()[0]) if run.steps[0] else math.nan
    return LocalResult(models[0], loss, int(run.steps[0]))
