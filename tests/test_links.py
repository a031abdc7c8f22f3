"""Link-failure models: long-run ON frequencies, determinism, cyclic structure, the log-normal construction and
bad input."""

from __future__ import annotations

import numpy as np
import pytest

from pyfedkern.links import (
    PATTERNS,
    LinkModel,
    group_link_probs,
    lognormal_link_probs,
    make_links,
    time_varying_probs,
)

P = np.array([0.02, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0])
Z = 4.0  # frequency tolerances are Z standard deviations of the estimate
SEEDS = (3, 4, 5, 6)


def frequency(model: LinkModel, rounds: int) -> np.ndarray:
    return np.mean([model.active(t) for t in range(rounds)], axis=0)


def seed_mean_frequency(pattern: str, probs: np.ndarray, rounds: int, **kwargs) -> np.ndarray:
    return np.mean([frequency(LinkModel(probs, pattern, seed=s, **kwargs), rounds) for s in SEEDS], axis=0)


def markov_sd(p_t: np.ndarray, rounds: int) -> np.ndarray:
    """Std of a two-state chain's ON frequency over ``rounds`` rounds (an upper bound when p varies over time):
    Var ≈ p(1−p)/n·(1+λ)/(1−λ), λ = 1 − (OFF→ON) − (ON→OFF) the chain's second eigenvalue (its mixing rate), with
    p(1−p) and λ taken at their worst over the rows of p_t ([T, m] or [m])."""
    from pyfedkern.links import _markov_rates

    p_t = np.atleast_2d(p_t)
    on_off, off_on = _markov_rates(p_t)
    lam = np.abs(1.0 - on_off - off_on).max(0)
    var = (p_t * (1 - p_t)).max(0)
    return np.sqrt(var / rounds * (1 + lam) / np.maximum(1 - lam, 1e-12))


def bernoulli_sd(p_t: np.ndarray, rounds: int) -> np.ndarray:
    """Std of the ON frequency of independent Bernoulli(p_t) rounds; p_t [T, m] (cycling over T) or [m]."""
    p_t = np.atleast_2d(p_t)
    return np.sqrt((p_t * (1 - p_t)).mean(0) / rounds)


def markov_marginal(p_t: np.ndarray) -> np.ndarray:
    """Exact P(ON in round t) of the (non-homogeneous) chain: π_0 = p_0, π_t = π_{t−1}(1 − b_t) + (1 − π_{t−1})a_t
    with b_t, a_t the ON→OFF and OFF→ON rates of round t; [T, m]."""
    from pyfedkern.links import _markov_rates

    pi = np.empty_like(p_t)
    pi[0] = p_t[0]
    for t in range(1, len(p_t)):
        on_off, off_on = _markov_rates(p_t[t])
        pi[t] = pi[t - 1] * (1 - on_off) + (1 - pi[t - 1]) * off_on
    return pi


def tolerance(pattern: str, rounds: int) -> np.ndarray:
    """Z standard deviations of the seed-mean frequency of each client under ``pattern`` with base p = P; cyclic
    patterns are deterministic up to one partial cycle (at most one cycle length L of ON rounds in ``rounds``)."""
    n = rounds * len(SEEDS)
    if pattern == "markov":
        return Z * markov_sd(P, n) + 1e-12
    if pattern == "bernoulli":
        return Z * bernoulli_sd(P, n) + 1e-12
    return np.full(len(P), 100 / rounds)


@pytest.mark.parametrize("pattern", ["bernoulli", "markov", "cyclic", "cyclic-reset"])
def test_long_run_frequency_matches_p(pattern):
    rounds = 20_000
    freq = seed_mean_frequency(pattern, P, rounds, cycle_length=100)
    target = P if pattern in ("bernoulli", "markov") else LinkModel(P, pattern).prob(0)
    tol = tolerance(pattern, rounds)
    assert np.all(np.abs(freq - target) <= tol), (freq, target, tol)
    # the check has the power to catch a chain or coin running at twice its probability
    low = P <= 0.5
    doubled = seed_mean_frequency(pattern, 2 * P[low], rounds, cycle_length=100)
    assert np.all(np.abs(doubled - target[low]) > tol[low]), (doubled, target[low], tol[low])


def test_cyclic_on_fraction_is_p():
    model = LinkModel(P, "cyclic", cycle_length=100)
    assert np.allclose(model.prob(0), [0.02, 0.05, 0.1, 0.3, 0.5, 0.9, 100 / 101])


