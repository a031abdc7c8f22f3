"""Unreliable uplinks: which clients can reach the server in round t (FedPBC, Xiang et al. 2024, Sec. 7).

Base probabilities (:func:`lognormal_link_probs`): r'_k ∼ LogNormal(0, σ0) over the C classes, r = r'/‖r'‖₁,
p_i = max(δ, ⟨r, ν_i⟩) with ν_i client i's class distribution. Time variation (:func:`time_varying_probs`):
p_i^t = p_i·[(1−γ) + γ·sin(2πt/P)].

Patterns of :class:`LinkModel` (the uplink of client i in round t is ON with long-run frequency p_i):

- ``bernoulli``: ON ∼ Bern(p_i), independent over clients and rounds.
- ``bernoulli-tv``: ON ∼ Bern(p_i^t).
- ``markov``: a two-state chain per client with stationary ON probability p = p_i: OFF→ON with probability 0.05,
  ON→OFF with 0.05(1−p)/p (when 0.05(1−p) > p: OFF→ON p/(1−p), ON→OFF 1). The state of round 0 ∼ Bern(p_i^0);
  every later round applies one transition before it is read.
- ``markov-tv``: the same chain, non-homogeneous: the transition of round t uses p = p_i^t.
- ``cyclic``: ON for a_i = max(1, round(p_i·L)) rounds then OFF for max(1, L − a_i), after one initial OFF offset
  drawn uniformly from {0, …, OFF length} (switch-ons exactly one cycle apart).
- ``cyclic-reset``: each cycle [kL', (k+1)L') (L' = ON + OFF length) is ON during [kL' + o_k, kL' + o_k + a_i) with a
  fresh o_k ∼ U{0, …, OFF length}, so the gap between switch-ons is random.

Everything is a deterministic function of the seed: :meth:`LinkModel.active` may be called for any round in any
order (Markov chains are replayed from round 0 when asked for an earlier round), so a resumed run sees the same links
without saving link state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

PATTERNS = ("bernoulli", "bernoulli-tv", "markov", "markov-tv", "cyclic", "cyclic-reset")
TIME_VARYING = ("bernoulli-tv", "markov-tv")
MARKOV_RATE = 0.05  # OFF→ON probability of the Markov chains (the paper's value)

# Purposes of the random streams (first key after the seed).
_BERNOULLI, _MARKOV_INIT, _MARKOV_STEP, _CYCLIC = 1, 2, 3, 4


def _check_probs(probs: Any, name: str = "probs") -> np.ndarray:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of per-client probabilities, got shape {p.shape}")
    bad = ~(np.isfinite(p) & (p > 0) & (p <= 1))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} must lie in (0, 1], but {name}[{i}] = {p[i]}")
    return p


def check_gamma(gamma: float, delta: float | None = None) -> float:
    """γ as a float; ValueError unless 0 ≤ γ ≤ 1 and the time-varying lower bound (δ or p_i)·(1 − 2γ) > 0."""
    gamma = float(gamma)
    if not (math.isfinite(gamma) and 0 <= gamma <= 1):
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if gamma >= 0.5:
        floor = "p_i" if delta is None else f"delta={delta}"
        raise ValueError(
            f"gamma = {gamma} makes the lower bound {floor}·(1 − 2γ) ≤ 0, so some p_i^t would be 0; use gamma < 0.5"
        )
    return gamma


def lognormal_link_probs(
    class_dist: Any, *, sigma0: float = 10.0, delta: float = 0.02, rng: np.random.Generator | int = 0
) -> np.ndarray:
    """Per-client base probabilities p_i = max(δ, ⟨r, ν_i⟩) with r the normalised LogNormal(0, σ0) class weights.

    Args:
        class_dist: [m, C] non-negative class histograms or distributions ν_i (rows are normalised here).
        sigma0: σ0 ≥ 0 of the log-normal (the paper uses 10: r is dominated by a few classes).
        delta: floor δ ∈ (0, 1] of every p_i.
        rng: a numpy Generator or an integer seed.

    Returns:
        float64 [m] probabilities in [δ, 1].
    """
    nu = np.asarray(class_dist, dtype=np.float64)
    if nu.ndim != 2 or nu.shape[0] == 0 or nu.shape[1] == 0:
        raise ValueError(f"class_dist must be a non-empty [m, C] array, got shape {nu.shape}")
    if not np.all(np.isfinite(nu)) or np.any(nu < 0):
        raise ValueError("class_dist must be finite and non-negative")
    sums = nu.sum(axis=1, keepdims=True)
    if np.any(sums == 0):
        empty = int(np.flatnonzero(sums[:, 0] == 0)[0])
        raise ValueError(f"class_dist row {empty} is all zero (a client with no data)")
    if not (math.isfinite(sigma0) and sigma0 >= 0):
        raise ValueError(f"sigma0 must be finite and >= 0, got {sigma0}")
    if not (math.isfinite(delta) and 0 < delta <= 1):
        raise ValueError(f"delta must be in (0, 1], got {delta}")
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    z = sigma0 * gen.standard_normal(nu.shape[1])
    r = np.exp(z - z.max())  # r' / ‖r'‖₁ computed without overflow
    r /= r.sum()
    return np.maximum(delta, (nu / sums) @ r).clip(max=1.0)


def group_link_probs(values: Sequence[float], num_clients: int) -> np.ndarray:
    """Split clients 0..m−1 into len(values) contiguous, equal-as-possible groups with the given probabilities.

    ``group_link_probs([0.1, 0.9], 100)`` gives clients 0–49 p = 0.1 and 50–99 p = 0.9 (the quadratic experiment).
    """
    vals = _check_probs(values, "link probabilities")
    if num_clients < len(vals):
        raise ValueError(f"{len(vals)} probability groups need at least as many clients, got {num_clients}")
    groups = np.array_split(np.arange(num_clients), len(vals))
    out = np.empty(num_clients)
    for g, v in zip(groups, vals, strict=True):
        out[g] = v
    return out


def time_varying_probs(probs: Any, t: int, gamma: float, period: int) -> np.ndarray:
    """p_i^t = p_i·[(1−γ) + γ·sin(2πt/P)] for round t (γ < 0.5 keeps every p_i^t > 0)."""
    p = _check_probs(probs)
    return p * ((1.0 - gamma) + gamma * math.sin(2.0 * math.pi * t / period))


class LinkModel:
    """Which uplinks are ON in each round, for one of ``PATTERNS``.

    Args:
        probs: [m] base probabilities p_i in (0, 1].
        pattern: one of ``PATTERNS``.
        gamma: amplitude γ ∈ [0, 0.5) of the time variation (used by the ``-tv`` patterns).
        period: P ≥ 1 rounds of the time variation.
        cycle_length: L ≥ 1 rounds of a cyclic pattern's cycle.
        seed: integer seed of every random choice.
    """

    def __init__(
        self,
        probs: Any,
        pattern: str = "bernoulli",
        *,
        gamma: float = 0.3,
        period: int = 40,
        cycle_length: int = 100,
        seed: int = 0,
    ) -> None:
        if pattern not in PATTERNS:
            raise ValueError(f"unknown link pattern {pattern!r}; valid choices: {', '.join(PATTERNS)}")
        self.probs = _check_probs(probs)
        self.pattern = pattern
        self.gamma = check_gamma(gamma) if pattern in TIME_VARYING else float(gamma)
        if not (math.isfinite(self.gamma) and 0 <= self.gamma <= 1):
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        if isinstance(cycle_length, bool) or not isinstance(cycle_length, (int, np.integer)) or cycle_length < 1:
            raise ValueError(f"cycle_length must be an integer >= 1, got {cycle_length!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        self.period = int(period)
        self.cycle_length = int(cycle_length)
        self.seed = int(seed)
        m = self.num_clients
        self.on_rounds = np.maximum(1, np.round(self.probs * self.cycle_length)).astype(np.int64)
        self.off_rounds = np.maximum(1, self.cycle_length - self.on_rounds)
        self._cycle_offset = self._rng(_CYCLIC).integers(0, self.off_rounds + 1)  # the no-reset offsets
        self._markov_t = -1
        self._markov_state = np.zeros(m, dtype=bool)
        self._reset_cycle = np.full(m, -1, dtype=np.int64)
        self._reset_offset = np.zeros(m, dtype=np.int64)

    @property
    def num_clients(self) -> int:
        return int(self.probs.shape[0])

    def _rng(self, *keys: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *keys])

    def prob(self, t: int) -> np.ndarray:
        """The per-client ON probability of round t: p_i^t (``-tv``), the ON fraction a_i/(a_i + off_i) (cyclic),
        else p_i. This is what FedAvg with known p divides by."""
        if self.pattern in TIME_VARYING:
            return time_varying_probs(self.probs, t, self.gamma, self.period)
        if self.pattern.startswith("cyclic"):
            return self.on_rounds / (self.on_rounds + self.off_rounds)
        return self.probs.copy()

    def active(self, t: int) -> np.ndarray:
        """Boolean [m] mask of the clients whose uplink is ON in round t ≥ 0."""
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ValueError(f"round t must be an integer >= 0, got {t!r}")
        t = int(t)
        if self.pattern.startswith("bernoulli"):
            return self._rng(_BERNOULLI, t).random(self.num_clients) < self.prob(t)
        if self.pattern.startswith("markov"):
            return self._markov(t)
        return self._cyclic(t)

    def active_indices(self, t: int) -> np.ndarray:
        """Sorted int64 ids of the clients whose uplink is ON in round t."""
        return np.flatnonzero(self.active(t)).astype(np.int64)

    def _markov(self, t: int) -> np.ndarray:
        if t < self._markov_t:
            self._markov_t = -1
        while self._markov_t < t:
            s = self._markov_t + 1
            if s == 0:
                p0 = self.prob(0) if self.pattern == "markov-tv" else self.probs
                state = self._rng(_MARKOV_INIT).random(self.num_clients) < p0
            else:
                p = self.prob(s) if self.pattern == "markov-tv" else self.probs
                on_to_off, off_to_on = _markov_rates(p)
                u = self._rng(_MARKOV_STEP, s).random(self.num_clients)
                prev = self._markov_state
                state = np.where(prev, u >= on_to_off, u < off_to_on)
            self._markov_state, self._markov_t = state, s
        return self._markov_state.copy()

    def _cyclic(self, t: int) -> np.ndarray:
        cycle = self.on_rounds + self.off_rounds
        if self.pattern == "cyclic":
            shifted = t - self._cycle_offset
            return (shifted >= 0) & (np.mod(shifted, cycle) < self.on_rounds)
        k = t // cycle  # per-client cycle index; each cycle's offset is drawn once and cached
        for i in np.flatnonzero(k != self._reset_cycle):
            self._reset_offset[i] = self._rng(_CYCLIC, int(i), int(k[i])).integers(0, self.off_rounds[i] + 1)
            self._reset_cycle[i] = k[i]
        pos = t - k * cycle
        return (pos >= self._reset_offset) & (pos < self._reset_offset + self.on_rounds)


def _markov_rates(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ON→OFF, OFF→ON) transition probabilities with stationary ON probability p."""
    slow = MARKOV_RATE * (1.0 - p) > p
    off_to_on = np.where(slow, p / np.maximum(1.0 - p, 1e-300), MARKOV_RATE)
    on_to_off = np.where(slow, 1.0, MARKOV_RATE * (1.0 - p) / p)
    return on_to_off, off_to_on


