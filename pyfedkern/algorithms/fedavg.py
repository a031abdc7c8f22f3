"""FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020) and SCAFFOLD (Karimireddy et al. 2020, option II)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.base import (
    Algorithm,
    ClientMessage,
    ClientStore,
    ClientUpdates,
    FLContext,
    RoundSums,
    local_sgd,
    owned_clients,
)
from pyfedkern.algorithms.batched import BatchedLocal, Step


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


@dataclass
class FedAvg(Algorithm):
    """Clients run local SGD from the global model; the server averages the models weighted by |D_i|.

    Args:
        server_lr: global step η_g on the averaged update (1 = plain model averaging).
    """

    name = "fedavg"
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("server_lr", self.server_lr)

    def correction(self, t: int, ctx: FLContext, run: BatchedLocal | None = None):
        """The local direction's extra term as ``(g, x)`` → None for :func:`local_sgd` (run None), or
        ``(g, step)`` → None for the rows of a batched run; None for plain SGD."""
        return None

    def client_update(self, t: int, cid: int, ctx: FLContext) -> ClientMessage:
        result = local_sgd(ctx, cid, t, self.x, correction=self.correction(t, ctx))
        return ClientMessage(cid, float(ctx.client_sizes[cid]), {"model": result.x}, result.loss, result.steps)

    def batched_client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = BatchedLocal(ctx, t, clients)
        models = run.sgd_(run.start(self.x), correction=self.correction(t, ctx, run))
        return ClientUpdates.of(run, ctx, {"model": models})

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        add_weighted_models(sums, updates)

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        server_average_(self.x, sums.vector("model"), sums.scalar("weight"), self.server_lr)


@dataclass
class FedProx(FedAvg):
    """FedAvg whose local objective adds (μ/2)‖x − x^t‖² (the gradient gains μ(x − x^t)).

    Args:
        mu: proximal coefficient μ ≥ 0 (0 gives FedAvg).
    """

    name = "fedprox"
    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("mu", self.mu, allow_zero=True)

    def correction(self, t: int, ctx: FLContext, run: BatchedLocal | None = None):
        anchor = self.x
        if run is None:

            def proximal(g: torch.Tensor, x: torch.Tensor) -> None:
                g.add_(x - anchor, alpha=self.mu)

            return proximal

        def proximal_rows(g: torch.Tensor, step: Step) -> None:
            g.add_(step.x - anchor, alpha=self.mu)

        return proximal_rows


@dataclass
class Scaffold(FedAvg):
    """SCAFFOLD with option-II control variates.

    Local step direction g + c − c_i; after K steps of size η: c_i⁺ = c_i − c + (x^t − y_i)/(K·η).
    Server: x ← x + η_g·Σ p_i (y_i − x) with p_i ∝ |D_i| over the participants, and c ← c + (1/m)·Σ (c_i⁺ − c_i)
    (so c stays the uniform mean of all c_i). Uploads the model and the control delta; downloads x and c.
    """

    name = "scaffold"

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.c = torch.zeros_like(self.x)
        self.client_c = ClientStore(
            ctx.num_clients, self.x.numel(), device=self.x.device, dtype=self.x.dtype, owned=owned_clients(ctx)
        )

    def state_rows_per_client(self, ctx: FLContext) -> int:
        return 3  # c_i, c − c_i, the control delta

    def client_update(self, t: int, cid: int, ctx: FLContext) -> ClientMessage:
        c_i = self.client_c[cid]
        shift = self.c - c_i

        def control(g: torch.Tensor, x: torch.Tensor) -> None:
            g.add_(shift)

        lr = ctx.lr(t)
        result = local_sgd(ctx, cid, t, self.x, lr=lr, correction=control)
        if result.steps == 0:
            raise ValueError(f"SCAFFOLD: client {cid} took no local steps (empty local dataset?)")
        # c_i⁺ − c_i = −c + (x^t − y_i)/(K η)
        scale = 1.0 / (result.steps * lr)
        delta_c = ops.weighted_sum([self.c, self.x, result.x], [-1.0, scale, -scale])
        c_i.add_(delta_c)
        return ClientMessage(
            cid,
            float(ctx.client_sizes[cid]),
            {"model": result.x, "delta_c": delta_c},
            result.loss,
            result.steps,
        )

    def batched_client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = BatchedLocal(ctx, t, clients)
        if np.any(run.steps == 0):
            raise ValueError(f"SCAFFOLD: clients {run.clients[run.steps == 0].tolist()} take no local steps")
        shift = self.c - self.client_c.take(run.clients)

        def control(g: torch.Tensor, step: Step) -> None:
            g.add_(shift[: step.rows])

        models = run.sgd_(run.start(self.x), correction=control)
        scale = torch.as_tensor(1.0 / (run.steps * run.lr), dtype=self.x.dtype, device=self.x.device)
        delta_c = torch.sub(self.x, models).mul_(scale[:, None]).sub_(self.c)  # −c + (x^t − y_i)/(K η)
        self.client_c.add_(run.clients, delta_c)
        return ClientUpdates.of(run, ctx, {"model": models, "delta_c": delta_c})

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
