"""Experiments on the user's own model and data: :class:`Experiment`.

Everything a ``pyfedkern run`` has — algorithms by name or instance, client sampling, link models, metrics, a run
directory with checkpoints, resume, a progress bar — for a model given as an ``nn.Module``, a factory or a
``package.module:factory`` reference, and data given as arrays or tensors of any shape or map-style datasets, split
among clients by a partition spec, by index lists or by the data's natural clients. docs/experiments.md has the
details and examples.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pyfedkern.algorithms import Algorithm, algorithm_name, make_algorithm
from pyfedkern.data.dataset import Dataset
from pyfedkern.sim.callbacks import Callback, check_callbacks
from pyfedkern.sim.config import OPTIONS, ExperimentConfig, check_seed
from pyfedkern.sim.engine import Simulation
from pyfedkern.sim.parts import Evaluate, Parts, as_dataset, check_data, from_arrays, model_spec, split

#: Config fields an Experiment sets from its own arguments (the rest are its keyword settings).
_FROM_PARTS = ("model", "model_params", "dataset", "data_root", "normalize", "parity", "partition", "clients")


class Experiment:
    """An FL experiment on the user's own parts.

    Args:
        model: an ``nn.Module`` (each run trains a copy), a factory returning one (called with the keywords it
            accepts among ``input_shape``, a sample's shape, and ``num_classes``), a ``"package.module:factory"``
            reference, a built-in model name (``"cnn"``), or a :class:`~pyfedkern.models.ModelSpec`.
        train: the training data: an ``(x, y)`` pair of NumPy arrays or tensors (x [n, ...] any shape; y int64
            class labels [n] or float regression targets [n, ...]), a map-style dataset of ``(x, y)`` pairs, or a
            :class:`~pyfedkern.data.dataset.Dataset` (which carries its test set: leave ``test`` None).
        test: the test data, in the same forms as ``train``.
        clients: a partition spec (``"dirichlet:0.3"``, ``"iid"``, ``"natural"`` for a Dataset's own clients, ...;
            ``pyfedkern partition --help``), a list of index lists (client i holds ``train`` samples
            ``clients[i]``), or one client id per training sample.
        num_clients: the number of clients of a partition spec (default 20; ``"natural"``: all of them).
        algorithm: an algorithm name (``"fedavg"``, or ``"package.module:Class"`` for a user's own), an
            :class:`~pyfedkern.algorithms.Algorithm` subclass (made with ``algorithm_params``), or an instance
            (``FedProx(mu=0.01)``).
        loss: ``loss(output, target)`` → the batch's mean loss (default: cross-entropy, or a built-in model's own).
        penalty: ``penalty(model)`` → a scalar added to the training objective (default: none).
        predict: ``predict(output)`` → int64 [B] classes for accuracy (default: argmax over dim 1).
        evaluate: ``evaluate(model, x_test, y_test)`` → {name: number}, extra test metrics logged as
            ``test_<name>`` at every evaluation (the engine's own ``loss`` and ``acc`` are refused as names).
        num_classes: the number of classes (default: the largest label + 1; None for float targets).
        allow_overlap: whether index lists may share samples.
        name: the data's name in config.json.
        callbacks: :class:`~pyfedkern.sim.callbacks.Callback` instances each run calls after the engine's own
            (e.g. the loggers :class:`~pyfedkern.sim.loggers.TensorBoard` and :class:`~pyfedkern.sim.loggers.MLflow`).
        **settings: the run options of :data:`~pyfedkern.sim.config.OPTIONS` (rounds, fraction, batch_size, lr,
            seed, dtype, dp, ...; docs/experiments.md tabulates them) but those set by the arguments above (model,
            model_params, dataset, data_root, normalize, parity, partition, clients) and ``algorithm``.
    """

    def __init__(
        self,
        model: Any,
        train: Any,
        test: Any = None,
        *,
        clients: Any = "dirichlet:0.3",
        num_clients: int | None = None,
        algorithm: str | type[Algorithm] | Algorithm = "fedavg",
        loss: Callable | None = None,
        penalty: Callable | None = None,
        predict: Callable | None = None,
        evaluate: Evaluate | None = None,
        num_classes: int | None = None,
        allow_overlap: bool = False,
        name: str = "data",
        callbacks: list[Callback] | tuple[Callback, ...] = (),
        **settings: Any,
    ) -> None:
        known = set(OPTIONS) - set(_FROM_PARTS) - {"algorithm"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(unknown)}; valid settings: {', '.join(sorted(known))}")
        settings = {k: v.item() if isinstance(v, np.generic) else v for k, v in settings.items()}  # NumPy scalars
        if evaluate is not None and not callable(evaluate):
            raise TypeError(f"evaluate must be callable, got {type(evaluate).__name__}")
        self.callbacks = check_callbacks(callbacks)
        if not isinstance(allow_overlap, bool):
            raise TypeError(f"allow_overlap must be True or False, got {allow_overlap!r}")
        spec = model_spec(model, loss=loss, penalty=penalty, predict=predict)
        if isinstance(algorithm, str) or (isinstance(algorithm, type) and issubclass(algorithm, Algorithm)):
            algorithm = make_algorithm(algorithm, **settings.pop("algorithm_params", {}))
        elif not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"algorithm must be a name, an Algorithm subclass or instance, got {type(algorithm).__name__}"
            )
        elif "algorithm_params" in settings:
            raise TypeError("algorithm_params goes with an algorithm name; an instance carries its own parameters")
        if isinstance(train, Dataset):
            if test is not None:
                raise ValueError("test: a pyfedkern Dataset carries its own test set; leave test None")
            data = as_dataset(train, train.name)
        elif test is None:
            raise ValueError("test: a test set is needed (an (x, y) pair or a map-style dataset)")
        else:
            data = from_arrays(train, test, name=name, num_classes=num_classes)
        check_data(data)
        if isinstance(clients, str) and num_clients is None:
            natural = clients.strip().lower() == "natural"
            if natural and data.client_ids is None:
                raise ValueError("clients='natural' needs a Dataset with client_ids (e.g. from pyfedkern.data.leaf)")
            num_clients = len(set(data.client_ids.tolist())) if natural else ExperimentConfig.clients
        seed = settings.get("seed", ExperimentConfig.seed)
        check_seed(seed)  # before the split draws from it
        partition, public = split(
            data,
            clients,
            num_clients,
            seed=seed,
            public_per_class=int(getattr(algorithm, "public_per_class", 0)),
            allow_overlap=allow_overlap,
        )
        config = ExperimentConfig(
            algorithm=algorithm_name(type(algorithm)),
            algorithm_params=_parameters(algorithm),
            model=spec.name,
            dataset=data.name,
            partition=clients if isinstance(clients, str) else "given",
            clients=partition.num_clients,
            **settings,
        )
        config.validate_settings()
        self.config = config
        self.algorithm = algorithm
        self.parts = Parts(spec, data, partition, public, evaluate)
        self._simulation: Simulation | None = None

    @property
    def simulation(self) -> Simulation:
        """The engine running this experiment (built, and the model checked, on first use)."""
        if self._simulation is None:
            self._simulation = Simulation(self.config, self.algorithm, self.parts)
        return self._simulation

    def run(
        self, out_dir: str | Path | None = None, *, resume: bool = False, progress: bool = False
    ) -> list[dict[str, Any]]:
        """Run (or, with ``resume``, continue the interrupted run in ``out_dir``); return the per-round metrics
        (see :meth:`~pyfedkern.sim.engine.Simulation.run`). Resuming needs the same settings, model structure, data
        and split."""
        return self.simulation.run(out_dir, resume=resume, progress=progress, callbacks=self.callbacks)


def _parameters(algorithm: Algorithm) -> dict[str, Any]:
    """The algorithm's hyper-parameters that config.json can hold (JSON values)."""
    out = {}
    for key in algorithm.hyperparameters():
        value = getattr(algorithm, key)
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out
