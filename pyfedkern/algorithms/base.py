"""The algorithm interface shared by every FL method in pyfedkern, and the pieces they are built from.

An :class:`Algorithm` owns the server state (the global model as one flat vector, per-client state in a
:class:`ClientStore`) and implements one round as ``participants`` → ``client_update`` for each → ``server_step``;
methods with a different round shape (FedPBC trains every client, FNR-FL has a second phase) override
:meth:`Algorithm.round`. Algorithms never import :mod:`pyfedkern.sim` (the engine): everything they need from their
environment comes through the :class:`FLContext` protocol, which the simulation engine implements and a user's own
loop (or a Flower client) can implement as well.

Every piece of mutable state that affects later rounds must be returned by ``state_dict`` so a checkpointed run
resumes bit for bit; randomness is drawn from ``ctx.rng(...)`` streams keyed by (seed, round, client, purpose),
never from a shared generator.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.local import LocalModel

Batch = tuple[torch.Tensor, torch.Tensor]


class FLContext(Protocol):
    """What an algorithm may ask of its environment (the simulation engine implements it).

    Attributes:
        num_clients: number of clients m.
        client_sizes: int64 [m] local dataset sizes |D_i|.
        local: the shared :class:`LocalModel` (one model, its parameters and gradients as flat [d] buffers).
        device: torch device of all vectors.
        lr0, batch_size, local_epochs, local_steps, momentum, weight_decay: local training settings
        (local_steps, when not None, overrides local_epochs).
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

    def lr(self, t: int) -> float:
        """Local learning rate of round t."""

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

    def sample_clients(self, t: int) -> np.ndarray:
        """The clients taking part in round t (sorted int64 ids) under the configured participation."""

    # Optional: stacked_batches(clients, t, *, epochs=None, steps=None) yielding (rows, xb, yb, wb) per step, the
    # same batches as batches() for each client, stacked (see Simulation.stacked_batches); batched local SGD
    # uses it when present.

    def rng(self, *keys: int) -> np.random.Generator:
        """An independent random stream for (seed, *keys)."""

    def timer(self, category: str) -> contextlib.AbstractContextManager:
        """Context manager adding the elapsed wall time to a category ("local", "aggregation", "evaluation")."""


@dataclass
class ClientMessage:
    """What one client sends to the server after its local update.

    Attributes:
        cid: client id.
        weight: the client's aggregation weight before normalisation (by default |D_i|).
        vectors: named flat [d] tensors (e.g. "model", "delta", "control").
        loss: mean local training loss over the steps taken.
        steps: number of local steps taken (τ_i).
        extras: small per-client values (floats) an algorithm wants to log or use.
    """

    cid: int
    weight: float
    vectors: dict[str, torch.Tensor]
    loss: float = float("nan")
    steps: int = 0
    extras: dict[str, float] = field(default_factory=dict)

    @property
    def upload_floats(self) -> int:
        return sum(int(v.numel()) for v in self.vectors.values())


@dataclass
class RoundStats:
    """What a round reports to the engine: mean local loss, participants, traffic (floats), extra metrics."""

    clients: np.ndarray
    local_loss: float
    upload_floats: int
    download_floats: int
    extras: dict[str, float] = field(default_factory=dict)


