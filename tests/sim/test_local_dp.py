"""Local DP-SGD from the run options (``dp="local"``, ``--dp local``): the engine's clipped-gradient training, loop ==
batched, one process == two workers, the ε it reports against ``dp-accounting``, resume bit for bit, and what it
refuses."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

dp_accounting = pytest.importorskip("dp_accounting")

import pyfedkern  # noqa: E402
from pyfedkern import Experiment, privacy  # noqa: E402
from pyfedkern.cli import main  # noqa: E402
from pyfedkern.sim.engine import ExperimentConfig, Simulation  # noqa: E402
from pyfedkern.sim.results import read_metrics  # noqa: E402

LOCAL = ExperimentConfig(
    clients=4,
    rounds=1,
    model="logreg",
    partition="iid",
    batch_size=8,
    local_steps=3,
    dtype="float64",
    seed=3,
    dp="local",
    dp_clip=0.05,
    dp_delta=1e-4,
    dp_noise_multiplier=0.0,
)


def _numbers(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time_")} for m in metrics]


def _direct_epsilon(sigma: float, delta: float, steps: int, q: float) -> float:
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def test_without_noise_a_round_is_clipped_gradient_training():
    """σ = 0: each client's local steps are SGD on the mean of its per-sample gradients clipped to C (one backward
    per sample here), and the server averages the models by |D_i|."""
    sim = Simulation(LOCAL)
    x0 = sim.initial_vector.clone()
    local, clipped = sim.local, 0
    models, weights = [], []
    for cid in range(sim.num_clients):
        x = x0.clone()
        for positions in sim.batch_indices(cid, 0, steps=LOCAL.local_steps):
            xb, yb = sim.client_x[cid][positions], sim.client_y[cid][positions]
            grads = []
            for n in range(len(positions)):
                local.load_(x)
                local.loss_and_grad(xb[n : n + 1], yb[n : n + 1])
                g = local.flat.grad.clone()
                clipped += int(g.norm() > LOCAL.dp_clip)
                grads.append(g * min(1.0, LOCAL.dp_clip / float(g.norm())))
            x = x - LOCAL.lr * torch.stack(grads).mean(0)
        models.append(x)
        weights.append(float(sim.client_sizes[cid]))
    want = sum(w * m for w, m in zip(weights, models, strict=True)) / sum(weights)
    assert clipped > 0  # the clip acts
    for batched in (False, True):
        run = Simulation(dataclasses.replace(LOCAL, batched=batched))
        run.run()
        torch.testing.assert_close(run.algorithm.global_model(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("algorithm", "params", "momentum"),
    [("fedavg", {}, 0.5), ("scaffold", {}, 0.5), ("bherd", {}, 0.0), ("fedpbc", {"link_probs": (0.9,)}, 0.0)],
)
def test_loop_equals_batched_with_noise(algorithm, params, momentum):
    """σ > 0: the per-client loop and the batched path draw the same noise for each (round, client, step) and give
    the same models (float64), with unequal clients (padded batches), momentum and weight decay."""
    config = dataclasses.replace(
        LOCAL,
        algorithm=algorithm,
        algorithm_params=params,
        rounds=2,
        clients=5,
        partition="dirichlet:0.5",
        fraction=0.6,
        local_steps=None,
        local_epochs=1.0,
        batch_size=32,
        momentum=momentum,
        weight_decay=1e-3,
        dp_noise_multiplier=0.7,
        dp_clip=0.5,
    )
    finals = []
    for batched in (False, True):
        sim = Simulation(dataclasses.replace(config, batched=batched))
        sim.run()
        finals.append(sim.algorithm.global_model())
    torch.testing.assert_close(finals[0], finals[1], rtol=1e-10, atol=1e-10)
    plain = Simulation(dataclasses.replace(config, dp=None, dp_clip=None, dp_delta=None, dp_noise_multiplier=None))
    plain.run()
    assert (plain.algorithm.global_model() - finals[0]).abs().max() > 1e-3  # the noise and clip change the run


def test_reported_epsilon_equals_dp_accounting(tmp_path):
    """ε after t rounds is dp-accounting's for t·s Poisson-subsampled Gaussian steps at the worst-case client's rate
    q = max_i min(B, n_i)/n_i (s: the most local steps a client takes); summary.json holds the last."""
    config = dataclasses.replace(LOCAL, rounds=3, partition="dirichlet:0.5", dp_noise_multiplier=1.2)
    sim = Simulation(config)
    metrics = sim.run(tmp_path / "run")
    sizes = sim.client_sizes
    q = float(np.max(np.minimum(config.batch_size, sizes) / sizes))
    spent = [m["dp_epsilon"] for m in metrics[1:]]
    want = [_direct_epsilon(1.2, config.dp_delta, t * config.local_steps, q) for t in (1, 2, 3)]
    assert spent == pytest.approx(want, rel=1e-9)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["dp_epsilon"] == spent[-1]

    budget = dataclasses.replace(config, dp_noise_multiplier=None, dp_epsilon=2.0, local_steps=None, local_epochs=1.0)
    sim = Simulation(budget)
    steps = int(sim.planned_steps(np.arange(sim.num_clients)).max())
    assert sim.local_dp.steps_per_round == steps > 1
    sigma = privacy.noise_multiplier(2.0, config.dp_delta, 3 * steps, q)
    assert sim.dpsgd.noise_multiplier == sim.local_dp.noise_multiplier == sigma
    assert sim.run()[-1]["dp_epsilon"] <= 2.0 + 1e-9


def test_resume_is_bit_identical_and_keeps_the_budget(tmp_path):
    config = dataclasses.replace(LOCAL, rounds=4, checkpoint_every=2, fraction=0.5, dp_noise_multiplier=0.8)
    full = Simulation(config).run(tmp_path / "full")
    Simulation(dataclasses.replace(config, rounds=2)).run(tmp_path / "cut")
    resumed = Simulation(config).run(tmp_path / "cut", resume=True)  # extended to 4 rounds: σ given, ε grows
    assert _numbers(resumed) == _numbers(full)
    full_x = torch.load(tmp_path / "full" / "model.pt", weights_only=True)["x"]
    assert torch.equal(torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["x"], full_x)

    budget = dataclasses.replace(config, rounds=2, dp_noise_multiplier=None, dp_epsilon=5.0)
    Simulation(budget).run(tmp_path / "budget")
    with pytest.raises(ValueError, match="would exceed the run's privacy budget"):
        Simulation(dataclasses.replace(budget, rounds=4)).run(tmp_path / "budget", resume=True)


@pytest.mark.parametrize(
    "config",
    [
        dataclasses.replace(LOCAL, rounds=4, checkpoint_every=2, fraction=0.5, dp_noise_multiplier=0.8),
        dataclasses.replace(  # Poisson-sampled batches (dp_sampling="poisson"), some of them empty
            LOCAL,
            clients=5,
            rounds=4,
            checkpoint_every=2,
            partition="dirichlet:0.5",
            batch_size=4,
            local_steps=12,
            fraction=0.6,
            dp_clip=0.5,
            dp_noise_multiplier=0.7,
            dp_sampling="poisson",
        ),
    ],
    ids=["shuffle", "poisson"],
)
def test_interrupted_run_resumes_bit_identical(tmp_path, monkeypatch, config):
    """A run stopped in round 3 (after its round-2 checkpoint) and resumed equals the uninterrupted run bit for bit."""
    full = Simulation(config).run(tmp_path / "full")
    sim = Simulation(config)
    cls = type(sim.algorithm)
    original = cls.round

    def stop(self, t, ctx):
        if t == 2:
            raise KeyboardInterrupt
        return original(self, t, ctx)

    monkeypatch.setattr(cls, "round", stop)
    with pytest.raises(KeyboardInterrupt):
        sim.run(tmp_path / "cut")
    monkeypatch.undo()
    assert [m["round"] for m in read_metrics(tmp_path / "cut")] == [0, 1, 2]
    resumed = Simulation(config).run(tmp_path / "cut", resume=True)
    assert _numbers(resumed) == _numbers(full)
    full_x = torch.load(tmp_path / "full" / "model.pt", weights_only=True)["x"]
    assert torch.equal(torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["x"], full_x)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"algorithm": "fedspeed"}, "fedspeed takes extra gradients"),
        ({"algorithm": "fedsam"}, "fedsam takes extra gradients"),
        ({"algorithm": "dynamic"}, "dynamic takes extra gradients"),
        ({"dp_adaptive_clip": 0.5}, "dp_adaptive_clip apply to central DP only"),
        ({"dp_population": 1000, "dp_noise_cohort": 10}, "dp_population, dp_noise_cohort apply to central DP only"),
        ({"dp_epsilon": 1.0}, "local DP needs exactly one of dp_epsilon"),
        ({"dp_noise_multiplier": None}, "local DP needs exactly one of dp_epsilon"),
        ({"dp_clip": math.inf}, "dp_clip"),
        ({"dp_delta": 1.0}, r"dp_delta \(--dp-delta\) must be in \(0, 1\)"),
        ({"dp": None}, "need dp='central' or dp='local'"),
    ],
)
def test_config_refuses_bad_local_dp_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(LOCAL, **changes).validate()


def test_refused_before_training():
    """δ at or above 1/(the largest client's samples), a model with BatchNorm in training mode and a layer whose
    per-sample gradients neither the norms nor torch.func can take are refused when the simulation is built."""
    with pytest.raises(ValueError, match="delta must be below 1/records"):
        Simulation(dataclasses.replace(LOCAL, dp_delta=0.01))

    class Odd(nn.Module):  # .item()-like: torch.func cannot run it
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w * float(x.detach().sum())

    torch.manual_seed(0)
    x, y = torch.randn(40, 6), torch.randint(0, 3, (40,))
    for layer, error, match in [
        (nn.BatchNorm1d(4), ValueError, "BatchNorm1d in training mode"),
        (Odd(), TypeError, "Odd"),
    ]:
        experiment = Experiment(
            lambda layer=layer: nn.Sequential(nn.Linear(6, 4), layer, nn.Linear(4, 3)),
            (x[:30], y[:30]),
            (x[30:], y[30:]),
            clients="iid",
            num_clients=2,
            dp="local",
            dp_clip=1.0,
            dp_delta=1e-3,
            dp_noise_multiplier=1.0,
        )
        with pytest.raises(error, match=match):
            experiment.simulation  # noqa: B018


def test_cli_local_dp(tmp_path, capsys):
    fast = ["--rounds", "2", "--clients", "4", "--model", "logreg", "--partition", "iid", "--no-progress"]
    fast += ["--local-steps", "2", "--batch-size", "16"]
    dp = ["--dp", "local", "--dp-clip", "1", "--dp-delta", "1e-4"]
    out = tmp_path / "run"
    assert main(["run", *fast, *dp, "--dp-epsilon", "4", "--out", str(out)]) == 0
    assert all(math.isfinite(m["dp_epsilon"]) for m in read_metrics(out)[1:])
    assert json.loads((out / "summary.json").read_text())["dp_epsilon"] <= 4 + 1e-9
    capsys.readouterr()
    for extra, said in [
        (["--dp-noise-multiplier", "1", "--dp-adaptive-clip", "0.5"], "dp_adaptive_clip apply to central DP only"),
        (["--dp-noise-multiplier", "1", "--algorithm", "fedspeed"], "fedspeed"),
        (["--dp-noise-multiplier", "1", "--dp-epsilon", "2"], "exactly one of dp_epsilon"),
        (["--dp-noise-multiplier", "1", "--dp-delta", "0.1"], "below 1/records"),
    ]:
        assert main(["run", *fast, *dp, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err


def test_two_workers_equal_one_process(tmp_path):
    """``--workers 2``: each process trains its share of the participants with the same noise streams; the metrics
    equal one process's (float64)."""
    root = Path(pyfedkern.__file__).resolve().parents[1]
    args = ["run", "--algorithm", "fedavg", "--dataset", "digits", "--partition", "dirichlet:0.5", "--clients", "5"]
    args += ["--rounds", "2", "--batch-size", "32", "--dtype", "float64", "--model", "logreg", "--threads", "1"]
    args += ["--dp", "local", "--dp-clip", "0.5", "--dp-delta", "1e-4", "--dp-noise-multiplier", "1.0", "--seed", "2"]
    drop = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "pyfedkern", *args, "--workers", "2", "--out", str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    stored = ExperimentConfig.from_dict(json.loads((tmp_path / "run" / "config.json").read_text()))
    assert stored.dp == "local"
    got, want = _numbers(read_metrics(tmp_path / "run")), _numbers(Simulation(stored).run())
    assert len(got) == len(want) == 3
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        for key, value in w.items():
            assert g[key] == pytest.approx(value, rel=1e-12, abs=1e-13, nan_ok=True), key
