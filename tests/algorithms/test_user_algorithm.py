"""Users' own algorithms: the file of docs/algorithms.md (FedAvgM, FedYogi, FedAnchor) written where the page says
and loaded by reference (``--algorithm package.module:Class``) from the CLI and a Flower run config, or given as a
class to Experiment. Each class agrees on the per-client loop and batched (float64); FedAnchor, with a client side
and per-client state of its own, also on two worker processes and in a Flower client that keeps its state between
rounds; FedYogi takes the formula's server step; bad references are one-line errors; the page's example and command
run."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pyfedkern import Experiment
from pyfedkern.algorithms import RoundSums, algorithm_class, algorithm_name, make_algorithm
from pyfedkern.algorithms.fedavg import FedAvg
from pyfedkern.cli import main
from pyfedkern.data.datasets import load_dataset
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation

DOC = Path(__file__).resolve().parents[2] / "docs" / "algorithms.md"
pytestmark = pytest.mark.skipif(not DOC.exists(), reason="docs/ not next to the tests (installed package only)")

PARAMS = {"FedAvgM": {"server_momentum": 0.5}, "FedYogi": {"server_lr": 0.03}, "FedAnchor": {"mu": 0.5}}
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
)


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.DOTALL)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """my_algorithms.py written into a folder of its own, as the page says, and imported from there."""
    folder = tmp_path_factory.mktemp("user")
    source = next(block for block in _blocks("python") if block.startswith("# my_algorithms.py"))
    (folder / "my_algorithms.py").write_text(source)
    sys.path.insert(0, str(folder))
    sys.modules.pop("my_algorithms", None)
    yield importlib.import_module("my_algorithms")
    sys.modules.pop("my_algorithms", None)
    sys.path.remove(str(folder))


def _config(name: str, **changes) -> ExperimentConfig:
    return dataclasses.replace(CONFIG, algorithm=f"my_algorithms:{name}", algorithm_params=PARAMS[name], **changes)


def _final_model(config: ExperimentConfig) -> torch.Tensor:
    sim = Simulation(config)
    sim.run()
    return sim.algorithm.global_model()


def test_the_reference_names_the_class_and_back(user_module):
    assert algorithm_class("my_algorithms:FedAvgM") is user_module.FedAvgM
    assert algorithm_name(user_module.FedAvgM) == "my_algorithms:FedAvgM" and algorithm_name(FedAvg) == "fedavg"
    assert make_algorithm("my_algorithms:FedAvgM", server_momentum=0.25).server_momentum == 0.25


@pytest.mark.parametrize("name", list(PARAMS))
def test_each_class_agrees_on_the_loop_and_batched(user_module, name):
    loop = _final_model(_config(name, batched=False))
    batched = _final_model(_config(name, batched=True))
    torch.testing.assert_close(batched, loop, rtol=0, atol=1e-12)
    fedavg = _final_model(dataclasses.replace(CONFIG, batched=False))
    assert (loop - fedavg).abs().max() > 1e-4  # each does something FedAvg does not
    if name == "FedAvgM":  # β = 0 is FedAvg
        plain = _final_model(dataclasses.replace(_config(name, batched=False), algorithm_params={"server_momentum": 0}))
        torch.testing.assert_close(plain, fedavg, rtol=0, atol=1e-12)


def test_fedyogi_takes_yogis_server_step(user_module):
    sim = Simulation(CONFIG)
    algo = user_module.FedYogi(server_lr=0.1, beta1=0.5, beta2=0.75, tau=0.01)
    algo.setup(sim, sim.initial_vector)
    x = sim.initial_vector.numpy().copy()
    m, v = np.zeros_like(x), np.full_like(x, 0.01**2)
    rng = np.random.default_rng(0)
    for t in range(3):
        mean = x + rng.normal(scale=0.1, size=x.shape)
        sums = RoundSums()
        sums.add("model", torch.from_numpy(np.stack([mean, mean])), np.array([1.5, 0.5]))
        sums.add_scalar("weight", 2.0)
        algo.server_step(t, sums, sim)
        delta = mean - x
        m = 0.5 * m + 0.5 * delta
        v = v - 0.25 * delta**2 * np.sign(v - delta**2)
        x = x + 0.1 * m / (np.sqrt(v) + 0.01)
        np.testing.assert_allclose(algo.x.numpy(), x, rtol=0, atol=1e-12)


def test_experiment_takes_the_class_and_matches_the_reference(user_module):
    settings = {k: getattr(CONFIG, k) for k in ("rounds", "fraction", "batch_size", "dtype", "seed", "eval_train_max")}
    experiment = Experiment(
        "mlp", load_dataset("digits"), clients="dirichlet:0.5", num_clients=6, algorithm=user_module.FedAvgM,
        algorithm_params=PARAMS["FedAvgM"], batched=False, **settings,
    )  # fmt: skip
    assert experiment.config.algorithm == "my_algorithms:FedAvgM"
    mine = [{k: v for k, v in m.items() if not k.startswith("time_")} for m in experiment.run()]
    by_reference = Simulation(_config("FedAvgM", model_params={}, batched=False)).run()
    assert mine == [{k: v for k, v in m.items() if not k.startswith("time_")} for m in by_reference]


def test_the_cli_runs_it_by_reference(user_module, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["run", "--algorithm", "my_algorithms:FedAvgM", "--server-momentum", "0.5", "--rounds", "2"]
    argv += ["--clients", "4", "--dtype", "float64", "--batched", "false", "--eval-train-max", "50", "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 0, capsys.readouterr().err
    stored = json.loads((out / "config.json").read_text())
    assert stored["algorithm"] == "my_algorithms:FedAvgM" and stored["algorithm_params"] == PARAMS["FedAvgM"]
    assert main(["run", "--algorithm", "my_algorithms:FedAvgM", "--help-algorithm"]) == 0
    assert "--server-momentum (default: 0.9)" in capsys.readouterr().out


def test_fedanchor_runs_on_two_workers_as_in_one_process(user_module, tmp_path):
    # Run from the module's folder, outside the checkout: `python -m` puts the working directory first on sys.path,
    # and the source tree has no compiled extension.
    argv = [sys.executable, "-m", "pyfedkern", "run", "--algorithm", "my_algorithms:FedAnchor", "--mu", "0.5"]
    argv += ["--rounds", "2", "--clients", "4", "--dtype", "float64", "--batched", "false", "--eval-train-max", "50"]
    argv += ["--threads", "1", "--no-progress"]
    metrics = {}
    for workers in (1, 2):
        out = tmp_path / str(workers)
        run = subprocess.run(
            [*argv, "--workers", str(workers), "--out", str(out)], cwd=Path(user_module.__file__).parent,
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
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
        ("my_algorithms:Missing", "has no attribute 'Missing'"),
        ("pyfedkern.algorithms.base:FLOAT32_MAX", "FLOAT32_MAX is a float, not callable"),
        ("pyfedkern:Experiment", "Experiment is not a subclass of pyfedkern.algorithms.Algorithm"),
    ],
)
def test_the_cli_refuses_a_bad_reference_in_one_line(user_module, capsys, reference, message):
    assert main(["run", "--algorithm", reference, "--rounds", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_flower_client_runs_fedanchor_and_keeps_its_anchor(user_module):
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord, RecordDict

    from pyfedkern.integrations import flower as pf

    run_config = {"algorithm": "my_algorithms:FedAnchor", "algorithm-params": json.dumps(PARAMS["FedAnchor"])}
    run_config |= {"dataset": "digits", "clients": 6, "model": "mlp", "dtype": "float64", "seed": 1}
    config = pf.config_from_run_config(run_config)
    assert config.algorithm == "my_algorithms:FedAnchor"
    sim = Simulation(config)
    algo = make_algorithm(config.algorithm, **config.algorithm_params)
    algo.setup(sim, sim.initial_vector)
    x0 = pf.initial_arrays(config)
    state = RecordDict()
    for server_round in (1, 2):  # the same server model twice: only the client's kept anchor differs
        content = RecordDict({"arrays": x0, "config": ConfigRecord({"server-round": server_round})})
        reply = pf.client_train(config, 2, server_round, content, state)
        expected = algo.client_update(server_round - 1, np.array([2]), sim).vectors["model"][0]
        got = torch.from_numpy(pf.arrays_vector(reply.array_records["arrays"], sim.local.flat.layout))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    content = RecordDict({"arrays": x0, "config": ConfigRecord({"server-round": 2})})
    forgetful = pf.client_train(config, 2, 2, content, RecordDict())  # round 2 without the kept anchor
    other = torch.from_numpy(pf.arrays_vector(forgetful.array_records["arrays"], sim.local.flat.layout))
    assert (other - expected).abs().max() > 1e-6
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        pf.config_from_run_config(dict(run_config, algorithm="my_algorithms:Missing"))


def test_the_pages_example_and_command_run(user_module, tmp_path):
    example = next(block for block in _blocks("python") if "Experiment(" in block)
    namespace: dict = {}
    exec(compile(example, str(DOC), "exec"), namespace)
    last = namespace["metrics"][-1]
    assert last["round"] == 3 and np.isfinite(last["test_acc"])
    argv = shlex.split(_blocks("text")[0].splitlines()[0])
    assert argv[0] == "pyfedkern"
    assert main([*argv[1:], "--dtype", "float64", "--no-progress", "--out", str(tmp_path / "run")]) == 0
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["algorithm"] == "my_algorithms:FedAnchor" and stored["algorithm_params"] == {"mu": 0.05}
