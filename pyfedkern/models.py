"""Models for simulations: ``build_model(name, input_shape, num_classes, **kwargs)``, and :func:`builtin`, the same
models as :class:`ModelSpec` (a factory plus how to score its outputs), the form the engine takes any model in.

Inputs are batches [B, *input_shape]; classifiers return logits/scores [B, num_classes] (the binary SVM: [B, 1]).
Every classifier exposes ``features(x)`` (the penultimate representation, [B, F]) and ``classifier`` (the last
layer), so ``model(x) == model.classifier(model.features(x))``. A model may define ``layer_chain()``: its layers in
order when the model is exactly their composition (batched local training then uses a hand-written backward for
Flatten/Linear/ReLU chains). Losses are never looked up on the model: a :class:`ModelSpec` names them.

- ``svm`` (l2=0.1, bias=False): BHerd's squared-hinge SVM (Wang et al. JSAC'19), zero-initialised.
- ``logreg``: one linear layer (cross-entropy).
- ``mlp`` (hidden=64): flatten → [Linear → ReLU] per hidden width → Linear; an int means two layers of that width.
- ``cnn`` (channels=32, hidden=256): BHerd's CNN, 430,698 parameters on MNIST and 555,178 on CIFAR-10.
- ``resnet18`` (groups=2, stem="cifar"): ResNet-18 with GroupNorm.
- ``quadratic``: FedPBC's F_i(x) = ½‖x − u_i‖², one parameter x ∈ R^d.
- ``simple_cnn`` (dropout=true): pfl-research's CIFAR-10 benchmark CNN, 1,626,442 parameters on 3×32×32.
- ``lstm`` (vocab=num_classes, embed=8, hidden=256, layers=2): LEAF's Shakespeare next-character model on token
  sequences [B, T].
- ``transformer`` (vocab=num_classes, dim=64, heads=4, layers=2, ff=128, dropout=0): a small transformer encoder
  on token sequences [B, T], mean-pooled.

The sequence models take token ids, as integers or as floats holding integers (datasets store features as floats).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


class SquaredHingeSVM(nn.Module):
    """Linear SVM f(x) = w·flatten(x) (+ b), trained with :func:`squared_hinge_loss` + :func:`svm_penalty` and
    predicting with :func:`hinge_predict` (the ``svm`` :func:`builtin`); ``l2`` is the penalty's λ."""

    def __init__(self, in_features: int, num_classes: int, *, l2: float, bias: bool) -> None:
        super().__init__()
        self.l2 = l2
        self.classifier = nn.Linear(in_features, 1 if num_classes == 2 else num_classes, bias=bias)
        nn.init.zeros_(self.classifier.weight)
        if bias:
            nn.init.zeros_(self.classifier.bias)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def squared_hinge_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """BHerd's squared hinge loss of SVM scores. One score [B, 1] (binary): class 0 ↔ +1 and class 1 ↔ −1 (with
    parity labels: even = +1, odd = −1), ½·mean(max(0, 1 − y·f)²). C scores [B, C]: one-vs-rest, ½·mean over samples
    of Σ_c max(0, 1 − y_c·f_c)² with y_c = +1 for the true class and −1 otherwise."""
    if output.shape[1] == 1:
        sign = 1.0 - 2.0 * target.to(output.dtype)
        return 0.5 * F.relu(1.0 - sign * output[:, 0]).square().mean()
    signs = 2.0 * F.one_hot(target, output.shape[1]).to(output.dtype) - 1.0
    return 0.5 * F.relu(1.0 - signs * output).square().sum(dim=1).mean()


def svm_penalty(model: SquaredHingeSVM) -> torch.Tensor:
    """(l2/2)·‖w‖² of an SVM's weights (the bias is not penalised)."""
    return 0.5 * model.l2 * model.classifier.weight.square().sum()


def hinge_predict(output: torch.Tensor) -> torch.Tensor:
    """The class of SVM scores: one score → class 0 when f ≥ 0, else 1; C scores → argmax."""
    if output.shape[1] == 1:
        return (output[:, 0] < 0).long()
    return output.argmax(dim=1)


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: Linear on the flattened input; features are the flattened input."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(in_features, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def layer_chain(self) -> list[nn.Module]:
        return [nn.Flatten(), self.classifier]


