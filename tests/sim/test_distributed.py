"""Rounds spread over processes (pyfedkern.sim.distributed) against the one-process run they replace: placement,
sharded client state, the threads rule, torchrun and ``--workers`` launches (gloo, 2, 3 and 4 processes), runs
stopped and resumed on the same processes, a rank killed mid-run and resumed, resume refused with another number of
workers, and the start-up error of an unreachable rank."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pyfedkern
from pyfedkern import Experiment
from pyfedkern.algorithms import ALGORITHMS, ClientStore, algorithm_class
from pyfedkern.algorithms.base import owned_clients
from pyfedkern.algorithms.paths import LayoutChoice, PathChoice
from pyfedkern.sim import distributed, engine
from pyfedkern.sim.distributed import Team, place_clients, share_path_choice
from pyfedkern.sim.engine import WORK_PER_THREAD, ExperimentConfig, Simulation, threads_for_work

#: The folder holding the pyfedkern that runs these tests (the installed one, or a checkout on PYTHONPATH): the
#: subprocesses import the same one, and run there so that a source checkout's cwd is not imported instead.
ROOT = Path(pyfedkern.__file__).resolve().parents[1]
BASE = ExperimentConfig(
    dataset="digits",
    partition="dirichlet:0.5",
    clients=7,
    fraction=0.75,
    rounds=3,
    batch_size=64,
    local_epochs=1.0,
    weight_decay=1e-3,
    dtype="float64",
    seed=3,
    threads=1,
)
# every algorithm (all spread over processes), with options that change its local step, links or server state
CASES = {
    "fedavg": ("fedavg", {"server_lr": 0.8}, 0.5),
    "fedavg-dropout": ("fedavg", {}, 0.0),  # a model with dropout on the per-client loop: seeded per client
    "fedprox": ("fedprox", {"mu": 0.1}, 0.0),
    "scaffold": ("scaffold", {}, 0.5),
    "fednova": ("fednova", {}, 0.0),
    "feddyn": ("feddyn", {}, 0.0),
    "fedsam": ("fedsam", {}, 0.0),
    "fedcm": ("fedcm", {}, 0.0),
    "fedadam": ("fedadam", {}, 0.0),
    "bherd": ("bherd", {"alpha": 0.5}, 0.0),
    "grab": ("grab", {}, 0.0),
    "bherd-fednova": ("bherd-fednova", {"alpha": 0.5}, 0.0),
    "bherd-scaffold": ("bherd-scaffold", {"alpha": 0.5}, 0.0),
    "scaffold-one": ("scaffold", {}, 0.0),
    "fedavg-links": ("fedavg-links", {"server_lr": 0.9, "link_probs": (0.6,)}, 0.0),
    "fedavg-all": ("fedavg-all", {"links": "markov"}, 0.0),
    "fedavg-known-p": ("fedavg-known-p", {"links": "cyclic", "cycle_length": 2}, 0.0),
    "fedau": ("fedau", {"cutoff": 2, "link_probs": (0.5,)}, 0.0),
    "fedspeed": ("fedspeed", {"alpha": 0.5}, 0.0),
    "fedspeed-all": ("fedspeed", {"corr_avg": "all", "ref_compat": True}, 0.0),  # Σ_m h_i of every process's clients
    "fedpbc": ("fedpbc", {}, 0.5),
    "mifa": ("mifa", {"resum_every": 2, "server_lr": 0.9}, 0.0),
    "fnrfl": ("fnrfl", {"p": 0.5, "public_size": 5, "refine_epochs": 1.0}, 0.0),
    # dropout in the server's refinement too: seeded per refined client, not by what its process trained before
    "fnrfl-dropout": ("fnrfl", {"p": 0.5, "public_size": 5, "refine_epochs": 1.0}, 0.0),
    "dynamic": ("dynamic", {"host": "scaffold", "sessions": 3, "session_rounds": 1}, 0.0),
    # clients leave and arrive (session groups) under a host that keeps every client's memory; distillation
    "dynamic-mifa": ("dynamic", {"host": "mifa", "method": "continuous", "sessions": 3, "session_rounds": 1}, 0.0),
}
# fields of a case's config other than BASE's
CONFIGS = {
    "fedavg-dropout": {"model": "simple_cnn", "batched": False},
    "fnrfl-dropout": {"model": "simple_cnn", "batched": False},
    "scaffold-one": {"fraction": 0.15},  # one participant a round: the other ranks have nothing to add
    "dynamic": {"partition": "groups:0,0.5", "clients": 8},
    "dynamic-mifa": {"partition": "groups:0,0.5", "clients": 8},
}
# stopped after the next-to-last round and resumed on the same ranks (from every rank's checkpointed state)
RESUMED = {
    "fedavg-dropout",
    "fnrfl-dropout",
    "fedspeed",
    "fedspeed-all",
    "fedpbc",
    "mifa",
    "fnrfl",
    "dynamic",
    "dynamic-mifa",
}
# BHerd's family records gradients in float32 buffers (also in float64 runs): its herding sees float32 rounding, so
# a client trained in another batch (other rows beside it) may differ in the last float32 bit
FLOAT32_BUFFERS = {"bherd", "bherd-fednova", "bherd-scaffold"}
STATEFUL = {
    "scaffold": "client_c",
    "scaffold-one": "client_c",
    "feddyn": "h_store",
    "bherd-scaffold": "client_c",
    "fedspeed": "h_store",
    "fedspeed-all": "h_store",
    "fedpbc": "clients",
    "mifa": "memory",
}
# cases whose client state is their host algorithm's (SCAFFOLD's c_i, MIFA's memory)
OWNED = {"dynamic", "dynamic-mifa"}


def case_config(name: str) -> ExperimentConfig:
    algorithm, params, momentum = CASES[name]
    model = "mlp" if name in ("scaffold", "fedavg") else "logreg"
    fields = {"model": model, "model_params": {"hidden": [8]} if model == "mlp" else {}, **CONFIGS.get(name, {})}
    return dataclasses.replace(BASE, algorithm=algorithm, algorithm_params=params, momentum=momentum, **fields)


def numbers(metrics: list[dict]) -> list[dict]:
    """The recorded numbers of a run, without its timings."""
    return [{k: v for k, v in m.items() if not k.startswith("time_")} for m in metrics]


def assert_close(got: list[dict], want: list[dict], rel: float = 1e-12) -> None:
    assert len(got) == len(want) > 1
    for g, w in zip(numbers(got), numbers(want), strict=True):
        assert g.keys() == w.keys()
        for key in w:
            if isinstance(w[key], float) and math.isnan(w[key]):
                assert math.isnan(g[key]), key
            else:
                assert g[key] == pytest.approx(w[key], rel=rel, abs=1e-13), (key, g["round"])


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    out["PYTHONPATH"] = str(ROOT) + os.pathsep + out.get("PYTHONPATH", "")
    out["OMP_NUM_THREADS"] = "1"
    out.update(extra)
    return out


def cli(*args: str, timeout: float = 240, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pyfedkern", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(**extra),
        cwd=ROOT,
    )


# Placement, stores, threads: in this process ------------------------------------------------------------------


def test_place_clients_balances_planned_steps_largest_first():
    steps = np.array([5, 1, 9, 3, 3, 7, 2])
    owner = place_clients(steps, 3)
    # by hand, largest first to the least-loaded rank: 9→r0, 7→r1, 5→r2, 3 (id 3)→r2 (5), 3 (id 4)→r1 (7),
    # 2→r2 (8), 1→r0 (9)
    assert owner.tolist() == [2, 0, 0, 2, 1, 1, 2]
    loads = np.bincount(owner, weights=steps, minlength=3)
    assert loads.max() - loads.min() <= steps.max()
    assert np.array_equal(place_clients(steps, 3), owner)  # deterministic
    assert place_clients(steps, 1).tolist() == [0] * 7
    with pytest.raises(ValueError, match="ranks"):
        place_clients(steps, 0)


def test_participants_split_by_the_round_s_work_until_client_state_is_kept(monkeypatch):
    """Without client state each round's participants are split by their planned steps; once an algorithm keeps
    client state (owned_clients at setup), every rank trains the participants it owns for the rest of the run."""
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    team = distributed.ProcessTeam(np.array([5, 5, 5, 5, 1, 1, 9, 2]), torch.device("cpu"))
    # owners over all clients, largest first: 6→r0, 0→r1, 1→r1, 2→r0, 3→r1, 7→r0, 4→r1, 5→r0
    assert team.owner.tolist() == [1, 1, 0, 1, 1, 0, 0, 0] and team.owned.tolist() == [0, 1, 3, 4]
    participants = np.array([3, 0, 1])  # all owned by rank 1: 15 steps there, none on rank 0
    assert team.mine(participants).tolist() == [0]  # this round's split, ties in list order: 3→r0, 0→r1, 1→r0
    ctx = Simulation(dataclasses.replace(BASE, rounds=1))
    ctx.team = team
    assert owned_clients(ctx).tolist() == [0, 1, 3, 4]
    assert team.mine(participants).tolist() == [3, 0, 1]
    assert owned_clients(Simulation(dataclasses.replace(BASE, rounds=1))) is None  # one process: all clients


def test_client_store_holds_only_its_clients_rows():
    full = ClientStore(6, 3, dtype=torch.float64)
    part = ClientStore(6, 3, dtype=torch.float64, owned=np.array([1, 4, 5]))
    assert part.data.shape == (3, 3)
    values = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    for store in (full, part):
        store.add_(np.array([5, 1]), values)
        store.add_(np.array([5]), values[:1])
    assert torch.equal(part.take(np.array([1, 5, 4])), full.take(np.array([1, 5, 4])))
    part.put_(np.array([4]), values[1:])
    assert torch.equal(part[4], values[1])
    part[1].add_(1.0)  # a view
    assert torch.equal(part.take(np.array([1]))[0], values[1] + 1.0)
    with pytest.raises(ValueError, match=r"clients \[0, 2\] are not held"):
        part.take(np.array([0, 2]))
    with pytest.raises(ValueError, match="owned"):
        ClientStore(6, 3, owned=np.array([1, 6]))


def test_threads_rule_follows_the_work_of_a_step(monkeypatch):
    assert threads_for_work(1_000, 16) == 1
    assert threads_for_work(2.5 * WORK_PER_THREAD, 16) == 2
    assert threads_for_work(1e12, 16) == 16 and threads_for_work(1e12, 1) == 1
    cores = len(os.sched_getaffinity(0))
    sim = Simulation(dataclasses.replace(BASE, model="logreg", threads=None, rounds=1))
    assert sim.auto_threads() == 1  # 5 clients × 64 samples × 650 parameters: a small step, whatever the model size
    sim.batch_size = 10**6  # the same model, a step a million times larger: every core
    assert sim.auto_threads() == cores
    sim.client_chunk = 1  # ... one client at a time: still large
    assert sim.auto_threads() == cores
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert sim.auto_threads() == 1  # one process per core: each its share
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")

    seen = []
    for threads, want in ((None, 1), (2, 2)):
        run = Simulation(dataclasses.replace(BASE, model="logreg", rounds=1, threads=threads))
        plain_round = run.algorithm.round
        monkeypatch.setattr(
            run.algorithm,
            "round",
            lambda t, ctx, inner=plain_round: seen.append(torch.get_num_threads()) or inner(t, ctx),
        )
        before = torch.get_num_threads()
        run.run()
        assert seen[-1] == want and torch.get_num_threads() == before  # applied inside the run only


def test_ranks_take_rank_zero_s_measured_path(monkeypatch):
    class RankOne(Team):  # rank 1 of 2, sent rank 0's choice by scatter
        rank, size = 1, 2

        def __init__(self, sent):
            self.sent = sent

        def scatter(self, items):
            assert items is None  # only rank 0 gives the items
            return self.sent

    sim = Simulation(dataclasses.replace(BASE, model="logreg", rounds=1, batched=None))
    monkeypatch.setattr(engine, "choose_path", lambda ctx, rows: PathChoice(True, "measured here"))
    share_path_choice(sim, RankOne(False))
    assert sim.batched is False  # rank 0's choice, not this rank's own measurement
    forced = Simulation(dataclasses.replace(BASE, model="logreg", rounds=1, batched=True))
    share_path_choice(forced, RankOne(False))  # a path the config forces is not measured, so not shared
    assert forced.batched is True
    looped = Simulation(dataclasses.replace(BASE, model="logreg", rounds=1, batched=False))
    monkeypatch.setattr(engine, "choose_layout", lambda ctx, rows: LayoutChoice(True, "measured here", {}))
    share_path_choice(looped, RankOne(False))
    assert looped.channels_last is False  # rank 0's layout too


def test_one_process_team_is_the_identity():
    team = Team()
    clients = np.array([3, 1])
    assert team.mine(clients) is clients and team.size == 1 and team.is_writer
    assert team.gather("x") == ["x"] and team.scatter(["y"]) == "y" and team.first(lambda: 5) == 5


class OwnRound(algorithm_class("fedavg")):
    """An algorithm of a user's own with a round of its own: not spread unless it says so."""

    def round(self, t, ctx):
        return super().round(t, ctx)


