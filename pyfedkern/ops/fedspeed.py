"""FedSpeed local-step ops over flat [d] parameter/gradient buffers: one call per step for the whole model.

- :func:`sam_perturb`: the ascent point x̆ = x + (ρ/(‖g‖₂ + ε))·g written to a second buffer (x is never restored).
- :func:`fedspeed_update_`: the fused prox-corrected step x ← x − η[(1−α)g1 + αg2 + c·(x + D) + wd·x] with
  c = 1/λ and D = h_i − x^t (the storage form h_i = −λ·ĝ_i), or the reference code's clipped form.
- :func:`fedspeed_round_end_`: h_i += x_K − x^t and the server's running sum acc += w·(x_K + h_i).

All three accept numpy arrays, torch tensors (CPU or CUDA) and cupy arrays of float32/float64 (float16/bfloat16
storage with float32 arithmetic), read strided views in place, release the GIL and give the same bits for any
number of CPU threads (norms: double-precision partial sums over fixed chunks, added in order). On the GPU they
run on the caller's current stream and the norms stay on the device (``norm_out``): no host synchronisation.
Norm outputs are one-element arrays of the accumulation dtype (float64 for float64 inputs, else float32).
Torch tensors are read and written as data: the ops are not differentiable, an input or output that requires grad
is refused while grad mode is on, and written tensors get their autograd version bumped (as torch's own in-place
ops). Inside ``torch.compile``/``torch.export`` they run as ``torch.ops.pyfedkern.<name>`` (declared below).

Row forms (batched FL clients): pass [k, d] matrices instead of [d] vectors and each row is one client's vector,
handled exactly as the 1-D op would handle it (bit for bit on the CPU): :func:`sam_perturb` and
:func:`fedspeed_update_` compute one norm per row (``norm_out`` then has k elements); :func:`fedspeed_round_end_`
updates every row of h, takes x_global as one [d] vector shared by all rows (or [k, d]), and adds every row's
term to the [d] accumulators ``acc`` and ``h_sum``, in row order.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef
from pyfedkern._runtime import native
from pyfedkern.ops import _declare

A = TypeVar("A")


def _vector(x: Any, name: str) -> ArrayRef:
    ref = _arrays.describe(x, name)
    if len(ref.shape) != 1:
        raise ValueError(f"{name} must be a 1-D [d] vector, got shape {ref.shape} (flatten it first)")
    _arrays.check_float_dtype(ref, name)
    if ref.shape[0] == 0:
        raise ValueError(f"{name} is empty (d = 0)")
    return ref


def _like(x: Any, name: str, like: ArrayRef, like_name: str) -> ArrayRef:
    ref = _vector(x, name)
    _arrays.check_same(ref, like, name, like_name)
    if ref.shape != like.shape:
        raise ValueError(f"{name} has length {ref.shape[0]}, expected {like.shape[0]} (the length of {like_name})")
    return ref


def _same_view(a: ArrayRef, b: ArrayRef) -> bool:
    return a.ptr == b.ptr and a.strides == b.strides and a.shape == b.shape


def _disjoint(out: ArrayRef, out_name: str, others: dict[str, ArrayRef | None]) -> None:
    for name, ref in others.items():
        if ref is not None and out.overlaps(ref):
            raise ValueError(f"{out_name} overlaps {name}; pass separate arrays")


def _scalar(value: Any, name: str, *, low: float | None = None, high: float | None = None, strict: bool = False):
    v = _arrays.host_scalar(value, name)
    if low is not None and (v < low or (strict and v == low)):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {v}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {v}")
    return v


def _acc_dtype(ref: ArrayRef) -> str:
    return "float64" if ref.dtype == "float64" else "float32"


def _norm_target(norm_out: Any, like: ArrayRef, operands: dict[str, ArrayRef | None]) -> ArrayRef | None:
    """norm_out checked against x (``like``): one element for a [d] vector, [k] for [k, d] rows (accumulation dtype,
    x's library and device), overlapping none of the call's ``operands``; or None."""
    if norm_out is None:
        return None
    ref = _arrays.describe(norm_out, "norm_out")
    if ref.lib != like.lib or ref.device != like.device:
        raise ValueError(f"norm_out is a {ref.where} array but x is a {like.where} array; mixing is not allowed")
    want = _acc_dtype(like)
    if ref.dtype != want:
        raise TypeError(f"norm_out has dtype {ref.dtype}, expected {want} (the accumulation dtype of {like.dtype})")
    if len(like.shape) == 1 and ref.size != 1:
        raise ValueError(f"norm_out must hold exactly one element, got shape {ref.shape}")
    if len(like.shape) == 2 and (len(ref.shape) != 1 or ref.shape[0] != like.shape[0]):
        raise ValueError(f"norm_out must be a [{like.shape[0]}] vector (one norm per row), got shape {ref.shape}")
    _arrays.check_output(ref, "norm_out")
    _disjoint(ref, "norm_out", operands)
    return ref


def _workspace(like: ArrayRef, norm: ArrayRef | None, needed: bool) -> tuple[Any, int, int, int, int]:
    """(keep-alive object, workspace ptr, workspace length, norm ptr, norm stride) for a call on like's device."""
    vector = len(like.shape) == 1
    norm_ptr, norm_stride = (0, 1) if norm is None else (norm.ptr, 1 if vector else norm.strides[0])
    if like.device < 0 or not needed:
        return None, 0, 0, norm_ptr, norm_stride
    rows = 1 if vector else like.shape[0]
    lib = native()
    size = int(lib.fedspeed_workspace_size() if vector else lib.fedspeed_row_workspace_size(like.shape[1], rows))
    ws = _arrays.empty_like_lib(like, (size + rows,), "float64")  # partial sums of squares in double
    ws_ref = _arrays.describe(ws, "workspace")
    if norm is None:  # the norms still have to live on the device: the slots after the partial sums
        norm_ptr, norm_stride = ws_ref.ptr + size * ws_ref.itemsize, 1
    return ws, ws_ref.ptr, size, norm_ptr, norm_stride


def _vector_arg(ref: ArrayRef | None) -> tuple[int, int]:
    """(pointer, stride) of a [d] vector, or (0, 1) when it is absent."""
    return (0, 1) if ref is None else (ref.ptr, ref.strides[0])


def _forms(x: Any, name: str) -> tuple[Any, Any]:
    """The operand checks of x's form: (_vector, _like) for a [d] vector, (_matrix, _matrix_like) for [k, d] rows
    (``name``: the argument's name in errors)."""
    return (_matrix, _matrix_like) if _is_rows(x, name) else (_vector, _like)


def _shape(ref: ArrayRef) -> tuple[bool, int, int]:
    """(vector, rows, d) of a [d] vector or [rows, d] matrix, for the native ops."""
    return (True, 1, ref.shape[0]) if len(ref.shape) == 1 else (False, *ref.shape)


def _strided(ref: ArrayRef | None) -> tuple[int, int, int]:
    """(pointer, row stride, stride) of a [d] vector (row stride 0), a [k, d] matrix, or an absent operand."""
    if ref is None:
        return 0, 0, 1
    return (ref.ptr, 0, ref.strides[0]) if len(ref.shape) == 1 else (ref.ptr, *ref.strides)


def sam_perturb(
    x: Any,
    grad: Any,
    rho: float,
    *,
    eps: float = 1e-7,
    normalize: bool = True,
    out: A | None = None,
    norm_out: Any = None,
) -> A:
    """The SAM/FedSpeed ascent point ``out = x + s·grad`` in one pass after one norm pass.

    Args:
        x, grad: [d] vectors of one library, device and dtype (parameters and the first minibatch gradient g1).
        rho: ascent radius ρ ≥ 0.
        eps: ε ≥ 0 of ``s = ρ/(‖grad‖₂ + ε)`` (FedSpeed's reference code uses 1e-7).
        normalize: True: s = ρ/(‖grad‖₂ + ε) (the paper's experiments, SAM); False: s = ρ (Algorithm 1 literally,
            no norm is computed and ``norm_out`` must be None).
        out: optional [d] output (the second parameter buffer x̆). It may be ``x`` itself (same view: in-place
            perturbation) but must not overlap ``grad`` or partially overlap ``x``.
        norm_out: optional one-element array (accumulation dtype, x's device) receiving ‖grad‖₂; it stays on the
            device for GPU inputs.

    Zero gradient: when ‖grad‖₂ + ε = 0 (an all-zero gradient with ε = 0) the scale is defined as s = 0, so
    ``out = x``; with ε > 0 a zero gradient also gives ``out = x``. No division by zero happens.

    Returns:
        ``out``, or a new [d] array of x's library, device and dtype.
    """
    _declare.refuse_grad("sam_perturb", ("x", "grad", "rho", "eps"), x, grad, rho, eps)
    if _declare.operator_needed(x, grad, out, norm_out):
        return _sam_perturb_torch(x, grad, rho, eps, normalize, out, norm_out)
    return _sam_perturb(x, grad, rho, eps=eps, normalize=normalize, out=out, norm_out=norm_out)


def _sam_perturb(x: Any, grad: Any, rho: Any, *, eps: Any, normalize: bool, out: Any, norm_out: Any) -> Any:
    """The direct path of :func:`sam_perturb` (any library, [d] or [k, d])."""
    xr, gr, r, e, out, outr, norm = _perturb_checked(x, grad, rho, eps, normalize, out, norm_out)
    keep, ws_ptr, ws_len, norm_ptr, norm_stride = _workspace(xr, norm, normalize)
    native().fedspeed_perturb(
        xr.device,
        _arrays.stream_handle(xr),
        xr.dtype,
        *_shape(xr),
        *_strided(xr),
        *_strided(gr),
        *_strided(outr),
        r,
        e,
        normalize,
        norm_ptr,
        norm_stride,
        ws_ptr,
        ws_len,
    )
    del keep
    _arrays.mark_written(outr, *([norm] if norm is not None else []))
    return out


def _perturb_checked(x: Any, grad: Any, rho: Any, eps: Any, normalize: Any, out: Any, norm_out: Any) -> tuple:
    """The checked operands of :func:`sam_perturb` (direct path and fake function): those of
    :func:`_perturb_operands` and norm_out's ref (or None)."""
    xr, gr, r, e, out, outr = _perturb_operands(*_forms(x, "x"), x, grad, rho, eps, normalize, out, norm_out)
    return xr, gr, r, e, out, outr, _norm_target(norm_out, xr, {"x": xr, "grad": gr, "out": outr})


def _perturb_operands(take, like, x, grad, rho, eps, normalize, out, norm_out):
    """The checked operands and scalars of :func:`sam_perturb` (``take``/``like`` describe vectors or [k, d]
    matrices): (x, grad, rho, eps, out (allocated when None), out's ref)."""
    xr = take(x, "x")
    gr = like(grad, "grad", xr, "x")
    r = _scalar(rho, "rho", low=0.0)
    e = _scalar(eps, "eps", low=0.0)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__qualname__}")
    if not normalize and norm_out is not None:
        raise ValueError("norm_out needs normalize=True (with normalize=False no norm is computed)")
    if out is None:
        out = _arrays.empty_like_lib(xr, xr.shape)
        return xr, gr, r, e, out, _arrays.describe(out, "out")
    outr = like(out, "out", xr, "x")
    _arrays.check_output(outr, "out")
    _disjoint(outr, "out", {"grad": gr})
    if outr.overlaps(xr) and not _same_view(outr, xr):
        raise ValueError("out partially overlaps x; pass x itself or a separate array")
    return xr, gr, r, e, out, outr


