"""Data-parallel rounds on torch.distributed: one experiment spread over several processes (ranks).

Every rank builds the same simulation (same data, split, model and participants: all seeded), trains its share of
each round's participants (see Placement) with the batched engine, and the ranks combine their partial round sums
(:class:`~pyfedkern.algorithms.RoundSums`) with collectives: an ``all_gather`` of each rank's sums, added up in rank
order, so every rank takes the same server step and holds the same global model, and a rerun with the same number of
ranks is bit-identical. With N ranks the results equal the one-process run to rounding (float64: ~1e-15).

- Placement: :func:`place_clients` splits clients by their planned local steps (largest first to the least-loaded
  rank), deterministically. An algorithm without client state has each round's participants split this way, so the
  ranks finish the round together. Once an algorithm keeps client state (SCAFFOLD's c_i, FedDyn's h_i, ...: it asks
  :meth:`Team.keep_client_state <pyfedkern.algorithms.context.Team.keep_client_state>` which clients are its),
  every client has one owner rank for the whole run, placed the same way over all clients; its state lives in the
  owner's :class:`~pyfedkern.algorithms.ClientStore` only and never travels, and each round's participants are
  trained by their owners.
- Evaluation: each rank evaluates a contiguous slice of the test (and train-evaluation) samples; the means are
  combined weighted by the slice sizes.
- Files: only rank 0 writes the run directory. A checkpoint holds every rank's algorithm state (rank 0 gathers them
  and writes one checked file); ``--resume`` needs the same number of ranks.
- Launch: ``torchrun ... -m pyfedkern run ...`` (the env:// variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
  LOCAL_RANK, LOCAL_WORLD_SIZE) or ``pyfedkern run ... --workers N`` (:func:`launch_workers`, torch's elastic
  launcher on this machine). gloo on the CPU, NCCL on CUDA (one GPU per rank: ``cuda:LOCAL_RANK``).
- Failure: every collective has the process group's timeout; a collective that fails raises
  :class:`ConnectionError` naming this rank and the round, and the launcher reports which rank died.
"""

from __future__ import annotations

import dataclasses
import datetime
import heapq
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pyfedkern.algorithms import ClientUpdates, RoundSums, algorithm_class
from pyfedkern.algorithms.context import Team
from pyfedkern.sim.config import LAUNCHED_BY_WORKERS, local_world_size
from pyfedkern.sim.engine import Simulation

#: Seconds a rank waits in a collective (and at start-up for the others) before it gives up.
DEFAULT_TIMEOUT = 300.0
#: Most local processes ``--workers`` starts (beyond that a machine's cores are oversubscribed anyway).
MAX_WORKERS = 1024


def place_clients(steps: np.ndarray, ranks: int) -> np.ndarray:
    """Owner rank of every client, [m] int64: clients by descending planned steps (ties: earlier client first), each to
    the rank with the least planned work so far (ties: lower rank). Deterministic."""
    steps = np.asarray(steps, dtype=np.int64).reshape(-1)
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    owner = np.zeros(len(steps), dtype=np.int64)
    loads = [(0, r) for r in range(ranks)]
    for cid in np.argsort(-steps, kind="stable").tolist():
        load, rank = heapq.heappop(loads)
        owner[cid] = rank
        heapq.heappush(loads, (load + max(int(steps[cid]), 1), rank))
    return owner


