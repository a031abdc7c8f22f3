"""The baselines FedSpeed is compared with (besides FedAvg, FedProx and SCAFFOLD in :mod:`.fedavg`).

- :class:`FedDyn` (Acar et al. 2021) in FL-Simulator's storage form;
- :class:`FedSAM` (Qu et al. 2022): local SAM steps, FedAvg server;
- :class:`FedCM` (Xu et al. 2021): client momentum towards the previous round's average update;
- :class:`FedAdam` (Reddi et al. 2021): FedAvg clients, Adam on the server.

Each has ``ref_compat``: the run as FL-Simulator's client and server code do it (the clip of the loss gradient plus
the algorithm's terms at ``clip_norm`` before the weight decay, and the reference server rules; docs/fedspeed.md,
"Reference code"). They are written with plain torch operations on the flat buffers (not the fused FedSpeed
kernels), so the tests that equate FedSpeed's special cases with them check two independent implementations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.base import Algorithm, ClientStore, ClientUpdates, FLContext, RoundSums, owned_clients
from pyfedkern.algorithms.batched import Step
from pyfedkern.algorithms.fedavg import (
    FedAvg,
    Terms,
    _check_positive,
    add_weighted_models,
    server_average_,
    step_direction,
)
from pyfedkern.algorithms.looped import local_run


def _no_momentum(name: str, ctx: FLContext) -> None:
    if ctx.momentum:
        raise ValueError(f"{name}: local momentum is not part of the algorithm; set momentum to 0")


@dataclass
class FedDyn(Algorithm):
    """FedDyn with prox parameter λ (prox weight 1/λ), in the storage form h_i = −λ·∇L_i-state.

    Client: SGD on the direction g + (1/λ)(x + h_i − x^t) + wd·x; with ``ref_compat`` (FL-Simulator) the loss gradient
    plus the correction g + (1/λ)(h_i − x^t) is first clipped to norm ``clip_norm`` and (1/λ + wd)·x added after the
    clip. Then h_i += x_K − x^t.
    Server: x^{t+1} = mean over participants of x_K + mean over all m clients of h_i (plain means, not weighted by
    |D_i|, as in FedSpeed).
    """

    name = "feddyn"
    local_dp = True
    lam: float = 10.0
    ref_compat: bool = False
    clip_norm: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.lam) and self.lam > 0):
            raise ValueError(f"lam (λ) must be finite and > 0, got {self.lam}")
        _check_positive("clip_norm", self.clip_norm)

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.h_store = ClientStore(
            ctx.num_clients, self.x.numel(), device=self.x.device, dtype=self.x.dtype, owned=owned_clients(ctx)
        )
        self.h_total = torch.zeros_like(self.x)
        self.num_clients = int(ctx.num_clients)

    def state_rows_per_client(self, ctx: FLContext) -> int:
        return 3  # h_i, h_i − x^t, the model change

    def direction(self, ctx: FLContext, anchor: torch.Tensor) -> Terms:
        """The local direction around the anchors h_i − x^t ([k, d] rows of the run)."""
        c = 1.0 / self.lam

        def dual(g: torch.Tensor, step: Step) -> None:
            a = anchor[step.span]
            if self.ref_compat:  # c·x comes after the clip, with the weight decay
                g.add_(a, alpha=c)
            else:
                g.add_(step.x + a, alpha=c)

        decay = ctx.weight_decay + (c if self.ref_compat else 0.0)
        return step_direction(dual, decay, self.clip_norm if self.ref_compat else None)

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = local_run(ctx, t, clients)
        direction = self.direction(ctx, self.h_store.take(run.clients) - self.x)
        models = run.sgd_(run.start(self.x), correction=direction, weight_decay=0.0)
        delta = models - self.x
        self.h_store.add_(run.clients, delta)
        return ClientUpdates.of(run, ctx, {"model": models, "delta": delta}, weights=np.ones(len(run)))

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        ones = np.ones(len(updates))
        sums.add("model", updates.vectors["model"], ones)
        sums.add("delta", updates.vectors["delta"], ones)
        sums.add_scalar("count", len(updates))

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        self.h_total.add_(sums.vector("delta"))
        ops.weighted_sum(
            [sums.vector("model"), self.h_total], [1.0 / sums.scalar("count"), 1.0 / self.num_clients], out=self.x
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "h": self.h_store.data, "h_total": self.h_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.h_store.data.copy_(state["h"])
        self.h_total.copy_(state["h_total"])


@dataclass
class FedSAM(FedAvg):
    """FedAvg whose clients take SAM steps: g1 at x, x̆ = x + ρ·g1/(‖g1‖ + ε), g2 at x̆, x ← x − η(g2 + wd·x)
    (with ``ref_compat`` g2 is clipped to norm ``clip_norm`` first, as FL-Simulator's client does)."""

    name = "fedsam"
    local_dp = False  # its perturbed second gradient would be a second, unaccounted query
    rho: float = 0.1
    eps: float = 1e-7

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("rho", self.rho, allow_zero=True)
        _check_positive("eps", self.eps, allow_zero=True)

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        _no_momentum(self.name, ctx)
        super().setup(ctx, x0)

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        run = local_run(ctx, t, clients)
        models = run.start(self.x)
        finish = self.direction(ctx, None)
        for step in run.run(models):
            g = run.gradients(step)
            denom = torch.linalg.vector_norm(g, dim=1) + self.eps  # one norm per client
            scale = torch.where(denom > 0, self.rho / denom, torch.zeros_like(denom))
            g = run.gradients(step, step.x + scale[:, None] * g, record=False)
            if finish is not None:
                finish(g, step)
            step.x.add_(g, alpha=-run.lr)
        return ClientUpdates.of(run, ctx, {"model": models}, weights=self.weights(ctx, run.clients))


@dataclass
class FedCM(FedAvg):
    """FedAvg with client-level momentum: local direction a·g + (1 − a)·m + wd·x, where m = −Δ/(K·η) is the
    previous round's average model change per local step (0 in round 0) and a = ``client_momentum``.

    This is FL-Simulator's FedCM client (the loss a·L + (1 − a)·⟨x, m⟩ under SGD with weight decay wd): the weight
    decay is not scaled by a. With ``ref_compat`` a·g + (1 − a)·m is clipped to norm ``clip_norm`` before wd·x is
    added, Δ is the plain mean over the participants and K = E·|D_0|/B."""

    name = "fedcm"
    client_momentum: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.client_momentum) and 0 < self.client_momentum <= 1):
            raise ValueError(f"client_momentum must be in (0, 1], got {self.client_momentum}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        _no_momentum(self.name, ctx)
        super().setup(ctx, x0)
        self.momentum = torch.zeros_like(self.x)

    def broadcast_floats(self) -> int:
        return 2 * int(self.x.numel())

    def correction(self, t: int, ctx: FLContext) -> Terms:
        a, momentum = self.client_momentum, self.momentum

        def mix(g: torch.Tensor, step: Step) -> None:
            g.mul_(a).add_(momentum, alpha=1.0 - a)

        return mix

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        add_weighted_models(sums, updates)
        sums.add_scalar("steps", self.counted_steps(ctx, updates.steps).sum())
        sums.add_scalar("count", len(updates))

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        total, weight = sums.vector("model"), sums.scalar("weight")
        steps = sums.scalar("steps") / sums.scalar("count")
        if steps > 0:
            scale = 1.0 / (steps * ctx.lr(t))
            ops.weighted_sum([self.x, total], [scale, -scale / weight], out=self.momentum)
        server_average_(self.x, total, weight, self.server_lr)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "momentum": self.momentum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.momentum.copy_(state["momentum"])


@dataclass
class FedAdam(FedAvg):
    """FedAvg clients; the server applies Adam to the average update Δ = Σ p_i x_i − x:
    m ← β1·m + (1−β1)·Δ, v ← β2·v + (1−β2)·Δ², x ← x + η_g·m̂/(√v̂ + ε) (m̂ = m, v̂ = v unless bias_correction)."""

    name = "fedadam"
    server_lr: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3
    bias_correction: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        _check_positive("eps", self.eps)

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.m = torch.zeros_like(self.x)
        self.v = torch.zeros_like(self.x)
        self.steps = 0

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        delta = ops.weighted_sum([self.x, sums.vector("model")], [-1.0, 1.0 / sums.scalar("weight")])
        self.steps += 1
        self.m.mul_(self.beta1).add_(delta, alpha=1 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(delta, delta, value=1 - self.beta2)
        m_hat, v_hat = self.m, self.v
        if self.bias_correction:
            m_hat = self.m / (1 - self.beta1**self.steps)
            v_hat = self.v / (1 - self.beta2**self.steps)
        self.x.addcdiv_(m_hat, v_hat.sqrt().add_(self.eps), value=self.server_lr)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "m": self.m, "v": self.v, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.m.copy_(state["m"])
        self.v.copy_(state["v"])
        self.steps = int(state["steps"])
