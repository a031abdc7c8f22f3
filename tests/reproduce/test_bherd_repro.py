"""The BHerd reproduction: its curve helpers, and a tiny run of all three cases."""

from __future__ import annotations

import json

import pytest

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import REPRODUCTIONS
from pyfedkern.reproduce import bherd as repro


def test_rounds_to_loss_and_mean_curve():
    a = [{"round": t, "test_loss": x, "test_acc": 0.5} for t, x in enumerate([1.0, 0.6, 0.4], start=1)]
    b = [{"round": t, "test_loss": x, "test_acc": 0.7} for t, x in enumerate([0.8, 0.6, 0.2], start=1)]
    mean = repro.mean_curve([a, b])
    assert [m["test_loss"] for m in mean] == pytest.approx([0.9, 0.6, 0.3])
    assert [m["test_acc"] for m in mean] == pytest.approx([0.6] * 3)
    assert repro.rounds_to_loss(mean, 0.6) == 2  # reaching the threshold exactly counts
    assert repro.rounds_to_loss(mean, 0.1) is None


def test_variant_configs():
    cfg = repro.variant_config("bherd-0.3", 2, 7, rounds=4, lr=0.01, dataset="digits", root=None)
    assert (cfg.algorithm, cfg.algorithm_params, cfg.partition, cfg.seed) == ("bherd", {"alpha": 0.3}, "bherd2", 7)
    assert cfg.parity and cfg.model == "svm" and cfg.clients == 5
    assert repro.variant_config("grab", 1, 0, rounds=4, lr=0.01, dataset="digits", root=None).algorithm == "grab"


def test_tiny_reproduction(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs" / "reproductions.md"
    assert repro.main(["--rounds", "2", "--seeds", "1", "--no-progress"], out=out, quick=True, docs=str(docs)) == 0
    results = json.loads((out / "results.json").read_text())
    assert [c["case"] for c in results] == list(repro.CASES)
    for c in results:
        assert set(c["summary"]) == set(repro.VARIANTS)
        fedavg = c["summary"]["fedavg"]
        assert fedavg["rounds_to_fedavg_final_loss"] is not None  # FedAvg reaches its own final loss
        for s in c["summary"].values():
            assert 0.0 <= s["final_acc"] <= 1.0 and s["final_loss"] > 0
    section = docs.read_text()
    assert section.count("<!-- begin bherd -->") == 1 and "The paper's findings, checked" in section
    for case in repro.CASES:
        assert (docs.parent / "img" / f"bherd-case{case}.png").stat().st_size > 0


def test_registered_and_bad_arguments(tmp_path, monkeypatch):
    assert REPRODUCTIONS["bherd"] == "pyfedkern.reproduce.bherd"
    with pytest.raises(SystemExit):
        repro.main(["--lr", "0"], out=tmp_path, quick=True, docs=None)
    seen = {}
    monkeypatch.setattr(repro, "main", lambda argv, **kw: seen.update(argv=argv, **kw) or 0)
    assert cli_main(["reproduce", "bherd", "--quick", "--out", str(tmp_path)]) == 0
    assert seen["quick"] is True and seen["out"] == tmp_path
