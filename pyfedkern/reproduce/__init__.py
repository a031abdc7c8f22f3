"""Reproductions of the five papers' experiments (``pyfedkern reproduce NAME``).

Each module listed in ``REPRODUCTIONS`` exposes ``main(argv, *, out, quick, docs) -> int``: it runs its experiments
into ``out`` (resuming finished sub-runs), writes ``out/report.md`` with the measured numbers and plots, and, when
``docs`` names a markdown file, replaces that paper's section in it (see :func:`update_docs_section`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPRODUCTIONS: dict[str, str] = {
    "bherd": "pyfedkern.reproduce.bherd",
    "dynamic": "pyfedkern.reproduce.dynamic",
    "fedpbc": "pyfedkern.reproduce.fedpbc",
    "fedspeed": "pyfedkern.reproduce.fedspeed",
    "fnrfl": "pyfedkern.reproduce.fnrfl",
}


def update_docs_section(path: str | Path, name: str, markdown: str) -> None:
    """Replace (or append) the section of ``path`` between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Reproductions\n"
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (NaN for fewer than two values), e.g. of seed-paired differences."""
    arr = np.asarray(values, dtype=np.float64)
    se = float(arr.std(ddof=1) / np.sqrt(arr.size)) if arr.size > 1 else float("nan")
    return float(arr.mean()), se
