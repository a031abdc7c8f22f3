"""LoRA adapters (Hugging Face ``peft``) on a tiny ``transformers`` BERT built from a config with random weights (no
download): only the adapters (and the classifier head peft trains) are federated, on the loop and the batched path
alike; the base model's weights stay bit-identical; uploads and checkpoints hold the adapters only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pyfedkern import Experiment
from pyfedkern.flat import parameters_to_vector, trainable_parameters

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

VOCAB, LENGTH, CLASSES = 32, 8, 3


class Classifier(nn.Module):
    """Logits [B, C] of a sequence classifier for token ids [B, T] (the engine wants a tensor, not a model output)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


def tiny_lora_bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,  # no dropout: the two paths draw their masks differently
        attention_probs_dropout_prob=0.0,
    )
    base = transformers.BertForSequenceClassification(config)
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value"], lora_dropout=0.0, task_type="SEQ_CLS")
    return Classifier(peft.get_peft_model(base, lora))


def _experiment(batched: bool, **settings) -> Experiment:
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, VOCAB, size=(160, LENGTH)), rng.integers(0, CLASSES, 160)
    defaults = dict(
        clients="iid",
        num_clients=6,
        rounds=2,
        fraction=0.5,
        batch_size=8,
        lr=0.1,
        dtype="float64",
        batched=batched,
        eval_initial=False,
    )
    return Experiment(tiny_lora_bert, (x[:120], y[:120]), (x[120:], y[120:]), **{**defaults, **settings})


def _is_adapter(name: str) -> bool:
    return "lora_" in name or "modules_to_save" in name


def test_only_the_adapters_train_and_the_paths_agree(tmp_path):
    final = {}
    for batched in (False, True):
        experiment = _experiment(batched)
        sim = experiment.simulation
        module = sim.local.module
        names = [n for n, _ in trainable_parameters(module)]
        assert names and all(_is_adapter(n) for n in names)
        assert sim.local.dim == sum(p.numel() for _, p in trainable_parameters(module))
        assert sim.local.dim < sum(p.numel() for p in module.parameters()) / 10
        base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
        experiment.run(tmp_path / f"run-{batched}")
        final[batched] = sim.algorithm.global_model()
        for name, value in module.named_parameters():
            if not value.requires_grad:
                assert torch.equal(value, base[name]), name
        checkpoint = torch.load(sorted((tmp_path / f"run-{batched}" / "checkpoints").glob("*.pt"))[-1])
        vectors = [v for v in checkpoint["algorithm"].values() if isinstance(v, torch.Tensor) and v.dim() == 1]
        assert vectors and all(v.numel() == sim.local.dim for v in vectors)
        assert torch.load(tmp_path / f"run-{batched}" / "model.pt")["x"].numel() == sim.local.dim
        kept = torch.load(tmp_path / f"run-{batched}" / "frozen.pt", weights_only=True)
        assert kept.keys() == base.keys()
    assert (final[True] - sim.initial_vector).abs().max() > 1e-4  # the adapters trained
    torch.testing.assert_close(final[True], final[False], rtol=0, atol=1e-12)


def test_an_upload_holds_the_adapters_only():
    sim = _experiment(False).simulation
    sim.algorithm.setup(sim, sim.initial_vector)
    updates = sim.algorithm.client_update(0, np.array([1]), sim)
    assert {name: v.shape for name, v in updates.vectors.items()} == {"model": (1, sim.local.dim)}
    module = sim.local.module
    assert torch.equal(parameters_to_vector(module, torch.float64), updates.vectors["model"][0])  # loaded, as trained


def test_a_model_vmap_cannot_run_takes_the_loop_and_says_why(caplog):
    """GPT-2's sequence-classification head looks for the last non-padding token with data-dependent indexing, which
    vmap cannot batch: the engine's own choice takes the loop and logs the reason once."""

    def lora_gpt2():
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2, num_labels=CLASSES,
            pad_token_id=0, bos_token_id=1, eos_token_id=1,
        )  # fmt: skip
        base = transformers.GPT2ForSequenceClassification(config)
        lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, task_type="SEQ_CLS")
        return Classifier(peft.get_peft_model(base, lora))

    rng = np.random.default_rng(0)
    x, y = rng.integers(1, VOCAB, size=(60, LENGTH)), rng.integers(0, CLASSES, 60)
    experiment = Experiment(lora_gpt2, (x[:48], y[:48]), (x[48:], y[48:]), num_clients=4, rounds=1, batch_size=8)
    with caplog.at_level("INFO", logger="pyfedkern"):
        metrics = experiment.run()
    assert np.isfinite(metrics[-1]["test_loss"]) and experiment.simulation.batched is False
    notes = [r.getMessage() for r in caplog.records if "clients train as" in r.getMessage()]
    assert len(notes) == 1 and "a loop over clients: the model cannot be batched" in notes[0]
