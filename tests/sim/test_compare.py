"""compare: same split for every algorithm, reuse of finished sub-runs only when their config matches."""

import dataclasses

import pytest

from pyfedkern.sim.compare import compare
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import run_or_reuse
from pyfedkern.sim.results import read_metrics

BASE = ExperimentConfig(clients=4, rounds=2, model="logreg", partition="iid", batch_size=64)


def test_finished_sub_runs_are_reused_only_with_the_same_config(tmp_path):
    first = compare(BASE, ["fedavg", "fedprox"], tmp_path)
    assert [m["round"] for m in first.metrics["fedavg"]] == [0, 1, 2]
    stored = (tmp_path / "fedavg" / "metrics.jsonl").read_text()

    again = compare(BASE, ["fedavg", "fedprox"], tmp_path)
    assert (tmp_path / "fedavg" / "metrics.jsonl").read_text() == stored
    assert again.metrics["fedavg"] == read_metrics(tmp_path / "fedavg")

    with pytest.raises(ValueError, match=r"different config \(it differs in rounds\); choose a fresh output"):
        compare(dataclasses.replace(BASE, rounds=3), ["fedavg"], tmp_path)
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
    with pytest.raises(ValueError, match="differs in rounds"):
        run_or_reuse(dataclasses.replace(BASE, rounds=3), tmp_path / "run")
