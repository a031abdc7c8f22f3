"""BHerd-FedAvg, GraB-FedAvg, BHerd-FedNova, BHerd-SCAFFOLD and FedNova against the oracles of docs/bherd.md:
α = 1 equals FedAvg (Eq. 8) / FedNova / SCAFFOLD, closed forms on the quadratic problem built from the reference
selection, exact resume, the client-side recorder, the CLI and bad parameters."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

from pyfedkern import ops, reference
from pyfedkern.algorithms import ALGORITHMS, make_algorithm
from pyfedkern.algorithms.base import ClientUpdates
from pyfedkern.algorithms.bherd import GradientRecorder
from pyfedkern.algorithms.fedavg import FedAvg
from pyfedkern.algorithms.looped import local_run
from pyfedkern.cli import main
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation

# F_i(x) = ½‖x − u_i‖², one sample per client: the gradient at step λ is (1 − η)^(λ−1)·(x − u_i) exactly.
QUAD = ExperimentConfig(
    dataset="quadratic:6,5",
    partition="natural",
    clients=6,
    model="quadratic",
    batch_size=1,
    local_steps=6,
    lr=0.2,
    rounds=3,
)
DIGITS = ExperimentConfig(
    dataset="digits",
    partition="bherd2",
    clients=3,
    model="logreg",
    batch_size=100,
    lr=0.1,
    rounds=2,
    eval_every=2,
)


@dataclasses.dataclass
class FixedOrderFedAvg(FedAvg):
    """FedAvg with BHerd's batch order (fixed, drop_last), so α = 1 must equal it (Eq. 8)."""

    def client_update(self, t, clients, ctx):
        run = local_run(ctx, t, clients, order="fixed", drop_last=True)
        return ClientUpdates.of(run, ctx, {"model": run.sgd_(run.start(self.x))})


def _run(config: ExperimentConfig, algo=None, rounds: int | None = None) -> list[torch.Tensor]:
    sim = Simulation(config, algorithm=algo)
    sim.algorithm.setup(sim, sim.initial_vector)
    models = []
    for t in range(rounds or config.rounds):
        sim.algorithm.round(t, sim)
        models.append(sim.algorithm.x.clone())
    return models


def _u(sim: Simulation) -> torch.Tensor:
    return torch.stack([sim.client_x[i][0] for i in range(sim.num_clients)]).double()


def _quad_grads(x: torch.Tensor, u_i: torch.Tensor, steps: int, lr: float) -> np.ndarray:
    rows, w = [], x.clone()
    for _ in range(steps):
        y = w - u_i
        rows.append(y.numpy().copy())
        w = w - lr * y
    return np.array(rows)


def test_registered_names():
    for name in ("bherd", "grab", "bherd-fednova", "bherd-scaffold", "fednova"):
        assert name in ALGORITHMS
        assert make_algorithm(name).name == name


@pytest.mark.parametrize("buffer_dtype", ["float32", "bfloat16"])
def test_alpha_one_equals_fedavg_in_full_engine_run(buffer_dtype):
    """Eq. 8: with α = 1 the selected sum is every gradient, so w − η Σ p_i Σ_λ y_λ = Σ p_i w_i^(τ_i+1)."""
    cfg = dataclasses.replace(DIGITS, algorithm="bherd", algorithm_params={"alpha": 1.0, "buffer_dtype": buffer_dtype})
    herd = _run(cfg)
    avg = _run(cfg, algo=FixedOrderFedAvg())
    tol = 1e-5 if buffer_dtype == "float32" else 1e-2
    for a, b in zip(herd, avg, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()))
    metrics = Simulation(cfg).run()
    assert metrics[-1]["herd_k_frac"] == 1.0 and np.isfinite(metrics[-1]["test_acc"])


def test_bherd_round_is_eq7_with_reference_selection():
    alpha, lr = 0.5, QUAD.lr
    cfg = dataclasses.replace(QUAD, algorithm="bherd", algorithm_params={"alpha": alpha})
    sim = Simulation(cfg)
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    u = _u(sim)
    x = algo.x.double().clone()
    for t in range(2):
        total = torch.zeros_like(x)
        for cid in range(sim.num_clients):
            grads = _quad_grads(x, u[cid], QUAD.local_steps, lr)
            _, g = reference.herding_select(grads, alpha)
            total += torch.as_tensor(g) / sim.num_clients
        x = x - lr * (1.0 / alpha) * total  # E = 1 (local_steps fixed)
        algo.round(t, sim)
        torch.testing.assert_close(algo.x.double(), x, rtol=1e-5, atol=1e-6)


