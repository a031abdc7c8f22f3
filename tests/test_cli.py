"""The `pyfedkern` command line: a short experiment end to end, compare, partition, info and usage errors."""

import json

import pytest

from pyfedkern.cli import main

FAST = ["--rounds", "2", "--clients", "4", "--model", "logreg", "--partition", "iid", "--no-progress"]


def test_run_writes_results_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--algorithm", "fedprox", "--mu", "0.1", *FAST, "--out", str(out)]) == 0
    assert "test accuracy" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["algorithm_params"] == {"mu": 0.1} and config["rounds"] == 2
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 0


def test_compare_writes_plot_and_table(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "fedavg,fedprox", *FAST, "--out", str(out), "--target", "0.5"]) == 0
    for name in ("compare.png", "compare.md", "compare.json"):
        assert (out / name).exists()
    table = (out / "compare.md").read_text()
    assert "fedavg" in table and "fedprox" in table


def test_partition_prints_summary(capsys):
    assert main(["partition", "--partition", "shards:2", "--clients", "5"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n") >= 6


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"cuda", "openmp", "cuda_available"} <= set(info)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--algorithm", "nope", *FAST], "nope"),
        (["run", "--algorithm", "fedavg", "--mu", "1", *FAST], "unknown option --mu"),
        (["run", "--algorithm", "fedprox", "--mu", "abc", *FAST], "--mu"),
        (["run", "--algorithm", "fedavg", "--rounds", "0", "--no-progress"], "rounds"),
        (["run", "--resume", "--no-progress"], "--resume needs --out"),
        (["run", "--dataset", "mnist", "--data-root", "/nonexistent", *FAST], "nonexistent"),
        (["compare", "--algorithms", "fedavg,fedavg", *FAST, "--out", "x"], "duplicates"),
    ],
)
def test_usage_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err
