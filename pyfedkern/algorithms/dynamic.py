"""Dynamic client arrival and departure: initial-model construction from gradient similarity (Chang et al.),
wrapped around any host FL algorithm, with the baselines Previous, Average and Continuous.

Training is cut into ``sessions`` of T rounds; the clients (and the labels they hold) change only at session
boundaries, which the server knows. With a ``groups:o,α`` partition, session s uses group s mod 2 (A, B, A, ...),
sets the engine's active clients to it and restricts evaluation to its labels.

Proposed (``method="proposed"``), with P pilot sessions, V footprint rounds and scale R:

- Pilot (s < P): train normally; w_pilot = mean of the pilot sessions' last global models.
- Footprint (every s >= P, before its first round): from w_pilot, V extra rounds of the host algorithm with the
  current clients (fresh host state, constant LR = ``footprint_lr``·η0); G_s = w_fp − w_pilot. Not counted in T.
- Initial model (s >= P + 1): α = softmax(−R·distance(G_s, G_z)) over the retained post-pilot sessions z, and
  w_s^init = Σ_z α_z·w_z^last (:func:`pyfedkern.ops.similarity_combine`, metric ``layer_l2`` by default: mean over
  the non-bias parameter tensors of the distance between unit-normalised tensors). At s = P the model restarts
  from ``first_init`` (the random initial model by default, as the authors' code does).
- Each session restarts the host's state (SCAFFOLD control variates, ...) and the LR schedule.

Baselines skip the pilot (their rounds in sessions < P do nothing) and restart from the random model at s = P:
Previous continues from the last global model; Average starts from the uniform mean of the retained post-pilot
sessions' last models; Continuous is Previous plus a distillation term κ·KL(softmax(teacher) ‖ softmax(student))
in the local objective, with the previous session's last model as the teacher.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pyfedkern import ops
from pyfedkern.algorithms.base import Algorithm, FLContext, RoundStats
from pyfedkern.algorithms.history import STORAGE_DTYPES, SessionHistory
from pyfedkern.data.spec import parse_flag
from pyfedkern.flat import FlatParameters
from pyfedkern.ops.similarity import METRICS

METHODS = ("proposed", "previous", "average", "continuous")
FIRST_INITS = ("random", "previous", "pilot")
# Footprint rounds draw their minibatches and clients from round keys far above any real round.
_FOOTPRINT_ROUND_KEY = 10**9


def parse_host_params(host: str, text: str) -> dict[str, Any]:
    """``"mu=1,server_lr=0.5"`` → keyword arguments of the host algorithm, typed like its fields' defaults."""
    from pyfedkern.algorithms import algorithm_class

    fields = algorithm_class(host).hyperparameters()
    params: dict[str, Any] = {}
    for pair in (p.strip() for p in text.split(",") if p.strip()):
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"host_params expects key=value pairs separated by commas, got {pair!r}")
        if key not in fields:
            raise ValueError(f"host {host!r} has no parameter {key!r}; its parameters: {', '.join(fields) or 'none'}")
        default = fields[key].default
        kind = type(default) if isinstance(default, (bool, int, float)) else str
        value = value.strip()
        if kind is bool:
            params[key] = parse_flag(value)
            if params[key] is None:
                raise ValueError(f"host_params: {key} must be true or false, got {value!r}")
            continue
        try:
            params[key] = kind(value)
        except ValueError:
            raise ValueError(f"host_params: {key} must be {_KIND_WORDS[kind]}, got {value!r}") from None
    return params


_KIND_WORDS = {int: "an integer", float: "a number", str: "a string"}


