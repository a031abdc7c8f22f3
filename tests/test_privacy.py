"""Central DP: accounting equals dp-accounting's, the clipped and noised aggregate, the engine's runs (uniform FedAvg
without clip and noise, loop == batched, resume bit for bit, budget refusals) and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

dp_accounting = pytest.importorskip("dp_accounting")

from pyfedkern import privacy, reference  # noqa: E402
from pyfedkern.algorithms import ClientUpdates, RoundSums, make_algorithm  # noqa: E402
from pyfedkern.cli import main  # noqa: E402
from pyfedkern.privacy import CentralDP  # noqa: E402
from pyfedkern.sim.engine import ExperimentConfig, Simulation  # noqa: E402
from pyfedkern.sim.results import read_metrics  # noqa: E402

SMALL = ExperimentConfig(
    clients=6, rounds=3, model="logreg", partition="iid", batch_size=64, dtype="float64", fraction=0.5, seed=3
)
DP = {"dp": "central", "dp_clip": 0.5, "dp_delta": 1e-3, "dp_noise_multiplier": 1.0}


def _direct_epsilon(sigma, delta, steps, q, accountant):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    acc = dp_accounting.rdp.RdpAccountant() if accountant == "rdp" else dp_accounting.pld.PLDAccountant()
    return acc.compose(event).get_epsilon(delta)


@pytest.mark.parametrize(("sigma", "steps", "q"), [(1.1, 100, 0.01), (0.7, 3, 0.5), (4.0, 2000, 0.001)])
def test_epsilon_equals_dp_accounting_rdp(sigma, steps, q):
    assert privacy.epsilon(sigma, 1e-6, steps, q, "rdp") == _direct_epsilon(sigma, 1e-6, steps, q, "rdp")
    schedule = privacy.EpsilonSchedule(sigma, 1e-6, q, "rdp")
    for t in (1, steps // 2 + 1, steps):
        assert schedule(t) == pytest.approx(_direct_epsilon(sigma, 1e-6, t, q, "rdp"), rel=1e-12)


def test_epsilon_equals_dp_accounting_pld_and_sigma_spends_the_budget():
    assert privacy.epsilon(1.0, 1e-5, 10, 0.1, "pld") == _direct_epsilon(1.0, 1e-5, 10, 0.1, "pld")
    sigma = privacy.noise_multiplier(2.0, 1e-5, 50, 0.05, "rdp")
    spent = _direct_epsilon(sigma, 1e-5, 50, 0.05, "rdp")
    assert spent <= 2.0 + 1e-9 and spent == pytest.approx(2.0, rel=1e-4)
    assert _direct_epsilon(sigma * 0.99, 1e-5, 50, 0.05, "rdp") > 2.0


def test_pld_schedule_equals_the_accountant_exactly():
    """The schedule's cached one-round PLD, self-composed, gives dp-accounting's PLDAccountant's ε bit for bit."""
    schedule = privacy.EpsilonSchedule(1.0, 1e-5, 0.1, "pld")
    for t in (1, 6):
        assert schedule(t) == _direct_epsilon(1.0, 1e-5, t, 0.1, "pld")
    assert schedule(0) == 0.0


def test_a_budget_allowing_less_noise_than_the_floor_gets_the_floor():
    assert privacy.noise_multiplier(1e6, 1e-5, 2, 0.01) == privacy.LOWEST_SIGMA
    assert privacy.epsilon(privacy.LOWEST_SIGMA, 1e-5, 2, 0.01) <= 1e6


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: privacy.noise_multiplier(0.0, 1e-5, 10, 0.1), "epsilon must be finite and > 0"),
        (lambda: privacy.noise_multiplier(1.0, 1.0, 10, 0.1), r"delta must be in \(0, 1\)"),
        (lambda: privacy.epsilon(1.0, 1e-5, 0, 0.1), "steps must be an integer >= 1"),
        (lambda: privacy.epsilon(1.0, 1e-5, 10, 1.5), r"sampling_rate must be in \(0, 1\]"),
        (lambda: privacy.epsilon(1.0, 1e-5, 10, 0.1, "prv"), "accountant must be one of"),
    ],
)
def test_accounting_refuses_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _dp(**changes):
    settings = dict(clip=0.8, noise_multiplier=0.0, delta=1e-4, population=100, cohort=10, rounds=5)
    return CentralDP(**{**settings, **changes})


