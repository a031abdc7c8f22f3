"""Robust aggregation ops: coordinate-wise median and trimmed mean, Krum/Multi-Krum, Bulyan, geometric median and
centred clipping of K update vectors (Byzantine-robust servers). The rules, their tie-breaking and their float64
definitions are those of :mod:`pyfedkern.reference.robust`; docs/robust.md says what each costs and guarantees.

How they compute:

- **Coordinate-wise rules** (:func:`coordinate_median`, :func:`trimmed_mean`, the last step of :func:`bulyan`) run
  the native kernel ``robust_coordinate`` on the CPU: tiles of coordinates are copied into an L1-sized [K, B]
  buffer and a sorting network pruned to the ranks the rule needs runs across the B coordinates at once
  (selection, not a sort per coordinate; vectorised; its levels within groups of 8 rows run in registers as the
  tile is copied), parallel over fixed blocks of coordinates; a trimmed mean
  cutting at most 8 values per side pushes each row through the extremes held in registers instead (no network).
  Order statistics are exact; means of them are summed in float64. The weighted median sorts (value, row) pairs
  per coordinate.
- **Krum and Bulyan's selection** take pairwise squared distances ‖x_i‖² + ‖x_j‖² − 2⟨x_i, x_j⟩ from one Gram
  product: on the CPU all in the native ``robust_distances`` (the Gram kernel: blocks of 512 columns read in place
  or packed into an L2-resident buffer, only the upper triangle multiplied, in float32 lanes for float32 and 16-bit
  rows and float64 lanes for float64 ones, fused multiply-adds, the block sums added in float64: half a GEMM's
  multiply-adds), on CUDA chunked torch GEMMs summed in float64. It is taken of the raw rows when they are spread
  around a small mean, else of the rows shifted by their medoid as each block is read (models: a large common part
  would cancel); a float64 sample of columns picks which. Scores within their rounding bound of the lowest count as
  tied (lowest index).
- **Geometric median and centred clipping** iterate in the caller's precision (float32 for 16-bit storage): per
  iteration, the distances of the rows to the current point (a chunked difference and the
  :func:`pyfedkern.ops.row_norms` kernel) and one :func:`pyfedkern.ops.weighted_sum`. The stopping test of the
  geometric median reads the objective on the host each iteration (a synchronisation on a GPU).

On CUDA (torch or cupy) the coordinate-wise rules are computed with torch ops (a sort along the K rows: there is no
CUDA kernel for them), which is exact for the order statistics too but not selection-fast. Non-finite values are
refused: ``ValueError`` names the first row holding one. None of the ops is differentiable: torch inputs that
require grad are refused while grad mode is on. Each is also ``torch.ops.pyfedkern.<name>``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef, RowSet
from pyfedkern._runtime import native
from pyfedkern.ops import _declare
from pyfedkern.ops.aggregate import _check_output, _update_rows, weighted_sum
from pyfedkern.ops.herding import tie_rel_tol
from pyfedkern.ops.norms import row_norms

A = TypeVar("A")

_MEDIAN, _TRIMMED, _CLOSEST, _WEIGHTED = 0, 1, 2, 3
_NO_WEIGHTS = np.zeros(0)
_DIFF_CHUNK_ELEMENTS = 1 << 22  # rows × d of one difference chunk in the iterative ops (16 MiB of float32)
# rows × columns of one GEMM of Krum's Gram product on CUDA (2 MiB of float32 for the shifted rows' buffer)
_GRAM_CHUNK_ELEMENTS = 1 << 19
_GRAM_BLOCK = 512  # columns per block of the native Gram kernel (csrc/robust.cpp's kGramCols)
_PROBE_RUNS = 16  # runs of 16 adjacent columns in the float64 sample that picks the shift of Krum's Gram product
_PROBE = -2  # the shift argument of _squared_distances (and native robust_distances) that asks the probe


# Arguments -------------------------------------------------------------------------------------------------------


def _integer(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__qualname__}")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name} must be in [{lo}, {'∞' if hi is None else hi}], got {v}")
    return v


def _real(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__qualname__}")
    v = float(value)
    if math.isnan(v):
        raise ValueError(f"{name} must not be NaN")
    return v


def _beta(beta: Any, count: int) -> int:
    """⌊β·K⌋ for 0 ≤ β < 1/2 (``int(beta * K)``, Flower's and SciPy's rounding)."""
    b = _real(beta, "beta")
    if not 0.0 <= b < 0.5:
        raise ValueError(f"beta must be in [0, 0.5), got {beta}")
    return int(b * count)


def _f(f: Any, count: int, need: int = 1) -> int:
    """The number f of Byzantine rows: 0 ≤ f and K ≥ f + need."""
    v = _integer(f, "f", 0)
    if count < v + need:
        raise ValueError(f"f = {v} needs at least {v + need} updates, got K = {count}")
    return v


def _positive_weights(weights: Any, count: int) -> np.ndarray:
    w = _arrays.host_float64(weights, "weights", length=count)
    if (w < 0).any():
        k = int(np.flatnonzero(w < 0)[0])
        raise ValueError(f"weights must be >= 0, but weights[{k}] = {w[k]}")
    if not (w > 0).any():
        raise ValueError("weights must have a positive sum (all are 0)")
    return w


# Libraries -------------------------------------------------------------------------------------------------------


def _torch_view(x: Any) -> Any:
    """x as a torch tensor sharing its memory (numpy through from_numpy, cupy through DLPack)."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    return torch.from_dlpack(x)


