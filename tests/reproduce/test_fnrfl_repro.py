"""The FNR-FL reproduction on a tiny budget: report, table, results and docs section are written."""

from __future__ import annotations

import json

from pyfedkern.cli import main as cli_main
from pyfedkern.reproduce import REPRODUCTIONS
from pyfedkern.reproduce import fnrfl as repro
from pyfedkern.sim import compare as compare_module

TINY = ["--rounds", "2", "--clients", "4", "--seeds", "2", "--no-progress"]


def _table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| digits")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_tiny_reproduction(tmp_path, capsys, monkeypatch):
    # The per-seed compare.png files cost most of the time here; the reproduction's own plots stay real.
    monkeypatch.setattr(compare_module, "plot_curves", lambda runs, path, **kw: path)
    out, docs = tmp_path / "out", tmp_path / "docs" / "reproductions.md"
    assert repro.main([*TINY, "--data-root", str(tmp_path)], out=out, quick=True, docs=str(docs)) == 0

    rows = _table_rows((out / "table.md").read_text())
    expected = {(skew, repro.LABELS[v]) for skew, _ in repro.SETTINGS for v in repro.VARIANTS}
    assert len(rows) == len(expected) == 12
    assert {(r[1], r[3]) for r in rows} == expected
    for row in rows:
        for cell in row[6:8]:  # acc @ round min(10, rounds), final acc: "mean ± std"
            mean, std = (float(v) for v in cell.split("±"))
            assert 0.0 <= mean <= 1.0 and 0.0 <= std <= 1.0
    results = json.loads((out / "results.json").read_text())
    assert all(len(r["final_acc"]) == 2 and all(0 <= a <= 1 for a in r["final_acc"]) for r in results["rows"])
    assert all(t > 0 for r in results["rows"] for t in r["time_s"])
    assert "CIFAR-10 / ResNet-18-GN: skipped" in results["skipped"][0]

    report = (out / "report.md").read_text()
    assert (out / "table.md").read_text() in report and "Compared with the paper" in report
    for skew, _ in repro.SETTINGS:
        assert (out / f"digits-{skew}.png").stat().st_size > 0
        assert (docs.parent / "img" / f"fnrfl-digits-{skew}.png").exists()
    section = docs.read_text()
    assert "<!-- begin fnrfl -->" in section and "img/fnrfl-digits-feature.png" in section

    # A second call reuses every finished sub-run and gives the same numbers.
    capsys.readouterr()
    assert repro.main(TINY, out=out, quick=True, docs=None) == 0
    again = json.loads((out / "results.json").read_text())["rows"]
    assert [r["final_acc"] for r in again] == [r["final_acc"] for r in results["rows"]]


def test_registered_with_the_cli(tmp_path, monkeypatch):
    assert REPRODUCTIONS["fnrfl"] == "pyfedkern.reproduce.fnrfl"
    seen = {}
    monkeypatch.setattr(repro, "main", lambda argv, **kw: seen.update(argv=argv, **kw) or 0)
    assert cli_main(["reproduce", "fnrfl", "--quick", "--out", str(tmp_path), "--seeds", "1"]) == 0
    assert seen == {"argv": ["--seeds", "1"], "out": tmp_path, "quick": True, "docs": None}


def test_cifar_runs_only_when_its_files_are_present(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)]:
        (folder / name).touch()
    argv = ["--data-root", str(tmp_path)]
    setups, skipped = repro._setups(repro._parse(argv, quick=False), quick=False)
    assert [s.dataset for s in setups] == ["digits"] and "test_batch not found" in skipped[0]
    (folder / "test_batch").touch()
    setups, skipped = repro._setups(repro._parse(argv, quick=False), quick=False)
    cifar = setups[1]
    assert not skipped and (cifar.dataset, cifar.model, cifar.rounds, cifar.public_size) == (
        "cifar10",
        "resnet18",
        10,
        100,
    )
    assert [s.seeds for s in setups] == [[0, 1, 2, 3, 4], [0]]
