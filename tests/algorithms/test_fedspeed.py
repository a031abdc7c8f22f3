"""FedSpeed and its baselines: the closed-form oracles of docs/fedspeed.md §3, equality with a literal Algorithm 1,
the special cases (ρ = 0 + reference switches = FedDyn, perturbation alone = FedSAM, prox alone = FedProx, nothing =
FedAvg), the user-loop optimizer, bad input, exact resume, and short end-to-end runs through the simulation engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from pyfedkern.algorithms import FLContext, LocalModel, algorithm_class, make_algorithm
from pyfedkern.algorithms.fedavg import FedAvg, FedProx
from pyfedkern.algorithms.fedspeed import FedSpeed, FedSpeedOptimizer
from pyfedkern.algorithms.fedspeed_baselines import FedAdam, FedCM, FedDyn, FedSAM


class ToyContext(FLContext):
    """A deterministic FLContext: m clients (n samples each, or ``sizes``) with shifted Gaussian features, a small
    float64 MLP. ``client_sizes`` (the aggregation weights |D_i|) may be overwritten without changing the data."""

    def __init__(self, *, num_clients=5, n=24, dim=5, classes=3, batch=8, steps=3, weight_decay=0.0, fraction=0.6,
                 lr0=0.1, decay=0.9, seed=0, momentum=0.0, sizes=None):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(dim, 6), nn.Tanh(), nn.Linear(6, classes)).double()
        self.local = LocalModel(module)
        self.x0 = self.local.flat.data.clone()
        sizes = [n] * num_clients if sizes is None else list(sizes)
        self.samples = []
        for i, size in enumerate(sizes):
            features = torch.randn(size, dim, generator=gen, dtype=torch.float64) + 0.5 * i
            self.samples.append((features, torch.randint(0, classes, (size,), generator=gen)))
        self.num_clients, self.batch, self.seed = len(sizes), batch, seed
        self.client_sizes = np.asarray(sizes, dtype=np.int64)
        self.device = torch.device("cpu")
        self.batch_size, self.local_epochs, self.local_steps = batch, 1.0, steps
        self.momentum, self.weight_decay = momentum, weight_decay
        self.fraction, self.lr0, self.decay = fraction, lr0, decay

    def lr(self, t: int) -> float:
        return self.lr0 * self.decay**t

    def batches(self, cid, t, *, epochs=None, steps=None, order="reshuffle", drop_last=False, batch_size=None):
        rng = self.rng(2, t, cid)
        x, y = self.samples[cid]
        for _ in range(steps or self.local_steps):
            idx = torch.as_tensor(rng.choice(len(y), self.batch, replace=False))
            yield x[idx], y[idx]

    def sample_clients(self, t: int) -> np.ndarray:
        k = max(1, round(self.fraction * self.num_clients))
        return np.sort(self.rng(1, t).choice(self.num_clients, k, replace=False))

    def rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *keys])


def run(algorithm, ctx: ToyContext, rounds: int) -> torch.Tensor:
    algorithm.setup(ctx, ctx.x0)
    for t in range(rounds):
        algorithm.round(t, ctx)
    return algorithm.x


def grad_at(local: LocalModel, vector: torch.Tensor, xb, yb) -> torch.Tensor:
    local.load_(vector)
    local.loss_and_grad(xb, yb)
    return local.flat.grad.clone()


def algorithm_one(ctx: ToyContext, rounds: int, *, lam, rho, alpha, eps=1e-7, corr_avg="active"):
    """Algorithm 1 of the paper literally (ĝ form, normalised ρ, plus wd·x), with plain torch."""
    x = ctx.x0.clone()
    m, d = ctx.num_clients, x.numel()
    g_hat = torch.zeros(m, d, dtype=x.dtype)
    wd = ctx.weight_decay
    for t in range(rounds):
        clients = ctx.sample_clients(t)
        eta = ctx.lr(t)
        uploads, finals = [], []
        for i in clients:
            xi = x.clone()
            for xb, yb in ctx.batches(int(i), t):
                g1 = grad_at(ctx.local, xi, xb, yb)
                g2 = grad_at(ctx.local, xi + rho / (g1.norm() + eps) * g1, xb, yb)
                g_tilde = (1 - alpha) * g1 + alpha * g2
                xi = xi - eta * (g_tilde - g_hat[i] + (xi - x) / lam + wd * xi)
            g_hat[i] = g_hat[i] - (xi - x) / lam
            uploads.append(xi - lam * g_hat[i])
            finals.append(xi)
        if corr_avg == "active":
            x = torch.stack(uploads).mean(0)
        else:
            x = torch.stack(finals).mean(0) + (-lam * g_hat).mean(0)
    return x, g_hat


# the oracles of docs/fedspeed.md §3 ---------------------------------------------------------------------


@pytest.mark.parametrize(("alpha", "rho"), [(1.0, 0.05), (0.6, 0.2), (1.0, 0.0)])
def test_closed_form_oracles_for_x_and_g_hat(alpha, rho):
    """x_K − x^t = −λΣγ_k g̃_k + γλĝ^{t−1} and ĝ^t = (1−γ)ĝ^{t−1} + Σγ_k g̃_k (η constant, no weight decay)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    lam, eta, K = 4.0, 0.3, 6
    opt = FedSpeedOptimizer(model.parameters(), lr=eta, rho=rho, alpha=alpha, lam=lam)
    x_data, y_data = torch.randn(40, 4, dtype=torch.float64), torch.randint(0, 2, (40,))
    beta = eta / lam
    gamma_k = [beta * (1 - beta) ** (K - 1 - k) for k in range(K)]
    gamma = 1 - (1 - beta) ** K
    assert abs(sum(gamma_k) - gamma) < 1e-14
    for round_index in range(3):
        g_hat_before = -opt.h.clone() / lam
        x_t = opt.flat_params.clone()
        opt.begin_round()
        g_tildes = []
        for k in range(K):
            xb, yb = x_data[k * 6 : k * 6 + 6], y_data[k * 6 : k * 6 + 6]
            grads = []

            def closure(xb=xb, yb=yb, grads=grads):
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
                return loss

            opt.step(closure)
            g1, g2 = grads[0], grads[-1]
            assert len(grads) == (2 if rho > 0 else 1)
            g_tildes.append((1 - alpha) * g1 + alpha * g2)
        opt.end_round()
        weighted = sum(gk * g for gk, g in zip(gamma_k, g_tildes, strict=True))
        expected_change = -lam * weighted + gamma * lam * g_hat_before
        assert torch.allclose(opt.flat_params - x_t, expected_change, rtol=1e-11, atol=1e-13), round_index
        g_hat_after = -opt.h / lam
        assert torch.allclose(g_hat_after, (1 - gamma) * g_hat_before + weighted, rtol=1e-11, atol=1e-13)
        if round_index == 0:
            assert torch.count_nonzero(g_hat_before) == 0


