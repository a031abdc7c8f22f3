"""The simulation engine: config validation, determinism, exact resume, metrics and files."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from pyfedkern.sim.engine import ExperimentConfig, Simulation, load_config, parse_lr_schedule
from pyfedkern.sim.results import read_metrics

SMALL = ExperimentConfig(clients=4, rounds=4, model="logreg", partition="iid", batch_size=64, checkpoint_every=2)


def _numbers(metrics):
    """Metrics without wall-clock times (which differ between runs)."""
    return [{k: v for k, v in m.items() if not k.startswith("time")} for m in metrics]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"clients": 0}, "clients"),
        ({"rounds": 1.5}, "rounds"),
        ({"fraction": 0.0}, "fraction"),
        ({"lr": -1.0}, "lr"),
        ({"momentum": 1.0}, "momentum"),
        ({"lr_schedule": "exp:2"}, "lr_schedule"),
        ({"dataset": "imagenet"}, "unknown dataset"),
        ({"partition": "dirichlet:x"}, "not a number"),
        ({"model": "vgg"}, "unknown model"),
        ({"algorithm": "fedfoo"}, "fedfoo"),
        ({"algorithm": "fedprox", "algorithm_params": {"mu": -1.0}}, "mu"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_invalid_config_raises_value_error(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SMALL, **change).validate()


def test_lr_schedules():
    assert parse_lr_schedule("const") == ("const", 0.0)
    sim = Simulation(dataclasses.replace(SMALL, lr=0.1, lr_schedule="exp:0.5"))
    assert sim.lr(0) == pytest.approx(0.1) and sim.lr(2) == pytest.approx(0.025)
    sim = Simulation(dataclasses.replace(SMALL, lr=0.1, lr_schedule="invsqrt:1"))
    assert sim.lr(3) == pytest.approx(0.05)


def test_same_config_same_numbers_and_seed_changes_them():
    a = Simulation(SMALL).run()
    b = Simulation(SMALL).run()
    c = Simulation(dataclasses.replace(SMALL, seed=1)).run()
    assert _numbers(a) == _numbers(b)
    assert _numbers(a) != _numbers(c)
    assert [m["round"] for m in a] == [0, 1, 2, 3, 4]
    assert a[-1]["test_acc"] > a[0]["test_acc"]


def test_run_writes_files_and_resume_after_interruption_is_exact(tmp_path, monkeypatch):
    config = dataclasses.replace(SMALL, rounds=5, algorithm="scaffold", fraction=0.5)
    full = Simulation(config).run(tmp_path / "full")
    for name in ("config.json", "metrics.jsonl", "summary.json", "model.pt"):
        assert (tmp_path / "full" / name).exists(), name
    assert load_config(tmp_path / "full") == config
    assert _numbers(read_metrics(tmp_path / "full")) == _numbers(full)

    sim = Simulation(config)
    original_round = sim.algorithm.round

    def crash_in_round_3(t, ctx):
        if t == 3:
            raise KeyboardInterrupt
        return original_round(t, ctx)

    monkeypatch.setattr(sim.algorithm, "round", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        sim.run(tmp_path / "cut")
    assert not (tmp_path / "cut" / "summary.json").exists()
    resumed = Simulation(load_config(tmp_path / "cut")).run(tmp_path / "cut", resume=True)
    assert _numbers(resumed) == _numbers(full)
    model_full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    model_cut = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert torch.equal(model_full["x"], model_cut["x"])
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["rounds"] == 5


def test_refuses_to_overwrite_a_finished_run(tmp_path):
    Simulation(dataclasses.replace(SMALL, rounds=1)).run(tmp_path / "r")
    with pytest.raises((FileExistsError, ValueError)):
        Simulation(dataclasses.replace(SMALL, rounds=1)).run(tmp_path / "r")


def test_partial_participation_samples_the_requested_fraction():
    sim = Simulation(dataclasses.replace(SMALL, clients=10, fraction=0.3))
    picks = [sim.sample_clients(t) for t in range(20)]
    assert all(len(p) == 3 and np.all(np.diff(p) > 0) for p in picks)
    assert len({tuple(p) for p in picks}) > 1
    assert np.array_equal(sim.sample_clients(5), picks[5])


def test_batches_cover_the_client_data_once_per_epoch():
    sim = Simulation(dataclasses.replace(SMALL, batch_size=7))
    n = int(sim.client_sizes[0])
    seen = torch.cat([y for _, y in sim.batches(0, 0, epochs=1.0)])
    assert seen.shape[0] == n
    assert torch.equal(seen.sort().values, sim.client_y[0].sort().values)
    steps = list(sim.batches(0, 0, steps=3))
    assert len(steps) == 3
    fixed_a = [y for _, y in sim.batches(0, 0, epochs=1.0, order="fixed")]
    fixed_b = [y for _, y in sim.batches(0, 5, epochs=1.0, order="fixed")]
    assert all(torch.equal(a, b) for a, b in zip(fixed_a, fixed_b, strict=True))
