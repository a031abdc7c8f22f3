"""Callbacks: what a run does around its rounds besides training.

:meth:`Simulation.run <pyfedkern.sim.engine.Simulation.run>` calls each :class:`Callback`'s hooks in order: the
built-in ones first (:class:`Timing`, :class:`DivergenceWarning`, :class:`RunFiles`, :class:`Checkpoints`, and
:class:`ProgressBar` when asked for), then the user's (``Experiment(callbacks=[...])``, ``run(callbacks=[...])``;
the loggers of :mod:`pyfedkern.sim.loggers` are callbacks too). In a distributed run every rank calls them, with
the same records; :attr:`Run.is_writer` is True on the rank that writes (rank 0).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pyfedkern.sim.checkpoints import checkpoint_state
from pyfedkern.sim.results import RunWriter

logger = logging.getLogger("pyfedkern")


@dataclass
class Run:
    """What callbacks see of a run.

    Attributes:
        simulation: the :class:`~pyfedkern.sim.engine.Simulation` running (its ``config``, ``algorithm``, ``team``).
        out_dir: the run directory, or None when the run writes none.
        writer: the directory's :class:`~pyfedkern.sim.results.RunWriter` on the writing rank, else None.
        start: the last round done before this process began (0 for a new run; a resumed run's checkpoint round).
        metrics: the records so far, round 0 first (a resumed run's earlier records included); the engine appends
            each new record before it calls :meth:`Callback.on_round_end`.
    """

    simulation: Any
    out_dir: Path | None
    writer: RunWriter | None
    start: int
    metrics: list[dict[str, Any]]

    @property
    def config(self) -> Any:
        """The run's :class:`~pyfedkern.sim.config.ExperimentConfig`."""
        return self.simulation.config

    @property
    def is_writer(self) -> bool:
        """Whether this process writes the run's files and logs (rank 0 of a distributed run; True otherwise)."""
        return self.simulation.team.is_writer


class Callback:
    """Hooks a run calls; subclass and override those you need (each does nothing by default).

    A record is the dict of one round that metrics.jsonl holds (``round``, ``local_loss``, ``test_acc``, ...);
    treat it as read-only (the built-in :class:`Timing` adds its ``time_*`` fields before the other callbacks see
    it).
    """

    def on_run_start(self, run: Run) -> None:
        """Before the first round this process runs (a resumed run's state is restored by then)."""

    def on_round_start(self, run: Run, t: int) -> None:
        """Before training round ``t + 1`` (``t`` counts from 0, as
        :meth:`Algorithm.round <pyfedkern.algorithms.Algorithm.round>` does)."""

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        """After each new record: round 0's (the initial model, no training) in a run that starts anew, then every
        round's, evaluation included where the round is evaluated."""

    def on_run_end(self, run: Run) -> None:
        """After the last round, once the run directory is complete (summary.json, model.pt)."""


class Timing(Callback):
    """Adds a round's seconds to its record: ``time_local``, ``time_aggregation``, ``time_evaluation`` (the
    engine's ``timer`` categories) and ``time_round`` (the whole round, from its start to its record)."""

    def __init__(self) -> None:
        self._began: float | None = None

    def on_round_start(self, run: Run, t: int) -> None:
        run.simulation.times.clear()
        self._began = time.perf_counter()

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        if self._began is None:  # round 0: no training (its evaluation time is the engine's)
            return
        times = run.simulation.times
        for category in ("local", "aggregation", "evaluation"):
            record[f"time_{category}"] = times.get(category, 0.0)
        record["time_round"] = time.perf_counter() - self._began
        self._began = None


class DivergenceWarning(Callback):
    """Logs a warning, once, after the first round whose global model holds NaN or inf (the writing rank)."""

    def __init__(self) -> None:
        self._warned = False

    def on_run_start(self, run: Run) -> None:
        self._warned = False

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        if self._warned or record["round"] == 0:
            return
        if not bool(torch.isfinite(run.simulation.algorithm.global_model()).all()):
            self._warned = True
            if run.is_writer:
                logger.warning(
                    "round %d: the global model holds NaN or inf (training diverged; a smaller learning rate "
                    "may help): the later rounds cannot recover",
                    record["round"],
                )


class RunFiles(Callback):
    """Appends each record to the run directory's metrics.jsonl and, at the end, writes model.pt and summary.json
    (:class:`~pyfedkern.sim.results.RunWriter`; the writing rank)."""

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        if run.writer is not None:
            run.writer.append_metrics(record)

    def on_run_end(self, run: Run) -> None:
        if run.writer is not None:
            run.writer.finish(run.metrics, run.simulation.algorithm.global_model())


class Checkpoints(Callback):
    """Saves a checkpoint every ``config.checkpoint_every`` rounds and after the last (so that a finished run can be
    extended), when the run has a directory. Every rank's algorithm state is gathered on the writing rank, which
    saves them (a collective call: every rank runs it)."""

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        done, cfg = record["round"], run.config
        if run.out_dir is None or done == 0 or (done % cfg.checkpoint_every and done != cfg.rounds):
            return
        sim = run.simulation
        state = checkpoint_state(sim, done)
        shards = sim.team.gather(state["algorithm"])  # every rank's state, on rank 0
        if run.writer is not None:
            run.writer.save_checkpoint({**state, "algorithm": shards[0] if sim.team.size == 1 else shards})


class ProgressBar(Callback):
    """A tqdm progress bar of the rounds, with the last local loss and test accuracy (the writing rank)."""

    def __init__(self) -> None:
        self._bar = None

    def on_run_start(self, run: Run) -> None:
        if run.is_writer:
            from tqdm.auto import tqdm

            cfg = run.config
            self._bar = tqdm(total=cfg.rounds, initial=run.start, desc=cfg.algorithm, unit="round", dynamic_ncols=True)

    def on_round_end(self, run: Run, record: dict[str, Any]) -> None:
        if self._bar is None or record["round"] == 0:
            return
        self._bar.update(1)
        last_eval = next((m for m in reversed(run.metrics) if "test_acc" in m), {})
        postfix = {"loss": f"{record.get('local_loss', float('nan')):.4f}"}
        if "test_acc" in last_eval:
            postfix["acc"] = f"{last_eval['test_acc']:.4f}"
        self._bar.set_postfix(postfix)

    def on_run_end(self, run: Run) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def builtin_callbacks(progress: bool) -> list[Callback]:
    """The engine's own callbacks, in the order it calls them (a :class:`ProgressBar` with ``progress``)."""
    return [Timing(), DivergenceWarning(), RunFiles(), Checkpoints(), *([ProgressBar()] if progress else [])]


def check_callbacks(callbacks: Any) -> list[Callback]:
    """``callbacks`` as a list; TypeError unless it is a list or tuple of :class:`Callback` instances."""
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of Callback instances, got {type(callbacks).__name__}")
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks[{i}] must be a pyfedkern.sim.callbacks.Callback, got {type(cb).__name__}")
    return list(callbacks)
