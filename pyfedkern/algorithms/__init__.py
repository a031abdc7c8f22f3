"""FL algorithms on flat parameter vectors, usable from the simulation engine or a user's own loop.

``ALGORITHMS`` maps each CLI name to the class implementing it (imported on first use).
"""

from __future__ import annotations

import importlib
from typing import Any

from pyfedkern.algorithms.base import (
    Algorithm,
    ClientStore,
    RoundStats,
    RoundSums,
    weighted_average,
)
from pyfedkern.algorithms.context import ClientUpdates, FLContext
from pyfedkern.algorithms.local import LocalModel
from pyfedkern.algorithms.looped import LocalResult, local_run, local_sgd
from pyfedkern.data.spec import import_object, is_reference

ALGORITHMS: dict[str, str] = {
    "fedavg": "pyfedkern.algorithms.fedavg:FedAvg",
    "fedprox": "pyfedkern.algorithms.fedavg:FedProx",
    "scaffold": "pyfedkern.algorithms.fedavg:Scaffold",
    "fnrfl": "pyfedkern.algorithms.fnrfl:FNRFL",
    "fedpbc": "pyfedkern.algorithms.fedpbc:FedPBC",
    "fedavg-links": "pyfedkern.algorithms.fedpbc:FedAvgLinks",
    "fedavg-all": "pyfedkern.algorithms.fedpbc:FedAvgAll",
    "fedavg-known-p": "pyfedkern.algorithms.fedpbc:FedAvgKnownP",
    "fedau": "pyfedkern.algorithms.fedpbc:FedAU",
    "mifa": "pyfedkern.algorithms.fedpbc:MIFA",
    "fedspeed": "pyfedkern.algorithms.fedspeed:FedSpeed",
    "feddyn": "pyfedkern.algorithms.fedspeed_baselines:FedDyn",
    "fedsam": "pyfedkern.algorithms.fedspeed_baselines:FedSAM",
    "fedcm": "pyfedkern.algorithms.fedspeed_baselines:FedCM",
    "fedadam": "pyfedkern.algorithms.fedspeed_baselines:FedAdam",
    "bherd": "pyfedkern.algorithms.bherd:BHerd",
    "grab": "pyfedkern.algorithms.bherd:GrabFedAvg",
    "bherd-fednova": "pyfedkern.algorithms.bherd:BHerdFedNova",
    "bherd-scaffold": "pyfedkern.algorithms.bherd:BHerdScaffold",
    "fednova": "pyfedkern.algorithms.bherd:FedNova",
    "dynamic": "pyfedkern.algorithms.dynamic:DynamicInit",
}


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under ``name``, or the user's :class:`Algorithm` subclass a ``package.module:Class``
    reference names; ValueError listing the valid names, or naming what is wrong with the reference, otherwise."""
    if isinstance(name, str) and is_reference(name):
        cls = import_object(name, "algorithm")
        if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
            raise ValueError(
                f"algorithm {name!r}: {name.partition(':')[2]} is not a subclass of pyfedkern.algorithms.Algorithm"
            )
        return cls
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {name!r}; valid choices: {', '.join(sorted(ALGORITHMS))}, or package.module:Class"
        )
    module, _, attr = ALGORITHMS[key].partition(":")
    return getattr(importlib.import_module(module), attr)


def algorithm_name(cls: type[Algorithm]) -> str:
    """What a config names ``cls`` by: its registered name, or ``package.module:Class`` for a user's class."""
    reference = f"{cls.__module__}:{cls.__qualname__}"
    return next((name for name, path in ALGORITHMS.items() if path == reference), reference)


def make_algorithm(name: str | type[Algorithm], **params: Any) -> Algorithm:
    """An instance of the algorithm ``name`` (see :func:`algorithm_class`; or the class itself) with
    hyper-parameters ``params`` (unknown ones are an error)."""
    cls = name if isinstance(name, type) else algorithm_class(name)
    valid = cls.hyperparameters()
    unknown = sorted(set(params) - set(valid))
    if unknown:
        choices = ", ".join(sorted(valid)) or "none"
        label = algorithm_name(cls) if isinstance(name, type) else name
        raise ValueError(f"algorithm {label!r} has no parameter(s) {', '.join(unknown)}; its parameters: {choices}")
    return cls(**params)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "ClientStore",
    "ClientUpdates",
    "FLContext",
    "LocalModel",
    "LocalResult",
    "RoundStats",
    "RoundSums",
    "algorithm_class",
    "algorithm_name",
    "local_run",
    "local_sgd",
    "make_algorithm",
    "weighted_average",
]
