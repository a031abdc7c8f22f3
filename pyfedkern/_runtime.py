"""Loading of the compiled extension ``pyfedkern._C`` and build/runtime introspection."""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
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


#: glibc's mallopt parameters (malloc.h) and the values :func:`retain_freed_memory` sets: blocks up to 32 MiB (the
#: largest allowed) come from malloc's heap instead of fresh mmaps, and up to 1 GiB of free heap top is kept.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD, _TRIM_THRESHOLD = 32 << 20, 1 << 30


@functools.cache
def retain_freed_memory() -> bool:
    """Make the C allocator keep freed memory for reuse instead of returning it to the OS, process-wide.

    A CPU training step allocates and frees megabytes of activations and gradients; by default glibc's malloc gives
    each such block back to the OS and page-faults a fresh one in at the next step (thousands of page faults a
    step for a small CNN, 10-40 % of its step time on a virtual machine). The engine calls this before training on
    the CPU. True when applied (Linux with glibc); False elsewhere or when the environment variable
    ``PYFEDKERN_RETAIN_FREED_MEMORY`` is ``0``. The process then holds on to its peak heap memory (up to 1 GiB more).
    """
    if os.environ.get("PYFEDKERN_RETAIN_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no such tunables)
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