def test_every_algorithm_spreads_and_is_tested_here(monkeypatch):
    assert all(distributed.spreads(algorithm_class(name)) for name in ALGORITHMS)
    assert set(ALGORITHMS) == {algorithm for algorithm, _, _ in CASES.values()}
    for name in ALGORITHMS:
        distributed.check_algorithm(name)

    monkeypatch.setitem(ALGORITHMS, "own-round", f"{__name__}:OwnRound")
    assert not distributed.spreads(OwnRound)
    with pytest.raises(ValueError, match="'own-round' runs in one process only"):
        distributed.check_algorithm("own-round")
    with pytest.raises(ValueError, match="'own-round' runs in one process only"):  # as the host of a wrapper
        distributed.check_algorithm("dynamic", {"host": "own-round"})
    distributed.check_algorithm("dynamic", {"host": "fedpbc"})
    monkeypatch.setattr(OwnRound, "distributed", True)
    assert distributed.spreads(OwnRound)


def test_a_model_with_running_statistics_is_refused_before_any_round():
    """BatchNorm's running statistics would be updated by each rank's own clients only (the ranks' models would
    differ), so init_team refuses such a model, naming the module; GroupNorm or BatchNorm without running statistics
    pass the check (they then need the process group, which this process has not joined)."""

    x, y = np.random.default_rng(0).normal(size=(40, 6)), np.arange(40) % 3

    def sim_with(norm):
        module = torch.nn.Sequential(torch.nn.Linear(6, 8), norm, torch.nn.Linear(8, 3))
        return Experiment(module, (x, y), (x, y), clients="iid", num_clients=4).simulation

    with pytest.raises(ValueError, match=r"BatchNorm1d keeps running statistics.*GroupNorm"):
        distributed.init_team(sim_with(torch.nn.BatchNorm1d(8)))
    for fine in (torch.nn.GroupNorm(2, 8), torch.nn.BatchNorm1d(8, track_running_stats=False)):
        with pytest.raises(ValueError, match="process group"):
            distributed.init_team(sim_with(fine))


