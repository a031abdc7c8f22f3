"""Run directories: checkpoint integrity and fallback, resume checks that change no file before they pass, config
fingerprints, and clean errors for damaged metrics/config files and unusable output directories."""

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from pyfedkern.sim.checkpoints import check_resumable, load_config
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation
from pyfedkern.sim.results import DirectoryLocked, RunWriter, check_new_run_dir, read_config, read_metrics

# rounds 1-4 recorded, checkpoints of rounds 3 and 4 kept (the newest two), round 5 still to run
CONFIG = ExperimentConfig(
    clients=4, rounds=5, model="logreg", partition="iid", batch_size=64, checkpoint_every=1, algorithm="scaffold"
)
CRASH_ROUND = 4


def _numbers(metrics):
    return [{k: v for k, v in m.items() if not k.startswith("time")} for m in metrics]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run of CONFIG (its metrics and model) and a template of the same run interrupted at the
    start of round CRASH_ROUND."""
    base = tmp_path_factory.mktemp("runs")
    full = Simulation(CONFIG).run(base / "full")
    sim = Simulation(CONFIG)
    original = sim.algorithm.round

    def crash(t, ctx):
        if t == CRASH_ROUND:
            raise KeyboardInterrupt
        return original(t, ctx)

    sim.algorithm.round = crash
    with pytest.raises(KeyboardInterrupt):
        sim.run(base / "cut")
    model = torch.load(base / "full" / "model.pt", weights_only=True)["x"]
    return {"metrics": full, "model": model, "cut": base / "cut", "full": base / "full"}


@pytest.fixture
def cut(runs, tmp_path):
    """A fresh copy of the interrupted run."""
    return Path(shutil.copytree(runs["cut"], tmp_path / "cut"))


def _resume(run_dir: Path):
    return Simulation(load_config(run_dir)).run(run_dir, resume=True)


def _assert_exact(run_dir: Path, runs) -> None:
    assert _numbers(read_metrics(run_dir)) == _numbers(runs["metrics"])
    assert torch.equal(torch.load(run_dir / "model.pt", weights_only=True)["x"], runs["model"])


def _checkpoint(run_dir: Path, round_: int) -> Path:
    return run_dir / "checkpoints" / f"round_{round_:06d}.pt"


def _rewrite_checksum(path: Path) -> None:
    """Make path's checksum file match its (crafted) contents, as a careful forger would."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")


def _save_crafted(path: Path, state) -> None:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    path.write_bytes(buffer.getvalue())
    _rewrite_checksum(path)


def test_the_run_directory_holds_checksummed_checkpoints(cut):
    names = sorted(p.name for p in (cut / "checkpoints").iterdir())
    assert names == [f"round_00000{r}.pt{ext}" for r in (3, 4) for ext in ("", ".sha256")]
    for r in (3, 4):
        path = _checkpoint(cut, r)
        line = path.with_name(path.name + ".sha256").read_text()
        assert line == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"  # sha256sum -c format
        state = torch.load(path, weights_only=True)
        assert state["round"] == r and state["config"] == json.loads((cut / "config.json").read_text())


