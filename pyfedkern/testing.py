"""Helpers for testing pyfedkern ops: array factories over numpy/torch/cupy and per-dtype tolerances."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

# Max error allowed relative to Σ|w_k·u_k| (the scale of the rounding) for each storage dtype.
REL_TOL = {"float64": 1e-13, "float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}

LIBS_CPU = ("numpy", "torch")
DTYPES = ("float32", "float64", "float16", "bfloat16")


def supports(lib: str, dtype: str) -> bool:
    return not (lib == "numpy" and dtype == "bfloat16")


def make(lib: str, values: np.ndarray, dtype: str, device: str = "cpu"):
    """values (float64 numpy) as an array of ``lib`` with ``dtype`` on ``device``."""
    if lib == "numpy":
        return values.astype(dtype)
    if lib == "torch":
        return torch.tensor(np.ascontiguousarray(values)).to(device=device, dtype=getattr(torch, dtype))
    import cupy

    return cupy.asarray(values.astype(dtype))


def to_numpy64(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return x.get().astype(np.float64)


def lib_of(x) -> str:
    return type(x).__module__.split(".")[0]


def dtype_of(x) -> str:
    return str(x.dtype).removeprefix("torch.")


def written_after_sleep(stream, src: torch.Tensor) -> torch.Tensor:
    """A copy of the CUDA tensor ``src`` written on ``stream`` behind about half a second of GPU sleep.

    An op called on ``stream`` with this copy gives the right answer only if its kernels run on ``stream``: work
    queued on any other stream would run during the sleep and read the zeros that are there before the copy.
    """
    dst = torch.zeros_like(src)
    stream.wait_stream(torch.cuda.current_stream())  # the zeros are in place before the sleep starts
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1 << 30)
        dst.copy_(src)
    return dst


def _pool_switches() -> int:
    """Context switches so far of pyfedkern's CPU pool workers (the threads named "pyfedkern"; Linux /proc)."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "pyfedkern":
                continue
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        total += sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
    return total


def _settled_switches(quiet: float = 0.1, timeout: float = 10.0) -> int:
    """The workers' switch count once it has not changed for ``quiet`` seconds (a late wake-up has finished)."""
    end = time.monotonic() + timeout
    count = _pool_switches()
    while time.monotonic() < end:
        time.sleep(quiet)
        now = _pool_switches()
        if now == count:
            return count
        count = now
    return count


@contextlib.contextmanager
def pool_wakes(expected: bool) -> Iterator[None]:
    """Asserts that the block woke (or started) pyfedkern's CPU pool workers, or, with ``expected=False``, that it
    woke none: small inputs must run on the calling thread. Linux only (checks nothing elsewhere)."""
    if not Path("/proc/self/task").is_dir():
        yield
        return
    before = _settled_switches()
    yield
    if expected:
        end = time.monotonic() + 10.0
        while _pool_switches() == before and time.monotonic() < end:
            time.sleep(0.01)
        assert _pool_switches() > before, "no pyfedkern pool worker ran"
    else:
        assert _settled_switches() == before, "a pyfedkern pool worker was woken"