def test_time_varying_bernoulli_frequency_follows_p_t():
    gamma, period = 0.3, 40
    rounds = 400 * period
    p_t = np.array([time_varying_probs(P, t, gamma, period) for t in range(rounds)])
    assert np.allclose(p_t.mean(0), P * (1 - gamma))
    freq = seed_mean_frequency("bernoulli-tv", P, rounds, gamma=gamma, period=period)
    tol = Z * bernoulli_sd(p_t, rounds * len(SEEDS)) + 1e-12
    assert np.all(np.abs(freq - p_t.mean(0)) <= tol), (freq, p_t.mean(0), tol)
    assert np.all(np.abs(freq - P)[P < 1] > tol[P < 1])  # distinguishable from the time-invariant p_i
    # and within one period the ON rate follows the sine: at the peak p^t = p, at the trough p·(1 − 2γ)
    model = LinkModel(P, "bernoulli-tv", gamma=gamma, period=period, seed=1)
    for phase, factor in ((period // 4, 1.0), (3 * period // 4, 1 - 2 * gamma)):
        on = np.mean([model.active(t) for t in range(phase, rounds, period)], axis=0)
        assert np.all(np.abs(on - factor * P) <= Z * bernoulli_sd(factor * P, rounds // period) + 1e-12)


def test_markov_tv_with_gamma_zero_is_the_homogeneous_chain_and_tracks_p_t():
    a = LinkModel(P, "markov-tv", gamma=0.0, seed=5)
    b = LinkModel(P, "markov", gamma=0.0, seed=5)
    assert all(np.array_equal(a.active(t), b.active(t)) for t in range(300))
    gamma, period, rounds = 0.3, 40, 20_000
    p_t = np.array([time_varying_probs(P, t, gamma, period) for t in range(rounds)])
    expected = markov_marginal(p_t).mean(0)  # the chain lags its moving target: not exactly mean p_t = 0.7·p_i
    freq = seed_mean_frequency("markov-tv", P, rounds, gamma=gamma, period=period)
    tol = Z * markov_sd(p_t, rounds * len(SEEDS)) + 1e-12
    assert np.all(np.abs(freq - expected) <= tol), (freq, expected, tol)
    assert np.all(np.abs(freq - P)[P < 1] > tol[P < 1])  # not the homogeneous chain at p_i


def test_markov_transition_rates_give_stationary_p():
    from pyfedkern.links import _markov_rates

    p = np.array([0.01, 0.04, 0.05, 0.2, 0.8, 1.0])
    on_off, off_on = _markov_rates(p)
    assert np.allclose(off_on / (off_on + on_off), p)
    assert on_off[0] == 1.0 and np.isclose(off_on[0], 0.01 / 0.99)  # the slow regime: 0.05(1 − p) > p
    assert off_on[3] == 0.05 and np.isclose(on_off[3], 0.05 * 0.8 / 0.2)


def test_markov_chain_switches_at_its_transition_rates():
    from pyfedkern.links import _markov_rates

    model = LinkModel(P, "markov", seed=9)
    on = np.array([model.active(t) for t in range(20_000)])
    on_off, off_on = _markov_rates(P)
    for rate, was, now in ((on_off, True, False), (off_on, False, True)):
        trials = (on[:-1] == was).sum(0)
        moved = ((on[:-1] == was) & (on[1:] == now)).sum(0)
        seen = trials > 0
        observed = moved[seen] / trials[seen]
        sd = np.sqrt(rate[seen] * (1 - rate[seen]) / trials[seen])
        assert np.all(np.abs(observed - rate[seen]) <= Z * sd + 1e-12), (observed, rate[seen])


@pytest.mark.parametrize("pattern", PATTERNS)
def test_seeded_deterministic_and_order_independent(pattern):
    a = LinkModel(P, pattern, seed=7, cycle_length=20)
    forward = [a.active(t) for t in range(120)]
    b = LinkModel(P, pattern, seed=7, cycle_length=20)
    backward = {t: b.active(t) for t in reversed(range(120))}
    assert all(np.array_equal(forward[t], backward[t]) for t in range(120))
    c = LinkModel(P, pattern, seed=8, cycle_length=20)
    assert not all(np.array_equal(forward[t], c.active(t)) for t in range(120))
    assert a.active(5).dtype == bool and a.active_indices(5).tolist() == np.flatnonzero(forward[5]).tolist()


def test_cyclic_without_reset_switches_on_exactly_one_cycle_apart():
    model = LinkModel([0.3, 0.5], "cyclic", cycle_length=10, seed=2)
    on = np.array([model.active(t) for t in range(200)])
    for i, length in enumerate([3, 5]):
        starts = np.flatnonzero(on[1:, i] & ~on[:-1, i]) + 1
        assert np.all(np.diff(starts) == 10)
        assert on[:, i].sum() in range(200 * length // 10 - length, 200 * length // 10 + 1)


def test_cyclic_reset_has_a_full_on_block_in_every_cycle_and_random_gaps():
    model = LinkModel([0.3], "cyclic-reset", cycle_length=10, seed=4)
    on = np.array([model.active(t)[0] for t in range(1000)])
    blocks = on.reshape(100, 10)
    assert np.all(blocks.sum(1) == 3)
    for row in blocks:  # contiguous ON run inside the cycle
        idx = np.flatnonzero(row)
        assert idx[-1] - idx[0] == 2
    starts = np.flatnonzero(on[1:] & ~on[:-1]) + 1
    assert len(set(np.diff(starts).tolist())) > 3


def test_lognormal_probs():
    rng = np.random.default_rng(0)
    class_dist = rng.dirichlet(np.full(10, 0.1), size=100)
    p = lognormal_link_probs(class_dist, sigma0=10.0, delta=0.02, rng=1)
    assert p.shape == (100,) and np.all(p >= 0.02) and np.all(p <= 1)
    assert np.mean(p < 0.1) > 0.5  # σ0 = 10: one class dominates r, most clients end up rare
    assert np.allclose(p, lognormal_link_probs(class_dist * 7, rng=1), rtol=1e-12)  # histograms or distributions
    flat = lognormal_link_probs(class_dist, sigma0=0.0, delta=0.02)
    assert np.allclose(flat, 0.1)  # σ0 = 0: r uniform, p_i = 1/C
    counts = np.eye(3)
    assert np.isclose(lognormal_link_probs(counts, sigma0=0.0, delta=1e-3).sum(), 1.0)


def test_make_links_and_groups():
    assert group_link_probs([0.1, 0.9], 5).tolist() == [0.1, 0.1, 0.1, 0.9, 0.9]
    model = make_links("cyclic", 4, probs=[0.5, 0.5, 0.5, 0.5], cycle_length=4)
    assert model.num_clients == 4
    hist = np.random.default_rng(0).integers(0, 20, size=(6, 10))
    model = make_links("markov-tv", 6, class_dist=hist, seed=3)
    assert np.all(model.probs >= 0.02)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"probs": [0.5, 0.0]}, r"\(0, 1\], but probs\[1\] = 0.0"),
        ({"probs": [1.5]}, r"\(0, 1\]"),
        ({"probs": [-0.1]}, r"\(0, 1\]"),
        ({"probs": [np.nan]}, r"\(0, 1\]"),
        ({"probs": []}, "non-empty"),
        ({"probs": [[0.5]]}, "1-D"),
        ({"probs": [0.5], "pattern": "bernoulli-tv", "gamma": 0.5}, "gamma < 0.5"),
        ({"probs": [0.5], "pattern": "markov-tv", "gamma": 0.7}, "gamma < 0.5"),
        ({"probs": [0.5], "pattern": "bernoulli", "gamma": 1.5}, r"gamma must be in \[0, 1\]"),
        ({"probs": [0.5], "pattern": "cyclic", "cycle_length": 0}, "cycle_length must be an integer >= 1"),
        ({"probs": [0.5], "pattern": "cyclic", "cycle_length": 2.5}, "cycle_length"),
        ({"probs": [0.5], "pattern": "bernoulli-tv", "period": 0}, "period"),
        ({"probs": [0.5], "pattern": "gilbert"}, "unknown link pattern 'gilbert'"),
        ({"probs": [0.5], "seed": -1}, "seed"),
    ],
)
def test_bad_input(kwargs, match):
    probs = kwargs.pop("probs")
    with pytest.raises(ValueError, match=match):
        LinkModel(probs, **kwargs)


def test_bad_input_of_helpers():
    with pytest.raises(ValueError, match="round t"):
        LinkModel([0.5]).active(-1)
    with pytest.raises(ValueError, match=r"delta=0.02·\(1 − 2γ\) ≤ 0"):
        make_links("bernoulli-tv", 3, class_dist=np.ones((3, 2)), gamma=0.5)
    with pytest.raises(ValueError, match="unknown link pattern"):
        make_links("always", 3, probs=[0.5])
    with pytest.raises(ValueError, match="needs probs or class_dist"):
        make_links("bernoulli", 3)
    with pytest.raises(ValueError, match="all zero"):
        lognormal_link_probs(np.array([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="delta"):
        lognormal_link_probs(np.ones((2, 2)), delta=0.0)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        group_link_probs([0.5, 1.2], 4)
