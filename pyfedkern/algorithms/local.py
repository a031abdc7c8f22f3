"""LocalModel: one torch model bound to flat parameter/gradient buffers, with its training loss.

Simulated clients share one LocalModel: a client's model is loaded into ``flat.data`` ([d]), trained in place and
read back out. Models may define ``loss(output, target)``, ``penalty()`` (a parameter regulariser added to the
objective), ``predict(output)`` and ``has_accuracy``; plain modules get cross-entropy and argmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pyfedkern.flat import FlatParameters


class LocalModel:
    """A module whose parameters and gradients are views of flat [d] buffers ``flat.data`` / ``flat.grad``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.flat = FlatParameters(module)

    @property
    def dim(self) -> int:
        """d, the number of trainable parameters."""
        return self.flat.size

    @property
    def has_accuracy(self) -> bool:
        """Whether the model's outputs are class scores that an accuracy can be computed from."""
        return bool(getattr(self.module, "has_accuracy", True))

    def load_(self, vector: torch.Tensor) -> None:
        """Make the model's parameters equal to a flat [d] vector."""
        self.flat.load_(vector)

    def data_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean loss of a batch's outputs (the model's own ``loss`` or cross-entropy)."""
        loss_fn = getattr(self.module, "loss", None)
        return loss_fn(output, target) if loss_fn is not None else F.cross_entropy(output, target)

    def objective(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Training objective: data loss plus the model's ``penalty()`` if it has one."""
        loss = self.data_loss(output, target)
        penalty = getattr(self.module, "penalty", None)
        return loss + penalty() if penalty is not None else loss

    def predict(self, output: torch.Tensor) -> torch.Tensor:
        """Predicted labels [B] from a batch's outputs (the model's own ``predict``, else the argmax)."""
        predict_fn = getattr(self.module, "predict", None)
        return predict_fn(output) if predict_fn is not None else output.argmax(dim=1)

    def loss_and_grad(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Set ``flat.grad`` to the gradient of the objective on one batch; return the objective's value."""
        self.module.train()
        self.flat.zero_grad()
        loss = self.objective(self.module(x), y)
        loss.backward()
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
        penalty = getattr(self.module, "penalty", None)
        loss = total / x.shape[0] + (float(penalty()) if penalty is not None else 0.0)
        return loss, (correct / x.shape[0] if self.has_accuracy else math.nan)