def _update_checked(x, g2, lr, g1, alpha, anchor, prox_coef, weight_decay, clip_norm, norm_out) -> tuple:
    """The checked operands of :func:`fedspeed_update_` (direct path and fake function): those of
    :func:`_update_operands` and norm_out's ref (or None)."""
    checked = _update_operands(
        *_forms(x, "x"), x, g2, lr, g1, alpha, anchor, prox_coef, weight_decay, clip_norm, norm_out
    )
    xr, g1r, g2r, anchor_r = checked[:4]
    return *checked, _norm_target(norm_out, xr, {"x": xr, "g1": g1r, "g2": g2r, "anchor": anchor_r})


def _update_operands(take, like, x, g2, lr, g1, alpha, anchor, prox_coef, weight_decay, clip_norm, norm_out):
    """The checked operands and scalars of :func:`fedspeed_update_` (``take``/``like`` describe vectors or [k, d]
    matrices): (x, g1 or None, g2, anchor or None, lr, alpha, prox_coef, weight_decay, clip_norm or 0)."""
    xr = take(x, "x")
    _arrays.check_output(xr, "x")
    g2r = like(g2, "g2", xr, "x")
    eta = _scalar(lr, "lr", low=0.0)
    a = _scalar(alpha, "alpha", low=0.0, high=1.0)
    c = _scalar(prox_coef, "prox_coef", low=0.0)
    wd = _scalar(weight_decay, "weight_decay", low=0.0)
    clip = 0.0 if clip_norm is None else _scalar(clip_norm, "clip_norm", low=0.0, strict=True)
    g1r = None
    if a < 1.0:
        if g1 is None:
            raise ValueError(f"g1 is required when alpha < 1 (alpha = {a})")
        g1r = like(g1, "g1", xr, "x")
    anchor_r = None
    if c > 0.0:
        if anchor is None:
            raise ValueError(f"anchor (D = h - x^t) is required when prox_coef > 0 (prox_coef = {c})")
        anchor_r = like(anchor, "anchor", xr, "x")
    if norm_out is not None and clip_norm is None:
        raise ValueError("norm_out needs clip_norm (the norm is only computed for clipping)")
    _disjoint(xr, "x", {"g1": g1r, "g2": g2r, "anchor": anchor_r})
    return xr, g1r, g2r, anchor_r, eta, a, c, wd, clip


