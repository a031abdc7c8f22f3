"""The simulation engine: config validation, determinism, exact resume, metrics and files."""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from pyfedkern.data import datasets
from pyfedkern.sim.checkpoints import load_config
from pyfedkern.sim.config import ExperimentConfig, device_problems, parse_lr_schedule
from pyfedkern.sim.engine import Simulation
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
        ({"fraction": 1.5}, r"fraction must be in \(0, 1\]"),
        ({"fraction": float("nan")}, "fraction must be a finite number"),
        ({"fraction": "0.5"}, "fraction must be a finite number"),
        ({"local_epochs": float("inf")}, "local_epochs"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"seed": True}, "seed"),
        ({"eval_train_max": -1}, "eval_train_max"),
        ({"batched": "yes"}, "batched must be true, false or None"),
        ({"channels_last": 1}, "channels_last must be true, false or None"),
        ({"normalize": "zscore"}, "normalize"),
        ({"dataset": "digits:3"}, "no arguments"),
        ({"dataset": "synthetic:-1,1"}, "α and β"),
        ({"partition": "dirichlet:0"}, "dirichlet:α must be > 0"),
        ({"partition": "dirichlet:-0.5"}, "dirichlet:α must be > 0"),
        ({"partition": "dirichlet:0.3,2"}, "at most 1 argument"),
        ({"partition": "dirichlet:0.3;1"}, "not a number"),
        ({"partition": "shards:1.5"}, "shards:k"),
        ({"partition": "groups", "clients": 5}, "even number"),
        ({"clients": 1348}, "clients=1348 is more than the 1347 training samples of dataset 'digits'"),
        ({"dataset": "quadratic:6,3", "clients": 7, "partition": "natural"}, "more than the 6 training samples"),
        ({"dataset": "synthetic:1,1,3", "clients": 2000}, "clients=2000 is more than the"),
    ],
)
def test_invalid_config_raises_value_error(change, message, monkeypatch):
    config = dataclasses.replace(SMALL, **change)
    with pytest.raises(ValueError, match=message):
        config.validate()

    def no_loading(*args, **kwargs):
        raise AssertionError("data loaded before the config was checked")

    monkeypatch.setattr(datasets, "load_dataset", no_loading)
    with pytest.raises(ValueError, match=message):
        Simulation(config)


@pytest.mark.parametrize("device", ["cuda:x", "cuda:-1", "cuda:", "cpu:0", "CUDA", "gpu"])
def test_a_malformed_device_is_refused(device):
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N' \(N a GPU index\), got "):
        dataclasses.replace(SMALL, device=device).validate()


@pytest.mark.parametrize(
    ("device", "facts", "expected"),
    [
        ("cuda", {"torch_cuda": True, "gpus": 1, "pyfedkern_cuda": True}, []),
        ("cuda:1", {"torch_cuda": True, "gpus": 2, "pyfedkern_cuda": True}, []),
        ("cuda", {"torch_cuda": False, "gpus": 0, "pyfedkern_cuda": True}, ["torch was built without CUDA"]),
        ("cuda", {"torch_cuda": True, "gpus": 1, "pyfedkern_cuda": False}, ["pyfedkern was built without CUDA"]),
        ("cuda", {"torch_cuda": True, "gpus": 0, "pyfedkern_cuda": True}, ["no CUDA GPU is visible"]),
        ("cuda:7", {"torch_cuda": True, "gpus": 0, "pyfedkern_cuda": True}, ["no CUDA GPU is visible"]),
        (
            "cuda:7",
            {"torch_cuda": True, "gpus": 2, "pyfedkern_cuda": True},
            ["GPU index 7 is out of range: 2 GPU(s) visible, cuda:0 to cuda:1"],
        ),
        (
            "cuda:2",
            {"torch_cuda": True, "gpus": 2, "pyfedkern_cuda": False},
            ["pyfedkern was built without CUDA", "GPU index 2 is out of range"],
        ),
        (
            "cuda:7",
            {"torch_cuda": False, "gpus": 0, "pyfedkern_cuda": False},
            ["torch was built without CUDA", "pyfedkern was built without CUDA"],
        ),
    ],
)
def test_device_problems_say_why_a_gpu_cannot_be_used(device, facts, expected):
    problems = device_problems(device, **facts)
    assert len(problems) == len(expected)
    assert all(part in problem for part, problem in zip(expected, problems, strict=True))