class ClientStore:
    """Per-client state as one [m, d] tensor (zero until written): SCAFFOLD c_i, FedSpeed h_i, FedPBC x_i, ...

    One buffer instead of a Python object per client, so thousands of clients cost one allocation.
    """

    def __init__(
        self,
        num_clients: int,
        dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_clients < 1 or dim < 1:
            raise ValueError(f"ClientStore needs num_clients >= 1 and dim >= 1, got {num_clients} and {dim}")
        self.data = torch.zeros(num_clients, dim, device=device, dtype=dtype)

    def __getitem__(self, cid: int) -> torch.Tensor:
        """Row cid (a view: writes go to the store)."""
        return self.data[cid]

    def mean(self) -> torch.Tensor:
        """The unweighted mean over all clients, [d]."""
        return ops.weighted_sum(self.data, np.full(self.data.shape[0], 1.0 / self.data.shape[0]))


def weighted_average(
    vectors: Sequence[torch.Tensor], weights: Sequence[float] | np.ndarray, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Σ_i (w_i / Σw) v_i in one pass over memory (pyfedkern.ops.weighted_sum)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError(f"weights must have a positive sum, got {w.sum()}")
    return ops.weighted_sum(list(vectors), w / w.sum(), out=out)


class Algorithm:
    """Base class of FL algorithms operating on flat parameter vectors.

    Subclasses are dataclasses whose fields are their hyper-parameters (the CLI exposes each field as
    ``--field-name``), set ``name``, and implement :meth:`client_update` and :meth:`server_step` (or override
    :meth:`round`). ``setup`` receives the context and the initial model vector.
    """

    name: ClassVar[str] = ""
    #: Samples per class the engine must hold out of the training data as a labelled public set (FNR-FL).
    public_per_class: ClassVar[int] = 0

    x: torch.Tensor

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        """Allocate server state; ``x0`` is the initial global model [d]."""
        self.x = x0.clone()

    def participants(self, t: int, ctx: FLContext) -> np.ndarray:
        return ctx.sample_clients(t)

    def client_update(self, t: int, cid: int, ctx: FLContext) -> ClientMessage:
        raise NotImplementedError

    def server_step(self, t: int, messages: list[ClientMessage], ctx: FLContext) -> None:
        raise NotImplementedError

    def broadcast_floats(self) -> int:
        """Floats sent from the server to each participant per round (the model by default)."""
        return int(self.x.numel())

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        """One round: local updates of the participants, then the server step."""
        clients = self.participants(t, ctx)
        messages = []
        with ctx.timer("local"):
            for cid in clients:
                messages.append(self.client_update(t, int(cid), ctx))
        with ctx.timer("aggregation"):
            if messages:
                self.server_step(t, messages, ctx)
        return RoundStats(
            clients=np.asarray(clients, dtype=np.int64),
            local_loss=_mean_loss(messages),
            upload_floats=sum(m.upload_floats for m in messages),
            download_floats=len(clients) * self.broadcast_floats(),
        )

    def global_model(self) -> torch.Tensor:
        """The vector to evaluate [d]."""
        return self.x

    def state_dict(self) -> dict[str, Any]:
        """All mutable server/client state (tensors, numpy arrays, numbers) needed to resume exactly."""
        return {"x": self.x}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.x.copy_(state["x"])

    @classmethod
    def hyperparameters(cls) -> dict[str, dataclasses.Field]:
        """The algorithm's hyper-parameter fields (name → dataclass field)."""
        if not dataclasses.is_dataclass(cls):
            return {}
        return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _mean_loss(messages: Sequence[ClientMessage]) -> float:
    losses = [m.loss for m in messages if np.isfinite(m.loss)]
    return float(np.mean(losses)) if losses else float("nan")


@dataclass
class LocalResult:
    """Outcome of :func:`local_sgd`: final local model [d] (a copy), mean loss, number of steps."""

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
    correction: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    on_gradient: Callable[[int, torch.Tensor], None] | None = None,
) -> LocalResult:
    """Minibatch SGD on client cid from x0: x ← x − lr·(g + wd·x [+ correction]) with optional momentum.

    Args:
        correction: called as ``correction(g, x)`` after weight decay, may modify the direction g in place
            (FedProx adds μ(x − x0), SCAFFOLD adds c − c_i).
        on_gradient: called as ``on_gradient(step, g)`` with the raw minibatch gradient (a view: copy it to keep).
        epochs / steps: local work (defaults: ctx.local_steps if set, else ctx.local_epochs).
    """
    local = ctx.local
    local.load_(x0)
    x, g = local.flat.data, local.flat.grad
    lr = ctx.lr(t) if lr is None else lr
    if steps is None and epochs is None:
        steps, epochs = ctx.local_steps, ctx.local_epochs
    momentum_buf: torch.Tensor | None = None
    total, n = 0.0, 0
    for n, (xb, yb) in enumerate(
        ctx.batches(cid, t, epochs=epochs, steps=steps, order=order, drop_last=drop_last), start=1
    ):
        total += local.loss_and_grad(xb, yb)
        if on_gradient is not None:
            on_gradient(n - 1, g)
        if ctx.weight_decay:
            g.add_(x, alpha=ctx.weight_decay)
        if correction is not None:
            correction(g, x)
        direction = g
        if ctx.momentum:
            momentum_buf = g.clone() if momentum_buf is None else momentum_buf.mul_(ctx.momentum).add_(g)
            direction = momentum_buf
        x.add_(direction, alpha=-lr)
    return LocalResult(x.clone(), total / n if n else float("nan"), n)
