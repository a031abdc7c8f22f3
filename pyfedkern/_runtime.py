"""Loading of the compiled extension ``pyfedkern._C`` and build/runtime introspection."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any


@functools.cache
def native() -> ModuleType:
    """The compiled extension module, imported on first use."""
    try:
        return importlib.import_module("pyfedkern._C")
    except ImportError as exc:  # pragma: no cover - only on a broken install
        raise ImportError(
            "pyfedkern's compiled extension pyfedkern._C is missing or failed to load "
            f"({exc}); reinstall with `pip install .` from the source tree"
        ) from exc


def build_info() -> dict[str, Any]:
    """What was compiled: CUDA yes/no and archs, compiler and versions, and the CPU threads the kernels use."""
    import numpy
    import torch

    from pyfedkern import __version__

    info = dict(native().build_info())
    info["pyfedkern"] = __version__
    info["numpy"] = numpy.__version__
    info["torch"] = torch.__version__
    info["num_threads"] = get_num_threads()
    return info


def cuda_available() -> bool:
    """Whether pyfedkern was compiled with CUDA and a usable CUDA device exists now."""
    return bool(native().cuda_device_count() > 0)


def set_num_threads(n: int) -> None:
    """Set the number of CPU threads pyfedkern's kernels use (results do not depend on it)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"set_num_threads: n must be an integer >= 1, got {n!r}")
    native().set_num_threads(n)


def get_num_threads() -> int:
    """The number of CPU threads pyfedkern's kernels use."""
    return int(native().get_num_threads())
