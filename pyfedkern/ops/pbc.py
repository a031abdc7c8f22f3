"""FedPBC server ops over a [m, d] store of client models (Xiang et al., "implicit gossiping").

- :func:`pbc_agg_bcast_`: the postponed-broadcast step. The mean of the active rows goes to the server model and
  back into exactly those rows, in one pass that moves (2k+1)·d elements (k active rows); a no-op when k = 0.
- :func:`weighted_delta_`: ``x += scale·Σ_r w_r·(Y_r − x)``, the server step of FedAvg (scale = η_g/k, w = 1),
  FedAvg-all (η_g/m), FedAvg with known p (w = 1/p_i) and FedAU (w = ω_i); (k+2)·d traffic.
- :func:`mifa_update_`: MIFA's memory of the last update of every client with a running sum S = Σ_i U_i, so a round
  costs O(k) rows instead of O(m); ``resum=True`` recomputes S from all m rows to bound floating-point drift.

All ops work in place on numpy / torch (CPU, CUDA) / cupy arrays of float32, float64, float16 or bfloat16 (16-bit
storage accumulates in float32), read strided views in place, run on the caller's current CUDA stream, release the
GIL, and give the same bits for any number of CPU threads (each element sums its rows in the order given).
They are not differentiable: torch inputs and outputs that require grad are refused while grad mode is on. Inside
``torch.compile``/``torch.export`` they run as ``torch.ops.pyfedkern.<name>`` (declared below).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef
from pyfedkern._runtime import native
from pyfedkern.ops import _declare

A = TypeVar("A")


def _vector(x: Any, name: str, *, like: ArrayRef | None = None, d: int | None = None, writeable: bool) -> ArrayRef:
    ref = _arrays.describe(x, name)
    if len(ref.shape) != 1:
        raise ValueError(f"{name} must be a 1-D vector, got shape {ref.shape}")
    if like is None:
        _arrays.check_float_dtype(ref, name)
    else:
        _arrays.check_same(ref, like, name, "store" if d is None else "x")
    if ref.shape[0] == 0:
        raise ValueError(f"{name} is empty (d = 0)")
    if d is not None and ref.shape[0] != d:
        raise ValueError(f"{name} has length {ref.shape[0]}, expected {d}")
    if writeable:
        _arrays.check_output(ref, name)
    return ref


def _store(store: Any, name: str, *, like: ArrayRef | None = None, writeable: bool) -> ArrayRef:
    ref = _arrays.describe(store, name)
    if len(ref.shape) != 2:
        raise ValueError(f"{name} must be a 2-D [m, d] array, got shape {ref.shape}")
    if like is None:
        _arrays.check_float_dtype(ref, name)
    else:
        _arrays.check_same(ref, like, name, "x")
    if ref.shape[0] == 0 or ref.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {ref.shape}); need m >= 1 and d >= 1")
    if writeable:
        _arrays.check_output(ref, name)
        if _rows_overlap(ref):
            raise ValueError(f"{name}'s rows overlap each other in memory (strides {ref.strides})")
    return ref


def _rows_overlap(ref: ArrayRef) -> bool:
    """Whether two rows of a 2-D view share memory (for |row stride| ≥ the row's span they never do)."""
    m, d = ref.shape
    if m < 2:
        return False
    span = (d - 1) * abs(ref.strides[1]) + 1
    return abs(ref.strides[0]) < span and not _interleaved(ref)


def _interleaved(ref: ArrayRef) -> bool:
    """Column-major style layouts (|col stride| ≥ m·|row stride|) keep rows disjoint although they interleave."""
    m, _ = ref.shape
    return ref.strides[0] != 0 and abs(ref.strides[1]) >= m * abs(ref.strides[0])


_FEW_INDICES = 32  # index arrays up to this length are checked as Python lists


def _indices(active: Any, m: int, name: str, *, sort: bool = False) -> np.ndarray:
    """Distinct int64 row indices from indices or a boolean mask of length m (row order): in the given order, or
    sorted with ``sort``."""
    if _arrays.is_array(active):
        active = _arrays.to_host(active, name)  # GPU indices: one host round trip (pass host indices to avoid it)
    arr = np.asarray(active)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (indices or a boolean mask of length {m}), got shape {arr.shape}")
    if arr.dtype == np.bool_:
        if arr.shape[0] != m:
            raise ValueError(f"{name} is a boolean mask of length {arr.shape[0]}, expected {m}")
        return np.flatnonzero(arr).astype(np.int64)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer row indices or booleans, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.max() >= m:  # before the cast to int64, which would wrap 2^63 and above
        raise ValueError(f"{name} holds row index {int(arr.max())}, expected indices in [0, {m})")
    idx = arr.astype(np.int64)
    if idx.shape[0] <= _FEW_INDICES:  # the same checks on a list: a few µs less per call than numpy's
        values = idx.tolist()
        ordered_list = sorted(values)
        if ordered_list[0] < 0 or ordered_list[-1] >= m:
            bad = next(v for v in values if v < 0 or v >= m)
            raise ValueError(f"{name} holds row index {bad}, expected indices in [0, {m})")
        if len(set(values)) != len(values):
            raise ValueError(f"{name} holds duplicate row indices; each active row must appear once")
        return np.array(ordered_list, dtype=np.int64) if sort else idx
    ordered = np.sort(idx)
    if ordered[0] < 0 or ordered[-1] >= m:
        bad = int(idx[(idx < 0) | (idx >= m)][0])
        raise ValueError(f"{name} holds row index {bad}, expected indices in [0, {m})")
    if (ordered[1:] == ordered[:-1]).any():
        raise ValueError(f"{name} holds duplicate row indices; each active row must appear once")
    return ordered if sort else idx


def _row_ptrs(ref: ArrayRef, rows: np.ndarray) -> tuple[list[int], list[int]]:
    step = ref.strides[0] * ref.itemsize
    return (ref.ptr + rows.astype(np.int64) * step).tolist(), [ref.strides[1]] * len(rows)


def _check_disjoint(a: ArrayRef, b: ArrayRef, a_name: str, b_name: str) -> None:
    if a.overlaps(b):
        raise ValueError(f"{a_name} overlaps {b_name} in memory; pass separate arrays")


def pbc_agg_bcast_(store: Any, server: A, active: Any) -> A:
    """Postponed broadcast: ``server = mean_{i∈active} store[i]`` and ``store[i] = server`` for every active i.

    Args:
        store: [m, d] client models (numpy, torch CPU/CUDA or cupy; float32/float64/float16/bfloat16), in place.
        server: [d] server model of store's library, device and dtype, overwritten (unless no row is active).
        active: the active rows, as distinct int indices in [0, m) or a boolean mask of length m. They are
            summed in increasing row order; with no active row nothing is read or written.

    Returns:
        ``server``.
    """
    if _declare.operator_needed(store, server, active):
        _declare.torch_op("pbc_agg_bcast_")(store, server, _index_tensor(active))
        return server
    return _pbc_agg_bcast(store, server, active)


def _agg_bcast_operands(store: Any, server: Any, *_: Any) -> tuple[ArrayRef, ArrayRef]:
    """The checked store and server of :func:`pbc_agg_bcast_` (direct path and fake function)."""
    s = _store(store, "store", writeable=True)
    srv = _vector(server, "server", like=s, writeable=True)
    if srv.shape[0] != s.shape[1]:
        raise ValueError(f"server has length {srv.shape[0]}, expected {s.shape[1]} (the columns of store)")
    _check_disjoint(srv, s, "server", "store")
    return s, srv


def _pbc_agg_bcast(store: Any, server: Any, active: Any) -> Any:
    """The direct path of :func:`pbc_agg_bcast_` (any library)."""
    s, srv = _agg_bcast_operands(store, server)
    m, d = s.shape
    rows = _indices(active, m, "active", sort=True)
    if rows.size == 0:
        return server
    ptrs, strides = _row_ptrs(s, rows)
    stream = _arrays.stream_handle(s)
    _arrays.call_native(native().pbc_agg_bcast, s, s.device, stream, s.dtype, d, srv.ptr, srv.strides[0], ptrs, strides)
    _arrays.mark_written(s, srv)
    return server


def _stack(models: Any, name: str, x: ArrayRef) -> ArrayRef:
    """A read-only [K, d] stack of rows like x."""
    stack = _store(models, name, like=x, writeable=False)
    if stack.shape[1] != x.shape[0]:
        raise ValueError(f"{name} has {stack.shape[1]} columns, expected {x.shape[0]} (the length of x)")
    return stack


def _update_rows(models: Any, name: str, x: ArrayRef, rows: Any) -> tuple[list[int], list[int], list[ArrayRef]]:
    """Pointers/strides of the rows to read: a [K, d] stack (optionally selected by ``rows``) or a list."""
    d = x.shape[0]
    if _arrays.is_array(models):
        stack = _stack(models, name, x)
        idx = np.arange(stack.shape[0]) if rows is None else _indices(rows, stack.shape[0], "rows")
        ptrs, strides = _row_ptrs(stack, idx)
        return ptrs, strides, [stack]
    if rows is not None:
        raise ValueError("rows selects rows of a 2-D stack; with a list of vectors pass only the vectors used")
    if not isinstance(models, Sequence) or isinstance(models, (str, bytes)):
        raise TypeError(f"{name} must be a 2-D array or a list of 1-D arrays, got {type(models).__qualname__}")
    refs = [_vector(v, f"{name}[{k}]", like=x, d=d, writeable=False) for k, v in enumerate(models)]
    return [r.ptr for r in refs], [r.strides[0] for r in refs], refs


def weighted_delta_(x: A, models: Any, weights: Any, scale: float = 1.0, rows: Any = None) -> A:
    """In place ``x += scale·Σ_r weights[r]·(models[r] − x)`` in one pass ((k+2)·d traffic).

    FedAvg: scale = η_g/k, w = 1. FedAvg-all: scale = η_g/m. Known p: w_i = 1/p_i. FedAU: w_i = ω_i.

    Args:
        x: [d] server model, updated in place.
        models: a [K, d] array (e.g. the [m, d] store) or a list of K [d] vectors, same library/device/dtype as x,
            not overlapping x. Rows with weight exactly 0 are not read.
        weights: one finite weight per row used (per entry of ``rows`` when given).
        scale: finite real factor applied to the sum.
        rows: optional row indices (or boolean mask) selecting the rows of a 2-D ``models`` to use.

    Returns:
        ``x``.
    """
    _declare.refuse_grad("weighted_delta_", ("models", "weights", "scale"), models, weights, scale)
    if _declare.operator_needed(x, models, weights, rows):
        selected = None if rows is None else _index_tensor(rows)
        _declare.torch_op("weighted_delta_")(x, _stacked(models), _float_tensor(weights), float(scale), selected)
        return x
    return _weighted_delta(x, models, weights, scale, rows)


def _weighted_delta(x: Any, models: Any, weights: Any, scale: Any, rows: Any) -> Any:
    """The direct path of :func:`weighted_delta_` (any library)."""
    xr = _vector(x, "x", writeable=True)
    ptrs, strides, refs = _update_rows(models, "models", xr, rows)
    for k, r in enumerate(refs):
        _check_disjoint(xr, r, "x", "models" if len(refs) == 1 and len(r.shape) == 2 else f"models[{k}]")
    w = _arrays.host_float64(weights, "weights", length=len(ptrs))
    c = _arrays.host_scalar(scale, "scale")
    if not ptrs:
        return x
    with np.errstate(over="ignore"):
        scaled = w * c  # the kernel's weights: the scale folded in
    if not np.isfinite(scaled).all():
        raise ValueError(f"weights × scale overflows float64 (largest |weight| {np.abs(w).max():g}, scale {c:g})")
    stream = _arrays.stream_handle(xr)
    args = (xr.device, stream, xr.dtype, xr.shape[0], xr.ptr, xr.strides[0], ptrs, strides, list(scaled))
    _arrays.call_native(native().weighted_delta, xr, *args)
    _arrays.mark_written(xr)
    return x


def mifa_update_(
    x: A,
    memory: Any,
    total: Any,
    updates: Any,
    rows: Any,
    server_lr: float = 1.0,
    *,
    updates_are: str = "models",
    resum: bool = False,
) -> A:
    """MIFA's server step with a running sum, in place.

    For each active client i = rows[r]: Δ_i = updates[r] − x (``updates_are="models"``) or updates[r]
    (``"deltas"``); ``total += Δ_i − memory[i]``; ``memory[i] = Δ_i``. With ``resum``, ``total`` is then recomputed
    as Σ_{i<m} memory[i] (do it every few hundred rounds against float32 drift). Finally
    ``x += server_lr·total/m``. Traffic ≈ (3k+4)·d (plus m·d when re-summing) instead of (k+m)·d.

    Args:
        x: [d] server model. memory: [m, d] stored deltas U_i (zeros at the start). total: [d] running sum Σ U_i.
        updates: [k, d] array or list of k [d] vectors (the active clients' models or deltas), aligned with rows.
        rows: k distinct client indices in [0, m) (or a boolean mask of length m, then updates follow row order).
        server_lr: η_g.

    Returns:
        ``x``.
    """
    _declare.refuse_grad("mifa_update_", ("updates", "server_lr"), updates, server_lr)
    if _declare.operator_needed(x, memory, total, updates, rows):
        op = _declare.torch_op("mifa_update_")
        op(x, memory, total, _stacked(updates), _index_tensor(rows), float(server_lr), updates_are, resum)
        return x
    return _mifa_update(x, memory, total, updates, rows, server_lr, updates_are, resum)


def _mifa_operands(
    x: Any, memory: Any, total: Any, updates: Any, rows: Any, server_lr: Any, updates_are: Any, resum: Any
) -> tuple:
    """The checked x, memory, total and [k, d] updates (None for a list) of :func:`mifa_update_` (direct path and
    fake function)."""
    if updates_are not in ("models", "deltas"):
        raise ValueError(f"updates_are must be 'models' or 'deltas', got {updates_are!r}")
    if not isinstance(resum, (bool, np.bool_)):
        raise TypeError(f"resum must be a bool, got {type(resum).__qualname__}")
    xr = _vector(x, "x", writeable=True)
    mem = _store(memory, "memory", like=xr, writeable=True)
    if mem.shape[1] != xr.shape[0]:
        raise ValueError(f"memory has {mem.shape[1]} columns, expected {xr.shape[0]} (the length of x)")
    tot = _vector(total, "total", like=xr, d=mem.shape[1], writeable=True)
    stacked = _arrays.is_array(updates) and len(_arrays.describe(updates, "updates").shape) == 2
    return xr, mem, tot, _stack(updates, "updates", xr) if stacked else None


def _mifa_update(
    x: Any, memory: Any, total: Any, updates: Any, rows: Any, server_lr: Any, updates_are: str, resum: bool
) -> Any:
    """The direct path of :func:`mifa_update_` (any library)."""
    xr, mem, tot, upd = _mifa_operands(x, memory, total, updates, rows, server_lr, updates_are, resum)
    m, d = mem.shape
    idx = _indices(rows, m, "rows")
    if upd is not None:
        uptrs, ustrides = _row_ptrs(upd, np.arange(upd.shape[0]))
        urefs = [upd]
    else:
        uptrs, ustrides, urefs = _update_rows(updates, "updates", xr, None)
    if len(uptrs) != idx.shape[0]:
        raise ValueError(f"updates has {len(uptrs)} rows but rows selects {idx.shape[0]} clients")
    _check_disjoint(xr, mem, "x", "memory")
    _check_disjoint(tot, mem, "total", "memory")
    _check_disjoint(xr, tot, "x", "total")
    for r in urefs:
        for other, name in ((xr, "x"), (mem, "memory"), (tot, "total")):
            _check_disjoint(r, other, "updates", name)
    coef = _arrays.host_scalar(server_lr, "server_lr") / m
    mptrs, mstrides = _row_ptrs(mem, idx)
    aptrs, astrides = _row_ptrs(mem, np.arange(m)) if resum else ([], [])
    _arrays.call_native(
        native().mifa_update,
        xr,
        xr.device,
        _arrays.stream_handle(xr),
        xr.dtype,
        d,
        xr.ptr,
        xr.strides[0],
        tot.ptr,
        tot.strides[0],
        uptrs,
        ustrides,
        mptrs,
        mstrides,
        aptrs,
        astrides,
        coef,
        updates_are == "models",
    )
    _arrays.mark_written(xr, mem, tot)
    return x


# torch.library declarations -----------------------------------------------------------------------------------


def _index_tensor(indices: Any) -> Any:
    """Row indices or a boolean mask as a tensor (a list or numpy array becomes a CPU tensor)."""
    if _declare.is_tensor(indices):
        return indices
    import torch

    return torch.as_tensor(indices)


def _float_tensor(values: Any) -> Any:
    if _declare.is_tensor(values):
        return values
    import torch

    return torch.as_tensor(values, dtype=torch.float64)


def _stacked(rows: Any) -> Any:
    """A [K, d] tensor of a tensor or of a list of K [d] tensors."""
    if _declare.is_tensor(rows):
        return rows
    import torch

    return torch.stack(list(rows))


@_declare.declare(
    "pbc_agg_bcast_",
    "(Tensor(a!) store, Tensor(b!) server, Tensor active) -> ()",
    fake=_declare.checks_only(_agg_bcast_operands),
    mutates=("store", "server"),
)
def _pbc_agg_bcast_native(store: Any, server: Any, active: Any) -> None:
    _pbc_agg_bcast(store, server, active)


@_declare.declare(
    "weighted_delta_",
    "(Tensor(a!) x, Tensor models, Tensor weights, float scale, Tensor? rows) -> ()",
    fake=_declare.checks_only(lambda x, models, *_: _stack(models, "models", _vector(x, "x", writeable=True))),
    mutates=("x",),
)
def _weighted_delta_native(x: Any, models: Any, weights: Any, scale: float, rows: Any) -> None:
    _weighted_delta(x, models, weights, scale, rows)


@_declare.declare(
    "mifa_update_",
    "(Tensor(a!) x, Tensor(b!) memory, Tensor(c!) total, Tensor updates, Tensor rows, float server_lr, "
    "str updates_are, bool resum) -> ()",
    fake=_declare.checks_only(_mifa_operands),
    mutates=("x", "memory", "total"),
)
def _mifa_update_native(
    x: Any, memory: Any, total: Any, updates: Any, rows: Any, server_lr: float, updates_are: str, resum: bool
) -> None:
    _mifa_update(x, memory, total, updates, rows, server_lr, updates_are, resum)
