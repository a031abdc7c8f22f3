"""Local training of many clients at once: their models as the rows of one [k, d] tensor, one batched step each.

A Python loop over clients is dominated by per-call overhead at the sizes FL simulations use (module
forward/backward, optimizer bookkeeping, one small kernel per layer per client). Here the clients of a round train
together (:class:`BatchedLocal`): each local step is one batched gradient of all the rows on their own minibatches
(:class:`BatchedTrainer`) and one batched update, with an algorithm's per-client terms applied row-wise (weight
decay, momentum, FedProx's prox term, SCAFFOLD's control variates, ...). The minibatches are those of
``ctx.batches`` for each client, gathered a step at a time (``ctx.stacked_batches``,
:class:`~pyfedkern.algorithms.context.StackedBatches`), so the batched path and the per-client loop
(:func:`~pyfedkern.algorithms.local_sgd`) agree up to floating-point rounding.

Gradients:

- models that are a chain of Flatten / Linear / ReLU layers under cross-entropy (an ``nn.Sequential`` of them, or
  a model whose ``layer_chain()`` lists them, like the engine's ``mlp`` and ``logreg``) skip autograd: their
  forward and backward for all k clients are a few batched matmuls (:class:`LinearChainGradients`);
- any other model without persistent buffers (CNNs, ResNets with GroupNorm, transformers, models with another loss
  or a penalty) uses ``torch.func``: ``vmap(grad(objective))`` over (parameters, batch) pairs, each client's
  parameters views of its row;
- models with persistent buffers (BatchNorm running statistics) cannot be vmapped this way: :func:`use_batched` is
  False for them and the engine loops over clients.

A row holds the model's trainable parameters only (:func:`pyfedkern.flat.trainable_parameters`): frozen parameters
and buffers are the module's own tensors, read by every row and never copied (a frozen backbone or ``peft`` LoRA
adapters cost memory per row in proportion to what trains). A tied weight or a module used twice has one entry in
the row, its gradient the sum over its uses, as torch's on the per-client loop.

Batching is not always the faster path: on the CPU, vmapped convolutions and LSTM layers run slower than the same
layers called once per client. :func:`~pyfedkern.algorithms.paths.choose_path` picks the faster path for a model
(rules where the answer is known, else a short measurement of both); the engine takes it unless the user forces one.

Rows that run out of minibatches stop: the clients are ordered by descending number of steps, so the clients still
training at step s are the first a_s rows and every step works on a prefix view of the [k, d] tensor. Losses are
summed on the device; nothing waits for the GPU between steps. :func:`client_chunks` splits a round's participants
into chunks whose rows fit a memory budget.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from pyfedkern.algorithms.context import FLContext
from pyfedkern.algorithms.local import LocalModel
from pyfedkern.flat import Entry, trainable_parameters

logger = logging.getLogger("pyfedkern")


class _Objective(nn.Module):
    """forward(x, y[, w][, soft]) = the local training objective, so that the loss and penalty see the swapped
    parameters; with ``soft`` (teacher log-probabilities [B, C]) plus ``kd_weight``·KL(teacher ‖ model)."""

    def __init__(self, local: LocalModel) -> None:
        super().__init__()
        self.model = local.module
        self.local = [local]  # a plain list: not registered as a submodule
        self.kd_weight = 0.0

    def forward(
        self, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor | None = None, soft: torch.Tensor | None = None
    ) -> torch.Tensor:
        local = self.local[0]
        out = self.model(xb)
        if wb is None:
            total = local.objective(out, yb)
        else:
            # Σ_j wb[j]·loss(sample j) + penalty: one forward of the whole (padded) batch, the loss per sample.
            per_sample = vmap(lambda o, y: local.data_loss(o.unsqueeze(0), y.unsqueeze(0)))(out, yb)
            total = (per_sample * wb).sum()
            total = total + local.penalty(self.model) if local.penalty is not None else total
        if soft is not None:
            kl = (soft.exp() * (soft - torch.log_softmax(out, dim=1))).sum(1)  # KL per sample
            total = total + self.kd_weight * (kl.mean() if wb is None else (kl * wb).sum())
        return total


class Unbatchable(ValueError):
    """The model's objective cannot be vmapped (``.item()``, Python control flow on a tensor, ...); ``reason``:
    the first sentence of torch's error."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            f"batched: the model cannot be trained batched ({reason}); pass batched=False (--batched false)"
        )
        self.reason = reason