def test_epoch_scale_switch():
    cfg = dataclasses.replace(DIGITS, local_epochs=2.0, rounds=1)
    literal = Simulation(dataclasses.replace(cfg, algorithm="bherd", algorithm_params={"alpha": 0.5}))
    plain = Simulation(
        dataclasses.replace(cfg, algorithm="bherd", algorithm_params={"alpha": 0.5, "epoch_scale": False})
    )
    assert literal.algorithm.server_scale(literal) == 4.0 and plain.algorithm.server_scale(plain) == 2.0
    x0 = literal.initial_vector.clone()
    a, b = _run(literal.config, rounds=1)[0], _run(plain.config, rounds=1)[0]
    torch.testing.assert_close(a - x0, 2.0 * (b - x0), rtol=1e-4, atol=1e-6)


def test_grab_round_matches_reference_balancing():
    lr = QUAD.lr
    for running_mean in (False, True):
        cfg = dataclasses.replace(QUAD, algorithm="grab", algorithm_params={"running_mean": running_mean})
        sim = Simulation(cfg)
        algo = sim.algorithm
        algo.setup(sim, sim.initial_vector)
        u = _u(sim)
        x = algo.x.double().clone()
        g_sum, alpha_t = torch.zeros_like(x), 0.0
        for cid in range(sim.num_clients):
            grads = _quad_grads(x, u[cid], QUAD.local_steps, lr)
            idx, g = reference.grab_select(grads, running_mean=running_mean)
            g_sum += torch.as_tensor(g) / sim.num_clients
            alpha_t += len(idx) / QUAD.local_steps / sim.num_clients
        stats = algo.round(0, sim)
        assert stats.extras["alpha_t"] == pytest.approx(alpha_t)
        torch.testing.assert_close(algo.x.double(), x - lr / alpha_t * g_sum, rtol=1e-5, atol=1e-6)


def test_grab_with_one_step_never_selects_and_does_not_move():
    cfg = dataclasses.replace(QUAD, algorithm="grab", local_steps=1)
    sim = Simulation(cfg)
    sim.algorithm.setup(sim, sim.initial_vector)
    stats = sim.algorithm.round(0, sim)
    assert stats.extras["alpha_t"] == 0.0
    assert torch.equal(sim.algorithm.x, sim.initial_vector)


