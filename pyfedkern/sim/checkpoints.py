"""Checkpoints and resuming: what a checkpoint of a :class:`~pyfedkern.sim.engine.Simulation` holds, restoring one,
and the checks of a run directory before a run resumes, extends or reuses it (the config, the number of workers,
the data and model it was made with).

The :class:`~pyfedkern.sim.callbacks.Checkpoints` callback saves :func:`checkpoint_state` through the run's
:class:`~pyfedkern.sim.results.RunWriter`; :meth:`Simulation.run <pyfedkern.sim.engine.Simulation.run>` resumes
with :func:`restore_newest`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.results import (
    RESUME_FREE_FIELDS,
    ResumePoint,
    RunWriter,
    check_fingerprint,
    check_frozen,
    config_differences,
    is_finished,
    read_config,
)


def restore_newest(sim: Any, writer: RunWriter | None) -> tuple[int, list[dict[str, Any]]]:
    """Restore the newest intact checkpoint of the run into the simulation ``sim`` (rank 0 reads and checks it, each
    rank gets its shard); (the last round done, the metrics of rounds 0..that round)."""
    team = sim.team

    def resume_point():
        point = writer.resume_point()  # everything checked before any file changes
        check_fingerprint(writer.dir, sim.fingerprint)
        check_frozen(writer.dir, sim.frozen)
        check_workers_match(writer, point, team.size)
        done, cfg = point.round, sim.config
        if point.metrics and done < cfg.rounds and done % cfg.eval_every:  # a finished run now extended:
            # its last round was evaluated as the last; a run of cfg.rounds from the start does not evaluate it
            last = point.metrics[-1]
            point.metrics[-1] = {k: v for k, v in last.items() if not k.startswith(("test_", "train_"))}
        return point, writer.start_from(point)

    found = team.first(resume_point)
    shares = None
    if found is not None:  # rank 0
        point, metrics = found
        shards = [None] * team.size if point.state is None else point.state["algorithm"]
        if point.state is not None and team.size == 1:
            shards = [shards]
        shares = [
            (
                point.round,
                metrics,
                point.checkpoint,
                None if point.state is None else {**point.state, "algorithm": a},
            )
            for a in shards
        ]
    start, metrics, path, state = team.scatter(shares)
    if state is not None:
        restore(sim, path, state)
    return start, metrics


def checkpoint_state(sim: Any, rounds_done: int) -> dict[str, Any]:
    """What a checkpoint of the simulation ``sim`` after ``rounds_done`` rounds holds (this rank's algorithm state
    among it), with the config it was made under (checked on resume); the
    :class:`~pyfedkern.sim.callbacks.Checkpoints` callback saves it."""
    return {
        "round": rounds_done,
        "config": sim.config.to_dict(),
        "workers": sim.team.size,
        "algorithm": sim.algorithm.state_dict(),
        "active_clients": sim.active_clients,
        "eval_labels": sim.eval_labels,
        "batched": sim.batched,
        "channels_last": sim.channels_last,
        "buffers": {name: b.detach().cpu().clone() for name, b in sim.local.module.named_buffers()},
        "central_dp": None if sim.central_dp is None else sim.central_dp.state_dict(),
        "local_dp": None if sim.local_dp is None else sim.local_dp.state_dict(),
    }


def restore(sim: Any, path: Path, state: dict[str, Any]) -> None:
    """Load the state of checkpoint ``path`` into the simulation ``sim`` (already checked for integrity and config
    by the run writer); ValueError naming the file when it does not fit that simulation."""

    def labels(value: Any, bound: int) -> bool:
        ints = isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in "iu"
        return ints and (value.size == 0 or (value.min() >= 0 and value.max() < bound))

    active, eval_labels = state.get("active_clients"), state.get("eval_labels")
    if not labels(active, sim.num_clients):
        raise ValueError(f"checkpoint {path}: active_clients must be client ids in 0..{sim.num_clients - 1}")
    if eval_labels is not None and not labels(eval_labels, sim.data.num_classes):
        raise ValueError(f"checkpoint {path}: eval_labels must be None or classes in 0..{sim.data.num_classes - 1}")
    buffers = dict(sim.local.module.named_buffers())
    saved = state.get("buffers", {})
    fits = isinstance(saved, dict) and saved.keys() == buffers.keys()
    if not (fits and all(isinstance(v, torch.Tensor) and v.shape == buffers[k].shape for k, v in saved.items())):
        held = ", ".join(map(str, saved)) if isinstance(saved, dict) and saved else "none"
        raise ValueError(
            f"checkpoint {path}: its model buffers ({held}) do not fit the model's ({', '.join(buffers) or 'none'})"
        )
    try:
        sim.algorithm.load_state_dict(state["algorithm"])
    except (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError) as err:
        said = " ".join(str(err).split())  # on one line
        raise ValueError(
            f"checkpoint {path}: its algorithm state does not fit {sim.config.algorithm} ({type(err).__name__}: {said})"
        ) from None
    with torch.no_grad():
        for name, value in saved.items():
            buffers[name].copy_(value)
    if sim.central_dp is not None:
        sim.central_dp.load_state_dict(state.get("central_dp"), f"checkpoint {path}")
    if sim.local_dp is not None:
        sim.local_dp.load_state_dict(state.get("local_dp"), f"checkpoint {path}")
    sim.active_clients = active.astype(np.int64)
    sim.eval_labels = eval_labels
    if sim.config.batched is None and isinstance(state.get("batched"), bool):
        sim.batched = state["batched"]  # the path the run was taking: a resumed run continues on it
    if sim.config.channels_last is None and isinstance(state.get("channels_last"), bool):
        sim.channels_last = state["channels_last"]  # and its layout


def check_resumable(config: ExperimentConfig, run_dir: str | Path, *, workers: int = 1) -> ResumePoint:
    """Raise what ``Simulation(config).run(run_dir, resume=True)`` in ``workers`` processes would raise about the run
    directory (a changed config, a finished run, damaged files, another process writing it, another number of
    workers, ...), without building the simulation or changing any file; return where the run goes on."""
    with RunWriter(run_dir, config.to_dict(), resume=True) as writer:
        point = writer.resume_point()
        check_workers_match(writer, point, workers)
        return point


def check_workers_match(writer: RunWriter, point: Any, workers: int) -> None:
    """ValueError unless the checkpoint of ``point`` (a resume point of ``writer``) was made by ``workers`` processes
    (its shards are theirs: a checkpoint resumes with the number of processes that made it)."""
    made_by = 0 if point.state is None else int(point.state.get("workers", 1))
    if made_by and made_by != workers:
        raise ValueError(
            f"cannot resume {writer.dir}: checkpoint {point.checkpoint.name} was made by {made_by} worker(s) and this "
            f"run has {workers}; resume it with {made_by} (--workers {made_by}, or torchrun with {made_by} processes "
            "in all)"
        )


def check_reusable(config: ExperimentConfig, run_dir: str | Path) -> None:
    """Raise ValueError if ``run_dir`` holds a run (finished or interrupted) of a config other than ``config`` but
    for :data:`~pyfedkern.sim.results.RESUME_FREE_FIELDS`, or a finished run of more rounds."""
    run_dir = Path(run_dir)
    if (run_dir / "config.json").exists():
        changed = [k for k in config_differences(run_dir, config.to_dict()) if k not in RESUME_FREE_FIELDS]
        if changed:
            raise ValueError(
                f"{run_dir} holds a run with a different config (it differs in {', '.join(changed)}); "
                "choose a fresh output directory (--out) or delete that one"
            )
        done = read_config(run_dir)["rounds"]
        if is_finished(run_dir) and done > config.rounds:
            raise ValueError(f"{run_dir} holds a finished run of {done} rounds, more than the {config.rounds} asked")


def load_config(out_dir: str | Path) -> ExperimentConfig:
    """The config of a run directory (to resume it), checked; ValueError naming config.json when it is not valid."""
    data = read_config(out_dir)
    try:
        config = ExperimentConfig.from_dict(data)
        config.validate()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{Path(out_dir) / 'config.json'}: {err}") from None
    return config
