"""Benchmark cases of rounds spread over processes (:mod:`pyfedkern.sim.distributed`).

``distributed_round {algorithm} m={m} synthetic(1,1) {model} {device}``: one round of FedAvg or SCAFFOLD over m
clients, every client taking part (the engine_round task of :mod:`pyfedkern.benchmarks.engine`: synthetic(1,1) with
m natural clients, one local epoch of batch 32), timed round after round of one long run:

- "1 worker, 1 thread" and "2 workers, 1 thread each": the round in W processes on a gloo process group
  (torch.multiprocessing workers; each trains the clients it owns and the sums are combined with collectives, as
  ``pyfedkern run --workers W`` does), the time from the command to the last worker's answer;
- "1 process, 2 threads": the one-process engine with two CPU threads (in a process of its own as well).

Each process reports its peak resident memory (``ru_maxrss``), recorded per case as ``peak_rss_mb_per_rank``
(SCAFFOLD's client controls are split between the ranks). m = 10,000 with logreg and mlp, and the largest m of
:data:`LARGEST_CLIENTS` (FedAvg, logreg); quick: m = 200, logreg. On CUDA: world size 1 through NCCL against the
one-process engine.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import resource
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from queue import Empty
from typing import Any

import pyfedkern
from pyfedkern.benchmarks.common import Case
from pyfedkern.benchmarks.engine import round_config
from pyfedkern.sim.engine import Simulation

ALGORITHMS = ("fedavg", "scaffold")
CLIENTS, QUICK_CLIENTS = 10_000, 200
MODELS, QUICK_MODELS = ("logreg", "mlp"), ("logreg",)
#: The largest client count timed (FedAvg, logreg): about 5.7 million samples, some 3 GB per process (the data and
#: its per-client copy), which two workers and the one-process case fit in a 24 GiB machine shared with other work.
LARGEST_CLIENTS = 30_000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(
    rank: int, world: int, port: int, build: Callable[[], Any], threads: int, device: str, commands: list, answers: Any
) -> None:
    """Process ``rank``: with ``world`` >= 1 join a gloo/NCCL group of that size (``world`` 0: one plain process),
    build the simulation (``build()``), run one round per "round" command with ``threads`` CPU threads, answer with
    its peak resident memory, until "stop"."""
    from pyfedkern.sim import distributed
    from pyfedkern.sim.engine import _cpu_threads

    try:
        if world:
            os.environ.update(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                }
            )
            distributed.init_process_group(distributed.rank_device(device))
        with _cpu_threads(threads):
            sim = build()
            if world:
                sim.team = distributed.init_team(sim)  # the engine's path choice too, under the timed thread count
            else:
                sim.channels_last  # noqa: B018 (the engine's path and layout choices, made now, not in a timed round)
        algo = sim.algorithm
        algo.setup(sim, sim.initial_vector)
        rounds = itertools.count()
        with _cpu_threads(threads):
            while commands[rank].get() == "round":
                algo.round(next(rounds), sim)
                if sim.device.type == "cuda":
                    import torch

                    torch.cuda.synchronize()
                answers.put((rank, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    except Exception:
        answers.put((rank, traceback.format_exc()))  # the parent raises it instead of waiting for an answer
        raise
    finally:
        distributed.close_process_group()


def serve_calls(
    rank: int, world: int, port: int, build: Callable[[], Any], threads: int, device: str, commands: list, answers: Any
) -> None:
    """Process ``rank`` of ``world`` plain processes (no process group; ``port`` and ``device`` unused): ``build()``
    returns a callable, called once as a warm-up and then once per "round" command with ``threads`` CPU threads,
    until "stop"; answers like :func:`_serve`."""
    from pyfedkern.sim.engine import _cpu_threads

    try:
        with _cpu_threads(threads):
            run = build()
            run()
            while commands[rank].get() == "round":
                run()
                answers.put((rank, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    except Exception:
        answers.put((rank, traceback.format_exc()))
        raise


class WorkerRounds:
    """Processes (torch.multiprocessing, spawn) running rounds of the simulation on ``device`` that ``build()`` makes
    (a picklable callable: ``functools.partial(Simulation, config)``, a module-level function) with ``threads`` CPU
    threads each: ``workers`` ranks of one process group, or with ``workers`` 0 one plain process (the one-process
    engine); each :meth:`round` call runs the next round in all of them and waits for every answer. ``peak_mb``: each
    process's peak resident memory (MiB). ``serve``: what each process runs (:func:`serve_calls`: ``workers`` plain
    processes, each calling what ``build()`` returns once a round)."""

    def __init__(
        self, build: Callable[[], Any], workers: int, threads: int = 1, device: str = "cpu", serve: Callable = _serve
    ) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self._commands = [context.SimpleQueue() for _ in range(max(workers, 1))]
        self._answers = context.Queue()
        # Spawned processes start from this one's sys.path; the folder of the pyfedkern running here goes first, so
        # that they import it too, not a source checkout without the compiled extension that the path may hold.
        here = str(Path(pyfedkern.__file__).resolve().parents[1])
        sys.path.insert(0, here)
        try:
            self._processes = mp.start_processes(
                serve,
                args=(workers, _free_port(), build, threads, device, self._commands, self._answers),
                nprocs=max(workers, 1),
                join=False,
                start_method="spawn",
            )
        finally:
            sys.path.remove(here)  # the first occurrence: the one inserted above
        self.peak_mb: list[float] = [0.0] * len(self._commands)
        atexit.register(self.close)

    def round(self) -> None:
        """Run the next round in every process; a RuntimeError with the worker's traceback (or exit code) when one
        fails or dies instead of answering."""
        for queue in self._commands:
            queue.put("round")
        waiting = len(self._commands)
        while waiting:
            try:
                rank, answer = self._answers.get(timeout=1.0)
            except Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._processes.processes) if p.exitcode is not None]
                if dead:
                    raise RuntimeError(
                        "benchmark workers exited during a round: "
                        + ", ".join(f"rank {r} (exit code {code})" for r, code in dead)
                    ) from None
                continue
            if isinstance(answer, str):
                raise RuntimeError(f"benchmark worker rank {rank} failed:\n{answer}")
            self.peak_mb[rank] = answer
            waiting -= 1

    def close(self) -> None:
        for queue in self._commands:
            with contextlib.suppress(OSError, ValueError):
                queue.put("stop")
        for process in self._processes.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


#: Peak resident memory (MiB) of each process, by case id, filled as the cases run (bench/test_bench_distributed.py
#: records it with the case).
PEAKS: dict[str, list[float]] = {}


_running: list[WorkerRounds] = []  # the processes of the case being timed (one case's at a time: memory)


def stop_workers() -> None:
    """Stop the processes of the last :func:`worker_rounds` call (if any)."""
    while _running:
        _running.pop().close()


def worker_rounds(
    build: Callable[[], Any], workers: int, threads: int = 1, device: str = "cpu", key: str | None = None
) -> Callable[[], None]:
    """A callable running the next round of :class:`WorkerRounds` (``build``, ``workers``, ``threads``, ``device``);
    the processes of the previous call's case are stopped first (memory). With ``key``, each round records the
    processes' peak resident memory in ``PEAKS[key]``."""
    stop_workers()
    rounds = WorkerRounds(build, workers, threads, device)
    _running.append(rounds)

    def run() -> None:
        rounds.round()
        if key is not None:
            PEAKS[key] = list(rounds.peak_mb)

    return run


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """distributed_round groups for FedAvg and SCAFFOLD at each (m, model), and the largest m (FedAvg, logreg)."""
    sizes = [(QUICK_CLIENTS, model) for model in QUICK_MODELS] if quick else [(CLIENTS, m) for m in MODELS]
    plan = [(algorithm, clients, model) for clients, model in sizes for algorithm in ALGORITHMS]
    if not quick:
        plan.append(("fedavg", LARGEST_CLIENTS, "logreg"))
    out: list[Case] = []
    for algorithm, clients, model in plan:
        config = replace(round_config(algorithm, clients, model, device), threads=1)
        group = f"distributed_round {algorithm} m={clients} synthetic(1,1) {model} {device}"
        if device == "cuda":  # one GPU: world size 1 through NCCL against the one-process engine
            runs = {"1 rank (NCCL)": (config, 1), "1 process": (config, 0)}
        else:
            runs = {
                "1 worker, 1 thread": (config, 1),
                "2 workers, 1 thread each": (config, 2),
                "1 process, 2 threads": (replace(config, threads=2), 0),
            }
        for name, (cfg, workers) in runs.items():
            key = f"{group} | {name}"
            build = functools.partial(Simulation, cfg)
            out.append(
                Case(
                    group,
                    name,
                    lambda b=build, c=cfg, w=workers, k=key: worker_rounds(b, w, c.threads, device, k),
                    device=device,
                )
            )
    return out
