"""FedPBC's quadratic experiment on plain vectors (Xiang et al. 2024, Sec. 7.1): F_i(x) = ½‖x − u_i‖².

Local gradient descent is exact and has a closed form: s steps of size η from x give u_i + (1−η)^s·(x − u_i). The
server steps use the same ops as the algorithms (:func:`pyfedkern.ops.pbc_agg_bcast_` for FedPBC,
:func:`pyfedkern.ops.weighted_delta_` for FedAvg), so thousands of rounds take a fraction of a second.
:func:`fedavg_limit` is Proposition 1: the point FedAvg's expected model converges to under Bernoulli links.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.links import LinkModel


def quadratic_targets(m: int = 100, d: int = 100, seed: int = 0) -> np.ndarray:
    """u_i ∼ N((i/1000)·1, 0.01·I) for i = 1..m, float64 [m, d]."""
    rng = np.random.default_rng(seed)
    return np.arange(1, m + 1)[:, None] / 1000.0 + 0.1 * rng.standard_normal((m, d))


def _others_expectation(p: np.ndarray) -> np.ndarray:
    """E[1/(1 + #active among the other clients)] for each client i (Poisson-binomial, exact)."""
    m = p.shape[0]
    out = np.empty(m)
    for i in range(m):
        dist = np.zeros(m)
        dist[0] = 1.0
        for j in range(m):
            if j != i:
                dist[1:] = dist[1:] * (1 - p[j]) + dist[:-1] * p[j]
                dist[0] *= 1 - p[j]
        out[i] = float((dist / np.arange(1, m + 1)).sum())
    return out


def fedavg_limit(u: np.ndarray, p: np.ndarray) -> np.ndarray:
    """lim E[x^T] of FedAvg with exact local GD, x^0 = 0 and Bernoulli(p_i) links:
    Σ_i p_i·u_i·E[1/(1 + #other active)] / (1 − Π_i(1 − p_i)). Independent of η and s."""
    p = np.asarray(p, dtype=np.float64)
    weights = p * _others_expectation(p) / (1.0 - np.prod(1.0 - p))
    return weights @ np.asarray(u, dtype=np.float64)


LATE_BLOCKS = 5  # batch means of the late average's standard error


@dataclass
class QuadraticRun:
    """Per-round ‖x^t − x*‖ of the server model and of the mean client model x̄^t, the final server model, the
    server model averaged over the second half of the rounds (an estimate of lim E[x^t]) and that average's standard
    error: ‖se‖₂ of the per-coordinate batch-means standard errors over ``LATE_BLOCKS`` consecutive blocks, i.e. the
    typical distance of the late average from lim E[x^t] due to the rounds' randomness."""

    server_error: np.ndarray
    mean_error: np.ndarray
    server: np.ndarray
    late_average: np.ndarray
    late_std_error: float


def simulate_quadratic(
    method: str, u: np.ndarray, links: LinkModel, *, lr: float, steps: int, rounds: int
) -> QuadraticRun:
    """Run ``method`` ("fedpbc" or "fedavg") for ``rounds`` rounds from x^0 = 0 in float64.

    FedPBC: every client moves its own model by s exact GD steps; the active ones average through
    pbc_agg_bcast_. FedAvg: the active clients start from x^t; x += (1/|A|)·Σ_A (x_i − x) (no-op when A is empty).
    """
    if method not in ("fedpbc", "fedavg"):
        raise ValueError(f"method must be 'fedpbc' or 'fedavg', got {method!r}")
    targets = torch.as_tensor(np.asarray(u, dtype=np.float64))
    m, d = targets.shape
    optimum = targets.mean(0)
    a = (1.0 - lr) ** steps
    x = torch.zeros(d, dtype=torch.float64)
    store = torch.zeros(m, d, dtype=torch.float64)
    server_err, mean_err = np.empty(rounds), np.empty(rounds)
    late = []
    for t in range(rounds):
        active = links.active_indices(t)
        if method == "fedpbc":
            store.sub_(targets).mul_(a).add_(targets)  # x_i ← u_i + a·(x_i − u_i) for every client
            ops.pbc_agg_bcast_(store, x, active)
            mean_err[t] = float(torch.linalg.vector_norm(store.mean(0) - optimum))
        elif active.size:
            local = targets[active] + a * (x - targets[active])
            ops.weighted_delta_(x, local, np.ones(active.size), 1.0 / active.size)
            mean_err[t] = float(torch.linalg.vector_norm(x - optimum))
        else:
            mean_err[t] = float(torch.linalg.vector_norm(x - optimum))
        server_err[t] = float(torch.linalg.vector_norm(x - optimum))
        if t >= rounds // 2:
            late.append(x.numpy().copy())
    late = np.stack(late)
    blocks = np.stack([b.mean(0) for b in np.array_split(late, min(LATE_BLOCKS, len(late)))])
    se = blocks.std(0, ddof=1) / np.sqrt(len(blocks)) if len(blocks) > 1 else np.full(d, np.nan)
    return QuadraticRun(server_err, mean_err, x.numpy().copy(), late.mean(0), float(np.linalg.norm(se)))
