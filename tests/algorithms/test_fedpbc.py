"""FedPBC and its baselines under unreliable uplinks.

The quadratic problem of docs/fedpbc.md §5 (m = 100, d = 100, F_i = ½‖x − u_i‖², exact gradients): FedAvg's limit is the
biased point of Proposition 1, FedPBC's server error ends far below that bias and shrinks with η·s, and the mean of
all client models reaches the optimum. The algorithm classes run through the engine are checked against the vector
simulation, against each other (all links ON: every method is FedAvg), and batched against looped local training.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pyfedkern.algorithms import local_run, local_sgd, make_algorithm
from pyfedkern.algorithms.batched import BatchedLocal
from pyfedkern.algorithms.fedpbc import FedAU
from pyfedkern.algorithms.looped import local_sgd_rows_
from pyfedkern.cli import main
from pyfedkern.links import LinkModel, group_link_probs
from pyfedkern.reproduce.pbc_quadratic import fedavg_limit, quadratic_targets, simulate_quadratic
from pyfedkern.sim.checkpoints import load_config
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation

LINK_METHODS = ["fedpbc", "fedavg-links", "fedavg-all", "fedavg-known-p", "fedau", "mifa"]

# quadratic problem of docs/fedpbc.md §5 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def targets() -> np.ndarray:
    return quadratic_targets(100, 100, seed=0)


@pytest.mark.parametrize(("p0", "p1"), [(0.1, 0.9), (0.5, 0.9)])
def test_quadratic_fedavg_bias_and_fedpbc(targets, p0, p1):
    p = group_link_probs([p0, p1], 100)
    optimum = targets.mean(0)
    limit = fedavg_limit(targets, p)
    bias = np.linalg.norm(limit - optimum)
    assert bias > 0.05  # unequal link probabilities bias FedAvg away from x*

    def run(method: str, lr: float):
        return simulate_quadratic(method, targets, LinkModel(p, "bernoulli", seed=1), lr=lr, steps=100, rounds=2500)

    fedavg = run("fedavg", 1e-4)
    assert np.linalg.norm(fedavg.late_average - limit) < 0.1 * bias
    assert fedavg.server_error[-1] > 0.8 * bias

    pbc = run("fedpbc", 1e-4)
    assert pbc.server_error[-1] < 0.1 * bias
    assert pbc.mean_error[-1] < 1e-8  # x̄^t → x*
    halved = run("fedpbc", 5e-5)  # η·s halved: the server's O(ηs) error shrinks
    assert np.mean(halved.server_error[-100:]) < 0.7 * np.mean(pbc.server_error[-100:])


def test_fedavg_limit_formula_two_clients():
    """m = 2, u = (0, 100), p1 = 0.5: the limit is 150·p2/(1 + p2)."""
    u = np.array([[0.0], [100.0]])
    for p2 in (0.2, 0.5, 0.9):
        assert np.isclose(fedavg_limit(u, [0.5, p2])[0], 150 * p2 / (1 + p2))


# the classes through the engine --------------------------------------------------------------------------------

QUAD = ExperimentConfig(
    dataset="quadratic:20,6",
    partition="natural",
    clients=20,
    model="quadratic",
    batch_size=1,
    local_steps=5,
    lr=0.05,
    rounds=25,
    eval_every=25,
)


def _setup(config: ExperimentConfig, algorithm: str, batched: bool = True, **params):
    sim = Simulation(dataclasses.replace(config, algorithm=algorithm, algorithm_params=params, batched=batched))
    sim.algorithm.setup(sim, sim.initial_vector)
    return sim, sim.algorithm


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize(("algorithm", "method"), [("fedpbc", "fedpbc"), ("fedavg-links", "fedavg")])
def test_classes_match_the_vector_simulation(algorithm, method, batched):
    sim, algo = _setup(QUAD, algorithm, link_probs=(0.2, 0.8), links="markov", batched=batched)
    u = torch.stack([sim.client_x[i][0] for i in range(20)]).double().numpy()
    for t in range(QUAD.rounds):
        algo.round(t, sim)
    links = LinkModel(algo.link_model.probs, "markov", seed=algo.link_model.seed)
    expected = simulate_quadratic(method, u, links, lr=QUAD.lr, steps=QUAD.local_steps, rounds=QUAD.rounds)
    np.testing.assert_allclose(algo.x.double().numpy(), expected.server, rtol=1e-5, atol=1e-5)
    if algorithm == "fedpbc":
        gap = np.linalg.norm(algo.mean_model().double().numpy() - u.mean(0))
        assert np.isclose(gap, expected.mean_error[-1], rtol=1e-3, atol=1e-6)


def test_mifa_matches_a_plain_memory_implementation():
    sim, algo = _setup(QUAD, "mifa", link_probs=(0.3,), server_lr=0.7, resum_every=4)
    u = torch.stack([sim.client_x[i][0] for i in range(20)]).double()
    x = torch.zeros(6, dtype=torch.float64)
    memory = torch.zeros(20, 6, dtype=torch.float64)
    a = (1 - QUAD.lr) ** QUAD.local_steps
    for t in range(12):
        algo.round(t, sim)
        for i in algo.link_model.active_indices(t):
            memory[i] = (u[i] + a * (x - u[i])) - x
        x = x + 0.7 * memory.mean(0)
    torch.testing.assert_close(algo.x.double(), x, rtol=1e-5, atol=1e-5)


def test_known_p_weights_divide_by_p_t():
    _, algo = _setup(QUAD, "fedavg-known-p", link_probs=(0.25, 0.5), links="bernoulli-tv", gamma=0.2)
    active = np.array([0, 15])
    w, scale = algo.weights(7, active)
    assert np.allclose(w, 1.0 / algo.link_model.prob(7)[active]) and scale == 1.0 / 20
    p_t = np.array([0.25, 0.5]) * (0.8 + 0.2 * np.sin(2 * np.pi * 7 / 40))
    assert np.allclose(algo.link_model.prob(7)[[0, 15]], p_t)


def test_fedau_interval_bookkeeping():
    algo = FedAU(cutoff=3, link_probs=(0.5,))
    algo.present = np.array([0])
    algo.counter, algo.interval_sum, algo.interval_count = np.zeros(1, np.int64), np.zeros(1), np.zeros(1, np.int64)
    pattern = [1, 0, 0, 1, 0, 0, 0, 0, 1]
    omegas = []
    for on in pattern:
        omegas.append(float(algo.omega()[0]))
        algo.after_round(0, np.array([0]) if on else np.zeros(0, np.int64))
    # records: t0 → 1; t3 → 3; t6 (count reached K = 3) → 3; t8 → 2 (count 1 after the reset, +1)
    assert omegas == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 7 / 3, 7 / 3]
    assert algo.interval_sum[0] == 9 and algo.interval_count[0] == 4 and algo.counter[0] == 0


DIGITS = ExperimentConfig(
    dataset="digits",
    clients=10,
    partition="dirichlet:0.5",
    model="mlp",
    batch_size=16,
    local_steps=3,
    lr=0.05,
    rounds=2,
    eval_every=2,
    checkpoint_every=2,
)


def test_all_links_on_every_method_is_fedavg():
    finals = {}
    for name in LINK_METHODS:
        sim, algo = _setup(DIGITS, name, link_probs=(1.0,))
        for t in range(2):
            algo.round(t, sim)
        finals[name] = algo.x.clone()
    for name in LINK_METHODS[1:]:
        torch.testing.assert_close(finals[name], finals["fedpbc"], rtol=1e-5, atol=1e-5, msg=name)


def test_only_present_clients_train_and_report():
    """A session schedule (ctx.active_clients) restricts every method to the present clients, and m is their
    number: with every link ON all six methods are FedAvg over the present clients, and absent clients never train."""
    present = np.array([1, 4, 5, 8])
    finals = {}
    for name in LINK_METHODS:
        sim, algo = _setup(DIGITS, name, link_probs=(1.0,))
        sim.active_clients = present
        for t in range(2):
            stats = algo.round(t, sim)
            assert stats.clients.tolist() == present.tolist()
            assert stats.extras["active"] == len(present)
        finals[name] = algo.x.clone()
        if name == "fedpbc":
            absent = np.setdiff1d(np.arange(10), present)
            assert torch.equal(algo.clients.data[absent], sim.initial_vector.expand(len(absent), -1))
            torch.testing.assert_close(algo.mean_model(), algo.x)  # x̄ over the present clients
        else:
            assert stats.download_floats == len(present) * algo.x.numel()
    for name in LINK_METHODS[1:]:
        torch.testing.assert_close(finals[name], finals["fedpbc"], rtol=1e-5, atol=1e-5, msg=name)


def test_links_are_intersected_with_the_present_clients():
    sim, algo = _setup(QUAD, "fedavg-known-p", link_probs=(0.5,))
    sim.active_clients = np.arange(0, 20, 3)
    for t in range(6):
        on = algo.link_model.active_indices(t)
        stats = algo.round(t, sim)
        assert stats.clients.tolist() == [i for i in on.tolist() if i % 3 == 0]
        w, scale = algo.weights(t, stats.clients)
        assert scale == 1.0 / 7 and np.allclose(w, 2.0)


def test_mifa_drops_the_memory_of_departed_clients():
    sim, algo = _setup(QUAD, "mifa", link_probs=(0.6,), server_lr=0.7)
    u = torch.stack([sim.client_x[i][0] for i in range(20)]).double()
    x = torch.zeros(6, dtype=torch.float64)
    memory = torch.zeros(20, 6, dtype=torch.float64)
    a = (1 - QUAD.lr) ** QUAD.local_steps
    for t in range(10):
        present = np.arange(20) if t < 4 else np.arange(8)  # clients 8..19 leave after round 3
        sim.active_clients = present
        algo.round(t, sim)
        memory[np.setdiff1d(np.arange(20), present)] = 0
        for i in np.intersect1d(algo.link_model.active_indices(t), present):
            memory[i] = (u[i] + a * (x - u[i])) - x
        x = x + 0.7 * memory[present].mean(0)
        torch.testing.assert_close(algo.x.double(), x, rtol=1e-5, atol=1e-5)
    assert not algo.memory.data[8:].any()


def test_fedau_counts_only_present_clients():
    sim, algo = _setup(QUAD, "fedau", link_probs=(0.5,), cutoff=50)
    sim.active_clients = np.arange(5)
    for t in range(8):
        algo.round(t, sim)
    assert not algo.counter[5:].any() and not algo.interval_count[5:].any()
    assert algo.counter[:5].sum() + algo.interval_count[:5].sum() > 0


def test_dynamic_sessions_with_a_fedpbc_host():
    """``--algorithm dynamic --host fedpbc``: in each session the clients of the other group neither train nor
    upload, so their rows of the host's store stay at the session's initial model."""
    config = ExperimentConfig(
        algorithm="dynamic",
        algorithm_params={"method": "previous", "sessions": 3, "host": "fedpbc", "host_params": "delta=0.5"},
        dataset="digits",
        partition="groups:0.2,0.3",
        clients=6,
        model="mlp",
        model_params={"hidden": 16},
        rounds=9,
        local_steps=2,
        batch_size=32,
        lr=0.1,
    )
    sim = Simulation(config)
    algo = sim.algorithm
    start, host_rounds = algo._start_session, []

    def start_session(s, t, ctx):
        extras = start(s, t, ctx)
        host_rounds.append((s, ctx.active_clients.copy(), algo.host_algo.x.clone()))
        return extras

    algo._start_session = start_session
    metrics = sim.run()
    s, group, init = host_rounds[-1]
    assert s == 2 and len(group) == 3
    host = algo.host_algo
    absent = np.setdiff1d(np.arange(6), group)
    assert torch.equal(host.clients.data[absent], init.expand(len(absent), -1))
    assert not torch.equal(host.clients.data[group], init.expand(len(group), -1))  # the present ones trained
    # δ = 0.5 puts every p_i >= 0.5, so uploads happen; never more than the session's 3 clients
    uploads = [m["clients"] for m in metrics[4:]]
    assert max(uploads) <= 3 and sum(uploads) > 0


def test_batched_local_training_equals_the_loop():
    config = dataclasses.replace(DIGITS, momentum=0.9, weight_decay=1e-3, batch_size=64)  # some clients < 64 samples
    stores = []
    for batched in (True, False):
        sim, algo = _setup(config, "fedpbc", link_probs=(0.4,), batched=batched)
        for t in range(2):
            stats = algo.round(t, sim)
        stores.append(algo.clients.data.clone())
        assert np.isfinite(stats.local_loss)
    assert int(min(len(y) for y in sim.client_y)) < 64
    torch.testing.assert_close(stores[0], stores[1], rtol=1e-4, atol=1e-5)


def test_local_sgd_rows_trains_each_row_as_its_client_on_both_paths():
    """FedPBC's local training: each row of the models, in the clients' given order, is local_sgd of its client from
    that row (float64, weight decay and momentum, unequal steps), batched or not, whether the run orders its rows
    otherwise or as given."""
    config = dataclasses.replace(
        DIGITS, momentum=0.5, weight_decay=1e-3, batch_size=64, local_steps=None, local_epochs=1.0, dtype="float64"
    )
    for batched in (True, False):
        sim, _ = _setup(config, "fedpbc", link_probs=(0.4,), batched=batched)
        clients = np.array([2, 4, 8, 0])  # 2 and 8 take fewer steps than 4 and 0
        run = local_run(sim, 1, clients)
        assert isinstance(run, BatchedLocal) == batched
        assert not np.array_equal(run.clients, clients)  # the run orders its rows by descending steps
        for order in (clients, run.clients):
            x0 = sim.initial_vector
            noise = torch.randn(len(order), x0.numel(), generator=torch.Generator().manual_seed(0), dtype=x0.dtype)
            starts = x0 + 0.01 * noise  # a different start each row
            models = starts.clone()
            losses = local_sgd_rows_(sim, 1, models, order)
            for r, cid in enumerate(order):
                expected = local_sgd(sim, int(cid), 1, starts[r])
                assert (expected.x - starts[r]).abs().max() > 1e-3
                torch.testing.assert_close(models[r], expected.x, rtol=0, atol=1e-12)
                assert float(losses[r]) == pytest.approx(expected.loss, rel=1e-12)
        assert local_sgd_rows_(sim, 1, models[:0], clients[:0]).shape == (0,)
        with pytest.raises(ValueError, match=r"models must be \[3, d\]"):
            local_sgd_rows_(sim, 1, models, clients[:3])
        with pytest.raises(ValueError, match="clients has duplicates"):
            local_sgd_rows_(sim, 1, models, np.array([2, 4, 2, 0]))


def test_fedpbc_inactive_clients_keep_their_models_and_active_ones_get_the_average():
    sim, algo = _setup(DIGITS, "fedpbc", link_probs=(0.3,), links="cyclic", cycle_length=10)
    before = algo.clients.data.clone()
    stats = algo.round(0, sim)
    active = algo.link_model.active_indices(0)
    assert stats.clients.tolist() == active.tolist() and stats.extras["active"] == len(active)
    after = algo.clients.data
    inactive = np.setdiff1d(np.arange(10), active)
    assert not torch.equal(after[inactive], before[inactive])  # they trained and kept their progress
    if active.size:
        assert torch.equal(after[active], algo.x.expand(active.size, -1))
    assert stats.upload_floats == len(active) * algo.x.numel()


@pytest.mark.parametrize("name", ["fedpbc", "fedau", "mifa"])
def test_resume_is_exact(tmp_path, monkeypatch, name):
    config = dataclasses.replace(
        DIGITS, rounds=4, algorithm=name, algorithm_params={"link_probs": (0.3, 0.6), "links": "markov"}
    )
    full = Simulation(config).run(tmp_path / "full")
    sim = Simulation(config)
    original_round = sim.algorithm.round

    def crash_in_round_3(t, ctx):
        if t == 3:
            raise KeyboardInterrupt
        return original_round(t, ctx)

    monkeypatch.setattr(sim.algorithm, "round", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        sim.run(tmp_path / "cut")
    resumed = Simulation(load_config(tmp_path / "cut")).run(tmp_path / "cut", resume=True)
    strip = [{k: v for k, v in m.items() if not k.startswith("time")} for m in full]
    assert [{k: v for k, v in m.items() if not k.startswith("time")} for m in resumed] == strip


def test_lognormal_links_from_label_histograms():
    _, algo = _setup(DIGITS, "fedpbc", links="bernoulli-tv", gamma=0.3, sigma0=10.0, delta=0.02)
    p = algo.link_model.probs
    assert p.shape == (10,) and np.all(p >= 0.02) and np.all(p <= 1)


def test_cli_runs_fedpbc_with_link_options(tmp_path):
    args = ["run", "--algorithm", "fedpbc", "--links", "markov-tv", "--gamma", "0.3", "--link-probs", "0.3,0.7"]
    args += ["--clients", "6", "--rounds", "2", "--model", "logreg", "--partition", "iid", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    saved = load_config(tmp_path / "run")
    assert saved.algorithm_params == {"links": "markov-tv", "gamma": 0.3, "link_probs": [0.3, 0.7]}  # JSON


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("fedpbc", {"links": "gilbert"}, "unknown link pattern"),
        ("fedpbc", {"links": "bernoulli-tv", "gamma": 0.5}, "gamma < 0.5"),
        ("fedau", {"links": "markov-tv", "gamma": 0.8, "link_probs": (0.5,)}, "gamma < 0.5"),
        ("fedpbc", {"cycle_length": 0}, "cycle_length"),
        ("fedpbc", {"period": 0}, "period"),
        ("fedpbc", {"link_probs": (0.0, 0.5)}, r"\(0, 1\]"),
        ("fedpbc", {"link_probs": (1.5,)}, r"\(0, 1\]"),
        ("fedpbc", {"delta": 0.0}, "delta"),
        ("fedpbc", {"sigma0": -1.0}, "sigma0"),
        ("fedavg-links", {"server_lr": 0.0}, "server_lr"),
        ("fedau", {"cutoff": 0}, "cutoff"),
        ("mifa", {"resum_every": 0}, "resum_every"),
    ],
)
def test_bad_hyperparameters(name, params, match):
    with pytest.raises(ValueError, match=match):
        make_algorithm(name, **params)
