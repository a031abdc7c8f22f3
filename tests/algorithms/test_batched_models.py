"""Batched local training of conv nets and sequence models against the per-client loop, and the engine's choice
between the two paths (:func:`pyfedkern.algorithms.paths.choose_path`)."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from pyfedkern import models
from pyfedkern.algorithms import paths
from pyfedkern.algorithms.batched import BatchedLocal
from pyfedkern.algorithms.fedavg import FedAvg
from pyfedkern.algorithms.paths import choose_path, faster_path
from pyfedkern.benchmarks.engine_models import array_simulation, shakespeare_shaped
from pyfedkern.sim import checkpoints
from pyfedkern.sim.engine import ExperimentConfig, Simulation, _cpu_threads

SIZES = np.array([7, 3, 12, 5, 9], dtype=np.int64)  # unequal: rows stop at different steps, batches are padded


def _user_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 3, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 2 * 2, 6),
        nn.ReLU(),
        nn.Linear(6, 4),
    )


def _images(shape: tuple[int, ...], classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    n = int(SIZES.sum())
    return torch.randn(n, *shape, generator=gen, dtype=torch.float64), torch.randint(0, classes, (n,), generator=gen)


def _tokens(length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    n = int(SIZES.sum())
    return torch.randint(0, vocab, (n, length), generator=gen), torch.randint(0, vocab, (n,), generator=gen)


TASKS = {  # name: (model factory, data)
    "user-cnn": (_user_cnn, lambda: _images((2, 8, 8), 4)),
    "simple_cnn": (
        lambda: models.build_model("simple_cnn", (3, 8, 8), 5, dropout=False),
        lambda: _images((3, 8, 8), 5),
    ),
    "lstm": (lambda: models.build_model("lstm", (6,), 7, embed=4, hidden=5), lambda: _tokens(6, 7)),
    "transformer": (
        lambda: models.build_model("transformer", (6,), 7, dim=8, heads=2, ff=12, layers=2),
        lambda: _tokens(6, 7),
    ),
}


def _context(task: str, batched_flag: bool | None) -> Simulation:
    factory, data = TASKS[task]
    torch.manual_seed(0)
    x, y = data()
    return array_simulation(
        factory().double(),
        x,
        y,
        SIZES,
        per_round=len(SIZES),
        batch_size=4,
        lr=0.3,
        local_epochs=2.0,
        batched=batched_flag,
    )


def _rounds(ctx: Simulation, rounds: int = 2) -> tuple[torch.Tensor, float]:
    algo = FedAvg()
    x0 = ctx.local.flat.data.clone()
    algo.setup(ctx, x0)
    with _cpu_threads(1):
        for t in range(rounds):
            stats = algo.round(t, ctx)
    return algo.global_model() - x0, stats.local_loss


@pytest.mark.parametrize("task", list(TASKS))
def test_batched_rounds_of_conv_and_sequence_models_equal_the_loop(task, monkeypatch):
    built = []
    init = BatchedLocal.__init__
    monkeypatch.setattr(BatchedLocal, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    moved_batched, loss_batched = _rounds(_context(task, True))
    runs = len(built)
    moved_loop, loss_loop = _rounds(_context(task, False))
    assert runs == 2 and len(built) == runs  # one batched run a round; none in the loop
    assert moved_batched.abs().max() > 1e-3  # the models trained
    torch.testing.assert_close(moved_batched, moved_loop, rtol=1e-9, atol=1e-11)
    assert np.isfinite(loss_batched) and loss_batched == pytest.approx(loss_loop, rel=1e-9)


def test_float_token_ids_give_the_integer_ids_results():
    model = models.build_model("lstm", (6,), 7, embed=4, hidden=5).double()
    x, _ = _tokens(6, 7)
    torch.testing.assert_close(model(x.double()), model(x), rtol=0, atol=0)


def test_faster_path_is_batched_only_when_clearly_faster():
    assert faster_path({"batched": 1.0, "loop": 2.0}) is True
    assert faster_path({"batched": 2.0, "loop": 1.0}) is False
    assert faster_path({"batched": 0.8, "loop": 1.0}) is True
    assert faster_path({"batched": 0.85, "loop": 1.0}) is False  # within the margin: the loop


def test_measuring_the_paths_of_an_lstm_warns_of_nothing(fresh_choices):
    """torch warns that its vmap fallback for the float32 CPU LSTM kernel is slow; the engine's measurement finds that
    out itself (it takes the loop), so the user sees no warning."""
    factory, data = TASKS["lstm"]
    torch.manual_seed(0)
    x, y = data()
    ctx = array_simulation(factory(), x, y, SIZES, per_round=len(SIZES), batch_size=4, lr=0.3, batched=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _cpu_threads(1):
            choice = choose_path(ctx, rows=len(SIZES))
    assert choice.seconds is not None and set(choice.seconds) == {"batched", "loop"}
    assert [str(w.message) for w in caught] == []


@pytest.fixture
def fresh_choices(monkeypatch):
    monkeypatch.setattr(paths, "_CHOICES", {})
    monkeypatch.setattr(paths, "_LAYOUTS", {})


@pytest.mark.parametrize("loop_faster", [True, False])
def test_choose_path_follows_its_measurement_once_per_model_structure(loop_faster, monkeypatch, fresh_choices):
    calls = []

    def measured(ctx, xb, yb, wb):
        calls.append(xb.shape[0])
        return {"batched": 2.0, "loop": 1.0} if loop_faster else {"batched": 1.0, "loop": 2.0}

    monkeypatch.setattr(paths, "_measure_paths", measured)
    first = choose_path(_context("user-cnn", None), rows=50)
    again = choose_path(_context("user-cnn", None), rows=50)  # another simulation of the same model: no measurement
    assert first == again
    assert first.batched is (not loop_faster) and first.seconds == measured(None, torch.zeros(0), None, None)
    calls.pop()
    assert calls == [len(SIZES)]  # min(rows, PROBE_ROWS, clients) clients, measured once
    choose_path(_context("lstm", None), rows=50)  # another structure is measured anew
    assert len(calls) == 2


def test_rules_decide_without_measuring(monkeypatch, fresh_choices):
    monkeypatch.setattr(paths, "_measure_paths", lambda *args: pytest.fail("measured"))
    x, y = _images((2, 8, 8), 4)
    mlp = array_simulation(
        models.build_model("mlp", (2, 8, 8), 4).double(), x, y, SIZES, per_round=5, batch_size=4, lr=0.1
    )
    assert choose_path(mlp, 5).batched is True
    norm = nn.Sequential(nn.Flatten(), nn.Linear(128, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4)).double()
    with_buffers = array_simulation(norm, x, y, SIZES, per_round=5, batch_size=4, lr=0.1)
    choice = choose_path(with_buffers, 5)
    assert choice.batched is False and "buffers" in choice.reason and choice.seconds is None


def test_measuring_leaves_the_model_and_the_random_state_unchanged(fresh_choices):
    torch.manual_seed(0)
    x, y = _images((3, 8, 8), 5)
    ctx = array_simulation(
        models.build_model("simple_cnn", (3, 8, 8), 5).double(), x, y, SIZES, per_round=5, batch_size=4, lr=0.1
    )
    before = ctx.local.flat.data.clone()
    batch = next(iter(ctx.stacked_batches(np.arange(5), 0, steps=1)))  # seeds torch: a group's training
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    seconds = paths._measure_paths(ctx, *batch)
    assert set(seconds) == {"batched", "loop"} and all(s > 0 for s in seconds.values())
    assert torch.equal(torch.rand(3), expected)  # dropout's draws during the measurement were undone
    assert torch.equal(ctx.local.flat.data, before)
    torch.manual_seed(7)
    assert torch.equal(paths._probe_batch(ctx, 5)[0], batch[0])  # the measurements' batch, drawn without seeding
    assert torch.equal(torch.rand(3), expected)


def test_the_engine_takes_the_chosen_path_logs_it_once_and_can_be_forced(monkeypatch, caplog, fresh_choices):
    config = ExperimentConfig(
        dataset="digits", partition="iid", clients=4, rounds=2, batch_size=32, model="cnn",
        model_params={"channels": 2, "hidden": 8}, dtype="float64", seed=2, batched=None,
    )  # fmt: skip
    monkeypatch.setattr(paths, "_measure_paths", lambda *args: {"batched": 3.0, "loop": 1.0})
    built = []
    init = BatchedLocal.__init__
    monkeypatch.setattr(BatchedLocal, "__init__", lambda self, *a, **k: (built.append(1), init(self, *a, **k))[1])
    with caplog.at_level(logging.INFO, logger="pyfedkern"):
        auto = Simulation(config).run()
    notes = [r.getMessage() for r in caplog.records if "clients train as" in r.getMessage()]
    assert len(notes) == 1 and "a loop over clients" in notes[0] and "measured" in notes[0]
    assert built == []  # the loop, as measured
    forced_loop = Simulation(dataclasses.replace(config, batched=False)).run()
    assert [m["test_loss"] for m in auto] == [m["test_loss"] for m in forced_loop]  # the same path, bit for bit
    forced = Simulation(dataclasses.replace(config, batched=True)).run()  # forcing ignores the measurement
    assert len(built) == 2
    assert forced[-1]["test_loss"] == pytest.approx(auto[-1]["test_loss"], rel=1e-9)


def test_a_resumed_run_keeps_the_path_it_was_taking(monkeypatch, fresh_choices, tmp_path):
    config = ExperimentConfig(
        dataset="digits", partition="iid", clients=4, rounds=3, batch_size=32, model="cnn",
        model_params={"channels": 2, "hidden": 8}, seed=2, batched=None, checkpoint_every=1,
    )  # fmt: skip
    monkeypatch.setattr(paths, "_measure_paths", lambda *args: {"batched": 3.0, "loop": 1.0})
    sim = Simulation(config)
    sim.run(tmp_path / "run")
    state = checkpoints.checkpoint_state(sim, 1)
    assert state["batched"] is False
    monkeypatch.setattr(paths, "_CHOICES", {})
    monkeypatch.setattr(paths, "_LAYOUTS", {})
    monkeypatch.setattr(paths, "_measure_paths", lambda *args: pytest.fail("measured again"))
    monkeypatch.setattr(paths, "_timed_alternately", lambda *args: pytest.fail("measured again"))
    resumed = Simulation(config)
    resumed.algorithm.setup(resumed, resumed.initial_vector)
    checkpoints.restore(resumed, tmp_path / "checkpoint", state)
    assert resumed.batched is False
    assert resumed.channels_last is sim.channels_last  # and its layout, not measured again
    checkpoints.restore(resumed, tmp_path / "checkpoint", {**state, "channels_last": not sim.channels_last})
    assert resumed.channels_last is not sim.channels_last


def _three_channel_loop(channels_last: bool | None) -> Simulation:
    factory, (x, y) = (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 5)),
        _images((3, 8, 8), 5),
    )
    torch.manual_seed(0)
    sim = array_simulation(factory().double(), x, y, SIZES, per_round=3, batch_size=4, lr=0.1, batched=False)
    sim.channels_last = channels_last
    return sim


@pytest.mark.parametrize(
    ("channels_last_seconds", "channels_last_faster"),
    [(0.5, True), (2.0, False), (0.97, False)],  # 3 % faster: within the margin, contiguous is kept
)
def test_the_loop_takes_the_faster_image_layout_once_and_trains_alike(
    channels_last_seconds, channels_last_faster, monkeypatch, caplog, fresh_choices
):
    timings = []

    def timed(ctx, calls):
        timings.append(sorted(calls))
        return {"channels_last": channels_last_seconds, "contiguous": 1.0}

    monkeypatch.setattr(paths, "_timed_alternately", timed)
    with caplog.at_level(logging.INFO, logger="pyfedkern"):
        auto = _three_channel_loop(None)
        assert auto.channels_last is channels_last_faster
        assert auto.channels_last is channels_last_faster
    notes = [r.getMessage() for r in caplog.records if "image batches" in r.getMessage()]
    assert len(notes) == 1 and ("channels-last" if channels_last_faster else "contiguous") in notes[0]
    assert _three_channel_loop(None).channels_last is channels_last_faster  # kept for the process
    assert timings == [["channels_last", "contiguous"]]
    xb, _ = next(iter(auto.batches(0, 0)))
    assert xb.is_contiguous(memory_format=torch.channels_last) is channels_last_faster
    assert xb.is_contiguous() is not channels_last_faster
    contiguous = _three_channel_loop(False)
    for sim in (auto, contiguous):
        sim.algorithm.setup(sim, sim.initial_vector)
        for t in range(2):
            sim.algorithm.round(t, sim)
    moved = contiguous.algorithm.global_model() - contiguous.initial_vector
    assert moved.abs().max() > 1e-3
    # The layouts run different oneDNN convolution kernels (chosen per layout and per machine: AVX2, AVX-512), which
    # sum each output's 27 products and each weight gradient's 144 in other orders: a step differs by a few ulps
    # (~1e-14 relative in float64) of the terms' magnitudes, compounded over the rounds' steps. A parameter near 0
    # differs relatively more (3.9e-12 was seen on AVX-512), so the bound is absolute, on the model's scale.
    expected = contiguous.algorithm.global_model()
    torch.testing.assert_close(auto.algorithm.global_model(), expected, rtol=0, atol=1e-10 * expected.abs().max())


def test_the_layout_is_measured_only_for_image_batches_in_the_loop(monkeypatch, fresh_choices):
    monkeypatch.setattr(paths, "_timed_alternately", lambda *a: pytest.fail("measured"))
    x, y = _tokens(6, 7)
    text = array_simulation(TASKS["lstm"][0]().double(), x, y, SIZES, per_round=3, batch_size=4, lr=0.1, batched=False)
    assert text.channels_last is False
    assert paths.choose_layout(text, 3).seconds is None
    gray = Simulation(ExperimentConfig(dataset="digits", clients=4, model="cnn", batched=False))  # one channel
    assert gray.channels_last is False
    images = _three_channel_loop(None)
    images.batched = True  # batched steps keep the contiguous layout
    assert images.channels_last is False
    assert _three_channel_loop(True).channels_last is True  # forced: not measured


def test_the_layout_measurement_times_both_layouts_and_restores_the_model(fresh_choices):
    sim = _three_channel_loop(None)
    before = sim.local.flat.data.clone()
    choice = paths.choose_layout(sim, 3)
    assert set(choice.seconds) == {"contiguous", "channels_last"} and all(s > 0 for s in choice.seconds.values())
    faster = choice.seconds["channels_last"] < paths.LAYOUT_MARGIN * choice.seconds["contiguous"]
    assert choice.channels_last is faster  # channels-last only when clearly faster
    assert torch.equal(sim.local.flat.data, before)


def test_shakespeare_shaped_text_follows_its_description():
    x, y, sizes = shakespeare_shaped(30, 12, 9, seed=1)
    assert x.shape == (int(sizes.sum()), 12) and y.shape == (int(sizes.sum()),)
    assert sizes.min() >= 2 and sizes.max() <= 400 and len(sizes) == 30
    assert int(x.min()) >= 0 and int(x.max()) < 9 and int(y.max()) < 9
    assert torch.equal(shakespeare_shaped(30, 12, 9, seed=1)[0], x)  # seeded


class _ItemScaled(nn.Module):
    """Calls ``.item()``: vmap cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1)) / max(self.linear.weight.abs().max().item(), 1.0)


