"""On-disk results of a run: what is written, as it is made, so no work is lost.

A run directory holds ``config.json``; ``metrics.jsonl`` (one JSON object per round, appended and flushed each
round; undefined values are NaN, as Python's json module writes them); ``checkpoints/round_NNNNNN.pt`` (the
latest two, written atomically); and at the end ``summary.json`` and ``model.pt`` (the final global vector).
Checkpoints hold only tensors, numbers, strings, lists and dicts, and load with ``torch.load(weights_only=True)``:
no pickled code runs when a run is resumed.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

_KEEP_CHECKPOINTS = 2


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _encode(value: Any) -> Any:
    """Make checkpoint state weights_only-loadable: numpy arrays become tagged tensors."""
    if isinstance(value, np.ndarray):
        return {"__ndarray__": torch.from_numpy(np.ascontiguousarray(value))}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint state may hold tensors, arrays, numbers, strings, lists and dicts, not {type(value)}")


def _decode(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__ndarray__"}:
            return value["__ndarray__"].numpy()
        return {k: _decode(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, device) for v in value]
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return value


def config_differences(run_dir: str | Path, config: dict[str, Any]) -> list[str]:
    """The fields in which ``config`` differs from the config.json stored in ``run_dir`` (which must exist)."""
    stored = json.loads((Path(run_dir) / "config.json").read_text())
    wanted = json.loads(json.dumps(config))
    return sorted(k for k in set(stored) | set(wanted) if stored.get(k) != wanted.get(k))


def is_finished(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` ran to its end (summary.json, written last, exists)."""
    return (Path(run_dir) / "summary.json").exists()


class RunWriter:
    """Writes one run directory; with ``resume`` it reopens an unfinished one whose config must match."""

    def __init__(self, out_dir: str | Path, config: dict[str, Any], *, resume: bool = False) -> None:
        self.dir = Path(out_dir)
        self.config = config
        config_path = self.dir / "config.json"
        if resume:
            if not config_path.exists():
                raise FileNotFoundError(f"cannot resume: {config_path} does not exist")
            changed = config_differences(self.dir, config)
            if changed:
                raise ValueError(f"cannot resume {self.dir}: the config differs in {', '.join(changed)}")
            if is_finished(self.dir):
                raise FileExistsError(
                    f"nothing to resume: the run in {self.dir} is already finished (see its summary.json)"
                )
        else:
            if (self.dir / "metrics.jsonl").exists():
                raise FileExistsError(f"{self.dir} already holds a run; resume it or choose another output directory")
            self.dir.mkdir(parents=True, exist_ok=True)
            _atomic_write(config_path, lambda p: p.write_text(json.dumps(config, indent=2) + "\n"))
        (self.dir / "checkpoints").mkdir(exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.dir)

    def truncate_metrics(self, rounds_done: int) -> list[dict[str, Any]]:
        """Keep the records of rounds 0..rounds_done (drop what an interrupted run wrote after its checkpoint,
        including a half-written last line); they must all be there."""
        kept = [m for m in self.read_metrics() if m["round"] <= rounds_done]
        if [m["round"] for m in kept] != list(range(rounds_done + 1)):
            raise ValueError(
                f"cannot resume {self.dir}: {self.metrics_path.name} should hold rounds 0..{rounds_done} "
                f"(the last checkpoint), found {[m['round'] for m in kept]}"
            )
        _atomic_write(self.metrics_path, lambda p: p.write_text("".join(json.dumps(m) + "\n" for m in kept)))
        return kept

    def save_checkpoint(self, state: dict[str, Any]) -> Path:
        path = self.dir / "checkpoints" / f"round_{int(state['round']):06d}.pt"
        _atomic_write(path, lambda p: torch.save(_encode(state), p))
        for old in sorted((self.dir / "checkpoints").glob("round_*.pt"))[:-_KEEP_CHECKPOINTS]:
            old.unlink()
        return path

    def load_checkpoint(self, device: torch.device | str = "cpu") -> dict[str, Any] | None:
        """The newest checkpoint's state, or None when the run has none yet (it then restarts from round 0)."""
        found = sorted((self.dir / "checkpoints").glob("round_*.pt"))
        if not found:
            return None
        return _decode(torch.load(found[-1], map_location="cpu", weights_only=True), device)

    def finish(self, metrics: list[dict[str, Any]], model: torch.Tensor) -> None:
        """Write model.pt, then summary.json (last: it marks the run finished)."""
        _atomic_write(self.dir / "model.pt", lambda p: torch.save({"x": model.detach().cpu().clone()}, p))
        _atomic_write(self.dir / "summary.json", lambda p: p.write_text(json.dumps(summarize(metrics), indent=2)))


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-round records of a run directory.

    A last line that does not parse is dropped: a run killed while appending a record leaves half a line.
    Any other unparsable line raises ValueError.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {line[:80]!r}") from None
    return records


def summarize(metrics: list[dict[str, Any]], target: float | None = None) -> dict[str, Any]:
    """Final and best test accuracy, first round reaching ``target``, totals of traffic and time."""
    evals = [m for m in metrics if _finite(m.get("test_acc"))]
    best = max(evals, key=lambda m: m["test_acc"], default=None)
    out: dict[str, Any] = {
        "rounds": max((m["round"] for m in metrics), default=0),
        "final_test_acc": evals[-1]["test_acc"] if evals else math.nan,
        "final_test_loss": evals[-1].get("test_loss", math.nan) if evals else math.nan,
        "best_test_acc": best["test_acc"] if best else math.nan,
        "best_round": best["round"] if best else None,
        "mean_last10_test_acc": float(np.mean([m["test_acc"] for m in evals[-10:]])) if evals else math.nan,
        "bytes_up": int(sum(m.get("bytes_up", 0) for m in metrics)),
        "bytes_down": int(sum(m.get("bytes_down", 0) for m in metrics)),
        "time_total": float(sum(m.get("time_round", 0.0) for m in metrics)),
    }
    if target is not None:
        out["target"] = target
        out["rounds_to_target"] = next((m["round"] for m in evals if m["test_acc"] >= target), None)
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
