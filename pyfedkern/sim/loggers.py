"""Metric loggers as run callbacks: :class:`TensorBoard` and :class:`MLflow` (optional extras
``pyfedkern[tensorboard]`` and ``pyfedkern[mlflow]``; ``pyfedkern run --log tensorboard|mlflow``).

Each logs the numbers of every record a run adds to metrics.jsonl (all its fields but ``round``, which is the step)
on the writing rank, into local files under the run directory; neither contacts a network.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from pyfedkern.sim.callbacks import Callback, Run

#: The names ``--log`` takes.
LOGGERS = ("tensorboard", "mlflow")


def _require(package: str) -> None:
    """ImportError naming the extra to install unless ``package`` is importable."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"the {package} logger needs the {package} package: pip install 'pyfedkern[{package}]'")


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields but ``round``, as floats."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _under_run(path: str | Path | None, run: Run, name: str, who: str) -> Path:
    """``path``, or ``name`` in the run directory; ValueError when the run has none."""
    if path is not None:
        return Path(path)
    if run.out_dir is None:
        raise ValueError(f"{who} writes under the run directory: give run an out_dir (or the logger its own path)")
    return run.out_dir / name


class TensorBoard(Callback):
    """TensorBoard scalars of every record (float64, step = the round) in ``log_dir`` (default: the run
    directory's ``tensorboard/``), read by ``tensorboard --logdir``. A resumed run drops, in TensorBoard's view,
    the rounds it runs again (``purge_step``)."""

    def __init__(self, log_dir: str | Path | None = None) -> None:
        _require("tensorboard")
        self.log_dir = log_dir
        self._dir: Path | None = None
        self._writer = None

    def on_run_start(self, run: Run) -> None:
        self._dir = _under_run(self.log_dir, run, "tensorboard", "the TensorBoard logger")

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        if not run.is_writer:
            return
        step = int(record["round"])
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self._dir), purge_step=step)  # the rounds from here on are new
        for name, value in _numbers(record).items():
            self._writer.add_scalar(name, value, step, new_style=True, double_precision=True)
        self._writer.flush()  # an interrupted run keeps what it logged

    def on_run_end(self, run: Run) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MLflow(Callback):
    """MLflow metrics of every record (step = the round), one MLflow run per run directory (a resumed run goes on
    in its MLflow run) with the config as its parameters, in experiment ``experiment`` of ``tracking_uri``
    (default: a local SQLite store, the run directory's ``mlflow.db``, artifacts in ``mlartifacts/``; read it with
    ``mlflow ui --backend-store-uri sqlite:///RUN/mlflow.db``)."""

    def __init__(self, tracking_uri: str | None = None, experiment: str = "pyfedkern") -> None:
        _require("mlflow")
        if not isinstance(experiment, str) or not experiment.strip():
            raise ValueError(f"experiment must be a non-empty name, got {experiment!r}")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self._client = None
        self.run_id: str | None = None  #: The MLflow run's id, once the run starts.

    def on_run_start(self, run: Run) -> None:
        if not run.is_writer:
            return
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri, artifacts = self.tracking_uri, None
        if uri is None:
            where = _under_run(None, run, "mlflow.db", "the MLflow logger").resolve()
            uri, artifacts = f"sqlite:///{where}", (where.parent / "mlartifacts").as_uri()
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(self.experiment)
        experiment = found.experiment_id if found else client.create_experiment(self.experiment, artifacts)
        run_dir = "" if run.out_dir is None else str(run.out_dir.resolve())
        ours = [r for r in client.search_runs([experiment]) if run_dir and r.data.tags.get(_RUN_DIR) == run_dir]
        if ours:
            self.run_id = ours[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            made = client.create_run(experiment, run_name=run.config.algorithm, tags={_RUN_DIR: run_dir})
            self.run_id = made.info.run_id
            config = run.config.to_dict()
            params = [Param(k, v if isinstance(v, str) else json.dumps(v)) for k, v in config.items()]
            client.log_batch(self.run_id, params=params)
        self._client = client

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        if self._client is None:
            return
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record["round"])
        metrics = [Metric(name, value, now, step) for name, value in _numbers(record).items()]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def on_run_end(self, run: Run) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id)
            self._client = None


#: The MLflow tag naming the run directory an MLflow run logs (how a resumed run finds it).
_RUN_DIR = "pyfedkern.run_dir"


def check_loggers(names: str) -> str:
    """``names`` ("tensorboard", "mlflow", or both comma-separated) checked and normalised; ValueError for another
    name, ImportError naming the extra when a logger's package is missing."""
    asked = list(dict.fromkeys(n.strip().lower() for n in str(names).split(",")))
    if not all(n in LOGGERS for n in asked):
        raise ValueError(f"log must be tensorboard, mlflow or tensorboard,mlflow, got {names!r}")
    for name in asked:
        _require(name)
    return ",".join(asked)


def make_loggers(names: str) -> list[Callback]:
    """The loggers of ``names`` (see :func:`check_loggers`), each with its defaults."""
    made = {"tensorboard": TensorBoard, "mlflow": MLflow}
    return [made[n]() for n in check_loggers(names).split(",")]
