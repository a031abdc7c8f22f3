"""The algorithm interface shared by every FL method in pyfedkern, and the pieces they are built from.

An :class:`Algorithm` owns the server state (the global model as one flat vector, per-client state in a
:class:`ClientStore`) and implements one round as ``participants`` → local updates → ``server_step``. Its client
side is one method, :meth:`Algorithm.client_update`, written against rows of clients (their models the rows of one
[k, d] tensor): it trains through :func:`~pyfedkern.algorithms.looped.local_run`, which runs the rows as batched
steps (:mod:`pyfedkern.algorithms.batched`) or one client after another (:mod:`pyfedkern.algorithms.looped`), so the
engine's two paths, each process of a distributed run, a Flower client and a user's own loop (k = 1) run the same
definition. The updates arrive as :class:`~pyfedkern.algorithms.ClientUpdates` (stacked messages), possibly in
several chunks of participants (memory), and the server folds each chunk into a
:class:`~pyfedkern.algorithms.RoundSums` (:meth:`Algorithm.accumulate`) before finishing the round
(:meth:`Algorithm.server_step`). Methods with a different round shape (FedPBC trains every client, FNR-FL has a
second phase, FedSpeed keeps a running Σ h_i) override :meth:`Algorithm.round` and still train through their
:meth:`Algorithm.client_update`. Algorithms never import :mod:`pyfedkern.sim` (the engine): everything they need
from their environment comes through an :class:`~pyfedkern.algorithms.FLContext`
(:mod:`pyfedkern.algorithms.context`), which the simulation engine is and a user's own loop (or a Flower client)
subclasses.

Every piece of mutable state that affects later rounds must be returned by ``state_dict`` so a checkpointed run
resumes bit for bit; randomness is drawn from ``ctx.rng(...)`` streams keyed by (seed, round, client, purpose),
never from a shared generator.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.attacks import ATTACK_STREAM, Attack, parse_attack
from pyfedkern.algorithms.batched import client_chunks
from pyfedkern.algorithms.context import ClientUpdates, FLContext, RoundSums
from pyfedkern.algorithms.robust import Aggregator, parse_aggregator

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RoundStats:
    """What a round reports to the engine: mean local loss, participants, traffic (floats), extra metrics (numbers,
    or lists of numbers such as the attacking clients' ids)."""

    clients: np.ndarray
    local_loss: float
    upload_floats: int
    download_floats: int
    extras: dict[str, Any] = field(default_factory=dict)


class ClientStore:
    """Per-client state as one [m, d] tensor (zero until written): SCAFFOLD c_i, FedSpeed h_i, FedPBC x_i, ...

    One buffer instead of a Python object per client, so thousands of clients cost one allocation. With ``owned``
    (the clients of one process in a distributed run, :func:`~pyfedkern.algorithms.base.owned_clients`) it holds only
    their rows; rows are addressed by client id either way (:meth:`rows`, :meth:`take`, :meth:`add_`, :meth:`put_`).
    """

    def __init__(
        self,
        num_clients: int,
        dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        owned: np.ndarray | None = None,
    ) -> None:
        if num_clients < 1 or dim < 1:
            raise ValueError(f"ClientStore needs num_clients >= 1 and dim >= 1, got {num_clients} and {dim}")
        self._row: np.ndarray | None = None
        rows = num_clients
        if owned is not None:
            owned = np.asarray(owned, dtype=np.int64).reshape(-1)
            if owned.size and (owned.min() < 0 or owned.max() >= num_clients or np.unique(owned).size != owned.size):
                raise ValueError(f"owned must be distinct client ids in 0..{num_clients - 1}")
            self._row = np.full(num_clients, -1, dtype=np.int64)
            self._row[owned] = np.arange(owned.size)
            rows = owned.size
        self.data = torch.zeros(rows, dim, device=device, dtype=dtype)

    def rows(self, clients: np.ndarray) -> torch.Tensor:
        """The rows of ``data`` holding ``clients`` (int64 ids), an index tensor on the store's device."""
        clients = np.asarray(clients, dtype=np.int64)
        if self._row is not None:
            found = self._row[clients]
            if np.any(found < 0):
                raise ValueError(f"clients {clients[found < 0].tolist()} are not held by this store (another rank's)")
            clients = found
        return torch.as_tensor(clients, device=self.data.device)

    def take(self, clients: np.ndarray) -> torch.Tensor:
        """The rows of ``clients``, [k, d] (a copy)."""
        return self.data.index_select(0, self.rows(clients))

    def add_(self, clients: np.ndarray, values: torch.Tensor) -> None:
        """Row of clients[r] += values[r]."""
        self.data.index_add_(0, self.rows(clients), values)

    def put_(self, clients: np.ndarray, values: torch.Tensor) -> None:
        """Row of clients[r] = values[r]."""
        self.data.index_copy_(0, self.rows(clients), values)

    def __getitem__(self, cid: int) -> torch.Tensor:
        """Client cid's row (a view: writes go to the store)."""
        return self.data[int(self.rows(np.array([cid]))[0])]

    def mean(self) -> torch.Tensor:
        """The unweighted mean over the rows held, [d]."""
        return ops.weighted_sum(self.data, np.full(self.data.shape[0], 1.0 / self.data.shape[0]))


def owned_clients(ctx: FLContext) -> np.ndarray | None:
    """The clients whose state this process keeps: its own in a distributed run, else None (all). Call it where the
    client state is allocated: from then on every process trains the participants it owns
    (:meth:`~pyfedkern.algorithms.context.Team.keep_client_state`)."""
    return ctx.team.keep_client_state()


#: The largest finite float32: a larger factor (learning rate, coefficient) cannot multiply a float32 model.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


#: Field annotation → (what the error says, the check) of :meth:`Algorithm.__post_init__`.
_HYPERPARAMETER_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "bool": ("a bool (True or False)", lambda v: isinstance(v, (bool, np.bool_))),
    "int": ("an integer", lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))),
    "float": ("a real number", _is_real),
    "str": ("a string", lambda v: isinstance(v, str)),
    "tuple[float, ...]": (
        "a sequence of real numbers",
        lambda v: isinstance(v, (tuple, list, np.ndarray)) and all(_is_real(x) for x in np.asarray(v).ravel().tolist()),
    ),
}


