"""The `pyfedkern` command line: a short experiment end to end, resume after a kill, compare, partition, bench,
info and usage errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pyfedkern
from pyfedkern.cli import main
from pyfedkern.reproduce import REPRODUCTIONS, SUMMARIES
from pyfedkern.sim.engine import Simulation, load_config
from pyfedkern.sim.results import read_metrics

FAST = ["--rounds", "2", "--clients", "4", "--model", "logreg", "--partition", "iid", "--no-progress"]


def _numbers(metrics):
    """Metrics without wall-clock times (which differ between runs)."""
    return [{k: v for k, v in m.items() if not k.startswith("time")} for m in metrics]


def test_run_writes_results_and_will_not_resume_a_finished_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "--algorithm", "fedprox", "--mu", "0.1", *FAST, "--out", str(out)]) == 0
    assert "test accuracy" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["algorithm_params"] == {"mu": 0.1} and config["rounds"] == 2
    metrics = (out / "metrics.jsonl").read_text()
    assert [json.loads(line)["round"] for line in metrics.splitlines()] == [0, 1, 2]
    assert main(["run", "--resume", "--out", str(out), "--no-progress"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert (out / "metrics.jsonl").read_text() == metrics
    assert main(["run", "--resume", "--out", str(out), "--rounds", "5", "--mu", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "these options contradict it: --rounds 5 (the run has rounds=2), --mu 1.0 (the run has mu=0.1)" in err


def test_resume_after_a_kill_gives_the_uninterrupted_metrics(tmp_path):
    out = tmp_path / "killed"
    argv = ["run", "--clients", "10", "--partition", "iid", "--rounds", "40", "--checkpoint-every", "1"]
    root = str(Path(pyfedkern.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pyfedkern.cli", *argv, "--no-progress", "--out", str(out)]
    # cwd outside the checkout: `python -m` puts the cwd first on sys.path, and the source tree has no _C.
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(out)) < 4:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "the run wrote no metrics in 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "summary.json").exists(), "the run finished before it was killed"
    done = len(read_metrics(out))
    assert 4 <= done < 41
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"round": 99, "test_')  # what a kill in the middle of a write leaves

    resumed = subprocess.run(
        [sys.executable, "-m", "pyfedkern.cli", "run", "--resume", "--out", str(out), "--no-progress"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    uninterrupted = Simulation(load_config(out)).run(tmp_path / "uninterrupted")
    assert [m["round"] for m in read_metrics(out)] == list(range(41))
    assert _numbers(read_metrics(out)) == _numbers(uninterrupted)
    assert json.loads((out / "summary.json").read_text())["rounds"] == 40


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


def test_run_with_progress_bar_shows_round_and_accuracy(tmp_path, capsys):
    fast = [a for a in FAST if a != "--no-progress"]
    assert main(["run", *fast, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "fedavg" in err and "2/2" in err and "acc=" in err and "loss=" in err


def test_bench_prints_speedups_over_the_peers(capsys, monkeypatch):
    from pyfedkern.benchmarks import aggregate

    monkeypatch.setattr(aggregate, "QUICK_SIZES", [(4, 1000)])  # the real cases, tiny, to keep the test quick
    assert main(["bench", "--family", "aggregate", "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "### weighted_sum K=4 d=1e3 float32 cpu" in table and "| pyfedkern speedup |" in table
    for peer in ("| pyfedkern |", "torch.tensordot", "torch add_ loop", "numpy w @ X", "flower-style", "limit:copy"):
        assert peer in table, peer
    assert "pyfedkern vs fastest peer" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--algorithm", "nope", *FAST], "unknown algorithm 'nope'; valid choices: "),
        (["run", "--dataset", "nope", *FAST], "unknown dataset 'nope'; valid choices: cifar10, digits, mnist"),
        (["run", *FAST, "--partition", "nope"], "unknown partition 'nope'; valid choices: bherd1,"),
        (["run", "--model", "nope", "--rounds", "1"], "unknown model 'nope'; valid choices: cnn, logreg, mlp"),
        (["compare", "--algorithms", "fedavg,nope", *FAST, "--out", "x"], "unknown algorithm 'nope'; valid choices"),
        (["run", "--partition", "dirichlet:0", "--no-progress"], "dirichlet:α must be > 0, got 0"),
        (["run", "--partition", "dirichlet:-1", "--dataset", "mnist", "--no-progress"], "dirichlet:α must be > 0"),
        (["run", "--clients", "5000", "--no-progress"], "clients=5000 is more than the 1347 training samples"),
        (["run", "--fraction", "1.5", "--no-progress"], "fraction must be in (0, 1], got 1.5"),
        (["run", "--fraction", "0", "--no-progress"], "fraction must be in (0, 1], got 0"),
        (["info", "--verbose"], "unexpected argument(s): --verbose"),
        (["bench", "--famly", "all"], "unexpected argument(s): --famly all"),
        (["partition", "--clients", "3", "extra"], "unexpected argument(s): extra"),
        (["bench", "--family", "nope", "--no-progress"], "unknown benchmark family 'nope'; valid choices: all,"),
    ],
)
def test_bad_names_and_values_are_reported_before_any_work(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pyfedkern {argv[0]}: error: ") and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
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


def _python_m_pyfedkern(argv, cwd):
    """Run ``python -X importtime -m pyfedkern ARGV`` in a fresh interpreter from ``cwd``; return the exit code,
    stdout, stderr without the import-time lines, and the names of the modules it imported."""
    root = str(Path(pyfedkern.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pyfedkern", *argv],
        env=env,
        cwd=cwd,  # outside the checkout: `python -m` puts the cwd first on sys.path, and the source tree has no _C
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = proc.stderr.splitlines()
    imported = {line.rpartition("|")[2].strip() for line in lines if line.startswith("import time:")}
    err = "\n".join(line for line in lines if not line.startswith("import time:"))
    return proc.returncode, proc.stdout, err, imported


@pytest.mark.parametrize(
    ("argv", "code", "expected"),
    [
        (["--help"], 0, ["run", "compare", "partition", "reproduce", "bench", "info", "--version"]),
        (["--version"], 0, [f"pyfedkern {pyfedkern.__version__}"]),
        (["run", "--help"], 0, ["--rounds", "(default: 50)", "--help-algorithm"]),
        (["compare", "--help"], 0, ["--algorithms", "--target"]),
        (["reproduce", "--help"], 0, [*REPRODUCTIONS, SUMMARIES["bherd"][:40], "NAME --help"]),
        (["run", "--rounds", "abc"], 2, ["--rounds: invalid int value: 'abc'"]),
        (["frobnicate"], 2, ["pyfedkern: error: argument command: invalid choice: 'frobnicate'"]),
        ([], 2, ["pyfedkern: error: the following arguments are required: command"]),
        (["compare", "--rounds", "3"], 2, ["required: --algorithms"]),
        (["bench", "--famly", "all"], 2, ["unexpected argument(s): --famly all (did you mean --family?)"]),
        (["reproduce"], 2, ["name a reproduction: bherd, dynamic, fedpbc, fedspeed, fnrfl"]),
        (["reproduce", "nope"], 2, ["unknown reproduction 'nope'"]),
    ],
)
def test_help_version_and_usage_errors_answer_without_importing_torch(argv, code, expected, tmp_path):
    returncode, out, err, imported = _python_m_pyfedkern(argv, tmp_path)
    assert returncode == code, err
    for text in expected:
        assert text in (out if code == 0 else err), text
    if code == 2:
        assert len(err.strip().splitlines()) == 1, err
    assert "pyfedkern.cli" in imported
    assert not {"torch", "pyfedkern.sim.engine", "pyfedkern.algorithms", "matplotlib", "sklearn"} & imported


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--rouns", "5"], "unknown option --rouns (did you mean --rounds?); parameters of fedavg:"),
        (["run", "--no-progres"], "unknown option --no-progres (did you mean --no-progress?)"),
        (["run", "--algorithm", "fedprox", "--mu"], "option --mu needs a value"),
        (["compare", "--algorithms", "fedavg,fedprox", "--out", "x", "--m", "1"], "--m (did you mean --mu?)"),
        (["run", "--algorithm", "fedprox", "--muu", "1"], "--muu (did you mean --mu?); parameters of fedprox: --mu"),
    ],
)
def test_misspelled_options_suggest_the_nearest_general_or_algorithm_option(argv, message, tmp_path):
    returncode, _, err, _ = _python_m_pyfedkern(argv, tmp_path)
    assert returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pyfedkern {argv[0]}: error: ") and message in lines[0], err
    assert not (tmp_path / "x").exists()


def test_reproduce_help_with_a_name_lists_its_own_options(tmp_path):
    returncode, out, err, _ = _python_m_pyfedkern(["reproduce", "bherd", "--help"], tmp_path)
    assert returncode == 0, err
    assert "--quick" in out and "--seeds" in out and "MNIST" in out
    assert set(SUMMARIES) == set(REPRODUCTIONS)
