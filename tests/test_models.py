"""Models: parameter counts, shapes, features/classifier, SVM and quadratic losses, a short digits training run."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pyfedkern.algorithms import LocalModel
from pyfedkern.data.datasets import load_dataset
from pyfedkern.models import MODELS, build_model, builtin, hinge_predict, squared_hinge_loss, svm_penalty

SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "cifar": (3, 32, 32)}


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one intra-op thread is faster, and avoids oversubscription on busy machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _local(model: torch.nn.Module, name: str) -> LocalModel:
    """``model`` with the loss, penalty and prediction of built-in ``name``."""
    spec = builtin(name)
    return LocalModel(model, loss=spec.loss, penalty=spec.penalty, predict=spec.predict, has_accuracy=spec.has_accuracy)


def test_names():
    assert set(MODELS) == {"svm", "logreg", "mlp", "cnn", "resnet18", "quadratic", "simple_cnn", "lstm", "transformer"}


def test_simple_cnn_is_pfls_benchmark_cnn():
    model = build_model("simple_cnn", SHAPES["cifar"], 10)
    assert _count(model) == 1_626_442  # pfl-research's simple_cnn on CIFAR-10
    x = torch.randn(2, *SHAPES["cifar"])
    assert model(x).shape == (2, 10) and model.features(x).shape == (2, 128)
    dropouts = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts == [0.25, 0.5]
    assert all(m.p == 0 for m in build_model("simple_cnn", SHAPES["cifar"], 10, dropout=False).modules()
               if isinstance(m, torch.nn.Dropout))  # fmt: skip


def test_sequence_models_on_token_ids():
    lstm = build_model("lstm", (80,), 80)
    # LEAF's Shakespeare LSTM: embedding 80·8, two LSTM layers of 256 (4 gates, two biases each), FC 256 → 80
    assert _count(lstm) == 640 + (4 * 256 * (8 + 256) + 8 * 256) + (4 * 256 * 512 + 8 * 256) + 256 * 80 + 80
    tokens = torch.randint(0, 80, (3, 80))
    assert lstm(tokens).shape == (3, 80) and lstm.features(tokens).shape == (3, 256)
    transformer = build_model("transformer", (12,), 4, vocab=30, dim=16, heads=2)
    tokens = torch.randint(0, 30, (3, 12))
    assert transformer(tokens).shape == (3, 4) and transformer.features(tokens).shape == (3, 16)
    assert transformer(tokens[:, :5]).shape == (3, 4)  # shorter sequences use the first positions


@pytest.mark.parametrize(
    ("name", "shape", "kwargs", "match"),
    [
        ("lstm", (3, 8, 8), {}, "sequence length"),
        ("transformer", (8,), {"dim": 10, "heads": 4}, "heads must divide dim"),
        ("transformer", (8,), {"dropout": 1.0}, "dropout"),
        ("lstm", (8,), {"hidden": 0}, "lstm: hidden"),
        ("simple_cnn", (3, 5, 5), {}, "sides >= 6"),
    ],
)
def test_sequence_and_pfl_models_refuse_bad_arguments(name, shape, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model(name, shape, 10, **kwargs)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        # docs/bherd.md §6: d = 430,698 (MNIST) and 555,178 (CIFAR-10)
        # Digits: conv 832 + 25,632, fc 128·256+256, out 2,570
        (SHAPES["mnist"], 430_698),
        (SHAPES["cifar"], 555_178),
        (SHAPES["digits"], 832 + 25_632 + 33_024 + 2_570),
    ],
)
def test_cnn_parameter_counts(shape, expected):
    assert _count(build_model("cnn", shape, 10)) == expected


def test_resnet18_parameter_counts():
    cifar = build_model("resnet18", SHAPES["cifar"], 10)
    assert _count(cifar) == 11_173_962
    imagenet = build_model("resnet18", SHAPES["cifar"], 10, stem="imagenet")
    assert _count(imagenet) == 11_181_642  # torchvision resnet18 with 10 classes; GN has BN's affine count
    assert _count(build_model("resnet18", SHAPES["cifar"], 100, stem="imagenet")) == 11_227_812
    norms = [m for m in cifar.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(m.num_groups == 2 for m in norms)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in cifar.modules())
    assert all(m.num_groups == 4 for m in build_model("resnet18", SHAPES["cifar"], 10, groups=4).modules()
               if isinstance(m, torch.nn.GroupNorm))  # fmt: skip


def test_small_model_counts():
    assert _count(build_model("logreg", SHAPES["mnist"], 10)) == 7_850
    assert _count(build_model("svm", SHAPES["mnist"], 2)) == 784  # BHerd: w ∈ R^784, no bias
    assert _count(build_model("svm", SHAPES["mnist"], 2, bias=True)) == 785
    assert _count(build_model("svm", SHAPES["digits"], 10)) == 640
    # 64·64+64, 64·64+64, 64·10+10
    assert _count(build_model("mlp", SHAPES["digits"], 10)) == 4_160 + 4_160 + 650
    assert _count(build_model("mlp", SHAPES["digits"], 10, hidden=(32,))) == 64 * 32 + 32 + 330
    assert _count(build_model("quadratic", (7,), 3)) == 7


@pytest.mark.parametrize("name", ["svm", "logreg", "mlp", "cnn", "resnet18"])
@pytest.mark.parametrize("data", ["digits", "mnist", "cifar"])
def test_forward_shapes_and_features(name, data):
    shape = SHAPES[data]
    torch.manual_seed(0)
    model = build_model(name, shape, 10)
    x = torch.randn(3, *shape)
    out = model(x)
    assert out.shape == (3, 10)
    feats = model.features(x)
    assert feats.ndim == 2 and feats.shape[0] == 3
    torch.testing.assert_close(model.classifier(feats), out)
    if name in ("svm", "logreg"):
        torch.testing.assert_close(feats, x.flatten(1))


def test_feature_widths():
    x = torch.randn(2, *SHAPES["cifar"])
    assert build_model("resnet18", SHAPES["cifar"], 10).features(x).shape == (2, 512)
    assert build_model("cnn", SHAPES["cifar"], 10).features(x).shape == (2, 256)
    assert build_model("mlp", SHAPES["cifar"], 10, hidden=[16, 8]).features(x).shape == (2, 8)
    assert build_model("resnet18", SHAPES["cifar"], 10, stem="imagenet")(x).shape == (2, 10)
    assert (build_model("resnet18", SHAPES["cifar"], 10).features(x) >= 0).all()  # post-ReLU pooled features


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("vgg11", SHAPES["cifar"], 10)
    with pytest.raises(ValueError, match=r"unknown argument.*width"):
        build_model("mlp", SHAPES["digits"], 10, width=3)
    with pytest.raises(ValueError, match="accepted: none"):
        build_model("logreg", SHAPES["digits"], 10, hidden=3)
    with pytest.raises(ValueError, match="hidden"):
        build_model("mlp", SHAPES["digits"], 10, hidden=0)
    with pytest.raises(ValueError, match="hidden"):
        build_model("mlp", SHAPES["digits"], 10, hidden="wide")
    with pytest.raises(ValueError, match="l2"):
        build_model("svm", SHAPES["digits"], 2, l2=-1.0)
    with pytest.raises(ValueError, match="bias"):
        build_model("svm", SHAPES["digits"], 2, bias="maybe")
    with pytest.raises(ValueError, match="groups must divide 64"):
        build_model("resnet18", SHAPES["cifar"], 10, groups=3)
    with pytest.raises(ValueError, match="stem"):
        build_model("resnet18", SHAPES["cifar"], 10, stem="vit")
    with pytest.raises(ValueError, match="sides >= 4"):
        build_model("cnn", (1, 3, 3), 10)
    with pytest.raises(ValueError, match="channels, height, width"):
        build_model("cnn", (64,), 10)
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", (0, 8), 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("logreg", (4,), 1)


# SVM ------------------------------------------------------------------------------------------------------------


def test_svm_binary_loss_penalty_predict():
    model = build_model("svm", (2,), 2, l2=0.5)
    assert torch.count_nonzero(model.classifier.weight) == 0  # zero initialised
    with torch.no_grad():
        model.classifier.weight.copy_(torch.tensor([[1.0, -2.0]]))
    x = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [2.0, 0.0]])
    y = torch.tensor([0, 0, 1, 1])  # class 0 ↔ +1 (even), class 1 ↔ −1 (odd)
    f = model(x)
    torch.testing.assert_close(f[:, 0], torch.tensor([1.0, -0.5, -2.0, 2.0]))
    # margins y·f = 1, −0.5, 2, −2 → hinges 0, 1.5, 0, 3 → ½·mean(0 + 2.25 + 0 + 9) = 1.40625
    torch.testing.assert_close(squared_hinge_loss(f, y), torch.tensor(1.40625))
    torch.testing.assert_close(svm_penalty(model), torch.tensor(0.5 * 0.5 * 5.0))
    assert hinge_predict(f).tolist() == [0, 1, 1, 0]
    local = _local(model, "svm")
    torch.testing.assert_close(local.objective(f, y), torch.tensor(1.40625 + 1.25))
    assert build_model("svm", (2,), 2).l2 == 0.1  # BHerd's λ


def test_svm_binary_gradient_matches_closed_form():
    model = build_model("svm", (3,), 2, l2=0.2)
    w = torch.tensor([0.3, -0.1, 0.2])
    with torch.no_grad():
        model.classifier.weight.copy_(w[None])
    x = torch.tensor([[1.0, 2.0, 0.0], [0.0, 1.0, 1.0], [2.0, 0.0, -1.0]])
    y = torch.tensor([0, 1, 1])
    local = _local(model, "svm")
    local.loss_and_grad(x, y)
    sign = torch.tensor([1.0, -1.0, -1.0])
    slack = torch.clamp(1 - sign * (x @ w), min=0)
    expected = -(slack * sign) @ x / 3 + 0.2 * w  # d/dw [½·mean(slack²) + (λ/2)‖w‖²]
    torch.testing.assert_close(local.flat.grad, expected)


def test_svm_multiclass_one_vs_rest():
    model = build_model("svm", (2,), 3, l2=0.0)
    with torch.no_grad():
        model.classifier.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
    x = torch.tensor([[2.0, 0.0], [0.0, 0.5]])
    y = torch.tensor([0, 2])
    f = model(x)  # [[2, 0, −2], [0, 0.5, −0.5]]
    # sample 0 (class 0): margins 2, 0, 2 → hinges 0, 1, 0; sample 1 (class 2): margins 0, −0.5, −0.5 → 1, 1.5, 1.5
    torch.testing.assert_close(squared_hinge_loss(f, y), torch.tensor(0.5 * (1.0 + 5.5) / 2))
    assert hinge_predict(f).tolist() == [0, 1]


# quadratic ------------------------------------------------------------------------------------------------------


def test_quadratic_exact_gradient():
    data = load_dataset("quadratic:6,4", split_seed=1)
    model = build_model("quadratic", data.input_shape, data.num_classes)
    assert builtin("quadratic").has_accuracy is False
    local = _local(model, "quadratic")
    x = torch.tensor([0.5, -1.0, 2.0, 0.0])
    local.load_(x)
    u = torch.as_tensor(data.x_train)
    for i in range(6):
        loss = local.loss_and_grad(u[i : i + 1], torch.tensor([i]))
        torch.testing.assert_close(local.flat.grad, x - u[i])
        assert loss == pytest.approx(0.5 * float(((x - u[i]) ** 2).sum()), rel=1e-6)
    local.loss_and_grad(u, torch.arange(6))  # a batch of several clients: gradient x − mean(u)
    torch.testing.assert_close(local.flat.grad, x - u.mean(0))
    loss, acc = local.evaluate(x, u, torch.arange(6))
    assert np.isnan(acc) and loss == pytest.approx(float(0.5 * ((x - u) ** 2).sum(1).mean()), rel=1e-6)


# a real training run ----------------------------------------------------------------------------------------------


def test_mlp_learns_digits():
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes)
    x, y = torch.as_tensor(data.x_train), torch.as_tensor(data.y_train)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        for batch in torch.randperm(len(y), generator=gen).split(32):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(torch.as_tensor(data.x_test)).argmax(1).numpy() == data.y_test).mean()
    assert accuracy >= 0.9


def test_cnn_trains_on_digits_features():
    # One SGD step on a fixed batch lowers the loss: gradients flow through both conv layers.
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("cnn", data.input_shape, 10)
    x, y = torch.as_tensor(data.x_train[:64]), torch.as_tensor(data.y_train[:64])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with torch.no_grad():
        before = float(torch.nn.functional.cross_entropy(model(x), y))
    for _ in range(5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        assert float(torch.nn.functional.cross_entropy(model(x), y)) < before
    assert model.conv[0].weight.grad.abs().sum() > 0


# the plain SGD step -----------------------------------------------------------------------------------------------


class _PartlyUsed(torch.nn.Module):
    """A dropout model with a frozen layer and a parameter the loss never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(5, 6)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Dropout(0.3))
        self.head = torch.nn.Linear(7, 3)
        self.unused = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.frozen(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sgd_step_equals_gradient_then_update_bit_for_bit(dtype):
    torch.manual_seed(0)
    model = _PartlyUsed().to(dtype)
    frozen_start = model.frozen.weight.clone()
    stepped, reference = LocalModel(model), LocalModel(copy.deepcopy(model))  # frozen weights are not in the vector
    x, y = torch.randn(8, 5, dtype=dtype), torch.randint(0, 3, (8,))
    start = stepped.flat.data.clone()
    for step in range(3):
        torch.manual_seed(step)  # the same dropout masks on both sides
        loss = stepped.sgd_step_(x, y, 0.1)
        torch.manual_seed(step)
        expected = reference.loss_and_grad(x, y)
        reference.flat.data.add_(reference.flat.grad, alpha=-0.1)
        assert loss == expected
        assert torch.equal(stepped.flat.data, reference.flat.data)
    assert stepped.flat.size == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert torch.equal(model.frozen.weight, frozen_start)  # the frozen weight stayed
    assert torch.equal(model.unused, torch.ones(4, dtype=dtype))
    assert not stepped.flat.data.equal(start)
