"""The FedSpeed reproduction on a tiny budget, and its rounds-to-target and verdict logic on synthetic curves."""

from __future__ import annotations

import json

import pytest

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import REPRODUCTIONS
from pyfedkern.reproduce import fedspeed as repro

TINY = ["--rounds", "2", "--seeds", "1", "--no-progress"]


def _curve(accs):
    return [{"round": t + 1, "test_acc": a, "test_loss": 1.0 - a} for t, a in enumerate(accs)]


def test_rounds_to_target_is_the_first_round_at_or_above():
    curve = _curve([0.5, 0.84, 0.85, 0.80, 0.93])
    assert repro.rounds_to_target(curve, 0.85) == 3  # reaching the target exactly counts
    assert repro.rounds_to_target(curve, 0.9) == 5  # a later dip does not matter
    assert repro.rounds_to_target(curve, 0.95) is None


def test_mean_curve_averages_seeds_round_by_round():
    mean = repro.mean_curve([_curve([0.2, 0.6]), _curve([0.4, 1.0])])
    assert [m["round"] for m in mean] == [1, 2]
    assert [m["test_acc"] for m in mean] == pytest.approx([0.3, 0.8])
    assert [m["test_loss"] for m in mean] == pytest.approx([0.7, 0.2])


def _rows(to_target):
    """Result rows for one dataset with the given rounds-to-target per method (same for both α)."""
    return [
        {"dataset": "digits", "alpha": a, "method": m, "targets": [0.85, 0.92], "to_target": list(to_target[m])}
        for a in repro.ALPHAS
        for m in repro.METHODS
    ]


def test_verdict_counts_cells_where_fedspeed_is_strictly_fastest():
    slow = {m: (100, None) for m in repro.METHODS}
    text = repro.verdict(_rows({**slow, "fedspeed": (50, 80)}))
    assert "fewest rounds in 4 of 4" in text and "FedAvg took 100 rounds, 2.00× FedSpeed's" in text
    text = repro.verdict(_rows({**slow, "scaffold": (40, None), "fedspeed": (50, 80)}))
    assert "fewest rounds in 2 of 4" in text and "fastest baseline SCAFFOLD 40" in text
    text = repro.verdict(_rows({**slow, "fedspeed": (100, None)}))  # a tie is not a win
    assert "fewest rounds in 0 of 4" in text


def test_tiny_reproduction(tmp_path, capsys):
    out, docs = tmp_path / "out", tmp_path / "docs" / "reproductions.md"
    assert repro.main(TINY, out=out, quick=True, docs=str(docs)) == 0
    results = json.loads((out / "results.json").read_text())
    rows = results["rows"]
    assert {(r["alpha"], r["method"]) for r in rows} == {(a, m) for a in repro.ALPHAS for m in repro.METHODS}
    for r in rows:
        assert len(r["final_acc"]) == 1 and 0.0 <= r["final_acc"][0] <= 1.0
        assert r["best_acc"][0] >= r["final_acc"][0]
    assert "CIFAR-10 / ResNet-18-GN: skipped" in results["skipped"][0]
    # FedDyn and FedSpeed decay the learning rate more slowly, as in the paper
    run_dir = out / "digits" / "dir0.3" / "seed0"
    schedules = {m: json.loads((run_dir / m / "config.json").read_text())["lr_schedule"] for m in repro.METHODS}
    assert schedules["fedspeed"] == schedules["feddyn"] != schedules["fedavg"] == schedules["fedsam"]

    report = (out / "report.md").read_text()
    assert "| FedSpeed |" in report and "Compared with the paper" in report
    for a in repro.ALPHAS:
        assert (docs.parent / "img" / f"fedspeed-digits-dir{a:g}.png").stat().st_size > 0
    repro.main(TINY, out=out, quick=True, docs=str(docs))  # resumes every finished run, replaces the section
    assert docs.read_text().count("<!-- begin fedspeed -->") == 1
    again = json.loads((out / "results.json").read_text())["rows"]
    assert [r["final_acc"] for r in again] == [r["final_acc"] for r in rows]


def test_registered_with_the_cli(tmp_path, monkeypatch):
    assert REPRODUCTIONS["fedspeed"] == "pyfedkern.reproduce.fedspeed"
    seen = {}
    monkeypatch.setattr(repro, "main", lambda argv, **kw: seen.update(argv=argv, **kw) or 0)
    assert cli_main(["reproduce", "fedspeed", "--quick", "--out", str(tmp_path), "--seeds", "1"]) == 0
    assert seen == {"argv": ["--seeds", "1"], "out": tmp_path, "quick": True, "docs": None}


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(SystemExit):
        repro.main(["--seeds", "0"], out=tmp_path, quick=True, docs=None)
