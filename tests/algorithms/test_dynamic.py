"""The dynamic initial-model method and its baselines through the simulation engine (digits, a small MLP, two
client groups alternating over sessions): the session schedule, the pilot mean, the footprint gradient, the
similarity-weighted initial model and its limits, the baselines, resume, the history ring buffer and the CLI."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from pyfedkern import ops
from pyfedkern.algorithms import make_algorithm
from pyfedkern.algorithms.dynamic import DynamicInit, SessionContext, parse_host_params, transition_accuracy
from pyfedkern.algorithms.history import SessionHistory
from pyfedkern.dpsgd import DPSGD
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation

T = 3  # rounds per session


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models train far faster on one thread than on a shared, oversubscribed machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def config(method: str = "proposed", sessions: int = 4, **params) -> ExperimentConfig:
    return ExperimentConfig(
        algorithm="dynamic",
        algorithm_params={"method": method, "sessions": sessions, **params},
        dataset="digits",
        partition="groups:0.2,0.3",
        clients=6,
        model="mlp",
        model_params={"hidden": 16},
        rounds=sessions * T,
        local_steps=2,
        batch_size=32,
        lr=0.1,
        checkpoint_every=5,
    )


class Recorder:
    """Wraps DynamicInit's session start to record the model each session begins from, and the ctx state."""

    def __init__(self, sim: Simulation) -> None:
        self.inits: dict[int, torch.Tensor] = {}
        self.active: dict[int, np.ndarray] = {}
        self.labels: dict[int, np.ndarray | None] = {}
        self.before: dict[int, dict] = {}
        algo = sim.algorithm
        start = algo._start_session

        def recorded(s, t, ctx):
            self.before[s] = {
                "x": algo.host_algo.x.clone(),
                "models": [m.clone() for m in algo.store.model_rows()] if algo.store is not None else [],
                "pilot": algo.builder.pilot.clone() if algo.method == "proposed" else None,
            }
            extras = start(s, t, ctx)
            self.inits[s] = algo.host_algo.x.clone()
            self.active[s] = ctx.active_clients.copy()
            self.labels[s] = None if ctx.eval_labels is None else np.array(ctx.eval_labels)
            return extras

        algo._start_session = recorded


def run(cfg: ExperimentConfig):
    sim = Simulation(cfg)
    rec = Recorder(sim)
    metrics = sim.run()
    return sim, rec, metrics


def test_sessions_alternate_groups_and_restrict_evaluation_labels():
    sim, rec, metrics = run(config("previous"))
    groups = sim.partition.groups
    for s in range(4):
        assert np.array_equal(rec.active[s], np.flatnonzero(groups == s % 2))
        assert np.array_equal(rec.labels[s], sim.partition.group_labels[s % 2])
    assert [m["group"] for m in metrics if "group" in m] == [0.0, 1.0, 0.0, 1.0]
    # the baseline skips the pilot session; afterwards every round trains the session's 3 clients
    assert [m["clients"] for m in metrics[1:]] == [0] * T + [3] * (3 * T)


def test_pilot_footprint_and_similarity_initial_model():
    sim, rec, metrics = run(config("proposed", sessions=5, scale=10.0))
    algo = sim.algorithm
    x0 = sim.initial_vector
    # session 0 (pilot) and session 1 (= P, the first post-pilot session) start from the random model
    assert torch.equal(rec.inits[0], x0) and torch.equal(rec.inits[1], x0)
    # w_pilot is the pilot session's last global model (P = 1)
    assert torch.equal(algo.builder.pilot, rec.before[1]["x"])
    # the footprint gradient of the last session is V = 1 fresh host round from w_pilot with the current clients
    view = SessionContext(sim, 0, T, constant_lr=0.5 * sim.lr(0), round_key=10**9 + 4)
    host = make_algorithm("fedavg")
    sim.active_clients = rec.active[4]
    host.setup(view, algo.builder.pilot)
    host.round(0, view)
    assert torch.allclose(algo.builder.query, host.x - algo.builder.pilot, atol=1e-6)
    # sessions >= P + 1 start from Σ α_z w_z with α from the stored footprint gradients
    for s in (2, 3, 4):
        models = rec.before[s]["models"]
        assert len(models) == s - 1
        info = next(m for m in metrics if m["round"] == s * T + 1)
        assert info["candidates"] == s - 1 and 0 < info["alpha_max"] <= 1
    init4 = rec.inits[4]
    expected = sum(a * m for a, m in zip(algo.builder.last_alpha, rec.before[4]["models"], strict=True))
    assert torch.allclose(init4, expected, atol=1e-6)
    # the group returning in session 3 (B, like session 1) and 4 (A, like session 2) has the nearest footprint
    picks = {s: next(m for m in metrics if m["round"] == s * T + 1)["init_session"] for s in (3, 4)}
    assert picks == {3: 1.0, 4: 2.0}


