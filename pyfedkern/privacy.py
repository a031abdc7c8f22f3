"""Differential privacy: the accountant wrapper (Google's ``dp-accounting``) and central (user-level) DP.

Accounting: a round (or a DP-SGD step) is the Poisson-subsampled Gaussian mechanism, sampling rate q and noise
multiplier σ, composed T times. :func:`epsilon` asks ``dp-accounting``'s RDP or PLD accountant for ε at δ;
:func:`noise_multiplier` finds the σ that spends a given (ε, δ) with ``dp-accounting``'s own calibration (a root
search over the accountant's ε). There is no accountant of our own.

Central DP (:class:`CentralDP`, McMahan et al. 2018): each participant's model update Δ_i = x_i − x is clipped to
ℓ2 norm C, the clipped updates are summed (:func:`pyfedkern.ops.clip_accumulate`), N(0, σ²C²·I) is added once to the
sum (:func:`pyfedkern.ops.gaussian_noise_`, a stream keyed by (seed, round), so it does not depend on how the
participants are spread over processes) and the server divides by the cohort size n. An algorithm takes it through
:meth:`Algorithm.round <pyfedkern.algorithms.base.Algorithm.round>` when it sets ``dp_upload`` (the name of its
uploaded model vector) and keeps the default round (docs/privacy.md lists which do).

Local DP-SGD (:mod:`pyfedkern.dpsgd`) is accounted by :class:`LocalDP`: each client's local steps, for the
worst-case client of a run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyfedkern import ops

ACCOUNTANTS = ("rdp", "pld")
#: Adaptive clipping (Andrew et al. 2021): the clip's geometric learning rate, and the noise of the count of
#: unclipped updates as a fraction of the (noise) cohort (their recommended n/20).
CLIP_LR = 0.2
COUNT_NOISE_FRACTION = 1 / 20
#: First key of the central-DP noise streams (after the seed): distinct from the engine's purposes.
NOISE_STREAM = 0x4450


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError:  # pragma: no cover - an optional dependency
        raise ImportError("differential privacy needs the dp-accounting package: pip install 'pyfedkern[dp]'") from None
    return dp_accounting


def _event(noise_multiplier: float, sampling_rate: float, steps: int) -> Any:
    """The DpEvent of ``steps`` compositions of the Poisson-subsampled Gaussian mechanism."""
    dp = _dp_accounting()
    gaussian = dp.GaussianDpEvent(noise_multiplier)
    one = gaussian if sampling_rate == 1 else dp.PoissonSampledDpEvent(sampling_rate, gaussian)
    return dp.SelfComposedDpEvent(one, steps)


def _accountant(name: str) -> Any:
    dp = _dp_accounting()
    if name == "rdp":
        return dp.rdp.RdpAccountant()
    if name == "pld":
        return dp.pld.PLDAccountant()
    raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {name!r}")


def check_accounting(delta: float, steps: int, sampling_rate: float, accountant: str = "rdp") -> None:
    """ValueError naming the argument unless δ ∈ (0, 1), steps ≥ 1, q ∈ (0, 1] and the accountant is known."""
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not (isinstance(sampling_rate, (int, float)) and 0 < sampling_rate <= 1):
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")


def epsilon(noise_multiplier: float, delta: float, steps: int, sampling_rate: float, accountant: str = "rdp") -> float:
    """ε at δ after ``steps`` Poisson-subsampled Gaussian steps (rate q, noise multiplier σ), by ``dp-accounting``'s
    ``accountant`` ("rdp" or "pld"); inf for σ = 0."""
    check_accounting(delta, steps, sampling_rate, accountant)
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}")
    return _spent(noise_multiplier, delta, int(steps), sampling_rate, accountant)


def _spent(sigma: float, delta: float, steps: int, sampling_rate: float, accountant: str) -> float:
    """:func:`epsilon` of checked arguments."""
    if sigma == 0:
        return math.inf
    acc = _accountant(accountant)
    acc.compose(_event(sigma, sampling_rate, steps))
    return float(acc.get_epsilon(delta))


#: The smallest noise multiplier :func:`noise_multiplier` searches: below it the PLD accountant's discretised loss
#: distribution outgrows memory (σ = 1e-3 asks for tens of GiB); a budget that allows less noise gets this σ.
LOWEST_SIGMA = 0.3


def noise_multiplier(epsilon: float, delta: float, steps: int, sampling_rate: float, accountant: str = "rdp") -> float:
    """The smallest σ ≥ :data:`LOWEST_SIGMA` (to 1e-6) whose ``steps`` Poisson-subsampled Gaussian steps at rate q
    spend at most (ε, δ), by ``dp-accounting``'s calibration over its ``accountant``'s ε."""
    check_accounting(delta, steps, sampling_rate, accountant)
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}")
    dp = _dp_accounting()
    if _spent(LOWEST_SIGMA, delta, int(steps), sampling_rate, accountant) <= epsilon:
        return LOWEST_SIGMA  # the budget allows less noise: the search's floor, conservatively
    try:
        return float(
            dp.calibrate_dp_mechanism(
                lambda: _accountant(accountant),
                lambda sigma: _event(sigma, sampling_rate, int(steps)),
                epsilon,
                delta,
                dp.LowerEndpointAndGuess(LOWEST_SIGMA, 2 * LOWEST_SIGMA),
            )
        )
    except dp.mechanism_calibration.NoBracketIntervalFoundError:
        raise ValueError(
            f"no noise multiplier reaches epsilon={epsilon} at delta={delta} over {steps} steps at sampling rate "
            f"{sampling_rate}: the budget is too small"
        ) from None


class EpsilonSchedule:
    """ε after t = 1, 2, ... rounds of one run, cheaply and with the numbers :func:`epsilon` gives: the RDP
    accountant composes one round once and converts t times its RDP curve (``dp-accounting``'s
    ``compute_epsilon``); the PLD accountant's one-round privacy loss distribution (seconds to discretise at small
    sampling rates) is built once and self-composed t times, as the accountant itself composes. Each t's ε is
    computed once (a resumed or re-logged round asks again)."""

    def __init__(self, noise_multiplier: float, delta: float, sampling_rate: float, accountant: str) -> None:
        self.args = (noise_multiplier, delta, sampling_rate, accountant)
        self._rdp: tuple[np.ndarray, np.ndarray] | None = None
        self._pld: Any = None
        self._spent: dict[int, float] = {0: 0.0}
        if noise_multiplier > 0 and accountant == "rdp":
            acc = _accountant("rdp")
            acc.compose(_event(noise_multiplier, sampling_rate, 1))
            self._rdp = (np.asarray(acc._orders, dtype=np.float64), np.asarray(acc._rdp, dtype=np.float64))
        elif noise_multiplier > 0 and sampling_rate < 1:  # (q = 1: the accountant's closed form, no discretisation)
            acc = _accountant("pld")
            self._interval = acc._value_discretization_interval
            self._pld = _dp_accounting().pld.privacy_loss_distribution.from_gaussian_mechanism(
                standard_deviation=noise_multiplier,
                value_discretization_interval=self._interval,
                sampling_prob=sampling_rate,
                neighboring_relation=acc.neighboring_relation,
            )

    def __call__(self, rounds: int) -> float:
        if rounds not in self._spent:
            self._spent[rounds] = self._compute(rounds)
        return self._spent[rounds]

    def _compute(self, rounds: int) -> float:
        sigma, delta, q, accountant = self.args
        if self._rdp is not None:
            orders, curve = self._rdp
            rdp = _dp_accounting().rdp.rdp_privacy_accountant
            return float(rdp.compute_epsilon(orders, rounds * curve, delta)[0])
        if self._pld is not None:  # PLDAccountant.compose: identity ∘ (one round)^t
            identity = _dp_accounting().pld.privacy_loss_distribution.identity(self._interval)
            whole = identity.compose(self._pld.self_compose(rounds))
            return float(whole.get_epsilon_for_delta(delta))
        return epsilon(sigma, delta, rounds, q, accountant)


@dataclass
class CentralDP:
    """User-level DP of a federated run's server aggregate (Gaussian mechanism on clipped model updates).

    Each round: Δ_i = x_i − x clipped to ℓ2 norm ``clip``, summed, N(0, (σ_Δ·clip·n/N')²) added once, the server
    divides by n (n the round's participants, N' = ``noise_cohort`` or n: pfl's noise-cohort trick simulates the
    noise of a cohort of N' with a smaller cohort). Accounted as ``rounds`` Poisson-subsampled Gaussian rounds at
    rate N'/``population`` with multiplier σ = ``noise_multiplier``.

    Adaptive clipping (``target_quantile`` γ, Andrew et al. 2021): each client also reports b_i = 1[‖Δ_i‖ ≤ C]; the
    server noises their sum with N(0, (σ_b·n/N')²), σ_b = N'/20, and updates C ← C·exp(−0.2·(b̄ − γ)). The two
    Gaussian queries together are charged as one of multiplier σ: the update's noise is σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)
    (the count's sensitivity is 1/2 after centring), so adaptive clipping spends no extra budget but adds a little
    noise to the update.

    Args:
        clip: C > 0, finite (the initial clip with adaptive clipping); ``math.inf`` only with σ = 0 (no clipping,
            no noise: the uniform-weight mean, for checks).
        noise_multiplier: σ ≥ 0 (0: clipping only, no privacy: ε = inf).
        delta: δ ∈ (0, 1/population).
        population: clients the cohort is drawn from (the sampling rate's denominator).
        cohort: participants per round n (the engine's round(fraction·clients)).
        rounds: rounds T the budget covers.
        noise_cohort: N' ≥ cohort, or None for n.
        target_quantile: γ ∈ (0, 1) for adaptive clipping, None for a fixed clip.
        accountant: "rdp" or "pld" (``dp-accounting``'s).
    """

    clip: float
    noise_multiplier: float
    delta: float
    population: int
    cohort: int
    rounds: int
    noise_cohort: int | None = None
    target_quantile: float | None = None
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        for name in ("population", "cohort", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"dp {name} must be an integer >= 1, got {value!r}")
        if self.cohort > self.population:
            raise ValueError(f"dp cohort ({self.cohort}) must be at most the population ({self.population})")
        if self.noise_cohort is not None and not (
            isinstance(self.noise_cohort, (int, np.integer)) and self.cohort <= self.noise_cohort <= self.population
        ):
            raise ValueError(
                f"dp noise_cohort must be an integer from the cohort ({self.cohort}) to the population "
                f"({self.population}), got {self.noise_cohort!r}"
            )
        if not (self.clip == math.inf and self.noise_multiplier == 0):
            check_clip(self.clip)
        if not (isinstance(self.noise_multiplier, (int, float)) and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"dp noise_multiplier must be a finite number >= 0, got {self.noise_multiplier!r}")
        if self.noise_multiplier < 0:
            raise ValueError(f"dp noise_multiplier must be >= 0, got {self.noise_multiplier}")
        check_delta(self.delta, self.population)
        if self.target_quantile is not None:
            if not (isinstance(self.target_quantile, (int, float)) and 0 < self.target_quantile < 1):
                raise ValueError(f"dp adaptive clip quantile must be in (0, 1), got {self.target_quantile!r}")
            if self.noise_multiplier > 0 and 2 * self.count_std <= self.noise_multiplier:
                raise ValueError(
                    f"adaptive clipping needs 2·σ_b > σ (σ_b = noise cohort/20 = {self.count_std:g}, "
                    f"σ = {self.noise_multiplier:g}): use a larger (noise) cohort or a fixed clip"
                )
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"dp accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        self.initial_clip = float(self.clip)
        self._epsilon = EpsilonSchedule(self.noise_multiplier, self.delta, self.sampling_rate, self.accountant)

    @classmethod
    def for_epsilon(cls, epsilon: float, **settings: Any) -> CentralDP:
        """The CentralDP whose σ spends (``epsilon``, delta) over its rounds (:func:`noise_multiplier`)."""
        probe = cls(noise_multiplier=0.0, **settings)
        sigma = noise_multiplier(epsilon, probe.delta, probe.rounds, probe.sampling_rate, probe.accountant)
        return cls(noise_multiplier=sigma, **settings)

    @property
    def sampling_rate(self) -> float:
        """q = N'/population, the rate the accountant assumes."""
        return (self.noise_cohort or self.cohort) / self.population

    @property
    def count_std(self) -> float:
        """σ_b, the noise of the count of unclipped updates (on the noise cohort's scale)."""
        return COUNT_NOISE_FRACTION * (self.noise_cohort or self.cohort)

    @property
    def update_noise_multiplier(self) -> float:
        """The multiplier σ_Δ of the update's noise: σ, or with adaptive clipping (σ⁻² − (2σ_b)⁻²)^(−1/2)."""
        if self.target_quantile is None or self.noise_multiplier == 0:
            return self.noise_multiplier
        return (self.noise_multiplier**-2 - (2 * self.count_std) ** -2) ** -0.5

    def epsilon(self, rounds: int | None = None) -> float:
        """ε spent after ``rounds`` rounds (default: all of the run's)."""
        return self._epsilon(self.rounds if rounds is None else rounds)

    def accumulate(self, algorithm: Any, t: int, sums: Any, updates: Any, ctx: Any) -> None:
        """Fold a chunk of participants' updates into the round's sums as ``algorithm.accumulate`` does, with every
        weight 1 and the uploaded model vector ``algorithm.dp_upload`` replaced by its clipped update: the sum of
        that name becomes Σ clip(x_i − x) (and ``dp_unclipped`` counts the updates within the clip)."""
        uniform = dataclasses.replace(updates, weights=np.ones(len(updates)))
        algorithm.accumulate(t, _ClippedSums(sums, algorithm.dp_upload, algorithm.x, self.clip), uniform, ctx)

    def finish(self, t: int, sums: Any, x: Any, name: str, rng: Any) -> dict[str, float]:
        """Before the server step of round t (all participants' sums combined): noise the clipped sum once, add n·x
        back (so the server's mean of models is x + noisy mean update), update an adaptive clip. ``rng``: the
        context's ``rng``, whose (NOISE_STREAM, t) stream seeds the noise. Returns the round's DP metrics."""
        n = sums.scalar("weight")
        total = sums.vector(name)
        scale = n / (self.noise_cohort or n)  # the noise of N' participants, on the sum of n
        seed = int(rng(NOISE_STREAM, t).integers(0, 2**63))
        if self.noise_multiplier > 0:
            ops.gaussian_noise_(total, self.update_noise_multiplier * self.clip * scale, seed, 0)
        total.add_(x, alpha=n)
        clip = self.clip
        if self.target_quantile is not None:
            count = sums.scalar("dp_unclipped")
            if self.noise_multiplier > 0:
                count += float(rng(NOISE_STREAM, t, 1).normal(0.0, self.count_std * scale))
            self.clip = clip * math.exp(-CLIP_LR * (count / n - self.target_quantile))
        return {"dp_epsilon": self.epsilon(t + 1), "dp_clip": clip}

    def state_dict(self) -> dict[str, float]:
        """What a resumed run needs: the (adaptive) clip, and σ and the rounds the budget was planned for."""
        return {"clip": self.clip, "noise_multiplier": self.noise_multiplier, "rounds": float(self.rounds)}

    def load_state_dict(self, state: Any, where: str = "state") -> None:
        """Continue from :meth:`state_dict`'s ``state``; ValueError when ``state`` is missing or its σ is not this
        one's (a run planned for ε over fewer rounds, extended: its remaining rounds would exceed the budget)."""
        if not isinstance(state, dict) or not {"clip", "noise_multiplier"} <= state.keys():
            raise ValueError(f"{where} holds no central-DP state (a run without DP cannot be resumed with it)")
        _check_same_sigma(float(state["noise_multiplier"]), int(state.get("rounds", 0)), self, where)
        self.clip = float(state["clip"])


@dataclass
class LocalDP:
    """The accounting of record-level DP-SGD in a federated run (:class:`pyfedkern.dpsgd.DPSGD` in every local step).

    Client i's local steps are Poisson-subsampled Gaussian mechanisms at rate q_i = b_i/|D_i| (b_i = min(B, |D_i|)),
    s_i steps a round, in each of the ``rounds`` rounds it may take part in. The run is accounted for its worst-case
    client with q = max_i q_i and s = max_i s_i (an upper bound on every client's ε: ε grows with both), as
    ``rounds``·s compositions at rate q with multiplier σ. With Poisson-sampled batches (``dp_sampling="poisson"``:
    each sample in each step's batch independently with probability q_i, the sum divided by the expected size b_i)
    that is the mechanism the steps run; with fixed-size batches cut from a shuffled order (the default) it is the
    usual stand-in, not a proof (docs/privacy.md, section 8).

    Args:
        clip: C > 0, finite: the bound of each sample's gradient.
        noise_multiplier: σ ≥ 0 (0: clipping only, ε = inf).
        delta: δ ∈ (0, 1/records).
        records: the most samples a client holds (δ must be below its inverse).
        sampling_rate: q ∈ (0, 1], the largest of the clients' b_i/|D_i|.
        steps_per_round: s ≥ 1, the most local steps a client takes in a round.
        rounds: rounds T the budget covers.
        accountant: "rdp" or "pld" (``dp-accounting``'s).
    """

    clip: float
    noise_multiplier: float
    delta: float
    records: int
    sampling_rate: float
    steps_per_round: int
    rounds: int
    accountant: str = "rdp"

    def __post_init__(self) -> None:
        for name in ("records", "steps_per_round", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"dp {name} must be an integer >= 1, got {value!r}")
        check_clip(self.clip)
        sigma = self.noise_multiplier
        if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not 0 <= sigma < math.inf:
            raise ValueError(f"dp noise_multiplier must be a finite number >= 0, got {sigma!r}")
        if isinstance(self.delta, bool) or not isinstance(self.delta, (int, float)) or not 0 < self.delta < 1:
            raise ValueError(f"dp delta must be in (0, 1), got {self.delta!r}")
        if self.delta >= 1 / self.records:
            raise ValueError(
                f"dp delta must be below 1/records = 1/{self.records} (the largest client's samples: local DP "
                f"protects each record), got {self.delta!r}"
            )
        check_accounting(self.delta, int(self.rounds * self.steps_per_round), self.sampling_rate, self.accountant)
        self._epsilon = EpsilonSchedule(sigma, self.delta, self.sampling_rate, self.accountant)

    @classmethod
    def for_epsilon(cls, epsilon: float, **settings: Any) -> LocalDP:
        """The LocalDP whose σ spends (``epsilon``, delta) over its rounds (:func:`noise_multiplier`)."""
        probe = cls(noise_multiplier=0.0, **settings)
        steps = probe.rounds * probe.steps_per_round
        sigma = noise_multiplier(epsilon, probe.delta, steps, probe.sampling_rate, probe.accountant)
        return cls(noise_multiplier=sigma, **settings)

    def epsilon(self, rounds: int | None = None) -> float:
        """ε spent after ``rounds`` rounds (default: all of the run's) by the worst-case client."""
        return self._epsilon((self.rounds if rounds is None else rounds) * self.steps_per_round)

    def state_dict(self) -> dict[str, float]:
        """What a resumed run checks: σ and the rounds the budget was planned for."""
        return {"noise_multiplier": self.noise_multiplier, "rounds": float(self.rounds)}

    def load_state_dict(self, state: Any, where: str = "state") -> None:
        """ValueError when ``state`` (:meth:`state_dict`'s) is missing or its σ is not this one's (a run planned for
        ε over fewer rounds, extended: its remaining rounds would exceed the budget)."""
        if not isinstance(state, dict) or "noise_multiplier" not in state:
            raise ValueError(f"{where} holds no local-DP state (a run without DP-SGD cannot be resumed with it)")
        _check_same_sigma(float(state["noise_multiplier"]), int(state.get("rounds", 0)), self, where)


def _check_same_sigma(saved: float, saved_rounds: int, dp: Any, where: str) -> None:
    """ValueError unless the noise multiplier ``saved`` in a checkpoint is ``dp``'s."""
    if saved != dp.noise_multiplier:
        raise ValueError(
            f"{where}: the run's noise multiplier was {saved:.6g} (its budget spread over {saved_rounds} rounds), "
            f"this configuration gives {dp.noise_multiplier:.6g} over {dp.rounds}: continuing would exceed the "
            "run's privacy budget; give --dp-noise-multiplier to extend it (ε then grows)"
        )


class _ClippedSums:
    """A round's sums (:class:`~pyfedkern.algorithms.RoundSums`) as an algorithm's ``accumulate`` sees them under
    central DP: adding the uploaded model vector ``name`` adds the clipped updates instead; any other vector is
    refused (it would leave the round unprivatised)."""

    def __init__(self, sums: Any, name: str, x: Any, clip: float) -> None:
        self.sums, self.name, self.x, self.clip = sums, name, x, clip

    def add(self, name: str, rows: Any, coefs: Any) -> None:
        if name != self.name:
            raise ValueError(
                f"central DP privatises the uploaded {self.name!r} only; this algorithm also sums {name!r}"
            )
        total, norms = ops.clip_accumulate(rows, self.clip, center=self.x, return_norms=True)
        have = self.sums.vector(name)
        if have is None:
            self.sums.vectors[name] = total
        else:
            have.add_(total)
        self.sums.add_scalar("dp_unclipped", float((norms <= self.clip).sum()))

    def add_scalar(self, name: str, value: float) -> None:
        self.sums.add_scalar(name, value)

    def vector(self, name: str) -> Any:
        return self.sums.vector(name)

    def scalar(self, name: str) -> float:
        return self.sums.scalar(name)


def check_clip(clip: Any) -> None:
    """ValueError unless the clip is a finite number > 0."""
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"dp clip must be a finite number > 0, got {clip!r}")


def check_delta(delta: Any, population: int) -> None:
    """ValueError unless 0 < δ < 1/population (a larger δ allows releasing a client's data outright)."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"dp delta must be in (0, 1), got {delta!r}")
    if delta >= 1 / population:
        raise ValueError(f"dp delta must be below 1/population = {1 / population:.3g}, got {delta!r}")