def fedspeed_update_(
    x: A,
    g2: Any,
    lr: float,
    *,
    g1: Any = None,
    alpha: float = 1.0,
    anchor: Any = None,
    prox_coef: float = 0.0,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
    norm_out: Any = None,
) -> A:
    """FedSpeed's fused local step, in place: ``x ← x − lr·[k·(g̃ + c·D) + (c + wd)·x]``.

    With g̃ = (1−α)·g1 + α·g2, c = ``prox_coef`` = 1/λ and D = ``anchor`` = h_i − x^t this is
    x − lr·[g̃ + (1/λ)(x + D) + wd·x] = x − lr·[g̃ − ĝ_i + (1/λ)(x − x^t) + wd·x], Algorithm 1's step plus L2 weight
    decay. k = 1 unless ``clip_norm`` is given: then k = min(1, clip_norm/(‖g̃ + c·D‖₂ + 1e-6)), the reference code's
    ``clip_grad_norm_`` over the loss gradient plus the correction, followed by SGD with weight decay c + wd.

    Args:
        x: [d] parameters, updated in place.
        g2: [d] gradient at the perturbed point (always read).
        lr: step size η ≥ 0.
        g1: [d] gradient at x; required when α < 1, not read when α = 1.
        alpha: mix weight α ∈ [0, 1].
        anchor: [d] D = h_i − x^t; required when prox_coef > 0, not read when prox_coef = 0.
        prox_coef: c = 1/λ ≥ 0 (0: no prox and no correction term).
        weight_decay: wd ≥ 0.
        clip_norm: None (default, Algorithm 1) or M > 0 (the reference code uses 10).
        norm_out: optional one-element array receiving ‖g̃ + c·D‖₂ (only with clip_norm).

    The inputs must not overlap x. Returns ``x``.
    """
    _declare.refuse_grad(
        "fedspeed_update_",
        ("g2", "g1", "anchor", "lr", "alpha", "prox_coef", "weight_decay", "clip_norm"),
        g2, g1, anchor, lr, alpha, prox_coef, weight_decay, clip_norm,
    )  # fmt: skip
    if _declare.operator_needed(x, g2, g1, anchor, norm_out):
        _declare.torch_op("fedspeed_update_")(
            x, g2, float(lr), g1, float(alpha), anchor, float(prox_coef), float(weight_decay), clip_norm, norm_out
        )
        return x
    return _fedspeed_update(x, g2, lr, g1, alpha, anchor, prox_coef, weight_decay, clip_norm, norm_out)