def check_model_vector(x: Any, like: torch.Tensor, name: str) -> None:
    """Refuse ``x`` unless it is a torch tensor of as many values as ``like`` (the model's flat parameters), with its
    dtype and device."""
    what = f"the model's {like.numel()} parameters ({like.dtype}, {like.device})"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor of {what}, got {type(x).__qualname__}")
    if x.numel() != like.numel() or x.dtype != like.dtype or x.device != like.device:
        raise ValueError(f"{name} must hold {what}, got {x.numel()} values ({x.dtype}, {x.device})")


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
    ``--field-name``), set ``name``, and implement :meth:`client_update` (the updates of rows of clients),
    :meth:`accumulate` and :meth:`server_step`, or override ``round``. ``setup`` receives the context and the
    initial model vector.
    """

    name: ClassVar[str] = ""
    #: Samples per class the engine must hold out of the training data as a labelled public set (FNR-FL).
    public_per_class: ClassVar[int] = 0
    #: Whether rounds can be spread over processes (:mod:`pyfedkern.sim.distributed`), true for
    #: :meth:`Algorithm.round <pyfedkern.algorithms.base.Algorithm.round>` (the participants' updates, then the
    #: server step on their sums) when client state lives in a :class:`~pyfedkern.algorithms.base.ClientStore` made
    #: with ``owned=owned_clients(ctx)``. A subclass that overrides ``round`` must set it again itself (True when its
    #: round still goes through ``ctx.team``), else it runs in one process only.
    distributed: ClassVar[bool] = True
    #: The uploaded vectors whose server step is a weighted mean, ``sums.vector(name) / sums.scalar("weight")``: a
    #: robust aggregator (``ctx.aggregator``) replaces that mean by its rule, and an attack (``ctx.attack``) replaces
    #: the attackers' rows of them (``round``). Empty: the algorithm refuses both.
    robust_vectors: ClassVar[tuple[str, ...]] = ()
    #: The uploaded model vector that central DP (``ctx.central_dp``, :class:`pyfedkern.privacy.CentralDP`) clips
    #: and noises, when it is the algorithm's only uploaded vector and ``round`` is not overridden; None: the
    #: algorithm refuses central DP (``central_dp``).
    dp_upload: ClassVar[str | None] = None
    #: Whether local DP-SGD (``ctx.dpsgd``) privatises the algorithm's local training: its only data-dependent
    #: quantity is one minibatch gradient a step, taken by :func:`~pyfedkern.algorithms.local_sgd` or
    #: :meth:`~pyfedkern.algorithms.batched.BatchedLocal.sgd_` (everything else it computes is post-processing).
    #: False: refused with local DP (``check_local_dp``).
    local_dp: ClassVar[bool] = False

    x: torch.Tensor

    def __post_init__(self) -> None:
        """Check each hyper-parameter's type against its field's annotation (a TypeError naming it: the string
        "false" is not a bool); subclasses call this first, then check ranges."""
        for name, f in self.hyperparameters().items():
            value = getattr(self, name)
            expected = _HYPERPARAMETER_TYPES.get(str(f.type))
            if expected is not None and not expected[1](value):
                raise TypeError(f"{self.name}: {name} must be {expected[0]}, got {value!r}")
            if str(f.type) == "float" and math.isfinite(value) and abs(value) > FLOAT32_MAX:
                raise ValueError(f"{self.name}: {name} must be within float32's range, got {value!r}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        """Allocate server state; ``x0`` is the initial global model [d], like the model's ``ctx.local.flat.data``."""
        check_model_vector(x0, ctx.local.flat.data, "x0")
        self.x = x0.clone()

    def participants(self, t: int, ctx: FLContext) -> np.ndarray:
        """The client ids taking part in round t (int64 [k]); by default the context's client sampling."""
        return ctx.sample_clients(t)

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        """The local updates of ``clients`` (int64 [k]) in round t, as rows: the algorithm's one definition of its
        client side, run by the engine on a chunk of participants, by each process of a distributed run, by a
        Flower client and by a user's own loop on one client (``np.array([cid])``). It trains through
        :func:`~pyfedkern.algorithms.looped.local_run` (batched or one client after another, as the context
        allows), so it holds for both paths."""
        raise NotImplementedError

    def client_stores(self) -> dict[str, ClientStore]:
        """The algorithm's per-client state, its :class:`ClientStore` members by name (what a Flower node keeps of
        its client between rounds)."""
        return {name: value for name, value in vars(self).items() if isinstance(value, ClientStore)}

    def node_round(self, ctx: FLContext, t: int, settings: dict[str, Any]) -> tuple[Algorithm, FLContext, int]:
        """What a Flower node runs for round t under the server's round ``settings`` (its ConfigRecord): the
        algorithm whose :meth:`client_update` it calls, that call's context and round. By default this algorithm in
        ``ctx`` at t; DynamicInit answers with its host algorithm in a session's or footprint's context."""
        return self, ctx, t

    def node_receive(self, cid: int, settings: dict[str, Any], restored: bool) -> None:
        """A Flower node's start of a round, after :meth:`setup` from the server's model and the restore of client
        ``cid``'s rows of :meth:`client_stores` (``restored``: whether the node had kept them). By default nothing;
        FedPBC's client adopts the server's model here or keeps its own."""

    def state_rows_per_client(self, ctx: FLContext) -> int:
        """[d]-sized buffers per participant the batched update holds besides the model, gradient and messages
        (per-client state, recorded gradients), for the memory budget of
        :func:`~pyfedkern.algorithms.batched.client_chunks`."""
        return 2

    def accumulate(self, t: int, sums: RoundSums, updates: ClientUpdates, ctx: FLContext) -> None:
        """Fold one chunk of participants' updates into the round's sums."""
        raise NotImplementedError

    def server_step(self, t: int, sums: RoundSums, ctx: FLContext) -> None:
        """Finish round t from the sums of all its participants' updates."""
        raise NotImplementedError

    def broadcast_floats(self) -> int:
        """Floats sent from the server to each participant per round (the model by default)."""
        return int(self.x.numel())

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        """One round: the participants' local updates (in chunks that fit memory), then the server step.

        With ``ctx.team`` (several processes, :mod:`pyfedkern.sim.distributed`), each process trains the participants
        it owns and the team combines the processes' sums before the server step, which every process takes.

        With a robust ``ctx.aggregator`` or an ``ctx.attack`` (``robust_settings``), the round keeps its
        participants' uploads (K rows of each of ``robust_vectors``), replaces the attackers' rows, folds them into
        the sums and replaces the weighted means of ``robust_vectors`` by the aggregator's rule; with several
        processes, each gathers every process's uploads (``team.everyone``) and takes the same step."""
        clients = self.participants(t, ctx)
        team = ctx.team
        aggregator, attack = self.robust_settings(ctx)
        keep = aggregator is not None or attack is not None
        dp = self.central_dp(ctx)
        if dp is not None and keep:
            raise ValueError("central DP cannot be combined with a robust aggregator or an attack")
        sums = RoundSums()
        losses: list[torch.Tensor] = []
        kept: list[ClientUpdates] = []
        extras: dict[str, Any] = {}
        upload = 0
        own = team.mine(clients)
        for chunk in client_chunks(ctx, own, self.state_rows_per_client(ctx)):
            with ctx.timer("local"):
                updates = self.client_update(t, chunk, ctx)
            if keep:
                kept.append(updates)
            else:
                with ctx.timer("aggregation"):
                    if dp is None:
                        self.accumulate(t, sums, updates, ctx)
                    else:  # weights 1, the upload's clipped updates
                        dp.accumulate(self, t, sums, updates, ctx)
            losses.append(updates.losses)
            upload += updates.upload_floats
        with ctx.timer("aggregation"):
            if keep:  # the whole round's uploads, on every process; rank 0's sums count once in team.combine
                parts = team.everyone(t, kept)
                whole = RoundSums()
                if parts:
                    extras = self.robust_accumulate(t, whole, ClientUpdates.concat(parts), aggregator, attack, ctx)
                if team.rank == 0:
                    sums = whole
            sums, losses, upload = team.combine(t, sums, losses, upload)
            if dp is not None and len(clients):  # the noise, once per round on the combined sum
                extras.update(dp.finish(t, sums, self.x, self.dp_upload, ctx.rng))
            if len(clients):
                self.server_step(t, sums, ctx)
        return RoundStats(
            clients=np.asarray(clients, dtype=np.int64),
            local_loss=mean_loss(losses),
            upload_floats=upload,
            download_floats=len(clients) * self.broadcast_floats(),
            extras=extras,
        )

    def central_dp(self, ctx: FLContext) -> Any:
        """``ctx.central_dp`` (a :class:`pyfedkern.privacy.CentralDP`, or None), checked by
        :meth:`check_central_dp` when set."""
        dp = ctx.central_dp
        if dp is not None:
            self.check_central_dp()
        return dp

    @classmethod
    def check_central_dp(cls) -> None:
        """ValueError naming the algorithm unless central DP can privatise it: its only upload is its model
        (:attr:`dp_upload`) and it runs the default ``round``."""
        if cls.dp_upload is None or cls.round is not Algorithm.round:
            raise ValueError(
                f"central DP supports algorithms whose only upload is their model (fedavg, fedprox, fedsam, fedcm, "
                f"fedadam); {cls.name} uploads more (control variates, gradients) or runs a round of its own"
            )

    @classmethod
    def check_local_dp(cls) -> None:
        """ValueError naming the algorithm unless local DP-SGD can privatise its local steps (:attr:`local_dp`)."""
        if not cls.local_dp:
            raise ValueError(
                f"local DP-SGD supports algorithms whose local steps are plain minibatch gradient steps (fedavg, "
                f"fedprox, scaffold, feddyn, fedcm, fedadam, fnrfl, fednova, bherd and its variants, grab, fedpbc "
                f"and its baselines); {cls.name} takes extra gradients (perturbed steps, distillation) of its own"
            )

    def robust_settings(self, ctx: FLContext) -> tuple[Aggregator | None, Attack | None]:
        """(the robust aggregator, the attack) of ``ctx`` (None for the weighted mean and for no attack); ValueError
        naming the algorithm when it has no ``robust_vectors`` and either is asked for."""
        aggregator = parse_aggregator(ctx.aggregator)
        attack = parse_attack(ctx.attack)
        check_robust(type(self), aggregator, attack)
        return (None if aggregator.is_mean else aggregator), attack

    def robust_centre(self, name: str) -> torch.Tensor:
        """The point the uploads of ``name`` (one of ``robust_vectors``) are updates around: the global model."""
        return self.x

    def robust_accumulate(
        self,
        t: int,
        sums: RoundSums,
        updates: ClientUpdates,
        aggregator: Aggregator | None,
        attack: Attack | None,
        ctx: FLContext,
    ) -> dict[str, Any]:
        """Fold a whole round's ``updates`` (rows ordered by client) into ``sums``: first the attackers' rows of
        ``robust_vectors`` are replaced (``attack``), then after :meth:`accumulate` each of their weighted sums
        becomes Σw·(the aggregator's rule). Returns the metrics of the attack (attackers, attacked_clients)."""
        extras: dict[str, Any] = {}
        if attack is not None:
            rng = ctx.rng(ATTACK_STREAM, t)
            who = attack.attackers(len(updates), rng)
            for name in self.robust_vectors:
                attack.apply_(updates.vectors[name], self.robust_centre(name), who, rng)
            extras = {"attackers": int(who.size), "attacked_clients": updates.clients[who].tolist()}
        self.accumulate(t, sums, updates, ctx)
        if aggregator is not None and len(updates):
            weight = sums.scalar("weight")
            for name in self.robust_vectors:
                robust = aggregator.combine(updates.vectors[name], updates.weights, self.robust_centre(name))
                sums.vectors[name] = robust.mul_(weight)
        return extras

    def global_model(self) -> torch.Tensor:
        """The vector to evaluate [d]."""
        return self.x

    def state_dict(self) -> dict[str, Any]:
        """All mutable server/client state (tensors, numpy arrays, numbers) needed to resume exactly."""
        return {"x": self.x}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned (into the existing tensors)."""
        self.x.copy_(state["x"])

    @classmethod
    def hyperparameters(cls) -> dict[str, dataclasses.Field]:
        """The algorithm's hyper-parameter fields (name → dataclass field)."""
        if not dataclasses.is_dataclass(cls):
            return {}
        return {f.name: f for f in dataclasses.fields(cls) if f.init}


