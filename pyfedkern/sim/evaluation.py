"""Evaluation of a global model: test loss and accuracy, the user's own test metrics and train loss and accuracy on a
subset of the training data, each spread over the run's processes (``team.evaluate``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pyfedkern.algorithms import LocalModel
from pyfedkern.algorithms.context import Team


def evaluation_sets(
    x_test: torch.Tensor,
    y_test: torch.Tensor,
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    test_max: int | None,
    train_max: int,
    rng: Callable[..., np.random.Generator],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_test, y_test, x_train, y_train) evaluated: at most ``test_max`` test samples (None: all) and ``train_max``
    training samples, drawn without replacement from the streams ``rng(1)`` and ``rng()`` and kept in order."""
    if test_max is not None and len(y_test) > test_max:
        keep = np.sort(rng(1).choice(len(y_test), test_max, replace=False))
        x_test, y_test = x_test[keep], y_test[keep]
    train = np.arange(len(y_train))
    if train.size > train_max:
        train = np.sort(rng().choice(train, train_max, replace=False))
    return x_test, y_test, x_train[train], y_train[train]


class Evaluator:
    """Evaluates global models with ``local``'s model on fixed evaluation sets (:func:`evaluation_sets`).

    Args:
        local: the run's :class:`~pyfedkern.algorithms.LocalModel` (a global model is loaded into it).
        x_test, y_test, x_train, y_train: the evaluation sets, on the device; no train metrics when x_train is empty
            (``eval_train_max`` 0).
        user_evaluate: the user's ``evaluate(model, x, y) -> {name: number}`` of test metrics, or None.
    """

    def __init__(
        self,
        local: LocalModel,
        x_test: torch.Tensor,
        y_test: torch.Tensor,
        x_train: torch.Tensor,
        y_train: torch.Tensor,
        user_evaluate: Callable[..., Any] | None,
    ) -> None:
        self.local = local
        self.x_test, self.y_test, self.x_train, self.y_train = x_test, y_test, x_train, y_train
        self.user_evaluate = user_evaluate

    def evaluate(self, vector: torch.Tensor, team: Team, labels: np.ndarray | None) -> dict[str, float]:
        """Test loss/accuracy of the global model ``vector`` [d] (on the test samples of ``labels`` only, unless
        None), the user's own test metrics (``test_<name>``) and train loss/accuracy, spread over ``team``."""
        x, y = self.x_test, self.y_test
        if labels is not None:
            keep = torch.isin(y, torch.as_tensor(labels, device=y.device))
            x, y = x[keep], y[keep]

        def evaluate(xs: torch.Tensor, ys: torch.Tensor) -> tuple[float, float]:
            return self.local.evaluate(vector, xs, ys)

        test_loss, test_acc = team.evaluate(evaluate, x, y)
        result = {"test_loss": test_loss, "test_acc": test_acc}
        if self.user_evaluate is not None:
            result.update(self._user_metrics(x, y, taken=result))
        if len(self.y_train):
            train_loss, train_acc = team.evaluate(evaluate, self.x_train, self.y_train)
            result.update(train_loss=train_loss, train_acc=train_acc)
        return result

    @torch.no_grad()
    def _user_metrics(self, x: torch.Tensor, y: torch.Tensor, taken: dict[str, float]) -> dict[str, float]:
        """The user's ``evaluate(model, x, y)`` of the model loaded in ``local`` (eval mode), as ``test_<name>``;
        a name whose ``test_<name>`` is in ``taken`` (the engine's own metrics) is refused."""
        module = self.local.module
        module.eval()
        metrics = self.user_evaluate(module, x, y)
        if not isinstance(metrics, dict):
            raise TypeError(f"evaluate must return a dict of metric name → number, got {type(metrics).__name__}")
        out = {}
        for name, value in metrics.items():
            if f"test_{name}" in taken:
                raise ValueError(
                    f"evaluate: metric {name!r} would replace the engine's own test_{name}: give it another name"
                )
            try:
                out[f"test_{name}"] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"evaluate: metric {name!r} is {value!r}, not a number") from None
        return out
