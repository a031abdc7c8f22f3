"""The BHerd reproduction: its curve helpers, and a tiny run of all three cases."""

from __future__ import annotations

import json
import math

import pytest

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import ONE_SEED, REPRODUCTIONS
from pyfedkern.reproduce import bherd as repro


def test_rounds_to_loss_and_mean_curve():
    a = [{"round": t, "train_loss": x, "test_loss": 2 * x, "test_acc": 0.5} for t, x in enumerate([1.0, 0.6, 0.4], 1)]
    b = [{"round": t, "train_loss": x, "test_loss": 2 * x, "test_acc": 0.7} for t, x in enumerate([0.8, 0.6, 0.2], 1)]
    mean = repro.mean_curve([a, b])
    assert [m["train_loss"] for m in mean] == pytest.approx([0.9, 0.6, 0.3])
    assert [m["test_loss"] for m in mean] == pytest.approx([1.8, 1.2, 0.6])
    assert [m["test_acc"] for m in mean] == pytest.approx([0.6] * 3)
    assert repro.rounds_to_loss(mean, 0.6) == 2  # reaching the threshold exactly counts; judged on the train loss
    assert repro.rounds_to_loss(mean, 0.1) is None


def test_variant_configs():
    cfg = repro.variant_config("bherd-0.3", 2, 7, rounds=4, lr=0.01, batch=10, dataset="digits", root=None)
    assert (cfg.algorithm, cfg.algorithm_params, cfg.partition, cfg.seed) == ("bherd", {"alpha": 0.3}, "bherd2", 7)
    assert cfg.parity and cfg.model == "svm" and cfg.clients == 5 and cfg.batch_size == 10
    grab = repro.variant_config("grab", 1, 0, rounds=4, lr=0.01, batch=100, dataset="digits", root=None)
    assert grab.algorithm == "grab" and grab.batch_size == 100


ROUNDS = 20


def _curve(loss, acc=0.9):
    """A synthetic seed-averaged curve: train loss ``loss(t)`` for t = 0..ROUNDS and a constant test accuracy."""
    return [{"round": t, "train_loss": loss(t), "test_loss": loss(t), "test_acc": acc} for t in range(ROUNDS + 1)]


def _case(number, curves):
    finals = {v: [c[-1]["train_loss"]] * 2 for v, c in curves.items()}
    return {"case": number, "rounds": ROUNDS, "curves": curves, "summary": repro.summarize(curves, finals)}


def _decay(floor, scale):
    return lambda t: floor + 0.4 * math.exp(-t / scale)


def _paper_like(number):
    """Curves on which all four claims hold: α = 1 ≈ FedAvg, smaller α (down to 0.3) faster, α = 0.1 stalls high,
    GraB ≈ FedAvg."""
    fedavg = _decay(0.1, 5)
    return _case(
        number,
        {
            "fedavg": _curve(fedavg),
            "bherd-1": _curve(lambda t: 1.005 * fedavg(t)),
            "bherd-0.7": _curve(_decay(0.1, 4)),
            "bherd-0.5": _curve(_decay(0.1, 3)),
            "bherd-0.3": _curve(_decay(0.1, 2.5)),
            "bherd-0.1": _curve(_decay(0.2, 5)),
            "grab": _curve(lambda t: 0.995 * fedavg(t), acc=0.905),
        },
    )


def _contrary(number):
    """Curves on which none holds: α = 1 off FedAvg by up to 5% mid-run (equal at the end), smaller α slower,
    α = 0.1 fine, GraB 10% lower loss."""
    fedavg = _decay(0.1, 5)
    return _case(
        number,
        {
            "fedavg": _curve(fedavg),
            "bherd-1": _curve(lambda t: (1 + 0.05 * math.sin(math.pi * t / ROUNDS)) * fedavg(t)),
            "bherd-0.7": _curve(_decay(0.1, 6)),
            "bherd-0.5": _curve(_decay(0.1, 7)),
            "bherd-0.3": _curve(_decay(0.12, 7)),
            "bherd-0.1": _curve(lambda t: 1.02 * fedavg(t)),
            "grab": _curve(lambda t: 0.9 * fedavg(t), acc=0.95),
        },
    )


def test_verdicts_on_a_case_where_every_claim_holds():
    per_case = repro.case_verdicts(_paper_like(1))
    assert {claim: held for claim, (held, _) in per_case.items()} == dict.fromkeys(repro.CLAIMS, True)
    text = repro.findings([_paper_like(1), _paper_like(2)])
    assert text.count("— agree.**") == 4 and "disagree" not in text
    assert "our numbers agree with all four of the paper's claims" in text