def test_resume_is_exact(cut, runs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        _resume(cut)
    _assert_exact(cut, runs)
    assert not list((cut / "checkpoints").glob("*.damaged*"))


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _make_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("kept")


DAMAGE = {
    "garbage": lambda p: p.write_bytes(os.urandom(3000)),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-100]),
    "empty": lambda p: p.write_bytes(b""),
    "bit-flipped": _flip_a_bit,
    "a directory": _make_directory,
    "no checksum file": lambda p: p.with_name(p.name + ".sha256").unlink(),
    "malformed checksum file": lambda p: p.with_name(p.name + ".sha256").write_text("not a checksum\n"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_older_one_used(cut, runs, damage):
    newest = _checkpoint(cut, 4)
    DAMAGE[damage](newest)
    before = newest.read_bytes() if newest.is_file() else None
    with pytest.warns(UserWarning, match=r"round_000004.pt \(.+\) -> round_000004.pt.damaged; resuming from "):
        _resume(cut)
    _assert_exact(cut, runs)
    aside = newest.with_name("round_000004.pt.damaged")
    assert aside.exists()  # never deleted
    if before is not None:
        assert aside.read_bytes() == before
    if damage == "a directory":
        assert (aside / "inside").read_text() == "kept"


def test_every_checkpoint_damaged_refuses_and_changes_nothing(cut, files_under):
    for r in (3, 4):
        _checkpoint(cut, r).write_bytes(b"junk")
    before = files_under(cut)
    with pytest.raises(
        ValueError, match=r"no intact checkpoint is left .*round_000004.pt: .*To run it again from round 0"
    ):
        _resume(cut)
    assert files_under(cut) == before


def test_a_checkpoint_of_foreign_pickled_code_is_damaged_and_torchs_advice_never_shown(cut, runs):
    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch pwned",))

    newest = _checkpoint(cut, 4)
    newest.write_bytes(pickle.dumps({"round": 4, "x": Exploit()}))
    _rewrite_checksum(newest)
    with pytest.warns(UserWarning) as caught:
        _resume(cut)
    message = str(caught[0].message)
    assert "not a checkpoint torch can load safely" in message and "weights_only" not in message
    assert not Path("pwned").exists()
    _assert_exact(cut, runs)


def test_a_crafted_round_out_of_range_is_damaged_and_metrics_are_never_cut_below_a_checkpoint(cut, runs, files_under):
    newest = _checkpoint(cut, 4)
    state = torch.load(newest, weights_only=True)
    _save_crafted(newest, {**state, "round": -3})  # its checksum matches: only its contents give it away
    with pytest.warns(UserWarning, match=r"it says round -3, its name round 4"):
        _resume(cut)
    _assert_exact(cut, runs)

    # The only checkpoint crafted: nothing to fall back to, and no file is touched (metrics.jsonl included).
    other = cut.parent / "other"
    shutil.copytree(runs["cut"], other)
    _checkpoint(other, 3).unlink()
    _save_crafted(_checkpoint(other, 4), {**state, "round": -3})
    before = files_under(other)
    with pytest.raises(ValueError, match="no intact checkpoint"):
        _resume(other)
    assert files_under(other) == before


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("active_clients", np.array([0, 9]), "active_clients must be client ids in 0..3"),
        ("eval_labels", np.array([10]), "eval_labels must be None or classes in 0..9"),
        ("algorithm", {"x": torch.zeros(3)}, "its algorithm state does not fit scaffold"),
    ],
)
def test_a_checkpoint_that_does_not_fit_the_run_is_refused_before_any_file_changes(
    cut, field, value, message, files_under
):
    newest = _checkpoint(cut, 4)
    state = torch.load(newest, weights_only=True)
    encoded = {"__ndarray__": torch.from_numpy(value)} if isinstance(value, np.ndarray) else value
    _save_crafted(newest, {**state, field: encoded})
    before = files_under(cut)
    with pytest.raises(ValueError, match=message):
        _resume(cut)
    assert files_under(cut) == before


def _edit_config(run_dir: Path, **changes) -> None:
    path = run_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


@pytest.mark.parametrize(
    ("changes", "listed"),
    [
        ({"clients": 8}, "clients (4 -> 8)"),
        ({"model": "mlp"}, 'model ("logreg" -> "mlp")'),
        ({"model": "mlp", "model_params": {"hidden": [7]}}, 'model_params ({} -> {"hidden": [7]})'),
        ({"dataset": "synthetic:1,1"}, 'dataset ("digits" -> "synthetic:1,1")'),
        ({"algorithm": "fedavg"}, 'algorithm ("scaffold" -> "fedavg")'),
        ({"lr": 0.5, "seed": 3}, "lr (0.1 -> 0.5), seed (0 -> 3)"),
        ({"threads": 2}, "threads (null -> 2)"),  # the thread count changes the last bits of the local loss
    ],
)
def test_a_hand_edited_config_is_refused_naming_the_fields(cut, changes, listed, files_under):
    _edit_config(cut, **changes)
    before = files_under(cut)
    with pytest.raises(ValueError, match=r"config\.json was changed after checkpoint round_000004\.pt") as err:
        _resume(cut)
    assert listed in str(err.value)
    with pytest.raises(ValueError, match="was changed after checkpoint"):
        check_resumable(load_config(cut), cut)  # what the CLI asks before it loads the data
    assert files_under(cut) == before


