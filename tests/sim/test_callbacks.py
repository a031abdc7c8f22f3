"""Run callbacks: a user's callback sees every record, in order, on a new and a resumed run; the TensorBoard and
MLflow loggers' files, read back with their own readers, equal metrics.jsonl; the CLI's --log."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyfedkern.cli import main
from pyfedkern.sim.callbacks import Callback
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation
from pyfedkern.sim.results import read_metrics

SMALL = ExperimentConfig(clients=4, rounds=4, model="logreg", partition="iid", batch_size=64, checkpoint_every=2)


class Recorder(Callback):
    """Records every hook call; raises KeyboardInterrupt after the record of round ``stop_after``."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.calls: list[tuple] = []
        self.stop_after = stop_after

    def on_run_start(self, run):
        self.calls.append(("run_start", run.start, len(run.metrics)))

    def on_round_start(self, run, t):
        self.calls.append(("round_start", t))

    def on_round_end(self, run, record):
        assert run.metrics[-1] is record
        self.calls.append(("round_end", dict(record)))
        if record["round"] == self.stop_after:
            raise KeyboardInterrupt

    def on_run_end(self, run):
        self.calls.append(("run_end", run.out_dir is not None and (run.out_dir / "summary.json").is_file()))


def _expected_calls(records, start):
    """The hook calls of a run going from round ``start`` through ``records`` (round 0's first when start is 0)."""
    calls = [("round_end", records[0])] if start == 0 else []
    for record in records[1:] if start == 0 else records:
        calls += [("round_start", record["round"] - 1), ("round_end", record)]
    return calls


def test_a_user_callback_gets_every_record_in_order_and_the_run_directory_is_done_first(tmp_path):
    recorder = Recorder()
    metrics = Simulation(SMALL).run(tmp_path / "run", callbacks=[recorder])
    assert [m["round"] for m in metrics] == list(range(SMALL.rounds + 1))
    assert recorder.calls == [("run_start", 0, 0), *_expected_calls(metrics, 0), ("run_end", True)]
    assert read_metrics(tmp_path / "run") == metrics  # what it saw is what metrics.jsonl holds


def test_a_callback_stops_a_run_and_the_resumed_run_calls_it_from_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    first = Recorder(stop_after=3)
    with pytest.raises(KeyboardInterrupt):
        Simulation(SMALL).run(out, callbacks=[first])
    assert [c[1]["round"] for c in first.calls if c[0] == "round_end"] == [0, 1, 2, 3]
    assert [m["round"] for m in read_metrics(out)] == [0, 1, 2, 3]  # round 3 written before the callback stopped it
    second = Recorder()
    metrics = Simulation(SMALL).run(out, resume=True, callbacks=[second])
    # the checkpoint of round 2 is where it goes on: rounds 3 and 4 are run (again)
    assert second.calls == [("run_start", 2, 3), *_expected_calls(metrics[3:], 2), ("run_end", True)]
    assert read_metrics(out) == metrics
    uninterrupted = Simulation(SMALL).run(tmp_path / "whole")
    assert _without_times(metrics) == _without_times(uninterrupted)


def _without_times(metrics):
    """The records without their wall-clock times (which differ between runs)."""
    return [{k: v for k, v in m.items() if not k.startswith("time_")} for m in metrics]


def test_without_a_directory_callbacks_get_the_records_and_no_checkpoint_is_made():
    recorder = Recorder()
    metrics = Simulation(SMALL).run(callbacks=(recorder,))
    ends = [c[1] for c in recorder.calls if c[0] == "round_end"]
    assert ends == metrics and recorder.calls[0] == ("run_start", 0, 0) and recorder.calls[-1] == ("run_end", False)


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [(Recorder(), "callbacks must be a list"), ([Recorder(), print], r"callbacks\[1\] must be a pyfedkern")],
)
def test_callbacks_that_are_not_callbacks_are_refused(callbacks, message):
    with pytest.raises(TypeError, match=message):
        Simulation(SMALL).run(callbacks=callbacks)


def _by_field(metrics):
    """{field: {round: value}} of the numeric fields of metrics.jsonl's records (round aside)."""
    out = {}
    for record in metrics:
        for key, value in record.items():
            if key != "round" and isinstance(value, (int, float)):
                out.setdefault(key, {})[record["round"]] = float(value)
    return out


def _interrupted_then_resumed(out, logger_factory):
    """A run stopped by a callback after round 3 and resumed from its checkpoint of round 2, each process with a
    fresh logger from ``logger_factory``; metrics.jsonl's records."""
    with pytest.raises(KeyboardInterrupt):
        Simulation(SMALL).run(out, callbacks=[logger_factory(), Recorder(stop_after=3)])
    Simulation(SMALL).run(out, resume=True, callbacks=[logger_factory()])
    return read_metrics(out)


