"""Robust aggregation rules (pyfedkern.algorithms.robust) and Byzantine attacks (pyfedkern.algorithms.attacks): the
specs, the rules against the reference ops, the attacks against their formulas, and which algorithms take them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import norm

from pyfedkern.algorithms import algorithm_class
from pyfedkern.algorithms.attacks import Attack, parse_attack
from pyfedkern.algorithms.base import check_robust
from pyfedkern.algorithms.robust import Aggregator, parse_aggregator
from pyfedkern.reference import robust as ref


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, Aggregator()),
        ("mean", Aggregator()),
        (" Median ", Aggregator("median")),
        ("trimmed:0.1", Aggregator("trimmed", beta=0.1)),
        ("trimmed:0", Aggregator("trimmed", beta=0.0)),
        ("krum:2", Aggregator("krum", f=2)),
        ("multikrum:1,3", Aggregator("multikrum", f=1, m=3)),
        ("bulyan:1", Aggregator("bulyan", f=1)),
        ("geomed", Aggregator("geomed")),
        ("cclip:0.5", Aggregator("cclip", tau=0.5, iters=1)),
        ("cclip:2,3", Aggregator("cclip", tau=2.0, iters=3)),
    ],
)
def test_aggregator_specs(spec, expected):
    parsed = parse_aggregator(spec)
    assert parsed == expected
    assert parse_aggregator(parsed.spec) == parsed  # the normalised spec parses back


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("avg", "unknown aggregator 'avg'"),
        ("", "aggregator: expected a non-empty string"),
        (0.1, "aggregator must be a string"),
        ("trimmed", "trimmed takes 1 argument"),
        ("trimmed:0.5", r"β must be in \[0, 0.5\)"),
        ("trimmed:nan", r"β must be in \[0, 0.5\)"),
        ("trimmed:-0.1", r"β must be in \[0, 0.5\)"),
        ("krum:1.5", "f must be an integer >= 0"),
        ("krum:-1", "f must be an integer >= 0"),
        ("krum:inf", "f must be an integer >= 0"),
        ("multikrum:1", "multikrum takes 2 arguments"),
        ("multikrum:1,0", "m must be an integer >= 1"),
        ("bulyan", "bulyan takes 1 argument"),
        ("median:1", "median takes no argument"),
        ("geomed:3", "geomed takes no argument"),
        ("cclip:0", "τ must be finite and > 0"),
        ("cclip:inf", "τ must be finite and > 0"),
        ("cclip:1,0", "iters must be an integer >= 1"),
        ("krum:x", "is not a number"),
    ],
)
def test_bad_aggregator_specs_name_the_option(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_aggregator(spec)
    assert "aggregator" in str(err.value)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (None, None),
        ("none", None),
        ("signflip:0.2", Attack("signflip", 0.2)),
        ("gaussian:0.3,0.5", Attack("gaussian", 0.3, 0.5)),
        ("scale:1,-4", Attack("scale", 1.0, -4.0)),
        ("alie:0.25", Attack("alie", 0.25)),
        ("ipm:0.4,2", Attack("ipm", 0.4, 2.0)),
    ],
)
def test_attack_specs(spec, expected):
    parsed = parse_attack(spec)
    assert parsed == expected
    if parsed is not None:
        assert parse_attack(parsed.spec) == parsed


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("flip:0.2", "unknown attack 'flip'"),
        ("signflip", "signflip takes the fraction"),
        ("signflip:0.2,3", "signflip takes the fraction"),
        ("gaussian:0.2,1,2", "gaussian takes the fraction"),
        ("alie:0", r"fraction must be in \(0, 1\]"),
        ("alie:1.5", r"fraction must be in \(0, 1\]"),
        ("ipm:0.2,inf", "parameter must be finite"),
        ("gaussian:0.2,-1", "σ must be >= 0"),
        (3, "attack must be a string"),
    ],
)
def test_bad_attack_specs_name_the_option(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_attack(spec)
    assert "attack" in str(err.value)


def _rows(k: int, d: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(seed).standard_normal((k, d)), dtype=dtype)


@pytest.mark.parametrize("k", [7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_rule_is_the_reference_rule(k, dtype):
    rows = _rows(k, 33, k, dtype)
    rows[3] = rows[1]  # a duplicate row and a tie
    weights = np.arange(1.0, k + 1)
    share = weights / weights.sum()
    centre = rows.mean(0) * 0.5
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    chosen = np.sort(np.asarray(ref.krum_select(rows.double(), 1, m=3)))
    expected = {
        "median": ref.coordinate_median(rows, weights=share),
        "trimmed:0.2": ref.trimmed_mean(rows, 0.2),
        "krum:1": rows[int(ref.krum_select(rows, 1)[0])],
        "multikrum:1,3": (torch.as_tensor(share[chosen] / share[chosen].sum(), dtype=dtype) @ rows[chosen]),
        "bulyan:1": ref.bulyan(rows, 1),
        "geomed": ref.geometric_median(rows, weights=share),
        "cclip:0.7,2": ref.centred_clip(rows, centre, 0.7, iters=2),
    }
    for spec, want in expected.items():
        got = parse_aggregator(spec).combine(rows, weights, centre)
        assert got.shape == (33,) and got.dtype == dtype, spec
        torch.testing.assert_close(got, torch.as_tensor(want, dtype=dtype), **tol, msg=spec)


def test_a_rule_needs_enough_uploads():
    rows = _rows(6, 5, 0)
    with pytest.raises(ValueError, match=r"aggregator bulyan:1: needs at least 7 uploads in a round, got 6"):
        parse_aggregator("bulyan:1").combine(rows, np.ones(6), rows[0])
    with pytest.raises(ValueError, match="aggregator multikrum:0,7: needs at least 7 uploads"):
        parse_aggregator("multikrum:0,7").combine(rows, np.ones(6), rows[0])


def _attacked(spec: str, rows: torch.Tensor, centre: torch.Tensor, seed: int = 5) -> tuple[torch.Tensor, np.ndarray]:
    attack = parse_attack(spec)
    rng = np.random.default_rng(seed)
    who = attack.attackers(rows.shape[0], rng)
    out = rows.clone()
    attack.apply_(out, centre, who, rng)
    return out, who


def test_attackers_are_a_seeded_draw_of_the_requested_share():
    attack = parse_attack("signflip:0.3")
    draws = [attack.attackers(10, np.random.default_rng(s)) for s in range(20)]
    assert all(len(w) == 3 and np.all(np.diff(w) > 0) and w.min() >= 0 and w.max() < 10 for w in draws)
    assert len({tuple(w) for w in draws}) > 1  # the stream decides
    again = attack.attackers(10, np.random.default_rng(0))
    np.testing.assert_array_equal(again, draws[0])
    assert parse_attack("ipm:1").attackers(4, np.random.default_rng(0)).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "spec", ["signflip:0.4", "scale:0.4", "scale:0.4,-3", "gaussian:0.4,0.5", "ipm:0.4", "alie:0.4"]
)
def test_each_attack_follows_its_formula(spec):
    rows, centre = _rows(10, 40, 1), _rows(1, 40, 2)[0]
    out, who = _attacked(spec, rows, centre)
    honest = np.setdiff1d(np.arange(10), who)
    torch.testing.assert_close(out[honest], rows[honest], rtol=0, atol=0)  # the others upload what they computed
    delta = rows - centre
    attack = parse_attack(spec)
    if attack.name == "signflip":
        want = centre - delta[who]
    elif attack.name == "scale":
        want = centre + (attack.parameter or 10.0) * delta[who]
    elif attack.name == "gaussian":
        rng = np.random.default_rng(5)
        attack.attackers(10, rng)  # the same stream: who, then the noise
        want = centre + 0.5 * torch.as_tensor(rng.standard_normal((len(who), 40)))
    elif attack.name == "ipm":
        want = (centre - 0.1 * delta.mean(0)).expand(len(who), -1)
    else:  # Baruch et al.: s = ⌊n/2 + 1⌋ − f, z = Φ⁻¹((n − s)/n); n = 10, f = 4: s = 2, z = Φ⁻¹(0.8)
        z = norm.ppf(0.8)
        want = (centre + delta.mean(0) - z * delta.std(0, unbiased=False)).expand(len(who), -1)
    torch.testing.assert_close(out[who], want, rtol=1e-12, atol=1e-12)


def test_alie_z_is_the_papers_and_can_be_given():
    attack = parse_attack("alie:0.2")
    for n, f in [(50, 12), (10, 1), (20, 5), (7, 3)]:
        s = n // 2 + 1 - f
        assert attack.alie_z(n, f) == pytest.approx(norm.ppf((n - s) / n), abs=1e-12)
    assert parse_attack("alie:0.2,1.5").alie_z(50, 12) == 1.5


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "scaffold", "fedsam", "fedcm", "fedadam"])
def test_algorithms_whose_server_averages_models_take_rules_and_attacks(name):
    check_robust(algorithm_class(name), parse_aggregator("median"), parse_attack("alie:0.2"))


@pytest.mark.parametrize("name", ["fedpbc", "fedspeed", "fnrfl", "bherd", "fednova", "mifa", "dynamic", "feddyn"])
def test_other_algorithms_refuse_rules_and_attacks_by_name(name):
    check_robust(algorithm_class(name), parse_aggregator("mean"), None)  # the mean is everyone's
    with pytest.raises(ValueError, match=rf"algorithm '{name}' refuses aggregator 'median'"):
        check_robust(algorithm_class(name), parse_aggregator("median"), None)
    with pytest.raises(ValueError, match=rf"algorithm '{name}' refuses attack 'ipm:0.5'"):
        check_robust(algorithm_class(name), parse_aggregator("mean"), parse_attack("ipm:0.5"))
