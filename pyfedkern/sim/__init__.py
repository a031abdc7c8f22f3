"""The simulator: one process runs every client of an FL experiment, round by round.

- :class:`~pyfedkern.sim.experiment.Experiment` runs an experiment from your own parts (a model or factory, arrays,
  tensors or a Dataset, clients as index lists or a partition spec).
- :class:`~pyfedkern.sim.config.ExperimentConfig` says what to run (dataset, partition, model, algorithm, rounds,
  ...); it is saved as a run directory's ``config.json``.
- :class:`~pyfedkern.sim.engine.Simulation` builds the data, the partition and the model from a config and runs the
  rounds; :func:`~pyfedkern.sim.engine.run_experiment` and :func:`~pyfedkern.sim.engine.run_or_reuse` run one into a
  run directory (checkpoints, metrics, resume), and :func:`~pyfedkern.sim.checkpoints.load_config` reads a
  run directory's config back.
- :func:`pyfedkern.sim.compare.compare` runs several algorithms on the same split and seed
  (:class:`~pyfedkern.sim.compare.Comparison`); :func:`~pyfedkern.sim.results.read_metrics`,
  :func:`~pyfedkern.sim.results.summarize`, :func:`~pyfedkern.sim.plots.plot_curves` and
  :func:`~pyfedkern.sim.plots.summary_table` read, condense, plot and tabulate the results.

The names are imported from the submodules (``pyfedkern.sim.config``, ``.experiment``, ``.engine``,
``.checkpoints``, ``.compare``, ``.results``, ``.plots``) on first use, so that ``import pyfedkern.sim.config``
stays cheap (no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_SOURCES = {
    "Experiment": "experiment",
    "ExperimentConfig": "config",
    "Simulation": "engine",
    "load_config": "checkpoints",
    "run_experiment": "engine",
    "run_or_reuse": "engine",
    "Comparison": "compare",
    "read_metrics": "results",
    "summarize": "results",
    "plot_curves": "plots",
    "summary_table": "plots",
}

__all__ = list(_SOURCES)


def __getattr__(name: str) -> Any:
    if name not in _SOURCES:
        raise AttributeError(f"module 'pyfedkern.sim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pyfedkern.sim.{_SOURCES[name]}"), name)