class ProcessTeam(Team):
    """The team of a torch.distributed process group (initialised by :func:`init_team`)."""

    def __init__(self, steps: np.ndarray, device: torch.device) -> None:
        """``steps``: every client's planned local steps per round, [m]."""
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.steps = np.asarray(steps, dtype=np.int64)
        self.owner = place_clients(self.steps, self.size)
        self.owned = np.flatnonzero(self.owner == self.rank).astype(np.int64)
        self.fixed_owners = False
        self.device = device

    def keep_client_state(self) -> np.ndarray:
        self.fixed_owners = True
        return self.owned

    def mine(self, clients: np.ndarray) -> np.ndarray:
        clients = np.asarray(clients, dtype=np.int64)
        owner = self.owner[clients] if self.fixed_owners else place_clients(self.steps[clients], self.size)
        return clients[owner == self.rank]

    def _collective(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as err:  # gloo/NCCL errors and timeouts (DistBackendError is a RuntimeError)
            said = " ".join(str(err).split())[:300]
            then = (
                "stopped on an error or died before the rounds began (its own message says why)"
                if what == "start-up"
                else "died or stalled: resume the run with --resume from its last checkpoint"
            )
            raise RanksLost(
                f"rank {self.rank} of {self.size} lost the other ranks during {what} ({said}); another rank has {then}"
            ) from None

    def _objects(self, what: str, item: Any) -> list[Any]:
        parts: list[Any] = [None] * self.size
        self._collective(what, lambda: dist.all_gather_object(parts, item))
        return parts

    def combine(self, t: int, sums: RoundSums, losses: list[torch.Tensor], upload: int):
        what = f"round {t}"
        local_losses = torch.cat([v.reshape(-1) for v in losses]).cpu() if losses else torch.zeros(0)
        shapes = {name: (tuple(v.shape), v.dtype) for name, v in sums.vectors.items()}
        parts = self._objects(what, (shapes, sums.scalars, local_losses.double().numpy(), upload))
        total = RoundSums()
        for name in sorted({name for part in parts for name in part[0]}):
            shape, dtype = next(part[0][name] for part in parts if name in part[0])
            mine = sums.vectors.get(name)
            if mine is None:
                mine = torch.zeros(shape, dtype=dtype, device=self.device)
            gathered = [torch.empty_like(mine) for _ in range(self.size)]
            self._collective(what, lambda g=gathered, m=mine: dist.all_gather(g, m.contiguous()))
            out = gathered[0]
            for part in gathered[1:]:  # in rank order: the same bits on every rank, rerun after rerun
                out.add_(part)
            total.vectors[name] = out
        for part in parts:
            for name, value in part[1].items():
                total.add_scalar(name, value)
        everyone = torch.as_tensor(np.concatenate([part[2] for part in parts]), device=self.device)
        return total, [everyone], sum(part[3] for part in parts)

    def evaluate(self, fn, x, y):
        bounds = np.linspace(0, x.shape[0], self.size + 1).round().astype(np.int64)
        a, b = int(bounds[self.rank]), int(bounds[self.rank + 1])
        loss, acc = fn(x[a:b], y[a:b]) if b > a else (float("nan"), float("nan"))
        parts = self._objects("evaluation", (b - a, loss, acc))
        n = sum(part[0] for part in parts)
        if n == 0:
            return float("nan"), float("nan")
        return tuple(sum(part[0] * part[i] for part in parts if part[0]) / n for i in (1, 2))

    def first(self, fn):
        value, failure = None, None
        if self.rank == 0:
            try:
                value = fn()
            except (ValueError, OSError) as err:
                failure = (isinstance(err, ValueError), str(err))
        box = [failure]
        self._collective("start-up", lambda: dist.broadcast_object_list(box, src=0))
        if box[0] is not None:
            is_value_error, message = box[0]
            raise (ValueError if is_value_error else OSError)(message)
        return value

    def scatter(self, items):
        box: list[Any] = [None]
        self._collective("start-up", lambda: dist.scatter_object_list(box, items, src=0))
        return box[0]

    def everyone(self, t, parts):
        gathered = self._objects(f"round {t}", [_updates_on(p, torch.device("cpu")) for p in parts])
        return [_updates_on(p, self.device) for rank_parts in gathered for p in rank_parts]

    def gather(self, item):
        parts: list[Any] | None = [None] * self.size if self.rank == 0 else None
        item = _on_cpu(item)  # a CUDA tensor would arrive on the sender's GPU index
        self._collective("a checkpoint", lambda: dist.gather_object(item, parts, dst=0))
        return parts


class RanksLost(ConnectionError):
    """A collective failed: another rank died, stalled or stopped on an error of its own."""


def _updates_on(updates: ClientUpdates, device: torch.device) -> ClientUpdates:
    """``updates`` with its tensors on ``device``."""
    vectors = {name: v.to(device) for name, v in updates.vectors.items()}
    return dataclasses.replace(updates, vectors=vectors, losses=updates.losses.to(device))


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def timeout_seconds() -> float:
    """The collective timeout: PYFEDKERN_DIST_TIMEOUT seconds when set, else :data:`DEFAULT_TIMEOUT`."""
    text = os.environ.get("PYFEDKERN_DIST_TIMEOUT", "")
    try:
        value = float(text) if text else DEFAULT_TIMEOUT
    except ValueError:
        value = -1.0
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"PYFEDKERN_DIST_TIMEOUT must be a positive number of seconds, got {text!r}")
    return value


def rank_device(device: str) -> str:
    """The device this rank computes on: ``cuda`` becomes ``cuda:LOCAL_RANK`` (one GPU per rank)."""
    if device == "cpu":
        return device
    local, per_node = int(os.environ.get("LOCAL_RANK", "0")), local_world_size()
    if device != "cuda" and per_node > 1:
        raise ValueError(
            f"device {device!r} with {per_node} ranks on a machine: use --device cuda (rank i takes GPU i)"
        )
    return f"cuda:{local}" if device == "cuda" else device


