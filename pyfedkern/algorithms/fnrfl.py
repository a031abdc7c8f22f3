"""FNR-FL (Hu, Qiu, Tang: "Feature Norm Regularized Federated Learning"): Algorithms 1–3 as docs/fnrfl.md states.

Round t (participants S, n = |S|):

1. every client i trains from the global model with plain cross-entropy SGD (FedAvg's local step) → w_i, then
   computes on the labelled public set D_pub (eval mode, no grad) its class-average feature norms F_i [K]
   (Alg. 1: mean over samples of class k of ‖features(x)‖₂) and its top-1 accuracy A_i — one fused
   :func:`pyfedkern.ops.class_feature_norms` pass per batch;
2. the server picks S_re, the n_re = ⌊n·p⌋ clients with the lowest A_i (stable: lower id first on ties), and for
   each j ∈ S_re the differences Δ_j[l] = Σ_{m∈S∖S_re} (F_m[l] − F_j[l]) (Alg. 2, a signed sum over the M
   non-selected clients; a client whose F_m lacks label l is skipped for l). ``delta_rule="authors"`` sums over
   every other participant m ∈ S∖{j}, refined ones included, as the authors' code does (docs/fnrfl.md, "Reference
   code"); the regularizer's Σ_m F_m[l] and M_l below are taken over the same clients;
3. each selected client continues from its own w_j for ``refine_epochs`` epochs of minibatch SGD on D_pub with
   objective CE + λ·J, J = Σ_{l in batch} ρ_l·(...), ρ_l = #(y = l)/|B|;
4. w^{t+1} = Σ_i |D_i|/Σ|D|·w_i with the refined models substituted (public samples are not counted).

The printed regularizer J = Σ ρ_l·Δ_j[l] is a constant (Δ_j does not depend on the weights), so its gradient is
zero and the refinement is plain CE fine-tuning on D_pub. ``reg_mode`` chooses:

- ``"abs"`` (default): J = Σ_l ρ_l·|Σ_m F_m[l] − M_l·F̂_l|, with F̂_l the class-mean feature norm of the current
  batch under the current weights (differentiable; ∂J/∂f_b = −(M_l/|B|)·sign(Σ_m F_m[l] − M_l F̂_l)·f_b/‖f_b‖);
- ``"sq"``: J = Σ_l ρ_l·(F̄_l − F̂_l)², F̄_l = Σ_m F_m[l]/M_l;
- ``"literal"``: the printed constant J (logged, no gradient: reproduces the paper's algorithm as written).

With p = 0 (no client selected) the algorithm is exactly FedAvg.

The engine trains a round's participants with FedAvg's :meth:`~pyfedkern.algorithms.fedavg.FedAvg.client_update`
(batched or one client after another, :func:`~pyfedkern.algorithms.looped.local_run`); batched, it computes their
public-set statistics with one vmapped forward over the [k, d] models (:meth:`FNRFL.batched_public_statistics`) and
refines the selected clients together (:meth:`FNRFL.batched_refine`, vmapped gradients of CE + λ·J with J in plain
torch operations); :meth:`FNRFL.public_statistics` and :meth:`FNRFL.refine` do the same for one client. The refinement
needs the selected clients' own models after all statistics are known, so FNR-FL keeps every participant's model
of the round ([k, d]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import grad_and_value, vmap

from pyfedkern import ops
from pyfedkern.algorithms.base import ClientUpdates, FLContext, RoundStats, RoundSums, mean_loss
from pyfedkern.algorithms.batched import client_chunks, trainer_for, use_batched
from pyfedkern.algorithms.fedavg import FedAvg, _check_positive

REG_MODES = ("abs", "sq", "literal")
DELTA_RULES = ("paper", "authors")
_REFINE_STREAM = 0x464E52  # purpose key of the refinement batch order ("FNR")
_STAT_BATCH = 1024
_VMAP_ELEMENTS = 1 << 24  # feature elements of one vmapped forward over the public set (rows × samples × width)


@dataclass
class PublicStats:
    """Alg. 1 on the public set for one model: F [K] (0 where absent), present [K] bool, accuracy A."""

    class_mean: torch.Tensor
    present: torch.Tensor
    accuracy: float


def selection_count(n: int, p: float) -> int:
    """n_re = ⌊n·p⌋ (with a little slack so that e.g. 10·0.3 gives 3)."""
    return min(n, max(0, math.floor(n * p + 1e-9)))


def select_lowest(accuracies: np.ndarray, n_re: int) -> np.ndarray:
    """Positions of the n_re lowest accuracies, ties broken by position (stable sort)."""
    return np.sort(np.argsort(np.asarray(accuracies, dtype=np.float64), kind="stable")[:n_re])


def reference_sums(stats: list[PublicStats]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_m F_m[l], M_l) over the non-selected clients m, skipping m for labels absent from its F_m."""
    means = torch.stack([s.class_mean for s in stats]).to(torch.float64)
    present = torch.stack([s.present for s in stats])
    return (means * present).sum(0), present.sum(0).to(torch.float64)


