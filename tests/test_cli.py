"""The `pyfedkern` command line: a short experiment end to end, resume after a kill, compare, partition, bench,
info, usage errors, and damaged or misused run directories, devices and dataset files."""

import dataclasses
import gzip
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pyfedkern
from pyfedkern.benchmarks import FAMILIES
from pyfedkern.cli import main
from pyfedkern.data.partitions import PARTITIONS
from pyfedkern.reproduce import REPRODUCTIONS, SUMMARIES
from pyfedkern.sim.checkpoints import load_config
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation
from pyfedkern.sim.results import read_metrics

# every partition as `--help` writes it (name, or name:arguments)
PARTITION_FORMS = [
    *("iid", "dirichlet:α", "dirichlet-equal:α", "shards:k", "quantity:α", "noise:σ", "bherd1", "bherd2", "bherd3"),
    *("groups:o,α", "natural"),
]
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
    assert "these options contradict it: --mu 1.0 (the run has mu=0.1);" in err
    assert "--rounds" not in err  # more rounds extend the run
    assert main(["run", "--resume", "--out", str(out), "--rounds", "1", "--no-progress"]) == 2
    assert "nothing to resume: the run in" in capsys.readouterr().err


def test_resume_with_more_rounds_extends_a_finished_run_saying_from_where(tmp_path, capsys):
    out, direct = tmp_path / "run", tmp_path / "direct"
    assert main(["run", *FAST, "--out", str(out)]) == 0
    assert main(["run", *FAST, "--rounds", "4", "--out", str(direct)]) == 0
    capsys.readouterr()
    assert (
        main(["run", "--resume", "--out", str(out), "--rounds", "4", "--checkpoint-every", "3", "--no-progress"]) == 0
    )
    said = capsys.readouterr().out
    assert f"resuming {out} from round 2 (checkpoint round_000002.pt): rounds 3..4 to run" in said
    assert _numbers(read_metrics(out)) == _numbers(read_metrics(direct))
    assert torch.equal(torch.load(out / "model.pt")["x"], torch.load(direct / "model.pt")["x"])
    assert load_config(out) == dataclasses.replace(load_config(direct), checkpoint_every=3)
    assert json.loads((out / "summary.json").read_text())["rounds"] == 4


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


