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
    trainable = [(name, tuple(p.shape)) for name, p in module.named_parameters() if p.requires_grad]
    assert [name for name, _ in trainable] == ["3.weight", "3.bias"]
    sent = pf.initial_arrays(config)
    assert [(name, a.numpy().shape) for name, a in sent.items()] == trainable  # the backbone "1.*" is not sent
    layout = pf.model_layout(config)
    x0 = pf.arrays_vector(sent, layout)
    assert x0.shape == (head,)
    backbone = module[1].weight.detach().clone()
    content = RecordDict({"arrays": sent, "config": ConfigRecord({"server-round": 1})})
    reply = pf.client_train(config, 0, 1, content, RecordDict())
    upload = reply["arrays"]
    assert [(name, a.numpy().shape) for name, a in upload.items()] == trainable  # named, trainable only
    assert np.abs(pf.arrays_vector(upload, layout) - x0).max() > 1e-4  # the head trained
    assert torch.equal(module[1].weight, backbone)  # the backbone did not
    whole = {name: Array(p.detach().numpy().copy()) for name, p in module.named_parameters()}
    with pytest.raises(ValueError, match=r"have \['1.weight', '1.bias'\], which the 'model' vector has not"):
        pf.client_train(config, 0, 1, RecordDict({"arrays": ArrayRecord(whole)}), RecordDict())


def test_a_reply_with_a_missing_extra_or_misshaped_array_is_refused_by_name(tmp_path, monkeypatch):
    """The server's conversion of a reply to the flat vector (BHerd's, DynamicInit's, the server evaluation's)
    refuses arrays that are not exactly the model's trainable tensors, naming the first wrong one."""
    (tmp_path / "frozen_parts.py").write_text(PARTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ExperimentConfig(model="frozen_parts:frozen_backbone", clients=3, rounds=2, local_steps=3, lr=0.1, seed=1)
    layout = pf.model_layout(config)
    sent = pf.initial_arrays(config)
    reply = dict(
        pf.client_train(
            config, 1, 1, RecordDict({"arrays": sent, "config": ConfigRecord({"server-round": 1})}), RecordDict()
        )["arrays"].items()
    )
    x = pf.arrays_vector(reply, layout)
    np.testing.assert_array_equal(
        x, np.concatenate([reply["3.weight"].numpy().reshape(-1), reply["3.bias"].numpy()])
    )  # the flat vector is the arrays in layout order
    with pytest.raises(ValueError, match=r"lack \['3.bias'\]"):
        pf.arrays_vector({"3.weight": reply["3.weight"]}, layout)
    with pytest.raises(ValueError, match=r"have \['1.weight'\]"):
        pf.arrays_vector({**reply, "1.weight": Array(np.zeros((16, 64), np.float32))}, layout)
    with pytest.raises(ValueError, match=r"array '3.bias' has shape \(3,\), expected"):
        pf.arrays_vector({**reply, "3.bias": Array(np.zeros(3, np.float32))}, layout)