def test_check_workers_refuses_what_cannot_run():
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="--workers"):
            distributed.check_workers(bad, "cpu")
    with pytest.raises(ValueError, match="CPU cores"):
        distributed.check_workers(len(os.sched_getaffinity(0)) + 1, "cpu")
    distributed.check_workers(1, "cpu")


# Several processes --------------------------------------------------------------------------------------------


def run_cases(tmp_path: Path, names: list[str], ranks: int) -> dict:
    """The cases ``names`` run by distributed_cases.py on ``ranks`` gloo processes (torchrun): per case the metrics
    of two runs (and of a stopped and resumed one for RESUMED cases) and what each rank held."""
    cases = {name: case_config(name).to_dict() for name in names}
    spec = {"cases": cases, "resumed": sorted(RESUMED & set(names)), "runs": str(tmp_path / "runs")}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += [str(Path(__file__).with_name("distributed_cases.py")), str(tmp_path / "cases.json"), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env(), cwd=ROOT)
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-3000:]
    return json.loads(out.read_text())


def check_cases(results: dict, names: list[str], ranks: int) -> None:
    """Every case's runs equal the one-process run (float64: 1e-12), reruns are bit-identical, each client is owned
    by one rank and each rank's client stores hold its own clients' rows only."""
    for name in names:
        sim = Simulation(case_config(name))
        want = sim.run()
        first, second = results[name]["runs"]
        rel = 1e-6 if name in FLOAT32_BUFFERS else 1e-12
        assert_close(first, want, rel=rel)
        assert numbers(first) == numbers(second), name  # bit-identical rerun
        if name in RESUMED:
            assert_close(results[name]["resumed"], want, rel=rel)
        owned = [set(r["owned"]) for r in results[name]["ranks"]]
        assert len(owned) == ranks
        assert set().union(*owned) == set(range(sim.num_clients)) and sum(map(len, owned)) == sim.num_clients
        if name in STATEFUL:
            assert [r["stores"][STATEFUL[name]] for r in results[name]["ranks"]] == [len(o) for o in owned]
        # clients with state are trained by their owners; without, each round's participants are split anew
        assert {r["fixed_owners"] for r in results[name]["ranks"]} == {name in STATEFUL or name in OWNED}, name