def test_scale_zero_is_the_average_baseline_and_large_scale_picks_one_model():
    _, rec, _ = run(config("proposed", scale=0.0))
    for s in (2, 3):
        mean = sum(rec.before[s]["models"]) / len(rec.before[s]["models"])
        assert torch.allclose(rec.inits[s], mean, atol=1e-6)
    _, rec_big, _ = run(config("proposed", scale=1e9))
    models = rec_big.before[3]["models"]
    assert any(torch.equal(rec_big.inits[3], m) for m in models)
    _, rec_avg, _ = run(config("average"))
    assert torch.equal(rec_avg.inits[1], rec_avg.inits[0])  # restart from the random model at s = P
    for s in (2, 3):
        mean = sum(rec_avg.before[s]["models"]) / len(rec_avg.before[s]["models"])
        assert torch.allclose(rec_avg.inits[s], mean, atol=1e-6)


def test_previous_continues_and_continuous_distils():
    sim, rec, prev = run(config("previous"))
    assert torch.equal(rec.inits[1], sim.initial_vector)
    for s in (2, 3):
        assert torch.equal(rec.inits[s], rec.before[s]["x"])
    _, _, no_kd = run(config("continuous", kd_weight=0.0))
    _, _, kd = run(config("continuous", kd_weight=1.0))
    accs = [[m.get("test_acc") for m in ms] for ms in (prev, no_kd, kd)]
    assert accs[0] == accs[1]  # κ = 0 is Previous exactly
    assert accs[2][: 2 * T + 1] == accs[0][: 2 * T + 1]  # no teacher before the second post-pilot session
    assert accs[2][2 * T + 1 :] != accs[0][2 * T + 1 :]


def _continuous_rounds(batched: bool, kd_weight: float = 1.0, dpsgd: DPSGD | None = None) -> torch.Tensor:
    """The global model after three sessions of the Continuous baseline with plain SGD (float64), its distillation
    teacher set from the third; batched or on the per-client loop."""
    cfg = dataclasses.replace(
        config("continuous", sessions=3, kd_weight=kd_weight), dtype="float64", momentum=0.0, weight_decay=0.0
    )
    sim = Simulation(dataclasses.replace(cfg, batched=batched))
    sim.dpsgd = dpsgd
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    for t in range(cfg.rounds):
        algo.round(t, sim)
    return algo.global_model()


def test_continuous_distils_on_both_paths_with_plain_sgd():
    """Plain SGD's fast step on the loop takes the distillation term too: the loop equals the batched path (float64)
    and differs from κ = 0; local DP-SGD with a teacher is refused on both paths."""
    loop = _continuous_rounds(False)
    torch.testing.assert_close(loop, _continuous_rounds(True), rtol=1e-10, atol=1e-12)
    assert (loop - _continuous_rounds(False, kd_weight=0.0)).abs().max() > 1e-6
    for batched in (True, False):
        with pytest.raises(ValueError, match="distillation teacher is not supported"):
            _continuous_rounds(batched, dpsgd=DPSGD(0.5, 1.0, seed=3))


def test_sessions_reset_the_host_state_and_lr_schedule():
    cfg = config("proposed", host="scaffold", lr_floor=0.5)
    sim = Simulation(cfg)
    seen = {}
    algo = sim.algorithm
    start = algo._start_session

    def check(s, t, ctx):
        extras = start(s, t, ctx)
        seen[s] = float(algo.host_algo.c.abs().sum())
        return extras

    algo._start_session = check
    metrics = sim.run()
    assert all(v == 0.0 for v in seen.values())
    lrs = [m["lr"] for m in metrics[1:]]
    assert lrs[:T] == lrs[T : 2 * T]  # the engine's lr column is the engine's schedule (constant here)
    view = SessionContext(sim, 2 * T, T, 0.5)
    assert view.lr(2 * T) == pytest.approx(0.1)
    assert view.lr(3 * T - 1) == pytest.approx(0.1 * (0.5 * (1 / 3) ** 0.9 + 0.5))


def test_bfloat16_history_and_host_params():
    sim, rec, metrics = run(config("proposed", storage="bfloat16", host="fedprox", host_params="mu=0.5"))
    assert sim.algorithm.store.models.dtype == torch.bfloat16
    assert sim.algorithm.host_algo.mu == 0.5
    assert rec.inits[3].dtype == torch.float32 and torch.isfinite(rec.inits[3]).all()
    assert all(np.isfinite(m["test_acc"]) for m in metrics if "test_acc" in m)


def test_resume_mid_session_is_exact(tmp_path):
    cfg = config("proposed")
    full = Simulation(cfg).run(tmp_path / "run")
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("round_*.pt"))
    assert [p.name for p in checkpoints] == ["round_000010.pt", "round_000012.pt"]  # the newest two, the last too
    checkpoints[-1].unlink()  # as if interrupted in round 11 or 12 (mid-session 3)
    (tmp_path / "run" / "summary.json").unlink()  # an interrupted run has no summary
    resumed = Simulation(cfg).run(tmp_path / "run", resume=True)

    def strip(ms):
        return [{k: v for k, v in m.items() if not k.startswith("time")} for m in ms]

    assert json.dumps(strip(resumed)) == json.dumps(strip(full))


