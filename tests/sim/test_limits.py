"""Limits checked before anything is allocated: threads within the machine's CPUs, and memory estimates of the data,
the model and a round's minibatch plan that refuse what does not fit and say what does."""

import dataclasses
import functools
import os
import re
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch

from pyfedkern import models
from pyfedkern.data import datasets
from pyfedkern.sim import engine
from pyfedkern.sim.config import (
    ExperimentConfig,
    check_data_memory,
    check_local_work,
    check_model_memory,
    check_threads,
)

CONFIG = ExperimentConfig(clients=4, rounds=1, model="logreg", partition="iid")


def test_threads_are_capped_at_the_machines_cpus(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 6)
    check_threads(None)
    check_threads(6)
    with pytest.raises(ValueError, match="threads=7 is more than the 6 CPUs of this machine; use at most 6"):
        check_threads(7)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_data_estimate_covers_what_the_run_holds(dtype):
    config = dataclasses.replace(
        CONFIG, dataset="synthetic-iid:40,7,3", partition="natural", clients=40, dtype=dtype, algorithm="fedavg"
    )
    sim = engine.Simulation(config)
    data = datasets.load_dataset(config.dataset)
    held = sum(a.nbytes for a in (data.x_train, data.x_test, data.y_train, data.y_test, data.client_ids))
    held += sim.planner.x.nbytes
    if dtype == "float64":  # the converted copies of the whole set
        held += sim.evaluator.x_test.nbytes + sim.planner.x.nbytes
    with pytest.raises(ValueError, match="needs about"):  # never less than what is held
        check_data_memory(config, held - 1)
    check_data_memory(config, 3 * held)  # nor far more


def test_data_that_does_not_fit_says_how_many_clients_do():
    config = dataclasses.replace(CONFIG, dataset="quadratic:1000,50", model="quadratic", partition="natural")
    with pytest.raises(ValueError) as err:
        check_data_memory(config, 100_000)
    message = str(err.value)
    assert message.startswith("dataset quadratic:1000,50 (2,000 samples of 50 values) needs about 679.7 KiB of memory")
    fits = int(re.search(r"about ([\d,]+) of its 1,000 clients fit \(a smaller m\)", message).group(1).replace(",", ""))
    assert 0 < fits < 1000
    check_data_memory(dataclasses.replace(config, dataset=f"quadratic:{fits},50"), 100_000)
    with pytest.raises(ValueError, match=r"of its 1,000 clients fit \(a smaller N in synthetic-iid:N\)"):
        check_data_memory(dataclasses.replace(config, dataset="synthetic-iid:1000"), 100_000)
    check_data_memory(dataclasses.replace(config, dataset="mnist"), 1)  # read from files: no estimate


@pytest.mark.parametrize(("model", "params"), [("mlp", {"hidden": (7, 5)}), ("cnn", {}), ("logreg", {})])
def test_the_model_estimate_counts_the_real_parameters(model, params):
    config = dataclasses.replace(CONFIG, model=model, model_params=params, dtype="float64")
    count = sum(p.numel() for p in models.build_model(model, (1, 8, 8), 10, **params).parameters())
    build = functools.partial(models.build_model, model, (1, 8, 8), 10, **params)
    check_model_memory(config, build, 4 * 8 * count)
    with pytest.raises(ValueError) as err:
        check_model_memory(config, build, 4 * 8 * count - 1)
    assert f"has {count:,} parameters; the run holds at least 4 copies" in str(err.value)
    assert f"at most about {count - 1:,} parameters fit" in str(err.value)


def test_local_work_that_does_not_fit_names_the_option_and_what_fits():
    sizes = np.array([50, 70, 30, 90])
    for option, value in (("local_steps", 10**6), ("local_epochs", 1e5)):
        config = dataclasses.replace(CONFIG, **{option: value})
        with pytest.raises(ValueError) as err:
            check_local_work(config, sizes, 10**6)
        found = re.search(rf"at most about {option}=([\d.e+,]+) fits", str(err.value))
        assert str(err.value).startswith(f"{option}={value:,} makes ") and found
        most = float(found.group(1).replace(",", ""))
        check_local_work(dataclasses.replace(config, **{option: type(value)(most)}), sizes, 10**6)
    with pytest.raises(ValueError, match=r"local_epochs=1e\+300 makes 6e\+300 local steps a round \(2 participants\)"):
        check_local_work(dataclasses.replace(CONFIG, local_epochs=1e300, fraction=0.5), sizes, 10**12)


def test_a_run_that_does_not_fit_is_refused_before_its_data_is_made(monkeypatch):
    monkeypatch.setattr(engine, "free_memory", lambda device: 10_000)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the data was loaded"))
    with pytest.raises(ValueError, match=r"dataset digits .* needs about"):
        engine.Simulation(CONFIG)