def test_config_edits_that_change_no_recorded_number_are_accepted(cut, runs):
    _edit_config(cut, checkpoint_every=2, data_root="/moved/elsewhere")
    _resume(cut)
    _assert_exact(cut, runs)


def test_rounds_may_grow_but_not_drop_below_a_recorded_round(cut, runs, files_under):
    before = files_under(cut)
    _edit_config(cut, rounds=3)
    with pytest.raises(ValueError, match=r"asks for 3 rounds, but metrics\.jsonl has recorded 4"):
        _resume(cut)
    assert {k: v for k, v in files_under(cut).items() if k != "config.json"} == {
        k: v for k, v in before.items() if k != "config.json"
    }
    _edit_config(cut, rounds=4)  # round 4 recorded and checkpointed: resume only finishes the run
    assert _numbers(_resume(cut)) == _numbers(runs["metrics"][:5])
    assert json.loads((cut / "summary.json").read_text())["rounds"] == 4
    assert sorted(p.name for p in (cut / "checkpoints").glob("*.pt")) == ["round_000003.pt", "round_000004.pt"]
    _edit_config(cut, rounds=7)
    extended = _resume(cut)
    assert [m["round"] for m in read_metrics(cut)] == list(range(8))
    # The first five rounds are those of the 5-round run (round 5 is evaluated in both: eval_every is 1).
    assert _numbers(extended[:6]) == _numbers(runs["metrics"])


def test_extending_a_run_whose_last_round_was_off_the_evaluation_schedule_equals_the_longer_run(tmp_path):
    """Round 3 is evaluated as the last round of a 3-round run with eval_every=2; a 5-round run does not evaluate
    it, so once extended, neither does the record (nor the summary's means)."""
    short = dataclasses.replace(CONFIG, rounds=3, eval_every=2, algorithm="fedavg")
    longer = dataclasses.replace(short, rounds=5)
    uninterrupted = Simulation(longer).run(tmp_path / "long")
    assert "test_acc" not in uninterrupted[3]
    run = tmp_path / "run"
    assert "test_acc" in Simulation(short).run(run)[3]
    Simulation(longer).run(run, resume=True)
    assert _numbers(read_metrics(run)) == _numbers(uninterrupted)
    summaries = [json.loads((d / "summary.json").read_text()) for d in (run, tmp_path / "long")]
    assert _numbers([summaries[0]]) == _numbers([summaries[1]])


@pytest.mark.parametrize("name", ["config.json", "model.pt", "summary.json", "fingerprint.json", "checkpoints"])
def test_a_new_run_refuses_a_folder_holding_a_file_it_would_write(tmp_path, name):
    """The user's own file of a name the run writes is never overwritten (nothing is written at all)."""
    (tmp_path / name).mkdir() if name == "checkpoints" else (tmp_path / name).write_text("mine")
    with pytest.raises(FileExistsError, match=f"{tmp_path} already holds {name}, which a new run would overwrite"):
        Simulation(CONFIG).run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    if name != "checkpoints":
        assert (tmp_path / name).read_text() == "mine"