def _fedspeed_update(
    x: Any,
    g2: Any,
    lr: Any,
    g1: Any,
    alpha: Any,
    anchor: Any,
    prox_coef: Any,
    weight_decay: Any,
    clip_norm: Any,
    norm_out: Any,
) -> Any:
    """The direct path of :func:`fedspeed_update_` (any library, [d] or [k, d])."""
    xr, g1r, g2r, anchor_r, eta, a, c, wd, clip, norm = _update_checked(
        x, g2, lr, g1, alpha, anchor, prox_coef, weight_decay, clip_norm, norm_out
    )
    keep, ws_ptr, ws_len, norm_ptr, norm_stride = _workspace(xr, norm, clip > 0.0)
    native().fedspeed_update(
        xr.device,
        _arrays.stream_handle(xr),
        xr.dtype,
        *_shape(xr),
        *_strided(xr),
        *_strided(g1r),
        *_strided(g2r),
        *_strided(anchor_r),
        1.0 - a,
        a,
        c,
        c + wd,
        eta,
        clip,
        norm_ptr,
        norm_stride,
        ws_ptr,
        ws_len,
    )
    del keep
    _arrays.mark_written(xr, *([norm] if norm is not None else []))
    return x


def _round_end_outputs(hr, acc_like, acc_like_name, xl, xg, acc, acc_weight, include_h, h_sum):
    """(acc_weight, the checked outputs {"h", "acc"?, "h_sum"?}) of :func:`fedspeed_round_end_`; ``acc`` and
    ``h_sum`` are [d] vectors like ``acc_like``; no output overlaps an input or another output."""
    w = _scalar(acc_weight, "acc_weight")
    if not isinstance(include_h, bool):
        raise TypeError(f"include_h must be a bool, got {type(include_h).__qualname__}")
    outs: dict[str, ArrayRef] = {"h": hr}
    for name, value in (("acc", acc), ("h_sum", h_sum)):
        if value is not None:
            ref = _like(value, name, acc_like, acc_like_name)
            _arrays.check_output(ref, name)
            outs[name] = ref
    names = list(outs)
    for i, name in enumerate(names):
        _disjoint(outs[name], name, {"x_local": xl, "x_global": xg, **{n: outs[n] for n in names[i + 1 :]}})
    return w, outs


