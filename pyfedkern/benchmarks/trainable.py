"""Benchmark cases of rounds where part of the model is frozen: what the federated vector holds decides the memory of
every client row and message.

- ``trainable_round frozen-backbone cnn m=100 cpu``: one FedAvg round of 100 clients (20 images 3×16×16 each, one
  epoch of batch 10) training a Linear head over a frozen two-convolution backbone;
- ``trainable_round lora-bert m=100 cpu`` (with the ``llm`` extra): one FedAvg round of 100 clients (8 sequences of
  16 tokens each, one step) training LoRA adapters (r = 4 on the query and value projections, and the head) of a
  2-layer BERT (hidden size 32) built from a config with random weights;
- ``trainable_chunk bert-512 chunk=c m=8 cpu`` (with the ``llm`` extra, :func:`chunk_cases`): the memory one
  client chunk row adds, LoRA adapters against a trained head only, on a 4-layer BERT of hidden size 512.

Cases of the ``trainable_round`` groups: "pyfedkern" (batched: each client a row of the trainable parameters over
the one shared frozen part), "per-client loop (batched=False)", and "whole model as the vector" (every parameter
unfrozen, batched: what the engine federated before the vector became the trainable parameters; it trains a
different model, at the same cost as the old behaviour). Quick: 10 clients. ``info`` holds d, the trainable values
per client row, and the model's size.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pyfedkern.benchmarks.common import Case

CLIENTS, QUICK_CLIENTS = 100, 10
VOCAB, LENGTH = 100, 16


def frozen_backbone_cnn(num_classes: int) -> nn.Module:
    """Two frozen 3×3 convolutions (16 and 32 channels, ReLU, max-pool, global average) and a trainable Linear head."""
    backbone = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    backbone.requires_grad_(False)
    return nn.Sequential(backbone, nn.Linear(32, num_classes))


class _Logits(nn.Module):
    """Logits [B, C] of a Hugging Face sequence classifier for token ids [B, T]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


