"""Reference seeded permutations: one NumPy ``Generator`` per row, exactly as a simulation would build them."""

from __future__ import annotations

from typing import Any

import numpy as np


def seeded_permutations(seed: Any, keys: Any, sizes: Any) -> np.ndarray:
    """``np.random.default_rng([seed, *keys[r]]).permutation(sizes[r])`` for every row r, concatenated (int64);
    same inputs and output as :func:`pyfedkern.ops.seeded_permutations`."""
    rows = [[int(seed), *(int(key) for key in row)] for row in np.asarray(keys, dtype=np.int64)]
    perms = [np.random.default_rng(entropy).permutation(int(n)) for entropy, n in zip(rows, sizes, strict=True)]
    return np.concatenate(perms) if perms else np.zeros(0, dtype=np.int64)
