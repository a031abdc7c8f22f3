"""What an algorithm and its environment exchange: the context it reads and calls (:class:`FLContext`), the
processes a run is spread over (:class:`Team`), the minibatches of many clients (:class:`StackedBatches`) and what
clients upload (:class:`ClientUpdates`) and the server sums (:class:`RoundSums`).

Algorithms never import :mod:`pyfedkern.sim` (the engine): everything they need from their environment comes through
an :class:`FLContext`. The simulation engine's :class:`~pyfedkern.sim.engine.Simulation` is one; a user's own loop or
a Flower client subclasses :class:`FLContext`, sets the members without a default and overrides what it offers beyond
the defaults (a member is read as a plain attribute: nothing is probed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from pyfedkern import ops
from pyfedkern.algorithms.attacks import Attack
from pyfedkern.algorithms.local import LocalModel
from pyfedkern.algorithms.robust import Aggregator
from pyfedkern.data.dataset import Dataset
from pyfedkern.data.partitions import Partition
from pyfedkern.dpsgd import DPSGD
from pyfedkern.privacy import CentralDP

Batch = tuple[torch.Tensor, torch.Tensor]


# Minibatches of many clients -----------------------------------------------------------------------------------


class StackedBatches(Protocol):
    """The minibatches of a round's clients, step by step (what ``ctx.stacked_batches`` returns).

    Attributes:
        clients: int64 [k] the clients, ordered by descending number of steps (ties keep the order asked for).
        steps: int64 [k] each client's number of steps (descending).

    Iterating yields, for step s = 0, 1, ..., ``(xb, yb, wb)`` of the a_s = #{r: steps[r] > s} first clients:
    xb [a_s, B, ...] and yb [a_s, B] their batches (client r's batch is the one ``ctx.batches(clients[r], ...)``
    yields at step s), wb None when every batch of the step has B samples, else [a_s, B] weights 1/b_r on client
    r's b_r samples and 0 on the padding after them. A step's tensors may be overwritten by the next step's (the
    engine reuses its buffers): copy them to keep them.
    """

    clients: np.ndarray
    steps: np.ndarray

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]: ...


class ListedBatches:
    """:class:`StackedBatches` from a context's ``batches``: every client's batches listed, then stacked step by
    step (:meth:`FLContext.stacked_batches`' default)."""

    def __init__(self, ctx: FLContext, clients: Sequence[int] | np.ndarray, t: int, **kwargs: Any) -> None:
        listed = [list(ctx.batches(int(cid), t, **kwargs)) for cid in clients]
        counts = np.array([len(b) for b in listed], dtype=np.int64)
        order = np.argsort(-counts, kind="stable")
        self.clients = np.asarray(clients, dtype=np.int64).reshape(-1)[order]
        self.steps = counts[order]
        self._listed = [listed[r] for r in order]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        for step in range(int(self.steps[0]) if len(self.steps) else 0):
            active = int(np.count_nonzero(self.steps > step))
            yield stack_batches([self._listed[r][step] for r in range(active)])


def stack_batches(batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stack k batches to [k, B, ...]; unequal sizes are zero-padded to the largest, with per-sample weights."""
    sizes = [int(b[1].shape[0]) for b in batches]
    if len(set(sizes)) == 1 and len({tuple(b[0].shape) for b in batches}) == 1:
        return torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]), None
    xb = pad_sequence([b[0] for b in batches], batch_first=True)
    yb = pad_sequence([b[1] for b in batches], batch_first=True)
    return xb, yb, padding_weights(sizes, xb)


def padding_weights(sizes: Sequence[int] | torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """[k, B] per-sample weights of k batches of ``sizes`` ([k] integers) zero-padded into xb [k, B, ...]: 1/b_r on
    the b_r real samples of batch r, 0 on its padding (xb's float dtype, or float64 for integer inputs such as token
    ids: :meth:`~pyfedkern.algorithms.batched.BatchedTrainer.gradients` rounds them to the model's dtype); an empty
    batch (b_r = 0, Poisson sampling) is all padding."""
    sizes = torch.as_tensor(sizes, device=xb.device)
    dtype = xb.dtype if xb.is_floating_point() else torch.float64
    real = torch.arange(xb.shape[1], device=xb.device)[None, :] < sizes[:, None]
    return real.to(dtype) / sizes[:, None].clamp(min=1).to(dtype)


# Uploads and round sums ----------------------------------------------------------------------------------------


@dataclass
class ClientUpdates:
    """What a round's participants (or a chunk of them) send, stacked: row r belongs to client ``clients[r]``.

    Attributes:
        clients: int64 [k] client ids (in any order; batched training orders them by number of local steps).
        weights: float64 [k] aggregation weights before normalisation (by default |D_i|).
        vectors: named [k, d] tensors (e.g. "model", "delta_c"), row r the vector of client ``clients[r]``.
        losses: float64 [k] mean local training loss of each client (NaN without steps), on the model's device
            (read once per round, so local steps never wait for the GPU).
        steps: int64 [k] local steps taken.
        extras: named float64 [k] per-client values an algorithm uses or logs (BHerd's τ_i, K_i, ...).
    """

    clients: np.ndarray
    weights: np.ndarray
    vectors: dict[str, torch.Tensor]
    losses: torch.Tensor
    steps: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def upload_floats(self) -> int:
        """The total length of the uploaded vectors (floats sent to the server)."""
        return sum(int(v.numel()) for v in self.vectors.values())

    @classmethod
    def of(
        cls,
        run: Any,
        ctx: FLContext,
        vectors: dict[str, torch.Tensor],
        *,
        weights: np.ndarray | None = None,
        extras: dict[str, np.ndarray] | None = None,
    ) -> ClientUpdates:
        """The updates of a :class:`~pyfedkern.algorithms.batched.BatchedLocal` run: its clients, losses and steps,
        ``vectors`` in its row order, weights |D_i| unless given."""
        return cls(
            clients=run.clients,
            weights=ctx.client_sizes[run.clients].astype(np.float64) if weights is None else weights,
            vectors=vectors,
            losses=run.losses(),
            steps=run.steps,
            extras=extras or {},
        )

    @classmethod
    def concat(cls, parts: Sequence[ClientUpdates]) -> ClientUpdates:
        """The chunks ``parts`` of a round as one update, its rows ordered by client id (the loop's order; a stable
        sort), so that a rule that depends on the order sees the same rows on every path."""
        clients = np.concatenate([p.clients for p in parts])
        order = np.argsort(clients, kind="stable")
        first = parts[0]
        index = torch.as_tensor(order, device=first.losses.device)

        def rows(values: list[torch.Tensor]) -> torch.Tensor:
            joined = torch.cat(values) if len(values) > 1 else values[0]
            return joined.index_select(0, index.to(joined.device))

        return cls(
            clients=clients[order],
            weights=np.concatenate([p.weights for p in parts])[order],
            vectors={name: rows([p.vectors[name] for p in parts]) for name in first.vectors},
            losses=rows([p.losses for p in parts]),
            steps=np.concatenate([p.steps for p in parts])[order],
            extras={key: np.concatenate([p.extras[key] for p in parts])[order] for key in first.extras},
        )


class RoundSums:
    """The sums a server step needs, accumulated chunk by chunk over a round's participants.

    ``add(name, rows, coefs)`` adds Σ_r coefs[r]·rows[r] ([k, d] rows, one pass through
    :func:`pyfedkern.ops.weighted_sum`) to the vector ``name``; ``add_scalar(name, value)`` adds a number. Reading a
    name never added gives None (vectors) or 0.0 (scalars).
    """

    def __init__(self) -> None:
        self.vectors: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, float] = {}

    def add(self, name: str, rows: torch.Tensor, coefs: np.ndarray | Sequence[float]) -> None:
        """Add Σ_r coefs[r]·rows[r] ([k, d] rows, k coefficients) to the vector ``name``."""
        coefs = np.asarray(coefs, dtype=np.float64)
        if name not in self.vectors:
            self.vectors[name] = ops.weighted_sum(rows, coefs)
        elif rows.shape[0] == 1 == coefs.size:  # one pass over memory (the loop folds one large model at a time)
            ops.accumulate_(self.vectors[name], rows[0], coefs[0])
        else:
            self.vectors[name].add_(ops.weighted_sum(rows, coefs))

    def add_scalar(self, name: str, value: float) -> None:
        """Add a number to the scalar ``name``."""
        self.scalars[name] = self.scalars.get(name, 0.0) + float(value)

    def vector(self, name: str) -> torch.Tensor | None:
        """The [d] sum ``name``, or None when nothing was added to it."""
        return self.vectors.get(name)

    def scalar(self, name: str) -> float:
        """The scalar sum ``name`` (0.0 when nothing was added to it)."""
        return self.scalars.get(name, 0.0)


# The processes of a run ----------------------------------------------------------------------------------------


class Team:
    """The ranks of one run as the engine and :meth:`Algorithm.round <pyfedkern.algorithms.Algorithm.round>` see
    them. This base class is the one-process team (every method the identity);
    :class:`~pyfedkern.sim.distributed.ProcessTeam` is the torch.distributed one.

    Attributes:
        rank, size: this rank and the number of ranks.
        owned: sorted int64 ids of the clients this rank owns (None: all of them).
    """

    rank = 0
    size = 1
    owned: np.ndarray | None = None

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes files and prints (rank 0)."""
        return self.rank == 0

    def keep_client_state(self) -> np.ndarray | None:
        """The clients whose state this rank keeps (``owned``). From this call on, :meth:`mine` gives every rank
        the participants it owns, so that a client is always trained where its state is."""
        return self.owned

    def mine(self, clients: np.ndarray) -> np.ndarray:
        """The clients of a round's participants ``clients`` that this rank trains, in their given order: the ones it
        owns once client state is kept (:meth:`keep_client_state`), else its share of this round's work."""
        return clients

    def combine(self, t: int, sums: RoundSums, losses: list[torch.Tensor], upload: int):
        """(sums, losses, upload floats) of the whole round from this rank's part of them."""
        return sums, losses, upload

    def evaluate(
        self, fn: Callable[[torch.Tensor, torch.Tensor], tuple[float, float]], x: torch.Tensor, y: torch.Tensor
    ) -> tuple[float, float]:
        """``fn(x, y)`` → (mean loss, accuracy), computed over the ranks' slices of (x, y) and combined."""
        return fn(x, y)

    def first(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run on rank 0 (its value there, None on the other ranks) before any rank goes on; a ValueError
        or OSError it raises is raised on every rank."""
        return fn()

    def scatter(self, items: Sequence[Any] | None) -> Any:
        """items[r] (given on rank 0) on rank r."""
        assert items is not None
        return items[0]

    def gather(self, item: Any) -> list[Any] | None:
        """Every rank's ``item`` in rank order on rank 0 (tensors in it on the CPU), None elsewhere."""
        return [item]

    def everyone(self, t: int, parts: list[ClientUpdates]) -> list[ClientUpdates]:
        """Every rank's ``parts`` (chunks of round t's uploads, kept for a robust aggregator or an attack) on every
        rank, in rank order, on this rank's device."""
        return parts


#: The team of a run in one process (every method the identity): :attr:`FLContext.team`'s default.
ONE_PROCESS = Team()


# The context ---------------------------------------------------------------------------------------------------


def step_counts(
    sizes: np.ndarray, batch_size: int, epochs: float, steps: int | None, drop_last: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(batch size min(B, n), local steps) int64 [k] of clients of ``sizes`` n: ``steps``, else ⌈E·n/b⌉ (⌊E·n/b⌋
    with drop_last)."""
    size = np.minimum(batch_size, sizes)
    if steps is None:
        work = epochs * sizes / size
        counts = np.floor(work + 1e-9) if drop_last else np.ceil(work - 1e-9)
    else:
        counts = np.full(len(sizes), steps)
    return size, np.maximum(counts, 0).astype(np.int64)


class FLContext:
    """What an algorithm may read from and call on its environment: one declared member each, read as a plain
    attribute. A context (the engine's :class:`~pyfedkern.sim.engine.Simulation`, a Flower client's, a user's own)
    subclasses it, sets the members without a default and overrides the methods it needs; every other member keeps
    its default.

    Members without a default (a context must set them):

    Attributes:
        num_clients: number of clients m.
        client_sizes: int64 [m] local dataset sizes |D_i|.
        local: the shared :class:`~pyfedkern.algorithms.LocalModel` (one model, its parameters and gradients as flat
            [d] buffers).
        device: torch device of all vectors.
        batch_size: minibatch size B.
        local_epochs: local epochs E per round (used when local_steps is None).
        local_steps: local steps per round, or None to take local_epochs.
        momentum: local SGD momentum.
        weight_decay: L2 weight decay of the local steps.

    The methods :meth:`lr`, :meth:`batches`, :meth:`sample_clients` and :meth:`rng` have no default either (they
    raise NotImplementedError). The members below have one.
    """

    num_clients: int
    client_sizes: np.ndarray
    local: LocalModel
    device: torch.device
    batch_size: int
    local_epochs: float
    local_steps: int | None
    momentum: float
    weight_decay: float

    #: Train a round's participants as batched steps (True) or as a loop over clients (False); a model that cannot be
    #: batched loops either way (:func:`~pyfedkern.algorithms.batched.use_batched`).
    batched: bool = True
    #: Train at most this many participants at once; None: as many as fit the memory budget of
    #: :func:`~pyfedkern.algorithms.batched.client_chunks`.
    client_chunk: int | None = None
    #: One training sample (a tensor of the model's input shape), on which that budget measures the model's
    #: activations; None: the budget counts the model's rows only.
    sample_input: torch.Tensor | None = None
    #: Processes that share the device's free memory (the ranks of a distributed run on one CPU machine); the budget
    #: of :func:`~pyfedkern.algorithms.batched.client_chunks` is split between them.
    device_sharers: int = 1
    #: The processes a run spreads its rounds over: :meth:`Algorithm.round <pyfedkern.algorithms.Algorithm.round>`
    #: trains ``team.mine(participants)`` and combines the sums with ``team.combine(...)``. Default: one process.
    team: Team = ONE_PROCESS
    #: The server's rule for an algorithm's ``robust_vectors`` (a name or an
    #: :class:`~pyfedkern.algorithms.robust.Aggregator`); None: the weighted mean.
    aggregator: str | Aggregator | None = None
    #: Byzantine participants (a spec or an :class:`~pyfedkern.algorithms.attacks.Attack`); None: no attack.
    attack: str | Attack | None = None
    #: Central DP of the server's aggregate (:class:`~pyfedkern.privacy.CentralDP`); None: none.
    central_dp: CentralDP | None = None
    #: Local DP-SGD (:class:`~pyfedkern.dpsgd.DPSGD`): every local step's minibatch gradient is its clipped
    #: per-sample sum plus noise keyed by (round, client, step), on the loop and the batched path alike; None: none.
    dpsgd: DPSGD | None = None
    #: The run's number of rounds T (DynamicInit splits them into sessions); None: not known.
    rounds: int | None = None
    #: Sorted int64 ids of the clients that exist now; None: all m. A session schedule (DynamicInit) sets it, and
    #: :meth:`sample_clients` should draw from it.
    active_clients: np.ndarray | None = None
    #: int64 class labels evaluation keeps (the classes the current clients hold; DynamicInit sets it); None: all.
    eval_labels: np.ndarray | None = None
    #: The dataset (FedPBC's log-normal link probabilities read its ``num_classes``); None: not known.
    data: Dataset | None = None
    #: The split of the data among clients (DynamicInit reads its ``groups``); None: one group of every client.
    partition: Partition | None = None
    #: Each client's training labels, m int64 tensors [|D_i|] (FedPBC's log-normal link probabilities); None.
    client_y: list[torch.Tensor] | None = None
    #: A labelled public set on the server, [n_pub, ...] inputs and [n_pub] int64 labels (FNR-FL); None: none.
    public_x: torch.Tensor | None = None
    public_y: torch.Tensor | None = None

    def lr(self, t: int) -> float:
        """Local learning rate of round t."""
        raise NotImplementedError

    def batches(
        self,
        cid: int,
        t: int,
        *,
        epochs: float | None = None,
        steps: int | None = None,
        order: str = "reshuffle",
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> Iterator[Batch]:
        """Client cid's minibatches for round t ("reshuffle": a new seeded order each epoch; "fixed": one seeded
        order kept across rounds)."""
        raise NotImplementedError

    def planned_steps(
        self,
        clients: Sequence[int] | np.ndarray,
        *,
        epochs: float | None = None,
        steps: int | None = None,
        drop_last: bool = False,
        batch_size: int | None = None,
    ) -> np.ndarray:
        """Local steps int64 [k] that :meth:`batches` gives ``clients`` with these arguments (defaults: the run's
        local_steps if set, else local_epochs, and B): ``steps``, else ⌈E·|D_i|/b⌉ (⌊E·|D_i|/b⌋ with drop_last),
        b = min(B, |D_i|) (:func:`~pyfedkern.algorithms.context.step_counts`). A context whose batches count
        otherwise overrides it."""
        if steps is None and epochs is None:
            steps, epochs = self.local_steps, self.local_epochs
        sizes = self.client_sizes[np.asarray(clients, dtype=np.int64).reshape(-1)]
        return step_counts(sizes, batch_size or self.batch_size, epochs, steps, drop_last)[1]

    def sample_clients(self, t: int) -> np.ndarray:
        """The clients taking part in round t (sorted int64 ids) under the configured participation."""
        raise NotImplementedError

    def rng(self, *keys: int) -> np.random.Generator:
        """An independent random stream for (seed, ``*keys``)."""
        raise NotImplementedError

    def stacked_batches(
        self,
        clients: Sequence[int] | np.ndarray,
        t: int,
        *,
        epochs: float | None = None,
        steps: int | None = None,
        order: str = "reshuffle",
        drop_last: bool = False,
    ) -> StackedBatches:
        """The :meth:`batches` of many clients gathered step by step
        (:class:`~pyfedkern.algorithms.context.StackedBatches`). This default lists every client's batches, then stacks
        them (:class:`~pyfedkern.algorithms.context.ListedBatches`); the engine gathers them from its arrays."""
        return ListedBatches(self, clients, t, epochs=epochs, steps=steps, order=order, drop_last=drop_last)

    def seed_model_randomness(self, t: int, *keys: int) -> None:
        """Seed the model's own randomness (dropout: torch's default generators) from a stream of (round t,
        ``*keys``), so that what a model draws in round t does not depend on what its process ran before. This
        default does nothing (the model draws from torch's generators as they are)."""

    def timer(self, category: str) -> contextlib.AbstractContextManager:
        """Context manager adding the elapsed wall time to a category ("local", "aggregation", "evaluation"). This
        default measures nothing."""
        return contextlib.nullcontext()
