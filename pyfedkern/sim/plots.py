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


# Line style and marker of the i-th run: (_MARKERS[i % 8], _LINESTYLES[(i + i // 8) % 4]) differ for 32 runs, so a
# run whose curve lies on another's stays visible (and the legend says which coincide, see coinciding_runs).
_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_MARKS_PER_CURVE = 8


def plot_curves(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | Path,
    *,
    metrics: Sequence[str] = ("test_acc", "test_loss"),
    title: str | None = None,
    log_loss: bool = True,
) -> Path:
    """One panel per metric, one line per run, against the round; saves a PNG and returns its path.

    Every run has its own line style and marker (markers staggered between runs), and a run whose curves coincide
    with an earlier run's on every panel is labelled ``"name (= other)"`` or ``"name (≈ other)"``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    same = coinciding_runs(runs, metrics, log_loss=log_loss)
    labels = {
        name: f"{name} ({'=' if exact else '≈'} {other})" if other else name for name, (other, exact) in same.items()
    }
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        for i, (name, records) in enumerate(runs.items()):
            points = [(r["round"], r[metric]) for r in records if _finite(r.get(metric))]
            if points:
                xs, ys = zip(*points, strict=True)
                step = max(1, len(xs) // _MARKS_PER_CURVE)
                ax.plot(
                    xs,
                    ys,
                    label=labels[name],
                    linewidth=1.6,
                    linestyle=_LINESTYLES[(i + i // len(_MARKERS)) % len(_LINESTYLES)],
                    marker=_MARKERS[i % len(_MARKERS)],
                    markersize=4,
                    markevery=(i * step // len(runs), step),
                )
        ax.set_xlabel("round")
        ax.set_ylabel(_LABELS.get(metric, metric))
        if _log_scale(metric, log_loss):
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


def coinciding_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    metrics: Sequence[str],
    *,
    log_loss: bool = True,
    tolerance: float = 0.01,
) -> dict[str, tuple[str | None, bool]]:
    """For each run, the first earlier run whose curve it would hide on every panel of :func:`plot_curves`, and
    whether the two are exactly equal: ``name → (other or None, exact)``.

    Two curves coincide on a panel when they have values at the same rounds and differ by at most ``tolerance``
    of the panel's height (the range of every run's values; in log10 on a log-scaled loss panel).
    """
    curves = {
        metric: {name: _panel_curve(records, metric, log_loss) for name, records in runs.items()} for metric in metrics
    }
    heights = {}
    for metric, by_run in curves.items():
        values = [y for curve in by_run.values() for y in curve.values()]
        heights[metric] = (max(values) - min(values) if values else 0.0) or 1.0
    out: dict[str, tuple[str | None, bool]] = {}
    names = list(runs)
    for i, name in enumerate(names):
        out[name] = (None, False)
        for other in names[:i]:
            pairs = [(curves[m][name], curves[m][other], m) for m in metrics if curves[m][name] or curves[m][other]]
            if pairs and all(a.keys() == b.keys() for a, b, _ in pairs):
                gap = max(abs(a[k] - b[k]) / heights[m] for a, b, m in pairs for k in a)
                if gap <= tolerance:
                    out[name] = (other, all(a == b for a, b, _ in pairs))
                    break
    return out


def _log_scale(metric: str, log_loss: bool) -> bool:
    return "loss" in metric and log_loss


def _panel_curve(records: Sequence[Mapping[str, Any]], metric: str, log_loss: bool) -> dict[int, float]:
    """round → y position on the metric's panel (log10 on a log-scaled panel) of the values that are drawn."""
    points = {r["round"]: r[metric] for r in records if _finite(r.get(metric))}
    if _log_scale(metric, log_loss):
        return {k: math.log10(v) for k, v in points.items() if v > 0}
    return points


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
