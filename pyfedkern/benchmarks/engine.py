"""Benchmark cases of whole simulation rounds: the engine's batched local training against the per-client loop, and
against Flower's simulation engine on the same task.

- ``engine_round {algorithm} m={m} synthetic(1,1) {model} {device}``: one round of FedAvg, SCAFFOLD, FedSpeed or
  BHerd over m = 100 or 1,000 clients (quick: m = 100, logreg), every client taking part: synthetic(1,1) with m
  natural clients (sizes 40 to 800 samples), one local epoch of batch 32, the round's indices drawn as in a real
  run (round t = 1, 2, ... of one long run). "pyfedkern": the participants trained as rows of one [k, d] tensor
  (:mod:`pyfedkern.algorithms.batched`); "per-client loop": the same round with ``batched=False`` (a Python loop
  over ``client_update``). Both compute the same round (equal to rounding, tests/sim/test_batched_engine.py). CPU
  runs use one thread, as :meth:`Simulation.run` does for models this small. Plus FedAvg with logreg at
  m = 10,000 (pyfedkern only: the per-client loop takes about 12 s a round on the CPU).
- ``flower_round m=500 digits fedavg mlp cpu``: one FedAvg round of 500 clients (digits split IID, 2 or 3 samples
  each, one epoch of batch 32: one step per client, MLP) in pyfedkern's engine and in Flower's simulation engine
  (Ray), with pyfedkern's own ClientApp on each node (so every client computes the same local update), timed round
  by round in a running simulation (start-up excluded). Without ``flwr[simulation]`` (Ray) the Flower case is left
  out.

``python -m pyfedkern.benchmarks.engine flower [clients] [rounds]`` prints client steps per second of both on the
Flower task.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from pyfedkern.benchmarks.common import Case

ALGORITHMS = {
    "fedavg": {},
    "scaffold": {},
    "fedspeed": {},
    "bherd": {"alpha": 0.5},
}
CLIENTS, QUICK_CLIENTS = (100, 1000), (100,)
MODELS, QUICK_MODELS = ("logreg", "mlp"), ("logreg",)
FLOWER_CLIENTS, QUICK_FLOWER_CLIENTS = 500, 20
LARGE_CLIENTS = 10_000


def round_config(algorithm: str, clients: int, model: str, device: str) -> Any:
    from pyfedkern.sim.engine import ExperimentConfig

    return ExperimentConfig(
        algorithm=algorithm,
        algorithm_params=dict(ALGORITHMS.get(algorithm, {})),
        dataset=f"synthetic:1,1,{clients}",
        partition="natural",
        clients=clients,
        model=model,
        batch_size=32,
        local_epochs=1.0,
        lr=0.05,
        device=device,
        eval_every=10**6,
    )


def flower_config(clients: int, device: str = "cpu") -> Any:
    from pyfedkern.sim.engine import ExperimentConfig

    return ExperimentConfig(
        algorithm="fedavg",
        dataset="digits",
        partition="iid",
        clients=clients,
        model="mlp",
        batch_size=32,
        local_epochs=1.0,
        lr=0.05,
        device=device,
    )


def engine_round(config: Any, batched: bool = True):
    """A callable running the next round of ``config`` in pyfedkern's engine (one CPU thread on the CPU); returns
    the global model."""
    from pyfedkern.sim.engine import Simulation, _cpu_threads

    sim = Simulation(replace(config, batched=batched))
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    rounds = itertools.count()
    threads = 1 if config.device == "cpu" else None

    def run():
        if threads is None:
            algo.round(next(rounds), sim)
        else:
            with _cpu_threads(threads):
                algo.round(next(rounds), sim)
        return algo.global_model()

    return run


def client_steps(config: Any) -> int:
    """Local steps of every client in one round of ``config`` (all clients take part)."""
    from pyfedkern.sim.engine import Simulation

    sim = Simulation(config)
    return int(sim.stacked_batches(range(sim.num_clients), 0).steps.sum())


def flower_available() -> bool:
    try:
        import flwr.simulation  # noqa: F401
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


class FlowerRounds:
    """Flower's simulation engine running pyfedkern's FedAvg ClientApp on ``config.clients`` nodes, one round per
    :meth:`round` call; the simulation keeps running between calls, so Ray's start-up is paid once.

    The simulation runs in its own process group (``python -m pyfedkern.benchmarks.engine serve-flower CLIENTS``):
    its ServerApp waits for a line on stdin, runs ``strategy.start(num_rounds=1)`` from the current model and
    answers with a line. :meth:`close` (also at interpreter exit) stops it and ends the whole group, Ray's
    processes included.
    """

    def __init__(self, config: Any) -> None:
        if config != flower_config(config.clients):
            raise ValueError("FlowerRounds runs flower_config(clients) only")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pyfedkern.benchmarks.engine", "serve-flower", str(config.clients)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        atexit.register(self.close)

    def round(self) -> str:
        """Run one round; returns the server's answer ("done")."""
        self._process.stdin.write("round\n")
        self._process.stdin.flush()
        answer = self._process.stdout.readline().strip()
        if answer != "done":
            raise RuntimeError(f"the Flower simulation did not run the round (answered {answer!r})")
        return answer

    def close(self) -> None:
        if self._process.poll() is None:
            try:
                self._process.stdin.write("stop\n")
                self._process.stdin.flush()
                self._process.wait(timeout=30.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)  # Ray's processes left in the group


