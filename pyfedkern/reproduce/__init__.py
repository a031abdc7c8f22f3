"""Reproductions of the five papers' experiments (``pyfedkern reproduce NAME``).

Each module listed in ``REPRODUCTIONS`` (what it runs: ``SUMMARIES``) exposes
``main(argv, *, out, quick, docs) -> int``: it runs its experiments into ``out`` (resuming finished sub-runs), writes
``out/report.md`` with the measured numbers and plots, and, when ``docs`` names a markdown file, replaces that
paper's section in it (see :func:`update_docs_section`).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

REPRODUCTIONS: dict[str, str] = {
    "bherd": "pyfedkern.reproduce.bherd",
    "dynamic": "pyfedkern.reproduce.dynamic",
    "fedpbc": "pyfedkern.reproduce.fedpbc",
    "fedspeed": "pyfedkern.reproduce.fedspeed",
    "fnrfl": "pyfedkern.reproduce.fnrfl",
}

# One line each for `pyfedkern reproduce --help` (which must not import the modules: they import torch).
SUMMARIES: dict[str, str] = {
    "bherd": "BHerd Fig. 3a: FedAvg, BHerd-FedAvg (α = 0.1 … 1) and GraB-FedAvg on the even/odd SVM, "
    "5 clients, data Cases 1-3, 10 seeds",
    "dynamic": "clients arriving and leaving: accuracy after each session change with the similarity-weighted "
    "initial model vs the previous, average and continuous ones; FedAvg and FedProx hosts, 3 seeds",
    "fedpbc": "FedPBC: the quadratic bias experiment (FedAvg's biased limit vs FedPBC) and a table of link "
    "patterns × FedPBC, FedAvg, FedAvg-all, FedAU, known-p and MIFA, 100 clients, 3 seeds",
    "fedspeed": "FedSpeed: rounds to target and final accuracy of FedAvg, FedProx, SCAFFOLD, FedCM, FedAdam, FedDyn, "
    "FedSAM and FedSpeed (3 variants), all as FL-Simulator runs them, 20 clients at 25% participation, 3 seeds",
    "fnrfl": "FNR-FL vs FedAvg and FedProx under feature, label and quantity skew, with an ablation of its "
    "regularizer, 10 clients, 5 seeds",
}


#: What a reproduction says in place of its verdicts when it ran one seed (``--quick``): with one seed a difference
#: between methods cannot be told from seed noise, and there is no spread to show.
ONE_SEED = (
    "**No verdict is drawn from one seed**: with one seed a difference between methods cannot be told from seed "
    "noise, and there is no spread to show. Run with `--seeds 2` or more (the full run's default) for verdicts.\n"
)


def update_docs_section(path: str | Path, name: str, markdown: str) -> None:
    """Replace (or append) the section of ``path`` between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Reproductions\n"
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)


def publish(docs: str | Path, name: str, plots: Sequence[Path], markdown: Callable[[list[str]], str]) -> None:
    """Copy ``plots`` into the ``img`` folder beside ``docs`` (as ``NAME-<file>``) and replace section ``name`` of
    ``docs`` with ``markdown(paths)``, ``paths`` being the copies' names relative to ``docs``."""
    img = Path(docs).parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    paths = []
    for plot in plots:
        shutil.copyfile(plot, img / f"{name}-{Path(plot).name}")
        paths.append(f"img/{name}-{Path(plot).name}")
    update_docs_section(docs, name, markdown(paths))
    print(f"updated the {name} section of {docs}")


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (NaN for fewer than two values), e.g. of seed-paired differences."""
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    se = float(arr.std(ddof=1) / np.sqrt(arr.size)) if arr.size > 1 else float("nan")
    return float(arr.mean()), se