def fedspeed_round_end_(
    h: A,
    x_local: Any,
    x_global: Any,
    *,
    acc: Any = None,
    acc_weight: float = 1.0,
    include_h: bool = True,
    h_sum: Any = None,
) -> A:
    """End of a FedSpeed client round in one pass: ``h += x_local − x_global``, then optionally
    ``acc += acc_weight·(x_local + h)`` (the upload x̂_i = x_K + h_i summed without being materialised; only
    ``acc_weight·x_local`` with include_h=False, the reference code's server) and ``h_sum += x_local − x_global``
    (a running Σ_m h_i for the reference server).

    Args:
        h: [d] the client's correction in storage form h_i = −λ·ĝ_i, updated in place.
        x_local: [d] x_{i,K}; x_global: [d] x^t.
        acc, h_sum: optional [d] accumulators, updated in place.
        acc_weight: finite weight of this client's upload (1/S for the plain mean of Algorithm 1).

    Outputs must not overlap each other or the inputs. Returns ``h``.
    """
    _declare.refuse_grad("fedspeed_round_end_", ("x_local", "x_global", "acc_weight"), x_local, x_global, acc_weight)
    if _declare.operator_needed(h, x_local, x_global, acc, h_sum):
        _declare.torch_op("fedspeed_round_end_")(h, x_local, x_global, acc, float(acc_weight), include_h, h_sum)
        return h
    return _round_end(h, x_local, x_global, acc, acc_weight, include_h, h_sum)


def _round_end_checked(h: Any, x_local: Any, x_global: Any, acc: Any, acc_weight: Any, include_h: Any, h_sum: Any):
    """The checked operands of :func:`fedspeed_round_end_` (direct path and fake function): (h, x_local, x_global,
    acc_weight, the outputs {"h", "acc"?, "h_sum"?})."""
    take, like = _forms(h, "h")
    hr = take(h, "h")
    _arrays.check_output(hr, "h")
    xl = like(x_local, "x_local", hr, "h")
    row = hr.row(0) if len(hr.shape) == 2 else hr  # acc and h_sum are [d] vectors like one row of h
    row_name = "a row of h" if len(hr.shape) == 2 else "h"
    if len(hr.shape) == 2 and len(_arrays.describe(x_global, "x_global").shape) == 1:  # one x^t for every row
        xg = _like(x_global, "x_global", row, row_name)
    else:
        xg = like(x_global, "x_global", hr, "h")
    w, outs = _round_end_outputs(hr, row, row_name, xl, xg, acc, acc_weight, include_h, h_sum)
    return hr, xl, xg, w, outs