class _Branching(_ItemScaled):
    """Python control flow on a tensor: vmap cannot run it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x.flatten(1))
        return out * 0 if out.sum() > 1e9 else out


@pytest.mark.parametrize("model", [_ItemScaled, _Branching])
def test_a_model_vmap_cannot_run_takes_the_loop_or_is_refused_batched(model, caplog, fresh_choices):
    x, y = _images((2, 8, 8), 4)

    def simulation(batched_flag: bool | None) -> Simulation:
        torch.manual_seed(0)
        module = model().double()
        return array_simulation(module, x, y, SIZES, per_round=5, batch_size=4, lr=0.3, batched=batched_flag)

    auto = simulation(None)
    with caplog.at_level(logging.INFO, logger="pyfedkern"):
        moved, _ = _rounds(auto)
    notes = [r.getMessage() for r in caplog.records if "clients train as" in r.getMessage()]
    assert auto.batched is False and len(notes) == 1
    assert "a loop over clients: the model cannot be batched (RuntimeError: vmap: It looks like" in notes[0]
    torch.testing.assert_close(moved, _rounds(simulation(False))[0], rtol=0, atol=0)  # trained as the loop
    refused = r"batched: the model cannot be trained batched \(RuntimeError: vmap: .*\); pass batched=False"
    with pytest.raises(ValueError, match=refused) as info:
        _rounds(simulation(True))
    assert isinstance(info.value.__cause__, RuntimeError) and "\n" not in str(info.value)