def test_partition_plot_prints_the_file_it_wrote(tmp_path):
    command = [sys.executable, "-m", "pyfedkern", "partition", "--partition", "shards:2", "--clients", "5"]
    (tmp_path / "plots").mkdir()
    for given, written in [("shards", "shards.png"), ("plots", "plots/partition.png"), ("split.svg", "split.svg")]:
        proc = subprocess.run([*command, "--plot", given], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == f"plot: {Path(written)}"
        assert (tmp_path / written).stat().st_size > 1000
    proc = subprocess.run([*command, "--plot", "plot.xyz"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("pyfedkern partition: error: ") and "xyz" in proc.stderr
    assert proc.stderr.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "shards.png", "split.svg"]


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"cuda", "max_threads", "cuda_available"} <= set(info)


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
        (["run", "--dataset", "nope", *FAST], "unknown dataset 'nope'; valid choices: cifar10, digits, leaf, mnist"),
        (["run", *FAST, "--partition", "nope"], "unknown partition 'nope'; valid choices: bherd1,"),
        (["run", "--model", "nope", "--rounds", "1"], "unknown model 'nope'; valid choices: cnn, logreg, lstm, mlp"),
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
        (["run", "--algorithm", "fedavg", "--mu", "1", *FAST], "unknown option --mu (a parameter of fedprox)"),
        (["run", "--lr", "1e39", *FAST], "lr must be within float32's range"),
        (["run", "--algorithm", "fedprox", "--mu", "1e39", *FAST], "fedprox: mu must be within float32's range"),
        (["run", "--lr-schedule", "invsqrt:inf", *FAST], "needs a finite c > 0"),
        (["compare", "--algorithms", "fedavg", "--target", "nan", *FAST, "--out", "x"], "target must be an accuracy"),
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


def test_the_resume_hint_names_the_directory_and_how_the_run_was_launched(tmp_path, monkeypatch):
    """Run alone, with --workers, or as a rank that torchrun started: the resume command for that launch."""
    import argparse

    from pyfedkern.cli import _interrupted

    run = tmp_path / "a run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    monkeypatch.delenv("RANK", raising=False)
    args = argparse.Namespace(command="run", out=str(run), workers=None)
    assert _interrupted(args) == f"interrupted; resume with `pyfedkern run --resume --out '{run}'`"
    args.workers = 3
    assert _interrupted(args) == f"interrupted; resume with `pyfedkern run --resume --out '{run}' --workers 3`"
    monkeypatch.setenv("RANK", "0")
    args.workers = None
    assert _interrupted(args) == (
        f"interrupted; resume with `torchrun ... -m pyfedkern run --resume --out '{run}'`, launched as this run was "
        "(the same number of ranks)"
    )


def test_an_interruption_before_the_run_began_does_not_offer_a_resume(tmp_path, monkeypatch, capsys):
    from pyfedkern.sim import engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as a Ctrl-C while the data loads

    monkeypatch.setattr(engine.Simulation, "__init__", interrupted)
    assert main(["run", *FAST, "--out", str(tmp_path / "run")]) == 130
    assert (
        capsys.readouterr().err
        == f"pyfedkern run: interrupted before the run began (nothing was written to {tmp_path / 'run'})\n"
    )


def test_partition_takes_a_dataset_factory_and_makes_the_plot_folders(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_data.py").write_text(
        "import numpy as np\n\n\ndef load():\n    rng = np.random.default_rng(0)\n"
        "    x, y = rng.standard_normal((60, 3)).astype(np.float32), np.arange(60) % 3\n"
        "    return (x[:40], y[:40]), (x[40:], y[40:])\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["partition", "--dataset", "my_data:load", "--partition", "iid", "--clients", "4"]
    assert main([*argv, "--plot", "plots/sub/split.png"]) == 0
    assert (tmp_path / "plots/sub/split.png").exists() and "total" in capsys.readouterr().out


def test_experiment_takes_numpy_numbers_as_settings():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = x.astype(np.float32)
    experiment = pyfedkern.Experiment(
        lambda: torch.nn.Linear(64, 10), (x[:500], y[:500]), test=(x[500:600], y[500:600]),
        rounds=np.int64(2), seed=np.int64(3), lr=np.float32(0.125), batch_size=np.int32(32),
    )  # fmt: skip
    assert (experiment.config.rounds, experiment.config.seed, experiment.config.lr) == (2, 3, 0.125)
    assert type(experiment.config.rounds) is int and len(experiment.run()) == 3


def _python_m_pyfedkern(argv, cwd):
    """Run ``python -X importtime -m pyfedkern ARGV`` in a fresh interpreter from ``cwd``; return the exit code,
    stdout, stderr without the import-time lines, and the names of the modules it imported."""
    root = str(Path(pyfedkern.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    env["COLUMNS"] = "1000"  # help on one line per option, as tests look for it
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
        (["run", "--help"], 0, ["--rounds", "(default: 50)", "--help-algorithm", *PARTITION_FORMS, "synthetic-iid"]),
        (
            ["run", "--help"],
            0,
            ["synthetic:α,β[,N[,dim[,classes]]] (Li et al.'s synthetic(α,β): N clients, default 30"],
        ),
        (["partition", "--help"], 0, [*PARTITION_FORMS, "number of clients (default: 20)", "random seed of the split"]),
        (["partition", "--help"], 0, ["directory holding the MNIST / CIFAR-10 files", "synthetic-iid"]),
        (["bench", "--help"], 0, [" | ".join(FAMILIES) + " | all (default: aggregate)"]),
        (["compare", "--help"], 0, ["--algorithms", "--target"]),
        (["reproduce", "--help"], 0, [*REPRODUCTIONS, SUMMARIES["bherd"][:40], "NAME --help"]),
        (["run", "--rounds", "abc"], 2, ["--rounds: invalid int value: 'abc'"]),
        (["frobnicate"], 2, ["pyfedkern: error: unknown command 'frobnicate'; the commands are run, compare,"]),
        (["runn", "--rounds", "3"], 2, ["pyfedkern: error: unknown command 'runn' (did you mean run?); the commands"]),
        (["comapre"], 2, ["unknown command 'comapre' (did you mean compare?)"]),
        ([], 2, ["pyfedkern: error: the following arguments are required: command"]),
        (["compare", "--rounds", "3"], 2, ["required: --algorithms"]),
        (["bench", "--famly", "all"], 2, ["unexpected argument(s): --famly all (did you mean --family?)"]),
        (["reproduce"], 2, ["name a reproduction: bherd, dynamic, fedpbc, fedspeed, fnrfl"]),
        (["reproduce", "nope"], 2, ["unknown reproduction 'nope'"]),
        (["run", "--rouns", "5"], 2, ["unknown option --rouns (did you mean --rounds?)"]),
        (["compare", "--algorithms", "fedavg", "--out", "x", "--clientz", "3"], 2, ["(did you mean --clients?)"]),
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
        (["run", "--no-progres"], "unknown option --no-progres (did you mean --no-progress?)"),
        (["run", "--algorithm", "fedprox", "--mu"], "option --mu needs a value"),
        (["compare", "--algorithms", "fedavg,fedprox", "--out", "x", "--m", "1"], "--m (did you mean --mu?)"),
        (
            ["run", "--algorithm", "fedprox", "--muu", "1"],
            "--muu (did you mean --mu?); parameters of fedprox: --clip-norm, --mu, --ref-compat, --server-lr",
        ),
    ],
)
def test_misspelled_options_suggest_the_nearest_general_or_algorithm_option(argv, message, tmp_path):
    returncode, _, err, _ = _python_m_pyfedkern(argv, tmp_path)
    assert returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pyfedkern {argv[0]}: error: ") and message in lines[0], err
    assert not (tmp_path / "x").exists()


def test_the_help_names_every_partition():
    assert sorted(form.partition(":")[0] for form in PARTITION_FORMS) == sorted(PARTITIONS)


def test_no_algorithm_parameter_is_taken_for_a_misspelled_command_option():
    from pyfedkern.algorithms import ALGORITHMS, algorithm_class
    from pyfedkern.cli import _long_options, build_parser, near_miss

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    options = {flag for name in ("run", "compare") for flag in _long_options(commands[name])}
    for name in ALGORITHMS:
        for key in algorithm_class(name).hyperparameters():
            flag = f"--{key.replace('_', '-')}"
            if flag not in options:
                assert near_miss(flag, options) is None, (name, flag)


def test_reproduce_help_with_a_name_lists_its_own_options(tmp_path):
    returncode, out, err, _ = _python_m_pyfedkern(["reproduce", "bherd", "--help"], tmp_path)
    assert returncode == 0, err
    assert "--quick" in out and "--seeds" in out and "MNIST" in out
    assert set(SUMMARIES) == set(REPRODUCTIONS)


# Run directories: each case a real `python -m pyfedkern` run that must exit 2 with one line naming the problem
# (or go on, saying so) and lose or change no file of the run directory.

# fedprox, lr 0.05, mu 0.1: rounds 1-4 recorded, checkpoints of rounds 3 and 4 kept, round 5 to run
RUN = ExperimentConfig(
    algorithm="fedprox",
    algorithm_params={"mu": 0.1},
    clients=4,
    rounds=5,
    model="logreg",
    partition="iid",
    batch_size=64,
    lr=0.05,
    checkpoint_every=1,
)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """RUN stopped at the start of round 4 (a template: tests take copies), and RUN's uninterrupted metrics."""
    base = tmp_path_factory.mktemp("interrupted")
    full = Simulation(RUN).run(base / "full")
    sim = Simulation(RUN)
    original = sim.algorithm.round

    def crash(t, ctx):
        if t == 4:
            raise KeyboardInterrupt
        return original(t, ctx)

    sim.algorithm.round = crash
    with pytest.raises(KeyboardInterrupt):
        sim.run(base / "cut")
    return base / "cut", full


@pytest.fixture
def cut(interrupted, tmp_path):
    return Path(shutil.copytree(interrupted[0], tmp_path / "cut"))


def _error_line(argv, cwd) -> str:
    """The one line a failing command prints (it must exit 2 and print nothing else)."""
    returncode, _, err, _ = _python_m_pyfedkern(argv, cwd)
    lines = err.strip().splitlines()
    assert returncode == 2 and len(lines) == 1 and lines[0].startswith(f"pyfedkern {argv[0]}: error: "), err
    return lines[0]


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--algorithm", "scaffold"], "--algorithm scaffold (the run has algorithm=fedprox)"),
        (["--lr", "0.1"], "--lr 0.1 (the run has lr=0.05)"),  # the default given explicitly is still a contradiction
        (["--parity", "--rounds", "5", "--mu=1"], "--parity (the run has parity=false), --mu 1.0 (the run has mu=0.1)"),
    ],
)
def test_resume_refuses_options_that_contradict_the_stored_config(cut, files_under, options, message):
    before = files_under(cut)
    line = _error_line(["run", "--resume", "--out", str(cut), *options], cut.parent)
    assert f"these options contradict it: {message}" in line
    assert files_under(cut) == before


