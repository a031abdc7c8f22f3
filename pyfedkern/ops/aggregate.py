"""Aggregation ops: weighted sums of model-sized vectors (FedAvg and every server step).

Both ops read strided inputs in place (no copies), run on the caller's current CUDA stream for GPU arrays without
allocating device memory or synchronising, release the GIL, accumulate float16/bfloat16 in float32 and give the
same bits for any number of CPU threads (each output element sums its rows in row order).

Torch: :func:`weighted_sum` is differentiable in the updates and in tensor weights (``torch.ops.pyfedkern.
weighted_sum`` with its autograd formula, taken when an input requires grad or inside ``torch.compile``);
:func:`accumulate_` is not: it refuses inputs that require grad while grad mode is on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef, RowSet
from pyfedkern._runtime import native
from pyfedkern.ops import _declare

A = TypeVar("A")

_NO_WEIGHTS = np.zeros(0)


def _update_rows(updates: Any) -> RowSet:
    """The updates as a :class:`RowSet`, checked for a common library, device, dtype and length."""
    if _arrays.is_array(updates):
        stack = _arrays.describe(updates, "updates")
        if len(stack.shape) != 2:
            raise ValueError(f"updates must be a 2-D [K, d] array or a list of K 1-D vectors, got shape {stack.shape}")
        _arrays.check_float_dtype(stack, "updates")
        rows = RowSet(stack, stack, [], stack.shape[0], stack.shape[1])
    elif isinstance(updates, Sequence) and not isinstance(updates, (str, bytes)):
        refs = [_arrays.describe(u, f"updates[{k}]") for k, u in enumerate(updates)]
        for k, r in enumerate(refs):
            if len(r.shape) != 1:
                raise ValueError(f"updates[{k}] must be a 1-D vector, got shape {r.shape} (flatten it first)")
        if refs:
            _arrays.check_float_dtype(refs[0], "updates[0]")
        for k, r in enumerate(refs[1:], start=1):
            _arrays.check_same(r, refs[0], f"updates[{k}]", "updates[0]")
            if r.shape != refs[0].shape:
                raise ValueError(f"updates[{k}] has length {r.shape[0]}, expected {refs[0].shape[0]} (updates[0])")
        rows = RowSet(refs[0] if refs else None, None, refs, len(refs), refs[0].shape[0] if refs else 0)
    else:
        raise TypeError(f"updates must be a 2-D array or a list of 1-D arrays, got {type(updates).__qualname__}")
    if rows.count == 0:
        raise ValueError("updates is empty: need at least one update (K >= 1)")
    if rows.d == 0:
        raise ValueError("updates are empty vectors (d = 0)")
    return rows


def _check_output(out: Any, name: str, like: ArrayRef, d: int) -> ArrayRef:
    ref = _arrays.describe(out, name)
    _arrays.check_same(ref, like, name, "updates")
    if ref.shape != (d,):
        raise ValueError(f"{name} must have shape ({d},), got {ref.shape}")
    _arrays.check_output(ref, name)
    return ref


def _same_view(a: ArrayRef, b: ArrayRef) -> bool:
    """Same elements in the same order: each output element then only reads its own inputs, which is safe."""
    return a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape


def _weights(weights: Any, like: ArrayRef, count: int) -> tuple[np.ndarray, int, Any]:
    """(host float64 weights, device pointer, device array to keep alive): weights on like's GPU stay there."""
    if like.device >= 0 and _arrays.is_array(weights):
        ref = _arrays.describe(weights, "weights")
        if ref.device >= 0:
            if ref.lib != like.lib or ref.device != like.device:
                raise ValueError(f"weights is a {ref.where} array but updates is a {like.where} array")
            if len(ref.shape) != 1 or ref.shape[0] != count:
                raise ValueError(f"weights must have shape ({count},), got {ref.shape}")
            if ref.dtype not in _arrays.FLOAT_DTYPES:
                raise TypeError(f"weights has dtype {ref.dtype}; expected a float dtype")
            acc = _arrays.as_contiguous(weights, "float64" if like.dtype == "float64" else "float32")
            return _NO_WEIGHTS, _arrays.data_ptr(acc), acc
    return _arrays.host_float64(weights, "weights", length=count), 0, None


