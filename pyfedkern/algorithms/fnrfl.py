"""FNR-FL (Hu, Qiu, Tang: "Feature Norm Regularized Federated Learning"), Algorithms 1–3 resolved per specs/fnrfl.md.

Round t (participants S, n = |S|):

1. every client i trains from the global model with plain cross-entropy SGD (FedAvg's local step) → w_i, then
   computes on the labelled public set D_pub (eval mode, no grad) its class-average feature norms F_i [K]
   (Alg. 1: mean over samples of class k of ‖features(x)‖₂) and its top-1 accuracy A_i — one fused
   :func:`pyfedkern.ops.class_feature_norms` pass per batch;
2. the server picks S_re, the n_re = ⌊n·p⌋ clients with the lowest A_i (stable: lower id first on ties), and for
   each j ∈ S_re the differences Δ_j[l] = Σ_{m∈S∖S_re} (F_m[l] − F_j[l]) (Alg. 2, a signed sum over the M
   non-selected clients; a client whose F_m lacks label l is skipped for l);
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.base import ClientMessage, FLContext, RoundStats
from pyfedkern.algorithms.fedavg import FedAvg, _check_positive

REG_MODES = ("abs", "sq", "literal")
_REFINE_STREAM = 0x464E52  # purpose key of the refinement batch order ("FNR")
_STAT_BATCH = 1024


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
    """

    name = "fnrfl"
    lam: float = 0.01
    p: float = 0.3
    public_size: int = 100
    refine_epochs: float = 5.0
    reg_mode: str = "abs"

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

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        clients = self.participants(t, ctx)
        _split_model(ctx.local.module)
        messages: list[ClientMessage] = []
        stats: list[PublicStats] = []
        with ctx.timer("local"):
            for cid in clients:
                messages.append(self.client_update(t, int(cid), ctx))
                stats.append(self.public_statistics(messages[-1].vectors["model"], ctx))
        accuracies = np.array([s.accuracy for s in stats])
        chosen = select_lowest(accuracies, selection_count(len(clients), self.p))
        others = [s for k, s in enumerate(stats) if k not in set(chosen.tolist())]
        reg_values = []
        if chosen.size:
            target = reference_sums(others) if others else _empty_target(stats[0])
            with ctx.timer("local"):
                for k in chosen:
                    delta = differences(*target, stats[k])
                    model, _, reg = self.refine(t, int(clients[k]), messages[k].vectors["model"], ctx, target, delta)
                    messages[k].vectors["model"] = model
                    reg_values.append(reg)
        with ctx.timer("aggregation"):
            self.server_step(t, messages, ctx)
        P = int(self.x.numel())
        K = int(stats[0].class_mean.numel()) if stats else 0
        return RoundStats(
            clients=np.asarray(clients, dtype=np.int64),
            local_loss=float(np.mean([m.loss for m in messages])) if messages else float("nan"),
            upload_floats=len(clients) * (P + K + 1) + len(chosen) * P,
            download_floats=len(clients) * P + len(chosen) * K,
            extras={
                "fnr_refined": float(len(chosen)),
                "fnr_public_acc_mean": float(accuracies.mean()) if len(accuracies) else float("nan"),
                "fnr_public_acc_min": float(accuracies.min()) if len(accuracies) else float("nan"),
                "fnr_reg": float(np.mean(reg_values)) if reg_values else float("nan"),
            },
        )


def _empty_target(like: PublicStats) -> tuple[torch.Tensor, torch.Tensor]:
    zeros = torch.zeros_like(like.class_mean, dtype=torch.float64)
    return zeros, zeros.clone()


def _public_set(ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
    px, py = getattr(ctx, "public_x", None), getattr(ctx, "public_y", None)
    if px is None or py is None or px.shape[0] == 0:
        raise ValueError(
            "FNR-FL needs a labelled public set: the simulation engine carves it from the training data when the "
            "algorithm's public_per_class > 0; a custom loop must provide ctx.public_x and ctx.public_y"
        )
    return px, py


def _num_classes(module: torch.nn.Module) -> int:
    return int(module.classifier.out_features)


__all__ = ["FNRFL", "PublicStats", "differences", "reference_sums", "regularizer", "select_lowest", "selection_count"]