def test_resume_with_options_that_agree_and_a_damaged_checkpoint_goes_on_saying_so(cut, interrupted):
    (cut / "checkpoints" / "round_000004.pt").write_bytes(b"garbage")
    argv = ["run", "--resume", "--out", str(cut), "--algorithm", "fedprox", "--mu", "0.1", "--lr", "0.05"]
    returncode, _, err, _ = _python_m_pyfedkern([*argv, "--rounds", "5", "--no-progress"], cut.parent)
    assert returncode == 0, err
    assert err.strip().splitlines() == [
        f"pyfedkern run: warning: damaged checkpoint(s) in {cut / 'checkpoints'} set aside: round_000004.pt (its 7 "
        "bytes do not match the SHA-256 in round_000004.pt.sha256) -> round_000004.pt.damaged; resuming from "
        "round_000003.pt (round 3)"
    ]
    assert _numbers(read_metrics(cut)) == _numbers(interrupted[1])
    assert (cut / "checkpoints" / "round_000004.pt.damaged").read_bytes() == b"garbage"


def _craft_round(path: Path, round_) -> None:
    """Checkpoint ``path`` saying it is of round ``round_``, its checksum made to match."""
    state = torch.load(path, weights_only=True)
    buffer = io.BytesIO()
    torch.save({**state, "round": round_}, buffer)
    path.write_bytes(buffer.getvalue())
    digest = hashlib.sha256(buffer.getvalue()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")


def _no_intact_checkpoint(run: Path) -> None:
    for name in ("round_000003.pt", "round_000004.pt"):
        _flip = bytearray((run / "checkpoints" / name).read_bytes())
        _flip[100] ^= 1
        (run / "checkpoints" / name).write_bytes(bytes(_flip))


def _crafted_round_only(run: Path) -> None:
    (run / "checkpoints" / "round_000003.pt").unlink()
    _craft_round(run / "checkpoints" / "round_000004.pt", -3)


def _metrics_line_without_round(run: Path) -> None:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([*lines[:2], '{"test_acc": 0.5}', *lines[3:]]) + "\n")


