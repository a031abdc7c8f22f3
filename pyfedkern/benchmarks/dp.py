"""Benchmark cases of the DP ops and of a central-DP round.

- ``gaussian_noise d=...``: ``ops.gaussian_noise_(x, σ, seed, round)`` (x += σ·z in one pass) against what torch
  code writes, ``x.add_(buf.normal_(), alpha=σ)``, and torch's ``normal_`` alone (filling a buffer); the limits are
  a copy of the same floats and (CPU) the generator's ARS-5 alone, one 32-bit word per float.
- ``clip_accumulate K=... d=...``: the clipped sum of K update rows around the global model against the torch idiom
  (norms of X − x, clip factors, their weighted sum); the limit is a sum of the stack.
- ``central_dp_round fedavg m=1000 synthetic(1,1) logreg``: one FedAvg round of 1,000 clients, all taking part
  (the engine benchmark's round), with central DP (clip 1, σ = 1, adaptive clip at the median) and without, the two
  alternated round by round.
- ``central_dp_round cifar10-shaped ...``: pfl-research's DP CIFAR-10 setup (clip 0.4, σ = 0.46743, noise cohort
  1,000; 50 of 1,000 users a round, ``--quick``: 6 of 60) on the engine benchmark's task (:mod:`.engine_models`),
  one thread: pyfedkern's ``--dp central`` round against its plain round, and pfl 0.6's round with its central
  Gaussian mechanism against its plain round (when ``pfl`` is installed), each pair alternated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern._runtime import native
from pyfedkern.benchmarks import engine
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size

NOISE_SIZES, QUICK_NOISE_SIZES = (1_630_000, 11_200_000), (1_630_000,)  # simple_cnn's and ResNet-18's parameters
CLIP_SIZES, QUICK_CLIP_SIZES = ((10, 1_630_000), (100, 100_000), (1000, 7850)), ((100, 100_000),)
DP_SETTINGS = {"dp": "central", "dp_clip": 1.0, "dp_delta": 1e-5, "dp_noise_multiplier": 1.0, "dp_adaptive_clip": 0.5}
ROUND_CALLS, CIFAR_ROUND_CALLS = 15, 3
#: pfl-research's DP CIFAR-10 benchmark: clip 0.4, σ for ε = 2, δ = 1e-6 over 1,500 rounds at q = 1e-4 (PLD), noise
#: cohort 1,000. pyfedkern needs δ < 1/population, so its rounds account for a population of 1e5 (the accounting
#: does not change a round's work).
PFL_DP, PFL_DP_POPULATION = (0.4, 0.46743, 1000), 100_000


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """Groups of the noise, the clipped sum and (on the CPU) the central-DP round."""
    cache = InputCache()
    out: list[Case] = []
    for d in QUICK_NOISE_SIZES if quick else NOISE_SIZES:
        out += _noise_cases(cache, d, device)
    for k, d in QUICK_CLIP_SIZES if quick else CLIP_SIZES:
        out += _clip_cases(cache, k, d, device)
    if device == "cpu":
        config = engine.round_config("fedavg", 1000, "logreg", device)
        group = "central_dp_round fedavg m=1000 synthetic(1,1) logreg cpu"
        out += _alternated(
            group,
            ("pyfedkern central DP", lambda: engine.engine_round(replace(config, **DP_SETTINGS))),
            ("pyfedkern plain", lambda: engine.engine_round(config)),
            ROUND_CALLS,
        )
        out += _pfl_cifar_cases(quick)
    return out


def _alternated(group: str, first: tuple, second: tuple, rounds: int) -> list[Case]:
    """Two cases (name, builder of a round callable) whose timed calls alternate: each timed round of one follows
    an untimed round of the other (the same two runs), so both are timed under the same load."""
    built: dict[str, Callable[[], Any]] = {}

    def shared(name: str, build: Callable[[], Callable[[], Any]]) -> Callable[[], Callable[[], Any]]:
        def make() -> Callable[[], Any]:
            if name not in built:
                built[name] = build()
            return built[name]

        return make

    (a, build_a), (b, build_b) = first, second
    make_a, make_b = shared(a, build_a), shared(b, build_b)
    return [Case(group, a, make_a, before=make_b, rounds=rounds), Case(group, b, make_b, before=make_a, rounds=rounds)]


def _pfl_cifar_cases(quick: bool) -> list[Case]:
    """pfl-research's DP CIFAR-10 setup (:data:`PFL_DP`) on the engine benchmark's CIFAR-shaped task, 1 thread:
    pyfedkern's central DP and plain rounds, alternated, and pfl's (its central Gaussian mechanism) when installed."""
    from pyfedkern.benchmarks import engine_models as em

    clip, sigma, noise_cohort = PFL_DP
    settings = em.QUICK_CIFAR if quick else em.CIFAR
    ours = {
        "dp": "central",
        "dp_clip": clip,
        "dp_noise_multiplier": sigma,
        "dp_noise_cohort": noise_cohort,
        "dp_delta": 1e-6,
        "dp_population": PFL_DP_POPULATION,
    }
    group = (
        f"central_dp_round cifar10-shaped {settings['users']}×{settings['per_user']} simple_cnn fedavg "
        f"{settings['per_round']}/round B={settings['batch']} clip {clip} σ={sigma} noise cohort {noise_cohort} cpu t=1"
    )
    out = _alternated(
        group,
        ("pyfedkern central DP", lambda: em.fedavg_rounds(em.task_simulation("cifar", quick, None, **ours), 1)),
        ("pyfedkern plain", lambda: em.fedavg_rounds(em.task_simulation("cifar", quick, None), 1)),
        CIFAR_ROUND_CALLS,
    )
    if em.pfl_available():
        out += _alternated(
            group,
            ("pfl 0.6 central DP", lambda: em.pfl_rounds("cifar", quick, 1, PFL_DP)),
            ("pfl 0.6 plain", lambda: em.pfl_rounds("cifar", quick, 1)),
            CIFAR_ROUND_CALLS,
        )
    return out


def _noise_cases(cache: InputCache, d: int, device: str) -> list[Case]:
    def inputs() -> dict:
        return cache.get(("noise", d, device), lambda: {"x": torch.zeros(d, device=device), "buf": torch.empty(d)})

    group = f"gaussian_noise d={fmt_size(d)} float32 {device}"
    rounds = iter(range(10**9))

    def ours():
        x = inputs()["x"]
        return lambda: ops.gaussian_noise_(x, 0.1, 1234, next(rounds))

    def torch_normal_add():
        a = inputs()
        x, buf = a["x"], a["buf"].to(device)
        return lambda: x.add_(buf.normal_(), alpha=0.1)

    def torch_normal():
        buf = inputs()["buf"].to(device)
        return lambda: buf.normal_()

    def limit_copy():
        a = inputs()
        x, buf = a["x"], a["buf"].to(device)
        return lambda: buf.copy_(x)

    def limit_ars():
        words = np.empty((-(-d // 4), 4), np.uint32)
        return lambda: native().ars4x32_5(1234, 5, 0, words)

    nbytes = 2 * 4 * d
    out = [
        Case(group, "pyfedkern", ours, bytes_moved=nbytes, device=device),
        Case(group, "torch normal_+add_", torch_normal_add, bytes_moved=nbytes, device=device),
        Case(group, "torch normal_", torch_normal, bytes_moved=4 * d, device=device),
        Case(group, "limit:copy", limit_copy, bytes_moved=nbytes, device=device),
    ]
    if device == "cpu":
        out.append(Case(group, "limit:ars", limit_ars, bytes_moved=4 * d, device=device))
    return out


def _clip_cases(cache: InputCache, k: int, d: int, device: str) -> list[Case]:
    def inputs() -> dict:
        def build() -> dict:
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(d, generator=gen)
            return {"x": x.to(device), "X": (x + 0.01 * torch.randn(k, d, generator=gen)).to(device)}

        return cache.get(("clip", k, d, device), build)

    group = f"clip_accumulate K={k} d={fmt_size(d)} float32 {device}"

    def ours():
        a = inputs()
        return lambda: ops.clip_accumulate(a["X"], 0.5, center=a["x"])

    def idiom():
        a = inputs()

        def run():
            diffs = a["X"] - a["x"]
            norms = torch.linalg.vector_norm(diffs, dim=1)
            return (torch.clamp(0.5 / norms, max=1.0)[:, None] * diffs).sum(0)

        return run

    def limit_sum():
        a = inputs()
        return lambda: a["X"].sum(0)

    nbytes = (k + 2) * d * 4
    return [
        Case(group, "pyfedkern", ours, bytes_moved=nbytes, device=device),
        Case(group, "torch-idiom", idiom, bytes_moved=nbytes, device=device),
        Case(group, "limit:sum", limit_sum, bytes_moved=nbytes, device=device),
    ]
