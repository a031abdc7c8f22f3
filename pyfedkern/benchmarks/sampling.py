"""Benchmark cases of the seeded permutations and Poisson masks (the simulation engine's minibatches), CPU only.

- ``seeded_permutations``: k permutations of range(n), row r seeded by ``[seed, 2, t, cid, epoch]`` as the engine
  draws them (k = 500: 100 clients × 5 epochs of a round), pyfedkern's one native call vs the loop building one
  NumPy ``Generator`` per row. Both give the same int64 values. The op is bound by hashing and the generator's
  arithmetic, not by memory, so the groups have no ``limit:`` case.
- ``poisson plan``: one round's Poisson-sampled batches (local DP-SGD's ``dp_sampling="poisson"``) of 1,000 clients
  of 20 to 199 samples, B = 10, one epoch (⌈n/10⌉ steps each): the planner's vectorised masks
  (:meth:`~pyfedkern.sim.planning.BatchPlanner.plan`) vs a loop over the batches calling
  :func:`~pyfedkern.sim.planning.poisson_batches` for one at a time (the same positions). ``fixed-size plan``
  times the default plan of the same clients and steps, for reference.
"""

from __future__ import annotations

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache
from pyfedkern.sim import planning

SEED = 12345
SIZES = [(500, 14), (100, 1000)]  # (k rows, n items per row); cheap enough to be the quick sizes too


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """One group per (k, n); none on "cuda" (the op runs on the host)."""
    if device != "cpu":
        return []
    cache = InputCache()
    out: list[Case] = []
    for k, n in SIZES:

        def inputs(k: int = k, n: int = n) -> dict:
            def build() -> dict:
                cid, epoch = np.divmod(np.arange(k), 5)  # keys [_BATCH = 2, round t = 7, client, epoch]
                keys = np.stack([np.full(k, 2), np.full(k, 7), cid, epoch], axis=1).astype(np.int64)
                return {"keys": keys, "sizes": np.full(k, n, dtype=np.int64)}

            return cache.get((k, n), build)

        group = f"seeded_permutations k={k} n={n} cpu"

        def ours(inputs=inputs):
            a = inputs()
            return lambda: ops.seeded_permutations(SEED, a["keys"], a["sizes"])

        def numpy_loop(inputs=inputs):
            a = inputs()
            pairs = zip(a["keys"], a["sizes"], strict=True)
            rows = [([SEED, *(int(v) for v in key)], int(size)) for key, size in pairs]
            return lambda: np.concatenate([np.random.default_rng(entropy).permutation(size) for entropy, size in rows])

        out += [
            Case(group, "pyfedkern", ours, 0, 0, device),
            Case(group, "numpy loop default_rng([seed, *key]).permutation(n)", numpy_loop, 0, 0, device),
        ]
    return out + _plans()


def _planner(poisson: bool) -> tuple[planning.BatchPlanner, np.ndarray]:
    sizes = np.random.default_rng(0).integers(20, 200, 1000)
    x, y = torch.zeros(int(sizes.sum()), 1), torch.zeros(int(sizes.sum()), dtype=torch.int64)
    kwargs = {"seed": SEED, "batch_size": 10, "local_epochs": 1.0, "fixed_order": False, "noise_std": None}
    return planning.BatchPlanner(x, y, sizes, poisson=poisson, **kwargs), np.arange(1000)


def _plans() -> list[Case]:
    group = "poisson plan 1000 clients n=20..199 B=10 E=1 cpu"

    def ours():
        planner, clients = _planner(True)
        return lambda: planner.plan(clients, 7, None, None, "reshuffle", False, None)

    def batch_loop():
        planner, clients = _planner(True)
        n, size, counts = planner.counts(clients, None, None, False, None)
        rows = [(c, s, m, b / m) for c, m, b, k in zip(clients, n, size, counts, strict=True) for s in range(k)]
        return lambda: [planning.poisson_batches(SEED, 7, [c], [s], [m], q) for c, s, m, q in rows]

    def fixed():
        planner, clients = _planner(False)
        return lambda: planner.plan(clients, 7, None, None, "reshuffle", False, None)

    return [
        Case(group, "pyfedkern", ours),
        Case(group, "loop over batches, same stream", batch_loop),
        Case("fixed-size plan 1000 clients n=20..199 B=10 E=1 cpu", "pyfedkern", fixed),
    ]
