"""Flower's messages carry the model's trainable parameters only: a frozen backbone is never sent, received or
averaged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from pyfedkern.integrations import flower as pf
from pyfedkern.sim.config import ExperimentConfig

PARTS = """
import numpy as np
from torch import nn


def frozen_backbone(input_shape, num_classes):
    backbone = nn.Linear(int(np.prod(input_shape)), 16)
    backbone.requires_grad_(False)
    return nn.Sequential(nn.Flatten(), backbone, nn.ReLU(), nn.Linear(16, num_classes))
"""


def test_a_client_receives_and_uploads_the_trainable_parameters_only(tmp_path, monkeypatch):
    (tmp_path / "frozen_parts.py").write_text(PARTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ExperimentConfig(model="frozen_parts:frozen_backbone", clients=3, rounds=2, local_steps=3, lr=0.1, seed=1)
    sim = pf._simulation(config)
    module = sim.local.module
    head = sum(p.numel() for p in module[3].parameters())
    assert sim.local.dim == head < sum(p.numel() for p in module.parameters())
    x0 = pf.initial_arrays(config)["model"].numpy()
    assert x0.shape == (head,)
    backbone = module[1].weight.detach().clone()
    content = RecordDict({"arrays": ArrayRecord({"model": Array(x0)}), "config": ConfigRecord({"server-round": 1})})
    reply = pf.client_train(config, 0, 1, content, RecordDict())
    upload = reply["arrays"]
    assert list(upload) == ["model"] and upload["model"].numpy().shape == (head,)
    assert np.abs(upload["model"].numpy() - x0).max() > 1e-4  # the head trained
    assert torch.equal(module[1].weight, backbone)  # the backbone did not
    with pytest.raises(ValueError, match=f"this config's model has {head}"):
        whole = np.zeros(sum(p.numel() for p in module.parameters()), np.float32)
        pf.client_train(config, 0, 1, RecordDict({"arrays": ArrayRecord({"model": Array(whole)})}), RecordDict())
