"""Batch planning: which of its samples each client's minibatches hold, round after round, and the batches themselves.

A plan is made on the host without a loop over clients: client c of n samples takes ``steps`` local steps, else
⌈E·n/b⌉ (⌊E·n/b⌋ with drop_last) with b = min(B, n); step s is batch s mod (batches per epoch) of epoch
⌊s / (batches per epoch)⌋, cut from the epoch's permutation of the seeded stream (round, c, epoch) ("reshuffle") or
of the client's one fixed permutation ("fixed"). The per-client loop gathers one client's batches
(:meth:`BatchPlanner.client_batches`), the batched path a step of many clients at once (:class:`RoundBatches`);
both hold the same samples, noise included.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pyfedkern.algorithms.context import padding_weights, step_counts
from pyfedkern.ops import seeded_permutations

# Purposes of the planner's random streams (first key after the seed; the engine's others: sim.engine).
_BATCH, _FIXED_ORDER, _NOISE = 2, 3, 4


@dataclass
class _Plan:
    """Every minibatch of a round's clients, client after client (:meth:`BatchPlanner.plan`): ``counts`` [k] steps
    per client; per minibatch, its client's row ``owner``, its ``step``, and its positions in the client's data,
    ``perms[first : first + length]``."""

    clients: np.ndarray
    counts: np.ndarray
    perms: np.ndarray
    owner: np.ndarray
    step: np.ndarray
    first: np.ndarray
    length: np.ndarray


class BatchPlanner:
    """The minibatches of a run's clients.

    Args:
        x, y: every client's training samples, client after client ([N, ...] and [N], on the device).
        client_sizes: int64 [m] samples of each client (they sum to N).
        seed: the run's seed (of every permutation and of the feature noise).
        batch_size, local_epochs: the run's B and E (the defaults of each plan).
        fixed_order: every client keeps one batch order across rounds (``batch_order="fixed"``), whatever a plan
            asks.
        noise_std: per-client std of Gaussian feature noise added to every batch (feature-skew partitions), or None.

    Attributes:
        client_x, client_y: client i's samples, views of x and y.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        client_sizes: np.ndarray,
        *,
        seed: int,
        batch_size: int,
        local_epochs: float,
        fixed_order: bool,
        noise_std: np.ndarray | None,
    ) -> None:
        self.x, self.y = x, y
        self.client_sizes = client_sizes
        self.seed, self.batch_size, self.local_epochs = seed, batch_size, local_epochs
        self.fixed_order, self.noise_std = fixed_order, noise_std
        self.device = x.device
        #: Where each client's samples begin in x and y, int64 [m + 1].
        self.offsets = np.concatenate([[0], np.cumsum(client_sizes)]).astype(np.int64)
        spans = list(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist(), strict=True))
        self.client_x = [x[a:b] for a, b in spans]
        self.client_y = [y[a:b] for a, b in spans]

    def counts(
        self, clients: np.ndarray, epochs: float | None, steps: int | None, drop_last: bool, batch_size: int | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(samples n, batch size min(B, n), local steps) of each client (:func:`step_counts`; E and B the run's
        unless given)."""
        n = self.client_sizes[clients]
        epochs = epochs if epochs is not None else self.local_epochs
        return n, *step_counts(n, batch_size or self.batch_size, epochs, steps, drop_last)

    def plans(
        self,
        clients: Any,
        t: int,
        epochs: float | None,
        steps: int | None,
        order: str,
        drop_last: bool,
        batch_size: int | None,
    ) -> list[list[np.ndarray]]:
        """Every client's minibatches in round t: per client, the positions in its data of each step's batch."""
        plan = self.plan(clients, t, epochs, steps, order, drop_last, batch_size)
        ends = np.cumsum(plan.counts)
        batches = [plan.perms[a : a + n] for a, n in zip(plan.first.tolist(), plan.length.tolist(), strict=True)]
        return [batches[e - n : e] for e, n in zip(ends.tolist(), plan.counts.tolist(), strict=True)]

    def plan(
        self,
        clients: Any,
        t: int,
        epochs: float | None,
        steps: int | None,
        order: str,
        drop_last: bool,
        batch_size: int | None,
    ) -> _Plan:
        """Every minibatch of ``clients`` in round t, client after client, without a loop over clients (see the
        module). The permutations of all clients come from one native call
        (:func:`pyfedkern.ops.seeded_permutations`, equal to ``np.random.default_rng([seed, ...]).permutation(n)``
        of each stream)."""
        if order not in ("reshuffle", "fixed"):
            raise ValueError(f"order must be 'reshuffle' or 'fixed', got {order!r}")
        if self.fixed_order:  # the run keeps every client's batch order across rounds
            order = "fixed"
        clients = np.asarray(clients, dtype=np.int64).reshape(-1)
        n, size, counts = self.counts(clients, epochs, steps, drop_last, batch_size)
        per_epoch = n // size if drop_last else -(-n // size)  # every client holds data, so per_epoch >= 1
        if order == "fixed":  # the client's one fixed permutation, when it takes a step
            draws = (counts > 0).astype(np.int64)
            keys = np.stack([np.full(len(clients), _FIXED_ORDER), clients], axis=1)[counts > 0]
        else:  # one permutation per epoch begun
            draws = -(-counts // per_epoch)
            owner = np.repeat(np.arange(len(clients)), draws)
            epoch = np.arange(len(owner)) - np.repeat(np.cumsum(draws) - draws, draws)
            keys = np.stack([np.full(len(owner), _BATCH), np.full(len(owner), t), clients[owner], epoch], axis=1)
        perms = seeded_permutations(self.seed, keys, np.repeat(n, draws))
        starts = np.cumsum(draws * n) - draws * n  # where each client's permutations begin in perms
        owner = np.repeat(np.arange(len(clients)), counts)
        step = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
        epoch, b = np.divmod(step, per_epoch[owner])
        if order == "fixed":
            epoch[:] = 0  # the fixed permutation again
        first = starts[owner] + epoch * n[owner] + b * size[owner]
        length = np.minimum(size[owner], n[owner] - b * size[owner])
        return _Plan(clients, counts, perms, owner, step, first, length)

    def client_batches(
        self, cid: int, t: int, plan: list[np.ndarray], layout: torch.memory_format
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Client cid's minibatches (x in ``layout``, y) of round t at the positions of ``plan``, noise added."""
        x, y = self.client_x[cid], self.client_y[cid]
        for step, positions in enumerate(plan):
            idx = torch.as_tensor(positions, device=self.device)
            yield self.add_noise(x[idx], cid, t, step).contiguous(memory_format=layout), y[idx]

    def add_noise(self, xb: torch.Tensor, cid: int, t: int, step: int) -> torch.Tensor:
        """xb plus client cid's Gaussian feature noise of (round t, step) (feature-skew partitions), else xb."""
        sigma = 0.0 if self.noise_std is None else float(self.noise_std[cid])
        if sigma <= 0:
            return xb
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(np.random.default_rng([self.seed, _NOISE, t, cid, step]).integers(2**62)))
        return xb + sigma * torch.randn(xb.shape, generator=gen, device=self.device, dtype=xb.dtype)