def test_verdicts_on_a_case_where_no_claim_holds():
    per_case = repro.case_verdicts(_contrary(1))
    assert {claim: held for claim, (held, _) in per_case.items()} == dict.fromkeys(repro.CLAIMS, False)
    assert "largest gap 5.0%" in per_case["tracks"][1]
    # the common loss is α = 0.3's final one (it plateaus highest); α = 1 gets there first
    common = _decay(0.12, 7)(ROUNDS)
    assert f"rounds to train loss {common:.4f}" in per_case["faster"][1]
    assert f"α = 0.3: {ROUNDS}" in per_case["faster"][1] and "α = 1: 12, α = 0.7: 14" in per_case["faster"][1]
    assert "(+-10.0%)" not in per_case["grab"][1] and "(-10.0%)" in per_case["grab"][1]
    text = repro.findings([_contrary(1), _contrary(2)])
    assert text.count("— disagree (holds in no case).**") == 4
    assert "we disagree with the paper on all 4 claims" in text
    assert "(holds in no case, and instead α = 1 is the fastest of the four in every case)" in text


def test_mixed_cases_disagree_and_say_where_the_claim_holds():
    cases = [_paper_like(1), _contrary(2), _paper_like(3)]
    overall = repro.verdicts({c["case"]: repro.case_verdicts(c) for c in cases})
    assert overall == dict.fromkeys(repro.CLAIMS, (False, [1, 3]))
    text = repro.findings(cases)
    assert "Case 2: does not hold" in text and "holds only in Cases 1, 3" in text
    assert "instead" not in text  # α = 1 is not the fastest in Cases 1 and 3


def test_summary_rounds_to_fedavg_final_loss_and_near_it():
    case = _contrary(1)
    s = case["summary"]
    assert s["fedavg"]["rounds_to_fedavg_final_loss"] == ROUNDS
    assert s["bherd-0.3"]["rounds_to_fedavg_final_loss"] is None  # plateaus at 0.12, above FedAvg's 0.107
    assert s["grab"]["rounds_to_fedavg_final_loss"] < ROUNDS  # 10% below FedAvg all along
    threshold = (1 + repro.NEAR) * s["fedavg"]["final_train_loss"]
    assert s["fedavg"]["rounds_to_near_fedavg_final_loss"] == repro.rounds_to_loss(case["curves"]["fedavg"], threshold)
    assert s["fedavg"]["rounds_to_near_fedavg_final_loss"] < ROUNDS
    table = repro.results_table([case])
    assert table.count("\n") == 2 + len(repro.VARIANTS) and "| 1 | BHerd α = 0.3 | 0.1" in table and "never" in table


def test_batch_note_explains_the_batch_size():
    note = repro.batch_note({"batch": 10, "client_sizes": [269, 270, 405], "dataset": "digits"})
    assert "B = 10, not the paper's default" in note and "τ_i = 26–40" in note
    assert "would leave τ_i = 2–4" in note and "every α < 1 selects 1 of the 2 gradients" in note and "Fig. 3c" in note
    assert "paper's default (τ_i = 120" in repro.batch_note({"batch": 100, "client_sizes": [12000], "dataset": "mnist"})


def test_tiny_reproduction(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs" / "reproductions.md"
    assert repro.main(["--rounds", "2", "--seeds", "1", "--no-progress"], out=out, quick=True, docs=str(docs)) == 0
    results = json.loads((out / "results.json").read_text())
    assert [c["case"] for c in results] == list(repro.CASES)
    for c in results:
        assert set(c["summary"]) == set(repro.VARIANTS)
        fedavg = c["summary"]["fedavg"]
        assert fedavg["rounds_to_fedavg_final_loss"] is not None  # FedAvg reaches its own final loss
        assert c["batch"] == 10 and len(c["client_sizes"]) == 5
        for s in c["summary"].values():
            assert 0.0 <= s["final_test_acc"] <= 1.0 and s["final_train_loss"] > 0
    section = docs.read_text()
    assert section.count("<!-- begin bherd -->") == 1 and "The paper's findings, checked" in section
    assert "**Batch size.** B = 10" in section
    assert ONE_SEED in section and "In short," not in section and "± <" not in section  # no verdict, no spread
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
