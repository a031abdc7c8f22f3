"""pyfedkern: fast federated-learning kernels (C++/CUDA) and the FL algorithms built on them.

Layers, top to bottom: ``cli`` → ``integrations`` / ``reproduce`` → ``sim`` (the engine) → ``algorithms`` →
``data`` / ``models`` / ``links`` → ``ops`` / ``reference`` → ``_C`` (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

from pyfedkern._runtime import build_info, cuda_available, get_num_threads, set_num_threads

__version__ = "0.1.0"

__all__ = ["Experiment", "__version__", "build_info", "cuda_available", "get_num_threads", "set_num_threads"]


def __getattr__(name: str) -> object:  # imported on first use: `import pyfedkern` stays light (the CLI's --help)
    if name == "Experiment":
        from pyfedkern.sim.experiment import Experiment

        return Experiment
    raise AttributeError(f"module 'pyfedkern' has no attribute {name!r}")