class RoundBatches:
    """What :meth:`Simulation.stacked_batches <pyfedkern.sim.engine.Simulation.stacked_batches>` returns (see
    :class:`~pyfedkern.algorithms.context.StackedBatches`): the plan's sample index, step after step, on the device.
    Each step's batches are gathered with ``index_select`` into buffers reused from step to step.

    Attributes:
        clients, steps: the clients (descending number of steps) and their steps.
    """

    def __init__(self, planner: BatchPlanner, plan: _Plan, t: int) -> None:
        self.clients, self.steps = plan.clients, plan.counts
        self._planner, self._t = planner, t
        order = np.lexsort((plan.owner, plan.step))  # step after step; each step's clients are a prefix
        owner, first, length = plan.owner[order], plan.first[order], plan.length[order]
        self._rows = np.bincount(plan.step, minlength=int(plan.counts.max(initial=0)))
        self._starts = np.cumsum(self._rows) - self._rows
        if not len(owner):
            return
        self._widths = np.maximum.reduceat(length, self._starts)
        self._ragged = np.minimum.reduceat(length, self._starts) < self._widths
        # step s: its rows × its width, flattened, one after another (padding: any sample of the client, weight 0)
        width = np.repeat(self._widths, self._rows)  # of each row
        self._offsets = np.concatenate([[0], np.cumsum(self._rows * self._widths)])  # where each step begins
        row = np.repeat(np.arange(len(owner)), width)
        col = np.arange(row.size) - np.repeat(np.cumsum(width) - width, width)
        local = plan.perms[np.where(col < length[row], first[row] + col, first[row])]
        index = local + planner.offsets[plan.clients[owner[row]]]
        self._index = torch.as_tensor(index, device=planner.device)
        self._length = torch.as_tensor(length, device=planner.device) if self._ragged.any() else None
        noise = planner.noise_std
        self._noisy = noise is not None and bool(np.any(np.asarray(noise)[plan.clients] > 0))
        self._length_host = length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        planner = self._planner
        if not len(self._rows):
            return
        x, y = planner.x, planner.y
        most = int(np.max(self._rows * self._widths))
        x_buffer = torch.empty(most, *x.shape[1:], dtype=x.dtype, device=planner.device)
        y_buffer = torch.empty(most, *y.shape[1:], dtype=y.dtype, device=planner.device)
        for step, (rows, start) in enumerate(zip(self._rows.tolist(), self._starts.tolist(), strict=True)):
            width, (a, b) = int(self._widths[step]), self._offsets[step : step + 2].tolist()
            idx = self._index[a:b]
            xb = torch.index_select(x, 0, idx, out=x_buffer[: b - a]).view(rows, width, *x_buffer.shape[1:])
            yb = torch.index_select(y, 0, idx, out=y_buffer[: b - a]).view(rows, width, *y_buffer.shape[1:])
            if self._noisy:
                for r in range(rows):
                    n = int(self._length_host[start + r])
                    xb[r, :n] = planner.add_noise(xb[r, :n], int(self.clients[r]), self._t, step)
            wb = None
            if self._ragged[step]:
                wb = padding_weights(self._length[start : start + rows], xb)
            yield xb, yb, wb