def _round(dp, x, models, t=0, chunks=1):
    """FedAvg's server step under ``dp`` on the [k, d] client models, their sums folded in ``chunks`` parts that are
    then added (as the ranks of a distributed run combine theirs). Returns (new x, the round's DP metrics)."""
    algo = make_algorithm("fedavg")
    algo.x = x.clone()
    ctx = SimpleNamespace(rng=lambda *keys: np.random.default_rng([7, *keys]))
    parts = []
    for rows in np.array_split(np.arange(len(models)), chunks):
        sums = RoundSums()
        updates = ClientUpdates(
            clients=rows,
            weights=np.arange(1.0, len(rows) + 1),
            vectors={"model": models[rows]},
            losses=torch.zeros(len(rows)),
            steps=np.ones(len(rows), np.int64),
        )
        dp.accumulate(algo, t, sums, updates, ctx)
        parts.append(sums)
    total = parts[0]
    for part in parts[1:]:
        total.vectors["model"].add_(part.vectors["model"])
        for name, value in part.scalars.items():
            total.add_scalar(name, value)
    metrics = dp.finish(t, total, algo.x, "model", ctx.rng)
    algo.server_step(t, total, ctx)
    return algo.x, metrics


def test_clipped_aggregate_without_noise_equals_the_reference():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal(3000))
    models = x + torch.from_numpy(rng.standard_normal((9, 3000)) * rng.uniform(0.001, 0.05, (9, 1)))
    new_x, metrics = _round(_dp(), x, models)
    want = x + reference.clip_accumulate(models, 0.8, center=x) / 9  # uniform weights, not the given ones
    torch.testing.assert_close(new_x, want, rtol=1e-12, atol=1e-12)
    assert metrics == {"dp_epsilon": math.inf, "dp_clip": 0.8}
    split, _ = _round(_dp(), x, models, chunks=3)
    torch.testing.assert_close(split, new_x, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("noise_cohort", [None, 40])
def test_noise_has_std_sigma_clip_over_the_cohort(noise_cohort):
    dp = _dp(noise_multiplier=1.3, noise_cohort=noise_cohort)
    x = torch.zeros(20_000, dtype=torch.float64)
    models = x.repeat(10, 1)  # no update: what changes is the noise alone
    noise = torch.cat([_round(dp, x, models, t=t)[0] for t in range(20)])
    expected = 1.3 * 0.8 / (noise_cohort or 10)
    assert float(noise.std()) == pytest.approx(expected, rel=0.02)
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(noise.numel())
    one, _ = _round(dp, x, models, t=3)
    split, _ = _round(dp, x, models, t=3, chunks=4)  # the noise of a round does not depend on the ranks
    assert torch.equal(one, split)


def test_adaptive_clip_follows_the_quantile_and_charges_the_count():
    dp = _dp(target_quantile=0.5, cohort=10, noise_cohort=None)
    x = torch.zeros(50, dtype=torch.float64)
    norms = np.linspace(0.1, 2.0, 10)  # 4 of 10 within the clip 0.8
    models = torch.from_numpy(norms[:, None] * np.eye(10, 50))
    _, metrics = _round(dp, x, models)
    assert metrics["dp_clip"] == 0.8
    assert dp.clip == pytest.approx(0.8 * math.exp(-privacy.CLIP_LR * (0.4 - 0.5)), rel=1e-15)
    noisy = _dp(target_quantile=0.5, noise_multiplier=1.0, cohort=40)  # σ_b = 2: 2σ_b > σ
    assert noisy.update_noise_multiplier == pytest.approx((1.0 - 1 / 16) ** -0.5)
    with pytest.raises(ValueError, match="adaptive clipping needs"):
        _dp(target_quantile=0.5, noise_multiplier=1.0, cohort=10)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"clip": 0.0}, "clip must be a finite number > 0"),
        ({"clip": math.inf, "noise_multiplier": 1.0}, "clip must be a finite number > 0"),
        ({"delta": 0.01}, "delta must be below 1/population"),
        ({"noise_multiplier": -1.0}, "noise_multiplier must be >= 0"),
        ({"noise_cohort": 5}, "noise_cohort must be an integer from the cohort"),
        ({"cohort": 200}, "must be at most the population"),
        ({"target_quantile": 1.0}, r"quantile must be in \(0, 1\)"),
    ],
)
def test_central_dp_refuses_bad_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        _dp(**changes)


def _final(config):
    sim = Simulation(config)
    sim.run()
    return sim.algorithm.global_model()


