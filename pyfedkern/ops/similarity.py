"""Similarity ops of the dynamic initial-model method: softmax weights of a query against K stored vectors, and
the blend Σ_k α_k·models_k.

``similarity_weights`` reads the query and the K bank rows once (one streaming pass computing, per included
segment, Σq², and per row Σq·b, Σb², Σ(q − b)²), turns the statistics into one score per row in double precision
and returns the max-subtracted softmax. ``similarity_combine`` then blends the K models with the aggregation
kernel of :func:`pyfedkern.ops.weighted_sum`, in the same native call. Metrics (score s_k, weight α_k):

- ``"l2"``: s_k = ‖q − b_k‖₂ over the included entries (the paper's eq. 5); α = softmax(−scale·s).
- ``"layer_l2"`` (default): s_k = (1/L)·Σ_l ‖q_l/‖q_l‖ − b_kl/‖b_kl‖‖₂ over the L included segments, each in
  [0, 2] (the authors' code); α = softmax(−scale·s).
- ``"layer_cos"``: s_k = (1/L)·Σ_l cos(q_l, b_kl); α = softmax(+scale·s).

A segment whose norm is ≤ ``eps`` is the zero vector after normalisation (distance 1 to a non-zero segment,
0 to another zero segment, cosine 0): no NaN. ``scale = 0`` gives the uniform mean; a huge scale gives one-hot
on the best row (ties share equally). The ops read strided inputs in place, run on the caller's current CUDA
stream, release the GIL and give the same bits for any number of CPU threads. float16/bfloat16 storage is
accumulated in float32 and double.

Torch: both ops are differentiable in the query, the bank and (for the blend) the models, through the registered
operators ``torch.ops.pyfedkern.similarity_weights`` / ``similarity_combine`` and their autograd formulas (taken
when an input requires grad or inside ``torch.compile``). The scores are not differentiable where a distance is 0
or a segment norm is at most ``eps``; the gradient there is taken as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef
from pyfedkern._runtime import native
from pyfedkern.ops import _declare

METRICS = {"l2": 0, "layer_l2": 1, "layer_cos": 2}


def _stack(x: Any, name: str) -> ArrayRef:
    """A [K, n] float array."""
    stack = _arrays.describe(x, name)
    if len(stack.shape) != 2:
        raise ValueError(f"{name} must be a 2-D [K, n] array or a list of K 1-D vectors, got shape {stack.shape}")
    _arrays.check_float_dtype(stack, name)
    return stack


def _rows(x: Any, name: str) -> list[ArrayRef]:
    """One 1-D ref per row of a [K, n] array or a list of K 1-D arrays, checked for common library/device/dtype."""
    if _arrays.is_array(x):
        stack = _stack(x, name)
        rows = [stack.row(k) for k in range(stack.shape[0])]
    elif isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        rows = [_arrays.describe(r, f"{name}[{k}]") for k, r in enumerate(x)]
        for k, r in enumerate(rows):
            if len(r.shape) != 1:
                raise ValueError(f"{name}[{k}] must be a 1-D vector, got shape {r.shape}")
        if rows:
            _arrays.check_float_dtype(rows[0], f"{name}[0]")
        for k, r in enumerate(rows[1:], start=1):
            _arrays.check_same(r, rows[0], f"{name}[{k}]", f"{name}[0]")
            if r.shape != rows[0].shape:
                raise ValueError(f"{name}[{k}] has length {r.shape[0]}, expected {rows[0].shape[0]} ({name}[0])")
    else:
        raise TypeError(f"{name} must be a 2-D array or a list of 1-D arrays, got {type(x).__qualname__}")
    if not rows:
        raise ValueError(f"{name} is empty: need at least one stored vector (K >= 1)")
    return rows


def _segments(segments: Any, include: Any, d: int) -> tuple[list[int], list[bool]]:
    """(offsets [L + 1], include flags [L]) checked against the query length d."""
    if segments is None:
        offsets = np.array([0, d], dtype=np.int64)
    else:
        if hasattr(segments, "segments") and hasattr(segments, "include_mask"):  # a pyfedkern.flat.FlatLayout
            if include is None:
                include = segments.include_mask()
            segments = segments.segments()
        raw = _arrays.host_array(segments.cpu() if hasattr(segments, "cpu") else segments, "segments")
        if raw.ndim != 1 or raw.shape[0] < 2:
            raise ValueError(f"segments must be 1-D offsets [L + 1] with L >= 1, got shape {raw.shape}")
        if raw.dtype.kind not in "iu":
            raise TypeError(f"segments must hold integers, got dtype {raw.dtype}")
        offsets = raw.astype(np.int64)
        if offsets[0] < 0 or offsets[-1] > d:
            raise ValueError(
                f"segments must lie within [0, {d}] (the query length), got offsets from {offsets[0]} to {offsets[-1]}"
            )
        steps = np.diff(offsets)
        if np.any(steps < 0):
            bad = int(np.flatnonzero(steps < 0)[0])
            raise ValueError(
                f"segments must be non-decreasing, but segments[{bad + 1}] = {offsets[bad + 1]} < "
                f"segments[{bad}] = {offsets[bad]}"
            )
    L = offsets.shape[0] - 1
    if include is None:
        mask = np.ones(L, dtype=bool)
    else:
        mask = _arrays.host_array(include.cpu() if hasattr(include, "cpu") else include, "include")
        if mask.ndim != 1 or mask.shape[0] != L:
            raise ValueError(f"include must be a 1-D mask of length {L} (one flag per segment), got shape {mask.shape}")
        if mask.dtype != bool:
            raise TypeError(f"include must be a boolean mask, got dtype {mask.dtype}")
    if not mask.any():
        raise ValueError("include selects no segment: at least one segment must be included")
    return offsets.tolist(), mask.tolist()


def _query(query: Any) -> ArrayRef:
    q = _arrays.describe(query, "query")
    if len(q.shape) != 1:
        raise ValueError(f"query must be a 1-D vector, got shape {q.shape}")
    _arrays.check_float_dtype(q, "query")
    if q.shape[0] == 0:
        raise ValueError("query is empty (d = 0)")
    return q


def _check_bank(first: ArrayRef, q: ArrayRef, scale: Any, metric: str, eps: Any) -> tuple[float, float]:
    """Checks the bank's first row against the query, and the options: (scale, eps)."""
    _arrays.check_same(first, q, "bank", "query")
    if first.shape[0] != q.shape[0]:
        raise ValueError(f"bank rows have length {first.shape[0]}, expected {q.shape[0]} (the length of query)")
    s = _arrays.host_scalar(scale, "scale")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    e = _arrays.host_scalar(eps, "eps")
    if e < 0:
        raise ValueError(f"eps must be >= 0, got {e}")
    return s, e


