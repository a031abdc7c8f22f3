"""ServerApp: a pyfedkern strategy chosen by the run config's ``algorithm``. Every round it logs the clients' mean
local loss and the global model's test and train loss and accuracy; it saves the final model if asked."""

import functools
import json
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from pyfedkern.integrations import flower as pf

app = ServerApp()


def make_strategy(config):
    # Every round trains all connected nodes; a node that drops out later is a failure, not a reason to wait.
    # The round's local-loss is the plain mean of the clients' mean local losses, as pyfedkern's simulator records
    # it (Flower's default weights it by num-examples: see README.md).
    common = {
        "min_available_nodes": 1,
        "min_train_nodes": 1,
        "fraction_evaluate": 0.0,
        "train_metrics_aggr_fn": functools.partial(pf.mean_metrics, uniform=True),
    }
    if config.algorithm == "fedpbc":
        return pf.FedPBC(**common)
    if config.algorithm == "bherd":
        return pf.BHerd(config, **common)
    if config.algorithm == "fedspeed":
        return pf.FedSpeed(**common)
    if config.algorithm == "dynamic":
        return pf.DynamicInit(config, **common)
    if config.dp == "central":  # user-level DP: clipped updates summed in one fused op, seeded noise, ε per round
        return pf.FedAvg(central_dp=pf.central_dp_of(config), seed=config.seed, **common)
    return pf.robust_strategy(config.aggregator, **common)  # FedAvg for the default aggregator, mean


def evaluate_each_round(config, pause_dir: str):
    """Evaluate the global model after each round (test and train loss/accuracy, as pyfedkern's simulator does);
    with ``pause_dir`` (scripted runs), also write ``round-N.json`` (who replied, who failed) and wait for
    ``go-N``."""
    evaluate = pf.server_evaluation(config)

    def after_round(server_round: int, arrays: ArrayRecord):
        metrics = evaluate(server_round, arrays)
        if pause_dir and server_round > 0:
            record = strategy.history[-1]
            folder = Path(pause_dir)
            (folder / f"round-{server_round}.json").write_text(
                json.dumps({"received": record.received, "failed": record.failed})
            )
            while not (folder / f"go-{server_round}").exists():
                time.sleep(0.1)
        return metrics

    return after_round


def wait_for_nodes(grid: Grid, count: int, timeout: float = 120.0) -> None:
    """Block until ``count`` SuperNodes are connected (one per client of the config)."""
    end = time.monotonic() + timeout
    while len(list(grid.get_node_ids())) < count:
        if time.monotonic() > end:
            raise TimeoutError(f"only {len(list(grid.get_node_ids()))} of {count} SuperNodes connected")
        time.sleep(0.2)


strategy = None


@app.main()
def main(grid: Grid, context: Context) -> None:
    global strategy
    run_config = dict(context.run_config)
    config = pf.config_from_run_config(run_config)
    wait_for_nodes(grid, int(run_config.get("min-nodes", 0)) or config.clients)
    strategy = make_strategy(config)
    result = strategy.start(
        grid=grid,
        initial_arrays=pf.initial_arrays(config),
        num_rounds=config.rounds,
        timeout=float(run_config.get("train-timeout", 60.0)),
        evaluate_fn=evaluate_each_round(config, str(run_config.get("pause-dir", ""))),
    )
    if run_config.get("out-file"):
        out = run_config["out-file"]
        model = pf.arrays_vector(result.arrays, pf.model_layout(config)) if result.arrays is not None else np.zeros(0)
        Path(out + ".history.json").write_text(json.dumps([vars(r) for r in strategy.history]))
        metrics = {
            "train": {rnd: dict(m) for rnd, m in result.train_metrics_clientapp.items()},
            "evaluate": {rnd: dict(m) for rnd, m in result.evaluate_metrics_serverapp.items()},
        }
        Path(out + ".metrics.json").write_text(json.dumps(metrics))
        np.save(out, model)  # last: its existence tells a scripted run that the other files are there
