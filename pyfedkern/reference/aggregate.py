"""Reference aggregation: the textbook loops, in float64."""

from __future__ import annotations

from typing import Any

from pyfedkern.reference._xp import cast_like, to_float64, zeros_float64_like


def weighted_sum(updates: Any, weights: Any, out: Any = None) -> Any:
    """Σ_k weights[k]·updates[k] over a [K, d] array or a list of K vectors, computed in float64.

    Rows whose weight is exactly 0 are skipped (not read), as in the op: a NaN there does not spread.
    """
    rows = [updates[k] for k in range(len(updates))]
    total = zeros_float64_like(rows[0])
    for u, w in zip(rows, [float(w) for w in weights], strict=True):
        if w != 0.0:
            total = total + to_float64(u) * w
    result = cast_like(total, rows[0])
    if out is None:
        return result
    out[...] = result
    return out


def accumulate_(acc: Any, update: Any, weight: Any) -> Any:
    """acc += weight·update, computed in float64 and stored in acc's dtype."""
    acc[...] = cast_like(to_float64(acc) + float(weight) * to_float64(update), acc)
    return acc
