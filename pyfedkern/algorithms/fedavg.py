"""FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020) and SCAFFOLD (Karimireddy et al. 2020, option II).

Their local step direction is built in one place, :func:`step_direction`: the loss gradient plus the algorithm's
terms, clipped when ``ref_compat`` asks for FL-Simulator's clip, plus the weight decay. The FedSpeed paper's other
baselines (:mod:`.fedspeed_baselines`) build theirs the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.base import Algorithm, ClientStore, ClientUpdates, FLContext, RoundSums, owned_clients
from pyfedkern.algorithms.batched import Step
from pyfedkern.algorithms.looped import local_run

#: ``torch.nn.utils.clip_grad_norm_``'s ε, which FL-Simulator's clients use: the factor is min(1, M/(‖g‖ + ε))
CLIP_EPS = 1e-6


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if not np.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")


def server_average_(x: torch.Tensor, total: torch.Tensor, weight: float, server_lr: float) -> None:
    """x ← (1 − η_g)·x + η_g·total/weight (total = Σ w_i·x_i, weight = Σ w_i), in one pass over memory, in place."""
    if not weight > 0:
        raise ValueError(f"the participants' weights must have a positive sum, got {weight}")
    ops.weighted_sum([x, total], [1.0 - server_lr, server_lr / weight], out=x)


def add_weighted_models(sums: RoundSums, updates: ClientUpdates, name: str = "model") -> None:
    """sums[name] += Σ w_i·v_i and sums["weight"] += Σ w_i over a chunk (the FedAvg aggregate)."""
    sums.add(name, updates.vectors[name], updates.weights)
    sums.add_scalar("weight", updates.weights.sum())


def clip_by_norm_(g: torch.Tensor, max_norm: float) -> torch.Tensor:
    """g ← g·min(1, M/(‖g‖ + 1e-6)) in place (``torch.nn.utils.clip_grad_norm_``'s rule, M = ``max_norm``): one norm
    for a [d] vector, one per row of a [k, d] tensor (each client clips its own gradient). Returns g."""
    norm = torch.linalg.vector_norm(g, dim=-1, keepdim=True)
    return g.mul_(torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0))


Terms = Callable[[torch.Tensor, Step], None]


def step_direction(terms: Terms | None, decay: float, clip_norm: float | None) -> Terms | None:
    """The local step direction as the ``correction`` of a run's ``sgd_`` (called as ``(g, step)``, g the step's
    [rows, d] gradients, :func:`~pyfedkern.algorithms.looped.local_run`), run with ``weight_decay=0``: g (the loss
    gradient) gains the algorithm's ``terms`` in place, is
    clipped to norm ``clip_norm`` when that is not None, and gains ``decay``·x.

    This is FL-Simulator's order: its clients put the algorithm's terms into the loss, clip the gradient with
    ``clip_grad_norm_`` and let ``SGD(weight_decay=decay)`` add decay·x after the clip. None when there is nothing
    to add or clip (plain SGD, which the local loops then run without a flat gradient).
    """
    if terms is None and clip_norm is None and not decay:
        return None

    def direction(g: torch.Tensor, step: Step) -> None:
        if terms is not None:
            terms(g, step)
        if clip_norm is not None:
            clip_by_norm_(g, clip_norm)
        if decay:
            g.add_(step.x, alpha=decay)

    return direction


@dataclass
class FedAvg(Algorithm):
    """Clients run local SGD from the global model; the server averages the models weighted by |D_i|.

    Local direction: g + the algorithm's terms (none for FedAvg) + wd·x. With ``ref_compat`` clients and server run as
    FL-Simulator's do (docs/fedspeed.md, "Reference code"): g + the terms is clipped to norm ``clip_norm`` before
    the weight decay is added, the server takes the plain mean over the participants (weights 1, not |D_i|), and
    SCAFFOLD and FedCM count a round's local steps as E·|D_0|/B.

    Args:
        server_lr: global step η_g on the averaged update (1 = plain model averaging).
        ref_compat: FL-Simulator's clip, plain mean and step count.
        clip_norm: the clip threshold M > 0 of ``ref_compat`` (FL-Simulator's is 10).
    """

    name = "fedavg"
    local_dp = True
    robust_vectors = ("model",)
    dp_upload = "model"
    server_lr: float = 1.0
    ref_compat: bool = False
    clip_norm: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("server_lr", self.server_lr)
        _check_positive("clip_norm", self.clip_norm)

    def correction(self, t: int, ctx: FLContext) -> Terms | None:
        """The algorithm's terms of the local direction, added to the loss gradient before the clip: called as
        ``(g, step)`` with g the step's [rows, d] gradients; None for plain SGD."""
        return None

    def decay(self, ctx: FLContext) -> float:
        """The coefficient of the x term added after the clip (FL-Simulator's SGD weight decay): wd."""
        return ctx.weight_decay

    def direction(self, ctx: FLContext, terms: Terms | None) -> Terms | None:
        """The whole local direction around ``terms`` (:func:`step_direction`), for a run with weight_decay=0."""
        return step_direction(terms, self.decay(ctx), self.clip_norm if self.ref_compat else None)

    def weights(self, ctx: FLContext, clients: np.ndarray) -> np.ndarray:
        """Aggregation weights of ``clients`` (float64 [k]): |D_i|, or 1 each with ``ref_compat``."""
        clients = np.asarray(clients, dtype=np.int64)
        return np.ones(len(clients)) if self.ref_compat else ctx.client_sizes[clients].astype(np.float64)

    def counted_steps(self, ctx: FLContext, steps: np.ndarray) -> np.ndarray:
        """K_i of SCAFFOLD's and FedCM's server rules (float64 [k]): the local steps taken, or with ``ref_compat``
        FL-Simulator's count E·|D_0|/B for every client (client 0's size, not rounded; ``local_steps`` when set)."""
        steps = np.asarray(steps, dtype=np.float64)
        if not self.ref_compat:
            return steps
        count = (
            ctx.local_steps if ctx.local_steps is not None else ctx.local_epochs * ctx.client_sizes[0] / ctx.batch_size
        )
        return np.full(steps.shape, float(count))

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = local_run(ctx, t, clients)
        direction = self.direction(ctx, self.correction(t, ctx))
        models = run.sgd_(run.start(self.x), correction=direction, weight_decay=0.0)
        return ClientUpdates.of(run, ctx, {"model": models}, weights=self.weights(ctx, run.clients))

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        add_weighted_models(sums, updates)

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        server_average_(self.x, sums.vector("model"), sums.scalar("weight"), self.server_lr)


@dataclass
class FedProx(FedAvg):
    """FedAvg whose local objective adds (μ/2)‖x − x^t‖² (the gradient gains μ(x − x^t)).

    With ``ref_compat``, as FL-Simulator: −μ·x^t is added before the clip and μ·x after it (with the weight decay).

    Args:
        mu: proximal coefficient μ ≥ 0 (0 gives FedAvg).
    """

    name = "fedprox"
    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("mu", self.mu, allow_zero=True)

    def correction(self, t: int, ctx: FLContext) -> Terms:
        anchor, mu = self.x, self.mu
        if self.ref_compat:

            def pull(g: torch.Tensor, step: Step) -> None:  # μ·x comes with the weight decay (decay())
                g.sub_(anchor, alpha=mu)

            return pull

        def proximal(g: torch.Tensor, step: Step) -> None:
            g.add_(step.x - anchor, alpha=mu)

        return proximal

    def decay(self, ctx: FLContext) -> float:
        return ctx.weight_decay + (self.mu if self.ref_compat else 0.0)


@dataclass
class Scaffold(FedAvg):
    """SCAFFOLD with option-II control variates.

    Local step direction g + c − c_i (+ wd·x); after K steps of size η: c_i⁺ = c_i − c + (x^t − y_i)/(K·η).
    Server: x ← x + η_g·Σ p_i (y_i − x) with p_i ∝ |D_i| over the participants, and c ← c + (1/m)·Σ (c_i⁺ − c_i)
    (so c stays the uniform mean of all c_i). Uploads the model and the control delta; downloads x and c.
    With ``ref_compat``: g + c − c_i clipped, p_i = 1/S, K = E·|D_0|/B (:meth:`FedAvg.counted_steps`).
    """

    name = "scaffold"
    dp_upload = None  # its control deltas are uploads too

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.c = torch.zeros_like(self.x)
        self.client_c = ClientStore(
            ctx.num_clients, self.x.numel(), device=self.x.device, dtype=self.x.dtype, owned=owned_clients(ctx)
        )

    def state_rows_per_client(self, ctx: FLContext) -> int:
        return 3  # c_i, c − c_i, the control delta

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = local_run(ctx, t, clients)
        if np.any(run.steps == 0):
            raise ValueError(f"SCAFFOLD: clients {run.clients[run.steps == 0].tolist()} take no local steps")
        shift = self.c - self.client_c.take(run.clients)

        def control(g: torch.Tensor, step: Step) -> None:
            g.add_(shift[step.span])

        models = run.sgd_(run.start(self.x), correction=self.direction(ctx, control), weight_decay=0.0)
        steps = self.counted_steps(ctx, run.steps)
        scale = torch.as_tensor(1.0 / (steps * run.lr), dtype=self.x.dtype, device=self.x.device)
        delta_c = torch.sub(self.x, models).mul_(scale[:, None]).sub_(self.c)  # −c + (x^t − y_i)/(K η)
        self.client_c.add_(run.clients, delta_c)
        return ClientUpdates.of(run, ctx, {"model": models, "delta_c": delta_c}, weights=self.weights(ctx, run.clients))

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        add_weighted_models(sums, updates)
        sums.add("delta_c", updates.vectors["delta_c"], np.ones(len(updates)))

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        super().server_step(t, sums, ctx)
        ops.weighted_sum([self.c, sums.vector("delta_c")], [1.0, 1.0 / ctx.num_clients], out=self.c)

    def broadcast_floats(self) -> int:
        return 2 * int(self.x.numel())

    def state_dict(self) -> dict:
        return {**super().state_dict(), "c": self.c, "client_c": self.client_c.data}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.c.copy_(state["c"])
        self.client_c.data.copy_(state["client_c"])
