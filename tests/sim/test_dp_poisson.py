"""Poisson-sampled minibatches for local DP-SGD (``dp_sampling="poisson"``): the planner's Bernoulli masks (a
function of their keys, the rate they promise), both paths on the same samples, DP-SGD divided by the expected batch
size with empty batches, loop == batched, resume bit for bit, and what is refused."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("dp_accounting")

from pyfedkern.cli import main
from pyfedkern.dpsgd import DPSGD
from pyfedkern.ops.dp import stream_key
from pyfedkern.sim import planning
from pyfedkern.sim.engine import ExperimentConfig, Simulation

POISSON = ExperimentConfig(
    clients=5,
    rounds=2,
    model="logreg",
    partition="dirichlet:0.5",
    batch_size=4,
    local_steps=12,
    dtype="float64",
    seed=3,
    fraction=0.6,
    dp="local",
    dp_clip=0.5,
    dp_delta=1e-4,
    dp_noise_multiplier=0.7,
    dp_sampling="poisson",
)


def _numbers(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time_")} for m in metrics]


def test_stream_keys_are_stream_key_row_by_row():
    keys = np.array([[0, 5, 0, 0, 0], [2**63 - 1, 5, 7, 999, 40], [3, 2**64 - 1, 1, 2, 3]], dtype=np.uint64)
    assert planning.stream_keys(keys).tolist() == [stream_key(tuple(int(v) for v in row)) for row in keys]


def test_masks_depend_on_their_keys_alone(monkeypatch):
    """A batch is the same whichever batches are drawn with it and however the draws are cut into passes."""
    clients, steps = np.array([4, 4, 0, 9, 2]), np.array([0, 1, 0, 7, 3])
    sizes, rates = np.array([50, 50, 3, 1000, 0]), np.array([0.1, 0.1, 1.0, 0.02, 1.0])
    together = planning.poisson_batches(11, 2, clients, steps, sizes, rates)
    monkeypatch.setattr(planning, "_MASK_CHUNK", 7)
    cut = planning.poisson_batches(11, 2, clients, steps, sizes, rates)
    alone = [planning.poisson_batches(11, 2, *(v[r : r + 1] for v in (clients, steps, sizes, rates))) for r in range(5)]
    for got in (cut, (np.concatenate([a[0] for a in alone]), np.concatenate([a[1] for a in alone]))):
        assert np.array_equal(got[0], together[0]) and np.array_equal(got[1], together[1])
    positions, lengths = together
    assert lengths[2] == 3 and lengths[4] == 0  # rate 1: every sample; no samples: an empty batch
    assert not np.array_equal(*np.split(positions[: lengths[0] + lengths[1]], [lengths[0]]))  # steps differ
    batches = np.split(positions, np.cumsum(lengths)[:-1])
    assert all(
        np.all(np.diff(b) > 0) and (b.size == 0 or (0 <= b[0] and b[-1] < n))
        for b, n in zip(batches, sizes, strict=True)
    )


def test_batch_sizes_follow_the_rate():
    """Over 20,000 steps of a client of 200 samples at q = 0.05: the mean batch size is B = 10 within 6 standard
    errors (0.13), each sample is drawn q of the time within 6 standard deviations, consecutive steps are
    uncorrelated, and a client of 20 samples at q = 0.1 gets empty batches (1 - q)^20 = 12.2 % of the time."""
    steps = np.arange(20_000)
    positions, lengths = planning.poisson_batches(0, 0, np.zeros_like(steps), steps, np.full(20_000, 200), 0.05)
    se = math.sqrt(200 * 0.05 * 0.95 / 20_000)
    assert abs(lengths.mean() - 10.0) < 6 * se
    counts = np.bincount(positions, minlength=200)
    assert np.all(np.abs(counts - 1000) < 6 * math.sqrt(20_000 * 0.05 * 0.95))
    assert abs(np.corrcoef(lengths[:-1], lengths[1:])[0, 1]) < 6 / math.sqrt(20_000)
    _, small = planning.poisson_batches(0, 0, np.ones_like(steps), steps, np.full(20_000, 20), 0.1)
    empty = 0.9**20
    assert abs(np.mean(small == 0) - empty) < 6 * math.sqrt(empty * (1 - empty) / 20_000)


def test_both_paths_hold_the_same_samples():
    """The loop's batches of each client equal its rows of the batched path's steps (empty ones included, padded
    with weight 0); the number of steps is the fixed-size plan's; a plan of some clients is theirs in a plan of all."""
    sim = Simulation(POISSON)
    clients = np.array([3, 0, 4, 1])
    loop = {int(c): list(sim.batches(int(c), 1, steps=12)) for c in clients}
    assert all(len(b) == 12 for b in loop.values())
    assert any(len(xb) == 0 for b in loop.values() for xb, _ in b)  # B = 4: some batch is empty
    assert len({len(xb) for b in loop.values() for xb, _ in b}) > 2  # and sizes vary
    stacked = sim.stacked_batches(clients, 1, steps=12)
    for s, (xb, yb, wb) in enumerate(stacked):
        assert wb is not None and bool(torch.isfinite(wb).all())
        for r, cid in enumerate(stacked.clients.tolist()):
            x, y = loop[cid][s]
            real = wb[r] > 0
            assert int(real.sum()) == len(x) and bool(real[: len(x)].all())
            assert torch.equal(xb[r, : len(x)], x) and torch.equal(yb[r, : len(y)], y)
    plans = sim.batch_plans(clients, 1, steps=12)
    for r, cid in enumerate(clients.tolist()):
        alone = sim.batch_indices(cid, 1, steps=12)
        assert all(np.array_equal(a, b) for a, b in zip(alone, plans[r], strict=True))
    shuffled = Simulation(dataclasses.replace(POISSON, dp_sampling="shuffle"))
    assert all(len(p) == 4 for p in shuffled.batch_indices(0, 1, steps=12))


