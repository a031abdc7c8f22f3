"""Reference robust aggregation: the rules written literally in float64 NumPy, one coordinate or one row at a time.

The definitions here are the specification of :mod:`pyfedkern.ops.robust` (same signatures, same tie rules):

- ``updates`` is a [K, d] array or a list of K length-d vectors (numpy, torch or cupy); results come back in the
  caller's library, device and dtype (Krum's scores as float64, its indices as int64).
- Means of order statistics are summed in float64 in ascending order of value and divided once, so they only
  overflow beyond float64's range.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pyfedkern.reference._xp import cast_like
from pyfedkern.reference.herding import _like, _numpy64


def _rows(updates: Any) -> tuple[np.ndarray, Any]:
    """(float64 [K, d] numpy copy, an array whose library, device and dtype the result takes)."""
    if isinstance(updates, Sequence) and not isinstance(updates, (str, bytes)):
        return np.stack([_numpy64(u) for u in updates]), updates[0]
    return _numpy64(updates), updates


def _back(values: np.ndarray, like: Any, out: Any = None) -> Any:
    result = cast_like(_like(values, like), like)
    if out is None:
        return result
    out[...] = result
    return out


def _median_sorted(s: np.ndarray) -> np.ndarray:
    """Median of each column of an ascending-sorted [n, d] array: the middle value, or the mean of the two."""
    n = s.shape[0]
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) * 0.5


def coordinate_median(updates: Any, weights: Any = None, out: Any = None) -> Any:
    """[d] coordinate-wise median of the K rows.

    Without weights: the middle value for odd K, the mean of the two middle values for even K (NumPy's rule).

    With weights (K finite values ≥ 0, positive sum): rows of weight 0 are left out (never read). If the remaining
    weights are all equal, the result is the unweighted median of the remaining rows. Otherwise, per coordinate,
    the values are ordered by (value, row index), c_j is the float64 running sum of their weights in that order and
    T its last value; the weighted median is the first value x_j with 2·c_j ≥ T, or, when 2·c_j == T exactly, the
    mean of x_j and the next value in that order (the weights split exactly in half: NumPy's even-K rule).
    """
    x, like = _rows(updates)
    if weights is not None:
        w = np.asarray([float(v) for v in weights], dtype=np.float64)
        keep = w > 0
        x, w = x[keep], w[keep]
        if not np.all(w == w[0]):
            return _back(_weighted_median(x, w), like, out)
    return _back(_median_sorted(np.sort(x, axis=0)), like, out)


def _weighted_median(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    result = np.empty(x.shape[1])
    for i in range(x.shape[1]):
        order = np.argsort(x[:, i], kind="stable")
        values, c = x[order, i], 0.0
        running = []
        for k in order:
            c += w[k]
            running.append(c)
        total = running[-1]
        j = next(j for j, cj in enumerate(running) if 2.0 * cj >= total)
        result[i] = (values[j] + values[j + 1]) * 0.5 if 2.0 * running[j] == total else values[j]
    return result


def trimmed_mean(updates: Any, beta: float, out: Any = None) -> Any:
    """[d] per coordinate the mean of the K values after dropping the ⌊β·K⌋ smallest and the ⌊β·K⌋ largest
    (0 ≤ β < 1/2; ⌊β·K⌋ is ``int(beta * K)`` in float64, as Flower's and SciPy's ``trim_mean``)."""
    x, like = _rows(updates)
    cut = int(float(beta) * x.shape[0])
    s = np.sort(x, axis=0)[cut : x.shape[0] - cut]
    return _back(_ascending_mean(s), like, out)


def _ascending_mean(s: np.ndarray) -> np.ndarray:
    """Column means of an ascending-sorted [n, d] array, summed top to bottom in float64."""
    total = np.zeros(s.shape[1])
    for row in s:
        total = total + row
    return total / s.shape[0]


def _squared_distances(x: np.ndarray) -> np.ndarray:
    return np.array([[float(np.sum((a - b) ** 2)) for b in x] for a in x])


def _scores(dist: np.ndarray, f: int) -> np.ndarray:
    """Krum score of each row of a [n, n] squared-distance matrix: the sum of its max(1, n − f − 2) smallest
    distances to the other rows (none when n = 1), in ascending order."""
    n = dist.shape[0]
    near = min(n - 1, max(1, n - f - 2))
    return np.array([float(np.sum(np.sort(np.delete(dist[i], i))[:near])) for i in range(n)])


def krum_scores(updates: Any, f: int) -> Any:
    """[K] float64 Krum scores: for each row the sum of the squared distances to its max(1, K − f − 2) nearest other
    rows (Flower's count: at least one neighbour; none when K = 1), 0 ≤ f < K."""
    x, like = _rows(updates)
    return _like(_scores(_squared_distances(x), int(f)), like)


def krum_select(updates: Any, f: int, m: int = 1) -> Any:
    """[m] int64 indices of the m rows with the lowest Krum scores, lowest score first (ties → lowest index).
    m = 1 is Krum, m > 1 Multi-Krum's selection."""
    x, like = _rows(updates)
    scores = _scores(_squared_distances(x), int(f))
    return _like(np.argsort(scores, kind="stable")[: int(m)].astype(np.int64), like)


def bulyan_selection(x: np.ndarray, f: int) -> list[int]:
    """Bulyan's θ = K − 2f picks from a float64 [K, d] array: repeatedly the Krum winner (lowest score, ties →
    lowest index) among the rows not yet picked, scores recomputed on those rows each time."""
    dist = _squared_distances(x)
    remaining, picked = list(range(x.shape[0])), []
    for _ in range(x.shape[0] - 2 * f):
        scores = _scores(dist[np.ix_(remaining, remaining)], f)
        picked.append(remaining.pop(int(np.argmin(scores))))
    return picked


def bulyan(updates: Any, f: int) -> Any:
    """[d] Bulyan (K ≥ 4f + 3): the θ = K − 2f rows of ``bulyan_selection``, then per coordinate the mean of
    the β = θ − 2f of their values closest to their median (distances |x − median| in float64; equal distances go to
    the smaller value)."""
    x, like = _rows(updates)
    f = int(f)
    sel = x[bulyan_selection(x, f)]
    theta = sel.shape[0]
    beta = theta - 2 * f
    s = np.sort(sel, axis=0)
    med = _median_sorted(s)
    result = np.empty(x.shape[1])
    for i in range(x.shape[1]):
        col, m = s[:, i], med[i]
        lo, hi = (theta - 1) // 2, (theta - 1) // 2 + 1  # col[lo] <= m <= col[hi]
        for _ in range(beta):
            if lo >= 0 and (hi >= theta or m - col[lo] <= col[hi] - m):
                lo -= 1
            else:
                hi += 1
        result[i] = _ascending_mean(col[lo + 1 : hi, None])[0]
    return _back(result, like)


def geometric_median(updates: Any, weights: Any = None, eps: float = 1e-6, iters: int = 100, tol: float = 1e-6) -> Any:
    """[d] RFA's smoothed Weiszfeld iterations for the weighted geometric median (rows of weight 0 left out).

    v starts at the weighted mean; each iteration sets v ← Σ_k β_k x_k / Σ_k β_k with β_k = w_k / max(eps, ‖x_k − v‖)
    and stops after ``iters`` iterations or once the objective Σ_k w_k‖x_k − v‖ changed by at most tol times its new
    value.
    """
    x, like = _rows(updates)
    w = np.ones(x.shape[0]) if weights is None else np.asarray([float(v) for v in weights], dtype=np.float64)
    x, w = x[w > 0], w[w > 0]
    w = w / w.sum()
    v = w @ x
    obj = float(w @ np.sqrt(((x - v) ** 2).sum(1)))
    for _ in range(int(iters)):
        b = w / np.maximum(eps, np.sqrt(((x - v) ** 2).sum(1)))
        v = (b / b.sum()) @ x
        prev, obj = obj, float(w @ np.sqrt(((x - v) ** 2).sum(1)))
        if abs(prev - obj) <= tol * obj:
            break
    return _back(v, like)


def centred_clip(updates: Any, center: Any, tau: float, iters: int = 1) -> Any:
    """[d] centred clipping (Karimireddy et al. 2021): v ← v + (1/K) Σ_k (x_k − v)·min(1, τ/‖x_k − v‖), ``iters``
    times from v = center (a row at distance 0 adds nothing)."""
    x, like = _rows(updates)
    v = _numpy64(center)
    for _ in range(int(iters)):
        diff = x - v
        norms = np.sqrt((diff**2).sum(1))
        scale = np.minimum(1.0, tau / np.where(norms > 0, norms, 1.0))
        v = v + (scale[:, None] * diff).sum(0) / x.shape[0]
    return _back(v, like)