def serve_flower(clients: int) -> None:
    """The process behind :class:`FlowerRounds`: Flower's simulation engine with a ServerApp that runs one FedAvg
    round per "round" line on stdin and answers "done" on stdout, until "stop"."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from pyfedkern.integrations import flower as pf

    config = flower_config(clients)
    out = sys.stdout
    sys.stdout = sys.stderr  # Flower's and Ray's output must not mix with the answers
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        arrays = pf.initial_arrays(config)
        strategy = pf.FedAvg(fraction_evaluate=0.0, min_available_nodes=clients, min_train_nodes=clients)
        for line in sys.stdin:
            if line.strip() != "round":
                break
            arrays = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1, timeout=3600.0).arrays
            out.write("done\n")
            out.flush()

    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"include_dashboard": False}}
    run_simulation(
        server_app=server,
        client_app=pf.make_client_app(config),
        num_supernodes=clients,
        backend_config=backend,
        verbose_logging=False,
    )


def cases(quick: bool = False, device: str = "cpu") -> list[Case]:
    """engine_round groups for every (algorithm, m, model), and the Flower round group (CPU, with Ray)."""
    out: list[Case] = []
    for model in QUICK_MODELS if quick else MODELS:
        for clients in QUICK_CLIENTS if quick else CLIENTS:
            for algorithm in ALGORITHMS:
                config = round_config(algorithm, clients, model, device)
                group = f"engine_round {algorithm} m={clients} synthetic(1,1) {model} {device}"
                out += [
                    Case(group, "pyfedkern", lambda c=config: engine_round(c, True), device=device),
                    Case(
                        group, "per-client loop (batched=False)", lambda c=config: engine_round(c, False), device=device
                    ),
                ]
    if not quick:  # the 10,000-client round (the per-client loop takes 12 s a round: not timed)
        config = round_config("fedavg", LARGE_CLIENTS, "logreg", device)
        group = f"engine_round fedavg m={LARGE_CLIENTS} synthetic(1,1) logreg {device}"
        out.append(Case(group, "pyfedkern", lambda c=config: engine_round(c, True), device=device))
    if device == "cpu":
        clients = QUICK_FLOWER_CLIENTS if quick else FLOWER_CLIENTS
        config = flower_config(clients)
        group = f"flower_round m={clients} digits fedavg mlp cpu"
        out.append(Case(group, "pyfedkern", lambda c=config: engine_round(c, True)))
        if flower_available():
            out.append(Case(group, "flower simulation engine (Ray)", lambda c=config: FlowerRounds(c).round))
    return out


def main(argv: list[str] | None = None) -> int:
    """``flower [clients] [rounds]``: client steps per second of pyfedkern's engine and Flower's simulation engine on
    the Flower task (each round timed after a first warm-up round)."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "serve-flower":
        serve_flower(int(args[1]))
        return 0
    if not args or args[0] != "flower":
        print("usage: python -m pyfedkern.benchmarks.engine flower [clients] [rounds]")
        return 2
    clients = int(args[1]) if len(args) > 1 else FLOWER_CLIENTS
    rounds = int(args[2]) if len(args) > 2 else 3
    config = flower_config(clients)
    steps = client_steps(config)
    timings = {}
    flower = None
    for name in ("pyfedkern", "flower simulation engine"):
        if name == "pyfedkern":
            run = engine_round(config)
        elif flower_available():  # started after pyfedkern's rounds: Ray's workers load the machine
            flower = FlowerRounds(config)
            run = flower.round
        else:
            print(f"{name}: not available (pip install 'flwr[simulation]')")
            continue
        run()  # warm-up
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        timings[name] = min(times)
        print(f"{name}: {min(times) * 1e3:.1f} ms a round, {steps / min(times):,.0f} client steps/s", flush=True)
    if flower is not None:
        flower.close()
    if len(timings) == 2:
        print(f"pyfedkern: {timings['flower simulation engine'] / timings['pyfedkern']:.0f}× Flower's client steps/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