# ids without the bare word "cuda", which conftest reads as the mark of a test that needs a GPU
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:7"], ids=["default-gpu", "gpu-0", "gpu-7"])
def test_a_cuda_device_is_checked_against_this_machine(device, monkeypatch):
    import pyfedkern

    facts = {
        "torch_cuda": torch.backends.cuda.is_built(),
        "gpus": torch.cuda.device_count(),
        "pyfedkern_cuda": bool(pyfedkern.build_info()["cuda"]),
    }
    problems = device_problems(device, **facts)
    config = dataclasses.replace(SMALL, device=device)
    if not problems:
        config.validate()
        return
    config.validate()  # a valid config on any machine (its results can be read anywhere)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("data loaded for an unusable device"))
    with pytest.raises(ValueError, match=f"device '{device}' cannot be used here: ") as err:
        Simulation(config)
    assert all(problem in str(err.value) for problem in problems)


def test_too_many_clients_for_a_dataset_of_unknown_size_is_caught_right_after_loading(monkeypatch):
    monkeypatch.setattr(datasets, "train_size", lambda spec, split_seed=0: None)  # as for MNIST / CIFAR-10
    config = dataclasses.replace(SMALL, clients=1348)
    config.validate()
    with pytest.raises(ValueError, match="clients=1348 is more than the 1347 training samples"):
        Simulation(config)


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


def _interrupted_run(sim: Simulation, crash_round: int, out, monkeypatch) -> None:
    """Run ``sim`` into ``out`` until a KeyboardInterrupt at the start of round ``crash_round``."""
    original_round = sim.algorithm.round

    def crash(t, ctx):
        if t == crash_round:
            raise KeyboardInterrupt
        return original_round(t, ctx)

    monkeypatch.setattr(sim.algorithm, "round", crash)
    with pytest.raises(KeyboardInterrupt):
        sim.run(out)


def test_run_writes_files_and_resume_after_interruption_is_exact(tmp_path, monkeypatch):
    config = dataclasses.replace(SMALL, rounds=5, algorithm="scaffold", fraction=0.5)
    full = Simulation(config).run(tmp_path / "full")
    for name in ("config.json", "metrics.jsonl", "summary.json", "model.pt"):
        assert (tmp_path / "full" / name).exists(), name
    assert load_config(tmp_path / "full") == config
    assert _numbers(read_metrics(tmp_path / "full")) == _numbers(full)

    _interrupted_run(Simulation(config), 3, tmp_path / "cut", monkeypatch)
    assert not (tmp_path / "cut" / "summary.json").exists()
    # Rounds 1-3 were recorded, the last checkpoint is after round 2: round 3 must be redone, not duplicated.
    assert [m["round"] for m in read_metrics(tmp_path / "cut")] == [0, 1, 2, 3]
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"round": 4, "local_lo')  # a record cut short by a kill
    resumed = Simulation(load_config(tmp_path / "cut")).run(tmp_path / "cut", resume=True)
    assert _numbers(resumed) == _numbers(full)
    assert _numbers(read_metrics(tmp_path / "cut")) == _numbers(full)
    model_full = torch.load(tmp_path / "full" / "model.pt", weights_only=True)
    model_cut = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)
    assert torch.equal(model_full["x"], model_cut["x"])
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["rounds"] == 5