class SessionContext:
    """The engine's context seen from inside one session (or one footprint round).

    ``lr(t)`` restarts at the session's first round ``start``: η0·((1 − r)·(1 − τ/T)^0.9 + r)·base.lr(τ)/η0 with
    τ = t − start (the engine's schedule restarted, times the paper's polynomial decay when r < 1), or a constant
    when ``constant_lr`` is given. Minibatch and client-sampling streams are keyed by ``t + round_key`` so footprint
    rounds never reuse a training round's draws. ``local`` may be replaced (distillation). Everything else is the
    engine's.
    """

    def __init__(
        self,
        base: FLContext,
        start: int,
        rounds: int,
        lr_floor: float = 1.0,
        *,
        constant_lr: float | None = None,
        round_key: int = 0,
        local: Any = None,
    ) -> None:
        self._base = base
        self._start = start
        self._rounds = rounds
        self._lr_floor = lr_floor
        self._constant_lr = constant_lr
        self._round_key = round_key
        if local is not None:
            self.local = local

    def __getattr__(self, name: str) -> Any:
        return getattr(self._base, name)

    def lr(self, t: int) -> float:
        if self._constant_lr is not None:
            return self._constant_lr
        tau = t - self._start
        decay = (1.0 - self._lr_floor) * max(0.0, 1.0 - tau / self._rounds) ** 0.9 + self._lr_floor
        return self._base.lr(tau) * decay

    def batches(self, cid: int, t: int, **kwargs: Any):
        return self._base.batches(cid, t + self._round_key, **kwargs)

    def stacked_batches(self, clients: Any, t: int, **kwargs: Any) -> Any:
        return self._base.stacked_batches(clients, t + self._round_key, **kwargs)

    def sample_clients(self, t: int) -> np.ndarray:
        return self._base.sample_clients(t + self._round_key)

    def seed_model_randomness(self, t: int, *keys: int) -> None:
        self._base.seed_model_randomness(t + self._round_key, *keys)


