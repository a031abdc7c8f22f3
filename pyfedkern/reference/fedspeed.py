"""Reference FedSpeed step ops: the formulas of pyfedkern.ops.fedspeed written plainly, in float64.

Row forms ([k, d] inputs) apply the 1-D formula to each row in turn (x_global of round end may be one [d] vector for
every row; acc and h_sum gain the rows' terms in row order)."""

from __future__ import annotations

import math
from typing import Any

from pyfedkern.reference._xp import cast_like, to_float64


def _norm(v: Any) -> float:
    return math.sqrt(float((v * v).sum()))


def _new_like(x: Any) -> Any:
    """An uninitialised array of x's shape, dtype, library and device."""
    return x.copy() if hasattr(x, "copy") else x.clone()


def _store_norm(norm_out: Any, value: float) -> None:
    if norm_out is not None:
        norm_out[...] = value


def sam_perturb(
    x: Any,
    grad: Any,
    rho: float,
    *,
    eps: float = 1e-7,
    normalize: bool = True,
    out: Any = None,
    norm_out: Any = None,
) -> Any:
    """out = x + s·grad with s = ρ/(‖grad‖₂ + ε) (0 when the denominator is 0) or s = ρ."""
    if len(x.shape) == 2:
        out = _new_like(x) if out is None else out
        for r in range(x.shape[0]):
            norm = None if norm_out is None else norm_out[r : r + 1]
            sam_perturb(x[r], grad[r], rho, eps=eps, normalize=normalize, out=out[r], norm_out=norm)
        return out
    g = to_float64(grad)
    s = float(rho)
    if normalize:
        norm = _norm(g)
        _store_norm(norm_out, norm)
        denom = norm + float(eps)
        s = float(rho) / denom if denom > 0 else 0.0
    result = cast_like(to_float64(x) + s * g, x)
    if out is None:
        return result
    out[...] = result
    return out


def fedspeed_update_(
    x: Any,
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
) -> Any:
    """x ← x − lr·[k·((1−α)g1 + αg2 + c·D) + (c + wd)·x], k = 1 or min(1, M/(‖·‖₂ + 1e-6))."""
    if len(x.shape) == 2:
        for r in range(x.shape[0]):
            fedspeed_update_(
                x[r],
                g2[r],
                lr,
                g1=None if g1 is None else g1[r],
                alpha=alpha,
                anchor=None if anchor is None else anchor[r],
                prox_coef=prox_coef,
                weight_decay=weight_decay,
                clip_norm=clip_norm,
                norm_out=None if norm_out is None else norm_out[r : r + 1],
            )
        return x
    x64 = to_float64(x)
    v = float(alpha) * to_float64(g2)
    if float(alpha) < 1.0:
        v = (1.0 - float(alpha)) * to_float64(g1) + v
    c = float(prox_coef)
    if c > 0:
        v = v + c * to_float64(anchor)
    k = 1.0
    if clip_norm is not None:
        norm = _norm(v)
        _store_norm(norm_out, norm)
        k = min(1.0, float(clip_norm) / (norm + 1e-6))
    x[...] = cast_like(x64 - float(lr) * (k * v + (c + float(weight_decay)) * x64), x)
    return x


def fedspeed_round_end_(
    h: Any,
    x_local: Any,
    x_global: Any,
    *,
    acc: Any = None,
    acc_weight: float = 1.0,
    include_h: bool = True,
    h_sum: Any = None,
) -> Any:
    """h += x_local − x_global; acc += w·(x_local + h) (or w·x_local); h_sum += x_local − x_global."""
    if len(h.shape) == 2:
        for r in range(h.shape[0]):
            x_t = x_global if len(x_global.shape) == 1 else x_global[r]
            fedspeed_round_end_(h[r], x_local[r], x_t, acc=acc, acc_weight=acc_weight, include_h=include_h, h_sum=h_sum)
        return h
    xl = to_float64(x_local)
    delta = xl - to_float64(x_global)
    h_new = to_float64(h) + delta
    h[...] = cast_like(h_new, h)
    if acc is not None:
        upload = xl + h_new if include_h else xl
        acc[...] = cast_like(to_float64(acc) + float(acc_weight) * upload, acc)
    if h_sum is not None:
        h_sum[...] = cast_like(to_float64(h_sum) + delta, h_sum)
    return h