def _check_models(first: ArrayRef, count: int, q: ArrayRef, bank_count: int) -> None:
    """Checks the models' first row and their count against the query and the bank's count."""
    if first.lib != q.lib or first.device != q.device:
        raise ValueError(f"models is a {first.where} array but query is a {q.where} array; mixing is not allowed")
    if count != bank_count:
        raise ValueError(f"models has {count} rows, expected {bank_count} (one per bank row)")
    if first.shape[0] == 0:
        raise ValueError("models are empty vectors (d = 0)")


def _prepare(query: Any, bank: Any, scale: Any, metric: str, segments: Any, include: Any, eps: float):
    q = _query(query)
    d = q.shape[0]
    rows = _rows(bank, "bank")
    s, e = _check_bank(rows[0], q, scale, metric, eps)
    offsets, mask = _segments(segments, include, d)
    out_dtype = "float64" if q.dtype == "float64" else "float32"
    weights = _arrays.empty_like_lib(q, (len(rows),), out_dtype)
    scores = _arrays.empty_like_lib(q, (len(rows),), out_dtype)
    args = [
        q.device,
        _arrays.stream_handle(q),
        q.dtype,
        d,
        q.ptr,
        q.strides[0],
        [r.ptr for r in rows],
        [r.strides[0] for r in rows],
        offsets,
        mask,
        METRICS[metric],
        s,
        e,
        out_dtype,
        _arrays.describe(weights, "weights").ptr,
        _arrays.describe(scores, "scores").ptr,
    ]
    return q, rows, args, weights, scores