def test_the_engine_divides_by_each_clients_expected_batch():
    """E[b_i] = q_i·|D_i| = min(B, |D_i|): B for clients of at least B samples, |D_i| (q_i = 1: every sample, every
    step) for smaller ones; the accounting is the fixed-size run's (same rates and steps)."""
    config = dataclasses.replace(POISSON, batch_size=200)
    sim = Simulation(config)
    sizes = sim.client_sizes
    assert sizes.min() < 200 <= sizes.max()
    for cid, n in enumerate(sizes.tolist()):
        assert sim.dpsgd.expected_size((1, cid, 5)) == min(200, n)
        if n < 200:
            assert all(len(p) == n for p in sim.batch_indices(cid, 0, steps=3))
    shuffled = Simulation(dataclasses.replace(config, dp_sampling="shuffle"))
    assert shuffled.dpsgd.expected_batch is None
    assert shuffled.local_dp.state_dict() == sim.local_dp.state_dict()
    assert shuffled.local_dp.epsilon() == sim.local_dp.epsilon()


def test_dpsgd_step_divides_by_the_expected_size_and_takes_empty_batches():
    """Poisson sampling: the gradient is (clipped sum + σC·ξ)/E[b] whatever the batch's size, the loss Σ_n ℓ_n/E[b];
    an empty batch gives σC·ξ/E[b] and loss 0 on both paths, and a row of padding adds nothing."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    dp = DPSGD(0.3, 1.5, seed=2, expected_batch=lambda key: 7.0 + key[1])
    d = sum(p.numel() for p in model.parameters())

    def gradient() -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    loss = dp.gradient_(model, F.cross_entropy, x, y, (0, 1, 0))
    sums, _, total = DPSGD(0.3, 0.0).clipped_sum(model, F.cross_entropy, x, y)
    want = torch.cat([s.reshape(-1) for s in sums]) / 8
    dp.add_noise_(want, (0, 1, 0), 1 / 8)
    torch.testing.assert_close(gradient(), want, rtol=1e-12, atol=1e-14)
    assert loss == pytest.approx(float(total) / 8, rel=1e-12)

    empty = dp.gradient_(model, F.cross_entropy, x[:0], y[:0], (0, 2, 5))
    noise = dp.add_noise_(torch.zeros(d, dtype=torch.float64), (0, 2, 5), 1 / 9)
    assert empty == 0.0 and float(noise.abs().max()) > 0
    torch.testing.assert_close(gradient(), noise, rtol=1e-12, atol=1e-14)

    params = {n: p.detach()[None].expand(2, *p.shape).clone() for n, p in model.named_parameters()}
    xb = torch.stack([torch.cat([x, x[:1]]), x[:1].expand(4, -1)])  # row 1: padding only
    yb = torch.stack([torch.cat([y, y[:1]]), y[:1].expand(4)])
    wb = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0] * 4], dtype=torch.float64)
    grads, losses = dp.batched_gradients(model, F.cross_entropy, params, xb, yb, [(0, 1, 0), (0, 2, 5)], wb)
    flat = torch.cat([grads[n].reshape(2, -1) for n in params], 1)
    torch.testing.assert_close(flat[0], want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(flat[1], noise, rtol=1e-12, atol=1e-14)
    assert losses[0].item() == pytest.approx(loss, rel=1e-12) and losses[1].item() == 0.0


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan, True, "8"])
def test_a_bad_expected_batch_is_refused_by_name(value):
    with pytest.raises(ValueError, match="expected_batch"):
        DPSGD(1.0, 1.0, expected_batch=value)
    with pytest.raises(ValueError, match=r"expected_batch .*\(for key \(0, 1, 2\)\)"):
        DPSGD(1.0, 1.0, expected_batch=lambda key: value).expected_size((0, 1, 2))


@pytest.mark.parametrize("sigma", [0.0, 0.7])
@pytest.mark.parametrize("batch_size", [2, 200])
def test_loop_equals_batched(sigma, batch_size):
    """float64: the per-client loop and the batched path train on the same Poisson batches with the same noise and
    give the same models, with unequal clients, empty batches (B = 2) or clients smaller than B (B = 200), momentum
    and weight decay; the batches are Poisson ones (the run differs from the fixed-size one)."""
    config = dataclasses.replace(
        POISSON, batch_size=batch_size, dp_noise_multiplier=sigma, momentum=0.5, weight_decay=1e-3
    )
    runs = []
    for batched in (False, True):
        sim = Simulation(dataclasses.replace(config, batched=batched))
        metrics = sim.run()
        runs.append((sim.algorithm.global_model(), metrics[-1]))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=0, atol=1e-12)
    assert runs[0][1]["train_loss"] == pytest.approx(runs[1][1]["train_loss"], rel=1e-12)
    fixed = Simulation(dataclasses.replace(config, dp_sampling="shuffle"))
    fixed.run()
    assert float((fixed.algorithm.global_model() - runs[0][0]).abs().max()) > 1e-6


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dp_sampling": "bernoulli"}, "dp_sampling must be one of shuffle, poisson, got 'bernoulli'"),
        ({"dp": "central", "dp_delta": 0.01}, r"dp_sampling='poisson' .*needs dp='local'"),
        ({"dp": None, "dp_clip": None, "dp_delta": None, "dp_noise_multiplier": None}, "dp_sampling.*needs dp='local'"),
        ({"batch_order": "fixed"}, "dp_sampling='poisson' draws every batch afresh"),
    ],
)
def test_config_refuses_bad_sampling(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(POISSON, **changes).validate()


def test_cli_takes_and_refuses_dp_sampling(tmp_path, capsys):
    fast = ["--rounds", "1", "--clients", "4", "--model", "logreg", "--partition", "iid", "--no-progress"]
    fast += ["--local-steps", "2", "--batch-size", "8"]
    dp = ["--dp", "local", "--dp-clip", "1", "--dp-delta", "1e-4", "--dp-noise-multiplier", "1"]
    assert main(["run", *fast, *dp, "--dp-sampling", "poisson", "--out", str(tmp_path / "run")]) == 0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["dp_sampling"] == "poisson"
    capsys.readouterr()
    for argv, said in [
        ([*fast, "--dp-sampling", "poisson"], "dp_sampling='poisson' (--dp-sampling) samples local DP-SGD's batches"),
        ([*fast, *dp, "--dp-sampling", "uniform"], "dp_sampling must be one of shuffle, poisson"),
    ]:
        assert main(["run", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert said in err and len(err.splitlines()) == 1, err