def _round_end(h: Any, x_local: Any, x_global: Any, acc: Any, acc_weight: Any, include_h: Any, h_sum: Any) -> Any:
    """The direct path of :func:`fedspeed_round_end_` (any library, [d] or [k, d])."""
    hr, xl, xg, w, outs = _round_end_checked(h, x_local, x_global, acc, acc_weight, include_h, h_sum)
    accr, hsr = outs.get("acc"), outs.get("h_sum")
    native().fedspeed_round_end(
        hr.device,
        _arrays.stream_handle(hr),
        hr.dtype,
        *_shape(hr),
        *_strided(hr),
        *_strided(xl),
        *_strided(xg),
        *_vector_arg(accr),
        *_vector_arg(hsr),
        w,
        include_h,
    )
    _arrays.mark_written(*outs.values())
    return h


# torch.library declarations -----------------------------------------------------------------------------------


def _sam_perturb_torch(x: Any, grad: Any, rho: Any, eps: Any, normalize: bool, out: Any, norm_out: Any) -> Any:
    """:func:`sam_perturb` through ``torch.ops.pyfedkern.sam_perturb`` (``out`` is a mutated argument; in place on
    x itself it goes through a new tensor, as the operator's inputs may not alias its outputs)."""
    target = x.new_empty(x.shape) if out is None or out is x else out
    _declare.torch_op("sam_perturb")(x, grad, float(rho), float(eps), normalize, target, norm_out)
    if out is x:
        return x.copy_(target)
    return target


# Inductor lowerings (CPU, float32/float64, the common forms): the kernels' formulas in the kernels' order and
# accumulation dtype, built from inductor's lowerings so that inductor fuses them with the kernels producing the
# gradients. Any other call (CUDA, other dtypes, rows, clipping, a norm output, an argument the op would refuse)
# returns False and runs the kernel, which checks its arguments as in eager code.


def _lowerable(tensors: tuple[Any, ...], scalars: tuple[float, ...]) -> bool:
    """Whether the IR ``tensors`` are all CPU tensors of one float32/float64 dtype and ``scalars`` finite >= 0."""
    import torch

    dtype = tensors[0].get_dtype()
    return (
        dtype in (torch.float32, torch.float64)
        and all(t.get_device().type == "cpu" and t.get_dtype() == dtype for t in tensors)
        and all(math.isfinite(v) and v >= 0.0 for v in scalars)
    )


def _lower_sam_perturb(x, grad, rho, eps, normalize, out, norm_out) -> bool:
    """out = x + s·grad, s = ρ/(‖grad‖₂ + ε) (0 when that is 0) with the norm summed in float64, or s = ρ."""
    import torch
    from torch._inductor.lowering import lowerings as lower

    aten, prims = torch.ops.aten, torch.ops.prims
    if norm_out is not None or len(x.get_size()) != 1 or not _lowerable((x, grad, out), (rho, eps)):
        return False
    if normalize:
        g64 = lower[prims.convert_element_type.default](grad, torch.float64)
        norm = lower[aten.sqrt.default](lower[aten.sum.default](lower[aten.pow.Tensor_Scalar](g64, 2)))  # one load
        denom = lower[aten.add.Tensor](norm, eps)
        s = lower[aten.where.self](lower[aten.gt.Scalar](denom, 0.0), lower[aten.div.Tensor](rho, denom), 0.0)
        s = lower[prims.convert_element_type.default](s, x.get_dtype())
    else:
        s = rho
    lower[aten.copy_.default](out, lower[aten.add.Tensor](x, lower[aten.mul.Tensor](grad, s)))
    return True


