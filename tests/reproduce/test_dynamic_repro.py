"""The dynamic-arrival reproduction: the after-transition metric, the Proposed-vs-Previous headline on synthetic
numbers (one case where Proposed wins, one where it does not), and a tiny run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import REPRODUCTIONS
from pyfedkern.reproduce import dynamic as repro

S1 = repro.SESSIONS - 1  # sessions 1..S-1 carry a transition


def _row(host: str, acc: dict[str, list[list[float]]], lr: float = repro.LR) -> dict:
    return {"host": host, "overlap": 0.0, "alpha": 0.3, "lr": lr, "acc": acc, "curve": {}}


def _acc(base: float, later: list[float]) -> list[float]:
    """Sessions P and P+1 at ``base`` (the methods coincide there), then ``later`` for s >= P+2."""
    assert len(later) == S1 - (repro.FIRST_COMPARED - 1)
    return [base] * (repro.FIRST_COMPARED - 1) + later


def _all_methods(proposed: list[list[float]], previous: list[list[float]]) -> dict:
    return {"proposed": proposed, "previous": previous, "average": previous, "continuous": previous}


def test_session_accuracies_takes_the_first_rounds_of_each_later_session():
    T = 12  # the window is the first 10 rounds of each session s >= 1; rounds 11-12 stay 0 and must not count
    acc = {r: 0.0 for r in range(1, repro.SESSIONS * T + 1)}
    for s in range(1, repro.SESSIONS):
        for r in range(s * T + 1, s * T + 11):
            acc[r] = s / 10
    metrics = [{"round": 0, "test_acc": 0.5}] + [{"round": r, "test_acc": a} for r, a in acc.items()]
    assert repro.session_accuracies(metrics, T) == pytest.approx([s / 10 for s in range(1, repro.SESSIONS)])
    with pytest.raises(ValueError, match=r"session\(s\) \[3, 4, 5\]"):
        repro.session_accuracies(metrics[: 3 * T + 1], T)


def test_proposed_minus_ignores_the_sessions_where_the_methods_coincide():
    # Proposed is far behind at s = P and P+1 (impossible in a real run) but ahead by 2 and 4 pp later on
    later = [0.90, 0.80, 0.70]
    row = _row("fedavg", _all_methods([_acc(0.0, [a + 0.02 for a in later])] * 2, [_acc(0.9, later)] * 2))
    row["acc"]["proposed"][1] = _acc(0.0, [a + 0.04 for a in later])
    assert repro.proposed_minus(row, "previous") == pytest.approx([2.0, 4.0])


def test_compare_criterion_and_win_counts():
    win = repro.compare([1.0, 1.2, 0.8], "previous")
    assert win["mean"] == pytest.approx(1.0) and win["se"] == pytest.approx(0.2 / np.sqrt(3))
    assert (win["wins"], win["n"], win["verdict"]) == (3, 3, "Proposed better")
    # ahead in 2 of 3 seeds but the mean is within 2 s.e. of zero
    noisy = repro.compare([3.0, 1.0, -3.5], "previous")
    assert (noisy["wins"], noisy["verdict"]) == (2, "no clear difference")
    lose = repro.compare([-0.5, -0.6, -0.4], "average")
    assert (lose["wins"], lose["verdict"]) == (0, "Average better")
    assert repro.compare([0.0, 0.0], "previous")["verdict"] == "no clear difference"
    assert repro.compare([5.0], "previous")["verdict"] == "no verdict (one seed)"


def _rows(gain: float, spread: float) -> list[dict]:
    """Two grid settings and a sensitivity row; Proposed − Previous = gain + spread·(−1, 0, 1) pp per seed at every
    transition s >= P+2, Previous at 80% there."""
    previous = [_acc(0.5, [0.8] * (S1 - 2)) for _ in range(3)]
    proposed = [_acc(0.5, [0.8 + (gain + spread * k) / 100] * (S1 - 2)) for k in (-1, 0, 1)]
    return [
        _row("fedavg", _all_methods(proposed, previous)),
        _row("fedprox", _all_methods(proposed, previous)),
        _row("fedavg", _all_methods(previous, proposed), lr=repro.SENSITIVITY_LR),
    ]


def test_headline_when_proposed_wins():
    rows = _rows(gain=2.0, spread=0.5)
    pooled = repro.pooled(rows, "previous")  # the sensitivity row is not pooled
    assert pooled["n"] == 6 and pooled["wins"] == 6 and pooled["mean"] == pytest.approx(2.0)
    text = repro.verdict(rows)
    assert "**Proposed − Previous over transitions s ≥ 3: +2.00 ± 0.18 pp**" in text
    assert "**Proposed better**, which agrees with the paper" in text and "2 × Proposed better (of 2)" in text
    assert "largest seed-level gap measured there is 0.00 pp" in text
    assert "Sensitivity: fedavg, overlap 0, Dir(0.3) at η0 = 0.01: Proposed − Previous -2.00 ± 0.29 pp" in text
    table = repro.headline_table(rows)
    assert "| fedavg | 0 | 0.3 | 0.05 | +2.00 | +2.00 | +2.00 | +2.00 ± 0.29 | 3/3 | Proposed better |" in table
    assert "| Previous better |" in table  # the sensitivity row
    assert "gaps (setting × transition s ≥ 3, seed mean) lie between +2.00 and +2.00 pp, 0 of 6 reach" in text
    assert "Previous's lowest seed-mean accuracy after such a transition is 80.00%" in text


def test_overlap_effect_is_compared_with_two_standard_errors():
    rows = _rows(gain=2.0, spread=0.5)
    rows[1] = _rows(gain=0.2, spread=0.5)[0] | {"overlap": 0.2}
    text = repro.verdict(rows)
    assert "gap at overlap 0 (+2.00 ± 0.29 pp) is larger than that at overlap 0.2 (+0.20 ± 0.29 pp)" in text
    rows[1] = _rows(gain=1.8, spread=0.5)[0] | {"overlap": 0.2}
    assert "is not clearly different from that at overlap 0.2" in repro.verdict(rows)


def test_headline_when_proposed_does_not_win():
    rows = _rows(gain=0.1, spread=1.0)  # Proposed ahead in 2 of 3 seeds, by less than 2 s.e. on average
    pooled = repro.pooled(rows, "previous")
    assert (pooled["wins"], pooled["verdict"]) == (4, "no clear difference")
    text = repro.verdict(rows)
    assert "**no clear difference**, which does not confirm the paper's claim" in text
    behind = _rows(gain=-3.0, spread=0.5)
    assert "**Previous better**, which contradicts the paper" in repro.verdict(behind)


def test_transition_table_lists_every_session_per_method():
    rows = _rows(gain=2.0, spread=0.0)
    table = repro.transition_table(rows)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + len(rows) * len(repro.METHODS)
    assert "s = 3 (1st)" in lines[0] and "mean s ≥ 3" in lines[0]
    assert "| fedavg | 0 | 0.3 | 0.05 | Proposed | 50.00 | 50.00 | 82.00 | 82.00 | 82.00 | 82.00 |" in table


def test_run_config_follows_the_spec():
    cfg = repro.run_config("average", "fedprox", 0.2, 0.7, 1, session_rounds=50, lr=0.05)
    assert cfg.algorithm == "dynamic" and cfg.partition == "groups:0.2,0.7" and cfg.rounds == 6 * 50
    params = cfg.algorithm_params
    assert params["host_params"] == "mu=1" and params["method"] == "average" and params["pilot_sessions"] == 1
    assert (cfg.local_steps, cfg.momentum, cfg.clients) == (5, 0.9, 40)


def test_tiny_reproduction(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs" / "reproductions.md"
    argv = ["--session-rounds", "2", "--seeds", "2", "--no-progress"]
    assert repro.main(argv, out=out, quick=True, docs=str(docs)) == 0
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 1 and set(rows[0]["acc"]) == set(repro.METHODS)
    for method, accs in rows[0]["acc"].items():
        assert np.shape(accs) == (2, S1) and np.all((0 <= np.asarray(accs)) & (np.asarray(accs) <= 1))
        assert len(rows[0]["curve"][method]) == repro.SESSIONS * 2
    # at s = P the methods all restart from the random model; at s = P + 1 Proposed and Average copy Previous
    acc = {m: np.asarray(a) for m, a in rows[0]["acc"].items()}
    assert np.allclose(acc["proposed"][:, :2], acc["previous"][:, :2])
    assert np.allclose(acc["average"][:, :2], acc["previous"][:, :2])
    text = docs.read_text()
    assert text.count("<!-- begin dynamic -->") == 1 and "img/dynamic-sessions.png" in text
    assert (docs.parent / "img" / "dynamic-sessions.png").stat().st_size > 0
    assert "Proposed − Previous" in (out / "report.md").read_text()


def test_registered_and_bad_arguments(tmp_path, monkeypatch):
    assert REPRODUCTIONS["dynamic"] == "pyfedkern.reproduce.dynamic"
    with pytest.raises(SystemExit):
        repro.main(["--seeds", "0"], out=tmp_path, quick=True, docs=None)
    seen = {}
    monkeypatch.setattr(repro, "main", lambda argv, **kw: seen.update(argv=argv, **kw) or 0)
    assert cli_main(["reproduce", "dynamic", "--quick", "--out", str(tmp_path)]) == 0
    assert seen["quick"] is True and seen["out"] == tmp_path