def test_no_clip_no_noise_equals_uniform_fedavg():
    """C = ∞, σ = 0: the round is the plain mean of the participants' models (FedAvg with weights 1)."""
    sim = Simulation(SMALL)
    sim.central_dp = _dp(clip=math.inf, population=6, cohort=3, delta=1e-3)
    sim.run()
    uniform = _final(dataclasses.replace(SMALL, algorithm_params={"ref_compat": True, "clip_norm": 1e30}))
    torch.testing.assert_close(sim.algorithm.global_model(), uniform, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedadam", "fedcm"])
def test_loop_equals_batched(algorithm):
    config = dataclasses.replace(SMALL, algorithm=algorithm, **DP, dp_adaptive_clip=0.5, dp_noise_cohort=6)
    config = dataclasses.replace(config, dp_noise_multiplier=0.2)
    loop = _final(dataclasses.replace(config, batched=False))
    batched = _final(dataclasses.replace(config, batched=True))
    torch.testing.assert_close(loop, batched, rtol=1e-10, atol=1e-10)


def test_metrics_resume_and_budget(tmp_path):
    config = dataclasses.replace(SMALL, rounds=4, checkpoint_every=2, **DP, dp_adaptive_clip=0.6, dp_noise_cohort=6)
    config = dataclasses.replace(config, dp_noise_multiplier=0.5)
    full = Simulation(config).run(tmp_path / "full")
    dp = Simulation(config).central_dp
    assert [m["dp_epsilon"] for m in full[1:]] == pytest.approx([dp.epsilon(t) for t in range(1, 5)], rel=1e-12)
    assert json.loads((tmp_path / "full" / "summary.json").read_text())["dp_epsilon"] == full[-1]["dp_epsilon"]
    Simulation(dataclasses.replace(config, rounds=2)).run(tmp_path / "cut")
    resumed = Simulation(config).run(tmp_path / "cut", resume=True)  # extended to 4 rounds: σ given, ε grows
    assert [m.get("dp_clip") for m in resumed] == [m.get("dp_clip") for m in full]
    full_x = torch.load(tmp_path / "full" / "model.pt", weights_only=True)["x"]
    assert torch.equal(torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["x"], full_x)

    budget = dataclasses.replace(config, rounds=2, dp_noise_multiplier=None, dp_epsilon=5.0, dp_adaptive_clip=None)
    Simulation(budget).run(tmp_path / "budget")
    with pytest.raises(ValueError, match="would exceed the run's privacy budget"):
        Simulation(dataclasses.replace(budget, rounds=4)).run(tmp_path / "budget", resume=True)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dp_epsilon": 1.0}, "exactly one of dp_epsilon"),
        ({"dp_noise_multiplier": None}, "exactly one of dp_epsilon"),
        ({"dp_noise_multiplier": None, "dp_epsilon": -1.0}, "dp_epsilon must be a finite number > 0"),
        ({"dp_clip": math.inf}, "dp_clip"),
        ({"dp_clip": None}, "dp_clip"),
        ({"dp_delta": 0.5}, "dp_delta must be below 1/population"),
        ({"dp_delta": 1.0}, r"dp_delta \(--dp-delta\) must be in \(0, 1\)"),
        ({"dp": "both"}, "dp must be one of"),
        ({"dp": None}, "need dp='central'"),
        ({"algorithm": "scaffold"}, "central DP supports algorithms whose only upload is their model"),
        ({"algorithm": "fnrfl"}, "fnrfl uploads more"),
    ],
)
def test_config_refuses_bad_dp_settings(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(SMALL, **{**DP, **changes}).validate()


def test_cli_central_dp(tmp_path, capsys):
    fast = ["--rounds", "2", "--clients", "4", "--model", "logreg", "--partition", "iid", "--no-progress"]
    dp = ["--dp", "central", "--dp-clip", "1", "--dp-delta", "1e-5", "--dp-population", "1000"]
    out = tmp_path / "run"
    assert main(["run", *fast, *dp, "--dp-epsilon", "4", "--fraction", "0.5", "--out", str(out)]) == 0
    assert all(math.isfinite(m["dp_epsilon"]) for m in read_metrics(out)[1:])
    assert json.loads((out / "summary.json").read_text())["dp_epsilon"] <= 4 + 1e-9
    capsys.readouterr()
    assert main(["run", *fast, *dp, "--dp-epsilon", "4", "--dp-noise-multiplier", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "exactly one of dp_epsilon" in err and len(err.splitlines()) == 1
    assert main(["run", *fast, *dp, "--dp-noise-multiplier", "1", "--algorithm", "scaffold"]) == 2
    assert "scaffold" in capsys.readouterr().err


def test_docs_examples_run(tmp_path, monkeypatch):
    """docs/privacy.md's Python blocks and its command run as written."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "privacy.md").read_text()
    monkeypatch.chdir(tmp_path)
    spaces = []
    for block in re.findall(r"```python\n(.*?)```", text, re.DOTALL):
        spaces.append({})
        exec(compile(block, "docs/privacy.md", "exec"), spaces[-1])
    assert any("total" in space and space["x"].shape == (1000,) for space in spaces)  # the own-loop example
    commands = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    assert len(commands) == 2  # central, then local DP
    for command in commands:
        argv = shlex.split(command.replace("\\\n", " "))
        assert argv[0] == "pyfedkern" and main([*argv[1:], "--no-progress"]) == 0
    for run, rounds in (("dp-central", 20), ("dp-local", 3)):
        metrics = read_metrics(tmp_path / "runs" / run)
        assert [m["round"] for m in metrics] == list(range(rounds + 1))
        assert metrics[-1]["dp_epsilon"] > metrics[1]["dp_epsilon"]
