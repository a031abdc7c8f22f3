"""flwr-datasets partitions as natural clients, from local files (skipped without the optional extra)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr_datasets")

from flwr_datasets import FederatedDataset
from flwr_datasets.partitioner import IidPartitioner

from pyfedkern import Experiment
from pyfedkern.data.flower import from_flwr_datasets


def _write_csv(path, rows):
    lines = ["f0,f1,f2,label"] + [",".join(f"{v:.6g}" for v in r[:3]) + f",{int(r[3])}" for r in rows]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def federated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    rng = np.random.default_rng(0)
    label = rng.integers(0, 3, 150)
    rows = np.column_stack([rng.normal(size=(150, 3)) + 3 * label[:, None], label])
    _write_csv(tmp_path / "train.csv", rows[:120])
    _write_csv(tmp_path / "test.csv", rows[120:])
    files = {"train": str(tmp_path / "train.csv"), "test": str(tmp_path / "test.csv")}
    fds = FederatedDataset(dataset="csv", data_files=files, partitioners={"train": IidPartitioner(4)}, shuffle=False)
    return fds, rows


def test_the_partitions_become_natural_clients(federated):
    fds, rows = federated
    data = from_flwr_datasets(fds, x=["f0", "f1", "f2"], y="label")
    assert data.x_train.shape == (120, 3) and data.x_test.shape == (30, 3) and data.num_classes == 3
    start = 0
    for i in range(4):
        part = fds.load_partition(i, "train").with_format("numpy")
        n = len(part)
        assert np.array_equal(data.client_ids[start : start + n], np.full(n, i))
        np.testing.assert_allclose(data.x_train[start : start + n, 0], part["f0"], rtol=1e-6)
        assert np.array_equal(data.y_train[start : start + n], part["label"])
        start += n
    np.testing.assert_allclose(data.x_test, rows[120:, :3], rtol=1e-5)
    experiment = Experiment("logreg", data, clients="natural", rounds=10, local_steps=20, lr=0.05, eval_every=5)
    assert experiment.config.clients == 4
    assert [len(ix) for ix in experiment.simulation.client_indices] == np.bincount(data.client_ids).tolist()
    assert experiment.run()[-1]["test_acc"] > 0.7


def test_a_missing_column_is_named(federated):
    fds, _ = federated
    with pytest.raises(ValueError, match="no column"):
        from_flwr_datasets(fds, x="image", y="label")
