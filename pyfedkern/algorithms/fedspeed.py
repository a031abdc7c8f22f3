"""FedSpeed (Sun et al., ICLR 2023): prox-corrected local steps at a SAM-style perturbed point.

- :class:`FedSpeedOptimizer` is a ``torch.optim.Optimizer`` for a user's own loop: ``step(closure)`` takes the
  first gradient at x, the second at x̆ = x + (ρ/‖g1‖)·g1 (the closure is called twice on the same batch) and applies
  x ← x − η[(1−α)g1 + αg2 − ĝ_i + (1/λ)(x − x^t) + wd·x] with the fused kernel
  :func:`pyfedkern.ops.fedspeed_update_`.
  ``begin_round`` / ``end_round`` bracket one FL round (h_i += x_K − x^t, upload x̂_i = x_K + h_i).
- :class:`FedSpeed` is the client/server algorithm (Algorithm 1 in the storage form h_i = −λ·ĝ_i of
  docs/fedspeed.md §3; its :meth:`FedSpeed.client_update` runs the [k, d] row forms of the same fused kernels, one
  norm per row, batched or one client after another), with the switches ``use_prox``, ``use_correction``,
  ``use_perturb`` (the Table 7 ablation), ``ref_compat`` (FL-Simulator's clip of the loss gradient + correction at
  ``clip_norm``) and ``corr_avg`` ("all": the reference server x^{t+1} = mean_S(x_K) + mean_m(h_i)).

The prox parameter is λ (``lam``); the "prox weight" of the paper's experiments (0.1, 0.01, 0.001) is 1/λ.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
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
from pyfedkern.algorithms.looped import local_run

RHO_MODES = ("normalized", "raw")
CORR_AVG = ("active", "all")


def check_fedspeed_params(*, lam: float | None, rho: float, alpha: float, eps: float, rho_mode: str) -> None:
    """ValueError for λ ≤ 0, ρ < 0, α ∉ [0, 1], ε < 0 or an unknown rho_mode (all must be finite).

    Chained comparisons instead of ``math.isfinite`` (NaN fails them too), so that ``torch.compile`` traces the check
    of a compiled step when Dynamo has made a hyperparameter symbolic."""
    if lam is not None and not 0 < lam < math.inf:
        raise ValueError(f"lam (λ) must be finite and > 0, got {lam}")
    if not 0 <= rho < math.inf:
        raise ValueError(f"rho must be finite and >= 0, got {rho}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not 0 <= eps < math.inf:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if rho_mode not in RHO_MODES:
        raise ValueError(f"rho_mode must be one of {RHO_MODES}, got {rho_mode!r}")


def _flat_base(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The flat [d] tensor the tensors are consecutive contiguous views of, or None."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    d = offset - first.storage_offset()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (d,), (1,))


def _views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


class FedSpeedOptimizer(torch.optim.Optimizer):
    """FedSpeed's local optimizer on one flat buffer per quantity (one kernel launch per step for the whole model).

    The parameters are rebound to views of a flat [d] buffer x (adopted without a copy when they already are
    consecutive views of one, as with :class:`pyfedkern.flat.FlatParameters`); the gradients go to flat buffers
    too. Use ``opt.zero_grad()`` (it zeroes the flat buffer); gradients that were reset to None or replaced are
    copied back into the buffer at the next step. Moving the model to another device after creating the
    optimizer is not supported.

    Args:
        params: the model's parameters (one group; one dtype and device).
        lr: local step size η ≥ 0 (change it per round through ``param_groups[0]["lr"]``).
        rho: ascent radius ρ ≥ 0 (0: no second gradient).
        alpha: weight α ∈ [0, 1] of the perturbed gradient in g̃ = (1−α)g1 + αg2.
        lam: prox parameter λ > 0 (the prox weight is 1/λ), or None for no prox and no correction.
        weight_decay: L2 weight decay wd ≥ 0 added as wd·x.
        eps: ε ≥ 0 of ρ/(‖g1‖ + ε). A zero gradient gives x̆ = x.
        rho_mode: "normalized" (ρ/‖g1‖, the experiments) or "raw" (ρ, Algorithm 1 literally).
        correction: keep and update the correction h_i (False: prox only, FedProx-like).
        clip_norm: None, or M > 0 to clip ‖g̃ + (1/λ)D‖ at M as the reference code does.

    Usage::

        opt = FedSpeedOptimizer(model.parameters(), lr=0.1, rho=0.1, lam=10.0, weight_decay=1e-3)
        opt.begin_round()                      # x^t = the current parameters
        for xb, yb in loader:
            def closure():
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                return loss
            opt.step(closure)                  # calls closure twice (at x and at x̆)
        upload = opt.end_round()               # x̂_i = x_K + h_i, h_i updated
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        *,
        rho: float = 0.1,
        alpha: float = 1.0,
        lam: float | None = None,
        weight_decay: float = 0.0,
        eps: float = 1e-7,
        rho_mode: str = "normalized",
        correction: bool = True,
        clip_norm: float | None = None,
    ) -> None:
        check_fedspeed_params(lam=lam, rho=rho, alpha=alpha, eps=eps, rho_mode=rho_mode)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr must be finite and >= 0, got {lr}")
        if not (math.isfinite(weight_decay) and weight_decay >= 0):
            raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
        if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip_norm must be None or finite and > 0, got {clip_norm}")
        defaults = dict(lr=lr, rho=rho, alpha=alpha, lam=lam, weight_decay=weight_decay, eps=eps)
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError("FedSpeedOptimizer takes one parameter group (one fused update for the whole model)")
        # The step reads its group through this reference: under torch.compile, reading ``param_groups`` makes
        # Dynamo mark the parameters as static inputs, and a backward() traced in the same graph then drops their
        # gradients (torch 2.13).
        self._hyper = self.param_groups[0]
        self._params: list[torch.Tensor] = list(self._hyper["params"])
        if len({p.dtype for p in self._params}) != 1 or len({p.device for p in self._params}) != 1:
            raise ValueError("all parameters must share one dtype and one device")
        self.rho_mode = rho_mode
        self.correction = bool(correction)
        self.clip_norm = clip_norm
        base = _flat_base([p.data for p in self._params])
        if base is None:
            base = torch.cat([p.detach().reshape(-1) for p in self._params])
        self._x = base
        self._x_views = _views(self._x, self._params)
        grads = [p.grad for p in self._params]
        gbase = _flat_base(grads) if all(g is not None for g in grads) else None
        self._g1 = gbase if gbase is not None and gbase.numel() == base.numel() else torch.zeros_like(base)
        self._g1_views = _views(self._g1, self._params)
        self._perturbed: torch.Tensor | None = None
        self._g2: torch.Tensor | None = None
        if rho > 0:
            self._second_buffers()  # here rather than in a (possibly compiled) step
        self._external_h: torch.Tensor | None = None
        self._bind(self._x_views, self._g1_views)
        self.state[self._params[0]].update(
            {"h": torch.zeros_like(base), "x_round": torch.zeros_like(base), "in_round": False}
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # load_state_dict() replaces the group dict
        self._hyper = self.param_groups[0]

    # buffers -------------------------------------------------------------------------------------------

    @property
    def flat_params(self) -> torch.Tensor:
        """The flat [d] parameter buffer x (the parameters are views of it)."""
        return self._x

    @property
    def h(self) -> torch.Tensor:
        """The correction h_i = −λ·ĝ_i used by the current round (the internal one unless one was passed)."""
        return self._external_h if self._external_h is not None else self._state["h"]

    @property
    def _state(self) -> dict[str, Any]:
        return self.state[self._params[0]]

    def _bind(self, data_views: list[torch.Tensor], grad_views: list[torch.Tensor]) -> None:
        for p, v in zip(self._params, data_views, strict=True):
            p.data = v
        self._bind_grads(grad_views)

    def _bind_grads(self, grad_views: list[torch.Tensor]) -> None:
        for p, g in zip(self._params, grad_views, strict=True):
            p.grad = g

    def _sync_params(self) -> None:
        """Copy parameters whose data was replaced (p.data = ...) back into the flat buffer.

        Skipped inside ``torch.compile``: Dynamo cannot compare data pointers, so a compiled step relies on the
        binding that the constructor, ``begin_round``, ``end_round`` and every eager step restore."""
        if torch.compiler.is_compiling():
            return
        for p, v in zip(self._params, self._x_views, strict=True):
            if p.data.data_ptr() != v.data_ptr():
                v.copy_(p.data)
                p.data = v

    def _gather(self, views: list[torch.Tensor]) -> None:
        """Make every p.grad the view of the bound flat buffer (copying gradients that autograd put elsewhere).

        Autograd accumulates into a bound view in place, so ``p.grad`` is then the view object itself (an identity
        test, which Dynamo traces, unlike a data-pointer comparison)."""
        for p, v in zip(self._params, views, strict=True):
            if p.grad is None:
                v.zero_()
                p.grad = v
            elif p.grad is not v:
                v.copy_(p.grad)
                p.grad = v

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffer the parameters are bound to (``.grad`` stays bound to it)."""
        first = self._params[0].grad
        second = self._g2 is not None and first is self._g2_views[0]
        buffer, views = (self._g2, self._g2_views) if second else (self._g1, self._g1_views)
        buffer.zero_()
        for p, v in zip(self._params, views, strict=True):
            p.grad = v

    # rounds --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def begin_round(self, h: torch.Tensor | None = None) -> None:
        """Start a round at the current parameters x^t; ``h`` optionally replaces the internal correction buffer
        (e.g. a row of a [clients, d] store) for this round."""
        self._sync_params()
        if h is not None and (h.shape != self._x.shape or h.dtype != self._x.dtype or h.device != self._x.device):
            raise ValueError(f"h must be a [{self._x.numel()}] {self._x.dtype} tensor on {self._x.device}")
        self._external_h = h
        state = self._state
        state["x_round"].copy_(self._x)
        if self._hyper["lam"] is not None:
            if "anchor" not in state:
                state["anchor"] = torch.empty_like(self._x)
            ops.weighted_sum([self.h, self._x], [1.0, -1.0], out=state["anchor"])  # D = h − x^t
        state["in_round"] = True

    @torch.no_grad()
    def end_round(
        self,
        acc: torch.Tensor | None = None,
        acc_weight: float = 1.0,
        include_h: bool = True,
        h_sum: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """End the round: h += x_K − x^t (when correcting) and acc += acc_weight·(x_K + h) (x_K alone with
        include_h=False); h_sum, when given, gains x_K − x^t. Without ``acc`` a new [d] tensor x̂ = x_K + h is
        returned, else ``acc``."""
        state = self._state
        if not state["in_round"]:
            raise RuntimeError("end_round() without begin_round()")
        self._sync_params()
        if acc is None:
            acc = torch.zeros_like(self._x)
        if self.correction and self._hyper["lam"] is not None:
            ops.fedspeed_round_end_(
                self.h, self._x, state["x_round"], acc=acc, acc_weight=acc_weight, include_h=include_h, h_sum=h_sum
            )
        else:
            ops.accumulate_(acc, self._x, acc_weight)
            if include_h:
                ops.accumulate_(acc, self.h, acc_weight)
        state["in_round"] = False
        self._external_h = None
        return acc

    # the step ------------------------------------------------------------------------------------------

    def _second_buffers(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        if self._perturbed is None:
            self._perturbed = torch.empty_like(self._x)
            self._perturbed_views = _views(self._perturbed, self._params)
            self._g2 = torch.zeros_like(self._x)
            self._g2_views = _views(self._g2, self._params)
        return self._perturbed, self._perturbed_views, self._g2, self._g2_views

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One local step; returns the closure's loss at x (None without a closure).

        ``closure`` evaluates the loss of the current batch and calls ``backward()`` (gradients are zeroed before
        each call). With ρ > 0 it is called twice: at x and at x̆. Without a closure (only when ρ = 0) the
        gradients already in ``.grad`` are used.
        """
        group = self._hyper
        rho, alpha, lam = group["rho"], group["alpha"], group["lam"]
        check_fedspeed_params(lam=lam, rho=rho, alpha=alpha, eps=group["eps"], rho_mode=self.rho_mode)
        perturb = rho > 0
        with torch.no_grad():
            self._sync_params()
            if not self._state["in_round"]:
                self.begin_round()
        loss = None
        if closure is None:
            if perturb:
                raise ValueError("FedSpeedOptimizer.step needs a closure when rho > 0 (for the second gradient)")
            with torch.no_grad():
                self._gather(self._g1_views)
        else:
            with torch.no_grad():
                self._bind_grads(self._g1_views)  # the data is bound already (_sync_params)
                self._g1.zero_()
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                self._gather(self._g1_views)
        g2 = self._g2_at_perturbed_point(closure, group) if perturb else self._g1
        with torch.no_grad():
            ops.fedspeed_update_(
                self._x,
                g2,
                group["lr"],
                g1=self._g1 if perturb and alpha < 1 else None,
                alpha=alpha if perturb else 1.0,
                anchor=self._state.get("anchor") if lam is not None else None,
                prox_coef=0.0 if lam is None else 1.0 / lam,
                weight_decay=group["weight_decay"],
                clip_norm=self.clip_norm,
            )
        if torch.compiler.is_compiling() and isinstance(loss, torch.Tensor):
            loss = loss.detach()  # its graph was consumed by backward(): a compiled function cannot return it
        return loss

    def _g2_at_perturbed_point(self, closure: Callable[[], Any], group: dict[str, Any]) -> torch.Tensor:
        """Call the closure at x̆ = x + ρ·g1/(‖g1‖ + ε) with the gradients bound to the second buffer; that buffer.

        Eager, the parameters are rebound to views of the buffer holding x̆. Inside ``torch.compile`` x̆ is
        written into x itself and x is restored bit for bit afterwards (AOTAutograd cannot trace rebinding the
        parameters to views of another buffer); the results are the same."""
        x_pert, x_pert_views, g2, g2_views = self._second_buffers()
        normalize = self.rho_mode == "normalized"
        compiling = torch.compiler.is_compiling()
        with torch.no_grad():
            if compiling:
                saved = self._x.clone()
                ops.sam_perturb(saved, self._g1, group["rho"], eps=group["eps"], normalize=normalize, out=self._x)
                self._bind_grads(g2_views)
            else:
                ops.sam_perturb(self._x, self._g1, group["rho"], eps=group["eps"], normalize=normalize, out=x_pert)
                self._bind(x_pert_views, g2_views)
            g2.zero_()
        try:
            with torch.enable_grad():
                closure()
            with torch.no_grad():
                self._gather(g2_views)
        finally:
            with torch.no_grad():
                if compiling:
                    self._x.copy_(saved)
                    self._bind_grads(self._g1_views)
                else:
                    self._bind(self._x_views, self._g1_views)
        return g2


@dataclass
class FedSpeed(Algorithm):
    """FedSpeed's client/server rounds on flat vectors, per Algorithm 1 in the storage form h_i = −λ·ĝ_i.

    Client i (K local steps from x^t, the shared batch used for both gradients): x ← x − η[g̃ − ĝ_i + (1/λ)(x − x^t)
    + wd·x]; then h_i += x_K − x^t and the upload x̂_i = x_K + h_i is added into the server's sum, chunk by chunk.
    Server: x^{t+1} = mean over the S participants of x̂_i (``corr_avg="active"``, Algorithm 1) or
    mean_S(x_K) + mean over all m clients of h_i (``corr_avg="all"``, the reference code, via a running Σ_m h_i).
    Spread over processes (``ctx.team``), each process trains the participants it owns, keeps the h_i of its own
    clients and the running sum of those h_i, and the processes add up their sums of uploads (and of h_i) for the
    server step.
    Both means are plain 1/S (and 1/m) means, as in Algorithm 1 and in FedDyn; FedAvg, FedProx, SCAFFOLD and FedSAM
    weight their participants by |D_i| instead. So the special cases (perturbation alone = FedSAM, prox alone =
    FedProx, no switch = FedAvg) equal those baselines only when the clients have equal sizes; otherwise they equal
    them with equal weights.
    η is ``ctx.lr(t)`` (constant within a round) and wd is ``ctx.weight_decay``; momentum is not used.

    Args:
        lam: λ > 0; the paper's "prox weight" is 1/λ (0.1 → lam = 10).
        rho: ascent radius ρ ≥ 0 (ρ0 of ρ0/‖g1‖ with rho_mode "normalized").
        alpha: α ∈ [0, 1] (paper's best 0.9375; the reference code uses 1).
        eps: ε of ρ/(‖g1‖ + ε).
        rho_mode: "normalized" or "raw".
        use_prox, use_correction, use_perturb: the ablation switches (correction needs the prox term).
        ref_compat: clip ‖g̃ + (1/λ)D‖ at ``clip_norm`` before the step, as FL-Simulator does.
        clip_norm: the clip threshold of ref_compat.
        corr_avg: "active" or "all".
    """

    distributed = True  # its round goes through ctx.team

    name = "fedspeed"
    lam: float = 10.0
    rho: float = 0.1
    alpha: float = 1.0
    eps: float = 1e-7
    rho_mode: str = "normalized"
    use_prox: bool = True
    use_correction: bool = True
    use_perturb: bool = True
    ref_compat: bool = False
    clip_norm: float = 10.0
    corr_avg: str = "active"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fedspeed_params(lam=self.lam, rho=self.rho, alpha=self.alpha, eps=self.eps, rho_mode=self.rho_mode)
        if self.use_correction and not self.use_prox:
            raise ValueError("use_correction needs use_prox (the correction is built from the prox term)")
        if self.corr_avg not in CORR_AVG:
            raise ValueError(f"corr_avg must be one of {CORR_AVG}, got {self.corr_avg!r}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise ValueError(f"clip_norm must be finite and > 0, got {self.clip_norm}")

    def setup(self, ctx: FLContext, x0: torch.Tensor) -> None:
        super().setup(ctx, x0)
        if ctx.momentum:
            raise ValueError(f"{self.name}: local momentum is not part of the algorithm; set momentum to 0")
        self.num_clients = int(ctx.num_clients)
        d = self.x.numel()
        owned = owned_clients(ctx)
        self.h_store = (
            ClientStore(ctx.num_clients, d, device=self.x.device, dtype=self.x.dtype, owned=owned)
            if self.use_correction
            else None
        )
        self.h_total = torch.zeros_like(self.x)  # Σ h_i over the clients of h_store (this process's, when spread)

    def state_rows_per_client(self, ctx: FLContext) -> int:
        return 5  # h_i, D = h_i − x^t, the perturbed point, the second gradient, the first one kept for α < 1

    def round(self, t: int, ctx: FLContext) -> RoundStats:
        clients = self.participants(t, ctx)
        team = ctx.team
        weight = 1.0 / len(clients) if len(clients) else 0.0
        sums = RoundSums()  # the sums of this process's clients: uploads/S and, for "all", Σ h_i
        losses: list[torch.Tensor] = []
        for chunk in client_chunks(ctx, team.mine(clients), self.state_rows_per_client(ctx)):
            with ctx.timer("local"):
                updates = self.client_update(t, chunk, ctx)
            with ctx.timer("aggregation"):
                sums.add("upload", updates.vectors["model"], np.full(len(updates), weight))
            losses.append(updates.losses)
        with ctx.timer("aggregation"):
            if self.corr_avg == "all":
                sums.vectors["h_total"] = self.h_total
            sums, losses, _ = team.combine(t, sums, losses, 0)
            if len(clients):
                if self.corr_avg == "all":
                    ops.weighted_sum(
                        [sums.vector("upload"), sums.vector("h_total")], [1.0, 1.0 / self.num_clients], out=self.x
                    )
                else:
                    self.x.copy_(sums.vector("upload"))
        return RoundStats(
            clients=np.asarray(clients, dtype=np.int64),
            local_loss=mean_loss(losses),
            upload_floats=len(clients) * self.x.numel(),
            download_floats=len(clients) * self.broadcast_floats(),
        )

    def client_update(self, t: int, clients: np.ndarray, ctx: FLContext) -> ClientUpdates:
        """The local rounds of ``clients``: each step one gradient g1 at x (and with the perturbation a second, g2,
        at x̆ = x + ρ·g1/(‖g1‖ + ε), :func:`~pyfedkern.ops.sam_perturb`), then the fused step
        :func:`~pyfedkern.ops.fedspeed_update_`; at the end :func:`~pyfedkern.ops.fedspeed_round_end_` updates h_i
        (and, for ``corr_avg="all"``, the running Σ h_i). Each row's upload ("model") is x̂_i = x_K + h_i, or x_K
        for "all"; weights 1 (the server takes the plain mean)."""
        run = local_run(ctx, t, clients)
        x = run.start(self.x)
        h = self.h_store.take(run.clients) if self.use_correction else None
        prox = self.use_prox
        anchor = None
        if prox:  # D = h_i − x^t (h_i = 0 without the correction)
            anchor = h - self.x if h is not None else torch.neg(self.x).expand(len(run), -1)
        perturb = self.use_perturb and self.rho > 0
        alpha = self.alpha if perturb else 1.0
        normalize = self.rho_mode == "normalized"
        x_pert = torch.empty_like(x) if perturb else None
        g1_kept = torch.empty_like(x) if alpha < 1 else None  # on the loop the second gradient overwrites the first
        for step in run.run(x):
            g1 = g2 = run.gradients(step)
            if perturb:
                if g1_kept is not None:
                    g1 = g1_kept[step.span].copy_(g1)
                point = ops.sam_perturb(step.x, g1, self.rho, eps=self.eps, normalize=normalize, out=x_pert[step.span])
                g2 = run.gradients(step, point, record=False)
            ops.fedspeed_update_(
                step.x,
                g2,
                run.lr,
                g1=g1 if alpha < 1 else None,
                alpha=alpha,
                anchor=anchor[step.span] if prox else None,
                prox_coef=1.0 / self.lam if prox else 0.0,
                weight_decay=ctx.weight_decay,
                clip_norm=self.clip_norm if self.ref_compat else None,
            )
        if h is not None:
            reference_server = self.corr_avg == "all"
            ops.fedspeed_round_end_(h, x, self.x, h_sum=self.h_total if reference_server else None)
            self.h_store.put_(run.clients, h)
            if not reference_server:
                x.add_(h)
        return ClientUpdates.of(run, ctx, {"model": x}, weights=np.ones(len(run)))

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "h_total": self.h_total}
        if self.h_store is not None:
            state["h"] = self.h_store.data
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.h_store is not None:
            self.h_store.data.copy_(state["h"])
        self.h_total.copy_(state["h_total"])