def _from_torch(t: Any, lib: str) -> Any:
    """A torch tensor handed back in library ``lib`` (no copy)."""
    if lib == "torch":
        return t
    if lib == "numpy":
        return t.numpy()
    import cupy

    return cupy.from_dlpack(t)


def _stack(updates: Any, rows: RowSet) -> Any:
    """The updates as one [K, d] array of their library (a list is stacked: a copy)."""
    if rows.stack is not None:
        return updates
    lib = rows.first.lib
    if lib == "numpy":
        return np.stack(updates)
    if lib == "torch":
        return torch.stack([u.detach() for u in updates])
    import cupy

    return cupy.stack(updates)


def _nonfinite(op: str, updates: Any, rows: RowSet, which: Sequence[int] | None = None) -> ValueError:
    """ValueError naming the first row (of ``which``, or all) holding a NaN or an infinity."""
    for k in range(rows.count) if which is None else which:
        if not bool(torch.isfinite(_torch_view(updates[k])).all()):
            return ValueError(f"{op}: updates[{k}] holds NaN or infinite values; robust rules need finite updates")
    return ValueError(f"{op}: the squared distances between the updates overflow the float range")


# Coordinate-wise rules -------------------------------------------------------------------------------------------


def _native_rows(rows: RowSet, which: np.ndarray | None) -> tuple:
    if which is None:
        return rows.native_args()
    if rows.stack is not None:
        return rows.native_args(which)
    refs = [rows.refs[int(k)] for k in which]
    return [r.ptr for r in refs], [r.strides[0] for r in refs], 0, 0, 0, 0


def _coordinate(
    op: str, updates: Any, rule: int, param: int, weights: np.ndarray, out: Any, which: np.ndarray | None = None
) -> Any:
    """Run coordinate rule ``rule`` over the rows ``which`` (all when None) into ``out`` (allocated when None)."""
    rows = _update_rows(updates)
    first, d = rows.first, rows.d
    if out is None:
        out = _arrays.empty_like_lib(first, (d,))
        out_ref = _arrays.describe(out, "out")
    else:
        out_ref = _check_output(out, "out", first, d)
        for k, r in enumerate(rows.row_refs()):
            if out_ref.overlaps(r):
                raise ValueError(f"out overlaps updates[{k}]; pass a separate output array")
    if first.device >= 0:
        x = _torch_view(_stack(updates, rows))
        if which is not None:
            x = x[_torch_view(which).to(x.device)]
        finite = _torch_finite_rows(x)
        if not bool(finite.all()):
            bad = int(np.flatnonzero(~finite.cpu().numpy())[0])
            raise _nonfinite(op, updates, rows, [bad if which is None else int(which[bad])])
        result = torch_rule(x, rule, param, None if rule != _WEIGHTED else weights).to(x.dtype)
        _torch_view(out).copy_(result)
        return out
    ok = native().robust_coordinate(
        first.dtype, d, out_ref.ptr, out_ref.strides[0], *_native_rows(rows, which), rule, param, weights
    )
    if not ok:
        raise _nonfinite(op, updates, rows, None if which is None else [int(k) for k in which])
    _arrays.mark_written(out_ref)
    return out


def _torch_finite_rows(x: Any) -> Any:
    return torch.isfinite(x).all(dim=1)


