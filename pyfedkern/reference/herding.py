"""Reference herding: BHerd's Algorithm 2 and GraB's Algorithm 4 written literally, in float64 NumPy.

Algorithm 2 is run as printed: centre the rows, then K times scan every remaining candidate m computing
‖s + z_m‖ directly (one pass over the [τ, d] buffer per step, O(K·τ·d)), take the first minimiser (lowest index),
and add its centred row to s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pyfedkern.ops.herding import check_alpha, selection_size
from pyfedkern.reference._xp import cast_like


def _numpy64(x: Any) -> np.ndarray:
    lib = type(x).__module__.split(".")[0]
    if lib == "torch":
        import torch

        return x.detach().to("cpu", torch.float64).numpy()
    if lib == "cupy":
        return x.get().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def _like(values: np.ndarray, like: Any) -> Any:
    """A numpy array moved to like's library and device (keeping its dtype)."""
    lib = type(like).__module__.split(".")[0]
    if lib == "torch":
        import torch

        return torch.as_tensor(values, device=like.device)
    if lib == "cupy":
        import cupy

        return cupy.asarray(values)
    return values


def _clients(grads: Any) -> tuple[list[Any], bool]:
    """(per-client matrices, whether the input was a list)."""
    if isinstance(grads, Sequence) and not isinstance(grads, (str, bytes)):
        return list(grads), True
    if len(grads.shape) == 3:
        return [grads[n] for n in range(grads.shape[0])], False
    return [grads], False


def centred_gram(grads: Any) -> Any:
    """float64 Gram matrices Z Zᵀ of the rows centred on their mean ([τ, τ], or [N, τ_max, τ_max] zero padded)."""
    clients, listed = _clients(grads)
    ys = [_numpy64(y) for y in clients]
    big = max(y.shape[0] for y in ys)
    gram = np.zeros((len(ys), big, big))
    for n, y in enumerate(ys):
        z = y - y.mean(0)
        gram[n, : y.shape[0], : y.shape[0]] = z @ z.T
    single = not listed and len(grads.shape) == 2
    return _like(gram[0] if single else gram, clients[0])


def herding_order_one(y: np.ndarray, k: int) -> tuple[list[int], np.ndarray]:
    """Algorithm 2 on one float64 [τ, d] matrix: (the k picks, the final centred sum s)."""
    z = y - y.mean(axis=0)
    s = np.zeros(y.shape[1])
    candidates = list(range(y.shape[0]))
    order: list[int] = []
    for _ in range(k):
        norms = [np.linalg.norm(s + z[m]) for m in candidates]
        j = candidates[int(np.argmin(norms))]  # argmin returns the first minimiser: the lowest index
        order.append(j)
        candidates.remove(j)
        s = s + z[j]
    return order, s


def herding_order(grads: Any, k: Any) -> Any:
    """The first k indices of the greedy herding permutation; same inputs and outputs as
    :func:`pyfedkern.ops.herding_order`."""
    mats, listed = _clients(grads)
    ks = list(k) if isinstance(k, Sequence) else [k] * len(mats)
    orders = [np.array(herding_order_one(_numpy64(y), kk)[0], dtype=np.int64) for y, kk in zip(mats, ks, strict=True)]
    first = mats[0]
    if listed or isinstance(k, Sequence):
        return [_like(o, first) for o in orders]
    if len(grads.shape) == 3:
        return _like(np.stack(orders), first)
    return _like(orders[0], first)


def herding_select(grads: Any, alpha: Any, *, return_gap: bool = False) -> tuple[Any, ...]:
    """(indices, Σ_selected y) with K = round(α·τ); same inputs and outputs as :func:`pyfedkern.ops.herding_select`.

    The sums are accumulated in float64 in ascending row order and cast to the gradients' dtype.
    """
    a = check_alpha(alpha)
    mats, listed = _clients(grads)
    orders, sums, gaps = [], [], []
    for y in mats:
        y64 = _numpy64(y)
        k = selection_size(y64.shape[0], a)
        order, s = herding_order_one(y64, k)
        orders.append(np.array(order, dtype=np.int64))
        sums.append(y64[np.sort(order)].sum(axis=0))
        gaps.append(np.linalg.norm(s) / k)
    first = mats[0]
    total = cast_like(_like(np.stack(sums), first), first)
    if listed:
        result = ([_like(o, first) for o in orders], total)
    elif len(grads.shape) == 3:
        result = (_like(np.stack(orders), first), total)
    else:
        result = (_like(orders[0], first), total[0])
    return (*result, np.array(gaps)) if return_gap else result


def grab_select(grads: Any, *, running_mean: bool = False) -> tuple[Any, Any]:
    """Algorithm 4's balancing over the rows of a [τ, d] matrix in float64; same outputs as
    :func:`pyfedkern.ops.grab_select`."""
    y = _numpy64(grads)
    tau, d = y.shape
    mean, s, g = np.zeros(d), np.zeros(d), np.zeros(d)
    picked = []
    for lam in range(1, tau + 1):
        mean = mean + (y[lam - 1] - mean) / lam if running_mean else mean + y[lam - 1] / tau
        z = y[lam - 1] - mean
        if np.dot(s, z) < 0:  # ‖s + z‖ < ‖s − z‖
            s, g = s + z, g + y[lam - 1]
            picked.append(lam - 1)
        else:
            s = s - z
    return _like(np.array(picked, dtype=np.int64), grads), cast_like(_like(g, grads), grads)