def similarity_weights(
    query: Any,
    bank: Any,
    scale: Any,
    metric: str = "layer_l2",
    segments: Any = None,
    include: Any = None,
    *,
    eps: float = 1e-12,
    return_scores: bool = False,
) -> Any:
    """Softmax weights α [K] of the K bank rows by their similarity to ``query``.

    Args:
        query: [d_s] float vector (numpy, torch CPU/CUDA or cupy; float32, float64, float16 or bfloat16).
        bank: [K, d_s] array or list of K [d_s] vectors of query's library, device and dtype (K >= 1).
        scale: finite real R (0 → uniform; large → one-hot on the nearest row).
        metric: "l2", "layer_l2" (default) or "layer_cos" (see the module docstring).
        segments: None (one segment: the whole vector), int offsets [L + 1] (segment l is
            ``[segments[l], segments[l + 1])``, non-decreasing, within [0, d_s]), or a
            :class:`pyfedkern.flat.FlatLayout` (its ``segments()``, and ``include_mask()`` unless include is given).
        include: bool [L] mask of the segments used (default all); excluded entries are never read.
        eps: a segment whose norm is <= eps counts as zero.
        return_scores: also return the scores s [K] (distances, or mean cosines for "layer_cos").

    Returns:
        α [K] (float64 for float64 input, float32 otherwise) of the caller's library and device, summing to 1;
        ``(α, s)`` with ``return_scores``.
    """
    _declare.refuse_grad("similarity_weights", ("scale", "eps"), scale, eps)
    if _declare.use_operator(query, bank):
        offsets, mask = _torch_segments(query, segments, include)
        weights, scores = _declare.torch_op("similarity_weights")(
            query, _stacked(bank), float(scale), metric, offsets, mask, float(eps)
        )
    else:
        weights, scores = _similarity_weights(query, bank, scale, metric, segments, include, eps)
    return (weights, scores) if return_scores else weights


def _similarity_weights(query: Any, bank: Any, scale: Any, metric: str, segments: Any, include: Any, eps: Any):
    """The direct path of :func:`similarity_weights` (any library): (weights, scores)."""
    q, _, args, weights, scores = _prepare(query, bank, scale, metric, segments, include, eps)
    _arrays.call_native(native().similarity_weights, q, *args)
    return weights, scores


def similarity_combine(
    query: Any,
    bank: Any,
    models: Any,
    scale: Any,
    metric: str = "layer_l2",
    segments: Any = None,
    include: Any = None,
    *,
    eps: float = 1e-12,
    out: Any = None,
    return_weights: bool = False,
) -> Any:
    """Σ_k α_k·models_k with α = :func:`similarity_weights` (query, bank, ...), in one native call.

    The weights pass and the blend pass (the aggregation kernel of :func:`pyfedkern.ops.weighted_sum`) run back
    to back without returning to Python; models whose weight underflows to 0 are not read. On a GPU the blend
    reads the weights on the device: no host synchronisation (non-finite inputs then give NaN weights and a NaN
    blend instead of the CPU's ValueError).

    Args:
        query, bank, scale, metric, segments, include, eps: as in :func:`similarity_weights`.
        models: [K, d] array or list of K [d] vectors (one per bank row) of query's library and device, in any
            float dtype (e.g. bfloat16 storage of a float32 query's history is fine).
        out: optional [d] output of the models' library, device and dtype, not overlapping any model.
        return_weights: also return α.

    Returns:
        ``out`` or a new [d] array of the models' dtype; ``(blend, α)`` with ``return_weights``.
    """
    _declare.refuse_grad("similarity_combine", ("scale", "eps"), scale, eps)
    if _declare.use_operator(query, bank, models):
        offsets, mask = _torch_segments(query, segments, include)
        blend, weights, _ = _declare.torch_op("similarity_combine")(
            query, _stacked(bank), _stacked(models), float(scale), metric, offsets, mask, float(eps)
        )
        if out is not None:
            blend = out.copy_(blend)
    else:
        blend, weights, _ = _similarity_combine(query, bank, models, scale, metric, segments, include, eps, out)
    return (blend, weights) if return_weights else blend


