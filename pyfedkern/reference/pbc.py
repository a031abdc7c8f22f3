"""Reference FedPBC server ops: the torch idiom (index the active rows, mean, write back), computed in float64."""

from __future__ import annotations

from typing import Any

import numpy as np

from pyfedkern.reference._xp import cast_like, to_float64


def _index_list(active: Any, m: int) -> list[int]:
    if hasattr(active, "tolist"):
        active = active.tolist()
    active = list(active)
    if active and isinstance(active[0], bool):
        return [i for i, on in enumerate(active) if on]
    return [int(i) for i in active]


def pbc_agg_bcast_(store: Any, server: Any, active: Any) -> Any:
    """server = mean of store[active]; store[active] = server (nothing when no row is active)."""
    rows = sorted(_index_list(active, store.shape[0]))
    if not rows:
        return server
    mean = to_float64(store[rows[0]])
    for r in rows[1:]:
        mean = mean + to_float64(store[r])
    server[...] = cast_like(mean / len(rows), server)
    for r in rows:
        store[r] = server
    return server


def weighted_delta_(x: Any, models: Any, weights: Any, scale: float = 1.0, rows: Any = None) -> Any:
    """x += scale·Σ_r weights[r]·(models[r] − x), in float64."""
    vectors = [models[i] for i in _index_list(rows, models.shape[0])] if rows is not None else list(models)
    base = to_float64(x)
    total = base * 0
    for v, w in zip(vectors, np.asarray(weights, dtype=np.float64).tolist(), strict=True):
        total = total + w * (to_float64(v) - base)
    x[...] = cast_like(base + float(scale) * total, x)
    return x


def mifa_update_(
    x: Any,
    memory: Any,
    total: Any,
    updates: Any,
    rows: Any,
    server_lr: float = 1.0,
    *,
    updates_are: str = "models",
    resum: bool = False,
) -> Any:
    """MIFA: memory[rows[r]] = Δ_r, total = Σ_i memory[i] (always re-summed here), x += server_lr·total/m."""
    m = memory.shape[0]
    idx = _index_list(rows, m)
    base = to_float64(x)
    for r, i in enumerate(idx):
        delta = to_float64(updates[r]) - base if updates_are == "models" else to_float64(updates[r])
        memory[i] = cast_like(delta, memory[i])
    s = to_float64(memory[0])
    for i in range(1, m):
        s = s + to_float64(memory[i])
    total[...] = cast_like(s, total)
    x[...] = cast_like(base + float(server_lr) / m * to_float64(total), x)
    return x
