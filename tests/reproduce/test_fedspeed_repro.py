"""The FedSpeed reproduction on a tiny budget, and its rounds-to-target and verdict logic on synthetic curves."""

from __future__ import annotations

import json

import pytest

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import ONE_SEED, REPRODUCTIONS
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


def _rows(to_target, last10=None):
    """Result rows for one dataset: rounds-to-target (and last-10 accuracy) per method, the same for both α."""
    return [
        {
            "dataset": "digits",
            "alpha": a,
            "method": m,
            "targets": [0.85, 0.92],
            "to_target": list(to_target[m]),
            "last10_acc": [(last10 or {}).get(m, 0.9)],
        }
        for a in repro.ALPHAS
        for m in repro.METHODS
    ]


def test_verdict_counts_cells_where_each_fedspeed_variant_is_strictly_fastest():
    slow = {m: (100, None) for m in repro.METHODS}
    text = repro.verdict(_rows({**slow, "fedspeed": (50, 80)}))
    assert "FedSpeed (Alg. 1): fewer rounds than every baseline in 4 of 4 (Dir α, target) cells; fewer" in text
    assert (
        "FedSpeed (ρ0 = 0): fewer rounds than every baseline in 0 of 4 (Dir α, target) cells; fewer than FedAvg in 0"
        in text
    )
    assert "FedSpeed (corr_avg=all): fewer rounds than every baseline in 0 of 4" in text  # a tie is not a win
    assert "| Dir(0.3) → 85% | 50 | 100 | 100 | FedAvg 100 | 100 |" in text
    text = repro.verdict(_rows({**slow, "scaffold": (40, None), "fedspeed-all": (50, 80)}))
    assert "FedSpeed (corr_avg=all): fewer rounds than every baseline in 2 of 4" in text
    assert "fewer than FedAvg in 4 of 4" in text and "| SCAFFOLD 40 |" in text


def test_split_difference_adds_up_and_isolates_each_switch():
    grid = {("active", repro.RHO0): 30.0, ("all", repro.RHO0): 14.0, ("active", 0.0): 26.0, ("all", 0.0): 12.0}
    gap, server, perturb = repro.split_difference(grid)
    assert (gap, server, perturb) == (18.0, 15.0, 3.0)
    only_server = {("active", repro.RHO0): 5.0, ("all", repro.RHO0): 2.0, ("active", 0.0): 5.0, ("all", 0.0): 2.0}
    assert repro.split_difference(only_server) == (3.0, 3.0, 0.0)


def test_attribution_names_the_switch_that_explains_the_difference():
    rounds = {m: (20, 40) for m in repro.METHODS}
    rounds.update({"fedspeed": (30, 60), "fedspeed-rho0": (28, 58), "fedspeed-all": (21, 41), "feddyn": (20, 40)})
    acc = {"fedspeed": 0.90, "fedspeed-rho0": 0.91, "fedspeed-all": 0.95, "feddyn": 0.95}
    text = repro.attribution(_rows(rounds, acc))
    assert "over the 4 of 4 cells that all four reached: FedSpeed (Alg. 1) 180, FedDyn 120" in text
    assert "difference +60 = +54.0 from the server average" in text and "+6.0 from the perturbation" in text
    assert text.count("The server average of the correction accounts for the larger part.") == 2
    assert "FedSpeed (Alg. 1) 90.00%" in text and "the difference -5.00 points = -4.50 from the server" in text
    acc = {"fedspeed": 0.93, "fedspeed-rho0": 0.90, "fedspeed-all": 0.97, "feddyn": 0.95}
    text = repro.attribution(_rows(rounds, acc))
    assert "-2.00 points = -4.50 from the server average and +2.50 from the perturbation" in text
    assert "larger part (the two switches pull in opposite directions)." in text
    rounds["feddyn"] = (None, None)
    assert "no cell where all four grid methods reached the target" in repro.attribution(_rows(rounds, acc))


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
    assert ONE_SEED in capsys.readouterr().out and "fewer rounds than every baseline" not in docs.read_text()
    # FedDyn and FedSpeed decay the learning rate more slowly, as in the paper
    run_dir = out / "digits" / "dir0.3" / "seed0"
    configs = {m: json.loads((run_dir / m / "config.json").read_text()) for m in repro.METHODS}
    schedules = {m: c["lr_schedule"] for m, c in configs.items()}
    assert schedules["fedspeed"] == schedules["fedspeed-all"] == schedules["feddyn"] != schedules["fedavg"]
    assert schedules["fedavg"] == schedules["fedsam"]
    # every method on the same equal-size split; the variants differ only in their switch
    assert {c["partition"] for c in configs.values()} == {"dirichlet-equal:0.3"}
    assert {m: c["algorithm"] for m, c in configs.items() if m.startswith("fedspeed")} == dict.fromkeys(
        repro.FEDSPEED_VARIANTS, "fedspeed"
    )
    speed = configs["fedspeed"]["algorithm_params"]
    expected = {"lam": 10.0, "rho": 0.1, "alpha": 0.9375, "corr_avg": "active", "ref_compat": True}
    assert speed == expected  # prox weight 1/λ = 0.1, as FL-Simulator runs it
    assert all(c["algorithm_params"]["ref_compat"] is True for c in configs.values())  # the baselines too
    assert configs["fedspeed-all"]["algorithm_params"] == {**speed, "corr_avg": "all"}
    assert configs["fedspeed-rho0"]["algorithm_params"] == {**speed, "rho": 0.0}

    report = (out / "report.md").read_text()
    assert "| FedSpeed (Alg. 1) |" in report and "Compared with the paper" in report
    assert "What explains the difference between FedSpeed and FedDyn" in report
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
