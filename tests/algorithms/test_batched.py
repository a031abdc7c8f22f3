"""Batched local training: the hand-written gradients of Flatten/Linear/ReLU chains against the vmapped autograd
step, and which models take which path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyfedkern.algorithms.batched import BatchedTrainer, LinearChainGradients, layer_chain
from pyfedkern.algorithms.context import padding_weights
from pyfedkern.algorithms.local import LocalModel
from pyfedkern.models import build_model


def _nested_sequential() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 9), nn.ReLU(), nn.Sequential(nn.Linear(9, 5, bias=False)))


def _one_layer_applied_twice() -> nn.Module:
    shared = nn.Linear(5, 5)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), shared, nn.ReLU(), shared)


MODELS = {
    "mlp": lambda: build_model("mlp", (3, 4), 5, hidden=(8, 6)),
    "logreg": lambda: build_model("logreg", (3, 4), 5),
    "sequential": _nested_sequential,
    "applied twice": _one_layer_applied_twice,  # its weight's gradient: the sum over its two uses
}


def _trainer(name: str, dtype: torch.dtype) -> BatchedTrainer:
    torch.manual_seed(0)
    return BatchedTrainer(LocalModel(MODELS[name]().to(dtype)))


def _batch(trainer: BatchedTrainer, k: int, batch: int, dtype: torch.dtype, scale: float = 1.0):
    gen = torch.Generator().manual_seed(1)
    rows = trainer.local.flat.data.expand(k, -1) + 0.3 * torch.randn(k, trainer.local.dim, generator=gen, dtype=dtype)
    xb = scale * torch.randn(k, batch, 3, 4, generator=gen, dtype=dtype)
    yb = torch.randint(0, 5, (k, batch), generator=gen)
    return rows.contiguous(), xb, yb


def _vmapped(trainer: BatchedTrainer, *args):
    chain, trainer.chain = trainer.chain, None
    try:
        return trainer.gradients(*args)
    finally:
        trainer.chain = chain


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("padded", [False, True])
def test_chain_gradients_match_the_vmapped_step(name, dtype, padded):
    trainer = _trainer(name, dtype)
    assert trainer.chain is not None
    rows, xb, yb = _batch(trainer, k=6, batch=5, dtype=dtype)
    weights = padding_weights([5, 1, 3, 5, 2, 4], xb) if padded else None
    grads, losses = trainer.gradients(rows, xb, yb, weights)
    expected_grads, expected_losses = _vmapped(trainer, rows, xb, yb, weights)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-13}
    torch.testing.assert_close(grads, expected_grads, **tol)
    torch.testing.assert_close(losses, expected_losses, **tol)


def test_chain_gradients_stay_finite_for_huge_logits():
    trainer = _trainer("mlp", torch.float32)
    rows, xb, yb = _batch(trainer, k=3, batch=4, dtype=torch.float32, scale=1e4)
    grads, losses = trainer.gradients(rows, xb, yb)
    expected_grads, expected_losses = _vmapped(trainer, rows, xb, yb)
    assert torch.isfinite(grads).all() and torch.isfinite(losses).all()
    torch.testing.assert_close(grads, expected_grads, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-2)


def test_samples_that_are_not_vectors_need_a_flatten_first():
    torch.manual_seed(0)
    unflattened = BatchedTrainer(LocalModel(nn.Sequential(nn.Linear(4, 5))))
    assert unflattened.chain is not None
    rows = unflattened.local.flat.data.expand(2, -1).contiguous()
    xb, yb = torch.randn(2, 3, 4), torch.randint(0, 5, (2, 3))
    assert unflattened.chain.accepts(rows, xb, yb)
    assert not unflattened.chain.accepts(rows, xb[:, :, None], yb)  # [k, B, 1, 4]: Linear acts on the last dim
    assert not unflattened.chain.accepts(rows, xb, yb.double())  # float targets: not class labels
    assert not unflattened.chain.accepts(rows.double(), xb, yb)


@pytest.mark.parametrize(
    "module",
    [
        build_model("svm", (3, 4), 5),  # its own loss and penalty
        build_model("cnn", (1, 8, 8), 5),
        nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 5)),
        nn.Sequential(nn.Flatten(start_dim=2), nn.Linear(4, 5)),
    ],
)
def test_other_models_use_the_vmapped_step(module):
    assert LinearChainGradients.applies(LocalModel(module)) is None
    assert BatchedTrainer(LocalModel(module)).chain is None


def test_layer_chain_expands_nested_sequentials():
    layers = layer_chain(_nested_sequential())
    assert [type(layer) for layer in layers] == [nn.Flatten, nn.Linear, nn.ReLU, nn.Linear]
    assert layer_chain(build_model("cnn", (1, 8, 8), 5)) is None


def _frozen_backbone_cnn() -> nn.Module:
    model = build_model("cnn", (1, 8, 8), 5)
    for p in list(model.parameters())[:-2]:  # all but the last layer's weight and bias
        p.requires_grad_(False)
    return model


def _frozen_lstm() -> nn.Module:
    class Text(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(500, 16)  # frozen, and larger than the trained layers
            self.lstm = nn.LSTM(16, 16, batch_first=True)
            self.head = nn.Linear(16, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            dropped = nn.functional.dropout(self.embed(x), 0.3, self.training)  # draws before the LSTM fails
            return self.head(self.lstm(dropped)[0][:, -1])

    model = Text()
    model.embed.requires_grad_(False)
    return model


def _inputs(module: nn.Module, k: int, batch: int, tokens: bool = False):
    gen = torch.Generator().manual_seed(2)
    local = LocalModel(module)
    rows = local.flat.data.expand(k, -1) + 0.1 * torch.randn(k, local.dim, generator=gen, dtype=torch.float64)
    if tokens:
        xb = torch.randint(0, 7, (k, batch, 6), generator=gen)
    else:
        xb = torch.randn(k, batch, 1, 8, 8, generator=gen, dtype=torch.float64)
    return local, rows.contiguous(), xb, torch.randint(0, 5, (k, batch), generator=gen)


@pytest.mark.parametrize(
    "factory, first",
    [(lambda: build_model("cnn", (1, 8, 8), 5), "func"), (_frozen_backbone_cnn, "backward")],
    ids=["cnn", "frozen backbone"],
)
@pytest.mark.parametrize("padded", [False, True])
def test_both_vmapped_modes_give_the_same_gradients(factory, first, padded):
    torch.manual_seed(0)
    local, rows, xb, yb = _inputs(factory().double(), k=4, batch=3)
    weights = padding_weights([3, 1, 2, 3], xb) if padded else None
    trainer = BatchedTrainer(local)
    assert trainer.modes[0] == first  # a mostly frozen model frees its activations during the backward
    grads, losses = trainer.gradients(rows, xb, yb, weights)
    assert trainer.mode == first
    other = BatchedTrainer(local)
    other.modes = other.modes[::-1]
    expected_grads, expected_losses = other.gradients(rows, xb, yb, weights)
    assert other.mode != first
    torch.testing.assert_close(grads, expected_grads, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-12, atol=1e-14)
    frozen = [p for p in local.module.parameters() if not p.requires_grad]
    assert all(p.grad is None for p in frozen)


def test_a_mode_that_cannot_run_falls_back_with_the_random_state_kept():
    torch.manual_seed(0)
    local, rows, xb, yb = _inputs(_frozen_lstm().double(), k=3, batch=4, tokens=True)
    trainer = BatchedTrainer(local)
    assert trainer.modes == ("backward", "func")  # the LSTM has no batching rule outside torch.func's grad
    torch.manual_seed(5)
    grads, losses = trainer.gradients(rows, xb, yb)
    after_fallback = torch.get_rng_state()
    assert trainer.mode == "func"
    direct = BatchedTrainer(local)
    direct.modes = ("func",)
    torch.manual_seed(5)
    expected_grads, expected_losses = direct.gradients(rows, xb, yb)
    assert torch.equal(torch.get_rng_state(), after_fallback)  # the failed try's draws were given back
    assert torch.equal(grads, expected_grads) and torch.equal(losses, expected_losses)  # the same dropout masks
