"""Benchmark cases of every op family, shared by the pytest-benchmark suites in bench/ and ``pyfedkern bench``.

Each family module defines ``cases(quick, device) -> list[Case]``: for each input size one *group* of cases that
compute the same thing (pyfedkern, the peers users run today) plus the machine's limit measured on the same bytes
(a copy or sum for memory-bound ops, a GEMM for compute-bound ones). Reports compare ratios within a group.
"""

from pyfedkern.benchmarks.common import Case, InputCache

#: family name → module under pyfedkern.benchmarks ("flower" has no cases without flwr installed)
FAMILIES = [
    "aggregate",
    "compile",
    "engine",
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