def _bert(num_classes: int, hidden: int, layers: int) -> nn.Module:
    """A BERT sequence classifier (hidden size ``hidden``, ``layers`` layers, 2× wide feed-forward) from a config with
    random weights, no dropout."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=LENGTH,
        num_labels=num_classes,
        hidden_dropout_prob=0.0,  # no dropout: the loop and the batched path draw their masks differently
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return transformers.BertForSequenceClassification(config)


def lora_bert(num_classes: int) -> nn.Module:
    """LoRA adapters (r = 4, query and value) and the head of a 2-layer BERT of hidden size 32, random weights, no
    dropout."""
    import peft

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    return _Logits(peft.get_peft_model(_bert(num_classes, 32, 2), lora))


def lora_bert_512(num_classes: int) -> nn.Module:
    """As :func:`lora_bert` on a 4-layer BERT of hidden size 512 (8.7 M frozen parameters): a base far larger than the
    activations of one short sequence."""
    import peft

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")
    return _Logits(peft.get_peft_model(_bert(num_classes, 512, 4), lora))


def head_bert_512(num_classes: int) -> nn.Module:
    """The same 4-layer BERT of hidden size 512 with only its classifier head trainable (no adapters): the same
    forward and backward through the frozen layers as :func:`lora_bert_512`, with a row of 1 kB."""
    model = _bert(num_classes, 512, 4).requires_grad_(False)
    model.classifier.requires_grad_(True)
    return _Logits(model)


def _unfrozen(factory: Callable[[int], nn.Module]) -> Callable[[int], nn.Module]:
    def whole(num_classes: int) -> nn.Module:
        return factory(num_classes).requires_grad_(True)

    return whole


def fedavg_round(
    factory: Callable[[int], nn.Module], data: tuple, clients: int, batch: int, batched: bool, chunk: int | None = None
):
    """A callable running the next FedAvg round (every client taking part, one thread, ``chunk`` clients trained at
    once: None for the engine's choice) of the model of ``factory`` on ``data`` (x, y) split IID among ``clients``;
    returns the global model."""
    from pyfedkern.sim.engine import _cpu_threads
    from pyfedkern.sim.experiment import Experiment

    x, y = data
    experiment = Experiment(
        factory, (x, y), (x[:50], y[:50]), clients="iid", num_clients=clients, fraction=1.0, batch_size=batch, lr=0.05,
        batched=batched, eval_every=10**6, client_chunk=chunk,
    )  # fmt: skip
    sim = experiment.simulation
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    rounds = itertools.count()

    def run() -> torch.Tensor:
        with _cpu_threads(1):
            algo.round(next(rounds), sim)
        return algo.global_model()

    return run


def _sizes(factory: Callable[[int], nn.Module], classes: int) -> dict[str, int]:
    module = factory(classes)
    return {
        "d": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "model": sum(p.numel() for p in module.parameters()),
    }


def _group(name: str, factory: Callable[[int], nn.Module], data: tuple, clients: int, batch: int) -> list[Case]:
    group = f"trainable_round {name} m={clients} cpu"
    classes = int(data[1].max()) + 1
    info = _sizes(factory, classes)

    def case(label: str, model: Callable[[int], nn.Module], batched: bool) -> Case:
        make = lambda: fedavg_round(model, data, clients, batch, batched)  # noqa: E731
        return Case(group, label, make, info={**info, "row": _sizes(model, classes)["d"]}, rounds=3)

    return [
        case("pyfedkern", factory, True),
        case("per-client loop (batched=False)", factory, False),
        case("whole model as the vector (unfrozen, batched)", _unfrozen(factory), True),
    ]


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """The frozen-backbone CNN group, and the LoRA BERT group when peft and transformers are installed (CPU only)."""
    if device != "cpu":
        return []
    clients = QUICK_CLIENTS if quick else CLIENTS
    rng = np.random.default_rng(0)
    images = rng.normal(size=(20 * clients, 3, 16, 16)).astype(np.float32)
    out = _group("frozen-backbone cnn", frozen_backbone_cnn, (images, rng.integers(0, 10, len(images))), clients, 10)
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return out
    tokens = rng.integers(0, VOCAB, size=(8 * clients, LENGTH))
    out += _group("lora-bert", lora_bert, (tokens, rng.integers(0, 2, len(tokens))), clients, 8)
    return out + chunk_cases()


def chunk_cases() -> list[Case]:
    """``trainable_chunk bert-512 chunk=c m=8 cpu`` for c = 1, 2, 4, 8: one batched FedAvg round of 8 clients (one
    sequence of 16 tokens each, one step) training c clients at once, "pyfedkern" the LoRA adapters of
    :func:`lora_bert_512`, "head only" :func:`head_bert_512`, and "limit:plain step" one plain torch gradient of the
    LoRA model on c sequences (:func:`plain_step`: the activations alone). Their peaks against c
    (``bench/peak_memory.py --allocated``) give the memory a chunk row adds: the LoRA slope minus the plain step's
    is what a row costs beyond its activations, to be compared with the adapters' and the model's sizes (``info``)."""
    rng = np.random.default_rng(0)
    data = (rng.integers(0, VOCAB, size=(8, LENGTH)), rng.integers(0, 2, 8))
    models = {"pyfedkern": lora_bert_512, "head only": head_bert_512}
    sizes = {label: _sizes(factory, 2) for label, factory in models.items()}
    out = []
    for chunk in (1, 2, 4, 8):
        group = f"trainable_chunk bert-512 chunk={chunk} m=8 cpu"
        for label, factory in models.items():
            make = functools.partial(fedavg_round, factory, data, 8, 1, True, chunk)
            out.append(Case(group, label, make, info=sizes[label], rounds=3))
        make = functools.partial(plain_step, lora_bert_512, data, chunk)
        out.append(Case(group, "limit:plain step", make, info=sizes["pyfedkern"], rounds=3))
    return out


def plain_step(factory: Callable[[int], nn.Module], data: tuple, batch: int) -> Callable[[], tuple]:
    """A callable computing one plain torch loss and gradient (no federation, one thread) of ``factory``'s model on
    the first ``batch`` samples of ``data``: the activations a batch of that many sequences needs."""
    from pyfedkern.sim.engine import _cpu_threads

    module = factory(2)
    x, y = (torch.as_tensor(a[:batch]) for a in data)
    trained = [p for p in module.parameters() if p.requires_grad]

    def run() -> tuple:
        with _cpu_threads(1):
            return torch.autograd.grad(nn.functional.cross_entropy(module(x), y), trained)

    return run