def _run(out: ArrayRef, rows: RowSet, host_weights: np.ndarray, device_weights: int, accumulate: bool) -> None:
    _arrays.call_native(
        native().weighted_sum,
        out,
        out.device,
        _arrays.stream_handle(out),
        out.dtype,
        out.shape[0],
        out.ptr,
        out.strides[0],
        *rows.native_args(),
        host_weights,
        device_weights,
        accumulate,
    )
    _arrays.mark_written(out)


def weighted_sum(updates: Any, weights: Any, out: A | None = None) -> A:
    """Σ_k weights[k]·updates[k] in one pass over memory.

    Args:
        updates: a [K, d] array or a list of K 1-D arrays of length d (numpy, torch CPU/CUDA or cupy; float32,
            float64, float16 or bfloat16; all the same library, device and dtype). Rows whose weight is exactly 0
            are never read, which is how a masked / active-set average is expressed.
        weights: K finite real numbers: a sequence or a host array (checked finite), or a float array on the
            updates' GPU, read there without a host synchronisation (not checked: a non-finite device weight gives
            non-finite outputs).
        out: optional [d] output of the same library, device and dtype. It may be one of the updates itself
            (same memory, same stride: ``x ← a·x + Σ b_k u_k`` in place) but must not partially overlap any.

    Returns:
        ``out``, or a new [d] array of the caller's library, device and dtype. Torch: differentiable in the updates
        and in tensor weights (with ``out``, the result is copied into it, as a torch ``out.copy_``).
    """
    if _declare.use_operator(updates, weights):
        return _weighted_sum_torch(updates, weights, out)
    return _weighted_sum(updates, weights, out)


def _weighted_sum(updates: Any, weights: Any, out: Any) -> Any:
    """The direct path of :func:`weighted_sum` (any library)."""
    rows = _update_rows(updates)
    first, d = rows.first, rows.d
    w, device_w, keep = _weights(weights, first, rows.count)
    if out is None:
        out = _arrays.empty_like_lib(first, (d,))
        out_ref = _arrays.describe(out, "out")
    else:
        out_ref = _check_output(out, "out", first, d)
        if rows.stack is None or out_ref.overlaps(rows.stack):
            lo, hi = out_ref.byte_span()
            for k, r in enumerate(rows.row_refs()):
                r_lo, r_hi = r.byte_span()
                zero = device_w == 0 and w[k] == 0
                if not zero and r_lo < hi and lo < r_hi and not _same_view(out_ref, r):
                    raise ValueError(f"out partially overlaps updates[{k}]; pass a separate output array")
    _run(out_ref, rows, w, device_w, accumulate=False)
    del keep  # device weights: read in stream order, and their memory is reused only in that order
    return out


