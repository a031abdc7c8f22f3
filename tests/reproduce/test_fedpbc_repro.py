"""The FedPBC reproduction: the quadratic part against Proposition 1, and the Table 1 run on a tiny budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import ONE_SEED, REPRODUCTIONS
from pyfedkern.reproduce import fedpbc as repro


@pytest.fixture(scope="module")
def quadratic_rows():
    return repro.quadratic_experiment([0], 2500)  # the reproduction's setting, one seed (a few seconds)


def test_quadratic_fedavg_limit_matches_proposition_1(quadratic_rows):
    by_pair = {(r["p0"], r["p1"]): r for r in quadratic_rows}
    assert set(by_pair) == set(repro.PROB_PAIRS)
    for r in quadratic_rows:  # the measured late average lands on the formula's limit vector, within its noise
        assert 0 < r["fedavg_limit_se"] < 0.01
        assert r["fedavg_limit_gap"] <= repro.LIMIT_MATCH_SE * r["fedavg_limit_se"]
        if r["p0"] != r["p1"]:
            assert r["fedavg_limit_gap"] < 0.05 * r["fedavg_bias_formula"]
    # unequal probabilities bias FedAvg, more so the more unequal they are; equal ones do not
    assert by_pair[0.5, 0.5]["fedavg_bias_formula"] < 1e-12
    assert by_pair[0.1, 0.9]["fedavg_bias_formula"] > by_pair[0.5, 0.9]["fedavg_bias_formula"] > 0.05


def test_quadratic_fedpbc_beats_the_fedavg_bias(quadratic_rows):
    for r in quadratic_rows:
        assert r["fedpbc_mean_model_error"] < 1e-6  # x̄^t reaches x*
        assert 0.35 < r["fedpbc_server_error_late_half_lr"] / r["fedpbc_server_error_late"] < 0.7  # O(η·s)
        if r["p0"] != r["p1"]:
            assert r["fedpbc_server_error_late"] < 0.1 * r["fedavg_bias_measured"]


def test_quadratic_verdict_is_computed_from_the_rows(quadratic_rows):
    text = repro.quadratic_verdict(quadratic_rows)
    assert "matches Proposition 1's limit vector in **3 of 3**" in text
    assert "in **2 of 2** settings with p0 ≠ p1" in text and "shrinks (ratio < 0.7) in **3 of 3**" in text
    rows = [dict(r) for r in quadratic_rows]
    rows[1]["fedavg_limit_gap"] = 10 * rows[1]["fedavg_limit_se"]  # a formula off by 10 standard errors
    rows[2]["fedpbc_server_error_late"] = 0.5 * rows[2]["fedavg_bias_measured"]
    rows[2]["fedpbc_server_error_late_half_lr"] = rows[2]["fedpbc_server_error_late"]  # no shrinking with η
    rows[0]["fedpbc_mean_model_error"] = 1e-3
    text = repro.quadratic_verdict(rows)
    assert "limit vector in **2 of 3**" in text and "in **1 of 2** settings with p0 ≠ p1" in text
    assert "shrinks (ratio < 0.7) in **2 of 3**" in text and "x* in **2 of 3**" in text


def test_quadratic_table_and_plot(quadratic_rows, tmp_path):
    table = repro.quadratic_table(quadratic_rows)
    assert table.count("\n") == 2 + len(repro.PROB_PAIRS)
    assert repro.plot_quadratic(quadratic_rows, tmp_path / "q.png").stat().st_size > 0


def test_late_accuracy_averages_the_last_evaluations():
    metrics = [{"round": t, "test_acc": a} for t, a in enumerate([0.1, 0.5, 0.6, 0.7], start=1)] + [{"round": 5}]
    assert repro.late_accuracy(metrics, "test_acc") == pytest.approx(0.6)
    assert repro.late_accuracy(metrics, "test_acc", last=1) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="train_acc"):
        repro.late_accuracy(metrics, "train_acc")


def _table_rows(fedpbc: list[float], others: list[float]) -> list[dict]:
    """Synthetic Table 1 rows: every pattern has FedPBC at ``fedpbc`` per seed and the baselines at ``others``."""
    rows = []
    for p in repro.PATTERNS:
        for m in repro.METHODS:
            acc = fedpbc if m == "fedpbc" else others
            curve = [0.1, 0.5, 0.6, 0.6, float(np.mean(acc))]
            rows.append({"pattern": p, "method": m, "train_acc": acc, "test_acc": list(acc), "test_curve": curve})
            rows[-1]["curve_rounds"] = [0, 10, 20, 30, 40]
    return rows


def test_verdict_compares_with_the_memory_free_methods_only():
    rows = _table_rows([0.8, 0.82, 0.81], [0.5, 0.5, 0.5])
    for r in rows:
        if r["method"] == "mifa":  # MIFA keeps memory: beating FedPBC does not count against the claim
            r["test_acc"] = [0.9, 0.9, 0.9]
    text = repro.verdict(rows)
    assert "leads the memory-free methods in 6 of 6" in text and "ranks 2 of 6" in text
    assert "(6 of them by more than 2 standard errors" in text
    rows[3]["test_acc"] = [0.85, 0.85, 0.85]  # FedAU beats FedPBC under the first pattern
    assert "in 5 of 6" in repro.verdict(rows)
    noisy = _table_rows([0.9, 0.5, 0.6], [0.6, 0.6, 0.6])  # a lead of 0.07 with a seed spread far larger
    assert "in 6 of 6 link patterns** (0 of them by more than 2" in repro.verdict(noisy)


def test_paper_comparison_and_convergence_note_follow_the_numbers():
    leading = _table_rows([0.8, 0.8, 0.8], [0.5, 0.5, 0.5])
    assert "6 of 6 patterns here and in 5 of 6 in the paper" in repro.paper_comparison(leading)
    assert "**this digits table supports the claim" in repro.paper_comparison(leading)
    trailing = _table_rows([0.4, 0.4, 0.4], [0.5, 0.5, 0.5])
    assert "0 of 6 patterns here" in repro.paper_comparison(trailing)
    assert "does not support the claim" in repro.paper_comparison(trailing)
    # curves end at 0.8 / 0.4 after 0.6 thirty rounds earlier: FedPBC's rise (20 points) counts, the others' fall not
    note = repro.convergence_note(leading)
    assert note.startswith("In 6 of 36") and "over the last 30 rounds (FedPBC: 6 of 6)." in note
    assert "during training" in repro.convergence_note(_table_rows([0.8] * 3, [0.9] * 3))


def test_tiny_reproduction(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs" / "reproductions.md"
    argv = ["--seeds", "1", "--rounds", "2", "--quadratic-rounds", "60", "--clients", "10", "--no-progress"]
    assert repro.main(argv, out=out, quick=True, docs=str(docs)) == 0
    results = json.loads((out / "results.json").read_text())
    assert {(r["pattern"], r["method"]) for r in results["table"]} == {
        (p, m) for p in repro.PATTERNS for m in repro.METHODS
    }
    for r in results["table"]:
        assert all(0.0 <= a <= 1.0 for a in r["train_acc"] + r["test_acc"])
    assert np.isfinite([q["fedavg_bias_measured"] for q in results["quadratic"]]).all()
    section = docs.read_text()
    assert section.count("<!-- begin fedpbc -->") == 1
    assert ONE_SEED in section and "leads the memory-free methods" not in section  # one seed: no verdict
    for name in ("fedpbc-quadratic.png", "fedpbc-digits.png"):
        assert f"img/{name}" in section and (docs.parent / "img" / name).exists()


def test_registered_and_bad_arguments(tmp_path, monkeypatch):
    assert REPRODUCTIONS["fedpbc"] == "pyfedkern.reproduce.fedpbc"
    with pytest.raises(SystemExit):
        repro.main(["--clients", "0"], out=tmp_path, quick=True, docs=None)
    seen = {}
    monkeypatch.setattr(repro, "main", lambda argv, **kw: seen.update(argv=argv, **kw) or 0)
    assert cli_main(["reproduce", "fedpbc", "--quick", "--out", str(tmp_path)]) == 0
    assert seen["quick"] is True and seen["out"] == tmp_path
