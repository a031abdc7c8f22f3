"""Run several algorithms on the same data split and seed, then plot and tabulate them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pyfedkern.sim.checkpoints import check_reusable
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import run_or_reuse
from pyfedkern.sim.plots import plot_curves, summary_table
from pyfedkern.sim.results import DirectoryLock, summarize


@dataclasses.dataclass
class Comparison:
    """Per-algorithm metrics and summaries, and the files written."""

    metrics: dict[str, list[dict[str, Any]]]
    summaries: dict[str, dict[str, Any]]
    plot: Path
    table: Path


def compare(
    base: ExperimentConfig,
    algorithms: Sequence[str],
    out_dir: str | Path,
    *,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    target: float | None = None,
    progress: bool = False,
    callbacks: Sequence[Any] = (),
) -> Comparison:
    """Run each algorithm with ``base``'s data, partition, model and seed into ``out_dir/<algorithm>``.

    A finished sub-run (summary.json present) is reused (extended when ``base`` has more rounds) and an interrupted
    one resumed, so an interrupted comparison picks up where it stopped; a sub-run made with a different config
    raises ValueError before anything runs. One comparison at a time writes ``out_dir`` (it holds the directory's
    lock; another raises :class:`~pyfedkern.sim.results.DirectoryLocked` naming its PID). Writes ``compare.png``
    (accuracy and loss against round) and ``compare.md`` (final/best accuracy and rounds to ``target``). Each
    sub-run that runs calls ``callbacks`` (:class:`~pyfedkern.sim.callbacks.Callback` instances, one after another
    run: e.g. the loggers of :mod:`pyfedkern.sim.loggers`, each logging into its sub-run's directory).
    """
    if not algorithms:
        raise ValueError("algorithms is empty: name at least one algorithm")
    if len(set(algorithms)) != len(algorithms):
        raise ValueError(f"algorithms has duplicates: {list(algorithms)}")
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1):
        raise ValueError(f"target must be an accuracy in (0, 1], e.g. 0.85, got {target!r}")
    params = params or {}
    configs = {
        name: dataclasses.replace(base, algorithm=name, algorithm_params=dict(params.get(name, {})))
        for name in algorithms
    }
    for config in configs.values():
        config.validate()
    if isinstance(out_dir, str) and not out_dir.strip():
        raise ValueError(f"out_dir is {out_dir!r}: name a directory (--out DIR)")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create the comparison directory {out}: {err.strerror}") from None
    with DirectoryLock(out, "comparison directory"):  # one comparison at a time writes out_dir
        for name, config in configs.items():
            check_reusable(config, out / name)  # every sub-run checked before any runs
        metrics = {
            name: run_or_reuse(config, out / name, progress=progress, callbacks=callbacks)
            for name, config in configs.items()
        }
        summaries = {name: summarize(m, target) for name, m in metrics.items()}
        title = f"{base.dataset}, {base.partition}, {base.clients} clients, model {base.model}"
        plot = plot_curves(metrics, out / "compare.png", title=title)
        table = out / "compare.md"
        table.write_text(f"# {title}\n\n" + summary_table(summaries, target))
        (out / "compare.json").write_text(json.dumps(summaries, indent=2))
    return Comparison(metrics, summaries, plot, table)