def _weighted_sum_torch(updates: Any, weights: Any, out: Any) -> Any:
    """:func:`weighted_sum` through ``torch.ops.pyfedkern.weighted_sum`` (a list of updates is stacked)."""
    import torch

    if not isinstance(updates, torch.Tensor):
        updates = torch.stack(list(updates))
    if isinstance(weights, (list, tuple)):  # tensors among them keep their autograd history
        device = next((w.device for w in weights if isinstance(w, torch.Tensor)), None)
        weights = torch.stack([torch.as_tensor(w, dtype=torch.float64, device=device).reshape(()) for w in weights])
    elif not isinstance(weights, torch.Tensor):
        weights = torch.as_tensor(weights, dtype=torch.float64)
    result = _declare.torch_op("weighted_sum")(updates, weights)
    if out is not None and (out.shape != result.shape or out.dtype != result.dtype or out.device != result.device):
        raise ValueError(
            f"out must be a [{result.shape[0]}] {result.dtype} tensor on {result.device}, like the updates' rows; got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return result if out is None else out.copy_(result)


def _weighted_sum_fake(updates: Any, weights: Any) -> Any:
    rows = _update_rows(updates)  # the direct path's checks, and those of its weights (not read here)
    if weights.dim() != 1:
        raise ValueError(f"weights must be 1-D, got shape {tuple(weights.shape)}")
    if weights.shape[0] != rows.count:
        raise ValueError(f"weights has length {weights.shape[0]}, expected {rows.count}")
    return updates.new_empty(updates.shape[1:])


def _weighted_sum_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _weighted_sum_backward(ctx: Any, grad: Any) -> tuple[Any, Any]:
    """∂/∂updates[k] = weights[k]·grad; ∂/∂weights[k] = ⟨updates[k], grad⟩ (accumulated in float64 for float64)."""
    updates, weights = ctx.saved_tensors
    grad_updates = grad_weights = None
    if ctx.needs_input_grad[0]:
        w = weights.to(device=grad.device, dtype=_declare.accumulation_dtype(grad))
        grad_updates = (w[:, None] * grad.to(w.dtype)).to(updates.dtype)
    if ctx.needs_input_grad[1]:
        acc = _declare.accumulation_dtype(grad)
        grad_weights = (updates.to(acc) @ grad.to(acc)).to(device=weights.device, dtype=weights.dtype)
    return grad_updates, grad_weights


@_declare.declare(
    "weighted_sum",
    "(Tensor updates, Tensor weights) -> Tensor",
    fake=_weighted_sum_fake,
    setup_context=_weighted_sum_setup,
    backward=_weighted_sum_backward,
)
def _weighted_sum_native(updates: Any, weights: Any) -> Any:
    return _weighted_sum(updates, weights, None)


def accumulate_(acc: A, update: Any, weight: Any) -> A:
    """In place ``acc += weight·update`` (aggregate results as they arrive with O(1) models of memory).

    Args:
        acc: a 1-D float array (numpy, torch or cupy), updated in place.
        update: a 1-D array of acc's length, library, device and dtype; it may be ``acc`` itself but must not
            partially overlap it.
        weight: a finite real number or one-element array; a one-element array on acc's GPU is read there without
            a host synchronisation.

    Returns:
        ``acc``.
    """
    _declare.refuse_grad("accumulate_", ("update", "weight"), update, weight)
    if _declare.operator_needed(acc, update, weight):
        device_weight = _declare.is_tensor(weight)
        op = _declare.torch_op("accumulate_")
        op(acc, update, 0.0 if device_weight else float(weight), weight if device_weight else None)
        return acc
    return _accumulate(acc, update, weight)


@_declare.declare(
    "accumulate_",
    "(Tensor(a!) acc, Tensor update, float weight, Tensor? weight_tensor) -> ()",
    fake=_declare.checks_only(lambda acc, update, *_: _accumulate_operands(acc, update)),
    mutates=("acc",),
)
def _accumulate_native(acc: Any, update: Any, weight: float, weight_tensor: Any) -> None:
    _accumulate(acc, update, weight if weight_tensor is None else weight_tensor)


def _accumulate_operands(acc: Any, update: Any) -> tuple[ArrayRef, ArrayRef]:
    """The checked acc and update of :func:`accumulate_` (direct path and fake function)."""
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
    _arrays.check_output(acc_ref, "acc")
    if acc_ref.overlaps(upd) and not _same_view(acc_ref, upd):
        raise ValueError("update partially overlaps acc; pass acc itself or a separate array")
    return acc_ref, upd


def _accumulate(acc: Any, update: Any, weight: Any) -> Any:
    """The direct path of :func:`accumulate_` (any library)."""
    acc_ref, upd = _accumulate_operands(acc, update)
    if acc_ref.device >= 0 and _arrays.is_array(weight) and _arrays.describe(weight, "weight").device >= 0:
        if math.prod(weight.shape) != 1:
            raise ValueError(f"weight must be a single number, got shape {tuple(weight.shape)}")
        w, device_w, keep = _weights(weight.reshape(1), acc_ref, 1)  # read on the device
    else:
        w, device_w, keep = np.array([_arrays.host_scalar(weight, "weight")]), 0, None
    _run(acc_ref, RowSet(upd, None, [upd], 1, upd.shape[0]), w, device_w, accumulate=True)
    del keep
    return acc
