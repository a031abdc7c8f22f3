"""Reference similarity ops: the per-segment loop in float64 (normalise each segment, distances or cosines,
softmax, weighted blend), written for clarity."""

from __future__ import annotations

from typing import Any

import numpy as np


def _numpy64(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        return x.detach().to("cpu", torch.float64).numpy()
    return x.get().astype(np.float64)  # cupy


def _like(values: np.ndarray, like: Any, dtype: str) -> Any:
    """values as an array of like's library and device with dtype ``dtype``."""
    if isinstance(like, np.ndarray):
        return values.astype(dtype)
    if type(like).__module__.split(".")[0] == "torch":
        import torch

        return torch.from_numpy(values).to(device=like.device, dtype=getattr(torch, dtype))
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(values.astype(dtype))


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _segment_slices(segments: Any, include: Any, d: int) -> list[slice]:
    if segments is None:
        return [slice(0, d)]
    if hasattr(segments, "include_mask"):
        include = segments.include_mask() if include is None else include
        segments = segments.segments()
    offsets = [int(o) for o in np.asarray(segments)]
    mask = [True] * (len(offsets) - 1) if include is None else [bool(f) for f in np.asarray(include)]
    return [slice(offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1) if mask[i]]


def _unit(v: np.ndarray, eps: float) -> np.ndarray:
    """v / ‖v‖, or the zero vector when ‖v‖ <= eps."""
    norm = np.linalg.norm(v)
    return v / norm if norm > eps else np.zeros_like(v)


def _scores(q: np.ndarray, bank: list[np.ndarray], metric: str, slices: list[slice], eps: float) -> np.ndarray:
    out = []
    for b in bank:
        if metric == "l2":
            out.append(np.sqrt(sum(np.sum((q[s] - b[s]) ** 2) for s in slices)))
        elif metric == "layer_l2":
            out.append(np.mean([np.linalg.norm(_unit(q[s], eps) - _unit(b[s], eps)) for s in slices]))
        elif metric == "layer_cos":
            out.append(np.mean([np.dot(_unit(q[s], eps), _unit(b[s], eps)) for s in slices]))
        else:
            raise ValueError(f"unknown metric {metric!r}")
    return np.array(out)


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
    """softmax(−scale·distance) (or softmax(+scale·cosine)) over the K bank rows, in float64."""
    q = _numpy64(query)
    rows = [_numpy64(bank[k]) for k in range(len(bank))]
    scores = _scores(q, rows, metric, _segment_slices(segments, include, q.shape[0]), eps)
    logits = float(scale) * (scores if metric == "layer_cos" else -scores)
    alpha = np.exp(logits - logits.max())
    alpha /= alpha.sum()
    dtype = "float64" if _dtype_name(query) == "float64" else "float32"
    weights = _like(alpha, query, dtype)
    return (weights, _like(scores, query, dtype)) if return_scores else weights


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
    """Σ_k α_k·models_k with α from :func:`similarity_weights`, in float64, stored in the models' dtype."""
    weights = similarity_weights(query, bank, scale, metric, segments, include, eps=eps)
    alpha = _numpy64(weights)
    blend = sum(a * _numpy64(models[k]) for k, a in enumerate(alpha))
    result = _like(blend, models[0], _dtype_name(models[0]))
    if out is not None:
        out[...] = result
        result = out
    return (result, weights) if return_weights else result
