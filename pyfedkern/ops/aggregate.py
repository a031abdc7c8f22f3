"""Aggregation ops: weighted sums of model-sized vectors (FedAvg and every server step).

Both ops read strided inputs in place (no copies), run on the caller's current CUDA stream for GPU arrays, release
the GIL, accumulate float16/bfloat16 in float32 and give the same bits for any number of CPU threads (each output
element sums its rows in row order). They are not differentiable: torch tensors are read as data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef
from pyfedkern._runtime import native

A = TypeVar("A")


def _update_rows(updates: Any) -> tuple[list[ArrayRef], ArrayRef | None]:
    """One 1-D ref per update, checked for a common library, device, dtype and length, and the [K, d] stack's own
    ref (None for a list)."""
    stack = None
    if _arrays.is_array(updates):
        stack = _arrays.describe(updates, "updates")
        if len(stack.shape) != 2:
            raise ValueError(f"updates must be a 2-D [K, d] array or a list of K 1-D vectors, got shape {stack.shape}")
        _arrays.check_float_dtype(stack, "updates")
        rows = [stack.row(k) for k in range(stack.shape[0])]
    elif isinstance(updates, Sequence) and not isinstance(updates, (str, bytes)):
        rows = [_arrays.describe(u, f"updates[{k}]") for k, u in enumerate(updates)]
        for k, r in enumerate(rows):
            if len(r.shape) != 1:
                raise ValueError(f"updates[{k}] must be a 1-D vector, got shape {r.shape} (flatten it first)")
        if rows:
            _arrays.check_float_dtype(rows[0], "updates[0]")
        for k, r in enumerate(rows[1:], start=1):
            _arrays.check_same(r, rows[0], f"updates[{k}]", "updates[0]")
            if r.shape != rows[0].shape:
                raise ValueError(f"updates[{k}] has length {r.shape[0]}, expected {rows[0].shape[0]} (updates[0])")
    else:
        raise TypeError(f"updates must be a 2-D array or a list of 1-D arrays, got {type(updates).__qualname__}")
    if not rows:
        raise ValueError("updates is empty: need at least one update (K >= 1)")
    if rows[0].shape[0] == 0:
        raise ValueError("updates are empty vectors (d = 0)")
    return rows, stack


def _check_output(out: Any, name: str, like: ArrayRef, d: int) -> ArrayRef:
    ref = _arrays.describe(out, name)
    _arrays.check_same(ref, like, name, "updates")
    if ref.shape != (d,):
        raise ValueError(f"{name} must have shape ({d},), got {ref.shape}")
    if not ref.writeable:
        raise ValueError(f"{name} is read-only")
    if d > 1 and ref.strides[0] == 0:
        raise ValueError(f"{name} has stride 0 (a broadcast view); it must be writeable element by element")
    return ref


def _same_view(a: ArrayRef, b: ArrayRef) -> bool:
    """Same elements in the same order: each output element then only reads its own inputs, which is safe."""
    return a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape


def _run(out: ArrayRef, rows: list[ArrayRef], weights: Sequence[float], accumulate: bool) -> None:
    native().weighted_sum(
        out.device,
        _arrays.stream_handle(out),
        out.dtype,
        out.shape[0],
        out.ptr,
        out.strides[0],
        [r.ptr for r in rows],
        [r.strides[0] for r in rows],
        [float(w) for w in weights],
        accumulate,
    )


def weighted_sum(updates: Any, weights: Any, out: A | None = None) -> A:
    """Σ_k weights[k]·updates[k] in one pass over memory.

    Args:
        updates: a [K, d] array or a list of K 1-D arrays of length d (numpy, torch CPU/CUDA or cupy; float32,
            float64, float16 or bfloat16; all the same library, device and dtype). Rows whose weight is exactly 0
            are never read, which is how a masked / active-set average is expressed.
        weights: K finite real numbers (a sequence or an array on any device; GPU weights are copied to the host).
        out: optional [d] output of the same library, device and dtype. It may be one of the updates itself
            (same memory, same stride: ``x ← a·x + Σ b_k u_k`` in place) but must not partially overlap any.

    Returns:
        ``out``, or a new [d] array of the caller's library, device and dtype.
    """
    rows, stack = _update_rows(updates)
    w = _arrays.host_float64(weights, "weights", length=len(rows))
    d = rows[0].shape[0]
    if out is None:
        out = _arrays.empty_like_lib(rows[0], (d,))
        out_ref = _arrays.describe(out, "out")
    else:
        out_ref = _check_output(out, "out", rows[0], d)
        may_overlap = rows if stack is None or out_ref.overlaps(stack) else []
        lo, hi = out_ref.byte_span()
        for k, r in enumerate(may_overlap):
            r_lo, r_hi = r.byte_span()
            if w[k] != 0 and r_lo < hi and lo < r_hi and not _same_view(out_ref, r):
                raise ValueError(f"out partially overlaps updates[{k}]; pass a separate output array")
    _run(out_ref, rows, w, accumulate=False)
    return out


def accumulate_(acc: A, update: Any, weight: Any) -> A:
    """In place ``acc += weight·update`` (aggregate results as they arrive with O(1) models of memory).

    Args:
        acc: a 1-D float array (numpy, torch or cupy), updated in place.
        update: a 1-D array of acc's length, library, device and dtype; it may be ``acc`` itself but must not
            partially overlap it.
        weight: a finite real number (or one-element array).

    Returns:
        ``acc``.
    """
    acc_ref = _arrays.describe(acc, "acc")
    if len(acc_ref.shape) != 1:
        raise ValueError(f"acc must be a 1-D vector, got shape {acc_ref.shape}")
    _arrays.check_float_dtype(acc_ref, "acc")
    if acc_ref.shape[0] == 0:
        raise ValueError("acc is empty (d = 0)")
    upd = _arrays.describe(update, "update")
    if len(upd.shape) != 1:
        raise ValueError(f"update must be a 1-D vector, got shape {upd.shape}")
    _arrays.check_same(upd, acc_ref, "update", "acc")
    if upd.shape != acc_ref.shape:
        raise ValueError(f"update has length {upd.shape[0]}, expected {acc_ref.shape[0]} (the length of acc)")
    if not acc_ref.writeable:
        raise ValueError("acc is read-only")
    if acc_ref.shape[0] > 1 and acc_ref.strides[0] == 0:
        raise ValueError("acc has stride 0 (a broadcast view); it must be writeable element by element")
    if acc_ref.overlaps(upd) and not _same_view(acc_ref, upd):
        raise ValueError("update partially overlaps acc; pass acc itself or a separate array")
    w = _arrays.host_scalar(weight, "weight")
    _run(acc_ref, [upd], [w], accumulate=True)
    return acc