@pytest.mark.parametrize("ranks", [2, 3])
def test_torchrun_equals_one_process_for_every_algorithm(tmp_path, ranks):
    """Every algorithm on 2 and 3 gloo ranks (torchrun) gives the one-process metrics to 1e-12 in float64, also when
    stopped and resumed; reruns with the same ranks are bit-identical; each rank stores only its own clients'
    state."""
    check_cases(run_cases(tmp_path, list(CASES), ranks), list(CASES), ranks)


@pytest.mark.parametrize("ranks", [1, 4])
def test_one_and_four_ranks_equal_one_process(tmp_path, ranks):
    """1 gloo rank (a process group of one) and 4 (some own one client, or none of a round's participants), on a few
    logistic-regression clients."""
    names = ["scaffold-one", "fedspeed-all", "fedpbc", "mifa", "fnrfl"]
    check_cases(run_cases(tmp_path, names, ranks), names, ranks)


def test_workers_launch_writes_once_and_equals_one_process(tmp_path):
    args = ["run", "--algorithm", "scaffold", "--dataset", "digits", "--partition", "dirichlet:0.5", "--clients", "7"]
    args += ["--fraction", "0.75", "--rounds", "3", "--batch-size", "64", "--weight-decay", "0.001", "--seed", "3"]
    args += ["--dtype", "float64", "--momentum", "0.5", "--model", "mlp", "--model-param", "hidden=8", "--threads", "1"]
    done = cli(*args, "--workers", "2", "--out", str(tmp_path / "run"), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("test accuracy") == 1  # rank 0 prints
    lines = (tmp_path / "run/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [0, 1, 2, 3]  # one writer
    stored = ExperimentConfig.from_dict(json.loads((tmp_path / "run/config.json").read_text()))
    assert (stored.algorithm, stored.clients, stored.dtype, stored.model) == ("scaffold", 7, "float64", "mlp")
    assert_close([json.loads(line) for line in lines], Simulation(stored).run())


def _descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children += [int(c) for c in text]
    return children + [d for c in children for d in _descendants(c) if Path(f"/proc/{c}").exists()]


def _rank_pid(parent: int, rank: int) -> int | None:
    for pid in _descendants(parent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"-m" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return pid
    return None


def test_killed_rank_stops_the_run_and_it_resumes(tmp_path):
    """Rank 1 killed after a checkpoint: the launcher stops the run within 60 s naming rank 1; resuming with another
    number of workers is refused; with the same number the run finishes with the one-process metrics."""
    run_dir = tmp_path / "run"
    rounds = 400
    args = ["run", "--algorithm", "scaffold", "--dataset", "digits", "--clients", "6", "--partition", "iid"]
    args += ["--rounds", str(rounds), "--local-steps", "2", "--batch-size", "16", "--dtype", "float64", "--seed", "5"]
    args += ["--model", "logreg", "--threads", "1", "--checkpoint-every", "5", "--eval-every", "50", "--no-progress"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pyfedkern", *args, "--workers", "2", "--out", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 300
        while not list((run_dir / "checkpoints").glob("round_*.pt")) and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()[1]
            time.sleep(0.2)
        victim = _rank_pid(launcher.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launcher.communicate(timeout=120)
        assert time.monotonic() - killed < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    hint = f"resume with `pyfedkern run --resume --out {shlex.quote(str(run_dir))} --workers 2`"
    assert f"worker rank 1 of 2 failed (SIGKILL); the others were stopped; {hint}" in stderr, stderr
    done_rounds = len((run_dir / "metrics.jsonl").read_text().splitlines()) - 1
    assert done_rounds < rounds

    refused = cli("run", "--resume", "--out", str(run_dir), "--workers", "1", "--no-progress")
    assert refused.returncode == 2
    assert "made by 2 worker(s) and this run has 1" in refused.stderr and refused.stderr.count("\n") == 1

    before = (run_dir / "metrics.jsonl").read_bytes()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "pyfedkern"]
    refused = subprocess.run(
        [*torchrun, "run", "--resume", "--out", str(run_dir), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env(),
        cwd=ROOT,
    )
    assert refused.returncode != 0 and "made by 2 worker(s) and this run has 1" in refused.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before

    resumed = cli("run", "--resume", "--out", str(run_dir), "--workers", "2", "--no-progress")
    assert resumed.returncode == 0, resumed.stderr
    got = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    config = ExperimentConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    assert_close(got, Simulation(config).run())


def test_workers_refusals_are_one_line_errors(tmp_path):
    cores = len(os.sched_getaffinity(0))
    for args, said in [
        (["--workers", "0"], "--workers must be an integer >= 1"),
        (["--workers", str(cores + 1)], "CPU cores"),
    ]:
        done = cli("run", "--rounds", "1", "--no-progress", *args, timeout=60)
        assert done.returncode == 2 and said in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_a_refusal_in_the_workers_is_said_once(tmp_path):
    """Every rank refuses a model with running statistics: rank 0 says it, the other ranks and the parent do not
    repeat it, and the launcher's log lines are not shown."""
    (tmp_path / "bn_model.py").write_text(
        "import torch\n\n\ndef make():\n"
        "    layers = torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 10)\n"
        "    return torch.nn.Sequential(*layers)\n"
    )
    done = cli("run", "--rounds", "1", "--model", "bn_model:make", "--workers", "2", "--no-progress", timeout=120,
               PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "BatchNorm1d keeps running statistics" in done.stderr, done.stderr


def test_an_error_of_one_worker_is_said_by_the_parent(tmp_path):
    """Only rank 1 fails (its dataset factory raises): its own error is the one line said, without the other rank's
    lost connection or resume advice (nothing was written)."""
    (tmp_path / "rank_data.py").write_text(
        "import os\n\nimport numpy as np\n\n\ndef make():\n"
        "    if os.environ['RANK'] == '1':\n        raise RuntimeError('no data on this node')\n"
        "    x, y = np.random.default_rng(0).normal(size=(60, 5)), np.arange(60) % 3\n    return (x, y), (x, y)\n"
    )
    args = ["run", "--dataset", "rank_data:make", "--model", "logreg", "--clients", "4", "--partition", "iid"]
    done = cli(*args, "--rounds", "1", "--workers", "2", "--out", str(tmp_path / "run"), "--no-progress",
               timeout=240, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == (
        "pyfedkern run: error: worker rank 1 of 2: dataset: the factory make raised RuntimeError: no data on this "
        "node\n"
    )


def test_a_rank_that_loses_the_others_at_start_up_gives_no_resume_advice(monkeypatch):
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    team = distributed.ProcessTeam(np.array([1, 1]), torch.device("cpu"))

    def closed():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(distributed.RanksLost) as err:
        team._collective("start-up", closed)
    assert str(err.value) == (
        "rank 0 of 2 lost the other ranks during start-up (Connection closed by peer); another rank has stopped on an "
        "error or died before the rounds began (its own message says why)"
    )
    with pytest.raises(ConnectionError, match=r"during round 3 .* resume the run with --resume"):
        team._collective("round 3", closed)


def test_interrupting_workers_is_one_line_saying_how_to_resume(tmp_path):
    """Ctrl-C (SIGINT to the process group) during a --workers run: exit status 130 and one line with the resume
    command, --workers included (no launcher traceback, no line from each worker)."""
    run_dir = tmp_path / "run"
    args = ["run", "--rounds", "400", "--clients", "6", "--partition", "iid", "--model", "logreg", "--threads", "1"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "pyfedkern", *args, "--workers", "2", "--out", str(run_dir), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()[1]
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGINT)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 130, stderr
    assert stderr == f"pyfedkern run: interrupted; resume with `pyfedkern run --resume --out {run_dir} --workers 2`\n"


GLOO_THREADS_AFTER_LEAVING = """
import os, sys
import torch
from pyfedkern.sim import distributed

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    return sum(name.startswith("pt_gloo") for name in names)

distributed.init_process_group("cpu")
torch.func.grad(lambda x: (x * x).sum())(torch.ones(3))  # its first call imports torch._dynamo
during = gloo_threads()  # (named by themselves once they run)
distributed.close_process_group()
print(during, gloo_threads(), "torch._dynamo" in sys.modules)
"""


def test_leaving_the_group_ends_gloo_s_threads_before_the_interpreter_shuts_down(tmp_path):
    """Modules that torch._dynamo imports take the default process group as a default argument: imported mid-run
    (torch.func's first gradient), they held the group past destroy_process_group, and gloo's threads ended in the
    interpreter's shutdown, which aborted ranks at exit ("terminate called without an active exception"). A rank
    that leaves the group has no gloo thread left."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rendezvous = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = subprocess.run(
        [sys.executable, "-c", GLOO_THREADS_AFTER_LEAVING],
        capture_output=True,
        text=True,
        timeout=240,
        env=env(**rendezvous),
        cwd=tmp_path,
    )
    assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr
    during, after, imported = done.stdout.split()
    assert int(during) > 0 and int(after) == 0 and imported == "True"


def test_unreachable_rendezvous_names_the_address(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rendezvous = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    began = time.monotonic()
    done = cli("run", "--rounds", "1", "--no-progress", timeout=120, PYFEDKERN_DIST_TIMEOUT="3", **rendezvous)
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]  # after c10d's own log lines
    assert last.startswith("pyfedkern run: error: rank 1 of 2 could not reach the other ranks at the rendezvous ")
    assert f"127.0.0.1:{port}" in last and time.monotonic() - began < 100


@pytest.mark.cuda
def test_cuda_world_size_one_through_nccl(tmp_path):
    """On a GPU: one rank through NCCL (the CUDA path of the collectives) equals the one-process CUDA run."""
    config = dataclasses.replace(case_config("scaffold"), device="cuda", threads=None)
    spec = {"cases": {"scaffold": config.to_dict()}, "resumed": [], "runs": str(tmp_path / "runs")}
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    script = Path(__file__).with_name("distributed_cases.py")
    done = subprocess.run([*command, str(script), str(tmp_path / "cases.json"), str(out)], env=env(), timeout=600)
    assert done.returncode == 0
    first, _ = json.loads(out.read_text())["scaffold"]["runs"]
    assert_close(first, Simulation(config).run())


def test_ranks_on_one_machine_split_its_memory_budget(monkeypatch):
    from pyfedkern.algorithms import batched

    sim = Simulation(dataclasses.replace(BASE, model="logreg"))
    per_client = batched.bytes_per_client(sim, 2)
    monkeypatch.setattr(batched, "free_memory", lambda device: int(per_client * 40 / batched.MEMORY_FRACTION["cpu"]))
    clients = np.arange(100)
    assert [len(c) for c in batched.client_chunks(sim, clients)] == [40, 40, 20]
    sim.device_sharers = 4
    assert [len(c) for c in batched.client_chunks(sim, clients)] == [10] * 10


def test_a_launched_process_without_its_team_refuses_to_run(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one of 2 started by torchrun: run the experiment with"):
        Simulation(dataclasses.replace(BASE, model="logreg")).run()