def check_robust(cls: type[Algorithm], aggregator: Aggregator, attack: Attack | None) -> None:
    """ValueError naming the algorithm unless ``cls`` can take the ``aggregator`` and the ``attack`` (any algorithm
    takes the mean and no attack; the others need :attr:`Algorithm.robust_vectors`)."""
    if (aggregator.is_mean and attack is None) or cls.robust_vectors:
        return
    asked = [f"aggregator {aggregator.spec!r}"] if not aggregator.is_mean else []
    asked += [f"attack {attack.spec!r}"] if attack is not None else []
    raise ValueError(
        f"algorithm {cls.name!r} refuses {' and '.join(asked)}: its server step is not a weighted mean of the "
        "uploads (robust aggregation and attacks apply to fedavg, fedprox, scaffold, fedsam, fedcm and fedadam)"
    )


def mean_loss(losses: Sequence[torch.Tensor] | torch.Tensor) -> float:
    """The mean of the finite per-client losses (one device read), NaN when there are none."""
    if isinstance(losses, (list, tuple)):
        if not losses:
            return float("nan")
        values = torch.cat([v.reshape(-1) for v in losses])
    else:
        values = losses.reshape(-1)
    if values.numel() == 0:
        return float("nan")
    finite = torch.isfinite(values)
    count = int(finite.sum())
    return float(torch.where(finite, values, torch.zeros_like(values)).sum()) / count if count else float("nan")