def torch_rule(x: Any, rule: int, param: int, weights: Any = None) -> Any:
    """The coordinate-wise rules with torch ops on a finite [K, d] tensor (any device): the CUDA path, a sort along
    the rows. Returns float64 [d] (for float64 rows) or float32 [d]."""
    v = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    K = v.shape[0]
    if rule == _WEIGHTED:
        s, idx = torch.sort(v, dim=0, stable=True)  # ties in value: lower row first
        w = torch.as_tensor(weights, dtype=torch.float64, device=v.device)
        c = torch.cumsum(w[idx], dim=0)
        total = c[-1:]
        j = torch.argmax((2.0 * c >= total).to(torch.int8), dim=0, keepdim=True)  # the first rank reaching 1/2
        value = s.gather(0, j).double()
        nxt = s.gather(0, (j + 1).clamp(max=K - 1)).double()
        half = (2.0 * c.gather(0, j) == total) & (j + 1 < K)
        return torch.where(half, (value + nxt) * 0.5, value)[0].to(v.dtype)
    s = torch.sort(v, dim=0).values.double()
    median = s[K // 2] if K % 2 else (s[K // 2 - 1] + s[K // 2]) * 0.5
    if rule == _MEDIAN:
        return median.to(v.dtype)
    if rule == _TRIMMED:
        return s[param : K - param].sum(0).div(K - 2 * param).to(v.dtype)
    order = torch.sort((s - median).abs(), dim=0, stable=True).indices[:param]  # equal distances: smaller value
    return s.gather(0, order).sum(0).div(param).to(v.dtype)


def coordinate_median(updates: Any, weights: Any = None, out: A | None = None) -> A:
    """[d] coordinate-wise median of K update vectors, or their weighted median.

    Args:
        updates: a [K, d] array or a list of K 1-D arrays of length d (numpy, torch CPU/CUDA or cupy; float32,
            float64, float16 or bfloat16; one library, device and dtype). Finite (a NaN or an infinity is refused,
            naming its row).
        weights: None (the plain median: the middle value for odd K, the mean of the two middle values for even
            K, as ``np.median``), or K finite weights ≥ 0 with a positive sum. Rows of weight 0 are not read. Equal
            positive weights give the plain median of those rows; otherwise, per coordinate, with the values ordered
            by (value, row) and c_j the float64 running sum of their weights in that order (T its total), the result
            is the first x_j with 2·c_j ≥ T, or the mean of x_j and the next value when 2·c_j == T exactly.
        out: optional [d] output of the updates' library, device and dtype, overlapping none of them.

    Returns:
        ``out`` or a new [d] array. Exact for odd K (a value of the input); means of two values are formed in
        float64 and rounded once to float32/float64 (float16/bfloat16: through float32).
    """
    _declare.refuse_grad("coordinate_median", ("updates", "weights"), updates, weights)
    if _declare.operator_needed(updates, weights, out):
        return _traced("coordinate_median", updates, out, weights)
    return _coordinate_median(updates, weights, out)


def _coordinate_median(updates: Any, weights: Any, out: Any) -> Any:
    if weights is None:
        return _coordinate("coordinate_median", updates, _MEDIAN, 0, _NO_WEIGHTS, out)
    count = _update_rows(updates).count
    w = _positive_weights(weights, count)
    which = np.flatnonzero(w > 0)
    if np.all(w[which] == w[which[0]]):
        return _coordinate("coordinate_median", updates, _MEDIAN, 0, _NO_WEIGHTS, out, which)
    return _coordinate("coordinate_median", updates, _WEIGHTED, 0, np.ascontiguousarray(w[which]), out, which)


def trimmed_mean(updates: Any, beta: float, out: A | None = None) -> A:
    """[d] per coordinate the mean of the K values left after dropping the ⌊β·K⌋ smallest and the ⌊β·K⌋ largest
    (0 ≤ β < 1/2; ⌊β·K⌋ = ``int(beta * K)`` as Flower's ``aggregate_trimmed_avg`` and SciPy's ``trim_mean``).

    ``updates`` and ``out`` as in :func:`coordinate_median`. The kept values are summed in float64 (in ascending
    order for cuts above 8 per side; otherwise in the order the CPU kernel sets them aside) and the mean rounded once
    (float16/bfloat16: through float32).
    """
    _declare.refuse_grad("trimmed_mean", ("updates",), updates)
    if _declare.operator_needed(updates, out):
        return _traced("trimmed_mean", updates, out, float(beta))
    rows = _update_rows(updates)
    return _coordinate("trimmed_mean", updates, _TRIMMED, _beta(beta, rows.count), _NO_WEIGHTS, out)


def _traced(name: str, updates: Any, out: Any, *args: Any) -> Any:
    if not isinstance(updates, torch.Tensor):
        updates = torch.stack(list(updates))
    result = _declare.torch_op(name)(updates, *args)
    return result if out is None else out.copy_(result)


# Krum and Bulyan -------------------------------------------------------------------------------------------------


def _mid(values: np.ndarray) -> np.ndarray:
    """The middle values along axis 0 (rank ⌊K/2⌋ of K, counting from 0: the upper one for even K)."""
    return np.sort(values, axis=0)[values.shape[0] // 2]


def _medoid(dist: np.ndarray) -> int:
    """The row of a [K, K] squared-distance matrix with the smallest middle distance (:func:`_mid`) to the rows
    (itself included; ties: lowest index). A row farther than that from over half of the rows is never it."""
    return int(np.argmin(_mid(dist)))


def _sample_columns(x: Any) -> Any:
    """The probe's columns of a torch [K, d] tensor: 16 runs of 16 adjacent columns, run r from column r·⌊d/16⌋
    (all columns when d ≤ 256), [K, ≤ 256] (through a strided view)."""
    K, d = x.shape
    if d <= _PROBE_RUNS * _PROBE_RUNS:
        return x
    rs, cs = x.stride()
    return x.as_strided((K, _PROBE_RUNS, _PROBE_RUNS), (rs, (d // _PROBE_RUNS) * cs, cs), x.storage_offset()).reshape(
        K, -1
    )


def _probe(x: Any) -> int | None:
    """The shift row of :func:`_torch_gram` for a torch [K, d] tensor (the CUDA path; the native
    ``robust_distances`` probes alike on the CPU), from a float64 sample of its columns (:func:`_sample_columns`: a
    few cache lines per row): None (no shift) when the raw rows' middle squared norm (:func:`_mid`) is at most their
    middle squared distance to their medoid (:func:`_medoid`), else the medoid's index."""
    sample = _sample_columns(x).double().cpu().numpy()
    with np.errstate(all="ignore"):  # non-finite rows are reported after the Gram product
        norms = np.einsum("kj,kj->k", sample, sample)
        dist = norms[:, None] + norms[None, :] - 2.0 * (sample @ sample.T)  # float64: coarse only for extreme offsets
    k = _medoid(dist)
    return None if _mid(norms) <= _mid(dist[:, k]) else k


def _torch_gram(x: Any, shift: int | None) -> np.ndarray:
    """float64 [K, K] Gram matrix of the rows of a torch [K, d] tensor shifted by row ``shift`` (none when None), with
    torch ops (the CUDA path): per chunk of columns the shifted rows are written to a buffer and multiplied (one GEMM,
    in float64 for float64 rows, float32 otherwise), the chunk products summed in float64. Without a shift the GEMMs
    read views of the rows."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    K, d = x.shape
    c = min(d, max(256, _GRAM_CHUNK_ELEMENTS // K))
    s = None if shift is None else x[shift].to(work)
    buf = None if s is None else torch.empty(K, c, dtype=work, device=x.device)
    g = None
    for lo in range(0, d, c):
        hi = min(d, lo + c)
        part = x[:, lo:hi].to(work) if s is None else torch.sub(x[:, lo:hi], s[lo:hi], out=buf[:, : hi - lo])
        product = (part @ part.T).double()
        g = product if g is None else g.add_(product)
    return g.cpu().numpy()


def _gram_rel_tol(rows: RowSet) -> float:
    """Relative rounding scale of the Gram entries (times ‖x_i − s‖² + ‖x_j − s‖² bounds an entry's error): the
    GEMMs' max(8, √d) ulps (:func:`tie_rel_tol`), and on the CPU at least the native kernel's min(512, d)/L + 5 units
    of roundoff (L lanes summed in turn, 8 in float32, 4 in float64; the shift and the lanes' float64 sum)."""
    rel = tie_rel_tol(rows.first.dtype, rows.d)
    if rows.first.device >= 0:
        return rel
    lanes, unit = (4, 2.0**-53) if rows.first.dtype == "float64" else (8, 2.0**-24)
    return max(rel, (min(_GRAM_BLOCK, rows.d) / lanes + 5) * unit)


def _squared_distances(op: str, updates: Any, rows: RowSet, shift: int = _PROBE) -> tuple[np.ndarray, np.ndarray]:
    """(float64 [K, K] squared distances ‖x_i‖² + ‖x_j‖² − 2⟨x_i, x_j⟩ from one Gram product, [K, K] rounding bound
    of each entry).

    Distances do not change when every row is shifted by the same vector s, and their rounding scales with
    ‖x_i − s‖² + ‖x_j − s‖². A probe on a sample of columns picks s: no shift for rows spread around a small mean
    (updates), else the medoid row (models: rows sharing a large common part, whose raw Gram product cancels). A
    medoid is close to at least half of the rows, so an outlying row (an attacker's huge update) is never s. If the
    full product shows that the sample misled (the middle ‖x_k − s‖² above 4 times the middle distance to the medoid
    of the full distances), the product is taken once more, shifted by that medoid. ``shift`` replaces the probe's
    pick (-1: none, k: row k; tests). On the CPU all of it is the native ``robust_distances``; on CUDA,
    :func:`_probe` and :func:`_torch_gram`."""
    K = rows.count
    if rows.first.device < 0:
        g, dist = np.empty((K, K)), np.empty((K, K))
        used = native().robust_distances(
            rows.first.dtype, rows.d, g.ctypes.data, dist.ctypes.data, *rows.native_args(), shift
        )
        if used == _PROBE:
            raise _nonfinite(op, updates, rows)
        diag = np.diagonal(g)
    else:
        x = _torch_view(_stack(updates, rows))
        s = _probe(x) if shift == _PROBE else None if shift < 0 else shift
        for attempt in range(2):
            g = _torch_gram(x, s)
            if not np.isfinite(g).all():
                raise _nonfinite(op, updates, rows)
            diag = np.diag(g)
            dist = np.maximum(diag[:, None] + diag[None, :] - 2.0 * g, 0.0)
            np.fill_diagonal(dist, 0.0)
            best = _medoid(dist)
            if attempt or _mid(diag) <= 4.0 * _mid(dist[:, best]):
                break
            s = best
    return dist, _gram_rel_tol(rows) * 2.0 * (diag[:, None] + diag[None, :])


def _scores(dist: np.ndarray, bound: np.ndarray, f: int) -> tuple[np.ndarray, np.ndarray]:
    """(Krum scores of the rows of a squared-distance matrix, their rounding bounds): each row's max(1, n − f − 2)
    smallest distances to the others, summed in ascending order."""
    n = dist.shape[0]
    near = min(n - 1, max(1, n - f - 2))
    if near == 0:
        return np.zeros(n), np.zeros(n)
    masked = dist + np.diag(np.full(n, np.inf))
    order = np.argsort(masked, axis=1, kind="stable")[:, :near]
    row = np.arange(n)[:, None]
    return np.cumsum(dist[row, order], axis=1)[:, -1], bound[row, order].sum(1)


def _lowest(scores: np.ndarray, bound: np.ndarray, candidates: np.ndarray) -> int:
    """The candidate of lowest score, counting scores within rounding of the lowest as tied (lowest index)."""
    s, b = scores[candidates], bound[candidates]
    best = int(np.argmin(s))
    tied = s <= s[best] + b + b[best]
    return int(candidates[np.flatnonzero(tied)[0]])


def krum_scores(updates: Any, f: int) -> Any:
    """[K] float64 Krum scores: per row the sum of the squared distances to its max(1, K − f − 2) nearest other rows
    (Flower's count: at least one; 0 when K = 1), 0 ≤ f < K. Returned in the updates' library and device.

    Distances come from one Gram product (see the module docstring): each is accurate to
    2·(min(512, d)/L + 5) units of roundoff of the accumulation dtype on the CPU (float32, L = 8 lanes, unless the
    rows are float64: L = 4), about max(8, √d) ulps on CUDA, times ‖x_i − s‖² + ‖x_j − s‖², s = 0 for rows spread
    around a small mean and otherwise a row close to at least half of the rows (their medoid; at worst the
    middle ‖x_k − s‖² is 4 times the middle distance to the medoid); not to the rounding of a direct ‖x_i − x_j‖².
    """
    _declare.refuse_grad("krum_scores", ("updates",), updates)
    if _declare.operator_needed(updates):
        return _traced("krum_scores", updates, None, int(f))
    return _krum_scores(updates, f)


def _krum_scores(updates: Any, f: Any) -> Any:
    rows = _update_rows(updates)
    fv = _f(f, rows.count)
    dist, bound = _squared_distances("krum_scores", updates, rows)
    return _like(_scores(dist, bound, fv)[0], rows.first)


def krum_select(updates: Any, f: int, m: int = 1) -> Any:
    """[m] int64 indices of the m rows with the lowest Krum scores (:func:`krum_scores`), lowest first; scores
    within their rounding bound of each other are tied and go to the lowest index. m = 1 is Krum's choice, m > 1
    Multi-Krum's set (average those rows with :func:`pyfedkern.ops.weighted_sum`). 1 ≤ m ≤ K."""
    _declare.refuse_grad("krum_select", ("updates",), updates)
    if _declare.operator_needed(updates):
        return _traced("krum_select", updates, None, int(f), int(m))
    return _krum_select(updates, f, m)


def _krum_select(updates: Any, f: Any, m: Any) -> Any:
    rows = _update_rows(updates)
    fv = _f(f, rows.count)
    mv = _integer(m, "m", 1, rows.count)
    return _like(_pick(*_squared_distances("krum_select", updates, rows), fv, mv), rows.first)


def _pick(dist: np.ndarray, bound: np.ndarray, f: int, m: int) -> np.ndarray:
    """[m] int64: the m rows of lowest Krum score, lowest first (ties within rounding: lowest index)."""
    scores, sbound = _scores(dist, bound, f)
    remaining, picked = np.arange(dist.shape[0]), []
    for _ in range(m):
        j = _lowest(scores, sbound, remaining)
        picked.append(j)
        remaining = remaining[remaining != j]
    return np.asarray(picked, dtype=np.int64)


def bulyan(updates: Any, f: int) -> Any:
    """[d] Bulyan (El Mhamdi et al. 2018, as Flower's ``aggregate_bulyan`` with Krum): K ≥ 4f + 3.

    θ = K − 2f rows are picked one at a time, each the Krum winner (:func:`krum_select` with this f, scores over the
    rows not yet picked); then per coordinate the mean of the β = θ − 2f picked values closest to their median
    (|x − median| in float64; equal distances take the smaller value first), summed in float64 in ascending order.
    ``updates`` as in :func:`coordinate_median`; returns a new [d] array.
    """
    _declare.refuse_grad("bulyan", ("updates",), updates)
    if _declare.operator_needed(updates):
        return _traced("bulyan", updates, None, int(f))
    return _bulyan(updates, f)


def _bulyan(updates: Any, f: Any) -> Any:
    rows = _update_rows(updates)
    fv = _bulyan_f(f, rows.count)
    dist, bound = _squared_distances("bulyan", updates, rows)
    remaining, picked = list(range(rows.count)), []
    for _ in range(rows.count - 2 * fv):
        sub = np.ix_(remaining, remaining)
        scores, sbound = _scores(dist[sub], bound[sub], fv)
        picked.append(remaining.pop(_lowest(scores, sbound, np.arange(len(remaining)))))
    which = np.sort(np.asarray(picked, dtype=np.int64))
    return _coordinate("bulyan", updates, _CLOSEST, len(picked) - 2 * fv, _NO_WEIGHTS, None, which)


def _bulyan_f(f: Any, count: int) -> int:
    fv = _integer(f, "f", 0)
    if count < 4 * fv + 3:
        raise ValueError(f"bulyan needs K >= 4f + 3 = {4 * fv + 3} updates for f = {fv}, got K = {count}")
    return fv


def _like(values: np.ndarray, like: ArrayRef) -> Any:
    """A small host result in like's library and device (its own dtype)."""
    values = np.ascontiguousarray(values)
    if like.lib == "numpy":
        return values
    t = torch.from_numpy(values)
    if like.device >= 0:
        t = t.to(f"cuda:{like.device}")
    return _from_torch(t, like.lib)


# Geometric median and centred clipping ---------------------------------------------------------------------------


def _compute_rows(updates: Any, rows: RowSet) -> tuple[list[Any], Any]:
    """(the K rows as torch vectors in the compute dtype, the dtype): float32 for 16-bit storage (converted once)."""
    x = [_torch_view(updates[k]) for k in range(rows.count)]
    if x[0].dtype in (torch.float16, torch.bfloat16):
        x = [r.float() for r in x]
    return x, x[0].dtype


def _distances(op: str, updates: Any, rows: RowSet, x: list[Any], v: Any) -> np.ndarray:
    """float64 [K] ‖x_k − v‖ (differences in chunks of rows, norms by the row_norms kernel); checks finiteness."""
    step = max(1, _DIFF_CHUNK_ELEMENTS // rows.d)
    parts = []
    for k in range(0, len(x), step):
        diff = torch.stack(x[k : k + step]) - v
        parts.append(row_norms(diff).double().cpu().numpy())
    dist = np.concatenate(parts)
    if not np.isfinite(dist).all():
        raise _nonfinite(op, updates, rows)
    return dist


def geometric_median(updates: Any, weights: Any = None, eps: float = 1e-6, iters: int = 100, tol: float = 1e-6) -> Any:
    """[d] weighted geometric median by RFA's smoothed Weiszfeld iterations (Pillutla et al. 2022).

    v starts at the weighted mean; each iteration sets v ← Σ_k β_k x_k / Σ_k β_k with β_k = w_k / max(eps,
    ‖x_k − v‖), and the loop stops after ``iters`` iterations or once the objective Σ_k w_k ‖x_k − v‖ changed by at
    most ``tol`` times its new value. Rows of weight 0 are left out.

    Args:
        updates: as in :func:`coordinate_median`.
        weights: None (equal) or K finite weights ≥ 0 with a positive sum.
        eps: the smoothing distance, > 0. iters: ≥ 0 (0: the weighted mean). tol: ≥ 0 (0: run all iterations).

    Returns:
        a new [d] array of the updates' library, device and dtype (computed in float32 for 16-bit storage).
    """
    _declare.refuse_grad("geometric_median", ("updates", "weights"), updates, weights)
    if _declare.operator_needed(updates, weights):
        return _traced("geometric_median", updates, None, weights, float(eps), int(iters), float(tol))
    return _geometric_median(updates, weights, eps, iters, tol)


def _geometric_median(updates: Any, weights: Any, eps: Any, iters: Any, tol: Any) -> Any:
    rows = _update_rows(updates)
    w = np.ones(rows.count) if weights is None else _positive_weights(weights, rows.count)
    e, n, t = _weiszfeld_args(eps, iters, tol)
    x, _ = _compute_rows(updates, rows)
    keep = np.flatnonzero(w > 0)
    x, w = [x[k] for k in keep], w[keep] / w[keep].sum()
    v = weighted_sum(x, w)
    dist = _distances("geometric_median", updates, rows, x, v)
    obj = float(w @ dist)
    for _ in range(n):
        b = w / np.maximum(e, dist)
        v = weighted_sum(x, b / b.sum(), out=v)
        dist = _distances("geometric_median", updates, rows, x, v)
        prev, obj = obj, float(w @ dist)
        if abs(prev - obj) <= t * obj:
            break
    return _from_torch(v.to(_torch_view(updates[0]).dtype), rows.first.lib)


def _weiszfeld_args(eps: Any, iters: Any, tol: Any) -> tuple[float, int, float]:
    e, n, t = _real(eps, "eps"), _integer(iters, "iters", 0), _real(tol, "tol")
    if not (e > 0 and math.isfinite(e)):
        raise ValueError(f"eps must be a finite number > 0, got {eps}")
    if not (t >= 0 and math.isfinite(t)):
        raise ValueError(f"tol must be a finite number >= 0, got {tol}")
    return e, n, t


def centred_clip(updates: Any, center: Any, tau: float, iters: int = 1) -> Any:
    """[d] centred clipping (Karimireddy et al. 2021): from v = center, ``iters`` times
    v ← v + (1/K) Σ_k (x_k − v)·min(1, τ/‖x_k − v‖) (a row at distance 0 adds nothing).

    Args:
        updates: as in :func:`coordinate_median`.
        center: a [d] vector of the updates' library, device and dtype (typically the previous round's aggregate
            or the server momentum).
        tau: the clipping radius, > 0. iters: ≥ 0.

    Returns:
        a new [d] array (computed in float32 for 16-bit storage).
    """
    _declare.refuse_grad("centred_clip", ("updates", "center"), updates, center)
    if _declare.operator_needed(updates, center):
        return _traced("centred_clip", updates, None, center, float(tau), int(iters))
    return _centred_clip(updates, center, tau, iters)


def _centred_clip_operands(updates: Any, center: Any, tau: Any, iters: Any) -> tuple[RowSet, float, int]:
    rows = _update_rows(updates)
    c = _arrays.describe(center, "center")
    _arrays.check_same(c, rows.first, "center", "updates")
    if c.shape != (rows.d,):
        raise ValueError(f"center must have shape ({rows.d},), got {c.shape}")
    radius, n = _real(tau, "tau"), _integer(iters, "iters", 0)
    if not radius > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    return rows, radius, n


def _centred_clip(updates: Any, center: Any, tau: Any, iters: Any) -> Any:
    rows, radius, n = _centred_clip_operands(updates, center, tau, iters)
    x, dtype = _compute_rows(updates, rows)
    v = _torch_view(center).to(dtype).clone()
    if not bool(torch.isfinite(v).all()):
        raise ValueError("center holds NaN or infinite values")
    K = rows.count
    for _ in range(n):
        dist = _distances("centred_clip", updates, rows, x, v)
        s = np.minimum(1.0, radius / np.where(dist > 0, dist, 1.0)) / K
        v = weighted_sum([*x, v], np.append(s, 1.0 - s.sum()))
    return _from_torch(v.to(_torch_view(center).dtype), rows.first.lib)


# torch.library declarations --------------------------------------------------------------------------------------


# The fake functions run the direct path's operand checks (fake tensors have no data: weights are checked for their
# length only, their values when the operator runs).


def _fake_rows(updates: Any, weights: Any = None) -> RowSet:
    rows = _update_rows(updates)
    if weights is not None and tuple(weights.shape) != (rows.count,):
        raise ValueError(f"weights must have shape ({rows.count},), got {tuple(weights.shape)}")
    return rows


def _vector_fake(updates: Any) -> Any:
    return updates.new_empty(updates.shape[1:])


def _median_fake(u: Any, w: Any) -> Any:
    _fake_rows(u, w)
    return _vector_fake(u)


def _trimmed_fake(u: Any, beta: float) -> Any:
    _beta(beta, _fake_rows(u).count)
    return _vector_fake(u)


def _bulyan_fake(u: Any, f: int) -> Any:
    _bulyan_f(f, _fake_rows(u).count)
    return _vector_fake(u)


def _geometric_median_fake(u: Any, w: Any, eps: float, iters: int, tol: float) -> Any:
    _fake_rows(u, w)
    _weiszfeld_args(eps, iters, tol)
    return _vector_fake(u)


def _centred_clip_fake(u: Any, c: Any, tau: float, iters: int) -> Any:
    _centred_clip_operands(u, c, tau, iters)
    return _vector_fake(u)


def _krum_scores_fake(u: Any, f: int) -> Any:
    _f(f, _fake_rows(u).count)
    return u.new_empty(u.shape[:1], dtype=torch.float64)


def _krum_select_fake(u: Any, f: int, m: int) -> Any:
    count = _fake_rows(u).count
    _f(f, count)
    return u.new_empty((_integer(m, "m", 1, count),), dtype=torch.int64)


for _name, _schema, _fake, _run in (
    (
        "coordinate_median",
        "(Tensor updates, Tensor? weights) -> Tensor",
        _median_fake,
        lambda u, w: _coordinate_median(u, None if w is None else w, None),
    ),
    ("trimmed_mean", "(Tensor updates, float beta) -> Tensor", _trimmed_fake, lambda u, b: trimmed_mean(u, b)),
    ("bulyan", "(Tensor updates, int f) -> Tensor", _bulyan_fake, _bulyan),
    (
        "geometric_median",
        "(Tensor updates, Tensor? weights, float eps, int iters, float tol) -> Tensor",
        _geometric_median_fake,
        _geometric_median,
    ),
    (
        "centred_clip",
        "(Tensor updates, Tensor center, float tau, int iters) -> Tensor",
        _centred_clip_fake,
        _centred_clip,
    ),
    ("krum_scores", "(Tensor updates, int f) -> Tensor", _krum_scores_fake, _krum_scores),
    ("krum_select", "(Tensor updates, int f, int m) -> Tensor", _krum_select_fake, _krum_select),
):
    _declare.declare(_name, _schema, fake=_fake)(_run)
