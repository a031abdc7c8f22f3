"""Link-failure models: long-run ON frequencies, determinism, cyclic structure, the log-normal construction and
bad input."""

from __future__ import annotations

import numpy as np
import pytest

from pyfedkern.sim.links import (
    PATTERNS,
    LinkModel,
    group_link_probs,
    lognormal_link_probs,
    make_links,
    time_varying_probs,
)

P = np.array([0.02, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0])


def frequency(model: LinkModel, rounds: int) -> np.ndarray:
    return np.mean([model.active(t) for t in range(rounds)], axis=0)


@pytest.mark.parametrize("pattern", ["bernoulli", "markov", "cyclic", "cyclic-reset"])
def test_long_run_frequency_matches_p(pattern):
    freq = frequency(LinkModel(P, pattern, seed=3, cycle_length=100), 20_000)
    target = P if pattern in ("bernoulli", "markov") else LinkModel(P, pattern).prob(0)
    # Markov chains with rate 0.05 mix slowly: allow a few standard errors of their correlated samples
    tol = 0.03 if pattern == "markov" else 0.012
    assert np.all(np.abs(freq - target) <= tol + 0.03 * target), (freq, target)


def test_cyclic_on_fraction_is_p():
    model = LinkModel(P, "cyclic", cycle_length=100)
    assert np.allclose(model.prob(0), [0.02, 0.05, 0.1, 0.3, 0.5, 0.9, 100 / 101])


def test_time_varying_bernoulli_frequency_follows_p_t():
    gamma, period = 0.3, 40
    model = LinkModel(P, "bernoulli-tv", gamma=gamma, period=period, seed=1)
    rounds = 400 * period
    freq = frequency(model, rounds)
    target = np.mean([time_varying_probs(P, t, gamma, period) for t in range(rounds)], axis=0)
    assert np.allclose(target, P * (1 - gamma))
    assert np.all(np.abs(freq - target) <= 0.012 + 0.03 * target)
    # and within one period the ON rate follows the sine
    by_phase = np.mean([model.active(t)[-1] for t in range(rounds) if (t % period) == period // 4])
    assert abs(by_phase - 1.0) < 0.02  # p^t = p·(1 − γ + γ) = 1 at the sine's peak for p = 1


def test_markov_tv_with_gamma_zero_is_the_homogeneous_chain_and_tracks_p_t():
    a = LinkModel(P, "markov-tv", gamma=0.0, seed=5)
    b = LinkModel(P, "markov", gamma=0.0, seed=5)
    assert all(np.array_equal(a.active(t), b.active(t)) for t in range(300))
    freq = frequency(LinkModel(P, "markov-tv", gamma=0.3, seed=5), 20_000)
    # the chain lags its moving target, so its frequency is near, not equal to, the mean of p_i^t = 0.7·p_i
    assert np.all(freq <= P + 0.02) and np.all(freq >= 0.5 * P * (1 - 0.3))


def test_markov_transition_rates_give_stationary_p():
    from pyfedkern.sim.links import _markov_rates

    p = np.array([0.01, 0.04, 0.05, 0.2, 0.8, 1.0])
    on_off, off_on = _markov_rates(p)
    assert np.allclose(off_on / (off_on + on_off), p)
    assert on_off[0] == 1.0 and np.isclose(off_on[0], 0.01 / 0.99)  # the slow regime: 0.05(1 − p) > p
    assert off_on[3] == 0.05 and np.isclose(on_off[3], 0.05 * 0.8 / 0.2)


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
