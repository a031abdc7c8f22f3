"""Benchmark cases of the FedPBC server ops over a [m, d] float32 store of client models (m = 100).

- ``pbc_agg_bcast``: pyfedkern's one-pass postponed broadcast vs the torch idiom (index the active rows, mean,
  write back) and a torch loop over per-client tensors; limit: a copy of k rows ((2k)·d floats of traffic, the op
  needs (2k+1)·d).
- ``weighted_delta``: x += (η_g/D)·Σ_A w_i(Y_i − x) vs the torch idiom and the loop; limit: a copy of k rows.
- ``mifa``: the running-sum update vs the idiom that rewrites the memory rows and re-sums all m of them, and a torch
  loop over per-client memory tensors keeping the same running sum.

Sizes: the paper's CNNs, d = 273,706 (SVHN), 551,786 (CIFAR-10), 1,193,130 (CINIC-10), with k ∈ {5, 10, 50}.

- ``fedpbc_round``: one engine round of FedPBC (every client trains s = 5 steps of batch 16, then the postponed
  broadcast) on digits with the MLP, m = 100 clients (quick: 20), one CPU thread as the engine uses for small models:
  batched local training ("pyfedkern": one step for all clients, batches gathered at once) vs the per-client
  loop (the engine's ``batched=False``). Both compute the same round. Limit: the round's matrix products (each
  Linear layer's forward, weight gradient and input gradient over all the clients' batches) as plain GEMMs on one
  shared model.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

M = 100
FULL_SIZES = [(k, d) for d in (273_706, 551_786, 1_193_130) for k in (5, 10, 50)]
QUICK_SIZES = [(5, 50_000), (10, 20_000)]
ROUND_CLIENTS, QUICK_ROUND_CLIENTS = 100, 20
SCALE = 1.0 / M  # η_g/m of FedAvg-all / known-p


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """Groups per (k, d) on ``device`` ("cpu" or "cuda") for the three ops."""
    cache = InputCache()
    out: list[Case] = []
    m = 20 if quick else M
    for k, d in QUICK_SIZES if quick else FULL_SIZES:

        def inputs(k: int = k, d: int = d) -> dict:
            def build() -> dict:
                gen = torch.Generator().manual_seed(0)
                store = torch.randn(m, d, generator=gen).to(device)
                active = np.sort(np.random.default_rng(0).choice(m, size=k, replace=False))
                w = np.random.default_rng(1).random(k) + 0.5
                return {
                    "store": store,
                    "clients": list(store.unbind(0)),  # one tensor per client, as FL code keeps them
                    "x": torch.randn(d, generator=gen).to(device),
                    "acc": torch.empty(d, device=device),
                    "active": active,
                    "active_t": torch.as_tensor(active, device=device),
                    "w": w,
                    "w_t": torch.as_tensor(w, dtype=torch.float32, device=device),
                    "copy": torch.empty(k, d, device=device),
                    "memory": torch.zeros(m, d, device=device),
                    "total": torch.zeros(d, device=device),
                    "updates": torch.randn(k, d, generator=gen).to(device),
                }

            return cache.get((k, d, device), build)

        size = f"m={m} k={k} d={fmt_size(d)} float32 {device}"
        limit_bytes = 2 * k * d * 4

        def limit_copy(inputs=inputs, k=k):
            a = inputs()
            return lambda: a["copy"].copy_(a["store"][:k])

        # postponed broadcast --------------------------------------------------------------------------------
        group = f"pbc_agg_bcast {size}"

        def agg_ours(inputs=inputs):
            a = inputs()
            return lambda: ops.pbc_agg_bcast_(a["store"], a["x"], a["active"])

        def agg_idiom(inputs=inputs):
            a = inputs()
            store, x, idx = a["store"], a["x"], a["active_t"]

            def run():
                x.copy_(store[idx].mean(0))
                store[idx] = x
                return x

            return run

        def agg_loop(inputs=inputs):
            a = inputs()
            clients, x, idx = a["clients"], a["x"], [int(i) for i in a["active"]]

            def run():
                x.zero_()
                for i in idx:
                    x.add_(clients[i])
                x.div_(len(idx))
                for i in idx:
                    clients[i].copy_(x)
                return x

            return run

        nbytes = (2 * k + 1) * d * 4
        out += [
            Case(group, "pyfedkern", agg_ours, nbytes, k * d, device),
            Case(group, "torch-idiom X[A].mean(0); X[A] = x", agg_idiom, nbytes, k * d, device),
            Case(group, "torch loop over client tensors", agg_loop, nbytes, k * d, device),
            Case(group, "limit:copy", limit_copy, limit_bytes, 0, device),
        ]

        # weighted delta -------------------------------------------------------------------------------------
        group = f"weighted_delta {size}"

        def wd_ours(inputs=inputs):
            a = inputs()
            return lambda: ops.weighted_delta_(a["x"], a["store"], a["w"], SCALE, rows=a["active"])

        def wd_idiom(inputs=inputs):
            a = inputs()
            store, x, idx, w = a["store"], a["x"], a["active_t"], a["w_t"]
            return lambda: x.add_(((store[idx] - x) * w[:, None]).sum(0), alpha=SCALE)

        def wd_loop(inputs=inputs):
            a = inputs()
            clients, x, acc = a["clients"], a["x"], a["acc"]
            pairs = [(int(i), float(w)) for i, w in zip(a["active"], a["w"], strict=True)]

            def run():
                acc.zero_()
                for i, w in pairs:
                    acc.add_(clients[i] - x, alpha=w)
                return x.add_(acc, alpha=SCALE)

            return run

        nbytes = (k + 2) * d * 4
        out += [
            Case(group, "pyfedkern", wd_ours, nbytes, 3 * k * d, device),
            Case(group, "torch-idiom x += s*((X[A]-x)*w).sum(0)", wd_idiom, nbytes, 3 * k * d, device),
            Case(group, "torch loop over client tensors", wd_loop, nbytes, 3 * k * d, device),
            Case(group, "limit:copy", limit_copy, limit_bytes, 0, device),
        ]

        # MIFA -----------------------------------------------------------------------------------------------
        group = f"mifa_update {size}"

        def mifa_ours(inputs=inputs):
            a = inputs()
            return lambda: ops.mifa_update_(a["x"], a["memory"], a["total"], a["updates"], a["active"], 1.0)

        def mifa_idiom(inputs=inputs):
            a = inputs()
            memory, x, idx, upd = a["memory"], a["x"], a["active_t"], a["updates"]

            def run():
                memory[idx] = upd - x
                return x.add_(memory.sum(0), alpha=1.0 / memory.shape[0])

            return run

        def mifa_loop(inputs=inputs):
            a = inputs()
            memory, total, x = list(a["memory"].unbind(0)), a["total"], a["x"]
            pairs = [(int(i), u) for i, u in zip(a["active"], a["updates"].unbind(0), strict=True)]
            m = len(memory)

            def run():
                for i, u in pairs:
                    delta = u - x
                    total.add_(delta).sub_(memory[i])
                    memory[i].copy_(delta)
                return x.add_(total, alpha=1.0 / m)

            return run

        nbytes = (3 * k + 4) * d * 4
        out += [
            Case(group, "pyfedkern", mifa_ours, nbytes, 3 * k * d, device),
            Case(group, "torch-idiom U[A] = Y-x; x += U.sum(0)/m", mifa_idiom, nbytes, 3 * k * d, device),
            Case(group, "torch loop over client tensors (running sum)", mifa_loop, nbytes, 3 * k * d, device),
            Case(group, "limit:copy", limit_copy, limit_bytes, 0, device),
        ]
    return out + round_cases(ROUND_CLIENTS if not quick else QUICK_ROUND_CLIENTS, device)


def round_cases(clients: int, device: str) -> list[Case]:
    """FedPBC engine rounds on digits/MLP with ``clients`` clients: batched vs the per-client loop, and the
    round's matrix products as plain GEMMs (limit)."""
    from pyfedkern.sim.config import ExperimentConfig
    from pyfedkern.sim.engine import Simulation, _cpu_threads

    group = f"fedpbc_round m={clients} digits mlp s=5 B=16 float32 {device}"
    config = ExperimentConfig(
        algorithm="fedpbc",
        algorithm_params={"links": "bernoulli"},
        dataset="digits",
        partition="dirichlet-equal:0.1",
        clients=clients,
        model="mlp",
        batch_size=16,
        local_steps=5,
        lr=0.05,
        lr_schedule="invsqrt:10",
        device=device,
    )

    def make(batched: bool):
        def build():
            sim = Simulation(replace(config, batched=batched))
            algo = sim.algorithm
            algo.setup(sim, sim.initial_vector)
            rounds = itertools.count()

            def run():
                with _cpu_threads(1):
                    algo.round(next(rounds), sim)
                return algo.clients.data

            return run

        return build

    # The round's products: per step, every Linear layer's forward, weight gradient and (but the first) input
    # gradient over all clients' padded batches of that step.
    sim = Simulation(config)
    layers = [(m.in_features, m.out_features) for m in sim.local.module.modules() if isinstance(m, torch.nn.Linear)]
    samples = [
        xb.shape[0] * xb.shape[1] for xb, _, _ in sim.stacked_batches(range(clients), 0, steps=config.local_steps)
    ]
    per_sample = sum(2 * i * o * (2 if j == 0 else 3) for j, (i, o) in enumerate(layers))
    flops = sum(samples) * per_sample

    def limit_gemm():
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(o, i, generator=gen).to(device) for i, o in layers]
        acts = [[torch.randn(n, i, generator=gen).to(device) for i, _ in layers] for n in samples]
        grads = [[torch.randn(n, o, generator=gen).to(device) for _, o in layers] for n in samples]

        def run():
            with _cpu_threads(1):
                for h, dz in zip(acts, grads, strict=True):
                    for j, w in enumerate(weights):
                        torch.mm(h[j], w.T)
                        torch.mm(dz[j].T, h[j])
                        if j:
                            torch.mm(dz[j], w)
            return weights

        return run

    return [
        Case(group, "pyfedkern", make(True), 0, flops, device),
        Case(group, "per-client loop (batched=False)", make(False), 0, flops, device),
        Case(group, "limit:gemm (the round's products, one shared model)", limit_gemm, 0, flops, device),
    ]
