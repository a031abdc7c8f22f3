"""Plots and tables of run metrics (matplotlib, Agg backend: works without a display)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_LABELS = {
    "test_acc": "test accuracy",
    "test_loss": "test loss",
    "train_loss": "train loss (global model)",
    "local_loss": "mean local training loss",
}


def plot_curves(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | Path,
    *,
    metrics: Sequence[str] = ("test_acc", "test_loss"),
    title: str | None = None,
    log_loss: bool = True,
) -> Path:
    """One panel per metric, one line per run, against the round; saves a PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for name, records in runs.items():
            points = [(r["round"], r[metric]) for r in records if _finite(r.get(metric))]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=name, linewidth=1.6)
        ax.set_xlabel("round")
        ax.set_ylabel(_LABELS.get(metric, metric))
        if "loss" in metric and log_loss:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def summary_table(summaries: Mapping[str, Mapping[str, Any]], target: float | None = None) -> str:
    """Markdown table: final / best / mean-of-last-10 test accuracy, rounds to target, traffic and time."""
    head = "| algorithm | final acc | best acc (round) | mean last 10 | rounds to target | uploaded MB | time s |"
    if target is not None:
        head = head.replace("rounds to target", f"rounds to {target:.0%}")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in summaries.items():
        reached = s.get("rounds_to_target")
        lines.append(
            f"| {name} | {_pct(s['final_test_acc'])} | {_pct(s['best_test_acc'])} ({s['best_round']}) "
            f"| {_pct(s['mean_last10_test_acc'])} | {'never' if reached is None else reached} "
            f"| {s['bytes_up'] / 1e6:.1f} | {s['time_total']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _pct(value: float) -> str:
    return "n/a" if not _finite(value) else f"{100 * value:.2f}%"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
