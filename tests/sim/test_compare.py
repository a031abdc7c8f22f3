"""compare: same split for every algorithm, reuse of finished sub-runs only when their config matches."""

import dataclasses
import json
import os

import pytest

from pyfedkern.sim.compare import compare
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import run_or_reuse
from pyfedkern.sim.results import DirectoryLock, DirectoryLocked, read_metrics

BASE = ExperimentConfig(clients=4, rounds=2, model="logreg", partition="iid", batch_size=64)


def test_finished_sub_runs_are_reused_only_with_the_same_config(tmp_path):
    first = compare(BASE, ["fedavg", "fedprox"], tmp_path)
    assert [m["round"] for m in first.metrics["fedavg"]] == [0, 1, 2]
    stored = (tmp_path / "fedavg" / "metrics.jsonl").read_text()

    again = compare(BASE, ["fedavg", "fedprox"], tmp_path)
    assert (tmp_path / "fedavg" / "metrics.jsonl").read_text() == stored
    assert again.metrics["fedavg"] == read_metrics(tmp_path / "fedavg")

    with pytest.raises(ValueError, match=r"different config \(it differs in lr\); choose a fresh output"):
        compare(dataclasses.replace(BASE, lr=0.5), ["fedavg"], tmp_path)
    with pytest.raises(ValueError, match="differs in algorithm_params"):
        compare(BASE, ["fedprox"], tmp_path, params={"fedprox": {"mu": 0.5}})
    assert (tmp_path / "fedavg" / "metrics.jsonl").read_text() == stored


def test_an_interrupted_sub_run_with_another_config_is_not_resumed(tmp_path):
    compare(BASE, ["fedavg"], tmp_path)
    (tmp_path / "fedavg" / "summary.json").unlink()  # as if it had been interrupted
    with pytest.raises(ValueError, match="differs in seed"):
        compare(dataclasses.replace(BASE, seed=1), ["fedavg"], tmp_path)


def test_run_or_reuse_reads_back_a_finished_run_and_refuses_another_config(tmp_path):
    first = run_or_reuse(BASE, tmp_path / "run")
    stored = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert run_or_reuse(BASE, tmp_path / "run") == first
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == stored
    with pytest.raises(ValueError, match="differs in lr"):
        run_or_reuse(dataclasses.replace(BASE, lr=0.5), tmp_path / "run")


def test_more_rounds_extend_the_finished_sub_runs_to_the_uninterrupted_result(tmp_path):
    compare(BASE, ["fedavg", "scaffold"], tmp_path / "cmp")
    longer = dataclasses.replace(BASE, rounds=4)
    extended = compare(longer, ["fedavg", "scaffold"], tmp_path / "cmp")
    direct = compare(longer, ["fedavg", "scaffold"], tmp_path / "direct")
    for name in ("fedavg", "scaffold"):
        assert _numbers(extended.metrics[name]) == _numbers(direct.metrics[name])
        assert _numbers(read_metrics(tmp_path / "cmp" / name)) == _numbers(direct.metrics[name])
    with pytest.raises(ValueError, match="holds a finished run of 4 rounds, more than the 2 asked"):
        compare(BASE, ["fedavg"], tmp_path / "cmp")


def test_one_comparison_at_a_time_writes_its_directory(tmp_path):
    with DirectoryLock(tmp_path, "comparison directory"):
        with pytest.raises(
            DirectoryLocked, match=rf"comparison directory {tmp_path} is being written .*PID {os.getpid()}"
        ):
            compare(BASE, ["fedavg"], tmp_path)
    assert not (tmp_path / "fedavg").exists()
    compare(BASE, ["fedavg"], tmp_path)
    with DirectoryLock(tmp_path / "fedavg", "run directory"):  # a `run --resume` of a sub-run is going on
        (tmp_path / "fedavg" / "summary.json").unlink()
        with pytest.raises(DirectoryLocked, match=r"run directory .*fedavg is being written"):
            compare(BASE, ["fedavg"], tmp_path)


def test_an_unusable_comparison_directory_is_a_value_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot create the comparison directory"):
        compare(BASE, ["fedavg"], tmp_path / "file" / "cmp")
    with pytest.raises(ValueError, match="out_dir is '': name a directory"):
        compare(BASE, ["fedavg"], "")


def _numbers(metrics):
    return [{k: v for k, v in m.items() if not k.startswith("time")} for m in metrics]


def test_a_finished_run_of_the_same_config_on_other_data_is_not_reused(tmp_path):
    """The config names the data, but a factory or --data-root can load other data under the same name: the run's
    fingerprint is checked before its metrics are reused."""
    run_or_reuse(BASE, tmp_path / "run")
    fingerprint = tmp_path / "run" / "fingerprint.json"
    digests = json.loads(fingerprint.read_text())
    fingerprint.write_text(json.dumps({**digests, "training data": "0" * 32}))  # as if made on other data
    with pytest.raises(ValueError, match=r"cannot reuse .*: the training data differs from the run's"):
        run_or_reuse(BASE, tmp_path / "run")


def test_a_sub_run_killed_before_its_first_round_is_resumed(tmp_path):
    """Only config.json written (killed while loading): the next compare resumes it rather than refusing it."""
    run_or_reuse(BASE, tmp_path / "run")
    for name in ("metrics.jsonl", "summary.json", "model.pt"):
        (tmp_path / "run" / name).unlink()
    for checkpoint in (tmp_path / "run" / "checkpoints").iterdir():
        checkpoint.unlink()
    assert [m["round"] for m in run_or_reuse(BASE, tmp_path / "run")] == [0, 1, 2]


@pytest.mark.parametrize("target", [float("nan"), float("inf"), -0.1, 0.0, 1.5, True])
def test_compare_refuses_a_target_that_is_not_an_accuracy(tmp_path, target):
    with pytest.raises(ValueError, match=r"target must be an accuracy in \(0, 1\]"):
        compare(BASE, ["fedavg"], tmp_path, target=target)
