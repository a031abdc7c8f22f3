"""The federated vector is the model's trainable parameters: frozen parameters stay bit-identical and are never
copied per client, tied weights and a module used twice get the gradient torch gives them, on the per-client loop
and the batched path (the hand-written Linear-chain backward and the vmapped one), for every algorithm; checkpoints
hold the trainable vector and the run directory the frozen part once."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from pyfedkern import Experiment
from pyfedkern.algorithms import ALGORITHMS, local_sgd
from pyfedkern.algorithms.batched import trainer_for
from pyfedkern.algorithms.looped import local_sgd_rows_
from pyfedkern.flat import parameters_to_vector, trainable_parameters

FEATURES, CLASSES, WIDTH = 6, 3, 6


class Net(nn.Module):
    """features (two Linear layers, ``act`` after each) and a Linear classifier (what FNR-FL needs); with ReLU its
    ``layer_chain`` is a Flatten/Linear/ReLU chain (the batched path's hand-written backward), with Tanh it is not
    (the vmapped backward). ``kind``: "frozen" (the first layer's weight frozen), "tied" (the second layer's weight
    is the first's) or "reused" (the first layer used twice)."""

    def __init__(self, kind: str, act: type[nn.Module], seed: int = 5) -> None:
        super().__init__()
        torch.manual_seed(seed)
        first = nn.Linear(FEATURES, WIDTH)
        second = first if kind == "reused" else nn.Linear(WIDTH, WIDTH)
        if kind == "tied":
            second.weight = first.weight
        if kind == "frozen":
            first.weight.requires_grad_(False)
        self.features = nn.Sequential(first, act(), second, act())
        self.classifier = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def layer_chain(self) -> list[nn.Module]:
        return [*self.features, self.classifier]


MODELS = [(kind, act) for kind in ("frozen", "tied", "reused") for act in (nn.ReLU, nn.Tanh)]
IDS = [f"{kind}-{act.__name__.lower()}" for kind, act in MODELS]


def _data(n: int = 240, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n)
    return rng.normal(size=(n, FEATURES)) + y[:, None], y


def _experiment(model, batched: bool, algorithm: str = "fedavg", **settings) -> Experiment:
    x, y = _data()
    defaults = dict(
        clients="iid",
        num_clients=6,
        rounds=2,
        fraction=0.5,
        batch_size=16,
        lr=0.1,
        momentum=0.5,
        weight_decay=0.01,
        dtype="float64",
        batched=batched,
        eval_initial=False,
    )
    return Experiment(model, (x[:200], y[:200]), (x[200:], y[200:]), algorithm=algorithm, **{**defaults, **settings})


def _frozen(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}


def test_the_vector_holds_each_trainable_tensor_once():
    head = WIDTH * CLASSES + CLASSES
    trained = {"frozen": 2 * (WIDTH * WIDTH + WIDTH) - WIDTH * WIDTH, "tied": WIDTH * WIDTH + 2 * WIDTH}
    trained["reused"] = WIDTH * WIDTH + WIDTH
    for kind, size in trained.items():
        net = Net(kind, nn.ReLU)
        assert parameters_to_vector(net).shape == (size + head,)
        assert len({id(p) for _, p in trainable_parameters(net)}) == len(trainable_parameters(net))
    frozen = Net("frozen", nn.ReLU)
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="Net has no trainable parameters"):
        parameters_to_vector(frozen)

    def net():
        return frozen

    with pytest.raises(ValueError, match="model 'net' has no trainable parameters"):
        _experiment(net, True).run()


@pytest.mark.parametrize(("kind", "act"), MODELS, ids=IDS)
def test_local_training_equals_torch_sgd_on_both_paths(kind, act):
    """Each client's local SGD (weight decay and momentum) on the loop and on the batched path is torch's SGD of the
    trainable parameters over the same batches, to 1e-12; the frozen parameters do not move."""
    sims = {batched: _experiment(lambda: Net(kind, act), batched).simulation for batched in (False, True)}
    clients = np.arange(4)
    plain_net = copy.deepcopy(sims[False].local.module)
    start = _frozen(plain_net)
    x0 = sims[False].initial_vector
    rows = x0.expand(len(clients), -1).clone()
    local_sgd_rows_(sims[True], 0, rows, clients)
    for r, cid in enumerate(clients):
        loop = local_sgd(sims[False], int(cid), 0, x0).x
        net = copy.deepcopy(plain_net)
        opt = torch.optim.SGD([p for _, p in trainable_parameters(net)], lr=0.1, momentum=0.5, weight_decay=0.01)
        for xb, yb in sims[False].batches(int(cid), 0, epochs=1.0):
            opt.zero_grad()
            nn.functional.cross_entropy(net(xb), yb).backward()
            opt.step()
        expected = parameters_to_vector(net, torch.float64)
        assert (expected - x0).abs().max() > 1e-3  # the model moved
        torch.testing.assert_close(loop, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(rows[r], expected, rtol=0, atol=1e-12)
    for sim in sims.values():
        for name, value in _frozen(sim.local.module).items():
            assert torch.equal(value, start[name])


def test_the_chain_and_vmapped_gradients_of_tied_and_reused_weights_are_torch_s():
    """One batched gradient, with unequal (padded) batches, against torch's autograd per row."""
    for kind in ("frozen", "tied", "reused"):
        sim = _experiment(lambda kind=kind: Net(kind, nn.ReLU), True).simulation
        trainer = trainer_for(sim.local)
        assert trainer.chain is not None
        gen = torch.Generator().manual_seed(3)
        rows = sim.initial_vector + 0.1 * torch.randn(3, sim.local.dim, generator=gen, dtype=torch.float64)
        xb = torch.randn(3, 5, FEATURES, generator=gen, dtype=torch.float64)
        yb = torch.randint(0, CLASSES, (3, 5), generator=gen)
        sizes = torch.tensor([5, 3, 1])
        wb = (torch.arange(5)[None] < sizes[:, None]).double() / sizes[:, None]
        chain, _ = trainer.gradients(rows, xb, yb, wb)
        trainer.chain = None  # the vmapped backward
        vmapped, _ = trainer.gradients(rows, xb, yb, wb)
        for r in range(3):
            sim.local.load_(rows[r])
            sim.local.loss_and_grad(xb[r, : sizes[r]], yb[r, : sizes[r]])
            torch.testing.assert_close(chain[r], sim.local.flat.grad, rtol=0, atol=1e-13)
            torch.testing.assert_close(vmapped[r], sim.local.flat.grad, rtol=0, atol=1e-13)


@pytest.mark.parametrize(("kind", "act"), MODELS, ids=IDS)
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_trains_the_same_model_on_both_paths(algorithm, kind, act):
    params = {
        "fnrfl": {"public_size": 5, "refine_epochs": 1.0},
        "dynamic": {"sessions": 2, "session_rounds": 1},
        "fedpbc": {"link_probs": (0.5,)},
    }.get(algorithm, {})
    momentum = 0.5 if algorithm in ("fedavg", "fedprox", "scaffold", "feddyn", "fedpbc") else 0.0
    final = {}
    for batched in (False, True):
        experiment = _experiment(
            lambda: Net(kind, act), batched, algorithm, algorithm_params=params, momentum=momentum, batch_size=8
        )
        sim = experiment.simulation
        start = _frozen(sim.local.module)
        metrics = experiment.run()
        assert np.isfinite(metrics[-1]["test_loss"])
        final[batched] = sim.algorithm.global_model()
        assert final[batched].shape == (sim.local.dim,) == parameters_to_vector(sim.local.module).shape
        for name, value in _frozen(sim.local.module).items():
            assert torch.equal(value, start[name]), name
    assert (final[True] - sim.initial_vector).abs().max() > 1e-4
    torch.testing.assert_close(final[True], final[False], rtol=0, atol=1e-12)


def test_the_frozen_part_is_kept_once_and_checked_on_resume(tmp_path):
    def make(seed):
        def net():
            return Net("frozen", nn.Tanh, seed)

        return net

    full = _experiment(make(5), True, rounds=3).run()
    _experiment(make(5), True, rounds=2).run(tmp_path / "run")
    kept = torch.load(tmp_path / "run" / "frozen.pt", weights_only=True)
    assert list(kept) == ["features.0.weight"]
    assert torch.equal(kept["features.0.weight"], Net("frozen", nn.Tanh).features[0].weight.detach())
    checkpoint = torch.load(sorted((tmp_path / "run" / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    vectors = [v for v in checkpoint["algorithm"].values() if isinstance(v, torch.Tensor) and v.dim() == 1]
    dim = _experiment(make(5), True).simulation.local.dim
    assert vectors and all(v.numel() == dim for v in vectors)  # the trainable vector, not the whole model
    with pytest.raises(ValueError, match=r"the frozen parameter features\.0\.weight differs"):
        _experiment(make(6), True, rounds=3).run(tmp_path / "run", resume=True)
    resumed = _experiment(make(5), True, rounds=3).run(tmp_path / "run", resume=True)
    assert [m.get("test_loss") for m in resumed] == [m.get("test_loss") for m in full]


def test_the_automatic_path_trains_reused_modules():
    """A module used twice crashed the batched and automatic paths after the first round ("tensor may have
    escaped"): functional_call swapped its weight in and out twice."""
    for batched in (None, True):
        metrics = _experiment(lambda: Net("reused", nn.Tanh), batched, rounds=3).run()
        assert np.isfinite(metrics[-1]["test_loss"])