def _similarity_combine(
    query: Any, bank: Any, models: Any, scale: Any, metric: str, segments: Any, include: Any, eps: Any, out: Any
) -> tuple[Any, Any, Any]:
    """The direct path of :func:`similarity_combine` (any library): (blend, weights, scores)."""
    q, rows, args, weights, scores = _prepare(query, bank, scale, metric, segments, include, eps)
    mrows = _rows(models, "models")
    _check_models(mrows[0], len(mrows), q, len(rows))
    dim = mrows[0].shape[0]
    if out is None:
        out = _arrays.empty_like_lib(mrows[0], (dim,))
        out_ref = _arrays.describe(out, "out")
    else:
        out_ref = _arrays.describe(out, "out")
        _arrays.check_same(out_ref, mrows[0], "out", "models")
        if out_ref.shape != (dim,):
            raise ValueError(f"out must have shape ({dim},), got {out_ref.shape}")
        _arrays.check_output(out_ref, "out")
        for k, r in enumerate(mrows):
            if out_ref.overlaps(r):
                raise ValueError(f"out overlaps models[{k}]; pass a separate output array")
    _arrays.call_native(
        native().similarity_combine,
        q,
        *args,
        mrows[0].dtype,
        dim,
        out_ref.ptr,
        out_ref.strides[0],
        [r.ptr for r in mrows],
        [r.strides[0] for r in mrows],
    )
    _arrays.mark_written(out_ref)
    return out, weights, scores


# torch.library declarations -----------------------------------------------------------------------------------


def _stacked(rows: Any) -> Any:
    """A [K, n] tensor of a tensor or of a list of K [n] tensors."""
    if _declare.is_tensor(rows):
        return rows
    import torch

    return torch.stack(list(rows))


def _torch_segments(query: Any, segments: Any, include: Any) -> tuple[list[int], list[bool]]:
    """(offsets, include flags) as Python lists for the operators: checked here in eager calls (floats are not
    offsets, integers not flags), and by the direct path when a traced call runs."""
    if not _declare.traced():
        return _segments(segments, include, query.shape[0])
    if hasattr(segments, "segments") and hasattr(segments, "include_mask"):  # a pyfedkern.flat.FlatLayout
        if include is None:
            include = segments.include_mask()
        segments = segments.segments()
    offsets = [0, query.shape[0]] if segments is None else [int(o) for o in segments]
    mask = [True] * (len(offsets) - 1) if include is None else [bool(f) for f in include]
    return offsets, mask


def _fake_stack(x: Any, name: str) -> ArrayRef:
    """The direct path's checks of a [K, n] tensor (its rows are not described one by one: K may be symbolic)."""
    stack = _stack(x, name)
    if stack.shape[0] == 0:
        raise ValueError(f"{name} is empty: need at least one stored vector (K >= 1)")
    return stack


def _weights_fake(query: Any, bank: Any, scale: float, metric: str, segments: Any, include: Any, eps: float):
    _check_bank(_fake_stack(bank, "bank").row(0), _query(query), scale, metric, eps)
    import torch

    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    return query.new_empty(bank.shape[:1], dtype=acc), query.new_empty(bank.shape[:1], dtype=acc)


def _combine_fake(query: Any, bank: Any, models: Any, *rest: Any):
    weights, scores = _weights_fake(query, bank, *rest)
    stack = _fake_stack(models, "models")
    _check_models(stack.row(0), stack.shape[0], _query(query), bank.shape[0])
    return models.new_empty(models.shape[1:]), weights, scores


def _weights_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    query, bank, scale, metric, segments, include, eps = inputs
    ctx.save_for_backward(query, bank, output[0])
    ctx.options = (scale, metric, segments, include, eps)


def _weights_backward(ctx: Any, grad_weights: Any, grad_scores: Any) -> tuple:
    query, bank, weights = ctx.saved_tensors
    dq, db = _score_grads(query, bank, weights, grad_weights, grad_scores, *ctx.options)
    return dq, db, None, None, None, None, None


def _combine_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    query, bank, models, scale, metric, segments, include, eps = inputs
    ctx.save_for_backward(query, bank, models, output[1])
    ctx.options = (scale, metric, segments, include, eps)


def _combine_backward(ctx: Any, grad_blend: Any, grad_weights: Any, grad_scores: Any) -> tuple:
    """blend = Σ_k α_k·models_k: ∂/∂models_k = α_k·grad, and ⟨models_k, grad⟩ joins the weights' gradient."""
    query, bank, models, weights = ctx.saved_tensors
    acc = weights.dtype
    g = grad_blend.to(acc)
    grad_models = (weights[:, None] * g).to(models.dtype) if ctx.needs_input_grad[2] else None
    through_weights = models.to(acc) @ g
    if grad_weights is not None:
        through_weights = through_weights + grad_weights
    dq, db = _score_grads(query, bank, weights, through_weights, grad_scores, *ctx.options)
    return dq, db, grad_models, None, None, None, None, None