@pytest.mark.parametrize("corr_avg", ["active", "all"])
@pytest.mark.parametrize(("alpha", "rho", "wd"), [(1.0, 0.1, 0.0), (0.9375, 0.05, 1e-3)])
def test_fedspeed_equals_literal_algorithm_one(corr_avg, alpha, rho, wd):
    lam = 5.0
    expected_x, expected_g_hat = algorithm_one(
        ToyContext(weight_decay=wd), 4, lam=lam, rho=rho, alpha=alpha, corr_avg=corr_avg
    )
    algo = FedSpeed(lam=lam, rho=rho, alpha=alpha, corr_avg=corr_avg)
    x = run(algo, ToyContext(weight_decay=wd), 4)
    assert torch.allclose(x, expected_x, rtol=1e-10, atol=1e-12)
    assert torch.allclose(-algo.h_store.data / lam, expected_g_hat, rtol=1e-10, atol=1e-12)
    never_active = torch.count_nonzero(expected_g_hat, dim=1) == 0
    assert torch.all(algo.h_store.data[never_active] == 0)


# special cases equal the baselines -----------------------------------------------------------------------


@pytest.mark.parametrize(("ref_compat", "clip_norm"), [(True, 10.0), (True, 0.05), (False, 10.0)])
def test_rho_zero_with_reference_switches_equals_feddyn(ref_compat, clip_norm):
    ctx_kwargs = dict(weight_decay=1e-3, lr0=0.2)
    speed = FedSpeed(lam=2.0, rho=0.0, ref_compat=ref_compat, clip_norm=clip_norm, corr_avg="all")
    dyn = FedDyn(lam=2.0, ref_compat=ref_compat, clip_norm=clip_norm)
    x_speed = run(speed, ToyContext(**ctx_kwargs), 4)
    x_dyn = run(dyn, ToyContext(**ctx_kwargs), 4)
    assert torch.allclose(x_speed, x_dyn, rtol=1e-10, atol=1e-12)
    assert torch.allclose(speed.h_store.data, dyn.h_store.data, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(x_speed, run(FedAvg(), ToyContext(**ctx_kwargs), 4), atol=1e-6)


def test_clipping_is_active_in_the_small_clip_case():
    ctx = ToyContext(weight_decay=1e-3, lr0=0.2)
    clipped = run(FedSpeed(lam=2.0, rho=0.0, ref_compat=True, clip_norm=0.05, corr_avg="all"), ctx, 2)
    plain = run(FedSpeed(lam=2.0, rho=0.0, corr_avg="all"), ToyContext(weight_decay=1e-3, lr0=0.2), 2)
    assert not torch.allclose(clipped, plain, atol=1e-6)


def test_perturbation_alone_equals_fedsam():
    speed = FedSpeed(rho=0.2, use_prox=False, use_correction=False, use_perturb=True)
    x_speed = run(speed, ToyContext(weight_decay=1e-3), 4)
    x_sam = run(FedSAM(rho=0.2), ToyContext(weight_decay=1e-3), 4)
    assert torch.allclose(x_speed, x_sam, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(x_speed, run(FedAvg(), ToyContext(weight_decay=1e-3), 4), atol=1e-6)


def test_prox_alone_equals_fedprox_and_nothing_equals_fedavg():
    prox = run(FedSpeed(lam=4.0, use_correction=False, use_perturb=False), ToyContext(weight_decay=1e-3), 3)
    assert torch.allclose(prox, run(FedProx(mu=0.25), ToyContext(weight_decay=1e-3), 3), rtol=1e-10, atol=1e-12)
    plain = FedSpeed(use_prox=False, use_correction=False, use_perturb=False)
    assert torch.allclose(run(plain, ToyContext(), 3), run(FedAvg(), ToyContext(), 3), rtol=1e-10, atol=1e-12)


def test_unequal_client_sizes_fedspeed_and_feddyn_take_the_plain_mean():
    """With unequal |D_i| FedSpeed's server (Algorithm 1) and FedDyn take the plain 1/S mean, while FedAvg, FedProx and
    FedSAM weight by |D_i|: FedSpeed's special cases then equal those baselines with equal weights, not as they are."""
    sizes = [8, 40, 12, 60, 20]

    def ctx(equal_weights=False):
        context = ToyContext(sizes=sizes, weight_decay=1e-3)
        if equal_weights:  # same data, aggregation weights |D_i| replaced by 1
            context.client_sizes = np.ones(len(sizes), dtype=np.int64)
        return context

    cases = [
        (FedSpeed(rho=0.2, use_prox=False, use_correction=False), lambda: FedSAM(rho=0.2)),
        (FedSpeed(lam=4.0, use_correction=False, use_perturb=False), lambda: FedProx(mu=0.25)),
        (FedSpeed(use_prox=False, use_correction=False, use_perturb=False), FedAvg),
    ]
    for speed, baseline in cases:
        x_speed = run(speed, ctx(), 3)
        assert torch.allclose(x_speed, run(baseline(), ctx(equal_weights=True), 3), rtol=1e-10, atol=1e-12)
        assert not torch.allclose(x_speed, run(baseline(), ctx(), 3), atol=1e-6), type(baseline())
    x_speed = run(FedSpeed(lam=2.0, rho=0.0, corr_avg="all"), ctx(), 3)
    assert torch.allclose(x_speed, run(FedDyn(lam=2.0), ctx(), 3), rtol=1e-10, atol=1e-12)


def test_round_loss_is_the_mean_of_the_step_losses():
    """The round's local_loss is the exact mean over clients of each client's mean step loss at x (the losses at the
    perturbed points x̆ not counted)."""
    algo = FedSpeed(lam=4.0, rho=0.1)
    ctx = ToyContext(weight_decay=1e-3)
    ctx.batched = False  # one client at a time on ctx.local, spied on (batched: tests/sim/test_batched_engine.py)
    algo.setup(ctx, ctx.x0)
    seen = []
    loss_and_grad = ctx.local.loss_and_grad

    def recording(xb, yb):
        loss = loss_and_grad(xb, yb)
        seen.append(loss)
        return loss

    ctx.local.loss_and_grad = recording
    stats = algo.round(0, ctx)
    k = ctx.local_steps
    assert len(seen) == 2 * k * len(stats.clients)  # at x, then at x̆
    at_x = seen[0::2]
    per_client = [sum(at_x[i : i + k]) / k for i in range(0, len(at_x), k)]
    assert stats.local_loss == float(np.mean(per_client))


# the optimizer in a user's loop --------------------------------------------------------------------------


def test_optimizer_on_plain_module_equals_flat_module_and_handles_reset_grads():
    torch.manual_seed(3)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    flat = LocalModel(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    flat.load_(torch.cat([p.detach().reshape(-1) for p in plain.parameters()]))
    data = [(torch.randn(8, 3), torch.randint(0, 2, (8,))) for _ in range(4)]
    results = []
    for module, reset in ((plain, True), (flat.module, False)):
        opt = FedSpeedOptimizer(module.parameters(), lr=0.1, rho=0.05, alpha=0.5, lam=10.0, weight_decay=1e-3)
        for _ in range(2):
            opt.begin_round()
            for xb, yb in data:

                def closure(xb=xb, yb=yb, module=module, reset=reset):
                    if reset:
                        module.zero_grad(set_to_none=True)  # autograd then writes fresh .grad tensors
                    loss = nn.functional.cross_entropy(module(xb), yb)
                    loss.backward()
                    return loss

                loss = opt.step(closure)
                assert torch.isfinite(loss)
            upload = opt.end_round()
        results.append((opt.flat_params.clone(), upload))
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)
    assert flat.flat.data.data_ptr() == FedSpeedOptimizer(flat.module.parameters(), lr=0.1).flat_params.data_ptr()
    params = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    assert torch.equal(params, results[0][0]), "the module's parameters are views of the optimizer's buffer"


def test_optimizer_zero_gradient_is_defined():
    p = nn.Parameter(torch.ones(5))
    opt = FedSpeedOptimizer([p], lr=0.1, rho=0.1, eps=0.0, lam=2.0)

    def closure():
        loss = (p * 0).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert torch.all(torch.isfinite(p)) and torch.allclose(p.detach(), torch.ones(5))  # prox anchor = x^t, D = −x
    opt2 = FedSpeedOptimizer([nn.Parameter(torch.ones(3))], lr=0.1, rho=0.0)
    with pytest.raises(ValueError, match="needs a closure"):
        FedSpeedOptimizer([nn.Parameter(torch.ones(3))], lr=0.1, rho=0.1).step()
    opt2.param_groups[0]["params"][0].grad = torch.full((3,), 2.0)
    opt2.step()
    assert torch.allclose(opt2.flat_params, torch.full((3,), 0.8))


def test_optimizer_state_dict_round_trip():
    torch.manual_seed(5)
    model = nn.Linear(3, 2)
    opt = FedSpeedOptimizer(model.parameters(), lr=0.1, rho=0.1, lam=5.0)
    xb, yb = torch.randn(6, 3), torch.randint(0, 2, (6,))

    def closure():
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        return loss

    opt.begin_round()
    opt.step(closure)
    opt.end_round()
    state = opt.state_dict()
    model2 = nn.Linear(3, 2)
    model2.load_state_dict(model.state_dict())
    opt2 = FedSpeedOptimizer(model2.parameters(), lr=0.1, rho=0.1, lam=5.0)
    opt2.load_state_dict(state)
    assert torch.equal(opt2.h, opt.h) and torch.count_nonzero(opt.h) > 0


def test_optimizer_steps_with_the_hyperparameters_of_a_loaded_state_dict():
    """load_state_dict() replaces the param group: the step reads the loaded lr (0 here, so x does not move)."""
    torch.manual_seed(5)
    model = nn.Linear(3, 2)
    opt = FedSpeedOptimizer(model.parameters(), lr=0.1, rho=0.1, lam=5.0)
    state = opt.state_dict()
    state["param_groups"][0]["lr"] = 0.0
    opt.load_state_dict(state)
    x0 = opt.flat_params.clone()
    xb, yb = torch.randn(6, 3), torch.randint(0, 2, (6,))

    def closure():
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        return loss

    opt.step(closure)
    assert opt.param_groups[0]["lr"] == 0.0
    assert torch.equal(opt.flat_params, x0)


# bad input -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (dict(lam=0.0), "lam"),
        (dict(lam=-1.0), "lam"),
        (dict(lam=float("inf")), "lam"),
        (dict(rho=-0.1), "rho"),
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=-0.01), "alpha"),
        (dict(eps=-1.0), "eps"),
        (dict(rho_mode="sqrt"), "rho_mode"),
        (dict(corr_avg="some"), "corr_avg"),
        (dict(use_prox=False), "use_correction needs use_prox"),
        (dict(clip_norm=0.0), "clip_norm"),
    ],
)
def test_fedspeed_bad_input(params, match):
    with pytest.raises(ValueError, match=match):
        FedSpeed(**params)
    with pytest.raises(ValueError, match=match):
        make_algorithm("fedspeed", **params)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [(dict(lam=0.0), "lam"), (dict(rho=-1.0), "rho"), (dict(alpha=2.0), "alpha"), (dict(lr=-0.1), "lr")],
)
def test_optimizer_bad_input(kwargs, match):
    args = dict(lr=0.1) | kwargs
    with pytest.raises(ValueError, match=match):
        FedSpeedOptimizer([nn.Parameter(torch.ones(3))], **args)