class MLP(nn.Module):
    """flatten → (Linear → ReLU) per hidden width → Linear(num_classes); features = the last hidden activations."""

    def __init__(self, in_features: int, num_classes: int, hidden: Sequence[int]) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def layer_chain(self) -> list[nn.Module]:
        return [*self.body, self.classifier]


class CNN(nn.Module):
    """BHerd's CNN: [conv 5×5 (padding 2) → ReLU → max-pool 2×2] × 2 → FC(hidden) → ReLU → FC(num_classes).

    With 32 channels and hidden 256: MNIST 1×28×28 → 7·7·32 = 1568 inputs to the FC layer, 430,698 parameters;
    CIFAR-10 3×32×32 → 2048, 555,178 parameters; digits 1×8×8 → 128, 62,058 parameters. Features: the hidden
    FC layer's ReLU output [B, hidden].
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, channels: int, hidden: int) -> None:
        super().__init__()
        in_channels, height, width = input_shape
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, channels, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, channels, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(nn.Linear(channels * (height // 4) * (width // 4), hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.GroupNorm(groups, out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 (BasicBlocks [2, 2, 2, 2], widths 64-128-256-512) with GroupNorm(groups) in place of BatchNorm.

    stem "cifar": 3×3 conv, stride 1, no max-pool (11,173,962 parameters for 3×32×32 and 10 classes); stem
    "imagenet": torchvision's 7×7 stride-2 conv + 3×3 max-pool (11,181,642, FedSpeed's model). Features: the
    global-average-pooled 512-d output of the last stage (post-ReLU).
    """

    def __init__(self, in_channels: int, num_classes: int, groups: int, stem: str) -> None:
        super().__init__()
        if stem == "cifar":
            layers: list[nn.Module] = [nn.Conv2d(in_channels, 64, 3, padding=1, bias=False)]
        else:
            layers = [nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)]
        layers += [nn.GroupNorm(groups, 64), nn.ReLU()]
        if stem == "imagenet":
            layers.append(nn.MaxPool2d(3, stride=2, padding=1))
        width = 64
        for out_channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [
                _BasicBlock(width, out_channels, stride, groups),
                _BasicBlock(out_channels, out_channels, 1, groups),
            ]
            width = out_channels
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.body = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class Quadratic(nn.Module):
    """FedPBC's toy objective F_i(x) = ½‖x − u_i‖² with one parameter x ∈ R^d (initially 0).

    forward(u) = x − u flattened to [B, d]; :func:`half_squared_norm` of it is the loss (mean over rows of
    ½‖x − u‖², whose gradient is x − mean(u)). No accuracy.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return self.x - u.flatten(1)


def half_squared_norm(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ½‖output‖² (``target`` unused): the ``quadratic`` model's loss."""
    return 0.5 * output.square().sum(dim=1).mean()