def init_process_group(device: str) -> None:
    """Join the env:// rendezvous (gloo on the CPU, NCCL on CUDA); ConnectionError naming the rendezvous address when
    the other ranks cannot be reached within the timeout."""
    if dist.is_initialized():
        return
    # torch.func's first gradient imports torch._dynamo, which imports modules (torch.distributed.nn.functional,
    # FSDP's grad scaler) whose functions take the default process group as a default argument. Imported mid-run,
    # they would hold the group past destroy_process_group, so that it (and gloo's threads) ended only during the
    # interpreter's shutdown, which aborts the process ("terminate called without an active exception"). Imported
    # before the group exists, their default is None.
    import torch._dynamo

    timeout = timeout_seconds()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, ValueError, OSError) as err:
        said = " ".join(str(err).split())[:300]
        raise ConnectionError(
            f"rank {rank} of {size} could not reach the other ranks at the rendezvous {address} within {timeout:g} s "
            f"({said}); check MASTER_ADDR/MASTER_PORT (torchrun --rdzv-endpoint) and that every node started"
        ) from None


def init_team(sim: Any) -> ProcessTeam:
    """The team of an initialised process group for the simulation ``sim``: every client placed by its planned steps
    under the run's local training settings (the same on every rank), and every rank on rank 0's training path
    (:func:`share_path_choice`). ValueError for a model with running statistics (BatchNorm's)."""
    tracking = [type(m).__name__ for m in sim.local.module.modules() if _tracks_running_stats(m)]
    if tracking:
        raise ValueError(
            f"the model's {tracking[0]} keeps running statistics, which each process would update from its own "
            "clients only, so a distributed run would not equal one process; run it in one process, or use a "
            "normalization without running statistics (e.g. GroupNorm, or track_running_stats=False)"
        )
    team = ProcessTeam(sim.planned_steps(np.arange(sim.num_clients, dtype=np.int64)), sim.device)
    share_path_choice(sim, team)
    return team


def _tracks_running_stats(module: torch.nn.Module) -> bool:
    """Whether ``module`` updates running statistics in training (BatchNorm, InstanceNorm with
    ``track_running_stats=True``)."""
    return bool(getattr(module, "track_running_stats", False)) and getattr(module, "running_mean", None) is not None


def share_path_choice(sim: Any, team: Team) -> None:
    """When the engine measures which training path (``config.batched`` None) or loop layout
    (``config.channels_last`` None) is faster, make every rank take rank 0's choice: each rank measures (at the same
    time, so none waits long) and rank 0's answer is sent to all, as two processes' timings can disagree and ranks
    on different paths would not train alike."""
    if sim.config.batched is None:
        choice = sim.batched
        sim.batched = team.scatter([choice] * team.size if team.rank == 0 else None)
    if sim.config.channels_last is None:
        choice = sim.channels_last
        sim.channels_last = team.scatter([choice] * team.size if team.rank == 0 else None)


def close_process_group() -> None:
    """Leave the process group: once no module holds it (see :func:`init_process_group`), this ends it and joins
    gloo's threads while the interpreter still runs."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_workers(workers: int, device: str) -> None:
    """ValueError unless ``workers`` local processes can run here: 1..cores on the CPU, 1..GPUs on CUDA (one GPU
    per worker, ``--device cuda``)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an integer >= 1, got {workers!r}")
    if device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if workers > min(cores, MAX_WORKERS):
            raise ValueError(
                f"--workers {workers} is more than the {cores} CPU cores this process may use; each worker needs a core"
            )
    elif workers > 1:
        gpus = torch.cuda.device_count()
        if device != "cuda":
            raise ValueError(f"--workers with a GPU needs --device cuda (worker i takes GPU i), got {device!r}")
        if workers > gpus:
            raise ValueError(f"--workers {workers} is more than the {gpus} visible GPUs (one worker per GPU)")


def spreads(cls: type) -> bool:
    """Whether the algorithm class ``cls`` can spread its rounds over processes: its ``distributed`` attribute is
    true and was set by the class that defines its ``round`` or by a subclass of it (a class that overrides
    ``round`` must say so itself; it does not inherit the base class's True)."""
    mro = cls.__mro__
    round_owner = next(i for i, c in enumerate(mro) if "round" in vars(c))
    flag_owner = next(i for i, c in enumerate(mro) if "distributed" in vars(c))
    return bool(cls.distributed) and flag_owner <= round_owner