def test_baselines_bad_input_and_momentum():
    for cls, params, match in [
        (FedDyn, dict(lam=0.0), "lam"),
        (FedSAM, dict(rho=-1.0), "rho"),
        (FedCM, dict(client_momentum=0.0), "client_momentum"),
        (FedAdam, dict(beta1=1.0), "beta1"),
    ]:
        with pytest.raises(ValueError, match=match):
            cls(**params)
    with pytest.raises(ValueError, match="momentum"):
        FedSpeed().setup(ToyContext(momentum=0.9), ToyContext().x0)


# state and the registry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fedspeed", "feddyn", "fedsam", "fedcm", "fedadam"])
def test_resume_is_exact(name):
    params = {"fedspeed": dict(corr_avg="all", alpha=0.5)}.get(name, {})
    ctx = ToyContext(weight_decay=1e-3)
    first = make_algorithm(name, **params)
    run(first, ctx, 2)
    saved = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in first.state_dict().items()}
    first.round(2, ctx)
    second = make_algorithm(name, **params)
    ctx2 = ToyContext(weight_decay=1e-3)
    second.setup(ctx2, ctx2.x0)
    second.load_state_dict(saved)
    second.round(2, ctx2)
    assert torch.equal(first.x, second.x)


def test_registry_names():
    for name, cls in [("fedspeed", FedSpeed), ("feddyn", FedDyn), ("fedsam", FedSAM), ("fedcm", FedCM),
                      ("fedadam", FedAdam)]:  # fmt: skip
        assert algorithm_class(name) is cls and cls.name == name


