"""Byzantine clients: a fraction of a round's participants replace their upload by an attack.

An :class:`Attack` is parsed from ``NAME:fraction[,parameter]`` (``--attack``, ``Experiment(attack=...)``). Each
round, ``round(fraction·K)`` of the K participants are drawn from the seeded stream ``ctx.rng(ATTACK_STREAM, t)``
(so a run is reproducible, and a resumed run draws what the uninterrupted one did). Every vector of the algorithm's
``robust_vectors`` is attacked as an update Δ_i = x_i − c around its centre c (the global model for uploaded
models); the attackers upload c + Δ' with

==============================  ===================================================================================
``signflip:p``                  Δ' = −Δ_i
``gaussian:p[,σ]``              Δ' = σ·ξ, ξ ~ N(0, I) (σ = 1 by default)
``scale:p[,s]``                 Δ' = s·Δ_i (s = 10 by default)
``alie:p[,z]``                  Δ' = μ − z·σ per coordinate ("a little is enough", Baruch et al. 2019), μ and σ the
                                mean and (population) standard deviation of the round's honest updates, z by
                                default the paper's z_max = Φ⁻¹((K − s)/K), s = ⌊K/2 + 1⌋ − f, f attackers
``ipm:p[,ε]``                   Δ' = −ε·μ (inner-product manipulation, Xie et al. 2020; ε = 0.1 by default)
==============================  ===================================================================================

The honest updates are the ones every participant computed (the attackers' own honest work included: they know
it), before any is replaced. Other uploads (SCAFFOLD's control deltas) and client state stay honest.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from pyfedkern.data.spec import parse_spec

ATTACKS = ("signflip", "gaussian", "scale", "alie", "ipm")
USAGE = "signflip:p | gaussian:p[,σ] | scale:p[,s] | alie:p[,z] | ipm:p[,ε] (p: the fraction of each round's clients)"
#: The purpose key of the attack's random stream (which clients attack, Gaussian noise).
ATTACK_STREAM = 0x415454  # "ATT"
_DEFAULTS = {"gaussian": 1.0, "scale": 10.0, "ipm": 0.1}


@dataclass(frozen=True)
class Attack:
    """A parsed attack (:func:`parse_attack`): its ``name``, the ``fraction`` of each round's participants that
    attack, and its ``parameter`` (σ, s, z or ε; None: the default, or ALIE's z_max)."""

    name: str
    fraction: float
    parameter: float | None = None

    @property
    def spec(self) -> str:
        """The normalised spec."""
        tail = "" if self.parameter is None else f",{self.parameter:g}"
        return f"{self.name}:{self.fraction:g}{tail}"

    def attackers(self, k: int, rng: np.random.Generator) -> np.ndarray:
        """The sorted positions (int64, among a round's k participants) of its attackers, drawn from ``rng``."""
        count = min(k, round(self.fraction * k))
        return np.sort(rng.choice(k, size=count, replace=False)).astype(np.int64)

    def alie_z(self, k: int, f: int) -> float:
        """z of "a little is enough" for k participants of which f attack: the given one, or the paper's
        Φ⁻¹((k − s)/k) with s = ⌊k/2 + 1⌋ − f (0 where that quantile is not inside (0, 1))."""
        if self.parameter is not None:
            return self.parameter
        s = math.floor(k / 2 + 1) - f
        q = (k - s) / k
        return statistics.NormalDist().inv_cdf(q) if 0 < q < 1 else 0.0

    def apply_(self, rows: torch.Tensor, centre: torch.Tensor, who: np.ndarray, rng: np.random.Generator) -> None:
        """Replace rows[who] ([K, d] uploads, in place) by the attack on the updates rows − ``centre``."""
        if who.size == 0:
            return
        index = torch.as_tensor(who, device=rows.device)
        delta = rows - centre
        if self.name == "signflip":
            bad = -delta.index_select(0, index)
        elif self.name == "scale":
            bad = delta.index_select(0, index) * self.parameter_or_default()
        elif self.name == "gaussian":
            noise = rng.standard_normal((who.size, rows.shape[1]))
            bad = torch.as_tensor(noise, dtype=rows.dtype, device=rows.device) * self.parameter_or_default()
        else:
            mean = delta.mean(dim=0)
            if self.name == "ipm":
                bad = (-self.parameter_or_default() * mean).expand(who.size, -1)
            else:  # alie
                std = delta.std(dim=0, correction=0)
                bad = (mean - self.alie_z(rows.shape[0], who.size) * std).expand(who.size, -1)
        rows.index_copy_(0, index, bad + centre)

    def parameter_or_default(self) -> float:
        """σ, s or ε: the given parameter or the attack's default."""
        return _DEFAULTS[self.name] if self.parameter is None else self.parameter


def parse_attack(spec: str | Attack | None) -> Attack | None:
    """The :class:`Attack` of a spec such as ``"signflip:0.2"`` (None, "" and "none": no attack); ValueError naming
    ``attack`` for a malformed one."""
    if spec is None or isinstance(spec, Attack):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"attack must be a string such as 'signflip:0.2', got {spec!r}")
    if spec.strip().lower() in ("", "none"):
        return None
    name, args = parse_spec(spec, what="attack", choices=ATTACKS)
    if not 1 <= len(args) <= (1 if name == "signflip" else 2):
        takes = "the fraction of attacking clients" + ("" if name == "signflip" else " and optionally its parameter")
        raise ValueError(f"attack {spec!r}: {name} takes {takes}; attacks: {USAGE}")
    fraction = args[0]
    if not 0 < fraction <= 1:
        raise ValueError(f"attack {spec!r}: the fraction must be in (0, 1], got {fraction:g}")
    parameter = args[1] if len(args) > 1 else None
    if parameter is not None and not math.isfinite(parameter):
        raise ValueError(f"attack {spec!r}: the parameter must be finite, got {parameter:g}")
    if name == "gaussian" and parameter is not None and parameter < 0:
        raise ValueError(f"attack {spec!r}: σ must be >= 0, got {parameter:g}")
    return Attack(name, fraction, parameter)
