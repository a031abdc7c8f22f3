"""A user's own algorithm, a class in this file: FedAvgM (FedAvg with server momentum, Hsu et al. 2019) loaded by
reference (``--algorithm package.module:Class``) from the CLI and a Flower run config, and given as a class to
Experiment; its loop and batched rounds, and two worker processes and one, agree in float64, and bad references are
one-line errors."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from pyfedkern import Experiment
from pyfedkern.algorithms import algorithm_class, algorithm_name, make_algorithm
from pyfedkern.algorithms.fedavg import FedAvg
from pyfedkern.cli import main
from pyfedkern.data.datasets import load_dataset
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation


@dataclass
class FedAvgM(FedAvg):
    """FedAvg with server momentum: m ← β·m + (x̄ − x), x ← x + m (x̄ the clients' weighted mean model)."""

    server_momentum: float = 0.9

    def setup(self, ctx, x0):
        super().setup(ctx, x0)
        self.m = torch.zeros_like(self.x)

    def server_step(self, t, sums, ctx):
        mean = sums.vector("model") / sums.scalar("weight")
        self.m.mul_(self.server_momentum).add_(mean - self.x)
        self.x.add_(self.m)

    def state_dict(self):
        return {**super().state_dict(), "m": self.m}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.m.copy_(state["m"])


NOT_AN_ALGORITHM = 3
REFERENCE = f"{__name__}:FedAvgM"
CONFIG = ExperimentConfig(
    dataset="digits",
    partition="dirichlet:0.5",
    clients=6,
    fraction=0.7,
    rounds=3,
    batch_size=64,
    model="mlp",
    model_params={"hidden": 16},
    dtype="float64",
    seed=1,
    eval_train_max=100,
    algorithm=REFERENCE,
    algorithm_params={"server_momentum": 0.5},
)


def _final_model(config: ExperimentConfig) -> torch.Tensor:
    sim = Simulation(config)
    sim.run()
    return sim.algorithm.global_model()


def test_the_reference_names_the_class_and_back():
    assert algorithm_class(REFERENCE) is FedAvgM
    assert algorithm_name(FedAvgM) == REFERENCE and algorithm_name(FedAvg) == "fedavg"
    assert make_algorithm(REFERENCE, server_momentum=0.25).server_momentum == 0.25


def test_loop_and_batched_rounds_agree_and_the_momentum_acts():
    loop = _final_model(dataclasses.replace(CONFIG, batched=False))
    batched = _final_model(dataclasses.replace(CONFIG, batched=True))
    torch.testing.assert_close(batched, loop, rtol=0, atol=1e-12)
    plain = _final_model(dataclasses.replace(CONFIG, batched=False, algorithm_params={"server_momentum": 0.0}))
    fedavg = _final_model(dataclasses.replace(CONFIG, batched=False, algorithm="fedavg", algorithm_params={}))
    torch.testing.assert_close(plain, fedavg, rtol=0, atol=1e-12)  # β = 0 is FedAvg
    assert (loop - fedavg).abs().max() > 1e-3  # β > 0 moves elsewhere


def test_experiment_takes_the_class_and_matches_the_reference():
    settings = {k: getattr(CONFIG, k) for k in ("rounds", "fraction", "batch_size", "dtype", "seed", "eval_train_max")}
    experiment = Experiment(
        "mlp", load_dataset("digits"), clients="dirichlet:0.5", num_clients=6, algorithm=FedAvgM,
        algorithm_params={"server_momentum": 0.5}, batched=False, **settings,
    )  # fmt: skip
    assert experiment.config.algorithm == REFERENCE
    mine = [{k: v for k, v in m.items() if not k.startswith("time_")} for m in experiment.run()]
    by_reference = Simulation(dataclasses.replace(CONFIG, model_params={}, batched=False)).run()
    assert mine == [{k: v for k, v in m.items() if not k.startswith("time_")} for m in by_reference]


def test_the_cli_runs_it_by_reference(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", REFERENCE, "--server-momentum", "0.5", "--rounds", "2", "--clients", "4"]
    argv += ["--dtype", "float64", "--batched", "false", "--eval-train-max", "50", "--no-progress", "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    stored = json.loads((out / "config.json").read_text())
    assert stored["algorithm"] == REFERENCE and stored["algorithm_params"] == {"server_momentum": 0.5}
    assert main(["run", "--algorithm", REFERENCE, "--help-algorithm"]) == 0
    assert "--server-momentum (default: 0.9)" in capsys.readouterr().out


def test_two_workers_run_it_as_one_process(tmp_path):
    # The class in a module of its own, run from outside the checkout: `python -m` puts the working directory first
    # on sys.path, and the source tree has no compiled extension.
    source = "import torch\nfrom dataclasses import dataclass\nfrom pyfedkern.algorithms.fedavg import FedAvg\n\n\n"
    (tmp_path / "user_fedavgm.py").write_text(source + inspect.getsource(FedAvgM))
    argv = [sys.executable, "-m", "pyfedkern", "run", "--algorithm", "user_fedavgm:FedAvgM"]
    argv += ["--server-momentum", "0.5", "--rounds", "2", "--clients", "4", "--dtype", "float64", "--batched", "false"]
    argv += ["--eval-train-max", "50", "--threads", "1", "--no-progress"]
    metrics = {}
    for workers in (1, 2):
        out = tmp_path / str(workers)
        run = subprocess.run(
            [*argv, "--workers", str(workers), "--out", str(out)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr
        metrics[workers] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics[2]) == len(metrics[1]) == 3
    for one, two in zip(metrics[1], metrics[2], strict=True):
        for key in ("test_loss", "test_acc", "train_loss"):
            assert two[key] == pytest.approx(one[key], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("no_such_module:FedAvgM", "algorithm 'no_such_module:FedAvgM': cannot import module 'no_such_module'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:NOT_AN_ALGORITHM", "NOT_AN_ALGORITHM is a int, not callable"),
        (f"{__name__}:Experiment", "Experiment is not a subclass of pyfedkern.algorithms.Algorithm"),
    ],
)
def test_the_cli_refuses_a_bad_reference_in_one_line(capsys, reference, message):
    assert main(["run", "--algorithm", reference, "--rounds", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_flower_client_runs_it_from_the_run_config():
    pytest.importorskip("flwr")
    from flwr.app import RecordDict

    from pyfedkern.integrations import flower as pf

    run_config = {"algorithm": REFERENCE, "algorithm-params": json.dumps({"server_momentum": 0.5})}
    run_config |= {"dataset": "digits", "clients": 6, "model": "mlp", "dtype": "float64", "seed": 1}
    config = pf.config_from_run_config(run_config)
    assert config.algorithm == REFERENCE
    x0 = pf.initial_arrays(config)
    reply = pf.client_train(config, 2, 1, RecordDict({"arrays": x0}), RecordDict())
    sim = Simulation(config)
    algo = make_algorithm(REFERENCE, server_momentum=0.5)
    algo.setup(sim, sim.initial_vector)
    expected = algo.client_update(0, 2, sim).vectors["model"]
    got = pf.arrays_vector(reply.array_records["arrays"], sim.local.flat.layout)
    torch.testing.assert_close(torch.from_numpy(got), expected, rtol=0, atol=1e-12)
    bad = dict(run_config, algorithm=f"{__name__}:Missing")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        pf.config_from_run_config(bad)