def _cgroup_files(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_cgroup_limit_counts_the_process_s_cgroup_and_its_ancestors(tmp_path):
    from pyfedkern.algorithms.batched import cgroup_room

    mount, membership = tmp_path / "cgroup", tmp_path / "self-cgroup"
    membership.write_text("0::/jobs/run7\n")
    _cgroup_files(mount, {"jobs/run7/memory.max": "max\n", "jobs/run7/memory.current": "100\n"})
    assert cgroup_room(str(mount), str(membership)) is None  # no limit anywhere
    # v2: the parent's limit less its usage, page cache that can be reclaimed counted as free
    _cgroup_files(mount, {"jobs/memory.max": "5000\n", "jobs/memory.current": "3000\n"})
    assert cgroup_room(str(mount), str(membership)) == 2000
    _cgroup_files(mount, {"jobs/memory.stat": "anon 2000\ninactive_file 500\nactive_file 500\n"})
    assert cgroup_room(str(mount), str(membership)) == 2500
    _cgroup_files(mount, {"jobs/run7/memory.max": "2600\n"})  # the tighter of the two
    assert cgroup_room(str(mount), str(membership)) == 2500
    _cgroup_files(mount, {"jobs/run7/memory.current": "2500\n"})
    assert cgroup_room(str(mount), str(membership)) == 100
    # v1: the memory controller's hierarchy; its 'unlimited' is a page-rounded 2^63
    membership.write_text("4:memory:/box\n3:cpu:/box\n0::/\n")
    _cgroup_files(mount, {"memory/box/memory.limit_in_bytes": "9223372036854771712\n"})
    _cgroup_files(mount, {"memory/box/memory.usage_in_bytes": "10\n"})
    assert cgroup_room(str(mount), str(membership)) is None
    _cgroup_files(mount, {"memory/box/memory.limit_in_bytes": "8000\n", "memory/box/memory.usage_in_bytes": "9000"})
    assert cgroup_room(str(mount), str(membership)) == 0  # over its limit: nothing left
    _cgroup_files(mount, {"memory/box/memory.stat": "cache 4000\ntotal_inactive_file 3000\n"})
    assert cgroup_room(str(mount), str(membership)) == 2000
    assert cgroup_room(str(mount), str(tmp_path / "absent")) is None


def test_free_memory_is_the_least_of_ram_and_the_process_s_limits(monkeypatch):
    from pyfedkern.algorithms import batched

    monkeypatch.setattr(batched, "cgroup_room", lambda: 12345)
    assert batched.free_memory(torch.device("cpu")) == 12345
    monkeypatch.setattr(batched, "rlimit_room", lambda: 999)
    assert batched.free_memory(torch.device("cpu")) == 999


def _limited(limit: int):
    """A preexec_fn giving the child process an address-space limit of ``limit`` bytes."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def test_an_address_space_rlimit_bounds_free_memory():
    """A child under RLIMIT_AS (as ``prlimit --as`` or ``ulimit -v`` set it) sees at most the limit less what it
    has mapped, however much RAM the machine has free."""
    limit = 6 << 30
    code = (
        "import torch; from pyfedkern.algorithms import batched; "
        "print(batched.free_memory(torch.device('cpu')), batched.rlimit_room())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, preexec_fn=_limited(limit)
    )
    assert done.returncode == 0, done.stderr
    free, room = map(int, done.stdout.split())
    assert 0 < free <= room < limit


def test_a_run_under_an_rlimit_is_refused_saying_what_fits(tmp_path):
    """The run of the report (200,000 clients' data under an 8 GiB address space): a one-line error that measures
    against the limit, not a MemoryError traceback."""
    args = ["--dataset", "synthetic:1,1,200000", "--partition", "natural", "--clients", "200000", "--model", "logreg"]
    done = subprocess.run(
        [sys.executable, "-m", "pyfedkern", "run", *args, "--rounds", "1", "--out", str(tmp_path / "X")],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limited(8 << 30),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    available = re.search(r"but ([\d.,]+) GiB are available; about [\d,]+ of its 200,000 clients fit", done.stderr)
    assert available and float(available.group(1).replace(",", "")) <= 8.0, done.stderr


def test_a_memory_error_during_a_run_is_a_one_line_error(monkeypatch, capsys):
    from pyfedkern.cli import main

    def exhausted(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(engine.Simulation, "run", exhausted)
    assert main(["run", "--rounds", "1", "--clients", "4", "--model", "logreg", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("pyfedkern run: error: out of memory: the command needs more than the ") and err.count("\n") == 1
    ), err
    assert "--client-chunk" in err
