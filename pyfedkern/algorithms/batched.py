"""Local SGD of many clients at once: one vectorised step over stacked parameters instead of a loop over models.

FedPBC trains all m clients every round. For small models a Python loop over clients is dominated by per-call
overhead (module forward/backward, optimizer bookkeeping), so :func:`batched_local_sgd_` stacks the clients' flat
models as the rows of a [k, d] tensor and takes each SGD step for all of them with ``torch.func``:
``vmap(grad(objective))`` over (parameters, batch) pairs, where each client's parameters are views of its row.

The update is the one of :func:`~pyfedkern.algorithms.local_sgd` (weight decay, heavy-ball momentum, the model's own
``loss``/``penalty``), on the same minibatches (``ctx.batches``), so the two agree up to floating-point rounding.
Models with buffers (BatchNorm running statistics) cannot be vmapped this way and fall back to the loop.

Models that are a chain of Flatten / Linear / ReLU layers under cross-entropy (an ``nn.Sequential`` of them, or a
model whose ``layer_chain()`` lists them, like the engine's ``mlp`` and ``logreg``) skip autograd altogether: their
forward and backward for all k clients are a few batched matmuls (:class:`LinearChainGradients`). At the sizes FL
simulations use (digits MLP, k = 100, B = 16) the vmapped autograd step is bound by per-operator overhead, and the
hand-written one is several times faster.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.utils.rnn import pad_sequence

from pyfedkern.algorithms.base import Batch, FLContext, local_sgd
from pyfedkern.algorithms.local import LocalModel
from pyfedkern.flat import Entry


class _Objective(nn.Module):
    """forward(x, y) = the local training objective, so that loss() and penalty() see the swapped parameters."""

    def __init__(self, local: LocalModel) -> None:
        super().__init__()
        self.model = local.module
        self.local = [local]  # a plain list: not registered as a submodule

    def forward(self, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor | None = None) -> torch.Tensor:
        local = self.local[0]
        if wb is None:
            return local.objective(self.model(xb), yb)
        # Σ_j wb[j]·loss(sample j) + penalty: one forward of the whole (padded) batch, the loss per sample.
        out = self.model(xb)
        per_sample = vmap(lambda o, y: local.data_loss(o.unsqueeze(0), y.unsqueeze(0)))(out, yb)
        penalty = getattr(self.model, "penalty", None)
        weighted = (per_sample * wb).sum()
        return weighted + penalty() if penalty is not None else weighted


def can_batch(local: LocalModel) -> bool:
    """Whether the model can be trained with the vmapped step (no buffers, one float dtype)."""
    return not any(True for _ in local.module.buffers())


def layer_chain(module: nn.Module) -> list[nn.Module] | None:
    """The layers whose composition is ``module`` (``module.layer_chain()``, or an ``nn.Sequential``'s children,
    nested ones expanded) when they are all Flatten (of every non-batch dimension), Linear or ReLU, else None."""
    if hasattr(module, "layer_chain"):
        layers = list(module.layer_chain())
    elif isinstance(module, nn.Sequential):
        layers = list(module)
    else:
        return None
    flat: list[nn.Module] = []
    for layer in layers:
        if isinstance(layer, nn.Sequential):
            inner = layer_chain(layer)
            if inner is None:
                return None
            flat += inner
        elif isinstance(layer, (nn.Linear, nn.ReLU)) or (
            isinstance(layer, nn.Flatten) and layer.start_dim == 1 and layer.end_dim == -1
        ):
            flat.append(layer)
        else:
            return None
    return flat


@dataclass(frozen=True)
class _Linear:
    """A Linear layer of a chain: where its weight [out, in] and bias [out] (None without one) sit in the row."""

    weight: Entry
    bias: Entry | None


class LinearChainGradients:
    """Per-row gradients of cross-entropy for a Flatten/Linear/ReLU chain, forward and backward written by hand.

    With the k rows' weights W_l [k, out, in] (views of the rows), activations h_l [k, B, ·] and per-sample weights
    w [k, B]: logits z = h_L W_Lᵀ + b_L; loss_r = Σ_j w_rj·CE(z_rj, y_rj); ∂loss/∂z = w·(softmax(z) − onehot(y));
    then per Linear layer ∂W = (∂z)ᵀh, ∂b = Σ_j ∂z, ∂h = (∂z)W, masked by h > 0 through each ReLU.
    """

    def __init__(self, layers: list[nn.Module], entries: dict[str, Entry], module: nn.Module) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        #: the chain without its Flatten layers: a _Linear per Linear layer, "relu" per ReLU
        self.plan: list[_Linear | str] = []
        for layer in layers:
            if isinstance(layer, nn.Linear):
                bias = None if layer.bias is None else entries[names[id(layer.bias)]]
                self.plan.append(_Linear(entries[names[id(layer.weight)]], bias))
            elif isinstance(layer, nn.ReLU):
                self.plan.append("relu")
        #: position in the plan of the first Linear layer (the backward pass stops there)
        self.first_linear = next(i for i, step in enumerate(self.plan) if step != "relu")
        before_first_linear = layers[: next(i for i, layer in enumerate(layers) if isinstance(layer, nn.Linear))]
        #: whether the chain flattens every sample before its first Linear layer (else samples must be vectors)
        self.flattens_input = any(isinstance(layer, nn.Flatten) for layer in before_first_linear)

    @staticmethod
    def applies(local: LocalModel) -> list[nn.Module] | None:
        """The chain of ``local``'s module when this class computes its objective (plain cross-entropy, every
        parameter in the chain's Linear layers, each layer used once), else None."""
        module = local.module
        if any(hasattr(module, hook) for hook in ("loss", "penalty")):
            return None
        layers = layer_chain(module)
        if layers is None:
            return None
        linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
        if len({id(layer) for layer in linears}) != len(linears):  # a layer used twice: its gradients would add up
            return None
        chained = {id(p) for layer in linears for p in layer.parameters()}
        return layers if chained and chained == {id(p) for p in module.parameters()} else None

    def accepts(self, rows: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> bool:
        """Whether the batch suits the chain: inputs of the rows' dtype, integer labels, samples that are vectors
        unless the chain flattens them."""
        return xb.dtype == rows.dtype and not yb.is_floating_point() and (xb.dim() == 3 or self.flattens_input)

    def __call__(
        self, rows: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradients [k, d], losses [k]) of rows [k, d] on batches xb [k, B, ...], yb [k, B] (int64 labels)."""
        k, batch = xb.shape[:2]
        h = xb.reshape(k, batch, -1)
        inputs: list[torch.Tensor] = []  # the input of each plan step
        for step in self.plan:
            inputs.append(h)
            if step == "relu":
                h = torch.relu(h)
            else:
                h = torch.bmm(h, self._view(rows, step.weight).mT)
                if step.bias is not None:
                    h += self._view(rows, step.bias)[:, None]
        if weights is None:
            weights = torch.full((k, batch), 1.0 / batch, dtype=h.dtype, device=h.device)
        log_p = torch.log_softmax(h, dim=-1)
        target = yb.unsqueeze(-1)
        losses = -(log_p.gather(-1, target).squeeze(-1) * weights).sum(1)
        dz = log_p.exp_()  # softmax
        dz.scatter_add_(-1, target, torch.full(target.shape, -1.0, dtype=dz.dtype, device=dz.device))
        dz.mul_(weights[..., None])
        grads = torch.empty_like(rows)
        for i in range(len(self.plan) - 1, self.first_linear - 1, -1):
            step, h_in = self.plan[i], inputs[i]
            if step == "relu":
                dz = dz * (h_in > 0)
                continue
            self._view(grads, step.weight).copy_(torch.bmm(dz.mT, h_in))
            if step.bias is not None:
                self._view(grads, step.bias).copy_(dz.sum(1))
            if i > self.first_linear:
                dz = torch.bmm(dz, self._view(rows, step.weight))
        return grads, losses

    @staticmethod
    def _view(rows: torch.Tensor, e: Entry) -> torch.Tensor:
        return rows[:, e.offset : e.offset + e.numel].view(rows.shape[0], *e.shape)


class BatchedTrainer:
    """Vectorised SGD steps for the shared :class:`LocalModel` of an FL context (built once, reused each round)."""

    def __init__(self, local: LocalModel) -> None:
        self.local = local
        self.objective = _Objective(local)
        self.entries = [e for e in local.flat.layout.entries if not e.carried]

        def loss(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            return functional_call(self.objective, params, (xb, yb))

        def masked_loss(
            params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor
        ) -> torch.Tensor:
            return functional_call(self.objective, params, (xb, yb, wb))

        self._step = vmap(grad_and_value(loss), in_dims=(0, 0, 0), randomness="different")
        self._masked_step = vmap(grad_and_value(masked_loss), in_dims=(0, 0, 0, 0), randomness="different")
        chain = LinearChainGradients.applies(local)
        self.chain = (
            None if chain is None else LinearChainGradients(chain, {e.name: e for e in self.entries}, local.module)
        )

    def _params(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        k = rows.shape[0]
        return {f"model.{e.name}": rows[:, e.offset : e.offset + e.numel].view(k, *e.shape) for e in self.entries}

    def gradients(
        self, rows: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row gradients [k, d] of the objective at each row's parameters on its batch, and the losses [k].

        With ``weights`` [k, B] the objective of row r is Σ_j weights[r, j]·objective(sample j) instead of the
        batch objective: padded batches of unequal size, with weight 1/b_r on the real samples and 0 on padding
        (exact for objectives that are a mean over samples plus a penalty, on models without batch statistics,
        which the vmapped step requires anyway).
        """
        if self.chain is not None and self.chain.accepts(rows, xb, yb):
            return self.chain(rows, xb, yb, weights)
        self.local.module.train()
        params = self._params(rows)
        if weights is None:
            grads, losses = self._step(params, xb, yb)
        else:
            grads, losses = self._masked_step(params, xb, yb, weights)
        flat = torch.cat([grads[f"model.{e.name}"].reshape(rows.shape[0], -1) for e in self.entries], dim=1)
        return flat, losses.detach()


def batched_local_sgd_(
    ctx: FLContext,
    t: int,
    models: torch.Tensor,
    clients: Sequence[int] | np.ndarray,
    *,
    trainer: BatchedTrainer | None = None,
    lr: float | None = None,
    steps: int | None = None,
    epochs: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Local SGD of every client in ``clients`` from its row of ``models`` ([k, d], trained in place).

    Each step stacks the next minibatch of every client that still has one and updates all those rows in one
    vmapped step. The batches come from ``ctx.stacked_batches`` when the context has it (the engine gathers every
    client's batch of a step at once), else from each client's ``ctx.batches``. Batches of unequal size (clients
    holding fewer samples than the batch size) are padded to the largest and weighted per sample (see
    :meth:`BatchedTrainer.gradients`).

    Args:
        ctx: the FL context (data, learning rate, batch size, weight decay, momentum).
        t: round index (seeds the batch order, as for :func:`local_sgd`).
        models: [k, d] float tensor on ctx.device, row r the model of client ``clients[r]``.
        trainer: a :class:`BatchedTrainer` to reuse (built when None). Models with buffers use the per-client loop.

    Returns:
        (mean loss per client [k], steps per client [k]).
    """
    clients = [int(c) for c in clients]
    k = len(clients)
    if models.dim() != 2 or models.shape[0] != k:
        raise ValueError(f"models must be [{k}, d] (one row per client), got shape {tuple(models.shape)}")
    losses = np.zeros(k)
    counts = np.zeros(k, dtype=np.int64)
    if k == 0:
        return losses, counts
    if steps is None and epochs is None:
        steps, epochs = ctx.local_steps, ctx.local_epochs
    lr = ctx.lr(t) if lr is None else lr
    if not can_batch(ctx.local):
        for r, cid in enumerate(clients):
            result = local_sgd(ctx, cid, t, models[r], lr=lr, steps=steps, epochs=epochs)
            models[r].copy_(result.x)
            losses[r], counts[r] = result.loss, result.steps
        return losses, counts
    trainer = trainer or BatchedTrainer(ctx.local)
    stacked = getattr(ctx, "stacked_batches", None)
    if stacked is not None:
        batches = stacked(clients, t, steps=steps, epochs=epochs)
    else:
        batches = _stack_per_client(ctx, clients, t, steps=steps, epochs=epochs)
    momentum = torch.zeros_like(models) if ctx.momentum else None
    for rows, xb, yb, wb in batches:
        everyone = len(rows) == k
        index = None if everyone else torch.as_tensor(rows, device=models.device)
        current = models if everyone else models.index_select(0, index)
        g, batch_losses = trainer.gradients(current, xb, yb, wb)
        if ctx.weight_decay:
            g.add_(current, alpha=ctx.weight_decay)
        direction = g
        if momentum is not None:
            first = torch.as_tensor(counts[rows] == 0, device=models.device)[:, None]
            buf = momentum if everyone else momentum.index_select(0, index)
            buf = torch.where(first, g, buf * ctx.momentum + g)
            if everyone:
                momentum.copy_(buf)
            else:
                momentum.index_copy_(0, index, buf)
            direction = buf
        if everyone:
            models.add_(direction, alpha=-lr)
        else:
            models.index_copy_(0, index, current - lr * direction)
        losses[rows] += batch_losses.cpu().numpy()
        counts[rows] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, losses / np.maximum(counts, 1), np.nan), counts


def _stack_per_client(
    ctx: FLContext, clients: Sequence[int], t: int, **kwargs: Any
) -> Iterator[tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``stacked_batches`` for a context that only has ``batches``: the next batch of every client that still has
    one, stacked (rows, xb, yb, wb) per step."""
    iterators: list[Iterator[Batch] | None] = [ctx.batches(cid, t, **kwargs) for cid in clients]
    while True:
        ready: list[tuple[int, Batch]] = []
        for r, it in enumerate(iterators):
            batch = None if it is None else next(it, None)
            if batch is None:
                iterators[r] = None
            else:
                ready.append((r, batch))
        if not ready:
            return
        xb, yb, wb = _stack_batches([b for _, b in ready])
        yield np.array([r for r, _ in ready], dtype=np.int64), xb, yb, wb


def _stack_batches(batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stack k batches to [k, B, ...]; unequal sizes are zero-padded to the largest, with per-sample weights."""
    sizes = [int(b[1].shape[0]) for b in batches]
    if len(set(sizes)) == 1 and len({tuple(b[0].shape) for b in batches}) == 1:
        return torch.stack([b[0] for b in batches]), torch.stack([b[1] for b in batches]), None
    xb = pad_sequence([b[0] for b in batches], batch_first=True)
    yb = pad_sequence([b[1] for b in batches], batch_first=True)
    return xb, yb, padding_weights(sizes, xb)


def padding_weights(sizes: Sequence[int], xb: torch.Tensor) -> torch.Tensor:
    """[k, B] per-sample weights of k batches of ``sizes`` zero-padded into xb [k, B, ...]: 1/b_r on the b_r real
    samples of batch r, 0 on its padding (xb's float dtype, or the default one for integer inputs)."""
    n = torch.as_tensor(sizes, device=xb.device)
    dtype = xb.dtype if xb.is_floating_point() else torch.get_default_dtype()
    real = torch.arange(xb.shape[1], device=xb.device)[None, :] < n[:, None]
    return real.to(dtype) / n[:, None].to(dtype)
