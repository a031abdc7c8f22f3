"""Batch planning: which of its samples each client's minibatches hold, round after round, and the batches themselves.

A plan is made on the host without a loop over clients: client c of n samples takes ``steps`` local steps, else
⌈E·n/b⌉ (⌊E·n/b⌋ with drop_last) with b = min(B, n); step s is batch s mod (batches per epoch) of epoch
⌊s / (batches per epoch)⌋, cut from the epoch's permutation of the seeded stream (round, c, epoch) ("reshuffle") or
of the client's one fixed permutation ("fixed"). The per-client loop gathers one client's batches
(:meth:`BatchPlanner.client_batches`), the batched path a step of many clients at once (:class:`RoundBatches`);
both hold the same samples, noise included.

Poisson sampling (``dp_sampling="poisson"``, for local DP-SGD) keeps the number of steps and replaces each batch by
an independent Bernoulli(q) sample of the client's data, q = b/n: sample j of client c is in the batch of step s of
round t when output j of SplitMix64 started from the stream key of (seed, tag, t, c, s) (:func:`stream_keys`) has
its top 53 bits below ⌊q·2^53⌋ (integers compared). A batch may be empty; every mask is a function of its key
alone, so it does not depend on the path, the chunking, the ranks or the threads.
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
_BATCH, _FIXED_ORDER, _NOISE, _POISSON = 2, 3, 4, 5
#: Draws one pass of :func:`poisson_batches` makes (~60 bytes each; small arrays are reused, not mapped afresh).
_MASK_CHUNK = 1 << 15
_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's mixer of z + γ, elementwise over a uint64 array (wrapping), in place: ``stream_key``'s mix."""
    z += _GAMMA
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def stream_keys(keys: np.ndarray) -> np.ndarray:
    """``pyfedkern.ops.dp.stream_key`` of each row of ``keys`` (integers in [0, 2^64), [R, j]): uint64 [R]."""
    keys = np.asarray(keys).astype(np.uint64).reshape(len(keys), -1)
    h = _mix(np.full(len(keys), keys.shape[1], dtype=np.uint64))
    for column in keys.T:
        h = _mix(h ^ column)
    return h


def poisson_batches(
    seed: int, t: int, clients: np.ndarray, steps: np.ndarray, sizes: np.ndarray, rates: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Poisson-sampled batches (see the module): batch r, of client ``clients[r]`` at local step ``steps[r]`` of round
    t, holds each of the client's ``sizes[r]`` samples with probability ``rates[r]`` (or ``rates``, one for all),
    independently.

    Returns (positions, lengths): int64, every batch's positions in its client's data (ascending), batch after batch,
    and each batch's length [R]. No loop over batches: one vectorised pass over at most 2^15 draws at a time; the
    work is Σ_r sizes[r] draws (a client of n samples taking ⌈E·n/B⌉ steps: E·n²/B of them).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    R = len(sizes)
    keys = np.stack([np.full(R, seed), np.full(R, _POISSON), np.full(R, t), clients, steps], axis=1)
    heads = stream_keys(keys.astype(np.uint64))
    rates = np.broadcast_to(np.asarray(rates, dtype=np.float64), (R,))
    below = np.floor(rates * 2.0**53).astype(np.uint64)  # a draw is kept when its top 53 bits are below
    ends = np.cumsum(sizes)
    positions, lengths = [], np.zeros(R, dtype=np.int64)
    a = 0
    while a < R:  # batches a..b-1, their draws one after another
        base = int(ends[a] - sizes[a])
        b = max(a + 1, int(np.searchsorted(ends, base + _MASK_CHUNK, side="right")))
        starts = np.concatenate([[0], ends[a:b] - base])  # of each batch's draws
        j = np.arange(starts[-1], dtype=np.uint64)
        j -= np.repeat(starts[:-1].astype(np.uint64), sizes[a:b])  # draw j of its batch
        z = j * _GAMMA
        z += np.repeat(heads[a:b], sizes[a:b])
        kept = np.flatnonzero((_mix(z) >> np.uint64(11)) < np.repeat(below[a:b], sizes[a:b]))
        batch = np.searchsorted(starts, kept, side="right") - 1
        positions.append(kept - starts[batch])
        lengths[a:b] = np.bincount(batch, minlength=b - a)
        a = b
    return (np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)), lengths


@dataclass
class _Plan:
    """Every minibatch of a round's clients, client after client (:meth:`BatchPlanner.plan`): ``counts`` [k] steps
    per client; per minibatch, its client's row ``owner``, its ``step``, and its positions in the client's data,
    ``perms[first : first + length]`` (Poisson sampling: each batch's own positions, ``length`` 0 included)."""

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
        poisson: every batch is a Poisson sample of its client's data at rate min(B, n)/n (``dp_sampling="poisson"``,
            see the module), whatever order a plan asks; the number of steps is the fixed-size plan's.

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
        poisson: bool = False,
    ) -> None:
        self.x, self.y = x, y
        self.client_sizes = client_sizes
        self.seed, self.batch_size, self.local_epochs = seed, batch_size, local_epochs
        self.fixed_order, self.noise_std, self.poisson = fixed_order, noise_std, poisson
        self.device = x.device
        #: Where each client's samples begin in x and y, int64 [m + 1].
        self.offsets = np.concatenate([[0], np.cumsum(client_sizes)]).astype(np.int64)
        spans = list(zip(self.offsets[:-1].tolist(), self.offsets[1:].tolist(), strict=True))
        self.client_x = [x[a:b] for a, b in spans]
        self.client_y = [y[a:b] for a, b in spans]

    def counts(
        self, clients: np.ndarray, epochs: float | None, steps: int | None, drop_last: bool, batch_size: int | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(samples n, batch size min(B, n), local steps) of each client
        (:func:`~pyfedkern.algorithms.context.step_counts`; E and B the run's unless given)."""
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
        of each stream); Poisson batches (``poisson``) from :func:`poisson_batches`."""
        if order not in ("reshuffle", "fixed"):
            raise ValueError(f"order must be 'reshuffle' or 'fixed', got {order!r}")
        if self.fixed_order:  # the run keeps every client's batch order across rounds
            order = "fixed"
        clients = np.asarray(clients, dtype=np.int64).reshape(-1)
        n, size, counts = self.counts(clients, epochs, steps, drop_last, batch_size)
        if self.poisson:
            owner = np.repeat(np.arange(len(clients)), counts)
            step = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
            rows = (clients[owner], step, n[owner], (size / n)[owner])
            positions, length = poisson_batches(self.seed, t, *rows)
            return _Plan(clients, counts, positions, owner, step, np.cumsum(length) - length, length)
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
        self._widths = np.maximum(np.maximum.reduceat(length, self._starts), 1)  # Poisson: a step may be all empty
        self._ragged = np.minimum.reduceat(length, self._starts) < self._widths
        # step s: its rows × its width, flattened, one after another (padding: a sample of the client, weight 0: its
        # batch's first, or its first sample (position 0, the sentinel after perms) when its batch is empty)
        width = np.repeat(self._widths, self._rows)  # of each row
        self._offsets = np.concatenate([[0], np.cumsum(self._rows * self._widths)])  # where each step begins
        row = np.repeat(np.arange(len(owner)), width)
        col = np.arange(row.size) - np.repeat(np.cumsum(width) - width, width)
        pad = np.where(length > 0, first, len(plan.perms))
        local = np.append(plan.perms, 0)[np.where(col < length[row], first[row] + col, pad[row])]
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