def test_fednova_and_bherd_fednova_alpha_one_agree():
    """Both use the mean local gradient: d_i = (w − w_i)/(η τ_i) = (1/τ_i) Σ y."""
    nova = _run(dataclasses.replace(QUAD, algorithm="fednova", algorithm_params={"order": "fixed"}))
    herd = _run(dataclasses.replace(QUAD, algorithm="bherd-fednova", algorithm_params={"alpha": 1.0}))
    for a, b in zip(herd, nova, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fednova_with_equal_steps_is_fedavg():
    """With τ_i = τ for all clients, τ_eff·Σ p_i d_i = Σ p_i (w − w_i)/η: FedNova's step is FedAvg's."""
    nova = _run(dataclasses.replace(QUAD, algorithm="fednova"))
    avg = _run(dataclasses.replace(QUAD, algorithm="fedavg"))
    for a, b in zip(nova, avg, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bherd_fednova_uses_mean_of_selected():
    alpha, lr = 0.5, QUAD.lr
    sim = Simulation(dataclasses.replace(QUAD, algorithm="bherd-fednova", algorithm_params={"alpha": alpha}))
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    u, x = _u(sim), algo.x.double().clone()
    direction = torch.zeros_like(x)
    for cid in range(sim.num_clients):
        idx, g = reference.herding_select(_quad_grads(x, u[cid], QUAD.local_steps, lr), alpha)
        direction += torch.as_tensor(g) / len(idx) / sim.num_clients
    algo.round(0, sim)
    torch.testing.assert_close(algo.x.double(), x - lr * QUAD.local_steps * direction, rtol=1e-5, atol=1e-6)


def test_bherd_scaffold_alpha_one_equals_scaffold():
    herd = _run(dataclasses.replace(QUAD, algorithm="bherd-scaffold", algorithm_params={"alpha": 1.0}, rounds=4))
    scaf = _run(dataclasses.replace(QUAD, algorithm="scaffold", rounds=4))
    for a, b in zip(herd, scaf, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bherd_scaffold_controls_are_means_of_selected_raw_gradients():
    alpha, lr = 0.5, QUAD.lr
    sim = Simulation(dataclasses.replace(QUAD, algorithm="bherd-scaffold", algorithm_params={"alpha": alpha}))
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    u, x = _u(sim), algo.x.double().clone()
    algo.round(0, sim)  # c = c_i = 0 in round 0: v = y
    for cid in range(sim.num_clients):
        idx, g = reference.herding_select(_quad_grads(x, u[cid], QUAD.local_steps, lr), alpha)
        torch.testing.assert_close(algo.client_c[cid].double(), torch.as_tensor(g) / len(idx), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(algo.c, algo.client_c.data.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["bherd", "grab", "bherd-fednova", "bherd-scaffold", "fednova"])
def test_resume_from_state_dict_is_exact(name):
    cfg = dataclasses.replace(DIGITS, algorithm=name, rounds=3)
    straight = _run(cfg)
    sim = Simulation(cfg)
    sim.algorithm.setup(sim, sim.initial_vector)
    sim.algorithm.round(0, sim)
    state = {
        k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in sim.algorithm.state_dict().items()
    }
    fresh = Simulation(cfg)
    fresh.algorithm.setup(fresh, fresh.initial_vector)
    fresh.algorithm.load_state_dict(state)
    for t in range(1, 3):
        fresh.algorithm.round(t, fresh)
    assert torch.equal(fresh.algorithm.x, straight[-1])


def test_bherd_learns_on_digits():
    metrics = Simulation(dataclasses.replace(DIGITS, algorithm="bherd", rounds=4, eval_every=4, lr=0.3)).run()
    assert metrics[-1]["test_acc"] > 0.5 and metrics[-1]["train_loss"] < metrics[0]["train_loss"]


def test_recorder_in_a_users_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    d = sum(p.numel() for p in model.parameters())
    rec = GradientRecorder(d, capacity=2)  # grows past its capacity
    flats = []
    for _ in range(7):
        xb, yb = torch.randn(8, 5), torch.randint(0, 2, (8,))
        model.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        rec.record_module(model)
        flats.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    assert rec.count == 7 and torch.equal(rec.grads, torch.stack(flats))
    idx, g, gap = rec.select(0.5, return_gap=True)
    ridx, rg = ops.herding_select(torch.stack(flats), 0.5)
    assert torch.equal(idx, ridx) and torch.equal(g, rg) and gap >= 0
    rec.reset()
    with pytest.raises(ValueError, match="no gradients"):
        rec.select(0.5)
    with pytest.raises(ValueError, match="shape"):
        rec.record(torch.zeros(d + 1))
    with pytest.raises(ValueError, match="parameters"):
        rec.record_module(nn.Linear(2, 2))
    assert rec.count == 0
    half = GradientRecorder(d, 7, dtype=torch.bfloat16)
    for f in flats:
        half.record(f)
    _, hg = half.select(1.0)
    assert hg.dtype == torch.float32
    torch.testing.assert_close(hg, torch.stack(flats).sum(0), rtol=3e-2, atol=3e-2)


def test_bad_parameters():
    for alpha in (0.0, 1.5, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            make_algorithm("bherd", alpha=alpha)
    with pytest.raises(ValueError, match="buffer_dtype"):
        make_algorithm("bherd", buffer_dtype="float16")
    with pytest.raises(ValueError, match="order"):
        make_algorithm("grab", order="random")
    with pytest.raises(ValueError, match="momentum"):
        Simulation(dataclasses.replace(DIGITS, algorithm="bherd", momentum=0.9)).run()


def test_cli_runs_bherd_with_alpha(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "bherd", "--alpha", "0.3", "--rounds", "1", "--clients", "3", "--model", "logreg"]
    assert main([*argv, "--partition", "bherd1", "--batch-size", "200", "--no-progress", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["algorithm_params"] == {"alpha": 0.3}
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "herd_gap" in lines[-1]