def test_refuses_to_overwrite_or_resume_a_finished_run(tmp_path):
    config = dataclasses.replace(SMALL, rounds=1)
    Simulation(config).run(tmp_path / "r")
    before = (tmp_path / "r" / "metrics.jsonl").read_text()
    with pytest.raises(FileExistsError, match="already holds a run"):
        Simulation(config).run(tmp_path / "r")
    with pytest.raises(FileExistsError, match="already finished"):
        Simulation(config).run(tmp_path / "r", resume=True)
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == before


def test_resume_refuses_a_changed_config_and_a_corrupt_metrics_file(tmp_path, monkeypatch):
    config = dataclasses.replace(SMALL, rounds=3, checkpoint_every=1)
    _interrupted_run(Simulation(config), 2, tmp_path / "cut", monkeypatch)
    with pytest.raises(ValueError, match="config differs in lr"):
        Simulation(dataclasses.replace(config, lr=0.5)).run(tmp_path / "cut", resume=True)
    path = tmp_path / "cut" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{garbage", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        Simulation(config).run(tmp_path / "cut", resume=True)
    path.write_text(lines[0] + "\n")  # round 1 lost although its checkpoint exists
    with pytest.raises(ValueError, match=r"should hold rounds 0..2"):
        Simulation(config).run(tmp_path / "cut", resume=True)


def test_round_metrics_traffic_times_and_evaluation_schedule():
    rounds, eval_every = 5, 2
    for algorithm, vectors in (("fedavg", 1), ("scaffold", 2)):
        config = dataclasses.replace(
            SMALL, algorithm=algorithm, clients=6, fraction=0.5, rounds=rounds, eval_every=eval_every
        )
        sim = Simulation(config)
        metrics = sim.run()
        d = sim.local.dim
        for m in metrics[1:]:
            assert m["clients"] == 3
            # float32 vectors of d floats: FedAvg sends the model each way, SCAFFOLD the model and a control variate.
            assert m["bytes_up"] == m["bytes_down"] == 3 * vectors * 4 * d, algorithm
            times = [m[k] for k in ("time_local", "time_aggregation", "time_evaluation")]
            assert all(isinstance(v, float) and v >= 0 for v in [*times, m["time_round"]])
            assert sum(times) <= m["time_round"]
            evaluated = m["round"] % eval_every == 0 or m["round"] == rounds
            assert ("test_acc" in m) == ("test_loss" in m) == ("train_loss" in m) == evaluated
            if not evaluated:
                assert m["time_evaluation"] == 0.0
        assert "test_acc" in metrics[0] and metrics[0]["time_evaluation"] >= 0
        assert [m["round"] for m in metrics if "test_acc" in m] == [0, 2, 4, 5]


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"epochs": 1.5},
        {"steps": 7},
        {"epochs": 2.3, "drop_last": True},
        {"steps": 4, "order": "fixed"},
        {"epochs": 0.5, "batch_size": 5},
        {"steps": 0},
    ],
)
def test_batch_plans_follow_the_seeded_streams(kwargs):
    """Epoch e of client c in round t is default_rng([seed, 2, t, c, e]).permutation(n) cut into batches (the fixed
    order: default_rng([seed, 3, c])); stored results depend on exactly these streams."""
    sim = Simulation(dataclasses.replace(SMALL, clients=6, partition="dirichlet:0.3", batch_size=16, seed=7))
    clients, t = [3, 0, 5, 5], 4
    plans = sim.batch_plans(clients, t, **kwargs)
    for cid, plan in zip(clients, plans, strict=True):
        n = int(sim.client_sizes[cid])
        size = min(kwargs.get("batch_size", 16), n)
        per_epoch = n // size if kwargs.get("drop_last") else -(-n // size)
        work = kwargs.get("epochs", 1.0) * n / size
        steps = kwargs.get("steps", math.floor(work + 1e-9) if kwargs.get("drop_last") else math.ceil(work - 1e-9))
        expected = []
        for step in range(steps):
            epoch, b = divmod(step, per_epoch)
            keys = [7, 3, cid] if kwargs.get("order") == "fixed" else [7, 2, t, cid, epoch]
            expected.append(np.random.default_rng(keys).permutation(n)[b * size : (b + 1) * size])
        assert len(plan) == steps
        assert all(np.array_equal(a, b) for a, b in zip(plan, expected, strict=True))
        assert all(np.array_equal(a, b) for a, b in zip(sim.batch_indices(cid, t, **kwargs), plan, strict=True))


