"""Benchmark cases of the seeded permutations (the simulation engine's minibatch orders), CPU only.

- ``seeded_permutations``: k permutations of range(n), row r seeded by ``[seed, 2, t, cid, epoch]`` as the engine
  draws them (k = 500: 100 clients × 5 epochs of a round), pyfedkern's one native call vs the loop building one
  NumPy ``Generator`` per row. Both give the same int64 values. The op is bound by hashing and the generator's
  arithmetic, not by memory, so the groups have no ``limit:`` case.
"""

from __future__ import annotations

import numpy as np

from pyfedkern import ops
from pyfedkern.benchmarks.common import Case, InputCache

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
    return out