def test_history_ring_buffer_keeps_the_newest_sessions():
    h = SessionHistory(3, 4, 2, dtype="bfloat16")
    for s in range(5):
        h.push(s, torch.full((4,), float(s)), torch.full((2,), -float(s)))
    assert len(h) == 3 and h.session_ids().tolist() == [2, 3, 4]
    assert [float(m[0]) for m in h.model_rows()] == [2.0, 3.0, 4.0]
    assert [float(g[0]) for g in h.grad_rows()] == [-2.0, -3.0, -4.0]
    assert h.models.dtype == torch.bfloat16 and h.model_rows()[2].data_ptr() == h.models[1].data_ptr()  # views
    copy = SessionHistory(3, 4, 2, dtype="bfloat16")
    copy.load_state_dict(h.state_dict())
    assert copy.session_ids().tolist() == [2, 3, 4] and torch.equal(copy.models, h.models)
    w = ops.similarity_weights(torch.full((2,), -3.0, dtype=torch.bfloat16), h.grad_rows(), 1e6, "l2")
    assert w.tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="capacity"):
        SessionHistory(0, 4)
    with pytest.raises(ValueError, match="dtype"):
        SessionHistory(2, 4, dtype="float16")
    with pytest.raises(ValueError, match="gradient"):
        SessionHistory(2, 4).push(0, torch.zeros(4), torch.zeros(2))


def test_bounded_history_limits_the_candidates():
    _, rec, metrics = run(config("proposed", sessions=5, history=2))
    assert len(rec.before[4]["models"]) == 2
    assert next(m for m in metrics if m["round"] == 4 * T + 1)["candidates"] == 2.0


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"host": "dynamic"}, "another algorithm"),
        ({"host": "nope"}, "unknown algorithm"),
        ({"host": "fedprox", "host_params": "mu"}, "key=value"),
        ({"host": "fedavg", "host_params": "mu=1"}, "has no parameter 'mu'"),
        ({"host": "fedavg", "host_params": "ref_compat=flase"}, "ref_compat must be true or false, got 'flase'"),
        ({"host": "fedprox", "host_params": "mu=a"}, "mu must be a number, got 'a'"),
        ({"method": "best"}, "method must be one of"),
        ({"metric": "cos"}, "metric must be one of"),
        ({"sessions": 2, "pilot_sessions": 2}, "pilot_sessions"),
        ({"scale": float("nan")}, "scale must be finite"),
        ({"storage": "float16"}, "storage must be one of"),
        ({"first_init": "zero"}, "first_init"),
        ({"lr_floor": 2.0}, "lr_floor"),
    ],
)
def test_bad_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        DynamicInit(**params)


def test_rounds_must_fill_the_sessions():
    cfg = config("previous")
    cfg.rounds = 10
    with pytest.raises(ValueError, match="multiple of sessions"):
        Simulation(cfg).run()


def test_parse_host_params_types_values_like_the_fields():
    assert parse_host_params("fedprox", "mu=0.5, server_lr=1") == {"mu": 0.5, "server_lr": 1.0}


def test_footprint_rounds_shift_the_stacked_batches_like_the_batches():
    sim = Simulation(config())
    view = SessionContext(sim, 0, T, round_key=10**9 + 4)
    ours = view.stacked_batches([0, 2], 1, steps=2)
    base = sim.stacked_batches([0, 2], 10**9 + 5, steps=2)
    assert ours.clients.tolist() == base.clients.tolist() == [0, 2]
    steps = [tuple(None if t is None else t.clone() for t in step) for step in ours]  # buffers are reused
    assert len(steps) == 2
    for (xa, ya, _), (xb, yb, _) in zip(steps, base, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x0, y0 = next(iter(view.batches(2, 1, steps=2)))
    assert torch.equal(steps[0][0][1, : len(y0)], x0) and torch.equal(steps[0][1][1, : len(y0)], y0)


def test_transition_accuracy():
    metrics = [{"round": r, "test_acc": r / 100} for r in range(0, 13)]
    assert transition_accuracy(metrics, 4, window=2) == {1: 0.055, 2: 0.095}
    # a window longer than the 4-round session stops at the session's end (rounds 5-8 and 9-12)
    assert transition_accuracy(metrics, 4, window=10) == {1: 0.065, 2: 0.105}


def test_cli_runs_dynamic(tmp_path, capsys):
    from pyfedkern.cli import main

    code = main(
        [
            "run",
            "--algorithm",
            "dynamic",
            "--dataset",
            "digits",
            "--partition",
            "groups:0,0.5",
            "--clients",
            "4",
            "--model",
            "logreg",
            "--rounds",
            "6",
            "--local-steps",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "cli"),
            "--host",
            "scaffold",
            "--sessions",
            "3",
            "--scale",
            "10",
        ]
    )
    assert code == 0
    stored = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert stored["algorithm_params"] == {"host": "scaffold", "sessions": 3, "scale": 10.0}
