"""``ref_compat``: every FedSpeed-paper baseline against a literal restatement of FL-Simulator's client and server code.

The literal side (``literal_run``) is written the way FL-Simulator's clients are: an ``nn.Module`` trained by
``torch.optim.SGD(weight_decay=...)``, the method's extra terms written into the loss as inner products with the
received vectors (−λ·⟨x, x^t⟩ for FedProx, ⟨x, c − c_i⟩ for SCAFFOLD, a·L + (1 − a)·⟨x, m⟩ for FedCM, λ·⟨x, h_i − x^t⟩
for FedDyn and FedSpeed), SAM steps that climb by ρ·g/(‖g‖ + 1e-7) and step back by subtraction,
``torch.nn.utils.clip_grad_norm_`` before every optimizer step, and the servers' plain means over the participants
with K = E·|D_0|/B. pyfedkern's flat-vector algorithms run the same rounds, per client and batched, in float64; the
clip threshold is set to the median gradient norm of an unclipped literal run, so that it fires on some steps and
not on others (checked). Clients hold unequal amounts of data that are not multiples of the batch size, so the
plain mean, the step count and the padded batched path all matter.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, parameters_to_vector, vector_to_parameters

from pyfedkern.algorithms import FLContext, LocalModel, make_algorithm

LAMB = 0.1  # FL-Simulator's prox weight (FedProx's μ, FedDyn's and FedSpeed's 1/λ)
RHO = 0.1
CM_ALPHA = 0.1  # FedCM's a
ADAM = dict(server_lr=0.1, beta1=0.9, beta2=0.99, eps=0.01)


class EpochContext(FLContext):
    """A FLContext whose clients pass over their data in epochs of shuffled minibatches of ``batch`` samples, the
    last one short (a DataLoader with shuffle=True); every client takes part in every round unless ``fraction``."""

    def __init__(self, sizes, *, batch=4, epochs=1.0, weight_decay=1e-2, lr0=0.1, decay=0.9, fraction=1.0, seed=0):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        dim, classes = 5, 3
        self.module = nn.Sequential(nn.Linear(dim, 6), nn.Tanh(), nn.Linear(6, classes)).double()
        self.local = LocalModel(self.module)
        self.x0 = self.local.flat.data.clone()
        self.samples = []
        for i, size in enumerate(sizes):
            features = 2.0 * torch.randn(size, dim, generator=gen, dtype=torch.float64) + i
            self.samples.append((features, torch.randint(0, classes, (size,), generator=gen)))
        self.num_clients, self.seed, self.fraction = len(sizes), seed, fraction
        self.client_sizes = np.asarray(sizes, dtype=np.int64)
        self.device = torch.device("cpu")
        self.batch_size, self.local_epochs, self.local_steps = batch, epochs, None
        self.momentum, self.weight_decay = 0.0, weight_decay
        self.lr0, self.decay = lr0, decay

    def lr(self, t: int) -> float:
        return self.lr0 * self.decay**t

    def batches(self, cid, t, *, epochs=None, steps=None, order="reshuffle", drop_last=False, batch_size=None):
        x, y = self.samples[cid]
        for e in range(math.ceil(epochs or self.local_epochs)):
            perm = torch.as_tensor(self.rng(2, t, cid, e).permutation(len(y)))
            for b in range(0, len(y), self.batch_size):
                idx = perm[b : b + self.batch_size]
                yield x[idx], y[idx]

    def sample_clients(self, t: int) -> np.ndarray:
        k = max(1, round(self.fraction * self.num_clients))
        return np.sort(self.rng(1, t).choice(self.num_clients, k, replace=False))

    def rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *keys])


# FL-Simulator, restated ----------------------------------------------------------------------------------------


def literal_client(method, ctx, start, cid, t, received, clip, norms):
    """One client's local epochs as FL-Simulator's client of ``method`` runs them; appends each step's gradient norm
    (before the clip) to ``norms``."""
    model = ctx.module
    params = list(model.parameters())
    vector_to_parameters(start.clone(), params)  # the parameters become views of the copy
    ce = nn.CrossEntropyLoss()
    decay = ctx.weight_decay + (LAMB if method in ("fedprox", "feddyn", "fedspeed") else 0.0)
    opt = torch.optim.SGD(params, lr=ctx.lr(t), weight_decay=decay)
    for xb, yb in ctx.batches(cid, t):
        opt.zero_grad()
        if method in ("fedsam", "fedspeed"):  # the SAM step: gradient at x, climb, gradient there, step back
            ce(model(xb), yb).backward()
            norm = torch.norm(torch.stack([p.grad.norm(2) for p in params]))
            climb = [p.grad * (RHO / (norm + 1e-7)) for p in params]
            with torch.no_grad():
                for p, e in zip(params, climb, strict=True):
                    p.add_(e)
            opt.zero_grad()
            ce(model(xb), yb).backward()
            with torch.no_grad():
                for p, e in zip(params, climb, strict=True):
                    p.sub_(e)
            if method == "fedspeed":
                (LAMB * torch.sum(parameters_to_vector(params) * received["dual"])).backward()
        else:
            loss = ce(model(xb), yb)
            x = parameters_to_vector(params)
            if method == "fedprox":
                loss = loss - LAMB * torch.sum(x * received["global"])
            elif method == "scaffold":
                loss = loss + torch.sum(x * received["control"])
            elif method == "fedcm":
                loss = CM_ALPHA * loss + (1 - CM_ALPHA) * torch.sum(x * received["momentum"])
            elif method == "feddyn":
                loss = loss + LAMB * torch.sum(x * received["dual"])
            loss.backward()
        norms.append(float(clip_grad_norm_(params, max_norm=clip)))
        opt.step()
    return parameters_to_vector(params).detach().clone()


def literal_run(method, ctx, rounds, clip, *, reference_server=True):
    """The global model after ``rounds`` rounds of FL-Simulator's server for ``method``, and every step's gradient
    norm. ``reference_server`` False: |D_i|-weighted means and K = the steps taken (pyfedkern without ref_compat)."""
    x = ctx.x0.clone()
    m, d = ctx.num_clients, x.numel()
    c, c_i = torch.zeros(d, dtype=x.dtype), torch.zeros(m, d, dtype=x.dtype)
    h = torch.zeros(m, d, dtype=x.dtype)
    momentum, adam_m, adam_v = (torch.zeros(d, dtype=x.dtype) for _ in range(3))
    norms: list[float] = []
    for t in range(rounds):
        lr, clients = ctx.lr(t), ctx.sample_clients(t)
        models, steps, delta_c = [], [], torch.zeros(d, dtype=x.dtype)
        for i in clients:
            received = {"global": x, "control": c - c_i[i], "momentum": momentum, "dual": h[i] - x}
            before = len(norms)
            xi = literal_client(method, ctx, x, int(i), t, received, clip, norms)
            steps.append(len(norms) - before)
            k = ctx.local_epochs * ctx.client_sizes[0] / ctx.batch_size if reference_server else steps[-1]
            if method == "scaffold":
                new_ci = c_i[i] - c - (xi - x) / (k * lr)
                delta_c += new_ci - c_i[i]
                c_i[i] = new_ci
            h[i] += xi - x
            models.append(xi)
        weights = np.ones(len(clients)) if reference_server else ctx.client_sizes[clients].astype(np.float64)
        weights = torch.as_tensor(weights / weights.sum())
        update = (weights[:, None] * torch.stack(models)).sum(0) - x
        if method in ("feddyn", "fedspeed"):
            x = torch.stack(models).mean(0) + h.mean(0)
        elif method == "fedadam":
            adam_m = ADAM["beta1"] * adam_m + (1 - ADAM["beta1"]) * update
            adam_v = ADAM["beta2"] * adam_v + (1 - ADAM["beta2"]) * update**2
            x = x + ADAM["server_lr"] * adam_m / (adam_v.sqrt() + ADAM["eps"])
        else:
            x = x + update
        if method == "scaffold":
            c = c + delta_c / m
        if method == "fedcm":
            k = ctx.local_epochs * ctx.client_sizes[0] / ctx.batch_size if reference_server else float(np.mean(steps))
            momentum = -update / (k * lr)
    return x, norms


# pyfedkern -----------------------------------------------------------------------------------------------------

PARAMS = {
    "fedavg": {},
    "fedprox": {"mu": LAMB},
    "scaffold": {},
    "fedsam": {"rho": RHO},
    "fedcm": {"client_momentum": CM_ALPHA},
    "fedadam": ADAM,
    "feddyn": {"lam": 1 / LAMB},
    "fedspeed": {"lam": 1 / LAMB, "rho": RHO, "alpha": 1.0, "corr_avg": "all"},
}
SIZES = (13, 10, 7, 11)  # 4, 3, 2 and 3 steps of batch 4: not multiples of it, K = E·|D_0|/B = 3.25


def pyfedkern_run(method, ctx, rounds, batched, **params):
    ctx.batched = batched
    algorithm = make_algorithm(method, **PARAMS[method], **params)
    algorithm.setup(ctx, ctx.x0)
    for t in range(rounds):
        algorithm.round(t, ctx)
    return algorithm.x


@pytest.mark.parametrize("method", list(PARAMS))
def test_ref_compat_equals_fl_simulator(method):
    rounds = 2
    _, free_norms = literal_run(method, EpochContext(SIZES), rounds, clip=math.inf)
    clip = float(np.median(free_norms))
    expected, norms = literal_run(method, EpochContext(SIZES), rounds, clip=clip)
    fired = sum(n > clip for n in norms)
    assert 0 < fired < len(norms), (fired, len(norms))  # the clip acts on some steps, not on all
    for batched in (False, True):
        x = pyfedkern_run(method, EpochContext(SIZES), rounds, batched, ref_compat=True, clip_norm=clip)
        torch.testing.assert_close(x, expected, rtol=1e-10, atol=1e-12, msg=f"{method}, batched={batched}")
    # the clip, the plain mean and the step count are what ref_compat changes: without it the rounds differ
    plain = pyfedkern_run(method, EpochContext(SIZES), rounds, False)
    assert (plain - expected).abs().max() > 1e-6


@pytest.mark.parametrize("batched", [False, True])
def test_fedcm_weight_decay_is_outside_the_momentum_mix(batched):
    """FedCM's direction a·g + (1 − a)·m + wd·x (FL-Simulator's loss a·L + (1 − a)·⟨x, m⟩ under SGD weight decay),
    not a·(g + wd·x) + (1 − a)·m: equal client sizes (so |D_i| weights and the steps taken agree with the reference
    server), no clip, two rounds."""
    sizes = (12, 12, 12, 12)
    expected, _ = literal_run("fedcm", EpochContext(sizes, weight_decay=5e-2), 2, clip=math.inf)
    x = pyfedkern_run("fedcm", EpochContext(sizes, weight_decay=5e-2), 2, batched)
    torch.testing.assert_close(x, expected, rtol=1e-10, atol=1e-12)
    no_decay, _ = literal_run("fedcm", EpochContext(sizes, weight_decay=0.0), 2, clip=math.inf)
    assert (no_decay - expected).abs().max() > 1e-5  # the weight decay matters at this size


@pytest.mark.parametrize("method", ["scaffold", "fedcm"])
def test_without_ref_compat_the_steps_taken_and_size_weights_are_used(method):
    """pyfedkern's own rules (|D_i|-weighted means, K = the steps each client took) against the literal code with
    those two rules swapped in, so the difference ref_compat makes is exactly the clip, the mean and K."""
    expected, _ = literal_run(method, EpochContext(SIZES), 2, clip=math.inf, reference_server=False)
    for batched in (False, True):
        x = pyfedkern_run(method, EpochContext(SIZES), 2, batched)
        torch.testing.assert_close(x, expected, rtol=1e-10, atol=1e-12)


def test_ref_compat_has_a_valid_clip_norm():
    for method in ("fedavg", "scaffold", "fedcm", "fedsam", "fedadam", "fedprox"):
        with pytest.raises(ValueError, match="clip_norm"):
            make_algorithm(method, ref_compat=True, clip_norm=0.0)