def test_tensorboard_events_read_back_equal_metrics_jsonl_across_a_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from pyfedkern.sim.loggers import TensorBoard

    out = tmp_path / "run"
    metrics = _interrupted_then_resumed(out, TensorBoard)
    logged = _tensorboard_scalars(out / "tensorboard")
    assert logged == _by_field(metrics)
    assert {"local_loss", "test_acc", "time_round"} <= set(logged)


def _tensorboard_scalars(log_dir):
    """{tag: {step: value}} of the scalars in ``log_dir``, read by TensorBoard's own reader; each step once (the
    rounds a resumed run ran again are purged)."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})  # 0: keep every event
    events.Reload()
    logged = {}
    for tag in events.Tags()["tensors"]:
        steps = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]
        logged[tag] = dict(steps)
        assert len(logged[tag]) == len(steps), tag
    return logged


def test_mlflow_run_read_back_equals_metrics_jsonl_across_a_resume(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from pyfedkern.sim.loggers import MLflow

    out = tmp_path / "run"
    metrics = _interrupted_then_resumed(out, MLflow)
    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("pyfedkern")
    (run,) = client.search_runs([experiment.experiment_id])  # the resumed run went on in the same MLflow run
    assert run.info.status == "FINISHED" and run.data.params["algorithm"] == "fedavg"
    assert run.data.params["rounds"] == str(SMALL.rounds)
    logged = {}
    for key in run.data.metrics:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp)
        logged[key] = {m.step: m.value for m in history}  # the latest value of each round: round 3's second
    assert logged == _by_field(metrics)


FAST = ["--rounds", "2", "--clients", "4", "--model", "logreg", "--partition", "iid", "--no-progress"]


def test_cli_log_tensorboard_writes_events_in_the_run_directory(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main(["run", *FAST, "--log", "tensorboard", "--out", str(out)]) == 0
    assert _tensorboard_scalars(out / "tensorboard") == _by_field(read_metrics(out))


def test_workers_log_once_from_rank_zero(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "pyfedkern", "run", *FAST, "--threads", "1", "--workers", "2", "--log", "tensorboard"]
    # from outside the checkout: `python -m` puts the working directory first on sys.path (the source has no _C)
    done = subprocess.run([*argv, "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # one writer
    assert _tensorboard_scalars(out / "tensorboard") == _by_field(read_metrics(out))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--log", "wandb", "--out", "x"], "argument --log: log must be tensorboard, mlflow or tensorboard,mlflow"),
        (["--log", "tensorboard,"], "argument --log: log must be"),
        (["--log", "tensorboard"], "--log writes its logs in the run directory: give --out DIR"),
    ],
)
def test_cli_bad_log_is_a_one_line_error_with_status_2(argv, message, capsys):
    try:
        status = main(["run", *FAST, *argv])
    except SystemExit as exit_:
        status = exit_.code
    err = capsys.readouterr().err
    assert status == 2 and message in err and err.count("\n") == 1


def test_a_missing_logger_package_names_the_extra(monkeypatch):
    from pyfedkern.sim import loggers

    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'pyfedkern\[mlflow\]'"):
        loggers.MLflow()
    with pytest.raises(ImportError, match=r"pip install 'pyfedkern\[tensorboard\]'"):
        loggers.check_loggers("tensorboard")


def test_the_callbacks_section_of_the_docs_runs(tmp_path, monkeypatch):
    """docs/experiments.md's "Callbacks and loggers" examples run as written (their asserts check what they say)."""
    pytest.importorskip("tensorboard")
    docs = Path(__file__).resolve().parents[2] / "docs" / "experiments.md"
    if not docs.exists():
        pytest.skip("docs/ not next to the tests (installed package only)")
    text = docs.read_text()
    start = text.index("## Callbacks and loggers")
    blocks = re.findall(r"```python\n(.*?)```", text[start : text.index("\n## ", start + 1)], re.DOTALL)
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "docs_example"}
    for block in blocks:
        exec(compile(block, "docs/experiments.md", "exec"), scope)
    assert _tensorboard_scalars(tmp_path / "runs/logged/tensorboard") == _by_field(read_metrics("runs/logged"))


def test_compare_logs_each_sub_run_into_its_own_directory(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "fedavg,fedprox", *FAST, "--out", str(out), "--log", "tensorboard"]) == 0
    for name in ("fedavg", "fedprox"):
        assert _tensorboard_scalars(out / name / "tensorboard") == _by_field(read_metrics(out / name))
