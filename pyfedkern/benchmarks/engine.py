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
import itertools
import queue
import sys
import threading
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
    :meth:`round` call (the simulation keeps running between calls, so Ray's start-up is paid once).

    The ServerApp waits for a request, runs ``strategy.start(num_rounds=1)`` from the current model, and reports
    back; :meth:`close` ends the simulation.
    """

    def __init__(self, config: Any) -> None:
        from flwr.app import Context
        from flwr.serverapp import Grid, ServerApp
        from flwr.simulation import run_simulation

        from pyfedkern.integrations import flower as pf

        self.config = config
        self._requests: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        server = ServerApp()
        clients = config.clients

        @server.main()
        def main(grid: Grid, context: Context) -> None:
            arrays = pf.initial_arrays(config)
            strategy = pf.FedAvg(fraction_evaluate=0.0, min_available_nodes=clients, min_train_nodes=clients)
            while self._requests.get() is not None:
                result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1, timeout=3600.0)
                arrays = result.arrays
                self._done.put(arrays)
            self._done.put(None)

        backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"include_dashboard": False}}
        self._thread = threading.Thread(
            target=run_simulation,
            kwargs={
                "server_app": server,
                "client_app": pf.make_client_app(config),
                "num_supernodes": clients,
                "backend_config": backend,
                "verbose_logging": False,
            },
            daemon=True,
        )
        self._thread.start()
        atexit.register(self.close)

    def round(self) -> Any:
        """Run one round; returns the new global model (an ArrayRecord)."""
        self._requests.put(True)
        arrays = self._done.get()
        if arrays is None:
            raise RuntimeError("the Flower simulation ended before the round ran")
        return arrays

    def close(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=60.0)


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
