"""Byzantine-robust server aggregation: the rule that replaces the weighted mean of a round's uploads.

An :class:`Aggregator` is parsed from a spec (``--aggregator``, ``Experiment(aggregator=...)``):

==================  ==========================================================================================
``mean``            the weighted mean Σ w_i·x_i / Σ w_i (the algorithms' own server step, unchanged)
``median``          the coordinate-wise weighted median (weights w_i)
``trimmed:β``       the coordinate-wise mean after dropping the ⌊βK⌋ smallest and largest values, 0 ≤ β < 0.5
``krum:f``          the upload with the lowest Krum score (sum of squared distances to its K − f − 2 nearest)
``multikrum:f,m``   the weighted mean (weights w_i) of the m uploads of lowest Krum score
``bulyan:f``        Bulyan: K − 2f uploads chosen by Multi-Krum, then the coordinate-wise mean of the K − 4f values
                    nearest their median (K ≥ 4f + 3)
``geomed``          the weighted geometric median (smoothed Weiszfeld iterations)
``cclip:τ[,n]``     centred clipping around the current global model, radius τ, n iterations (default 1)
==================  ==========================================================================================

All of them run on ``pyfedkern.ops``'s robust family. An algorithm takes part when its server step reads each vector of
its ``robust_vectors`` as a weighted mean ``sums.vector(name) / sums.scalar("weight")``; the round then keeps the K
uploaded rows of those vectors (K × d values each) for the rule (:meth:`pyfedkern.algorithms.Algorithm.round`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.data.spec import parse_spec
from pyfedkern.ops import robust as robust_ops

RULES = ("mean", "median", "trimmed", "krum", "multikrum", "bulyan", "geomed", "cclip")
#: The spec of each rule, for error messages and help.
USAGE = "mean | median | trimmed:β | krum:f | multikrum:f,m | bulyan:f | geomed | cclip:τ[,iters]"


@dataclass(frozen=True)
class Aggregator:
    """A parsed aggregation rule (:func:`parse_aggregator`): ``rule`` and its parameters (β of trimmed, f of the Krum
    family and Bulyan, m of Multi-Krum, τ and iters of centred clipping)."""

    rule: str = "mean"
    beta: float = 0.0
    f: int = 0
    m: int = 1
    tau: float = 0.0
    iters: int = 1

    @property
    def is_mean(self) -> bool:
        """Whether this is the plain weighted mean (the algorithm's own server step)."""
        return self.rule == "mean"

    def check_count(self, k: int) -> None:
        """ValueError naming ``aggregator`` unless the rule can combine ``k`` uploads."""
        need = {"krum": self.f + 1, "multikrum": max(self.f + 1, self.m), "bulyan": 4 * self.f + 3}.get(self.rule, 1)
        if k < need:
            raise ValueError(f"aggregator {self.spec}: needs at least {need} uploads in a round, got {k}")

    @property
    def spec(self) -> str:
        """The spec this aggregator was parsed from (normalised)."""
        args = {
            "trimmed": f":{self.beta:g}",
            "krum": f":{self.f}",
            "multikrum": f":{self.f},{self.m}",
            "bulyan": f":{self.f}",
            "cclip": f":{self.tau:g},{self.iters}",
        }
        return self.rule + args.get(self.rule, "")

    def combine(self, rows: torch.Tensor, weights: np.ndarray, centre: torch.Tensor) -> torch.Tensor:
        """The rule applied to ``rows`` [K, d] (the uploads) with the clients' ``weights`` float64 [K] (used by the
        weighted rules: median, multikrum, geomed); ``centre`` [d] is the point centred clipping starts from (the
        global model). Returns a new [d] tensor."""
        k = rows.shape[0]
        self.check_count(k)
        w = np.asarray(weights, dtype=np.float64)
        share = w / w.sum()
        if self.rule == "median":
            return robust_ops.coordinate_median(rows, weights=share)
        if self.rule == "trimmed":
            return robust_ops.trimmed_mean(rows, self.beta)
        if self.rule in ("krum", "multikrum"):
            chosen = np.asarray(robust_ops.krum_select(rows, self.f, m=self.m if self.rule == "multikrum" else 1))
            chosen = np.sort(chosen.astype(np.int64))
            picked = rows.index_select(0, torch.as_tensor(chosen, device=rows.device))
            return ops.weighted_sum(picked, w[chosen] / w[chosen].sum())
        if self.rule == "bulyan":
            return robust_ops.bulyan(rows, self.f)
        if self.rule == "geomed":
            return robust_ops.geometric_median(rows, weights=share)
        if self.rule == "cclip":
            return robust_ops.centred_clip(rows, centre, self.tau, iters=self.iters)
        raise AssertionError(self.rule)


def parse_aggregator(spec: str | Aggregator | None) -> Aggregator:
    """The :class:`Aggregator` of a spec such as ``"trimmed:0.1"`` (None and ``"mean"``: the weighted mean);
    ValueError naming ``aggregator`` for a malformed one."""
    if spec is None:
        return Aggregator()
    if isinstance(spec, Aggregator):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"aggregator must be a string such as 'median' or 'trimmed:0.1', got {spec!r}")
    rule, args = parse_spec(spec, what="aggregator", choices=RULES)
    counts = {"trimmed": (1, 1), "krum": (1, 1), "multikrum": (2, 2), "bulyan": (1, 1), "cclip": (1, 2)}
    low, high = counts.get(rule, (0, 0))
    if not low <= len(args) <= high:
        raise ValueError(f"aggregator {spec!r}: {rule} takes {_arguments(low, high)}; aggregators: {USAGE}")

    def whole(value: float, what: str, least: int) -> int:
        if not (math.isfinite(value) and value == int(value) and value >= least):
            raise ValueError(f"aggregator {spec!r}: {what} must be an integer >= {least}, got {value:g}")
        return int(value)

    if rule == "trimmed":
        if not 0 <= args[0] < 0.5:
            raise ValueError(f"aggregator {spec!r}: β must be in [0, 0.5), got {args[0]:g}")
        return Aggregator(rule, beta=args[0])
    if rule in ("krum", "bulyan"):
        return Aggregator(rule, f=whole(args[0], "f", 0))
    if rule == "multikrum":
        return Aggregator(rule, f=whole(args[0], "f", 0), m=whole(args[1], "m", 1))
    if rule == "cclip":
        if not (math.isfinite(args[0]) and args[0] > 0):
            raise ValueError(f"aggregator {spec!r}: τ must be finite and > 0, got {args[0]:g}")
        return Aggregator(rule, tau=args[0], iters=whole(args[1], "iters", 1) if len(args) > 1 else 1)
    return Aggregator(rule)


def _arguments(low: int, high: int) -> str:
    if high == 0:
        return "no argument"
    if low == high:
        return f"{low} argument{'s' if low > 1 else ''}"
    return f"{low} to {high} arguments"