def _lower_fedspeed_update(x, g2, lr, g1, alpha, anchor, prox_coef, weight_decay, clip_norm, norm_out) -> bool:
    """x ← x − lr·[(1−α)g1 + αg2 + c·D + (c + wd)·x] (g1 read only when α < 1, D only when c > 0)."""
    import torch
    from torch._inductor.lowering import lowerings as lower

    aten = torch.ops.aten
    read_g1, read_anchor = alpha < 1.0, prox_coef > 0.0
    if (
        clip_norm is not None
        or norm_out is not None
        or alpha > 1.0
        or (read_g1 and g1 is None)
        or (read_anchor and anchor is None)
    ):
        return False
    tensors = (x, g2, *([g1] if read_g1 else []), *([anchor] if read_anchor else []))
    if not _lowerable(tensors, (lr, alpha, prox_coef, weight_decay)):
        return False
    mul, add = lower[aten.mul.Tensor], lower[aten.add.Tensor]
    v = mul(g2, alpha)
    if read_g1:
        v = add(mul(g1, 1.0 - alpha), v)
    if read_anchor:
        v = add(v, mul(anchor, prox_coef))
    step = mul(add(v, mul(x, prox_coef + weight_decay)), lr)
    lower[aten.copy_.default](x, lower[aten.sub.Tensor](x, step))
    return True


@_declare.declare(
    "sam_perturb",
    "(Tensor x, Tensor grad, float rho, float eps, bool normalize, Tensor(a!) out, Tensor(b!)? norm_out) -> ()",
    fake=_declare.checks_only(_perturb_checked),
    mutates=("out", "norm_out"),
    lowering=_lower_sam_perturb,
)
def _sam_perturb_native(x: Any, grad: Any, rho: float, eps: float, normalize: bool, out: Any, norm_out: Any) -> None:
    _sam_perturb(x, grad, rho, eps=eps, normalize=normalize, out=out, norm_out=norm_out)


@_declare.declare(
    "fedspeed_update_",
    "(Tensor(a!) x, Tensor g2, float lr, Tensor? g1, float alpha, Tensor? anchor, float prox_coef, "
    "float weight_decay, float? clip_norm, Tensor(b!)? norm_out) -> ()",
    fake=_declare.checks_only(_update_checked),
    mutates=("x", "norm_out"),
    lowering=_lower_fedspeed_update,
)
def _fedspeed_update_native(
    x: Any,
    g2: Any,
    lr: float,
    g1: Any,
    alpha: float,
    anchor: Any,
    prox_coef: float,
    weight_decay: float,
    clip_norm: float | None,
    norm_out: Any,
) -> None:
    _fedspeed_update(x, g2, lr, g1, alpha, anchor, prox_coef, weight_decay, clip_norm, norm_out)


@_declare.declare(
    "fedspeed_round_end_",
    "(Tensor(a!) h, Tensor x_local, Tensor x_global, Tensor(b!)? acc, float acc_weight, bool include_h, "
    "Tensor(c!)? h_sum) -> ()",
    fake=_declare.checks_only(_round_end_checked),
    mutates=("h", "acc", "h_sum"),
)
def _round_end_native(
    h: Any, x_local: Any, x_global: Any, acc: Any, acc_weight: float, include_h: bool, h_sum: Any
) -> None:
    _round_end(h, x_local, x_global, acc, acc_weight, include_h, h_sum)


# Operands of the row forms ([k, d]: one client per row) -------------------------------------------------------


def _is_rows(x: Any, name: str) -> bool:
    return _arrays.is_array(x) and len(_arrays.describe(x, name).shape) == 2


def _matrix(x: Any, name: str) -> ArrayRef:
    ref = _arrays.describe(x, name)
    if len(ref.shape) != 2:
        raise ValueError(f"{name} must be a [k, d] matrix (one row per client), got shape {ref.shape}")
    _arrays.check_float_dtype(ref, name)
    if ref.shape[0] == 0 or ref.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {ref.shape})")
    return ref


def _matrix_like(x: Any, name: str, like: ArrayRef, like_name: str) -> ArrayRef:
    ref = _matrix(x, name)
    _arrays.check_same(ref, like, name, like_name)
    if ref.shape != like.shape:
        raise ValueError(f"{name} has shape {ref.shape}, expected {like.shape} (the shape of {like_name})")
    return ref