@pytest.mark.parametrize(
    ("partition", "kwargs"),
    [
        ("dirichlet:0.3", {"epochs": 1.5}),
        ("noise:0.5", {"steps": 4}),
        ("dirichlet:0.3", {"epochs": 2.3, "drop_last": True, "order": "fixed"}),
    ],
)
def test_stacked_batches_are_every_clients_batches(partition, kwargs):
    """stacked_batches orders the clients by descending number of steps (ties keep the given order) and gathers,
    per step, exactly the batch batches() gives each client that still has one (noise included), as a prefix of
    the rows; unequal batch sizes are zero-weighted padding."""
    sim = Simulation(dataclasses.replace(SMALL, clients=6, partition=partition, batch_size=16, model="mlp"))
    clients = [5, 0, 3, 2]
    stacked = sim.stacked_batches(clients, 7, **kwargs)
    counts = [len(sim.batch_indices(cid, 7, **kwargs)) for cid in clients]
    order = np.argsort(-np.array(counts), kind="stable")
    assert stacked.clients.tolist() == [clients[i] for i in order]
    assert stacked.steps.tolist() == sorted(counts, reverse=True)
    expected = [list(sim.batches(int(cid), 7, **kwargs)) for cid in stacked.clients]
    steps = [tuple(None if t is None else t.clone() for t in step) for step in stacked]  # buffers are reused
    assert len(steps) == max(counts)
    padded = 0
    for step, (xb, yb, wb) in enumerate(steps):
        assert xb.shape[0] == sum(len(e) > step for e in expected)
        for r in range(xb.shape[0]):
            x, y = expected[r][step]
            b = y.shape[0]
            assert torch.equal(xb[r, :b], x) and torch.equal(yb[r, :b], y)
            if wb is None:
                assert b == xb.shape[1]
            else:
                assert torch.allclose(wb[r, :b], torch.full((b,), 1.0 / b)) and not wb[r, b:].any()
                padded += b < xb.shape[1]
    first = sim.batch_indices(int(stacked.clients[0]), 7, **kwargs)[0]
    raw = sim.client_x[int(stacked.clients[0])][torch.as_tensor(first)]
    assert torch.equal(steps[0][0][0, : len(first)], raw) == (partition != "noise:0.5")  # noise, when on
    assert list(sim.stacked_batches([], 7, steps=2)) == []
    if kwargs.get("epochs") and not kwargs.get("drop_last"):
        assert padded > 0  # 1.5 epochs of batch 16 end on partial batches of unequal sizes


def test_a_diverged_global_model_is_reported_once(caplog):
    config = ExperimentConfig(
        dataset="quadratic:4,3", partition="natural", clients=4, model="quadratic", batch_size=1, local_steps=3,
        lr=1e20, rounds=4,
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="pyfedkern"):
        metrics = Simulation(config).run()
    said = [r.getMessage() for r in caplog.records if "NaN or inf" in r.getMessage()]
    first = next(m["round"] for m in metrics if not math.isfinite(m["test_loss"]))
    assert said == [f"round {first}: the global model holds NaN or inf (training diverged; a smaller learning rate "
                    "may help): the later rounds cannot recover"]  # fmt: skip
    with caplog.at_level("WARNING", logger="pyfedkern"):
        caplog.clear()
        Simulation(dataclasses.replace(config, lr=0.1)).run()
    assert not [r for r in caplog.records if "NaN or inf" in r.getMessage()]