def can_batch(local: LocalModel) -> bool:
    """Whether the model can be trained with the vmapped step: no persistent buffer (running statistics, which
    training updates); non-persistent ones (constant masks, position ids) are read by every row."""
    return not any(
        name not in module._non_persistent_buffers_set
        for module in local.module.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    )


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
    """A Linear layer of a chain: its weight [out, in] and bias [out] (None without one), each where it sits in the
    row when it trains, else the frozen tensor itself."""

    weight: Entry | torch.Tensor
    bias: Entry | torch.Tensor | None

    @property
    def trains(self) -> bool:
        """Whether the layer has a trainable parameter."""
        return isinstance(self.weight, Entry) or isinstance(self.bias, Entry)


class LinearChainGradients:
    """Per-row gradients of cross-entropy for a Flatten/Linear/ReLU chain, forward and backward written by hand.

    With the k rows' weights W_l [k, out, in] (views of the rows), activations h_l [k, B, ·] and per-sample weights
    w [k, B]: logits z = h_L W_Lᵀ + b_L; loss_r = Σ_j w_rj·CE(z_rj, y_rj); ∂loss/∂z = w·(softmax(z) − onehot(y));
    then per Linear layer ∂W = (∂z)ᵀh, ∂b = Σ_j ∂z, ∂h = (∂z)W, masked by h > 0 through each ReLU. Frozen weights
    and biases are the module's tensors, shared by the rows, and get no gradient; a weight used by several layers
    (tied, or a layer used twice) gets the sum of their gradients.
    """

    def __init__(self, layers: list[nn.Module], entries: dict[str, Entry], module: nn.Module) -> None:
        names = {id(p): n for n, p in trainable_parameters(module)}

        def ref(p: torch.Tensor | None) -> Entry | torch.Tensor | None:
            return None if p is None else entries[names[id(p)]] if id(p) in names else p.detach()

        #: the chain without its Flatten layers: a _Linear per Linear layer, "relu" per ReLU
        self.plan: list[_Linear | str] = []
        for layer in layers:
            if isinstance(layer, nn.Linear):
                self.plan.append(_Linear(ref(layer.weight), ref(layer.bias)))
            elif isinstance(layer, nn.ReLU):
                self.plan.append("relu")
        #: position in the plan of the first Linear layer that trains (the backward pass stops there)
        self.first_linear = next(i for i, step in enumerate(self.plan) if step != "relu" and step.trains)
        before_first_linear = layers[: next(i for i, layer in enumerate(layers) if isinstance(layer, nn.Linear))]
        #: whether the chain flattens every sample before its first Linear layer (else samples must be vectors)
        self.flattens_input = any(isinstance(layer, nn.Flatten) for layer in before_first_linear)

    @staticmethod
    def applies(local: LocalModel) -> list[nn.Module] | None:
        """The chain of ``local``'s module when this class computes its objective (plain cross-entropy, every
        parameter in the chain's Linear layers), else None."""
        module = local.module
        if local.loss is not F.cross_entropy or local.penalty is not None:
            return None
        layers = layer_chain(module)
        if layers is None:
            return None
        linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
        chained = {id(p) for layer in linears for p in layer.parameters()}
        return layers if chained and chained == {id(p) for p in module.parameters()} else None

    def accepts(self, rows: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> bool:
        """Whether the batch suits the chain: inputs of the rows' dtype, integer labels, samples that are vectors
        unless the chain flattens them."""
        return xb.dtype == rows.dtype and not yb.is_floating_point() and (xb.dim() == 3 or self.flattens_input)

    def __call__(
        self,
        rows: torch.Tensor,
        xb: torch.Tensor,
        yb: torch.Tensor,
        weights: torch.Tensor | None,
        soft: torch.Tensor | None = None,
        kd_weight: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradients [k, d], losses [k]) of rows [k, d] on batches xb [k, B, ...], yb [k, B] (int64 labels); with
        teacher log-probabilities ``soft`` [k, B, C] the loss gains kd_weight·Σ_j w_j·KL(teacher_j ‖ model_j)
        (∂/∂z: kd_weight·w·(softmax(z) − teacher))."""
        k, batch = xb.shape[:2]
        h = xb.reshape(k, batch, -1)
        inputs: list[torch.Tensor] = []  # the input of each plan step
        for step in self.plan:
            inputs.append(h)
            if step == "relu":
                h = torch.relu(h)
            else:
                h = torch.matmul(h, self._value(rows, step.weight).mT)
                if isinstance(step.bias, Entry):
                    h += self._view(rows, step.bias)[:, None]
                elif step.bias is not None:
                    h += step.bias
        if weights is None:
            weights = torch.full((k, batch), 1.0 / batch, dtype=h.dtype, device=h.device)
        # log-softmax by hand: torch's kernel is slow over a last dimension as short as the number of classes
        shifted = h - h.amax(-1, keepdim=True)
        dz = shifted.exp()
        log_norm = dz.sum(-1, keepdim=True)
        dz.div_(log_norm)  # softmax
        log_norm.log_()
        target = yb.unsqueeze(-1)
        losses = ((log_norm - shifted.gather(-1, target)).squeeze(-1) * weights).sum(1)
        if soft is not None:
            kl = (soft.exp() * (soft - shifted + log_norm)).sum(-1)
            losses = losses + kd_weight * (kl * weights).sum(1)
            dz = dz.mul_(1.0 + kd_weight).sub_(soft.exp(), alpha=kd_weight)
        dz.scatter_add_(-1, target, torch.full(target.shape, -1.0, dtype=dz.dtype, device=dz.device))
        dz.mul_(weights[..., None])
        grads = torch.empty_like(rows)
        written: set[int] = set()  # offsets of the entries written: a weight used again adds its gradient

        def put(e: Entry, g: torch.Tensor) -> None:
            view = self._view(grads, e)
            if e.offset in written:
                view.add_(g)
            else:
                view.copy_(g)
                written.add(e.offset)

        for i in range(len(self.plan) - 1, self.first_linear - 1, -1):
            step, h_in = self.plan[i], inputs[i]
            if step == "relu":
                dz = dz * (h_in > 0)
                continue
            if isinstance(step.weight, Entry):
                put(step.weight, torch.bmm(dz.mT, h_in))
            if isinstance(step.bias, Entry):
                put(step.bias, dz.sum(1))
            if i > self.first_linear:
                dz = torch.matmul(dz, self._value(rows, step.weight))
        return grads, losses

    @staticmethod
    def _view(rows: torch.Tensor, e: Entry) -> torch.Tensor:
        return rows[:, e.offset : e.offset + e.numel].view(rows.shape[0], *e.shape)

    @classmethod
    def _value(cls, rows: torch.Tensor, ref: Entry | torch.Tensor) -> torch.Tensor:
        """The rows' views [k, ...] of a trained entry, or the frozen tensor (broadcast over the rows)."""
        return cls._view(rows, ref) if isinstance(ref, Entry) else ref


def _parameter_slots(module: nn.Module) -> list[tuple[str, str]]:
    """(place, name) of every place a trainable parameter sits in ``module`` (a submodule's attribute, each
    submodule once however often it is used) and the parameter's name in :func:`trainable_parameters`."""
    names = {id(p): n for n, p in trainable_parameters(module)}
    slots, seen = [], set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub._parameters.items():
            if p is not None and id(p) in names and (id(sub), attr) not in seen:
                seen.add((id(sub), attr))
                slots.append((f"{prefix}.{attr}" if prefix else attr, names[id(p)]))
    return slots


class BatchedTrainer:
    """Per-row gradients of a :class:`~pyfedkern.algorithms.LocalModel`'s objective (built once per model:
    :func:`trainer_for`)."""

    def __init__(self, local: LocalModel) -> None:
        self.local = local
        self.objective = _Objective(local)
        self.entries = [e for e in local.flat.layout.entries if not e.carried]

        self._slots = _parameter_slots(local.module)

        def objective(params: dict[str, torch.Tensor], *batch: torch.Tensor) -> torch.Tensor:
            return self.call(self.objective, params, batch)

        # Two ways to the rows' gradients. "backward" vmaps only the forward and runs one plain backward of the rows'
        # summed losses (row r's loss depends on row r's parameters only): it frees each layer's saved activations
        # as it goes, so a row costs its activations and its parameters. "func" vmaps torch.func's grad, which keeps
        # them all to the end of the backward (it differentiates with create_graph) but decomposes ops that have no
        # batching rule of their own (LSTM) and lays out large weight gradients without a transposing copy. Mostly
        # frozen models (adapters, a trained head), whose activations dwarf their rows, try "backward" first.
        self._losses = vmap(objective, randomness="different")  # (params, xb, yb[, wb[, soft]]) -> [k]
        self._soft_losses = vmap(lambda p, xb, yb, soft: objective(p, xb, yb, None, soft), randomness="different")
        step = grad_and_value(objective)
        self._step = vmap(step, randomness="different")
        self._soft_step = vmap(lambda p, xb, yb, soft: step(p, xb, yb, None, soft), randomness="different")
        trained = sum(e.numel for e in self.entries)
        frozen = sum(p.numel() for p in local.module.parameters() if not p.requires_grad)
        #: the modes the first vmapped step tries, in order; ``mode`` the one that ran (None before the first step)
        self.modes = ("backward", "func") if frozen > trained else ("func", "backward")
        self.mode: str | None = None
        chain = LinearChainGradients.applies(local)
        self.chain = (
            None if chain is None else LinearChainGradients(chain, {e.name: e for e in self.entries}, local.module)
        )
        self._activations: int | None = None

    def params(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each row's parameters as views, keyed "model.<name>" (a submodule named ``model`` holding the module)."""
        k = rows.shape[0]
        return {f"model.{e.name}": rows[:, e.offset : e.offset + e.numel].view(k, *e.shape) for e in self.entries}

    def call(self, wrapper: nn.Module, params: dict[str, torch.Tensor], args: tuple) -> Any:
        """``wrapper(*args)`` (a module holding the model as submodule ``model``) with the model's trainable
        parameters replaced by ``params`` (keyed as :meth:`params`'s): every place a trained tensor sits gets its
        value (a tied weight the same tensor at each place, so autograd sums its gradients; a module used twice is
        one place, swapped once); frozen parameters and buffers stay the module's own."""
        swapped = {f"model.{slot}": params[f"model.{name}"] for slot, name in self._slots}
        return functional_call(wrapper, swapped, args, tie_weights=False)

    def gradients(
        self,
        rows: torch.Tensor,
        xb: torch.Tensor,
        yb: torch.Tensor,
        weights: torch.Tensor | None = None,
        soft: torch.Tensor | None = None,
        kd_weight: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row gradients [k, d] of the objective at each row's parameters on its batch, and the losses [k].

        With ``weights`` [k, B] the objective of row r is Σ_j weights[r, j]·objective(sample j) instead of the
        batch objective: padded batches of unequal size, with weight 1/b_r on the real samples and 0 on padding
        (exact for objectives that are a mean over samples plus a penalty, on models without batch statistics,
        which the vmapped step requires anyway). With ``soft`` [k, B, C] (a teacher's log-probabilities) the
        objective gains kd_weight·KL(teacher ‖ model), averaged (or weighted) over the batch like the loss.
        """
        if weights is not None:  # float64 for integer inputs (padding_weights)
            weights = weights.to(rows.dtype)
        if self.chain is not None and self.chain.accepts(rows, xb, yb):
            return self.chain(rows, xb, yb, weights, soft, kd_weight)
        self.local.module.train()
        self.objective.kd_weight = kd_weight
        batch = tuple(t for t in (xb, yb, weights, soft) if t is not None)
        soft_only = soft is not None and weights is None
        if self.mode is None:
            grads, losses = self._first_step(rows, batch, soft_only)
        else:
            grads, losses = self._vmapped_gradients(rows, batch, soft_only)
        return torch.cat([g.reshape(rows.shape[0], -1) for g in grads], dim=1), losses.detach()

    def _vmapped_gradients(
        self, rows: torch.Tensor, batch: tuple, soft_only: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Each parameter's per-row gradients [k, *shape] and the losses [k], the way of ``mode``."""
        if self.mode == "backward":
            params = {name: view.detach().requires_grad_() for name, view in self.params(rows).items()}
            with torch.enable_grad():
                losses = (self._soft_losses if soft_only else self._losses)(params, *batch)
                return list(torch.autograd.grad(losses.sum(), list(params.values()), materialize_grads=True)), losses
        named, losses = (self._soft_step if soft_only else self._step)(self.params(rows), *batch)
        return list(named.values()), losses

    def _first_step(self, rows: torch.Tensor, batch: tuple, soft_only: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``_vmapped_gradients`` in the first of ``modes`` that runs, the random state restored after a
        failed try (a resumed run makes the same draws); Unbatchable when neither runs."""
        cuda = rows.device.type == "cuda"
        for mode in self.modes:
            state = torch.cuda.get_rng_state(rows.device) if cuda else torch.get_rng_state()
            self.mode = mode
            try:
                return self._vmapped_gradients(rows, batch, soft_only)
            except RuntimeError as err:
                self.mode, error = None, err
                if isinstance(err, torch.OutOfMemoryError):
                    raise
                if cuda:
                    torch.cuda.set_rng_state(state, rows.device)
                else:
                    torch.set_rng_state(state)
        raise Unbatchable(f"{type(error).__name__}: {str(error).splitlines()[0].split('. ')[0]}") from error

    def activations_per_sample(self, sample: torch.Tensor) -> int:
        """Elements of every layer's output for one sample (measured once with forward hooks): the memory scale of
        a batched forward and backward, per sample."""
        if self._activations is None:
            total = [0]

            def count(module: nn.Module, inputs: Any, output: Any) -> None:
                if isinstance(output, torch.Tensor):
                    total[0] += output.numel()

            leaves = [m for m in self.local.module.modules() if not list(m.children())]
            handles = [m.register_forward_hook(count) for m in leaves]
            try:
                batch = sample.unsqueeze(0)  # token ids stay integers
                with torch.no_grad():
                    self.local.module(batch.to(self.local.flat.data.dtype) if batch.is_floating_point() else batch)
            finally:
                for h in handles:
                    h.remove()
            self._activations = max(total[0], 1)
        return self._activations


_TRAINERS: weakref.WeakKeyDictionary[LocalModel, BatchedTrainer] = weakref.WeakKeyDictionary()


def trainer_for(local: LocalModel) -> BatchedTrainer:
    """The :class:`BatchedTrainer` of ``local`` (built on first use, kept while ``local`` lives)."""
    trainer = _TRAINERS.get(local)
    if trainer is None:
        trainer = _TRAINERS[local] = BatchedTrainer(local)
    return trainer


def use_batched(ctx: FLContext) -> bool:
    """Whether a round's participants train as batched steps: the context allows it (``ctx.batched``) and its
    model can be batched (:func:`can_batch`)."""
    return bool(ctx.batched) and can_batch(ctx.local)


# Batched local training ----------------------------------------------------------------------------------------


@dataclass
class Step:
    """One local step of ``rows`` clients, rows ``span`` of a run: step ``index`` of each, ``x`` their models (a
    [rows, d] view of the [k, d] models, updated in place) and their minibatches [rows, B, ...] (``wb`` their
    samples' weights when some rows have fewer, else None). Batched, a step covers the first rows (start 0); on the
    loop, one row at a time. Per-client state [k, ...] of the run's rows is ``state[step.span]``."""

    index: int
    rows: int
    x: torch.Tensor
    xb: torch.Tensor
    yb: torch.Tensor
    wb: torch.Tensor | None
    soft: torch.Tensor | None = None  # a distillation teacher's log-probabilities [rows, B, C]
    start: int = 0

    @property
    def span(self) -> slice:
        """The step's rows of the run, start : start + rows."""
        return slice(self.start, self.start + self.rows)


class BatchedLocal:
    """The local training of k clients in round t, their models the rows of one [k, d] tensor.

    Plans the clients' minibatches (``ctx.stacked_batches``) and orders the clients by descending number of steps;
    row r of every [k, ·] tensor belongs to client ``clients[r]``, so per-client state must be gathered in that
    order (``store[run.index]``).

    Args:
        ctx: the FL context (data, learning rate, batch size, weight decay, momentum).
        t: round index (seeds the minibatch order, as for :func:`~pyfedkern.algorithms.local_sgd`).
        clients: the clients to train.
        order, drop_last, epochs, steps: as for ``ctx.batches`` (defaults: ctx.local_steps if set, else
            ctx.local_epochs).
        lr: local learning rate (default ``ctx.lr(t)``).

    Attributes:
        clients: int64 numpy [k] in row order; ``index`` the same as a tensor on ctx.device.
        steps: int64 numpy [k] local steps of each row (descending).
        loss_sum: float64 [k] on the device, each row's sum of minibatch losses at its unperturbed model.
    """

    def __init__(
        self,
        ctx: FLContext,
        t: int,
        clients: Sequence[int] | np.ndarray,
        *,
        order: str = "reshuffle",
        drop_last: bool = False,
        epochs: float | None = None,
        steps: int | None = None,
        lr: float | None = None,
    ) -> None:
        if steps is None and epochs is None:
            steps, epochs = ctx.local_steps, ctx.local_epochs
        self.ctx = ctx
        self.batches = ctx.stacked_batches(clients, t, epochs=epochs, steps=steps, order=order, drop_last=drop_last)
        self.clients = np.asarray(self.batches.clients, dtype=np.int64)
        self.steps = np.asarray(self.batches.steps, dtype=np.int64)
        self.index = torch.as_tensor(self.clients, device=ctx.device)
        self.lr = ctx.lr(t) if lr is None else lr
        self.t = t
        self.trainer = trainer_for(ctx.local)
        #: local DP-SGD (``ctx.dpsgd``): every step's gradients are private ones, noise keyed by (t, client, step)
        self.dp = ctx.dpsgd
        self.loss_sum = torch.zeros(len(self.clients), dtype=torch.float64, device=ctx.device)
        #: a distillation teacher (module) and weight, when the context's model has them (dynamic's Continuous)
        self.teacher = ctx.local.teacher
        self.kd_weight = float(ctx.local.kd_weight)

    def __len__(self) -> int:
        return len(self.clients)

    def start(self, x0: torch.Tensor) -> torch.Tensor:
        """Every row's starting model: [k, d] copies of the global model x0 [d]."""
        return x0.expand(len(self), -1).clone()

    def run(self, models: torch.Tensor) -> Iterator[Step]:
        """The local steps over ``models`` [k, d] (contiguous): one :class:`Step` per minibatch step."""
        if models.dim() != 2 or models.shape[0] != len(self) or not models.is_contiguous():
            raise ValueError(f"models must be a contiguous [{len(self)}, d] tensor, got shape {tuple(models.shape)}")
        for s, (xb, yb, wb) in enumerate(self.batches):
            rows = xb.shape[0]
            soft = None
            if self.teacher is not None:
                with torch.no_grad():
                    out = self.teacher(xb.reshape(-1, *xb.shape[2:]))
                    soft = torch.log_softmax(out, dim=1).reshape(rows, xb.shape[1], -1)
            yield Step(s, rows, models[:rows], xb, yb, wb, soft)

    def gradients(self, step: Step, x: torch.Tensor | None = None, *, record: bool = True) -> torch.Tensor:
        """Gradients [rows, d] of the step's rows at ``x`` (default: their models) on their minibatches; their
        losses are added to ``loss_sum`` unless ``record`` is False."""
        if self.dp is not None:
            g, losses = self._private_gradients(step, step.x if x is None else x)
        else:
            g, losses = self.trainer.gradients(
                step.x if x is None else x, step.xb, step.yb, step.wb, step.soft, self.kd_weight
            )
        if record:
            self.loss_sum[: step.rows] += losses
        return g

    def _private_gradients(self, step: Step, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DP-SGD gradients [rows, d] and losses [rows] of the step's rows at x, as one batched step
        (:meth:`pyfedkern.dpsgd.DPSGD.batched_gradients`); row r's noise is the loop's for client ``clients[r]``."""
        if step.soft is not None:
            raise ValueError("dpsgd: local DP-SGD with a distillation teacher is not supported")
        local, rows = self.ctx.local, x.shape[0]
        params = {e.name: x[:, e.offset : e.offset + e.numel].view(rows, *e.shape) for e in self.trainer.entries}
        keys = [(self.t, int(c), step.index) for c in self.clients[:rows]]
        local.module.train()
        grads, losses = self.dp.batched_gradients(
            local.module, local.loss, params, step.xb, step.yb, keys, step.wb, penalty=local.penalty
        )
        return torch.cat([grads[e.name].reshape(rows, -1) for e in self.trainer.entries], dim=1), losses

    def sgd_(
        self,
        models: torch.Tensor,
        *,
        correction: Callable[[torch.Tensor, Step], None] | None = None,
        weight_decay: float | None = None,
    ) -> torch.Tensor:
        """Minibatch SGD of every row in place, as :func:`~pyfedkern.algorithms.local_sgd` per client:
        x ← x − lr·(g + wd·x [+ correction]), heavy-ball momentum when ctx.momentum > 0.

        Args:
            correction: called as ``correction(g, step)`` after weight decay with g the step's [rows, d] direction;
                may modify g in place (BHerd records it; the FedAvg family builds its whole direction here, clip
                and weight decay included, with ``weight_decay=0``).
            weight_decay: wd (default ``ctx.weight_decay``).

        Returns ``models``.
        """
        wd, momentum = self.ctx.weight_decay if weight_decay is None else weight_decay, self.ctx.momentum
        buffer = torch.empty_like(models) if momentum else None
        for step in self.run(models):
            g = self.gradients(step)
            if wd:
                g.add_(step.x, alpha=wd)
            if correction is not None:
                correction(g, step)
            direction = g
            if buffer is not None:
                direction = buffer[: step.rows]
                if step.index == 0:
                    direction.copy_(g)
                else:
                    direction.mul_(momentum).add_(g)
            step.x.add_(direction, alpha=-self.lr)
        return models

    def losses(self) -> torch.Tensor:
        """Mean minibatch loss of each row, float64 [k] on the device (NaN for rows without steps)."""
        steps = torch.as_tensor(self.steps, dtype=torch.float64, device=self.loss_sum.device)
        return self.loss_sum / steps


# Memory ----------------------------------------------------------------------------------------------------------

#: The share of free memory a chunk of participants may use (of the GPU's free memory, or of the available RAM).
MEMORY_FRACTION = {"cuda": 0.5, "cpu": 0.25}
#: Bytes of messages (two [d] vectors a client) a chunk of the per-client loop holds before they are folded into
#: the round's sums: small enough that the allocator hands the same memory back chunk after chunk (glibc maps every
#: block over 32 MiB afresh, which costs a page fault per 4 KiB), large enough to fold many small models at once.
LOOP_CHUNK_BYTES = 16 << 20


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: ``torch.cuda.mem_get_info`` on a GPU; on the CPU the least of MemAvailable (else
    total RAM), the room under this process's rlimits (:func:`rlimit_room`) and under its cgroup's memory limit
    (:func:`cgroup_room`)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    free = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        with open("/proc/meminfo") as f:
            free = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), free)
    except OSError:
        pass
    return min(room for room in (free, rlimit_room(), cgroup_room()) if room is not None)


def rlimit_room(status: str = "/proc/self/status") -> int | None:
    """Bytes this process may still allocate under its soft RLIMIT_AS (less its VmSize) and RLIMIT_DATA (less its
    VmData), the usage read from ``status``; None when neither limit is set."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    used = {}
    try:
        with open(status) as f:
            fields = (line.partition(":") for line in f)
            used = {k: int(v.split()[0]) * 1024 for k, _, v in fields if k in ("VmSize", "VmData")}
    except (OSError, ValueError):
        pass
    rooms = []
    for limit, field in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            rooms.append(max(0, soft - used.get(field, 0)))
    return min(rooms, default=None)


def cgroup_room(mount: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> int | None:
    """Bytes left under the memory limits of this process's cgroup and of its ancestors (the cgroups named in
    ``membership``, under ``mount``): cgroup v2 ``memory.max`` less ``memory.current``, v1
    ``memory/memory.limit_in_bytes`` less ``memory.usage_in_bytes``, the reclaimable page cache (``inactive_file``
    of ``memory.stat``) counted as free; None when no limit is set or cgroups are not there."""
    try:
        with open(membership) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            base, files = Path(mount), _CGROUP_V2
        elif "memory" in controllers.split(","):
            base, files = Path(mount, "memory"), _CGROUP_V1
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the cgroup, then its ancestors up to the mount's root
            room = _cgroup_room(base.joinpath(*parts[:depth]), *files)
            if room is not None:
                rooms.append(room)
    return min(rooms, default=None)


#: A cgroup's memory files: its limit, its usage and the memory.stat entry of its reclaimable page cache.
_CGROUP_V2 = ("memory.max", "memory.current", "inactive_file")
_CGROUP_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


def _cgroup_room(folder: Path, limit: str, usage: str, cache: str) -> int | None:
    """``limit`` less (``usage`` less the ``cache`` entry of memory.stat) in the cgroup ``folder``; None without a
    limit (``max``, v1's page-rounded 2^63, or no such files)."""
    try:
        text = (folder / limit).read_text().strip()
        if text == "max" or int(text) >= 1 << 62:
            return None
        used = int((folder / usage).read_text())
    except (OSError, ValueError):
        return None
    try:
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        used -= int(stat.get(cache, 0))
    except (OSError, ValueError):
        pass
    return max(0, int(text) - max(0, used))


def bytes_per_client(ctx: FLContext, state_rows: int) -> int:
    """Memory one participant takes in batched training: its model, gradient, second gradient and message rows,
    momentum, ``state_rows`` more [d] buffers (per-client state, recorded gradients), and its minibatch's
    activations through the forward and backward pass."""
    local = ctx.local
    itemsize = local.flat.data.element_size()
    rows = 5 + state_rows + (1 if ctx.momentum else 0)
    sample = ctx.sample_input
    activations = 0
    if sample is not None and can_batch(local):
        activations = 3 * ctx.batch_size * trainer_for(local).activations_per_sample(sample)
    return itemsize * (rows * local.dim + activations)


def client_chunks(ctx: FLContext, clients: np.ndarray, state_rows: int = 2) -> Iterator[np.ndarray]:
    """``clients`` in consecutive chunks to train at once: ``ctx.client_chunk`` clients when set; on the per-client
    loop as many as :data:`LOOP_CHUNK_BYTES` of their messages and ``state_rows`` allow; batched, as many as fit
    :data:`MEMORY_FRACTION` of the free memory (:func:`bytes_per_client`; divided among ``ctx.device_sharers``
    processes when set); one chunk when everything fits. Nothing when ``clients`` is empty."""
    clients = np.asarray(clients, dtype=np.int64).reshape(-1)
    size = ctx.client_chunk
    if size is None and not use_batched(ctx):
        rows = max(2, state_rows)  # of each client: its messages and state
        size = max(1, LOOP_CHUNK_BYTES // (rows * ctx.local.dim * ctx.local.flat.data.element_size()))
    elif size is None:
        device = torch.device(ctx.device)
        budget = MEMORY_FRACTION["cuda" if device.type == "cuda" else "cpu"] * free_memory(device)
        budget /= ctx.device_sharers  # the processes of a distributed run on the same memory
        size = max(1, int(budget // max(bytes_per_client(ctx, state_rows), 1)))
    for start in range(0, len(clients), size):
        yield clients[start : start + size]
