"""FNR-FL: regularizer values/gradients vs the closed forms of docs/fnrfl.md §4, Alg. 2 differences, selection of the
lowest-accuracy clients, the refinement phase (D_pub, from w_j, CE + λ·J) against a plain-torch restatement of
docs/fnrfl.md §3, aggregation with refined models substituted, p = 0 ≡ FedAvg, λ = 0 ≡ literal, the public set and
the CLI."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pyfedkern.algorithms import FLContext, make_algorithm
from pyfedkern.algorithms.fnrfl import (
    FNRFL,
    PublicStats,
    differences,
    reference_sums,
    regularizer,
    round_targets,
    select_lowest,
    selection_count,
)
from pyfedkern.algorithms.local import LocalModel
from pyfedkern.models import build_model
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation


def _batch(seed: int = 0, B: int = 24, D: int = 7, K: int = 5):
    gen = torch.Generator().manual_seed(seed)
    f = torch.randn(B, D, generator=gen, dtype=torch.float64).abs()  # post-ReLU-like features
    y = torch.randint(0, K - 1, (B,), generator=gen)  # class K-1 absent from the batch
    return f.requires_grad_(True), y


def _class_stats(f: torch.Tensor, y: torch.Tensor, K: int):
    norms = f.detach().norm(dim=1)
    counts = torch.bincount(y, minlength=K).double()
    means = torch.zeros(K, dtype=torch.float64).index_add_(0, y, norms) / counts.clamp(min=1)
    return norms, counts, means


def test_abs_regularizer_value_and_gradient_match_the_spec():
    K = 5
    f, y = _batch()
    B = f.shape[0]
    target_sum = torch.tensor([3.0, 20.0, 0.5, 9.0, 4.0], dtype=torch.float64)
    target_count = torch.tensor([3.0, 3.0, 3.0, 0.0, 3.0], dtype=torch.float64)  # no reference for class 3
    J = regularizer("abs", f, y, K, target_sum, target_count, torch.zeros(K))
    norms, counts, means = _class_stats(f, y, K)
    rho = counts / B
    active = (counts > 0) & (target_count > 0)
    expected = (rho * (target_sum - target_count * means).abs())[active].sum()
    torch.testing.assert_close(J, expected)
    J.backward()
    # ∂J/∂f_b = −(M_l/|B|)·sign(Σ_m F_m[l] − M_l·F̂_l)·f_b/‖f_b‖ for l = y_b
    sign = torch.sign(target_sum - target_count * means)
    coef = -(target_count / B) * sign * active
    expected_grad = coef[y][:, None] * f.detach() / norms[:, None]
    torch.testing.assert_close(f.grad, expected_grad)
    assert torch.all(f.grad[y == 3] == 0)


def test_sq_regularizer_gradient_matches_the_spec():
    K = 5
    f, y = _batch(1)
    B = f.shape[0]
    target_sum = torch.tensor([6.0, 1.0, 12.0, 3.0, 1.0], dtype=torch.float64)
    target_count = torch.full((K,), 3.0, dtype=torch.float64)
    J = regularizer("sq", f, y, K, target_sum, target_count, torch.zeros(K))
    norms, counts, means = _class_stats(f, y, K)
    bar = target_sum / target_count
    torch.testing.assert_close(J, ((counts / B) * (bar - means) ** 2)[counts > 0].sum())
    J.backward()
    # ρ_l/c_l = 1/|B|: ∂J/∂f_b = −(2/|B|)·(F̄_l − F̂_l)·f_b/‖f_b‖
    coef = -(2.0 / B) * (bar - means)
    torch.testing.assert_close(f.grad, coef[y][:, None] * f.detach() / norms[:, None])


def test_literal_regularizer_is_the_printed_constant():
    K = 5
    f, y = _batch(2)
    delta = torch.tensor([1.0, -2.0, 0.5, 3.0, 7.0], dtype=torch.float64)
    J = regularizer("literal", f, y, K, torch.zeros(K), torch.zeros(K), delta)
    counts = torch.bincount(y, minlength=K).double()
    torch.testing.assert_close(J, (counts / y.shape[0] * delta).sum())
    assert not J.requires_grad  # the paper's J has no gradient


def _stats(means, present, acc=0.5):
    return PublicStats(torch.tensor(means, dtype=torch.float64), torch.tensor(present), acc)


def test_differences_are_signed_sums_over_non_selected_clients():
    others = [_stats([1.0, 2.0, 3.0], [True, True, True]), _stats([4.0, 0.0, 5.0], [True, False, True])]
    own = _stats([2.0, 1.0, 0.0], [True, True, False])
    delta = differences(*reference_sums(others), own)
    # label 0: (1-2)+(4-2) = 1; label 1: only client 0 has it: (2-1) = 1; label 2 absent from F_j: 0
    assert delta.tolist() == [1.0, 1.0, 0.0]


def _literal_deltas(norms: list[dict], chosen: list[int], rule: str) -> list[dict]:
    """Δ_j as dictionaries {label: value}, summed the way the authors' calculate_feature_norm_diff does (rule
    "authors": over every other client, refined or not) or Alg. 2 does (rule "paper": over the clients not chosen),
    skipping a client for the labels it lacks."""
    out = []
    for j in chosen:
        delta = {}
        for m, other in enumerate(norms):
            if m == j or (rule == "paper" and m in chosen):
                continue
            for label, own in norms[j].items():
                if label in other:
                    delta[label] = delta.get(label, 0.0) + other[label] - own
        out.append(delta)
    return out


def _as_dicts(stats: list[PublicStats]) -> list[dict]:
    return [{l: float(s.class_mean[l]) for l in range(len(s.present)) if s.present[l]} for s in stats]


@pytest.mark.parametrize("rule", ["paper", "authors"])
def test_delta_rules_are_the_literal_sums(rule):
    gen = torch.Generator().manual_seed(4)
    stats = []
    for _ in range(6):
        present = torch.rand(5, generator=gen) > 0.3
        means = torch.where(present, torch.rand(5, generator=gen, dtype=torch.float64) * 3, torch.zeros(5).double())
        stats.append(PublicStats(means, present, 0.5))
    chosen = np.array([1, 4, 5])
    sums, counts, deltas = round_targets(stats, chosen, rule)
    expected = _literal_deltas(_as_dicts(stats), chosen.tolist(), rule)
    for r, j in enumerate(chosen):
        dense = [expected[r].get(l, 0.0) for l in range(5)]
        torch.testing.assert_close(deltas[r], torch.tensor(dense, dtype=torch.float64), rtol=1e-14, atol=1e-14)
        others = [s for k, s in enumerate(stats) if k != j and (rule == "authors" or k not in chosen)]
        torch.testing.assert_close(sums[r], sum(s.class_mean * s.present for s in others))
        torch.testing.assert_close(counts[r], sum(s.present.double() for s in others))
    other_rule = round_targets(stats, chosen, "authors" if rule == "paper" else "paper")[2]
    assert (other_rule - deltas).abs().max() > 0.1  # the refined clients' norms are what separates the rules


def test_selection_picks_the_lowest_accuracies_stably():
    assert selection_count(10, 0.3) == 3 and selection_count(10, 0.0) == 0 and selection_count(3, 1.0) == 3
    assert selection_count(7, 0.5) == 3
    acc = np.array([0.9, 0.2, 0.5, 0.2, 0.1, 0.7])
    assert select_lowest(acc, 3).tolist() == [1, 3, 4]
    assert select_lowest(acc, 2).tolist() == [1, 4]  # tie at 0.2: the lower position first
    assert select_lowest(acc, 0).tolist() == []


def _config(**params):
    base = {"public_size": 10, "refine_epochs": 1.0, "p": 0.5}
    base.update(params)
    return ExperimentConfig(
        algorithm="fnrfl",
        algorithm_params=base,
        dataset="digits",
        model="mlp",
        clients=4,
        rounds=1,
        partition="noise:0.5",
        batch_size=32,
        seed=3,
    )


def test_public_set_is_carved_disjoint_from_clients():
    sim = Simulation(_config(public_size=12))
    assert sim.public_x.shape[0] == 12 * sim.data.num_classes
    assert torch.bincount(sim.public_y).tolist() == [12] * sim.data.num_classes
    client_rows = {r.tobytes() for x in sim.client_x for r in x.reshape(x.shape[0], -1).numpy()}
    assert not any(r.tobytes() in client_rows for r in sim.public_x.reshape(sim.public_x.shape[0], -1).numpy())
    assert sum(sim.client_sizes) + sim.public_x.shape[0] == len(sim.data.y_train)


def test_refined_clients_are_the_lowest_accuracy_and_aggregation_substitutes_them(monkeypatch):
    sim = Simulation(dataclasses.replace(_config(p=0.5), batched=False))  # the per-client methods, spied on
    algo: FNRFL = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    x0 = algo.x.clone()
    seen = {}
    original_stats, original_refine = FNRFL.public_statistics, FNRFL.refine
    trained = {}

    def stats_spy(self, vector, ctx):
        s = original_stats(self, vector, ctx)
        seen[len(seen)] = s.accuracy
        trained[len(trained)] = vector.clone()
        return s

    refined = []

    def refine_spy(self, t, cid, start, ctx, target, delta):
        refined.append(cid)
        return torch.zeros_like(start), 0.0, 0.0

    monkeypatch.setattr(FNRFL, "public_statistics", stats_spy)
    monkeypatch.setattr(FNRFL, "refine", refine_spy)
    stats = algo.round(0, sim)
    acc = np.array([seen[k] for k in range(4)])
    assert sorted(refined) == sorted(np.argsort(acc, kind="stable")[:2].tolist())
    assert stats.extras["fnr_refined"] == 2.0
    # w^{t+1} = Σ |D_i|/Σ|D| · w_i with the refined (here zero) models substituted
    w = sim.client_sizes / sim.client_sizes.sum()
    expected = sum(w[k] * (torch.zeros_like(x0) if k in refined else trained[k]) for k in range(4))
    torch.testing.assert_close(algo.x, expected.to(algo.x.dtype), rtol=1e-6, atol=1e-7)
    monkeypatch.setattr(FNRFL, "refine", original_refine)


def test_authors_delta_rule_reaches_the_refinement(monkeypatch):
    """With delta_rule="authors" each refined client gets Δ_j (and the regularizer's sums) over every other
    participant of the round, refined ones included: checked against the literal sum of the authors' code."""
    sim = Simulation(dataclasses.replace(_config(p=0.5, delta_rule="authors"), batched=False))
    algo: FNRFL = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    stats, received = [], {}
    original_stats = FNRFL.public_statistics

    def stats_spy(self, vector, ctx):
        stats.append(original_stats(self, vector, ctx))
        return stats[-1]

    def refine_spy(self, t, cid, start, ctx, target, delta):
        received[cid] = (target, delta)
        return start, 0.0, 0.0

    monkeypatch.setattr(FNRFL, "public_statistics", stats_spy)
    monkeypatch.setattr(FNRFL, "refine", refine_spy)
    algo.round(0, sim)
    assert len(received) == 2
    norms = _as_dicts(stats)  # participants in client order (all 4 clients take part)
    for cid, (target, delta) in received.items():
        expected = _literal_deltas(norms, [cid], "authors")[0]
        dense = torch.tensor([expected.get(l, 0.0) for l in range(len(delta))], dtype=torch.float64)
        torch.testing.assert_close(delta, dense, rtol=1e-12, atol=1e-12)
        others = [s for k, s in enumerate(stats) if k != cid]
        torch.testing.assert_close(target[0], sum(s.class_mean.double() * s.present for s in others))


class _RefineContext(FLContext):
    """The part of FLContext that FNRFL.refine reads: a LocalModel, the public set, lr, batch size and rng streams
    (the model's seeding is the default's: the test model has no dropout)."""

    def __init__(self, module, public_x, public_y, batch_size):
        self.local = LocalModel(module)
        self.public_x, self.public_y = public_x, public_y
        self.batch_size = batch_size
        self.momentum = self.weight_decay = 0.0

    def lr(self, t):
        return 0.5

    def rng(self, *keys):
        return np.random.default_rng(list(keys))


def _spec_refinement(start, x, y, target_sum, target_count, lam, steps, lr=0.5):
    """docs/fnrfl.md §3 step 5 ('abs' J) as full-batch gradient descent in plain torch: w ← w − η∇(CE + λ·J) from
    ``start``."""
    model = _refine_model()
    torch.nn.utils.vector_to_parameters(start, model.parameters())
    params = list(model.parameters())
    K = model.classifier.out_features
    for _ in range(steps):
        feats = model.features(x)
        ce = torch.nn.functional.cross_entropy(model.classifier(feats), y)
        counts = torch.bincount(y, minlength=K).double()
        means = torch.zeros(K, dtype=torch.float64).index_add(0, y, feats.norm(dim=1)) / counts.clamp(min=1)
        active = (counts > 0) & (target_count > 0)
        J = torch.where(active, counts / y.shape[0] * (target_sum - target_count * means).abs(), 0.0).sum()
        grads = torch.autograd.grad(ce + lam * J, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p -= lr * g
    return torch.nn.utils.parameters_to_vector(params).detach()


def _refine_model():
    torch.manual_seed(11)
    return build_model("mlp", (6,), 3, hidden=[5]).double()


def _refine_setup(batch_size):
    gen = torch.Generator().manual_seed(12)
    public_x = torch.randn(12, 6, generator=gen, dtype=torch.float64)
    public_y = torch.arange(12) % 3
    client_x = torch.randn(12, 6, generator=gen, dtype=torch.float64) + 1.0  # a client's own data, not D_pub
    ctx = _RefineContext(_refine_model(), public_x, public_y, batch_size)
    d = ctx.local.dim
    global_w = torch.randn(d, generator=gen, dtype=torch.float64) * 0.5
    client_w = torch.randn(d, generator=gen, dtype=torch.float64) * 0.5
    ctx.local.load_(global_w)  # what the shared model holds when the server starts refining (not w_j)
    assert torch.equal(torch.nn.utils.parameters_to_vector(ctx.local.module.parameters()), ctx.local.flat.data)
    target = (torch.tensor([30.0, 4.0, 12.0], dtype=torch.float64), torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64))
    return ctx, (public_x, public_y), (client_x, public_y), global_w, client_w, target


def test_refine_trains_on_the_public_set_from_the_client_model_with_the_regularizer():
    ctx, (px, py), (cx, cy), global_w, client_w, target = _refine_setup(batch_size=64)  # one batch = all of D_pub
    algo = FNRFL(lam=0.2, refine_epochs=3.0, reg_mode="abs")
    model, loss, reg = algo.refine(0, 1, client_w, ctx, target, torch.zeros(3, dtype=torch.float64))
    expected = _spec_refinement(client_w, px, py, *target, lam=0.2, steps=3)
    torch.testing.assert_close(model, expected, rtol=1e-10, atol=1e-12)
    assert np.isfinite(loss) and reg > 0
    # each way of getting it wrong lands far outside that tolerance
    wrong = {
        "client data instead of D_pub": _spec_refinement(client_w, cx, cy, *target, lam=0.2, steps=3),
        "global model instead of w_j": _spec_refinement(global_w, px, py, *target, lam=0.2, steps=3),
        "λ ignored": _spec_refinement(client_w, px, py, *target, lam=0.0, steps=3),
        "no refinement": client_w,
    }
    for what, w in wrong.items():
        assert (w - expected).abs().max() > 1e-3, what


def test_refine_minibatches_cover_the_public_set_once_per_epoch():
    ctx, (px, _), _, _, client_w, target = _refine_setup(batch_size=5)
    seen = []
    features = ctx.local.module.features

    def recording_features(x):
        seen.append(x.detach().clone())
        return features(x)

    ctx.local.module.features = recording_features
    FNRFL(lam=0.2, refine_epochs=2.0).refine(0, 1, client_w, ctx, target, torch.zeros(3, dtype=torch.float64))
    assert [b.shape[0] for b in seen] == [5, 5, 2, 5, 5]  # ⌈2·12/5⌉ = 5 steps of batches from D_pub
    public_rows = sorted(r.tolist() for r in px)
    assert sorted(r.tolist() for r in torch.cat(seen[:3])) == public_rows  # epoch 0: every public row once


def test_p_zero_is_exactly_fedavg():
    sim = Simulation(_config(p=0.0))
    fnr: FNRFL = sim.algorithm
    fnr.setup(sim, sim.initial_vector)
    stats = fnr.round(0, sim)
    avg = make_algorithm("fedavg")
    avg.setup(sim, sim.initial_vector)  # same clients, same batches
    avg.round(0, sim)
    assert torch.equal(avg.x, fnr.x)
    assert stats.extras["fnr_refined"] == 0.0


def test_lambda_zero_equals_literal_and_lambda_changes_the_model():
    models = {}
    for key, params in {
        "abs0": {"lam": 0.0, "reg_mode": "abs"},
        "literal": {"lam": 5.0, "reg_mode": "literal"},
        "abs": {"lam": 1.0, "reg_mode": "abs"},
    }.items():
        sim = Simulation(_config(**params))
        sim.run()
        models[key] = sim.algorithm.x.clone()
    torch.testing.assert_close(models["abs0"], models["literal"], rtol=0, atol=0)
    assert not torch.equal(models["abs"], models["abs0"])


def test_parameters_are_validated_and_reach_the_cli():
    from pyfedkern.cli import _algorithm_params

    params = _algorithm_params(["fnrfl"], {"lam": "0.1", "p": "0.2", "public_size": "10", "reg_mode": "sq"})["fnrfl"]
    algo = make_algorithm("fnrfl", **params)
    assert (algo.lam, algo.p, algo.public_size, algo.reg_mode, algo.public_per_class) == (0.1, 0.2, 10, "sq", 10)
    assert make_algorithm("fnrfl", **_algorithm_params(["fnrfl"], {"delta_rule": "authors"})["fnrfl"]).delta_rule == (
        "authors"
    )
    assert "ref_compat" not in FNRFL.hyperparameters()  # FL-Simulator's behaviours are no FNR-FL parameter
    bad_values = ({"p": 1.5}, {"lam": -1.0}, {"public_size": 0}, {"reg_mode": "linear"}, {"refine_epochs": -1.0},
                  {"delta_rule": "all"})  # fmt: skip
    for bad in bad_values:
        with pytest.raises(ValueError):
            FNRFL(**bad)


def test_missing_public_set_and_model_split_are_reported():
    algo = FNRFL()

    with pytest.raises(ValueError, match="public set"):
        algo.public_statistics(torch.zeros(1), FLContext())


def test_cli_accepts_the_short_p_option(tmp_path):
    from pyfedkern.cli import main

    argv = ["run", "--algorithm", "fnrfl", "--p", "0.5", "--lam", "0.1", "--public-size", "10", "--refine-epochs", "1"]
    argv += ["--dataset", "digits", "--model", "logreg", "--clients", "3", "--rounds", "1", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("batched", [False, True])
def test_refinement_dropout_depends_on_round_and_client_not_on_what_ran_before(batched):
    """With a dropout model (simple_cnn on digits), the server's refinement of a client draws its dropout masks
    from a stream of (round, client): the same refined model whatever torch's generator held before, another one
    for another round. Distributed rounds refine a client in whichever process trained it."""
    from pyfedkern.sim.engine import ExperimentConfig, Simulation

    config = ExperimentConfig(
        dataset="digits", model="simple_cnn", algorithm="fnrfl", algorithm_params={"public_size": 5}, clients=4,
        rounds=1, batch_size=16, dtype="float64", seed=3, batched=batched,
    )  # fmt: skip
    sim = Simulation(config)
    algo = sim.algorithm
    start = sim.initial_vector.clone()
    K = 10
    target = (torch.rand(K, dtype=torch.float64) + 1.0, torch.full((K,), 2.0, dtype=torch.float64))
    delta = torch.zeros(K, dtype=torch.float64)

    def refined(t, before_seed):
        torch.manual_seed(before_seed)
        if batched:
            rows = (target[0][None], target[1][None])
            return algo.batched_refine(t, np.array([1]), start[None], sim, rows, delta[None])[0][0]
        return algo.refine(t, 1, start, sim, target, delta)[0]

    first = refined(0, before_seed=1)
    assert torch.equal(refined(0, before_seed=2), first)
    assert not torch.equal(refined(1, before_seed=1), first)  # another round, other masks (and the same lr)