def _score_grads(
    query: Any, bank: Any, weights: Any, grad_weights: Any, grad_scores: Any, scale: float, metric: str, *seg: Any
) -> tuple[Any, Any]:
    """(∂/∂query, ∂/∂bank) given the gradients of the weights α = softmax(σ·s) and of the scores s."""
    acc = weights.dtype
    gs = weights.new_zeros(weights.shape) if grad_scores is None else grad_scores.to(acc)
    if grad_weights is not None:
        ga = grad_weights.to(acc)
        sigma = scale if metric == "layer_cos" else -scale
        gs = gs + sigma * weights * (ga - (weights * ga).sum())
    dq, db = _score_input_grads(query.to(acc), bank.to(acc), gs, metric, *seg)
    return dq.to(query.dtype), db.to(bank.dtype)


def _score_input_grads(q: Any, b: Any, gs: Any, metric: str, offsets: list, include: list, eps: float):
    """(∂/∂q, ∂/∂b) of Σ_k gs_k·s_k for the metric's scores s (0 on excluded entries and where s is not
    differentiable: a zero distance, or a segment whose norm is at most eps)."""
    import torch

    dq, db = torch.zeros_like(q), torch.zeros_like(b)
    parts = [slice(lo, hi) for lo, hi, on in zip(offsets[:-1], offsets[1:], include, strict=True) if on]
    if metric == "l2":
        diff = torch.cat([q[p] - b[:, p] for p in parts], dim=1)
        dist = diff.norm(dim=1)
        coef = torch.where(dist > 0, gs / dist.masked_fill(dist == 0, 1), 0)
        step = coef[:, None] * diff
        start = 0
        for p in parts:
            width = p.stop - p.start
            dq[p] += step[:, start : start + width].sum(0)
            db[:, p] -= step[:, start : start + width]
            start += width
        return dq, db
    L = len(parts)
    for p in parts:
        u, nq = _unit(q[p], eps)
        v, nb = _unit(b[:, p], eps)
        if metric == "layer_l2":
            diff = u - v
            dist = diff.norm(dim=1)
            r = torch.where(dist > 0, gs / (L * dist.masked_fill(dist == 0, 1)), 0)[:, None] * diff
            du, dv = r.sum(0), -r
        else:  # layer_cos
            du, dv = (gs[:, None] * v).sum(0) / L, gs[:, None] * u / L
        dq[p] += _through_unit(u, nq, du, eps)
        db[:, p] += _through_unit(v, nb, dv, eps)
    return dq, db


def _unit(x: Any, eps: float) -> tuple[Any, Any]:
    """(x/‖x‖ along the last dimension, 0 where ‖x‖ ≤ eps; the norms ‖x‖ with a trailing dimension)."""
    n = x.norm(dim=-1, keepdim=True)
    return _where(n > eps, x / n.masked_fill(n <= eps, 1), 0), n


def _through_unit(u: Any, n: Any, du: Any, eps: float) -> Any:
    """The gradient reaching x through u = x/‖x‖: (du − u·⟨u, du⟩)/‖x‖ (0 where ‖x‖ ≤ eps)."""
    proj = du - u * (u * du).sum(-1, keepdim=True)
    return _where(n > eps, proj / n.masked_fill(n <= eps, 1), 0)


def _where(cond: Any, a: Any, b: float) -> Any:
    import torch

    return torch.where(cond, a, b)


@_declare.declare(
    "similarity_weights",
    "(Tensor query, Tensor bank, float scale, str metric, SymInt[] segments, bool[] include, float eps) "
    "-> (Tensor, Tensor)",
    fake=_weights_fake,
    setup_context=_weights_setup,
    backward=_weights_backward,
)
def _similarity_weights_native(
    query: Any, bank: Any, scale: float, metric: str, segments: list, include: list, eps: float
) -> tuple[Any, Any]:
    return _similarity_weights(query, bank, scale, metric, segments, include, eps)


@_declare.declare(
    "similarity_combine",
    "(Tensor query, Tensor bank, Tensor models, float scale, str metric, SymInt[] segments, bool[] include, "
    "float eps) -> (Tensor, Tensor, Tensor)",
    fake=_combine_fake,
    setup_context=_combine_setup,
    backward=_combine_backward,
)
def _similarity_combine_native(
    query: Any, bank: Any, models: Any, scale: float, metric: str, segments: list, include: list, eps: float
) -> tuple[Any, Any, Any]:
    return _similarity_combine(query, bank, models, scale, metric, segments, include, eps, None)
