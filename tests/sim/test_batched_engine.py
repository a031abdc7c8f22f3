"""The engine's batched local training against the per-client loop, for every algorithm.

Each algorithm runs two rounds twice on the same seed, in float64: with ``batched=True`` (every participant of a round
trains as rows of one [k, d] tensor, :mod:`pyfedkern.algorithms.batched`) and ``batched=False`` (the loop over
``client_update``); the global models must agree to rounding. Both gradient paths are covered: the hand-written
Flatten/Linear/ReLU chain (``mlp``) and the vmapped autograd step (a small ``cnn``). Clients hold unequal amounts of
data (Dirichlet split, batch 64), so rows stop at different steps and batches are padded. Then: chunks of
participants (forced tiny, and the automatic budget), and models that cannot be batched.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from torch import nn

from pyfedkern import models
from pyfedkern.algorithms import LocalModel, batched
from pyfedkern.algorithms.batched import BatchedLocal, client_chunks, trainer_for
from pyfedkern.sim.engine import ExperimentConfig, Simulation, _cpu_threads

BASE = ExperimentConfig(
    dataset="digits",
    partition="dirichlet:0.5",
    clients=6,
    fraction=0.7,
    rounds=2,
    batch_size=64,
    local_epochs=1.0,
    weight_decay=1e-3,
    dtype="float64",
    seed=1,
    batched=True,
)
MODEL_PARAMS = {"mlp": {"hidden": 16}, "cnn": {"channels": 4, "hidden": 16}}

# (case id, algorithm, parameters, local momentum): every SGD-based algorithm, with its options that change the
# local step (the FedSpeed-paper baselines' ref_compat clipping, FedSpeed's α < 1 and reference server, the dynamic
# hosts).
CASES = [
    ("fedavg", "fedavg", {}, 0.5),
    ("fedprox", "fedprox", {"mu": 0.1}, 0.5),
    ("scaffold", "scaffold", {}, 0.5),
    ("fednova", "fednova", {}, 0.0),
    ("fedspeed", "fedspeed", {"alpha": 0.75}, 0.0),
    ("fedspeed-ref", "fedspeed", {"ref_compat": True, "clip_norm": 0.5, "corr_avg": "all"}, 0.0),
    ("feddyn", "feddyn", {}, 0.5),
    ("feddyn-clip", "feddyn", {"ref_compat": True, "clip_norm": 0.5}, 0.0),
    ("fedprox-ref", "fedprox", {"mu": 0.1, "ref_compat": True, "clip_norm": 0.5}, 0.0),
    ("scaffold-ref", "scaffold", {"ref_compat": True, "clip_norm": 0.5}, 0.0),
    ("fedsam", "fedsam", {}, 0.0),
    ("fedsam-ref", "fedsam", {"ref_compat": True, "clip_norm": 0.5}, 0.0),
    ("fedcm", "fedcm", {}, 0.0),
    ("fedcm-ref", "fedcm", {"ref_compat": True, "clip_norm": 0.5}, 0.0),
    ("fedadam", "fedadam", {}, 0.0),
    ("bherd", "bherd", {"alpha": 0.5}, 0.0),
    ("grab", "grab", {}, 0.0),
    ("bherd-fednova", "bherd-fednova", {"alpha": 0.5}, 0.0),
    ("bherd-scaffold", "bherd-scaffold", {"alpha": 0.5}, 0.0),
    ("fnrfl", "fnrfl", {"public_size": 5, "refine_epochs": 1.0, "p": 0.5}, 0.0),
    ("dynamic-scaffold", "dynamic", {"sessions": 2, "host": "scaffold"}, 0.0),
    ("dynamic-fedspeed", "dynamic", {"sessions": 2, "host": "fedspeed"}, 0.0),
    ("dynamic-continuous", "dynamic", {"sessions": 2, "pilot_sessions": 1, "method": "continuous"}, 0.0),
    ("fedpbc", "fedpbc", {"link_probs": (0.5,)}, 0.5),
]


def config(algorithm: str, params: dict, momentum: float, model: str, **changes) -> ExperimentConfig:
    rounds = 3 if params.get("method") == "continuous" else 2  # the teacher exists from the second session on
    if algorithm == "dynamic":
        params = {**params, "session_rounds": 1, "sessions": max(params["sessions"], rounds)}
    return dataclasses.replace(
        BASE,
        algorithm=algorithm,
        algorithm_params=params,
        momentum=momentum,
        model=model,
        model_params=MODEL_PARAMS[model],
        rounds=rounds,
        **changes,
    )


def run(cfg: ExperimentConfig, monkeypatch) -> tuple[torch.Tensor, float, int]:
    """(global model after cfg.rounds rounds minus the initial one, last round's local loss, batched runs built)."""
    built = []
    init = BatchedLocal.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(BatchedLocal, "__init__", counting)
    sim = Simulation(cfg)
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    with _cpu_threads(1):  # as Simulation.run for small models (threads spinning on a busy machine cost seconds)
        for t in range(cfg.rounds):
            stats = algo.round(t, sim)
    monkeypatch.setattr(BatchedLocal, "__init__", init)
    return algo.global_model() - sim.initial_vector, stats.local_loss, len(built)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize(("case", "algorithm", "params", "momentum"), CASES, ids=[c[0] for c in CASES])
def test_batched_rounds_equal_the_per_client_loop(case, algorithm, params, momentum, model, monkeypatch):
    cfg = config(algorithm, params, momentum, model)
    x_batched, loss_batched, runs = run(cfg, monkeypatch)
    x_loop, loss_loop, loop_runs = run(dataclasses.replace(cfg, batched=False), monkeypatch)
    assert runs > 0 and loop_runs == 0  # each run took the path it was asked for
    assert x_batched.abs().max() > 1e-3  # the model moved
    torch.testing.assert_close(x_batched, x_loop, rtol=1e-10, atol=1e-12)
    assert np.isfinite(loss_batched) and loss_batched == pytest.approx(loss_loop, rel=1e-10)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_the_loop_s_plain_sgd_steps_and_chunks_equal_the_batched_round(model, monkeypatch):
    """FedAvg without weight decay or momentum: the loop steps without its flat gradient
    (:meth:`~pyfedkern.algorithms.LocalModel.sgd_step_`) and folds its messages in chunks of
    :data:`~pyfedkern.algorithms.batched.LOOP_CHUNK_BYTES` (here two clients' worth)."""
    cfg = config("fedavg", {}, 0.0, model, weight_decay=0.0, fraction=1.0)
    loop = Simulation(dataclasses.replace(cfg, batched=False))
    monkeypatch.setattr(batched, "LOOP_CHUNK_BYTES", 2 * 2 * loop.local.dim * 8)
    assert [len(c) for c in client_chunks(loop, np.arange(6))] == [2, 2, 2]
    steps = []
    monkeypatch.setattr(LocalModel, "loss_and_grad", lambda *a: pytest.fail("a plain step wrote the flat gradient"))
    sgd_step = LocalModel.sgd_step_
    monkeypatch.setattr(LocalModel, "sgd_step_", lambda *a: steps.append(1) or sgd_step(*a))
    x_loop, loss_loop, _ = run(dataclasses.replace(cfg, batched=False), monkeypatch)
    assert steps
    monkeypatch.undo()
    x_batched, loss_batched, runs = run(cfg, monkeypatch)
    assert runs > 0 and x_batched.abs().max() > 1e-3
    torch.testing.assert_close(x_loop, x_batched, rtol=1e-10, atol=1e-12)
    assert loss_loop == pytest.approx(loss_batched, rel=1e-10)


def test_the_models_take_the_gradient_paths_they_are_meant_to():
    chain = Simulation(config("fedavg", {}, 0.0, "mlp")).local
    vmapped = Simulation(config("fedavg", {}, 0.0, "cnn")).local
    assert trainer_for(chain).chain is not None
    assert trainer_for(vmapped).chain is None


@pytest.mark.parametrize(
    ("algorithm", "params"),
    [
        ("fedavg", {}),
        ("scaffold", {}),
        ("fedspeed", {"corr_avg": "all"}),
        ("bherd", {"alpha": 0.5}),
        ("fnrfl", {"public_size": 5, "refine_epochs": 1.0, "p": 0.5}),
        ("fedpbc", {"link_probs": (0.5,)}),
    ],
)
def test_chunks_of_participants_give_the_unchunked_round(algorithm, params, monkeypatch):
    """A forced chunk of 2 participants at a time (the memory budget) changes only the order of the server's sums."""
    cfg = config(algorithm, params, 0.0, "mlp", fraction=1.0)
    whole, _, runs_whole = run(cfg, monkeypatch)
    chunked, _, runs_chunked = run(dataclasses.replace(cfg, client_chunk=2), monkeypatch)
    assert runs_chunked > runs_whole  # more, smaller batched runs
    torch.testing.assert_close(chunked, whole, rtol=1e-10, atol=1e-12)


def test_automatic_chunks_follow_the_free_memory(monkeypatch):
    sim = Simulation(config("bherd", {"alpha": 0.5}, 0.0, "mlp"))
    per_client = batched.bytes_per_client(sim, state_rows=10)
    d = sim.local.dim
    assert per_client >= 8 * 15 * d  # float64 model, gradient, messages and the 10 state rows at least
    clients = np.arange(6)
    monkeypatch.setattr(batched, "free_memory", lambda device: int(2.5 * per_client / batched.MEMORY_FRACTION["cpu"]))
    assert [c.tolist() for c in client_chunks(sim, clients, 10)] == [[0, 1], [2, 3], [4, 5]]
    monkeypatch.setattr(batched, "free_memory", lambda device: 0)
    assert [len(c) for c in client_chunks(sim, clients, 10)] == [1] * 6  # never less than one client
    monkeypatch.setattr(batched, "free_memory", lambda device: 1 << 50)
    assert [len(c) for c in client_chunks(sim, clients, 10)] == [6]
    assert list(client_chunks(sim, np.zeros(0, dtype=np.int64))) == []
    sim.client_chunk = 4
    assert [len(c) for c in client_chunks(sim, clients, 10)] == [4, 2]


def test_models_with_buffers_use_the_per_client_loop_and_say_so_once(monkeypatch, caplog):
    def with_batchnorm(input_shape, num_classes, hidden=16):
        return nn.Sequential(
            nn.Flatten(), nn.Linear(64, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    monkeypatch.setitem(models._BUILDERS, "mlp", with_batchnorm)
    with caplog.at_level(logging.WARNING, logger="pyfedkern"):
        cfg = config("fedavg", {}, 0.0, "mlp")
        _, loss, runs = run(cfg, monkeypatch)
    assert runs == 0 and np.isfinite(loss)
    notes = [r for r in caplog.records if "not batched" in r.getMessage()]
    assert len(notes) == 1 and "buffers" in notes[0].getMessage()


def test_config_options_are_checked():
    for bad, match in (
        ({"client_chunk": 0}, "client_chunk"),
        ({"batched": "yes"}, "batched"),
        ({"dtype": "float16"}, "dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(BASE, **bad).validate()


GPU_CASES = [c for c in CASES if c[0] in ("fedavg", "scaffold", "fedspeed", "fedspeed-ref", "fedsam", "bherd", "grab")]


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize(("case", "algorithm", "params", "momentum"), GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_batched_rounds_equal_the_per_client_loop(case, algorithm, params, momentum, model, monkeypatch):
    cfg = config(algorithm, params, momentum, model, device="cuda")
    x_batched, loss_batched, runs = run(cfg, monkeypatch)
    x_loop, loss_loop, _ = run(dataclasses.replace(cfg, batched=False), monkeypatch)
    assert runs > 0 and x_batched.device.type == "cuda"
    torch.testing.assert_close(x_batched, x_loop, rtol=1e-9, atol=1e-11)
    assert loss_batched == pytest.approx(loss_loop, rel=1e-9)


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_cuda_local_steps_never_wait_for_the_gpu(model):
    """Batched local steps queue their work and read nothing back: under ``set_sync_debug_mode("error")`` any host
    synchronisation inside the steps (a ``.item()``, a blocking copy) raises. Plain SGD with momentum and a
    correction, and FedSpeed's steps with the row-form ops."""
    from pyfedkern import ops

    sim = Simulation(config("fedavg", {}, 0.5, model, device="cuda", partition="noise:0.3"))
    clients = np.arange(sim.num_clients)
    runs = [BatchedLocal(sim, 0, clients), BatchedLocal(sim, 1, clients)]
    starts = [run.start(sim.initial_vector) for run in runs]
    anchor = torch.zeros_like(starts[1])
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runs[0].sgd_(starts[0], correction=lambda g, step: g.add_(step.x, alpha=0.01))
        for step in runs[1].run(starts[1]):
            g1 = runs[1].gradients(step)
            g2 = runs[1].gradients(step, ops.sam_perturb(step.x, g1, 0.1), record=False)
            ops.fedspeed_update_(step.x, g2, 0.05, g1=g1, alpha=0.5, anchor=anchor[: step.rows], prox_coef=0.1)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert all(torch.isfinite(run.losses()).all() for run in runs)