def differences(target_sum: torch.Tensor, target_count: torch.Tensor, own: PublicStats) -> torch.Tensor:
    """Alg. 2: Δ_j[l] = Σ_m (F_m[l] − F_j[l]) = Σ_m F_m[l] − M_l·F_j[l] for labels l in F_j (0 elsewhere)."""
    delta = target_sum - target_count * own.class_mean.to(torch.float64)
    return torch.where(own.present, delta, torch.zeros_like(delta))


def round_targets(
    stats: list[PublicStats], chosen: np.ndarray, rule: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each chosen position j (rows in ``chosen``'s order): (Σ_m F_m[l] [r, K], M_l [r, K], Δ_j [r, K]), m over
    the participants not chosen (rule "paper", Alg. 2) or over every participant but j (rule "authors")."""
    chosen = np.asarray(chosen, dtype=np.int64).tolist()
    sums, counts, deltas = [], [], []
    for j in chosen:
        excluded = set(chosen) if rule == "paper" else {j}
        others = [s for k, s in enumerate(stats) if k not in excluded]
        target = reference_sums(others) if others else _empty_target(stats[j])
        sums.append(target[0])
        counts.append(target[1])
        deltas.append(differences(*target, stats[j]))
    return torch.stack(sums), torch.stack(counts), torch.stack(deltas)


def regularizer(
    mode: str,
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    target_sum: torch.Tensor,
    target_count: torch.Tensor,
    delta: torch.Tensor,
) -> torch.Tensor:
    """J for one batch (see the module docstring); differentiable w.r.t. ``features`` for "abs" and "sq"."""
    if mode == "literal":
        counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
        return (counts / labels.shape[0] * delta).sum()
    stats = ops.class_feature_norms(features, labels, num_classes)
    rho = stats.counts.to(features.dtype) / labels.shape[0]
    active = (stats.counts > 0) & (target_count > 0)
    f_hat = stats.class_mean
    tsum, tcount = target_sum.to(features.dtype), target_count.to(features.dtype)
    if mode == "abs":
        terms = (tsum - tcount * f_hat).abs()
    else:
        terms = (tsum / tcount.clamp(min=1) - f_hat).square()
    return torch.where(active, rho * terms, torch.zeros_like(terms)).sum()


def plain_regularizer(
    mode: str,
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    target_sum: torch.Tensor,
    target_count: torch.Tensor,
    delta: torch.Tensor,
) -> torch.Tensor:
    """:func:`regularizer` in plain torch operations (no custom autograd op), so that ``torch.func`` can take its
    gradient for many clients at once; the same value and gradient to rounding."""
    onehot = (labels[:, None] == torch.arange(num_classes, device=labels.device)).to(features.dtype)  # [B, K]
    counts = onehot.sum(0)
    if mode == "literal":
        return (counts.to(torch.float64) / labels.shape[0] * delta).sum()
    f_hat = (torch.linalg.vector_norm(features, dim=1) @ onehot) / counts.clamp(min=1)
    rho = counts / labels.shape[0]
    active = (counts > 0) & (target_count > 0)
    tsum, tcount = target_sum.to(features.dtype), target_count.to(features.dtype)
    if mode == "abs":
        terms = (tsum - tcount * f_hat).abs()
    else:
        terms = (tsum / tcount.clamp(min=1) - f_hat).square()
    return torch.where(active, rho * terms, torch.zeros_like(terms)).sum()


class _Heads(nn.Module):
    """forward(x) = (features, logits) of the wrapped model, for functional calls with swapped parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats = self.model.features(x)
        return feats, self.model.classifier(feats)


class _RefineObjective(nn.Module):
    """forward(xb, yb, target_sum, target_count, delta) = (CE + λ·J (λ·J left out in literal mode), (CE, J)) of the
    wrapped model."""

    def __init__(self, local: Any, mode: str, lam: float, num_classes: int) -> None:
        super().__init__()
        self.model = local.module
        self.local = [local]  # a plain list: not registered as a submodule
        self.mode, self.lam, self.num_classes = mode, lam, num_classes

    def forward(
        self, xb: torch.Tensor, yb: torch.Tensor, target_sum: torch.Tensor, target_count: torch.Tensor, delta
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        feats = self.model.features(xb)
        loss = self.local[0].objective(self.model.classifier(feats), yb)
        reg = plain_regularizer(self.mode, feats, yb, self.num_classes, target_sum, target_count, delta)
        total = loss + self.lam * reg if self.mode != "literal" else loss
        return total, (loss.detach(), reg.detach())


def _split_model(module: torch.nn.Module) -> None:
    classifier = getattr(module, "classifier", None)
    if not (callable(getattr(module, "features", None)) and isinstance(classifier, torch.nn.Linear)):
        raise TypeError(
            f"FNR-FL needs a model with .features(x) and a Linear .classifier (got {type(module).__qualname__}); "
            "pyfedkern.models provides them for every classifier"
        )


@dataclass
class FNRFL(FedAvg):
    """FNR-FL on FedAvg (see the module docstring).

    Args:
        lam: regularization weight λ ≥ 0.
        p: fraction of participants refined each round (n_re = ⌊n·p⌋), in [0, 1].
        public_size: labelled public samples held out **per class** from the training data (disjoint from the
            clients and the test set); the engine carves public_size × num_classes samples.
        refine_epochs: epochs E_re of refinement on the public set.
        reg_mode: "abs" (default, differentiable), "sq" or "literal" (the paper's constant J).
        delta_rule: "paper" (Δ_j and the regularizer's sums over the participants not refined, Alg. 2) or
            "authors" (over every other participant, refined ones included, as the authors' code).
    """

    distributed = True  # its round goes through ctx.team (see round)
    robust_vectors = ()  # its round has a second phase on the server's refinement, not a weighted mean

    name = "fnrfl"
    lam: float = 0.01
    p: float = 0.3
    public_size: int = 100
    refine_epochs: float = 5.0
    reg_mode: str = "abs"
    delta_rule: str = "paper"
    # FL-Simulator's reference behaviours (FedAvg's ref_compat) are no part of FNR-FL: not parameters here
    ref_compat: bool = field(default=False, init=False, repr=False)
    clip_norm: float = field(default=10.0, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive("lam", self.lam, allow_zero=True)
        if not (0.0 <= self.p <= 1.0):
            raise ValueError(f"p must be in [0, 1], got {self.p}")
        if isinstance(self.public_size, bool) or not isinstance(self.public_size, int) or self.public_size < 1:
            raise ValueError(f"public_size must be an integer >= 1 (samples per class), got {self.public_size!r}")
        _check_positive("refine_epochs", self.refine_epochs, allow_zero=True)
        if self.reg_mode not in REG_MODES:
            raise ValueError(f"reg_mode must be one of {', '.join(REG_MODES)}, got {self.reg_mode!r}")
        if self.delta_rule not in DELTA_RULES:
            raise ValueError(f"delta_rule must be one of {', '.join(DELTA_RULES)}, got {self.delta_rule!r}")
        self.public_per_class = self.public_size  # read by the engine to carve the public set

    # Alg. 1 -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def public_statistics(self, vector: torch.Tensor, ctx: FLContext) -> PublicStats:
        """F (class-average feature norms) and top-1 accuracy of the model ``vector`` on the public set."""
        px, py = _public_set(ctx)
        local = ctx.local
        module = local.module
        local.load_(vector)
        module.eval()
        K = _num_classes(module)
        sums = torch.zeros(K, dtype=torch.float64, device=px.device)
        counts = torch.zeros(K, dtype=torch.int64, device=px.device)
        correct = 0
        for start in range(0, px.shape[0], _STAT_BATCH):
            xb, yb = px[start : start + _STAT_BATCH], py[start : start + _STAT_BATCH]
            feats = module.features(xb)
            res = ops.class_feature_norms(feats, yb, K, logits=module.classifier(feats))
            sums += res.class_sum.to(torch.float64)
            counts += res.counts
            correct += int(res.correct)
        present = counts > 0
        mean = torch.where(present, sums / counts.clamp(min=1), torch.zeros_like(sums))
        return PublicStats(mean, present, correct / px.shape[0])

    # Alg. 3 refinement ------------------------------------------------------------------------------------

    def refine(
        self, t: int, cid: int, start: torch.Tensor, ctx: FLContext, target: tuple[torch.Tensor, torch.Tensor], delta
    ) -> tuple[torch.Tensor, float, float]:
        """Refinement of client cid from its model ``start``: (model, mean CE loss, mean J) over the steps."""
        px, py = _public_set(ctx)
        local = ctx.local
        module = local.module
        local.load_(start)
        x, g = local.flat.data, local.flat.grad
        K = _num_classes(module)
        lr = ctx.lr(t)
        n = px.shape[0]
        size = min(ctx.batch_size, n)
        steps = math.ceil(self.refine_epochs * n / size - 1e-9)
        ctx.seed_model_randomness(t, cid, _REFINE_STREAM)  # its dropout: the same in whichever process refines it
        momentum_buf = None
        total_loss = total_reg = 0.0
        step = epoch = 0
        while step < steps:
            perm = torch.as_tensor(ctx.rng(_REFINE_STREAM, t, cid, epoch).permutation(n), device=px.device)
            for b in range(0, n, size):
                if step >= steps:
                    break
                idx = perm[b : b + size]
                xb, yb = px[idx], py[idx]
                module.train()
                local.flat.zero_grad()
                feats = module.features(xb)
                loss = local.objective(module.classifier(feats), yb)
                reg = regularizer(self.reg_mode, feats, yb, K, *target, delta)
                objective = loss + self.lam * reg if self.reg_mode != "literal" else loss
                objective.backward()
                total_loss += float(loss.detach())
                total_reg += float(reg.detach())
                if ctx.weight_decay:
                    g.add_(x, alpha=ctx.weight_decay)
                direction = g
                if ctx.momentum:
                    momentum_buf = g.clone() if momentum_buf is None else momentum_buf.mul_(ctx.momentum).add_(g)
                    direction = momentum_buf
                x.add_(direction, alpha=-lr)
                step += 1
            epoch += 1
        return x.clone(), total_loss / max(step, 1), total_reg / max(step, 1)

    @torch.no_grad()
    def batched_public_statistics(self, models: torch.Tensor, ctx: FLContext) -> list[PublicStats]:
        """:meth:`public_statistics` of every row of ``models`` [k, d], with vmapped forwards over the public set
        (rows in groups whose features fit a fixed budget) and one :func:`pyfedkern.ops.class_feature_norms` call
        per group (class l of row r counted as class r·K + l)."""
        px, py = _public_set(ctx)
        module = ctx.local.module
        module.eval()
        K, P = _num_classes(module), px.shape[0]
        heads = _Heads(module)
        trainer = trainer_for(ctx.local)
        forward = vmap(lambda params: trainer.call(heads, params, (px,)))
        params = trainer.params(models)
        counts = torch.bincount(py, minlength=K)
        present = counts > 0
        group = self._stat_rows(P, module)
        out: list[PublicStats] = []
        for a in range(0, models.shape[0], group):
            b = min(models.shape[0], a + group)
            feats, logits = forward({name: v[a:b] for name, v in params.items()})
            rows = b - a
            labels = (py[None, :] + K * torch.arange(rows, device=py.device)[:, None]).reshape(-1)
            res = ops.class_feature_norms(feats.reshape(rows * P, -1), labels, rows * K)
            sums = res.class_sum.reshape(rows, K).to(torch.float64)
            mean = torch.where(present, sums / counts.clamp(min=1), torch.zeros_like(sums))
            accuracy = (logits.argmax(-1) == py).sum(1).cpu().numpy() / P
            out += [PublicStats(mean[r], present, float(accuracy[r])) for r in range(rows)]
        return out

    @staticmethod
    def _stat_rows(samples: int, module: torch.nn.Module) -> int:
        """Rows per vmapped forward over the public set: features and logits within a fixed element budget."""
        width = module.classifier.in_features + module.classifier.out_features
        return max(1, _VMAP_ELEMENTS // (samples * width))

    def batched_refine(
        self,
        t: int,
        clients: np.ndarray,
        starts: torch.Tensor,
        ctx: FLContext,
        targets: tuple[torch.Tensor, torch.Tensor],
        deltas: torch.Tensor,
    ) -> tuple[torch.Tensor, np.ndarray]:
        """:meth:`refine` of every client in ``clients`` from its row of ``starts`` [r, d] with its rows of
        ``targets`` (Σ_m F_m [r, K], M [r, K]) and ``deltas`` [r, K], trained together (vmapped gradients, the same
        minibatches); (models [r, d], mean J of each)."""
        px, py = _public_set(ctx)
        local = ctx.local
        K, n, r = _num_classes(local.module), px.shape[0], len(clients)
        lr = ctx.lr(t)
        size = min(ctx.batch_size, n)
        steps = math.ceil(self.refine_epochs * n / size - 1e-9)
        epochs = -(-steps // -(-n // size))  # epochs begun
        perms = np.zeros((r, epochs, n), dtype=np.int64)
        for j, cid in enumerate(clients):
            for e in range(epochs):
                perms[j, e] = ctx.rng(_REFINE_STREAM, t, int(cid), e).permutation(n)
        if r:
            ctx.seed_model_randomness(t, int(clients[0]), r, _REFINE_STREAM)  # the group's dropout
        objective = _RefineObjective(local, self.reg_mode, self.lam, K)
        trainer = trainer_for(local)
        step_fn = vmap(  # each client its own dropout masks, as in batched local training
            grad_and_value(lambda p, *batch: trainer.call(objective, p, batch), has_aux=True), randomness="different"
        )
        x = starts.clone()
        params = trainer.params(x)
        momentum = torch.zeros_like(x) if ctx.momentum else None
        reg_sum = torch.zeros(r, dtype=torch.float64, device=x.device)
        local.module.train()
        step = 0
        for e in range(epochs):
            index = torch.as_tensor(perms[:, e], device=px.device)
            for b in range(0, n, size):
                if step >= steps:
                    break
                idx = index[:, b : b + size]
                grads, (_, (_, reg)) = step_fn(params, px[idx], py[idx], *targets, deltas)
                g = torch.cat([grads[name].reshape(r, -1) for name in params], dim=1)
                reg_sum += reg
                if ctx.weight_decay:
                    g.add_(x, alpha=ctx.weight_decay)
                direction = g
                if momentum is not None:
                    direction = momentum.copy_(g) if step == 0 else momentum.mul_(ctx.momentum).add_(g)
                x.add_(direction, alpha=-lr)
                step += 1
        return x, (reg_sum / max(step, 1)).cpu().numpy()

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        """One round (see the module docstring). Spread over processes (``ctx.team``), each process trains and
        measures its share of the participants (``team.mine``), the processes share every participant's public-set
        statistics (F_i, present labels, A_i: 2K + 1 numbers each), each takes the same selection, refines the
        selected clients it trained, and the team adds up the model sums for the server step."""
        clients = self.participants(t, ctx)
        team = ctx.team
        own = team.mine(clients)
        _split_model(ctx.local.module)
        batched = use_batched(ctx)
        chunks: list[ClientUpdates] = []
        stats: list[PublicStats] = []
        with ctx.timer("local"):
            for chunk in client_chunks(ctx, own, 2):
                updates = self.client_update(t, chunk, ctx)
                chunks.append(updates)
                models = updates.vectors["model"]
                if batched:
                    stats += self.batched_public_statistics(models, ctx)
                else:
                    stats += [self.public_statistics(models[r], ctx) for r in range(len(updates))]
        # this process's rows as (chunk, row) by client id
        own_ids = np.concatenate([u.clients for u in chunks]) if chunks else np.zeros(0, dtype=np.int64)
        where = dict(zip(own_ids.tolist(), ((c, r) for c, u in enumerate(chunks) for r in range(len(u))), strict=True))
        ids = own_ids
        if team.size > 1:
            stats = self._shared_statistics(t, team, _num_classes(ctx.local.module), clients, own_ids, stats)
            ids = np.asarray(clients, dtype=np.int64)
        # positions in ids in ascending client id: selection ties go to the lower id
        by_id = np.argsort(ids, kind="stable")
        accuracies = np.array([s.accuracy for s in stats])[by_id]
        chosen = by_id[select_lowest(accuracies, selection_count(len(clients), self.p))]
        sums = RoundSums()
        if chosen.size:
            target_sums, target_counts, deltas = round_targets(stats, chosen, self.delta_rule)
            mine = [j for j, k in enumerate(chosen) if int(ids[k]) in where]  # rows of the chosen this process has
            refine_ids = ids[chosen[mine]]
            spots = [where[int(cid)] for cid in refine_ids]
            if mine:
                starts = torch.stack([chunks[c].vectors["model"][r] for c, r in spots])
                with ctx.timer("local"):
                    if batched:
                        targets = (target_sums[mine], target_counts[mine])
                        refined, reg_values = self.batched_refine(t, refine_ids, starts, ctx, targets, deltas[mine])
                    else:
                        results = [
                            self.refine(t, int(cid), starts[j], ctx, (target_sums[i], target_counts[i]), deltas[i])
                            for j, (i, cid) in enumerate(zip(mine, refine_ids, strict=True))
                        ]
                        refined = torch.stack([model for model, _, _ in results])
                        reg_values = np.array([reg for _, _, reg in results])
                for j, (c, r) in enumerate(spots):
                    chunks[c].vectors["model"][r] = refined[j]
                sums.add_scalar("fnr_reg", float(np.sum(reg_values)))
        losses = [u.losses for u in chunks]
        with ctx.timer("aggregation"):
            for updates in chunks:
                self.accumulate(t, sums, updates, ctx)
            sums, losses, _ = team.combine(t, sums, losses, 0)
            if len(clients):
                self.server_step(t, sums, ctx)
        P = int(self.x.numel())
        K = int(stats[0].class_mean.numel()) if stats else 0
        return RoundStats(
            clients=np.asarray(clients, dtype=np.int64),
            local_loss=mean_loss(losses) if losses else float("nan"),
            upload_floats=len(clients) * (P + K + 1) + len(chosen) * P,
            download_floats=len(clients) * P + len(chosen) * K,
            extras={
                "fnr_refined": float(len(chosen)),
                "fnr_public_acc_mean": float(accuracies.mean()) if len(accuracies) else float("nan"),
                "fnr_public_acc_min": float(accuracies.min()) if len(accuracies) else float("nan"),
                "fnr_reg": sums.scalar("fnr_reg") / len(chosen) if len(chosen) else float("nan"),
            },
        )

    def _shared_statistics(
        self, t: int, team: Any, K: int, clients: np.ndarray, own_ids: np.ndarray, stats: list[PublicStats]
    ) -> list[PublicStats]:
        """Every participant's statistics in ``clients``' order, from each process's own (``stats`` of ``own_ids``,
        K classes): a [k, 2K + 1] float64 table (F, present, A per row) in which each process fills the rows of its
        own clients; the team's sum of the tables adds only zeros to each entry, so every entry arrives exactly."""
        table = torch.zeros(len(clients), 2 * K + 1, dtype=torch.float64, device=self.x.device)
        if len(own_ids):
            position = {int(cid): i for i, cid in enumerate(clients)}
            index = torch.as_tensor([position[int(cid)] for cid in own_ids], device=table.device)
            accuracies = torch.tensor([[s.accuracy] for s in stats], dtype=torch.float64, device=table.device)
            means = torch.stack([s.class_mean for s in stats]).to(table)
            present = torch.stack([s.present for s in stats]).to(table)
            table.index_copy_(0, index, torch.cat([means, present, accuracies], dim=1))
        sums = RoundSums()
        sums.vectors["fnr_public_stats"] = table
        table = team.combine(t, sums, [], 0)[0].vector("fnr_public_stats")
        return [PublicStats(row[:K], row[K : 2 * K].bool(), float(row[2 * K])) for row in table]


def _empty_target(like: PublicStats) -> tuple[torch.Tensor, torch.Tensor]:
    zeros = torch.zeros_like(like.class_mean, dtype=torch.float64)
    return zeros, zeros.clone()


def _public_set(ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
    px, py = ctx.public_x, ctx.public_y
    if px is None or py is None or px.shape[0] == 0:
        raise ValueError(
            "FNR-FL needs a labelled public set: the simulation engine carves it from the training data when the "
            "algorithm's public_per_class > 0; a custom loop must provide ctx.public_x and ctx.public_y"
        )
    return px, py


def _num_classes(module: torch.nn.Module) -> int:
    return int(module.classifier.out_features)


__all__ = ["FNRFL", "PublicStats", "differences", "reference_sums", "regularizer", "select_lowest", "selection_count"]
