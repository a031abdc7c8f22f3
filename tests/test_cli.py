"""The `pyfedkern` command line: a short experiment end to end, resume after a kill, compare, partition, bench,
info, usage errors, and damaged or misused run directories, devices and dataset files."""

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
from pyfedkern.cli import main
from pyfedkern.reproduce import REPRODUCTIONS, SUMMARIES
from pyfedkern.sim.config import ExperimentConfig
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
        (["run", "--algorithm", "fedprox", "--muu", "1"], "--muu (did you mean --mu?); parameters of fedprox: --mu"),
    ],
)
def test_misspelled_options_suggest_the_nearest_general_or_algorithm_option(argv, message, tmp_path):
    returncode, _, err, _ = _python_m_pyfedkern(argv, tmp_path)
    assert returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pyfedkern {argv[0]}: error: ") and message in lines[0], err
    assert not (tmp_path / "x").exists()


def test_no_algorithm_parameter_is_taken_for_a_misspelled_command_option():
    import difflib

    from pyfedkern.algorithms import ALGORITHMS, algorithm_class
    from pyfedkern.cli import TYPO_CUTOFF, _long_options, build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    options = {flag for name in ("run", "compare") for flag in _long_options(commands[name])}
    for name in ALGORITHMS:
        for key in algorithm_class(name).hyperparameters():
            flag = f"--{key.replace('_', '-')}"
            if flag not in options:
                assert not difflib.get_close_matches(flag, options, n=1, cutoff=TYPO_CUTOFF), (name, flag)


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