def check_algorithm(name: str, params: dict[str, Any] | None = None) -> None:
    """ValueError unless the algorithm ``name`` with hyper-parameters ``params`` can spread its rounds over processes
    (:func:`spreads`): it, and the algorithm it wraps when it has a ``host`` hyper-parameter (``dynamic``)."""
    names = [name]
    host = algorithm_class(name).hyperparameters().get("host")
    if host is not None:
        names.append((params or {}).get("host", host.default))
    for each in names:
        if not spreads(algorithm_class(each)):
            raise ValueError(
                f"algorithm {each!r} runs in one process only (its round does not go through ctx.team); "
                "run it without --workers or torchrun"
            )


def launch_workers(workers: int, argv: list[str]) -> int:
    """Run ``python -m pyfedkern ARGV`` in ``workers`` local processes through torch's elastic launcher (what
    torchrun runs: a c10d rendezvous on localhost, no restarts); 0, or :class:`ChildFailedWorkers` with the error of
    the lowest rank that told one (:func:`tell_launcher`), else naming the rank that failed first (the launcher then
    stops the others)."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=workers,
        run_id=f"pyfedkern-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.5,
    )
    # the launcher's log lines repeat what the workers and the errors below say (its loggers set their own levels)
    launcher_logs = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith(_LAUNCHER)]
    levels = [log.level for log in launcher_logs]
    for log in launcher_logs:
        log.setLevel(logging.CRITICAL)
    os.environ[LAUNCHED_BY_WORKERS] = "1"
    try:
        elastic_launch(config, sys.executable)("-m", "pyfedkern", *argv)
    except SignalException:  # Ctrl-C or SIGTERM to this process: the workers are stopped
        raise KeyboardInterrupt from None
    except ChildFailedError as err:
        failures = err.failures
        told = [r for r in sorted(failures) if failures[r].error_file_data.get("told")]  # (see tell_launcher)
        if told:  # an error of the lowest rank that had one: the others stopped on it, or had the same one
            said = failures[told[0]].message
            raise ChildFailedWorkers(
                said if told[0] == 0 else f"worker rank {told[0]} of {workers}: {said}", 2
            ) from None
        # else the rank that failed first; the launcher's SIGTERM to the others comes after it
        ranks = sorted(failures, key=lambda r: (failures[r].exitcode == -signal.SIGTERM, failures[r].timestamp, r))
        first, failure = ranks[0], failures[ranks[0]]
        how = failure.signal_name() if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        raise ChildFailedWorkers(
            f"worker rank {first} of {workers} failed ({how}); the others were stopped",
            failure.exitcode if failure.exitcode > 0 else 1,
            lost_work=True,
        ) from None
    finally:
        del os.environ[LAUNCHED_BY_WORKERS]
        for log, level in zip(launcher_logs, levels, strict=True):
            log.setLevel(level)
    return 0


_LAUNCHER = "torch.distributed.elastic"


class ChildFailedWorkers(Exception):
    """A ``--workers`` process failed; ``status`` is the exit status to give; ``lost_work``: it died in the middle
    (a signal, a crash), so the run may be resumed from its last checkpoint, where an error it told
    (:func:`tell_launcher`) stopped it."""

    def __init__(self, message: str, status: int, *, lost_work: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.lost_work = lost_work


def tell_launcher(message: str) -> bool:
    """Leave this rank's one-line error ``message`` to the ``--workers`` process that started it, which says the
    lowest rank's (:func:`launch_workers`; through the launcher's error file); False, leaving nothing, in a process
    that ``--workers`` did not start."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (os.environ.get(LAUNCHED_BY_WORKERS) and path):
        return False
    with open(path, "w") as file:
        json.dump({"message": message, "timestamp": int(time.time()), "told": True}, file)
    return True


def run_distributed(
    config: Any,
    out_dir: str | os.PathLike | None = None,
    *,
    resume: bool = False,
    progress: bool = False,
    callbacks: list[Any] | tuple[Any, ...] = (),
) -> list[dict[str, Any]]:
    """Run (or resume) ``config`` as this process's rank of a launched job (torchrun or ``--workers``; see
    :meth:`Simulation.run <pyfedkern.sim.engine.Simulation.run>`): join the process group, build the simulation,
    place the clients, run (calling ``callbacks`` on every rank), leave the group. Every rank returns the same
    per-round metrics."""
    check_algorithm(config.algorithm, config.algorithm_params)
    device = rank_device(config.device)
    init_process_group(device)
    try:
        sim = Simulation(config)
        sim.team = init_team(sim)
        return sim.run(out_dir, resume=resume, progress=progress, callbacks=callbacks)
    finally:
        close_process_group()
