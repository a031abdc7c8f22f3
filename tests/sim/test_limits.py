"""Limits checked before anything is allocated: threads within the machine's CPUs, and memory estimates of the data,
the model and a round's minibatch plan that refuse what does not fit and say what does."""

import dataclasses
import functools
import re

import numpy as np
import pytest

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
    held += sim._all_x.nbytes
    if dtype == "float64":  # the converted copies of the whole set
        held += sim.x_test.nbytes + sim._all_x.nbytes
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