class InitialModelBuilder:
    """The proposed method's server state across sessions and the initial model it builds for each session.

    Shared by :class:`DynamicInit` (simulation) and the Flower strategy
    (:class:`pyfedkern.integrations.flower.DynamicInit`); the driver runs the footprint rounds and reports models.
    Every vector is flat [d] like ``x0``.

    - :meth:`end_session` (s, w_s^last): a pilot session (s < P) adds w_s^last/P into ``pilot``; a later one stores
      (w_s^last, G_s) in ``store`` (a :class:`~pyfedkern.algorithms.history.SessionHistory` of ``capacity`` sessions).
    - :meth:`set_footprint` (w_fp): G_s = w_fp − w_pilot into ``query``.
    - :meth:`initial_model` (s, previous): x0 at s = 0, ``previous`` for the other pilot sessions, ``first_init`` at
      s = P, and Σ_z α_z·w_z^last with α = softmax(−scale·distance(G_s, G_z)) over the stored sessions after.
    """

    def __init__(
        self,
        x0: torch.Tensor,
        *,
        pilot_sessions: int,
        capacity: int,
        scale: float,
        metric: str,
        segments: np.ndarray,
        include: np.ndarray,
        storage: str = "float32",
        first_init: str = "random",
    ) -> None:
        _choice("first_init", first_init, FIRST_INITS)
        self.x0 = x0.clone()
        self.pilot_sessions = pilot_sessions
        self.scale, self.metric = scale, metric
        self.segments, self.include = segments, include
        if not self.include.any():  # a model of biases only: use every tensor
            self.include = np.ones_like(self.include)
        self.first_init = first_init
        d = x0.numel()
        self.store = SessionHistory(capacity, d, d, dtype=storage, device=x0.device)
        self.pilot = torch.zeros_like(x0)
        self.query = torch.zeros(d, dtype=STORAGE_DTYPES[storage], device=x0.device)
        self.last_alpha = np.zeros(0)

    def set_footprint(self, w_fp: torch.Tensor) -> None:
        """G_s = w_fp − w_pilot, the current session's footprint gradient."""
        self.query.copy_(ops.weighted_sum([w_fp.to(self.pilot.dtype), self.pilot], [1.0, -1.0]))

    def end_session(self, s: int, last: torch.Tensor) -> None:
        """Record session s's last global model: into the pilot mean (s < P) or the history with G_s."""
        if s < self.pilot_sessions:
            self.pilot.add_(last.to(self.pilot.dtype), alpha=1.0 / self.pilot_sessions)
        else:
            self.store.push(s, last, self.query)

    def initial_model(self, s: int, previous: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Session s's initial model (in x0's dtype) and what was decided ({} or candidates/alpha_max/init_session);
        ``previous`` is the last global model. For s > P, :meth:`set_footprint` must have been called first."""
        P = self.pilot_sessions
        if s < P:
            return (self.x0 if s == 0 else previous).clone(), {}
        if s == P:
            return {"random": self.x0, "previous": previous, "pilot": self.pilot}[self.first_init].clone(), {}
        init, alpha = ops.similarity_combine(
            self.query,
            self.store.grad_rows(),
            self.store.model_rows(),
            self.scale,
            self.metric,
            self.segments,
            self.include,
            return_weights=True,
        )
        alpha = alpha.detach().cpu().double().numpy()
        self.last_alpha = alpha
        sessions = self.store.session_ids()
        info = {
            "candidates": float(len(alpha)),
            "alpha_max": float(alpha.max()),
            "init_session": float(sessions[int(np.argmax(alpha))]),
        }
        return init.to(self.x0.dtype), info

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.store.state_dict(), "pilot": self.pilot, "query": self.query}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state["history"])
        self.pilot.copy_(state["pilot"])
        self.query.copy_(state["query"])


class DistillationLocal:
    """A LocalModel whose objective adds κ·KL(softmax(teacher(x)) ‖ softmax(student(x))) (Continuous baseline):
    :meth:`loss_and_grad` and :meth:`sgd_step_` on the loop, ``teacher`` and ``kd_weight`` on the batched path
    (:class:`~pyfedkern.algorithms.batched.BatchedLocal`)."""

    def __init__(self, local: Any, teacher: torch.Tensor, kd_weight: float) -> None:
        self._local = local
        self.kd_weight = kd_weight
        module = copy.deepcopy(local.module)
        self.teacher_flat = FlatParameters(module)  # its own flat buffers, detached from the student's
        self.teacher_flat.load_(teacher)
        self.teacher = module.eval()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local, name)

    def loss_and_grad(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Set ``flat.grad`` to the gradient of the objective plus κ·KL on one batch; return their value."""
        local = self._local
        local.module.train()
        local.flat.zero_grad()
        out = local.module(x)
        loss = local.objective(out, y)
        with torch.no_grad():
            target = F.log_softmax(self.teacher(x), dim=1)
        kd = F.kl_div(F.log_softmax(out, dim=1), target, log_target=True, reduction="batchmean")
        total = loss + self.kd_weight * kd
        total.backward()
        return float(total.detach())

    def sgd_step_(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        """One plain SGD step of the distillation objective on a batch (:meth:`loss_and_grad`, then
        p ← p − lr·∇p); returns the objective's value."""
        loss = self.loss_and_grad(x, y)
        self.flat.data.add_(self.flat.grad, alpha=-lr)
        return loss

    def private_loss_and_grad(self, dp: Any, x: torch.Tensor, y: torch.Tensor, key: tuple[int, ...]) -> float:
        """Refused, as on the batched path: DP-SGD's per-sample gradients leave out the distillation term."""
        raise ValueError("dpsgd: local DP-SGD with a distillation teacher is not supported")


def session_groups(ctx: FLContext) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
    """(client ids, labels) of each client group: the partition's groups, or one group of every client."""
    partition = ctx.partition
    groups = None if partition is None else partition.groups
    if groups is None:
        return [np.arange(ctx.num_clients, dtype=np.int64)], [None]
    groups = np.asarray(groups, dtype=np.int64)
    ids = sorted(set(groups.tolist()))
    labels = partition.group_labels
    return (
        [np.flatnonzero(groups == g).astype(np.int64) for g in ids],
        [None if labels is None else np.asarray(labels[g], dtype=np.int64) for g in ids],
    )


def transition_accuracy(metrics: list[dict[str, Any]], session_rounds: int, window: int = 10) -> dict[int, float]:
    """Mean test accuracy over the first ``window`` rounds of each session s >= 1 (the paper's metric), from an
    engine run's per-round records (record r is the model after round r). A window longer than a session is cut to
    the session, so it never reaches into the next one."""
    window = min(window, session_rounds)
    acc = {int(m["round"]): m["test_acc"] for m in metrics if "test_acc" in m and m["round"] > 0}
    out: dict[int, float] = {}
    for s in range(1, (max(acc, default=0)) // session_rounds + 1):
        values = [acc[r] for r in range(s * session_rounds + 1, s * session_rounds + window + 1) if r in acc]
        if values:
            out[s] = float(np.mean(values))
    return out


@dataclass
class DynamicInit(Algorithm):
    """Session-based training with initial models built from gradient similarity, or a baseline.

    Args:
        host: the FL algorithm run inside each session (any ALGORITHMS name except "dynamic").
        host_params: the host's hyper-parameters as "key=value,..." (e.g. "mu=1" for fedprox).
        method: "proposed", "previous", "average" or "continuous".
        sessions: number of sessions S, pilot included.
        session_rounds: rounds per session T (0: the engine's rounds / sessions).
        pilot_sessions: P (baselines skip these sessions).
        grad_rounds: footprint rounds V per session.
        scale: softmax scale R.
        metric: "layer_l2" (default), "l2" or "layer_cos".
        history: sessions kept as candidates (0: all post-pilot sessions).
        storage: "float32" or "bfloat16" storage of the history.
        first_init: initial model of session P: "random" (the authors' code), "previous" or "pilot".
        footprint_lr: footprint LR as a multiple of η0 (held constant).
        kd_weight: κ of the Continuous baseline's distillation term.
        lr_floor: r of the per-session polynomial decay ((1 − r)(1 − τ/T)^0.9 + r); 1 keeps the engine's schedule,
            restarted each session.
    """

    # its rounds (footprint rounds included) are its host's, which go through ctx.team; its own state (pilot mean,
    # history, teacher) is built from global models, the same on every process
    distributed = True

    name = "dynamic"
    host: str = "fedavg"
    host_params: str = ""
    method: str = "proposed"
    sessions: int = 6
    session_rounds: int = 0
    pilot_sessions: int = 1
    grad_rounds: int = 1
    scale: float = 10.0
    metric: str = "layer_l2"
    history: int = 0
    storage: str = "float32"
    first_init: str = "random"
    footprint_lr: float = 0.5
    kd_weight: float = 1.0
    lr_floor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.host == "dynamic":
            raise ValueError("host must be another algorithm than 'dynamic'")
        self._host_kwargs = parse_host_params(self.host, self.host_params)
        _choice("method", self.method, METHODS)
        _choice("metric", self.metric, tuple(METRICS))
        _choice("storage", self.storage, tuple(STORAGE_DTYPES))
        _choice("first_init", self.first_init, FIRST_INITS)
        for name, low in (("sessions", 1), ("session_rounds", 0), ("pilot_sessions", 0), ("grad_rounds", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.history, bool) or not isinstance(self.history, int) or self.history < 0:
            raise ValueError(f"history must be an integer >= 0 (0: keep every session), got {self.history!r}")
        if self.method == "proposed" and not 1 <= self.pilot_sessions < self.sessions:
            raise ValueError(
                f"pilot_sessions must be in [1, sessions - 1] = [1, {self.sessions - 1}], got {self.pilot_sessions}"
            )
        if self.pilot_sessions >= self.sessions:
            raise ValueError(f"pilot_sessions ({self.pilot_sessions}) must be < sessions ({self.sessions})")
        if not math.isfinite(self.scale):
            raise ValueError(f"scale must be finite, got {self.scale}")
        if not (math.isfinite(self.footprint_lr) and self.footprint_lr > 0):
            raise ValueError(f"footprint_lr must be finite and > 0, got {self.footprint_lr}")
        if not (math.isfinite(self.kd_weight) and self.kd_weight >= 0):
            raise ValueError(f"kd_weight must be finite and >= 0, got {self.kd_weight}")
        if not 0 <= self.lr_floor <= 1:
            raise ValueError(f"lr_floor must be in [0, 1], got {self.lr_floor}")

    # setup and state -------------------------------------------------------------------------------------

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        self.T = self.session_rounds or _rounds_per_session(ctx, self.sessions)
        self.x0 = x0.clone()
        self.host_algo = self.make_host()
        self.host_algo.setup(self.session_view(ctx, 0), x0)
        self.x = self.host_algo.x
        self.builder: InitialModelBuilder | None = None
        self.store: SessionHistory | None = None
        if self.method == "proposed":
            self.builder = self.make_builder(x0, ctx.local.flat.layout)
            self.store = self.builder.store
        elif self.method == "average":
            self.store = SessionHistory(self.history_capacity(), x0.numel(), dtype=self.storage, device=x0.device)
        self.teacher = torch.zeros_like(x0) if self.method == "continuous" else None
        self.has_teacher = False

    def make_host(self) -> Algorithm:
        """A fresh host algorithm with ``host_params``."""
        from pyfedkern.algorithms import make_algorithm

        return make_algorithm(self.host, **self._host_kwargs)

    def make_builder(self, x0: torch.Tensor, layout: Any) -> InitialModelBuilder:
        """The proposed method's state for a run from ``x0`` [d]; ``layout`` (a FlatLayout) gives the per-tensor
        segments of the similarity metric, biases excluded."""
        return InitialModelBuilder(
            x0,
            pilot_sessions=self.pilot_sessions,
            capacity=self.history_capacity(),
            scale=self.scale,
            metric=self.metric,
            segments=layout.segments(),
            include=layout.include_mask(),
            storage=self.storage,
            first_init=self.first_init,
        )

    def history_capacity(self) -> int:
        """Sessions kept as candidates: ``history``, or every post-pilot session but the last when 0."""
        return self.history or max(1, self.sessions - self.pilot_sessions - 1)

    def global_model(self) -> torch.Tensor:
        return self.host_algo.global_model()

    def broadcast_floats(self) -> int:
        return self.host_algo.broadcast_floats()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"host": self.host_algo.state_dict(), "has_teacher": self.has_teacher}
        if self.builder is not None:
            state.update(self.builder.state_dict())
        elif self.store is not None:
            state["history"] = self.store.state_dict()
        if self.teacher is not None:
            state["teacher"] = self.teacher
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.host_algo.load_state_dict(state["host"])
        self.has_teacher = bool(state["has_teacher"])
        if self.builder is not None:
            self.builder.load_state_dict(state)
        elif self.store is not None:
            self.store.load_state_dict(state["history"])
        if self.teacher is not None:
            self.teacher.copy_(state["teacher"])

    # rounds ----------------------------------------------------------------------------------------------

    def session_view(self, ctx: FLContext, start: int, local: Any = None) -> SessionContext:
        """The context of a session whose first round is ``start``: LR schedule restarted there (with the
        ``lr_floor`` decay over the session's rounds), the engine's minibatch streams."""
        rounds = self.session_rounds or _rounds_per_session(ctx, self.sessions)
        return SessionContext(ctx, start, rounds, self.lr_floor, local=local)

    def footprint_view(self, ctx: FLContext, session: int) -> SessionContext:
        """The context of session ``session``'s footprint rounds 0..V-1: constant LR ``footprint_lr``·η0 and
        minibatch/client streams keyed far above any training round (never a training round's draws)."""
        key = _FOOTPRINT_ROUND_KEY + session * self.grad_rounds
        return SessionContext(ctx, 0, 1, constant_lr=self.footprint_lr * ctx.lr(0), round_key=key)

    def node_round(self, ctx: FLContext, t: int, settings: dict[str, Any]) -> tuple[Algorithm, FLContext, int]:
        """A Flower node's round: a fresh host in footprint round ``footprint-round`` of ``session`` (its own LR
        and minibatches), else in the session that began at server round ``session-start`` (LR restarted there)."""
        if "footprint-round" in settings:
            return (
                self.make_host(),
                self.footprint_view(ctx, int(settings["session"])),
                int(settings["footprint-round"]),
            )
        return self.make_host(), self.session_view(ctx, int(settings.get("session-start", 1)) - 1), t

    def _skipped(self, session: int) -> bool:
        """Baselines do not run the pilot sessions."""
        return self.method != "proposed" and session < self.pilot_sessions

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        s, r = divmod(t, self.T)
        if s >= self.sessions:
            raise ValueError(f"round {t} is past the last session ({self.sessions} sessions of {self.T} rounds)")
        extras: dict[str, float] = {"session": float(s), "session_round": float(r)}
        if r == 0:
            extras.update(self._start_session(s, t, ctx))
        if self._skipped(s):
            return RoundStats(np.zeros(0, dtype=np.int64), float("nan"), 0, 0, extras)
        local = None
        if self.method == "continuous" and self.has_teacher and self.kd_weight > 0:
            local = DistillationLocal(ctx.local, self.teacher, self.kd_weight)
        stats = self.host_algo.round(t, self.session_view(ctx, s * self.T, local))
        if r == self.T - 1:
            self._end_session(s)
        stats.extras.update(extras)
        return stats

    def _start_session(self, s: int, t: int, ctx: FLContext) -> dict[str, float]:
        groups, labels = session_groups(ctx)
        g = s % len(groups)
        ctx.active_clients = groups[g]
        ctx.eval_labels = labels[g]
        extras: dict[str, float] = {"group": float(g)}
        if self._skipped(s):
            return extras
        if self.method == "proposed":
            if s >= self.pilot_sessions:
                self.builder.set_footprint(self._footprint(s, ctx))
            with ctx.timer("aggregation"):
                init, info = self.builder.initial_model(s, self.host_algo.x)
            extras.update(info)
        elif s == self.pilot_sessions:
            init = self.x0
        elif self.method == "average":
            rows = self.store.model_rows()
            init = ops.weighted_sum(rows, np.full(len(rows), 1.0 / len(rows)))
        else:  # previous, continuous
            init = self.host_algo.x
        self.host_algo.setup(self.session_view(ctx, t), init.to(self.x0.dtype))
        self.x = self.host_algo.x
        return extras

    def _footprint(self, s: int, ctx: FLContext) -> torch.Tensor:
        """w_fp: V host rounds with the current clients from w_pilot, with fresh host state."""
        view = self.footprint_view(ctx, s)
        runner = self.make_host()
        runner.setup(view, self.builder.pilot)
        for v in range(self.grad_rounds):
            runner.round(v, view)
        return runner.global_model()

    def _end_session(self, s: int) -> None:
        x = self.host_algo.global_model()
        if self.builder is not None:
            self.builder.end_session(s, x)
        elif self.method == "average":
            self.store.push(s, x)
        elif self.method == "continuous":
            self.teacher.copy_(x)
            self.has_teacher = True


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def _rounds_per_session(ctx: FLContext, sessions: int) -> int:
    rounds = ctx.rounds
    if rounds is None:
        raise ValueError("session_rounds must be set when the context has no rounds")
    if rounds % sessions:
        raise ValueError(f"rounds ({rounds}) must be a multiple of sessions ({sessions}), or set session_rounds")
    return rounds // sessions