def test_a_finished_run_given_more_rounds_is_extended_to_the_uninterrupted_result(runs, tmp_path):
    """The last round is checkpointed, so a finished run goes on from it; the newest two checkpoints are kept."""
    longer = dataclasses.replace(CONFIG, rounds=8)
    uninterrupted = Simulation(longer).run(tmp_path / "long")
    finished = tmp_path / "finished"
    shutil.copytree(runs["full"], finished)
    assert sorted(p.name for p in (finished / "checkpoints").glob("*.pt")) == ["round_000004.pt", "round_000005.pt"]
    with pytest.raises(FileExistsError, match=r"already finished .* give it more rounds"):
        check_resumable(CONFIG, finished)
    assert check_resumable(longer, finished).round == 5
    Simulation(longer).run(finished, resume=True)
    assert _numbers(read_metrics(finished)) == _numbers(uninterrupted)
    assert torch.equal(
        torch.load(finished / "model.pt", weights_only=True)["x"],
        torch.load(tmp_path / "long" / "model.pt", weights_only=True)["x"],
    )
    assert read_config(finished)["rounds"] == 8 and json.loads((finished / "summary.json").read_text())["rounds"] == 8
    assert sorted(p.name for p in (finished / "checkpoints").iterdir()) == [
        f"round_00000{r}.pt{ext}" for r in (7, 8) for ext in ("", ".sha256")
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"round": 0}\n{"loss": 1.0}\n{"round": 2}\n', r"line 2 is not a round's record"),
        (b'{"round": 0}\n[1, 2]\n{"round": 2}\n', r"line 2 is not a round's record"),
        (b'{"round": 0}\n{"round": true}\n{"round": 2}\n', r"line 2 is not a round's record"),
        (b'{"round": 0}\n\n{"round": 2}\n{"round": 3}\n', r"line 3 holds round 2, expected round 1"),
        (b'{"round": 0}\n\x89PNG\r\n\x1a\n\x00\x00\xff\xfe\n', r"line 2 is not text \(not UTF-8\)"),
        (b'{"round": 0}\n{garbage\n{"round": 1}\n', r"line 2 is not valid JSON"),
    ],
)
def test_damaged_metrics_lines_are_named(tmp_path, content, message):
    (tmp_path / "metrics.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=f"metrics.jsonl: {message}"):
        read_metrics(tmp_path)


def test_a_half_written_last_metrics_line_is_dropped(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"round": 0}\n{"round": 1}\n{"round": 2, "los')
    assert read_metrics(tmp_path) == [{"round": 0}, {"round": 1}]


def test_resume_refuses_damaged_metrics_before_any_file_changes(cut, files_under):
    path = cut / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"test_acc": 0.5}', *lines[2:]]) + "\n")
    before = files_under(cut)
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a round's record"):
        _resume(cut)
    path.write_text("\n".join(lines[:3]) + "\n")  # rounds 3 and 4 lost though their checkpoints exist
    with pytest.raises(ValueError, match=r"should hold rounds 0..4 .* but ends at round 2"):
        _resume(cut)
    path.write_text("\n".join([lines[0], "{garbage", *lines[1:]]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        _resume(cut)
    path.write_text("")
    with pytest.raises(ValueError, match=r"should hold rounds 0..4 .* but holds no round"):
        _resume(cut)
    assert {k: v for k, v in files_under(cut).items() if k != "metrics.jsonl"} == {
        k: v for k, v in before.items() if k != "metrics.jsonl"
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[1, 2, 3]", r"must hold a JSON object \(the run's config\), it holds an array"),
        (b'"fedavg"', "it holds a string"),
        (b'{\n  "clients": 4,\n  oops\n}', r"line 3 is not valid JSON"),
        (b"\xff\xfe\x00binary", "is not text: byte 0 is not UTF-8"),
        (b'{"clients": "four"}', "clients must be an integer from 1 to 2\\^63 - 1, got 'four'"),
        (b'{"colour": "blue"}', r"unknown config field\(s\): colour"),
        (b'{"device": 5}', "device must be a string, got 5"),
        (b'{"model_params": [64]}', r"model_params must be a dict, got \[64\]"),
    ],
)
def test_a_damaged_config_json_is_named(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=f"config.json.*{message}"):
        load_config(tmp_path)


def test_resume_of_a_run_whose_config_json_is_a_list_changes_nothing(cut, files_under):
    (cut / "config.json").write_text("[]")
    before = files_under(cut)
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object"):
        Simulation(CONFIG).run(cut, resume=True)
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object"):
        read_config(cut)
    assert files_under(cut) == before


def test_an_output_directory_under_a_regular_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    for out in (blocker, blocker / "run", blocker / "deeper" / "run"):
        with pytest.raises(ValueError, match=f"cannot create the run directory {out}: {blocker} is a file"):
            Simulation(dataclasses.replace(CONFIG, rounds=1)).run(out)
    assert blocker.read_text() == "mine"


def test_an_unwritable_output_directory_is_refused(tmp_path, unwritable):
    with unwritable(tmp_path / "locked") as locked:
        for out in (locked, locked / "run"):
            with pytest.raises(ValueError, match=f"run directory {out}: {locked} cannot be written"):
                Simulation(dataclasses.replace(CONFIG, rounds=1)).run(out)
        assert list(locked.iterdir()) == []


def test_resume_in_an_unwritable_directory_is_refused_before_any_file_changes(cut, unwritable, files_under):
    before = files_under(cut)
    with unwritable(cut):
        with pytest.raises(ValueError, match=f"cannot resume {cut}: {cut} cannot be written"):
            _resume(cut)
    assert files_under(cut) == before


def test_one_writer_per_run_directory_a_second_is_refused_naming_the_holder(cut, files_under):
    before = files_under(cut)
    with RunWriter(cut, read_config(cut), resume=True):
        for attempt in (
            lambda: RunWriter(cut, read_config(cut), resume=True),
            lambda: check_resumable(load_config(cut), cut),
            lambda: check_new_run_dir(cut),
            lambda: _resume(cut),
        ):
            with pytest.raises(
                DirectoryLocked, match=rf"{cut} is being written by another process \(PID {os.getpid()}\)"
            ):
                attempt()
        assert files_under(cut) == {**before, ".lock": f"{os.getpid()} {socket.gethostname()}\n".encode()}
    assert files_under(cut) == before  # released: the lock file is empty again
    _resume(cut)  # and the run goes on


def test_a_new_run_is_refused_while_another_process_creates_it(tmp_path):
    out = tmp_path / "new"
    with RunWriter(out, CONFIG.to_dict()):
        with pytest.raises(DirectoryLocked, match=rf"PID {os.getpid()}"):
            RunWriter(out, CONFIG.to_dict())
        with pytest.raises(DirectoryLocked, match=rf"PID {os.getpid()}"):
            Simulation(CONFIG).run(out)
    assert read_config(out) == json.loads(json.dumps(CONFIG.to_dict()))


def test_the_lock_of_a_killed_process_is_taken_over(cut, runs):
    """A process killed while it holds the lock (kill -9: no clean-up runs) leaves the lock file with its PID; the
    operating system has dropped its lock, so the next writer takes it and the run resumes exactly."""
    code = (
        "import sys, time\n"
        "from pyfedkern.sim.results import DirectoryLock\n"
        "DirectoryLock(sys.argv[1]).acquire()\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(cut)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(DirectoryLocked, match=rf"\(PID {holder.pid}\)"):
            check_resumable(load_config(cut), cut)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert (cut / ".lock").read_text().startswith(f"{holder.pid} ")  # the dead holder's PID is still written
    _resume(cut)
    _assert_exact(cut, runs)
    assert (cut / ".lock").read_text() == ""


def test_an_interrupted_write_leaves_no_temporary_file_and_resume_removes_those_of_a_kill(cut, runs, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _resume(cut)  # interrupted writing config, metrics or checkpoint files
    monkeypatch.undo()
    assert not list(cut.rglob("*.tmp"))
    (cut / "checkpoints" / "round_000005.pt.tmp").write_bytes(b"half a checkpoint")  # what kill -9 leaves
    (cut / "summary.json.tmp").write_bytes(b"{")
    _resume(cut)
    _assert_exact(cut, runs)
    assert not list(cut.rglob("*.tmp"))


def test_an_empty_out_directory_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for attempt in (lambda: check_new_run_dir(""), lambda: RunWriter("", CONFIG.to_dict())):
        with pytest.raises(ValueError, match="the run directory is '': name a directory"):
            attempt()
    assert list(tmp_path.iterdir()) == []
