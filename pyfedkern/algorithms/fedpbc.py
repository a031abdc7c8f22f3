"""FedPBC (Xiang, Ioannidis, Yeh, Joe-Wong, Su 2024) and the baselines it is compared with under unreliable uplinks.

In round t the uplink of client i is ON with probability p_i^t (a :class:`~pyfedkern.links.LinkModel`); A^t is
the set of ON links. The downlink never fails.

- ``fedpbc`` (:class:`FedPBC`): every client keeps its own model x_i and trains it every round, ON or OFF; the
  server averages the models of A^t and sends the average back to A^t only (postponed broadcast,
  :func:`pyfedkern.ops.pbc_agg_bcast_`). Clients whose link is OFF keep their progress.
- ``fedavg-links`` (:class:`FedAvgLinks`): every client starts from x^t; x += η_g·(1/|A|)·Σ_A Δ_i.
- ``fedavg-all`` (:class:`FedAvgAll`): x += η_g·(1/m)·Σ_A Δ_i (OFF clients count as zero updates).
- ``fedavg-known-p`` (:class:`FedAvgKnownP`): x += η_g·(1/m)·Σ_A Δ_i/p_i^t (unbiased when p is known).
- ``fedau`` (:class:`FedAU`): x += η_g·(1/m)·Σ_A ω_i·Δ_i with ω_i the mean of client i's past participation
  intervals, each capped at K (Wang & Ji 2023).
- ``mifa`` (:class:`MIFA`): the server remembers every client's latest Δ_i; x += η_g·(1/m)·Σ_{all i} U_i
  (Gu et al. 2021), with a running sum re-summed every ``resum_every`` rounds (:func:`pyfedkern.ops.mifa_update_`).

Baseline update rules follow the FedAU authors' code (docs/fedpbc.md §3). All methods use the
engine's local SGD settings (``--local-steps``, ``--lr``, ``--lr-schedule invsqrt:10`` for the paper's
η_t = η_0/√(t/10 + 1), ``--batch-size``); participation is decided by the links, so ``--fraction`` is not used.
Under a session schedule that changes which clients exist (``ctx.active_clients``, set by the ``dynamic``
wrapper), only those clients train and report, and m is their number: FedAvg-all, known p, FedAU and MIFA divide by
it, FedAU counts participation intervals of those clients only, and MIFA drops the stored update of a client that has
left (its sum runs over the current clients). Without a schedule every client exists.
Link options (fields of every class here): ``--links`` pattern, ``--gamma``, ``--period``, ``--cycle-length``,
``--sigma0``, ``--delta`` (the log-normal class-mix construction of p_i from each client's label histogram) or
``--link-probs p0,p1,...`` (explicit probabilities for equal contiguous groups of clients). The clients train as
batched steps (:mod:`pyfedkern.algorithms.batched`, in chunks that fit memory) unless the engine's ``--batched false``
asks for a loop over clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.base import (
    Algorithm,
    ClientStore,
    ClientUpdates,
    FLContext,
    RoundStats,
    RoundSums,
    mean_loss,
    owned_clients,
)
from pyfedkern.algorithms.batched import client_chunks
from pyfedkern.algorithms.looped import local_sgd_rows_

_LINK_SEED = 811  # purpose key of the link model's seed stream


def client_class_histograms(ctx: FLContext) -> np.ndarray:
    """[m, C] label counts of every client, from the context's ``client_y`` and ``data.num_classes``.

    ValueError when the context has no integer class labels (pass explicit ``link_probs`` then).
    """
    labels = ctx.client_y
    num_classes = None if ctx.data is None else ctx.data.num_classes
    if labels is None or not num_classes:
        raise ValueError(
            "the log-normal link probabilities need per-client class labels (ctx.client_y, ctx.data.num_classes); "
            "set link_probs (--link-probs p0,p1,...) instead"
        )
    hist = np.zeros((len(labels), int(num_classes)))
    for i, y in enumerate(labels):
        if torch.is_floating_point(y):
            raise ValueError("the log-normal link probabilities need integer class labels; set link_probs instead")
        hist[i] = np.bincount(y.detach().cpu().numpy().astype(np.int64), minlength=int(num_classes))
    return hist


@dataclass
class _LinkAlgorithm(Algorithm):
    """Shared link configuration and helpers of FedPBC and its baselines.

    Args:
        links: link pattern (bernoulli | bernoulli-tv | markov | markov-tv | cyclic | cyclic-reset).
        gamma: amplitude γ < 0.5 of the time variation p_i·[(1−γ) + γ·sin(2πt/P)] (``-tv`` patterns).
        period: P, rounds per period of the time variation.
        cycle_length: L, rounds per cycle of the cyclic patterns.
        sigma0: σ0 of the log-normal class weights used to derive p_i from label histograms.
        delta: floor δ of every p_i.
        link_probs: explicit probabilities instead (m values, or g values for g equal contiguous client groups).
    """

    local_dp = True
    links: str = "bernoulli"
    gamma: float = 0.3
    period: int = 40
    cycle_length: int = 100
    sigma0: float = 10.0
    delta: float = 0.02
    link_probs: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        from pyfedkern.links import PATTERNS, TIME_VARYING, check_gamma

        super().__post_init__()
        if self.links not in PATTERNS:
            raise ValueError(f"unknown link pattern {self.links!r}; valid choices: {', '.join(PATTERNS)}")
        if self.links in TIME_VARYING:
            check_gamma(self.gamma, None if self.link_probs else self.delta)
        if not (math.isfinite(self.sigma0) and self.sigma0 >= 0):
            raise ValueError(f"sigma0 must be finite and >= 0, got {self.sigma0}")
        if not (math.isfinite(self.delta) and 0 < self.delta <= 1):
            raise ValueError(f"delta must be in (0, 1], got {self.delta}")
        for name in ("period", "cycle_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.link_probs, (int, float)):
            self.link_probs = (float(self.link_probs),)
        self.link_probs = tuple(float(p) for p in self.link_probs)
        if any(not (0 < p <= 1) for p in self.link_probs):
            raise ValueError(f"link_probs must lie in (0, 1], got {self.link_probs}")

    def setup_links(self, ctx: FLContext) -> None:
        """Build the link model (seeded from ctx.rng)."""
        from pyfedkern.links import make_links

        seed = int(ctx.rng(_LINK_SEED).integers(2**62))
        self.link_model = make_links(
            self.links,
            ctx.num_clients,
            probs=self.link_probs or None,
            class_dist=None if self.link_probs else client_class_histograms(ctx),
            sigma0=self.sigma0,
            delta=self.delta,
            gamma=self.gamma,
            period=self.period,
            cycle_length=self.cycle_length,
            seed=seed,
        )

    @staticmethod
    def present_clients(ctx: FLContext) -> np.ndarray:
        """Sorted int64 ids of the clients that exist this round: ``ctx.active_clients`` when the context has it
        (a session schedule may restrict it), else all m."""
        present = ctx.active_clients
        if present is None:
            return np.arange(ctx.num_clients, dtype=np.int64)
        return np.unique(np.asarray(present, dtype=np.int64))

    def uplinks(self, t: int, present: np.ndarray) -> np.ndarray:
        """A^t: the present clients whose uplink is ON in round t (sorted int64 ids)."""
        return np.intersect1d(self.link_model.active_indices(t), present, assume_unique=True)

    def train_(self, ctx: FLContext, t: int, models: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """Local SGD of ``clients`` from the rows of ``models`` (in place, in chunks that fit memory,
        :func:`~pyfedkern.algorithms.looped.local_sgd_rows_`); returns the per-client mean losses, float64 [k] on
        the device."""
        with ctx.timer("local"):
            losses = torch.empty(len(clients), dtype=torch.float64, device=models.device)
            for rows in client_chunks(ctx, np.arange(len(clients)), 0):
                a, b = int(rows[0]), int(rows[-1]) + 1
                losses[a:b] = local_sgd_rows_(ctx, t, models[a:b], clients[a:b])
            return losses


@dataclass
class FedPBC(_LinkAlgorithm):
    """FedPBC: all clients train from their own models; the ON clients' average goes to the server and back to them.

    ``global_model()`` is the server model x^t (the paper's x_PS); ``mean_model()`` is x̄^t, the mean of all client
    models, which the theory covers. Each round logs ``active`` (|A^t|) and ``consensus_dist`` = ‖x^t − x̄^t‖₂.
    Spread over processes (``ctx.team``), each process keeps and trains the models of the clients it owns, and the
    processes add up their sums of the ON clients' models (for x^t) and of the OFF ones (for x̄^t).
    """

    name = "fedpbc"
    distributed = True  # its round goes through ctx.team

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.setup_links(ctx)
        self.clients = ClientStore(
            ctx.num_clients, x0.numel(), device=x0.device, dtype=x0.dtype, owned=owned_clients(ctx)
        )
        self.clients.data.copy_(x0.expand_as(self.clients.data))
        self.present: np.ndarray | None = None
        # spread over processes, x̄^t is combined each round (no process holds every x_i)
        self.team_mean = x0.clone() if ctx.team.size > 1 else None

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        present = self.present_clients(ctx)
        self.present = present
        team = ctx.team
        if team.size > 1:
            return self.shared_round(t, ctx, team, present)
        store = self.clients.data
        if len(present) == store.shape[0]:
            losses = self.train_(ctx, t, store, present)
        else:  # clients that have left neither train nor report
            index = torch.as_tensor(present, device=store.device)
            models = store.index_select(0, index)
            losses = self.train_(ctx, t, models, present)
            store.index_copy_(0, index, models)
        active = self.uplinks(t, present)
        with ctx.timer("aggregation"):
            ops.pbc_agg_bcast_(store, self.x, active)
        d = int(self.x.numel())
        gap = float(torch.linalg.vector_norm(self.x - self.mean_model()))
        return RoundStats(
            clients=active,
            local_loss=mean_loss(losses),
            upload_floats=len(active) * d,
            download_floats=len(active) * d,
            extras={"active": float(len(active)), "consensus_dist": gap},
        )

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        """``clients`` train from their own models x_i (:func:`~pyfedkern.algorithms.looped.local_sgd_rows_`), keep
        them and upload them (weights 1): a Flower node's update. :meth:`round` trains the store's rows in place."""
        clients = np.asarray(clients, dtype=np.int64).reshape(-1)
        rows = self.clients.rows(clients)
        models = self.clients.data.index_select(0, rows)
        losses = self.train_(ctx, t, models, clients)
        self.clients.data.index_copy_(0, rows, models)
        steps = ctx.planned_steps(clients)
        return ClientUpdates(clients, np.ones(len(clients)), {"model": models}, losses, steps)

    def node_receive(self, cid: int, settings: dict[str, Any], restored: bool) -> None:
        """A node whose uplink was ON (``pbc-adopt``, the default) adopts the server's model; otherwise it keeps the
        model it trained (set up from the server's model when it has none)."""
        if restored and settings.get("pbc-adopt", True):
            self.clients[cid].copy_(self.x)

    def shared_round(self, t: int, ctx: FLContext, team: Any, present: np.ndarray) -> RoundStats:
        """The round spread over processes (``ctx.team``, :mod:`pyfedkern.sim.distributed`): this process trains
        its own present clients, the team adds up Σ_{A^t} x_i and Σ_{present∖A^t} x_i over every process, and every
        process sets x^t = Σ_{A^t} x_i / |A^t| and broadcasts it to its own ON clients."""
        mine = team.mine(present)
        rows = self.clients.rows(mine)
        models = self.clients.data.index_select(0, rows)
        losses = self.train_(ctx, t, models, mine)
        active = self.uplinks(t, present)
        with ctx.timer("aggregation"):
            on = np.isin(mine, active)
            sums = RoundSums()
            for name, part in (("on", on), ("off", ~on)):
                if part.any():
                    sums.add(name, models[torch.as_tensor(part, device=models.device)], np.ones(int(part.sum())))
            sums, losses, _ = team.combine(t, sums, [losses], 0)
            if len(active):
                self.x.copy_(sums.vector("on")).mul_(1.0 / len(active))
                models[torch.as_tensor(on, device=models.device)] = self.x
            self.clients.data.index_copy_(0, rows, models)
            off = sums.vector("off")
            total = self.x * len(active) if off is None else ops.weighted_sum([off, self.x], [1.0, len(active)])
            self.team_mean = total.mul_(1.0 / max(len(present), 1))
        d = int(self.x.numel())
        return RoundStats(
            clients=active,
            local_loss=mean_loss(losses),
            upload_floats=len(active) * d,
            download_floats=len(active) * d,
            extras={
                "active": float(len(active)),
                "consensus_dist": float(torch.linalg.vector_norm(self.x - self.team_mean)),
            },
        )

    def mean_model(self) -> torch.Tensor:
        """x̄^t = (1/m)·Σ_i x_i^t over the clients present in the last round (all before the first), [d]. Spread over
        processes: the x̄^t combined in the last round."""
        if self.team_mean is not None:
            return self.team_mean
        if self.present is None or len(self.present) == self.clients.data.shape[0]:
            return self.clients.mean()
        return self.clients.data[torch.as_tensor(self.present, device=self.x.device)].mean(0)

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "clients": self.clients.data}
        if self.team_mean is not None:
            state["team_mean"] = self.team_mean
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.clients.data.copy_(state["clients"])
        if self.team_mean is not None:
            self.team_mean = state["team_mean"].to(self.x.device).clone()


@dataclass
class FedAvgLinks(_LinkAlgorithm):
    """FedAvg under unreliable uplinks: every client starts from x^t, the ON clients' updates are averaged.

    x ← x + η_g·(scale)·Σ_A w_i·(x_i^{t⋆} − x) with scale = 1/|A| and w_i = 1 (subclasses change scale and w).
    Only the ON clients are simulated (the OFF clients' work would be discarded).

    Args:
        server_lr: η_g.
    """

    name = "fedavg-links"
    distributed = True  # its round spreads over processes (shared_update)
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"server_lr must be finite and > 0, got {self.server_lr}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        self.setup_links(ctx)
        self.present = np.arange(ctx.num_clients, dtype=np.int64)

    def weights(self, t: int, active: np.ndarray) -> tuple[np.ndarray, float]:
        """(w_i for the ON clients, scale) of round t; ``self.present`` holds the clients that exist."""
        return np.ones(len(active)), 1.0 / max(len(active), 1)

    def after_round(self, t: int, active: np.ndarray) -> None:
        """Update per-client bookkeeping once round t's links are known (FedAU's interval counters)."""

    def local_models(self, ctx: FLContext, t: int, active: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        models = self.x.unsqueeze(0).repeat(len(active), 1)
        return models, self.train_(ctx, t, models, active)

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        self.present = self.present_clients(ctx)
        active = self.uplinks(t, self.present)
        team = ctx.team
        if team.size == 1:
            models, losses = self.local_models(ctx, t, active)
            with ctx.timer("aggregation"):
                self.server_update(t, active, models)
        else:  # each process trains the ON clients it owns; the processes combine Σ w_i·Δ_i
            losses = self.shared_update(t, ctx, team, active)
        self.after_round(t, active)
        d = int(self.x.numel())
        return RoundStats(
            clients=active,
            local_loss=mean_loss(losses),
            upload_floats=len(active) * d,
            download_floats=len(self.present) * d,
            extras={"active": float(len(active))},
        )

    def server_update(self, t: int, active: np.ndarray, models: torch.Tensor) -> None:
        if len(active) == 0:
            return
        w, scale = self.weights(t, active)
        ops.weighted_delta_(self.x, models, w, self.server_lr * scale)

    def shared_update(self, t: int, ctx: FLContext, team: Any, active: np.ndarray) -> torch.Tensor:
        """``server_update`` of a round spread over processes (``ctx.team``, :mod:`pyfedkern.sim.distributed`):
        this process trains its own ON clients, the team adds up Σ w_i·(x_i − x) over all of them, every process
        takes the step; returns every ON client's loss."""
        mine = team.mine(active)
        models, losses = self.local_models(ctx, t, mine)
        with ctx.timer("aggregation"):
            w, scale = self.weights(t, active)
            sums = RoundSums()
            if len(mine):
                sums.add("delta", models.sub_(self.x), w[np.isin(active, mine)])
            sums, losses, _ = team.combine(t, sums, [losses], 0)
            if len(active):
                ops.weighted_sum([self.x, sums.vector("delta")], [1.0, self.server_lr * scale], out=self.x)
        return losses[0]


@dataclass
class FedAvgAll(FedAvgLinks):
    """FedAvg-all: x ← x + η_g·(1/m)·Σ_A Δ_i (OFF clients count as zero updates)."""

    name = "fedavg-all"

    def weights(self, t: int, active: np.ndarray) -> tuple[np.ndarray, float]:
        return np.ones(len(active)), 1.0 / max(len(self.present), 1)


@dataclass
class FedAvgKnownP(FedAvgLinks):
    """FedAvg with known link probabilities: x ← x + η_g·(1/m)·Σ_A Δ_i / p_i^t (cyclic: p_i = ON rounds / L)."""

    name = "fedavg-known-p"

    def weights(self, t: int, active: np.ndarray) -> tuple[np.ndarray, float]:
        return 1.0 / self.link_model.prob(t)[active], 1.0 / max(len(self.present), 1)


@dataclass
class FedAU(FedAvgLinks):
    """FedAU: x ← x + η_g·(1/m)·Σ_A ω_i·Δ_i, ω_i = mean of client i's recorded participation intervals (1 if none).

    Each client counts rounds since its last report: on a report the interval count+1 is recorded and the count
    resets; otherwise the count grows and, on reaching K, K is recorded and the count resets. ω_i of round t uses the
    intervals recorded before round t.

    Args:
        cutoff: K, the interval cap.
    """

    name = "fedau"
    cutoff: int = 50

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.cutoff, bool) or not isinstance(self.cutoff, int) or self.cutoff < 1:
            raise ValueError(f"cutoff must be an integer >= 1, got {self.cutoff!r}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        m = ctx.num_clients
        self.counter = np.zeros(m, dtype=np.int64)
        self.interval_sum = np.zeros(m, dtype=np.float64)
        self.interval_count = np.zeros(m, dtype=np.int64)

    def omega(self) -> np.ndarray:
        """ω_i for every client from the intervals recorded so far, [m]."""
        return np.where(self.interval_count > 0, self.interval_sum / np.maximum(self.interval_count, 1), 1.0)

    def weights(self, t: int, active: np.ndarray) -> tuple[np.ndarray, float]:
        return self.omega()[active], 1.0 / max(len(self.present), 1)

    def after_round(self, t: int, active: np.ndarray) -> None:
        on = np.zeros(len(self.counter), dtype=bool)
        on[active] = True
        waiting = np.zeros_like(on)
        waiting[self.present] = True
        waiting &= ~on  # clients that have left are not counted
        self.counter[waiting] += 1
        record = on | (waiting & (self.counter >= self.cutoff))
        self.interval_sum[record] += np.where(on, self.counter + 1, self.cutoff)[record]
        self.interval_count[record] += 1
        self.counter[record] = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "counter": self.counter.copy(),
            "interval_sum": self.interval_sum.copy(),
            "interval_count": self.interval_count.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.counter[:] = np.asarray(state["counter"])
        self.interval_sum[:] = np.asarray(state["interval_sum"])
        self.interval_count[:] = np.asarray(state["interval_count"])


@dataclass
class MIFA(FedAvgLinks):
    """MIFA: the server keeps U_i, the latest Δ_i of every client (0 until its first report);
    x ← x + η_g·(1/m)·Σ_{i=1..m} U_i every round, stale entries included (raw Δ, as the FedAU reference code).
    The sum and m run over the present clients; a client that leaves has its U_i dropped. Spread over processes
    (``ctx.team``), each process keeps the U_i of the clients it owns and the running sum of those, and the processes
    add up their running sums for the step.

    Args:
        resum_every: re-sum the running Σ U_i from all m rows every this many rounds (float32 drift).
    """

    name = "mifa"
    resum_every: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.resum_every, bool) or not isinstance(self.resum_every, int) or self.resum_every < 1:
            raise ValueError(f"resum_every must be an integer >= 1, got {self.resum_every!r}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        owned = owned_clients(ctx)
        self.memory = ClientStore(ctx.num_clients, x0.numel(), device=x0.device, dtype=x0.dtype, owned=owned)
        self.held = np.arange(ctx.num_clients, dtype=np.int64) if owned is None else owned  # the clients of memory
        self.total = torch.zeros_like(self.x)  # Σ U_i over the clients of memory
        self.checked_present: np.ndarray | None = None  # the client set whose departures were last dropped

    def drop_departed(self) -> bool:
        """Zero the memory of clients that are no longer present (once per change of the client set); True when a
        non-zero row was dropped, so the running sum must be re-summed."""
        if self.checked_present is not None and np.array_equal(self.checked_present, self.present):
            return False
        self.checked_present = self.present
        gone = np.setdiff1d(self.held, self.present)
        if gone.size == 0:
            return False
        gone = self.memory.rows(gone)
        rows = self.memory.data.index_select(0, gone)
        if not bool(rows.any()):
            return False
        self.memory.data.index_fill_(0, gone, 0.0)
        return True

    def server_update(self, t: int, active: np.ndarray, models: torch.Tensor) -> None:
        updates = models if len(active) else []
        resum = self.drop_departed() or (t + 1) % self.resum_every == 0
        # the op divides the sum by all memory rows; the average runs over the present clients
        lr = self.server_lr * (self.memory.data.shape[0] / max(len(self.present), 1))
        ops.mifa_update_(self.x, self.memory.data, self.total, updates, active, lr, resum=resum)

    def shared_update(self, t: int, ctx: FLContext, team: Any, active: np.ndarray) -> torch.Tensor:
        """The step of a round spread over processes (``ctx.team``): this process trains its own ON clients and
        updates their U_i and its running Σ U_i (re-summed from its rows when due), the team adds up the processes'
        sums, every process takes the step; returns every ON client's loss."""
        mine = team.mine(active)
        models, losses = self.local_models(ctx, t, mine)
        with ctx.timer("aggregation"):
            resum = self.drop_departed() or (t + 1) % self.resum_every == 0
            if len(mine):
                rows = self.memory.rows(mine)
                deltas = models.sub_(self.x)
                ones = np.ones(len(mine))
                stale = ops.weighted_sum(self.memory.data.index_select(0, rows), ones)
                ops.weighted_sum([self.total, ops.weighted_sum(deltas, ones), stale], [1.0, 1.0, -1.0], out=self.total)
                self.memory.data.index_copy_(0, rows, deltas)
            if resum and len(self.held):
                ops.weighted_sum(self.memory.data, np.ones(len(self.held)), out=self.total)
            sums = RoundSums()
            sums.vectors["total"] = self.total
            sums, losses, _ = team.combine(t, sums, [losses], 0)
            lr = self.server_lr / max(len(self.present), 1)
            ops.weighted_sum([self.x, sums.vector("total")], [1.0, lr], out=self.x)
        return losses[0]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "memory": self.memory.data, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.memory.data.copy_(state["memory"])
        self.total.copy_(state["total"])
