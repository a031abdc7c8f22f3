"""LocalModel: one torch model bound to flat parameter/gradient buffers, with its training loss.

Simulated clients share one LocalModel: a client's model is loaded into ``flat.data`` ([d]), trained in place and
read back out. Its loss, penalty, prediction and whether accuracy is measured are given explicitly (nothing is
looked up on the module): cross-entropy, none, argmax and True unless said otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pyfedkern.dpsgd import DPSGD
from pyfedkern.flat import FlatParameters


class LocalModel:
    """A module whose parameters and gradients are views of flat [d] buffers ``flat.data`` / ``flat.grad``."""

    #: A distillation teacher whose log-probabilities the batched path's objective matches with weight
    #: ``kd_weight`` (DynamicInit's Continuous baseline sets both); None: none.
    teacher: nn.Module | None = None
    kd_weight: float = 0.0

    def __init__(
        self,
        module: nn.Module,
        *,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
        penalty: Callable[[nn.Module], torch.Tensor] | None = None,
        predict: Callable[[torch.Tensor], torch.Tensor] | None = None,
        has_accuracy: bool = True,
    ) -> None:
        """``loss(output, target)``: a batch's mean loss; ``penalty(module)``: a parameter regulariser added to the
        training objective; ``predict(output)``: int64 [B] classes (None: argmax over dim 1)."""
        self.module = module
        self.flat = FlatParameters(module)
        self.loss = loss
        self.penalty = penalty
        self._predict = predict
        self.has_accuracy = has_accuracy

    @property
    def dim(self) -> int:
        """d, the number of trainable parameters."""
        return self.flat.size

    def load_(self, vector: torch.Tensor) -> None:
        """Make the model's parameters equal to a flat [d] vector."""
        self.flat.load_(vector)

    def data_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch's outputs."""
        return self.loss(output, target)

    def objective(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Training objective: data loss plus the penalty if there is one."""
        loss = self.data_loss(output, target)
        return loss + self.penalty(self.module) if self.penalty is not None else loss

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        """Predicted labels [B] from a batch's outputs (the model's ``predict`` function, else the argmax)."""
        return self._predict(output) if self._predict is not None else output.argmax(dim=1)

    def loss_and_grad(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Set ``flat.grad`` to the gradient of the objective on one batch; return the objective's value."""
        self.module.train()
        self.flat.zero_grad()
        loss = self.objective(self.module(x), y)
        loss.backward()
        return float(loss.detach())

    def private_loss_and_grad(self, dp: DPSGD, x: torch.Tensor, y: torch.Tensor, key: tuple[int, ...]) -> float:
        """Set ``flat.grad`` to a DP-SGD gradient of one batch (:meth:`pyfedkern.dpsgd.DPSGD.gradient_`: clipped
        per-sample sum plus noise from the stream ``key``, over the batch size, plus the penalty's gradient); return
        the objective's value."""
        self.module.train()
        return dp.gradient_(self.module, self.loss, x, y, key, self.flat.grad, penalty=self.penalty)

    def sgd_step_(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
        """One plain SGD step on a batch, p ← p − lr·∇p of the objective; return the objective's value.

        Equal to :meth:`loss_and_grad` followed by ``flat.data.add_(flat.grad, alpha=-lr)``, but the gradients go
        straight into the update: ``flat.grad`` is neither zeroed nor written (one pass less over the model's
        memory for each)."""
        self.module.train()
        loss = self.objective(self.module(x), y)
        params = [p for p in self.module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                if g is not None:
                    p.add_(g, alpha=-lr)
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(
        self, vector: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048
    ) -> tuple[float, float]:
        """(mean objective, accuracy) of the model ``vector`` on (x, y); accuracy is NaN for models without one.

        Overwrites the working parameters with ``vector``.
        """
        if x.shape[0] == 0:
            return math.nan, math.nan
        self.load_(vector)
        self.module.eval()
        total, correct = 0.0, 0
        for start in range(0, x.shape[0], batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            out = self.module(xb)
            total += float(self.data_loss(out, yb)) * xb.shape[0]
            if self.has_accuracy:
                correct += int((self.predict(out) == yb).sum())
        loss = total / x.shape[0] + (float(self.penalty(self.module)) if self.penalty is not None else 0.0)
        return loss, (correct / x.shape[0] if self.has_accuracy else math.nan)
