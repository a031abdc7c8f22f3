"""The simulation engine: :class:`~pyfedkern.sim.experiment.Experiment` (the user's own model and data),
:class:`~pyfedkern.sim.engine.Simulation` and :func:`~pyfedkern.sim.engine.run_experiment` (a config's)."""

from __future__ import annotations

from typing import Any

__all__ = ["Experiment", "ExperimentConfig", "Simulation", "run_experiment"]


def __getattr__(name: str) -> Any:  # imported on first use: `import pyfedkern.sim.config` stays free of torch
    if name == "Experiment":
        from pyfedkern.sim.experiment import Experiment

        return Experiment
    if name in ("Simulation", "run_experiment"):
        from pyfedkern.sim import engine

        return getattr(engine, name)
    if name == "ExperimentConfig":
        from pyfedkern.sim.config import ExperimentConfig

        return ExperimentConfig
    raise AttributeError(f"module 'pyfedkern.sim' has no attribute {name!r}")
