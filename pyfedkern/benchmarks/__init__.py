"""Benchmark cases of every op family, shared by the pytest-benchmark suites in bench/ and ``pyfedkern bench``.

Each family module defines ``cases(quick, device) -> list[Case]``: for each input size one *group* of cases that
compute the same thing (pyfedkern, the peers users run today) plus the machine's limit measured on the same bytes
(a copy or sum for memory-bound ops, a GEMM for compute-bound ones). Reports compare ratios within a group.
"""

from typing import Any

#: family name → module under pyfedkern.benchmarks ("flower" has no cases without flwr installed)
FAMILIES = [
    "aggregate",
    "compile",
    "dp",
    "dpsgd",
    "engine",
    "engine_models",
    "fedspeed",
    "flower",
    "herding",
    "norms",
    "pbc",
    "sampling",
    "shared_cpu",
    "similarity",
]

__all__ = ["FAMILIES", "Case", "InputCache"]


def __getattr__(name: str) -> Any:
    """Case and InputCache on first use: FAMILIES stays importable without torch (``pyfedkern bench --help``)."""
    if name in ("Case", "InputCache"):
        from pyfedkern.benchmarks import common

        return getattr(common, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