def test_fedadam_and_fedcm_server_rules():
    ctx = ToyContext()
    adam = FedAdam(server_lr=0.1, beta1=0.9, beta2=0.99, eps=1e-3)
    adam.setup(ctx, ctx.x0)
    x0 = adam.x.clone()
    adam.round(0, ctx)
    # after one round m = 0.1Δ and v = 0.01Δ², so the step is 0.1·0.1Δ/(0.1|Δ| + 1e-3)
    avg = FedAvg()
    ctx_avg = ToyContext()
    avg.setup(ctx_avg, ctx_avg.x0)
    avg.round(0, ctx_avg)
    delta = avg.x - x0
    assert torch.allclose(adam.x - x0, 0.01 * delta / (0.1 * delta.abs() + 1e-3), rtol=1e-9, atol=1e-12)
    cm = FedCM(client_momentum=1.0)
    assert torch.allclose(run(cm, ToyContext(), 3), run(FedAvg(), ToyContext(), 3), rtol=1e-12, atol=1e-14)
    cm = FedCM(client_momentum=0.1)
    cm_delta = run(cm, ToyContext(), 1) - x0
    assert torch.allclose(cm.momentum, -cm_delta / (ToyContext().local_steps * ToyContext().lr(0)), rtol=1e-9)


# end to end through the engine ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fedspeed", "feddyn", "fedsam", "fedcm", "fedadam"])
def test_simulation_runs(name, tmp_path):
    from pyfedkern.sim.config import ExperimentConfig
    from pyfedkern.sim.engine import Simulation

    params = {"fedspeed": dict(lam=10.0, rho=0.1, alpha=0.9375)}.get(name, {})
    cfg = ExperimentConfig(algorithm=name, algorithm_params=params, dataset="digits", model="logreg", clients=4,
                           rounds=2, fraction=0.5, local_steps=3, lr=0.1, weight_decay=1e-3,
                           partition="dirichlet:0.6", eval_train_max=200)  # fmt: skip
    metrics = Simulation(cfg).run(tmp_path)
    assert len(metrics) == 3 and all(np.isfinite(m["test_acc"]) for m in metrics)
    assert metrics[-1]["bytes_up"] > 0