class SimpleCNN(nn.Module):
    """pfl-research's ``simple_cnn`` for CIFAR-10: conv 3×3 (32) → ReLU → conv 3×3 (64) → ReLU → max-pool 2×2 →
    dropout 0.25 → flatten → FC 128 → ReLU → dropout 0.5 → FC(num_classes); no padding. On 3×32×32: 1,626,442
    parameters and 16.8 M multiply-adds a sample. Features: the FC-128 layer's ReLU output [B, 128]."""

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int, dropout: bool) -> None:
        super().__init__()
        in_channels, height, width = input_shape
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25 if dropout else 0.0),
            nn.Flatten(),
        )
        self.fc = nn.Sequential(
            nn.Linear(64 * ((height - 4) // 2) * ((width - 4) // 2), 128),
            nn.ReLU(),
            nn.Dropout(0.5 if dropout else 0.0),
        )
        self.classifier = nn.Linear(128, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _token_ids(x: torch.Tensor) -> torch.Tensor:
    """Token ids [B, T] as int64 (datasets may hold them as floats)."""
    return x.long() if x.is_floating_point() else x


class CharLSTM(nn.Module):
    """LEAF's Shakespeare model: embedding(vocab, embed) → LSTM(hidden) × layers → Linear(num_classes) on the last
    position's output. Input: token ids [B, T]; output: logits [B, num_classes]. Features: the last position's
    top-layer output [B, hidden]."""

    def __init__(self, vocab: int, num_classes: int, embed: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, layers, batch_first=True)
        self.classifier = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embedding(_token_ids(x)))
        return out[:, -1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TransformerClassifier(nn.Module):
    """A small transformer encoder on token sequences: token embedding(vocab, dim) + learned position embedding →
    ``layers`` post-norm encoder layers (``heads`` heads, feed-forward width ``ff``, ReLU, ``dropout``) → mean over
    positions → Linear(num_classes). Input: token ids [B, T] (T at most the ``length`` it was built for); output:
    logits [B, num_classes]. Features: the mean-pooled encoding [B, dim]."""

    def __init__(
        self, length: int, vocab: int, num_classes: int, dim: int, heads: int, layers: int, ff: int, dropout: float
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(0.02 * torch.randn(length, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, ff, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.classifier = nn.Linear(dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        tokens = _token_ids(x)
        h = self.embedding(tokens) + self.position[: tokens.shape[1]]
        return self.encoder(h).mean(dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# builders -------------------------------------------------------------------------------------------------------


def _nonneg_float(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


def _pos_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {value!r}")
    return int(value)


def _image_shape(input_shape: tuple[int, ...], model: str, min_side: int) -> tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < min_side:
        raise ValueError(
            f"model {model!r} needs input_shape (channels, height, width) with sides >= {min_side}, got {input_shape}"
        )
    return input_shape


def _flag(value: object, what: str) -> bool:
    """A bool, also from 0/1 or the strings true/false/yes/no (command-line values)."""
    if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
        return value.lower() in ("true", "yes", "1")
    if value in (0, 1):
        return bool(value)
    raise ValueError(f"{what} must be true or false, got {value!r}")


def _svm(input_shape: tuple[int, ...], num_classes: int, l2: float = 0.1, bias: bool = False) -> nn.Module:
    return SquaredHingeSVM(
        math.prod(input_shape), num_classes, l2=_nonneg_float(l2, "svm: l2"), bias=_flag(bias, "svm: bias")
    )


def _logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return LogisticRegression(math.prod(input_shape), num_classes)


def _mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int | Sequence[int] = 64) -> nn.Module:
    widths = (hidden, hidden) if isinstance(hidden, int) and not isinstance(hidden, bool) else hidden
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths:
        raise ValueError(f"mlp: hidden must be an int or a non-empty sequence of ints, got {hidden!r}")
    return MLP(math.prod(input_shape), num_classes, [_pos_int(h, "mlp: hidden width") for h in widths])


def _cnn(input_shape: tuple[int, ...], num_classes: int, channels: int = 32, hidden: int = 256) -> nn.Module:
    shape = _image_shape(input_shape, "cnn", 4)
    return CNN(shape, num_classes, _pos_int(channels, "cnn: channels"), _pos_int(hidden, "cnn: hidden"))


def _resnet18(input_shape: tuple[int, ...], num_classes: int, groups: int = 2, stem: str = "cifar") -> nn.Module:
    shape = _image_shape(input_shape, "resnet18", 1)
    groups = _pos_int(groups, "resnet18: groups")
    if 64 % groups:
        raise ValueError(f"resnet18: groups must divide 64 (the narrowest layer), got {groups}")
    if stem not in ("cifar", "imagenet"):
        raise ValueError(f"resnet18: stem must be 'cifar' or 'imagenet', got {stem!r}")
    return ResNet18(shape[0], num_classes, groups, stem)


def _quadratic(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return Quadratic(math.prod(input_shape))


def _simple_cnn(input_shape: tuple[int, ...], num_classes: int, dropout: bool = True) -> nn.Module:
    shape = _image_shape(input_shape, "simple_cnn", 6)
    return SimpleCNN(shape, num_classes, _flag(dropout, "simple_cnn: dropout"))


def _sequence_length(input_shape: tuple[int, ...], model: str) -> int:
    if len(input_shape) != 1:
        raise ValueError(f"model {model!r} needs input_shape (sequence length,) of token ids, got {input_shape}")
    return input_shape[0]


def _lstm(
    input_shape: tuple[int, ...],
    num_classes: int,
    vocab: int | None = None,
    embed: int = 8,
    hidden: int = 256,
    layers: int = 2,
) -> nn.Module:
    _sequence_length(input_shape, "lstm")
    vocab = num_classes if vocab is None else _pos_int(vocab, "lstm: vocab")
    return CharLSTM(
        vocab,
        num_classes,
        _pos_int(embed, "lstm: embed"),
        _pos_int(hidden, "lstm: hidden"),
        _pos_int(layers, "lstm: layers"),
    )


def _transformer(
    input_shape: tuple[int, ...],
    num_classes: int,
    vocab: int | None = None,
    dim: int = 64,
    heads: int = 4,
    layers: int = 2,
    ff: int = 128,
    dropout: float = 0.0,
) -> nn.Module:
    length = _sequence_length(input_shape, "transformer")
    vocab = num_classes if vocab is None else _pos_int(vocab, "transformer: vocab")
    dim, heads = _pos_int(dim, "transformer: dim"), _pos_int(heads, "transformer: heads")
    if dim % heads:
        raise ValueError(f"transformer: heads must divide dim, got dim={dim}, heads={heads}")
    dropout = _nonneg_float(dropout, "transformer: dropout")
    if dropout >= 1:
        raise ValueError(f"transformer: dropout must be < 1, got {dropout}")
    layers, ff = _pos_int(layers, "transformer: layers"), _pos_int(ff, "transformer: ff")
    return TransformerClassifier(length, vocab, num_classes, dim, heads, layers, ff, dropout)


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "svm": _svm,
    "logreg": _logreg,
    "mlp": _mlp,
    "cnn": _cnn,
    "resnet18": _resnet18,
    "quadratic": _quadratic,
    "simple_cnn": _simple_cnn,
    "lstm": _lstm,
    "transformer": _transformer,
}
MODELS = tuple(_BUILDERS)


def build_model(name: str, input_shape: Sequence[int], num_classes: int, **kwargs: object) -> nn.Module:
    """Build model ``name`` for inputs [B, *input_shape] and ``num_classes`` classes; kwargs as in the module doc."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(sorted(MODELS))}")
    shape = tuple(input_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in shape):
        raise ValueError(f"input_shape must be a non-empty tuple of positive ints, got {input_shape!r}")
    shape = tuple(int(s) for s in shape)
    fewest = 1 if name == "quadratic" else 2
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < fewest:
        raise ValueError(f"num_classes must be an integer >= {fewest}, got {num_classes!r}")
    builder = _BUILDERS[name]
    accepted = list(inspect.signature(builder).parameters)[2:]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        allowed = ", ".join(accepted) if accepted else "none"
        raise ValueError(f"model {name!r}: unknown argument(s) {', '.join(unknown)}; accepted: {allowed}")
    return builder(shape, int(num_classes), **kwargs)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the engine takes it: how to build it and how to score its outputs.

    Attributes:
        factory: builds a fresh ``nn.Module``; called with the keywords it accepts among ``input_shape`` (one
            sample's shape, a tuple) and ``num_classes`` (an int, or None for regression targets).
        loss: ``loss(output, target)`` → the batch's mean loss, a scalar tensor (default: cross-entropy).
        penalty: ``penalty(model)`` → a scalar tensor added to the training objective (None: nothing).
        predict: ``predict(output)`` → int64 [B] predicted classes (None: argmax over dim 1).
        has_accuracy: whether accuracy is measured (only for integer class targets in any case).
        name: shown in config.json and logs.
    """

    factory: Callable[..., nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    penalty: Callable[[nn.Module], torch.Tensor] | None = None
    predict: Callable[[torch.Tensor], torch.Tensor] | None = None
    has_accuracy: bool = True
    name: str = "model"


_SCORING: dict[str, dict[str, object]] = {
    "svm": {"loss": squared_hinge_loss, "penalty": svm_penalty, "predict": hinge_predict},
    "quadratic": {"loss": half_squared_norm, "has_accuracy": False},
}


def builtin(name: str, /, **kwargs: object) -> ModelSpec:
    """Model ``name`` as a :class:`ModelSpec`: its factory is ``build_model(name, input_shape, num_classes,
    **kwargs)`` (kwargs are checked when it builds; input_shape and num_classes come from the data), with the
    model's own loss, penalty and prediction."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; valid choices: {', '.join(sorted(MODELS))}")
    taken = sorted({"input_shape", "num_classes"} & set(kwargs))
    if taken:
        raise ValueError(f"model {name!r} takes {' and '.join(taken)} from the data, not as arguments")
    return ModelSpec(factory=partial(build_model, name, **kwargs), name=name, **_SCORING.get(name, {}))


def builtin_name(spec: ModelSpec) -> str | None:
    """The built-in model ``spec`` builds (its factory is one :func:`builtin` made), else None: decided by the
    factory's identity, not by ``spec.name`` (a user's factory may be called ``cnn``)."""
    factory = spec.factory
    return factory.args[0] if isinstance(factory, partial) and factory.func is build_model else None