def _binary_metrics(run: Path) -> None:
    (run / "metrics.jsonl").write_bytes(b'{"round": 0}\n\x00\x9f\x92\x96 binary\n')


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_no_intact_checkpoint, "no intact checkpoint is left (round_000004.pt: its "),
        (_crafted_round_only, "round_000004.pt: it says round -3, its name round 4"),
        (
            lambda run: _edit_json(run / "config.json", algorithm="scaffold", algorithm_params={}, clients=8),
            'differs in algorithm ("fedprox" -> "scaffold"), algorithm_params ({"mu": 0.1} -> {}), clients (4 -> 8)',
        ),
        (lambda run: _edit_json(run / "config.json", rounds=2), "config.json asks for 2 rounds, but metrics.jsonl"),
        (_metrics_line_without_round, "metrics.jsonl: line 3 is not a round's record"),
        (_binary_metrics, "metrics.jsonl: line 2 is not text (not UTF-8)"),
        (lambda run: (run / "config.json").write_text("[1, 2]"), "config.json must hold a JSON object"),
    ],
    ids=["no-intact", "crafted-round", "edited", "rounds-cut", "no-round", "binary", "list"],
)
def test_resume_of_a_damaged_or_edited_run_directory_fails_cleanly_and_changes_nothing(
    cut, files_under, damage, message
):
    damage(cut)
    before = files_under(cut)
    line = _error_line(["run", "--resume", "--out", str(cut), "--no-progress"], cut.parent)
    assert message in line and str(cut) in line
    assert files_under(cut) == before


