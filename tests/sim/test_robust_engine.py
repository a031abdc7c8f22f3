"""Robust aggregators and Byzantine attacks in the engine: every rule on the loop and the batched path (float64,
equal to rounding), the rule really replacing the mean, attacks reproducible, resumable and logged, bad specs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pyfedkern.algorithms import Algorithm, ClientUpdates
from pyfedkern.cli import main
from pyfedkern.sim.checkpoints import load_config
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation, _cpu_threads
from pyfedkern.sim.results import read_metrics

BASE = ExperimentConfig(
    clients=8,
    rounds=2,
    model="mlp",
    model_params={"hidden": 8},
    partition="dirichlet:0.5",
    batch_size=32,
    local_steps=3,
    dtype="float64",
    seed=3,
    eval_every=2,
    eval_train_max=0,
    checkpoint_every=1,
)
RULES = ["median", "trimmed:0.2", "krum:1", "multikrum:1,3", "bulyan:1", "geomed", "cclip:0.5,2"]


def _numbers(metrics):
    return [{k: v for k, v in m.items() if not k.startswith("time")} for m in metrics]


def _model(cfg: ExperimentConfig, *, batched: bool) -> tuple[torch.Tensor, list]:
    sim = Simulation(dataclasses.replace(cfg, batched=batched))
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    extras = []
    with _cpu_threads(1):
        for t in range(cfg.rounds):
            extras.append(algo.round(t, sim).extras)
    return algo.global_model().clone(), extras


@pytest.mark.parametrize("attack", [None, "alie:0.25"])
@pytest.mark.parametrize("rule", RULES)
def test_every_rule_is_the_same_on_the_loop_and_the_batched_path(rule, attack):
    cfg = dataclasses.replace(BASE, aggregator=rule, attack=attack, client_chunk=3)  # chunks of 3, 3, 2 rows
    batched, extras_b = _model(cfg, batched=True)
    loop, extras_l = _model(cfg, batched=False)
    plain, _ = _model(dataclasses.replace(cfg, aggregator="mean"), batched=True)
    torch.testing.assert_close(batched, loop, rtol=1e-10, atol=1e-12)
    assert extras_b == extras_l
    assert not torch.allclose(batched, plain)  # the rule is not the mean


@pytest.mark.parametrize("algorithm", ["fedprox", "scaffold", "fedadam"])
def test_rules_and_attacks_in_other_model_averaging_algorithms(algorithm):
    cfg = dataclasses.replace(BASE, algorithm=algorithm, aggregator="trimmed:0.2", attack="signflip:0.25")
    batched, _ = _model(cfg, batched=True)
    loop, _ = _model(cfg, batched=False)
    torch.testing.assert_close(batched, loop, rtol=1e-10, atol=1e-12)


def test_krum_moves_the_global_model_to_one_client_s_model(monkeypatch):
    """One round with krum:1 and no server step size: the new global model is one of the uploaded models."""
    cfg = dataclasses.replace(BASE, rounds=1, aggregator="krum:1")
    sim = Simulation(cfg)
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    uploads = []
    updates = algo.client_update

    def recording(t, clients, ctx):
        out = updates(t, clients, ctx)
        uploads.append(out.vectors["model"].clone())
        return out

    monkeypatch.setattr(algo, "client_update", recording)
    algo.round(0, sim)
    rows = torch.cat(uploads)
    distance = (rows - algo.global_model()).abs().amax(dim=1)
    assert distance.min() < 1e-12 < distance.max()


def test_the_mean_keeps_the_round_as_it_was(monkeypatch):
    """aggregator="mean" without an attack folds each chunk as it comes (no rows kept)."""
    monkeypatch.setattr(ClientUpdates, "concat", lambda *a: pytest.fail("the mean kept the round's rows"))
    monkeypatch.setattr(Algorithm, "robust_accumulate", lambda *a: pytest.fail("the mean took the robust path"))
    given, _ = _model(dataclasses.replace(BASE, aggregator="mean", client_chunk=3), batched=True)
    default, _ = _model(dataclasses.replace(BASE, client_chunk=3), batched=True)
    assert torch.equal(given, default)


def test_attacks_are_reproducible_logged_and_change_the_model():
    cfg = dataclasses.replace(BASE, rounds=3, attack="signflip:0.25")
    a = Simulation(cfg).run()
    b = Simulation(cfg).run()
    assert _numbers(a) == _numbers(b)
    rounds = a[1:]
    assert all(m["attackers"] == 2 and len(m["attacked_clients"]) == 2 for m in rounds)
    assert all(set(m["attacked_clients"]) <= set(range(8)) for m in rounds)
    assert len({tuple(m["attacked_clients"]) for m in rounds}) > 1  # drawn per round
    other = Simulation(dataclasses.replace(cfg, seed=4)).run()
    assert [m["attacked_clients"] for m in other[1:]] != [m["attacked_clients"] for m in rounds]
    honest = Simulation(dataclasses.replace(cfg, attack=None)).run()
    assert "attackers" not in honest[1]
    assert honest[-1]["test_loss"] != a[-1]["test_loss"]


def test_an_attacked_robust_run_resumes_exactly(tmp_path, monkeypatch):
    cfg = dataclasses.replace(BASE, rounds=4, fraction=0.75, aggregator="median", attack="gaussian:0.25,2")
    full = Simulation(cfg).run(tmp_path / "full")
    sim = Simulation(cfg)
    original = sim.algorithm.round

    def crash(t, ctx):
        if t == 3:
            raise KeyboardInterrupt
        return original(t, ctx)

    monkeypatch.setattr(sim.algorithm, "round", crash)
    with pytest.raises(KeyboardInterrupt):
        sim.run(tmp_path / "cut")
    monkeypatch.undo()
    stored = load_config(tmp_path / "cut")
    assert (stored.aggregator, stored.attack) == ("median", "gaussian:0.25,2")
    resumed = Simulation(stored).run(tmp_path / "cut", resume=True)
    assert _numbers(resumed) == _numbers(full)
    assert _numbers(read_metrics(tmp_path / "cut")) == _numbers(full)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"aggregator": "trimmed:0.6"}, r"aggregator 'trimmed:0.6': β must be in \[0, 0.5\)"),
        ({"aggregator": None}, "aggregator must be a string"),
        ({"attack": 0.2}, "attack must be a string"),
        ({"attack": "signflip:2"}, r"attack 'signflip:2': the fraction must be in \(0, 1\]"),
        ({"algorithm": "fedpbc", "aggregator": "median"}, "algorithm 'fedpbc' refuses aggregator 'median'"),
        ({"algorithm": "fedspeed", "attack": "ipm:0.2"}, "algorithm 'fedspeed' refuses attack 'ipm:0.2'"),
    ],
)
def test_bad_settings_are_refused_before_the_run(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(BASE, **change).validate()


def test_too_few_uploads_for_the_rule_are_named():
    cfg = dataclasses.replace(BASE, rounds=1, fraction=0.5, aggregator="bulyan:1")  # 4 participants, 7 needed
    with pytest.raises(ValueError, match="aggregator bulyan:1: needs at least 7 uploads in a round, got 4"):
        Simulation(cfg).run()


def test_distributed_runs_gather_the_uploads_and_equal_one_process(tmp_path):
    """Two gloo ranks (torchrun, tests/sim/distributed_cases.py): each gathers every rank's uploads, so the rule and
    the attack see the whole round; the metrics equal one process's (float64, to rounding), also when resumed."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pyfedkern

    root = Path(pyfedkern.__file__).resolve().parents[1]
    cases = {
        "fedavg-multikrum-alie": dataclasses.replace(BASE, rounds=3, aggregator="multikrum:1,3", attack="alie:0.25"),
        "scaffold-median-signflip": dataclasses.replace(
            BASE, algorithm="scaffold", rounds=3, fraction=0.75, aggregator="median", attack="signflip:0.34"
        ),
    }
    spec = {
        "cases": {name: dataclasses.replace(c, threads=1).to_dict() for name, c in cases.items()},
        "resumed": ["scaffold-median-signflip"],
        "runs": str(tmp_path / "runs"),
    }
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(root) + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [str(Path(__file__).with_name("distributed_cases.py")), str(tmp_path / "cases.json")]
    command += [str(tmp_path / "out.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    for name, cfg in cases.items():
        want = _numbers(Simulation(dataclasses.replace(cfg, threads=1)).run())
        runs = results[name]["runs"] + ([results[name]["resumed"]] if name in spec["resumed"] else [])
        for got in map(_numbers, runs):
            assert [m.get("attacked_clients") for m in got] == [m.get("attacked_clients") for m in want]
            for g, w in zip(got, want, strict=True):
                assert g.keys() == w.keys()
                for key, value in w.items():
                    assert g[key] == (pytest.approx(value, rel=1e-10, abs=1e-12) if isinstance(value, float) else value)


def test_experiment_takes_the_aggregator_and_the_attack():
    from pyfedkern.sim.experiment import Experiment

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((80, 5)).astype(np.float32), rng.integers(0, 3, 80)
    exp = Experiment(
        torch.nn.Linear(5, 3),
        (x, y),
        (x, y),
        clients="iid",
        num_clients=5,
        rounds=2,
        aggregator="geomed",
        attack="scale:0.2,-5",
        eval_every=2,
    )
    metrics = exp.run()
    assert exp.config.aggregator == "geomed" and all(m["attackers"] == 1 for m in metrics[1:])
    with pytest.raises(ValueError, match="unknown aggregator 'middle'"):
        Experiment(torch.nn.Linear(5, 3), (x, y), (x, y), clients="iid", num_clients=5, aggregator="middle")


def test_the_command_line_runs_and_refuses_in_one_line(tmp_path, capsys):
    fast = ["--clients", "8", "--rounds", "1", "--model", "logreg", "--local-steps", "2", "--no-progress"]
    out = tmp_path / "r"
    assert main(["run", *fast, "--aggregator", "trimmed:0.25", "--attack", "ipm:0.25,2", "--out", str(out)]) == 0
    assert read_metrics(out)[1]["attackers"] == 2
    capsys.readouterr()
    assert main(["run", *fast, "--aggregator", "krum:x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "aggregator 'krum:x': argument 'x' is not a number" in err
    assert main(["run", *fast, "--algorithm", "bherd", "--attack", "alie:0.2"]) == 2
    assert "algorithm 'bherd' refuses attack 'alie:0.2'" in capsys.readouterr().err


def test_the_docs_examples_run(tmp_path, monkeypatch):
    """The Python and command-line examples of docs/robust.md's sections on the simulator, attacks and Flower."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "robust.md").read_text()
    text = text[text.index("## Robust aggregation in the simulator") :]
    blocks = re.findall(r"```(python|console)\n(.*?)```", text, flags=re.S)
    assert {kind for kind, _ in blocks} == {"python", "console"}
    monkeypatch.chdir(tmp_path)
    for kind, code in blocks:
        if kind == "python":
            if "flwr" in code or "flower" in code:
                pytest.importorskip("flwr")
            exec(compile(code, "docs/robust.md", "exec"), {})
        else:
            for line in code.strip().splitlines():
                argv = shlex.split(line)
                assert argv[0] == "pyfedkern"
                assert main([*argv[1:], "--no-progress"]) == 0
