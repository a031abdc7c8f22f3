"""Benchmark cases of one local DP-SGD step (clip C = 1, σ = 1, SGD) against the same non-private step and Opacus.

Groups: pfl's ``simple_cnn`` on CIFAR-10-shaped batches, the MLP 3072-512-256-10 and LEAF's Shakespeare LSTM
(``lstm``: 80 tokens, embedding 8, two layers of 256), at batch 10 and 64 (quick: batch 10, the CNN and the MLP).
Cases, each one step (gradient and update) on one model and batch, in float32:

- ``pyfedkern DP-SGD``: :meth:`pyfedkern.algorithms.LocalModel.private_loss_and_grad` (book-keeping: one forward,
  one backward to the layer outputs, per-layer norms and clipped products, noise) and the update of the flat
  parameters, as the engine's per-client loop runs it;
- ``opacus hooks``: Opacus 1.6's ``PrivacyEngine.make_private`` (per-sample gradients through hooks, DPOptimizer);
- ``opacus ghost``: the same with ``grad_sample_mode="ghost"`` (ghost clipping: norms without per-sample gradients,
  then a second backward pass);
- ``limit:non-private step``: the same model's plain gradient (``LocalModel.loss_and_grad``) and update;
- ``limit:non-private step + noise``: the same, plus the DP-SGD noise of the step (``DPSGD.add_noise_`` on the flat
  gradient): what any DP-SGD step with this noise generator costs at least.

Opacus replaces the LSTM by its DPLSTM (``ModuleValidator.fix``); its cases are left out when it is not installed.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from pyfedkern.algorithms.local import LocalModel
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size
from pyfedkern.dpsgd import DPSGD
from pyfedkern.models import build_model

FULL = [(name, B) for name in ("simple_cnn", "mlp", "lstm") for B in (10, 64)]
QUICK = [("simple_cnn", 10), ("mlp", 10)]
CLIP, SIGMA, LR = 1.0, 1.0, 0.05


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "simple_cnn":
        return build_model("simple_cnn", (3, 32, 32), 10, dropout=False)
    if name == "mlp":
        return build_model("mlp", (3, 32, 32), 10, hidden=[512, 256])
    return build_model("lstm", (80,), 80)


def _batch(name: str, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "lstm":
        return torch.randint(0, 80, (B, 80), generator=gen), torch.randint(0, 80, (B,), generator=gen)
    return torch.randn(B, 3, 32, 32, generator=gen), torch.randint(0, 10, (B,), generator=gen)


def _opacus_step(name: str, x: torch.Tensor, y: torch.Tensor, mode: str) -> Any:
    """One Opacus DP-SGD step (zero_grad, forward, backward, DPOptimizer.step) of a fresh model, or None when
    Opacus is not installed."""
    try:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator
    except ImportError:
        return None
    model = ModuleValidator.fix(_model(name))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    settings = {"noise_multiplier": SIGMA, "max_grad_norm": CLIP, "poisson_sampling": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "ghost":
            model, optimizer, criterion, _ = PrivacyEngine().make_private(
                module=model,
                optimizer=optimizer,
                data_loader=loader,
                criterion=torch.nn.CrossEntropyLoss(),
                grad_sample_mode="ghost",
                **settings,
            )
        else:
            model, optimizer, _ = PrivacyEngine().make_private(
                module=model, optimizer=optimizer, data_loader=loader, **settings
            )
            criterion = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(model(x), y).backward()
        optimizer.step()

    return step


def _opacus_installed() -> bool:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per (model, batch size); CPU only (no GPU run has measured it)."""
    if device != "cpu":
        return []
    cache = InputCache()
    out: list[Case] = []
    for name, B in QUICK if quick else FULL:

        def inputs(name: str = name, B: int = B) -> dict:
            def build() -> dict:
                x, y = _batch(name, B)
                return {"x": x, "y": y}

            return cache.get((name, B), build)

        params = sum(p.numel() for p in _model(name).parameters())
        group = f"dpsgd step {name} B={B} P={fmt_size(params)} float32 cpu"

        def ours(name: str = name, inputs: Any = inputs) -> Any:
            a, local = inputs(), LocalModel(_model(name))
            dp = DPSGD(CLIP, SIGMA, seed=0)
            step = [0]

            def run() -> None:
                step[0] += 1
                local.private_loss_and_grad(dp, a["x"], a["y"], (0, 0, step[0]))
                local.flat.data.add_(local.flat.grad, alpha=-LR)

            return run

        def plain(name: str = name, inputs: Any = inputs, noise: bool = False) -> Any:
            a, local = inputs(), LocalModel(_model(name))
            dp = DPSGD(CLIP, SIGMA, seed=0)
            step = [0]

            def run() -> None:
                step[0] += 1
                local.loss_and_grad(a["x"], a["y"])
                if noise:
                    dp.add_noise_(local.flat.grad, (0, 0, step[0]), 1.0 / a["x"].shape[0])
                local.flat.data.add_(local.flat.grad, alpha=-LR)

            return run

        out.append(Case(group, "pyfedkern DP-SGD", ours))
        if _opacus_installed():
            for mode in ("hooks", "ghost"):

                def opacus(name: str = name, inputs: Any = inputs, mode: str = mode) -> Any:
                    a = inputs()
                    return _opacus_step(name, a["x"], a["y"], mode)

                out.append(Case(group, f"opacus {mode}", opacus))
        out.append(Case(group, "limit:non-private step", plain))
        out.append(Case(group, "limit:non-private step + noise", functools.partial(plain, noise=True)))
    return out