def test_an_unusable_out_directory_is_a_one_line_error(tmp_path, unwritable):
    (tmp_path / "file").write_text("mine")
    line = _error_line(["run", *FAST, "--out", str(tmp_path / "file" / "run")], tmp_path)
    assert f"cannot create the run directory {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file" in line
    assert (tmp_path / "file").read_text() == "mine"
    with unwritable(tmp_path / "locked") as locked:
        line = _error_line(["run", *FAST, "--out", str(locked / "run")], tmp_path)
        assert f"cannot create the run directory {locked / 'run'}: " in line
        assert not list(locked.iterdir())


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda:x", "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ("cuda:-1", "device must be 'cpu', 'cuda' or 'cuda:N'"),
        ("cuda", "device 'cuda' cannot be used here: "),
        ("cuda:7", "device 'cuda:7' cannot be used here: "),
    ],
    ids=["letter", "negative", "default-gpu", "gpu-7"],  # no bare "cuda": conftest reads it as a GPU test's mark
)
def test_an_unusable_device_is_a_one_line_error(device, message, tmp_path):
    if device in ("cuda", "cuda:7") and pyfedkern.cuda_available() and torch.cuda.device_count() > 7:
        pytest.skip(f"{device} is usable here")
    line = _error_line(["run", *FAST, "--device", device, "--out", str(tmp_path / "run")], tmp_path)
    assert message in line
    assert not (tmp_path / "run").exists()