def make_links(
    pattern: str,
    num_clients: int,
    *,
    probs: Sequence[float] | np.ndarray | None = None,
    class_dist: Any = None,
    sigma0: float = 10.0,
    delta: float = 0.02,
    gamma: float = 0.3,
    period: int = 40,
    cycle_length: int = 100,
    seed: int = 0,
) -> LinkModel:
    """A :class:`LinkModel` for m clients from explicit probabilities or the log-normal class-mix construction.

    Args:
        probs: m per-client probabilities, or g < m values given to g contiguous groups (:func:`group_link_probs`).
        class_dist: [m, C] class histograms for :func:`lognormal_link_probs` (used when ``probs`` is None).
        sigma0, delta: the log-normal construction's σ0 and floor δ; with a ``-tv`` pattern γ must satisfy
            δ(1 − 2γ) > 0.
    """
    if pattern not in PATTERNS:
        raise ValueError(f"unknown link pattern {pattern!r}; valid choices: {', '.join(PATTERNS)}")
    if pattern in TIME_VARYING:
        check_gamma(gamma, None if probs is not None else delta)
    if probs is not None and len(probs) > 0:
        p = np.asarray(probs, dtype=np.float64)
        p = p if p.shape[0] == num_clients else group_link_probs(p, num_clients)
    elif class_dist is not None:
        p = lognormal_link_probs(class_dist, sigma0=sigma0, delta=delta, rng=np.random.default_rng([seed, 0]))
        if p.shape[0] != num_clients:
            raise ValueError(f"class_dist has {p.shape[0]} rows, expected {num_clients} clients")
    else:
        raise ValueError("make_links needs probs or class_dist (per-client class histograms)")
    return LinkModel(p, pattern, gamma=gamma, period=period, cycle_length=cycle_length, seed=seed)
