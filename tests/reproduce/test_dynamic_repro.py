"""The dynamic-arrival reproduction: the after-transition metric, and a tiny run."""

from __future__ import annotations

import json

import pytest

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import REPRODUCTIONS
from pyfedkern.reproduce import dynamic as repro


def test_after_transitions_averages_the_first_rounds_of_each_later_session():
    T = 12  # sessions of 12 rounds; the window is the first 10 rounds of each session s >= 1
    acc = {r: 0.0 for r in range(1, 4 * T + 1)}
    for s, value in ((1, 0.5), (2, 0.7), (3, 0.9)):
        for r in range(s * T + 1, s * T + 11):
            acc[r] = value  # rounds 11-12 of each session stay 0: outside the window
    metrics = [{"round": 0}] + [{"round": r, "test_acc": a} for r, a in acc.items()]
    assert repro.after_transitions(metrics, T) == pytest.approx((0.5 + 0.7 + 0.9) / 3)
    assert repro.after_transitions(metrics, T, first=3) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="transition"):
        repro.after_transitions(metrics[: T + 1], T)


def test_run_config_follows_the_spec():
    cfg = repro.run_config("average", "fedprox", 0.2, 0.7, 1, session_rounds=20, lr=0.05)
    assert cfg.algorithm == "dynamic" and cfg.partition == "groups:0.2,0.7" and cfg.rounds == 6 * 20
    assert cfg.algorithm_params["host_params"] == "mu=1" and cfg.algorithm_params["method"] == "average"
    assert (cfg.local_steps, cfg.momentum, cfg.clients) == (5, 0.9, 20)


def test_tiny_reproduction(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs" / "reproductions.md"
    argv = ["--session-rounds", "2", "--seeds", "1", "--no-progress"]
    assert repro.main(argv, out=out, quick=True, docs=str(docs)) == 0
    rows = json.loads((out / "results.json").read_text())
    assert len(rows) == 1 and set(rows[0]["acc"]) == set(repro.METHODS)
    for accs in rows[0]["acc"].values():
        assert len(accs) == 1 and 0.0 <= accs[0] <= 1.0
    assert docs.read_text().count("<!-- begin dynamic -->") == 1
    assert "Proposed − Previous" in (out / "report.md").read_text()


def test_registered_and_bad_arguments(tmp_path, monkeypatch):
    assert REPRODUCTIONS["dynamic"] == "pyfedkern.reproduce.dynamic"
    with pytest.raises(SystemExit):
        repro.main(["--seeds", "0"], out=tmp_path, quick=True, docs=None)
    seen = {}
    monkeypatch.setattr(repro, "main", lambda argv, **kw: seen.update(argv=argv, **kw) or 0)
    assert cli_main(["reproduce", "dynamic", "--quick", "--out", str(tmp_path)]) == 0
    assert seen["quick"] is True and seen["out"] == tmp_path