def test_unreadable_dataset_files_are_one_line_errors_naming_the_file(tmp_path):
    cifar = tmp_path / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    batch = {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (cifar / name).write_bytes(pickle.dumps(batch, protocol=2))
    (cifar / "data_batch_2").write_bytes(b"cposix\nsystem\n(S'touch pwned'\ntR.")  # a global the unpickler refuses
    line = _error_line(["run", *FAST, "--dataset", "cifar10", "--data-root", str(tmp_path / "cifar")], tmp_path)
    assert f"CIFAR-10 batch {cifar / 'data_batch_2'}: refusing to load global posix.system" in line
    assert not (tmp_path / "pwned").exists()

    mnist = tmp_path / "mnist"
    mnist.mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        (mnist / f"{name}.gz").write_bytes(gzip.compress(b"\x00" * 64)[:-12])  # cut short
    (mnist / "t10k-labels-idx1-ubyte").write_bytes(b"\x00" * 64)
    line = _error_line(["run", *FAST, "--dataset", "mnist", "--data-root", str(mnist)], tmp_path)
    assert f"cannot read IDX file {mnist / 'train-images-idx3-ubyte.gz'}: " in line


@pytest.mark.parametrize("flag", ["--batched", "--channels-last"])
@pytest.mark.parametrize(("value", "expected"), [("auto", None), ("AUTO", None), ("true", True), ("no", False)])
def test_batched_and_channels_last_take_auto_true_or_false(flag, value, expected, tmp_path):
    assert main(["run", *FAST, flag, value, "--out", str(tmp_path / "run")]) == 0
    assert getattr(load_config(tmp_path / "run"), flag[2:].replace("-", "_")) is expected


@pytest.mark.parametrize("flag", ["--batched", "--channels-last"])
def test_batched_and_channels_last_refuse_other_values(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", *FAST, flag, "sometimes"])
    assert exit_.value.code == 2
    assert f"argument {flag}: expected true, false or auto, got 'sometimes'" in capsys.readouterr().err


def _start_run(argv, cwd) -> subprocess.Popen:
    """``python -m pyfedkern ARGV`` in the background (its stderr piped)."""
    root = str(Path(pyfedkern.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pyfedkern", *argv]
    return subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_rounds(proc: subprocess.Popen, out: Path, rounds: int) -> None:
    deadline = time.monotonic() + 180
    while len(read_metrics(out)) < rounds:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"the run wrote {rounds} rounds in 180 s"
        time.sleep(0.01)


def test_one_writer_per_run_directory_and_ctrl_c_says_how_to_resume(tmp_path):
    """While a run writes --out, a resume or a new run there is refused naming its PID, and the run's metrics stay
    whole; Ctrl-C then stops it with the real --out in the advice, no temporary file left, and resume says where it
    goes on."""
    out = tmp_path / "my run"
    argv = ["run", "--clients", "10", "--partition", "iid", "--rounds", "100000", "--checkpoint-every", "1"]
    writer = _start_run([*argv, "--no-progress", "--out", str(out)], tmp_path)
    try:
        _wait_for_rounds(writer, out, 3)
        for second in (["run", "--resume", "--out", str(out)], [*argv, "--out", str(out)]):
            line = _error_line([*second, "--no-progress"], tmp_path)
            assert f"run directory {out} is being written by another process (PID {writer.pid})" in line, line
        assert writer.poll() is None
        writer.send_signal(signal.SIGINT)
        _, err = writer.communicate(timeout=120)
    finally:
        writer.kill()
        writer.wait()
    assert writer.returncode == 130, err
    assert (
        err.strip().splitlines()[-1]
        == f"pyfedkern run: interrupted; resume with `pyfedkern run --resume --out '{out}'`"
    )
    assert not list(out.rglob("*.tmp"))
    done = len(read_metrics(out)) - 1  # whole: every round recorded once, in order
    assert 3 <= done < 100000
    newest = max(int(p.name[6:12]) for p in (out / "checkpoints").glob("round_*.pt"))
    returncode, said, err, _ = _python_m_pyfedkern(
        ["run", "--resume", "--out", str(out), "--rounds", str(done + 2)], tmp_path
    )
    assert returncode == 0, err
    assert (
        f"resuming {out} from round {newest} (checkpoint round_{newest:06d}.pt): rounds {newest + 1}..{done + 2}"
        in said
    )
    assert len(read_metrics(out)) == done + 3


def test_ctrl_c_of_a_run_without_out_says_nothing_was_saved(tmp_path):
    proc = _start_run(["run", "--rounds", "100000", "--clients", "10", "--partition", "iid"], tmp_path)
    try:
        seen, deadline = "", time.monotonic() + 180
        while "round" not in seen:  # the progress bar: the rounds have begun
            assert proc.poll() is None and time.monotonic() < deadline, seen
            seen += os.read(proc.stderr.fileno(), 1024).decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert "pyfedkern run: interrupted (without --out nothing was saved)\n" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--threads", "1000000"], "threads=1000000 is more than the "),
        (["--batch-size", "1" + "0" * 20], "batch_size must be an integer from 1 to 2^63 - 1, got 1" + "0" * 20),
        (["--local-steps", "1" + "0" * 20], "local_steps must be an integer from 1 to 2^63 - 1"),
        (["--seed", str(2**64)], f"seed must be an integer from 0 to 2^63 - 1, got {2**64}"),
        (["--local-epochs", "1e300"], "local_epochs=1e+300 makes 4.4e+301 local steps a round (4 participants)"),
        (["--local-steps", "1" + "0" * 15], "planning their minibatches needs about"),
        (["--model", "mlp", "--model-param", "hidden=1000000000000"], "model mlp with hidden=1000000000000 has "),
        (["--model", "mlp", "--model-param", "hidden=1000000000,1000"], "has 1,065,000,011,010 parameters; the run"),
        (["--dataset", "quadratic:1000000000,1000", "--model", "quadratic", "--partition", "natural"], "clients fit"),
        (["--out", ""], "--out '' names no directory"),
        (["--rounds", "-1"], "rounds must be an integer from 1 to 2^63 - 1, got -1"),
    ],
    ids=[
        "threads",
        "batch-size",
        "local-steps",
        "seed",
        "local-epochs",
        "steps-memory",
        "layer",
        "model",
        "data",
        "out",
        "rounds",
    ],
)
def test_absurd_numbers_are_one_line_errors_naming_the_option(options, message, tmp_path):
    fast = [a for a in FAST if a not in ("--rounds", "2")]
    line = _error_line(["run", *fast, *options], tmp_path)
    assert message in line
    assert list(tmp_path.iterdir()) == []  # nothing written (--out '' is not the current directory)


def test_ctrl_c_of_a_comparison_says_to_run_it_again(tmp_path, capsys, monkeypatch):
    import pyfedkern.sim.compare

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pyfedkern.sim.compare, "compare", interrupted)
    assert main(["compare", "--algorithms", "fedavg", *FAST, "--out", str(tmp_path / "cmp")]) == 130
    assert capsys.readouterr().err == (
        f"pyfedkern compare: interrupted; run the same command again to go on: the finished runs in "
        f"{tmp_path / 'cmp'} are reused and the interrupted one resumed\n"
    )
