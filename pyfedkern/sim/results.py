"""On-disk results of a run: what is written, as it is made, so that no work is lost and damage is found.

A run directory holds

- ``config.json``: the run's :class:`~pyfedkern.sim.config.ExperimentConfig`, written when the run starts;
- ``metrics.jsonl``: one JSON object per round, rounds 0, 1, 2, ... in order (round 0 is the initial model),
  appended and flushed as each round ends; undefined values are NaN, as Python's json module writes them;
- ``checkpoints/round_NNNNNN.pt``: the state after round N, every ``checkpoint_every`` rounds, the newest two kept,
  each with ``round_NNNNNN.pt.sha256`` beside it (the SHA-256 of the checkpoint, in ``sha256sum`` format). A
  checkpoint holds its round, the config it was made under and the algorithm's state: tensors, numbers, strings,
  lists and dicts only, loaded with ``torch.load(weights_only=True)``, so no pickled code runs on resume;
- at the end ``model.pt`` (the final global vector: the model's trainable parameters) and ``summary.json`` (written
  last: it marks the run finished);
- ``frozen.pt``, for a model with frozen parameters: their values, written once when the run starts (they never
  change: checkpoints hold the trainable vector only), and checked on resume;
- ``.lock``: the lock of the process writing the directory (:class:`DirectoryLock`), with its PID while it runs.

Every file but metrics.jsonl is written whole to a temporary name and renamed into place, so a killed run leaves
the old file or the new one, never half of one (a checksum is written before its checkpoint: a stop between the two
leaves a checksum without a checkpoint, which is ignored; an interrupted write removes its temporary file, and
resume removes those a ``kill -9`` left). Resuming reads and checks all of it before it changes any file
(:meth:`RunWriter.resume_point`, then :meth:`RunWriter.start_from`). One process at a time writes a run directory:
:class:`RunWriter` holds its lock from start to end.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import itertools
import json
import math
import os
import re
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

_KEEP_CHECKPOINTS = 2
_CHECKPOINT = re.compile(r"round_(\d{6,})\.pt")
_CHECKSUM_LINE = re.compile(r"([0-9a-f]{64})  (\S+)\n?")

#: Config fields that config.json may change between a checkpoint and its resume: where the data is read from and
#: how often checkpoints are made change no recorded number (the thread count does, in the last bits of a loss).
#: ``rounds`` may also change, but not below the last recorded round.
RESUME_FREE_FIELDS = ("checkpoint_every", "data_root", "rounds")


_TMP = ".tmp"  # suffix of the temporary files of _atomic_write


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, synced to disk, then renamed over ``path``; an
    interruption (Ctrl-C, an error) removes the temporary file and leaves ``path`` as it was."""
    tmp = path.with_name(path.name + _TMP)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class DirectoryLocked(OSError):
    """The directory is being written by another process (the message names its PID)."""


class DirectoryLock:
    """An exclusive lock on a directory that one process holds at a time: ``flock`` on the file ``DIR/.lock``,
    which holds the holder's PID and host while it is held (and is empty otherwise).

    The operating system drops the lock when its process ends, however it ends (``kill -9`` too), so the lock of a
    dead process is taken over by the next writer without any guess about whether the PID still runs; the file
    itself is never deleted (deleting it would let two processes lock two different files of the same name).
    ``what`` names the directory in the error, e.g. "run directory".
    """

    NAME = ".lock"

    def __init__(self, directory: str | Path, what: str = "directory") -> None:
        self.path = Path(directory) / self.NAME
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; DirectoryLocked naming the holder when another process holds it, ValueError when the
        lock file cannot be opened."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(f"cannot lock the {self.what} {self.path.parent}: {self.path}: {err.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DirectoryLocked(self._busy()) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def _busy(self) -> str:
        return (
            f"the {self.what} {self.path.parent} is being written by another process ({self.holder()}); wait for "
            "it to end, or stop it, then try again"
        )

    def holder(self, tries: int = 20) -> str:
        """``"PID 1234"`` (with ``on HOST`` when another machine holds it) of the process holding the lock; the
        file is read again for up to ``tries`` × 25 ms while the holder has locked it but not yet written it."""
        for _ in range(tries):
            try:
                pid, _, host = self.path.read_text().strip().partition(" ")
            except (OSError, UnicodeDecodeError):
                pid = host = ""
            if pid.isdigit():
                return f"PID {pid}" + (f" on {host}" if host and host != socket.gethostname() else "")
            time.sleep(0.025)
        return "PID unknown"

    def release(self) -> None:
        """Empty the file and drop the lock (nothing when not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing drops the flock

    def check(self) -> None:
        """DirectoryLocked when another process holds the lock; changes nothing (the probe is a shared lock on the
        file opened for reading, dropped at once)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # no lock file (or none readable): no writer has locked the directory
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise DirectoryLocked(self._busy()) from None
        finally:
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _json_bytes(value: Any, indent: int | None = None) -> bytes:
    return (json.dumps(value, indent=indent) + "\n").encode()


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as JSON gives it back (tuples become lists), so configs compare equal however they were made."""
    return json.loads(json.dumps(config))


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


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__ndarray__"} and isinstance(value["__ndarray__"], torch.Tensor):
            return value["__ndarray__"].numpy()
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """The config.json of ``run_dir`` as a dict (FileNotFoundError when there is none; ValueError naming the file
    and line when it is not a JSON object)."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in {run_dir}: not a pyfedkern run directory")
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not text: byte {err.start} is not UTF-8") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: line {err.lineno} is not valid JSON ({err.msg})") from None
    if not isinstance(data, dict):
        found = _JSON_TYPES.get(type(data), "null")
        raise ValueError(f"{path} must hold a JSON object (the run's config), it holds {found}")
    return data


def config_differences(run_dir: str | Path, config: dict[str, Any]) -> list[str]:
    """The fields in which ``config`` differs from the config.json stored in ``run_dir`` (which must exist)."""
    stored, wanted = read_config(run_dir), _plain(config)
    return sorted(k for k in set(stored) | set(wanted) if stored.get(k) != wanted.get(k))


def is_finished(run_dir: str | Path) -> bool:
    """Whether the run in ``run_dir`` ran to its end (summary.json, written last, exists)."""
    return (Path(run_dir) / "summary.json").exists()


@dataclass
class ResumePoint:
    """Where a resumed run goes on: from ``checkpoint`` (its ``state``, read and checked), or from round 0 when
    the run has no checkpoint yet (both None). ``metrics``: the records of rounds 0..the checkpoint's round (empty
    without a checkpoint); ``damaged``: the checkpoints that failed their checks, with the reason."""

    checkpoint: Path | None
    state: dict[str, Any] | None
    metrics: list[dict[str, Any]]
    damaged: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def round(self) -> int:
        """The last round done (0 without a checkpoint: the run starts again with round 0)."""
        return 0 if self.state is None else int(self.state["round"])


class RunWriter:
    """Writes one run directory, holding its lock (:class:`DirectoryLock`) until :meth:`close` (or the end of a
    ``with`` block). A fresh run creates the directory and refuses one that already holds a run; ``resume`` reopens
    a run whose config.json must equal ``config`` but for :data:`RESUME_FREE_FIELDS`: an unfinished run, or a
    finished one that ``config`` gives more rounds (it is extended). Then call :meth:`resume_point` and
    :meth:`start_from`. DirectoryLocked when another process writes the directory."""

    def __init__(self, out_dir: str | Path, config: dict[str, Any], *, resume: bool = False) -> None:
        _check_named(out_dir)
        self.dir = Path(out_dir)
        self.config = _plain(config)
        self._lock = DirectoryLock(self.dir, "run directory")
        config_path = self.dir / "config.json"
        if resume:
            if not config_path.exists():
                raise FileNotFoundError(f"cannot resume: {config_path} does not exist")
            for path in (self.dir, self.checkpoint_dir, self.metrics_path):
                if path.exists() and not os.access(path, os.W_OK):
                    raise ValueError(f"cannot resume {self.dir}: {path} cannot be written (permission denied)")
            self._lock.acquire()
            try:
                self._check_resumable()
            except BaseException:
                self._lock.release()
                raise
        else:
            check_new_run_dir(self.dir)
            _make_run_dir(self.dir)
            self._lock.acquire()
            try:
                _check_holds_no_run(self.dir)  # again, now that no other writer can come in between
                _atomic_write(config_path, _json_bytes(self.config, indent=2))
                self.checkpoint_dir.mkdir(exist_ok=True)
            except BaseException:
                self._lock.release()
                raise

    def _check_resumable(self) -> None:
        """ValueError/FileExistsError unless the run may go on under ``self.config`` (see the class)."""
        changed = config_differences(self.dir, self.config)
        fixed = [k for k in changed if k not in RESUME_FREE_FIELDS]
        if fixed:
            raise ValueError(f"cannot resume {self.dir}: the config differs in {', '.join(fixed)}")
        if is_finished(self.dir) and self.config["rounds"] <= len(self.read_metrics()) - 1:
            raise FileExistsError(
                f"nothing to resume: the run in {self.dir} is already finished (see its summary.json); "
                f"to extend it, give it more rounds (--rounds)"
            )

    def close(self) -> None:
        """Release the directory's lock."""
        self._lock.release()

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"

    def append_metrics(self, record: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.dir)

    def save_checkpoint(self, state: dict[str, Any]) -> Path:
        """Write ``state`` (with its "round") as the checkpoint of that round, its checksum first; keep the
        newest two checkpoints."""
        path = self.checkpoint_dir / f"round_{int(state['round']):06d}.pt"
        buffer = io.BytesIO()
        torch.save(_encode(state), buffer)
        data = buffer.getvalue()
        _atomic_write(_checksum_path(path), f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())
        _atomic_write(path, data)
        for _, old in self._checkpoints()[_KEEP_CHECKPOINTS:]:
            for file in (old, _checksum_path(old)):
                if file.is_file():
                    file.unlink()
        return path

    def _checkpoints(self) -> list[tuple[int, Path]]:
        """(round, path) of the files named like checkpoints, newest first."""
        if not self.checkpoint_dir.is_dir():
            return []
        found = [(_CHECKPOINT.fullmatch(p.name), p) for p in self.checkpoint_dir.iterdir()]
        return sorted(((int(m.group(1)), p) for m, p in found if m), reverse=True)

    def resume_point(self) -> ResumePoint:
        """Read and check what the interrupted run left, changing nothing; return where it goes on.

        metrics.jsonl must be whole (but for a half-written last line) and ``rounds`` at least its last round.
        Checkpoints are tried newest first: one that is not a file, does not match its checksum, does not load or
        is not a checkpoint of its round is damaged, and the next older one is tried. The newest intact one must
        have been made under the same config (but for :data:`RESUME_FREE_FIELDS`) and its rounds must all be in
        metrics.jsonl. Raises ValueError naming the problem otherwise, and when every checkpoint is damaged.
        """
        metrics = self.read_metrics()
        rounds, recorded = self.config["rounds"], len(metrics) - 1
        if recorded > rounds:
            raise ValueError(
                f"cannot resume {self.dir}: config.json asks for {rounds} rounds, but {self.metrics_path.name} has "
                f"recorded {recorded}; a run cannot be cut below a recorded round (set rounds to {recorded} or more)"
            )
        if self.checkpoint_dir.exists() and not self.checkpoint_dir.is_dir():
            raise ValueError(f"cannot resume {self.dir}: {self.checkpoint_dir} is not a directory")
        damaged: list[tuple[Path, str]] = []
        for number, path in self._checkpoints():
            try:
                state = _read_checkpoint(path, number)
            except _Damaged as err:
                damaged.append((path, str(err)))
                continue
            self._check_fingerprint(path, state["config"])
            if number > recorded:
                holds = f"ends at round {recorded}" if metrics else "holds no round"
                raise ValueError(
                    f"cannot resume {self.dir}: {self.metrics_path.name} should hold rounds 0..{number} (those of "
                    f"checkpoint {path.name}) but {holds}; its records of the later rounds are lost"
                )
            return ResumePoint(path, state, metrics[: number + 1], damaged)
        if damaged:
            listing = "; ".join(f"{p.name}: {reason}" for p, reason in damaged)
            raise ValueError(
                f"cannot resume {self.dir}: no intact checkpoint is left ({listing}). To run it again from round 0, "
                f"delete {self.checkpoint_dir}"
            )
        return ResumePoint(None, None, [], [])

    def _check_fingerprint(self, path: Path, made_under: Any) -> None:
        """ValueError unless config.json equals the config checkpoint ``path`` was made under, but for
        :data:`RESUME_FREE_FIELDS`."""
        changed = [
            f"{k} ({json.dumps(made_under.get(k))} -> {json.dumps(self.config.get(k))})"
            for k in sorted(set(made_under) | set(self.config))
            if k not in RESUME_FREE_FIELDS and made_under.get(k) != self.config.get(k)
        ]
        if changed:
            raise ValueError(
                f"cannot resume {self.dir}: its config.json was changed after checkpoint {path.name} was made; "
                f"it differs in {', '.join(changed)}. Put the old values back, or start a new run elsewhere"
            )

    def start_from(self, point: ResumePoint) -> list[dict[str, Any]]:
        """Go on from ``point`` (of :meth:`resume_point`): set its damaged checkpoints aside (renamed, never
        deleted) and say so in a warning, remove temporary files a killed write left, write the new config.json
        when ``config`` changed a free field (a finished run being extended loses its summary.json and model.pt
        first), and cut metrics.jsonl back to ``point.metrics``, which are returned."""
        if point.damaged:
            moved = ", ".join(f"{p.name} ({reason}) -> {_set_aside(p).name}" for p, reason in point.damaged)
            warnings.warn(
                f"damaged checkpoint(s) in {self.checkpoint_dir} set aside: {moved}; resuming from "
                f"{point.checkpoint.name} (round {point.round})",
                stacklevel=2,
            )
        for leftover in [*self.dir.glob(f"*{_TMP}"), *self.checkpoint_dir.glob(f"*{_TMP}")]:
            leftover.unlink()  # what a kill -9 during a write left: never renamed into place, so never used
        if read_config(self.dir) != self.config:  # rounds, checkpoint_every or data_root given anew
            for done in ("summary.json", "model.pt"):  # summary.json first: it marks the run finished
                (self.dir / done).unlink(missing_ok=True)
            _atomic_write(self.dir / "config.json", _json_bytes(self.config, indent=2))
        self.checkpoint_dir.mkdir(exist_ok=True)
        _atomic_write(self.metrics_path, b"".join(_json_bytes(m) for m in point.metrics))
        return list(point.metrics)

    def finish(self, metrics: list[dict[str, Any]], model: torch.Tensor) -> None:
        """Write model.pt, then summary.json (last: it marks the run finished)."""
        buffer = io.BytesIO()
        torch.save({"x": model.detach().cpu().clone()}, buffer)
        _atomic_write(self.dir / "model.pt", buffer.getvalue())
        _atomic_write(self.dir / "summary.json", json.dumps(summarize(metrics), indent=2).encode())


class _Damaged(Exception):
    """A checkpoint file failed its checks (the message says which)."""


def _checksum_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".sha256")


def _read_checkpoint(path: Path, number: int) -> dict[str, Any]:
    """The state in checkpoint ``path`` of round ``number`` (from its name), checked against its checksum file and
    for its round and config; _Damaged saying what is wrong otherwise."""
    if not path.is_file():
        raise _Damaged("not a file")
    checksum = _checksum_path(path)
    try:
        line = _CHECKSUM_LINE.fullmatch(checksum.read_text(encoding="ascii"))
        data = path.read_bytes()
    except FileNotFoundError:
        raise _Damaged(f"its checksum file {checksum.name} is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise _Damaged(f"cannot be read ({type(err).__name__})") from None
    if line is None or line.group(2) != path.name:
        raise _Damaged(f"its checksum file {checksum.name} is malformed")
    if hashlib.sha256(data).hexdigest() != line.group(1):
        raise _Damaged(f"its {len(data)} bytes do not match the SHA-256 in {checksum.name}")
    try:  # torch's own words stay unsaid (its error advises loading with weights_only=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = _decode(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True))
    except Exception:
        raise _Damaged("not a checkpoint torch can load safely") from None
    if not (isinstance(state, dict) and {"round", "config", "algorithm"} <= set(state)):
        raise _Damaged("not a pyfedkern checkpoint (it lacks round, config or algorithm)")
    made_under, done = state["config"], state["round"]
    if isinstance(done, bool) or not isinstance(done, int) or done != number or done < 1:
        raise _Damaged(f"it says round {done!r}, its name round {number}")
    rounds = made_under.get("rounds") if isinstance(made_under, dict) else None
    if isinstance(rounds, bool) or not isinstance(rounds, int) or done > rounds:
        raise _Damaged(f"its config is not one of a run of {done} rounds or more")
    return state


def _set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint (file or whatever stands in its place) and its checksum file to
    NAME.damaged (NAME.damaged.1, ... when taken); return the checkpoint's new path."""
    for n in itertools.count():
        target = path.with_name(f"{path.name}.damaged" + (f".{n}" if n else ""))
        if not (target.exists() or target.is_symlink() or _checksum_path(target).exists()):
            break
    if _checksum_path(path).exists():
        os.rename(_checksum_path(path), _checksum_path(target))
    os.rename(path, target)
    return target


def check_new_run_dir(out_dir: str | Path) -> None:
    """Raise unless a new run can be written to ``out_dir``, changing nothing: FileExistsError when it holds a run
    already, ValueError when it is empty, or it or the nearest of its parents that exists is a file or cannot be
    written, and DirectoryLocked when another process is writing it."""
    _check_named(out_dir)
    path = Path(out_dir)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"cannot create the run directory {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot create the run directory {path}: {existing} cannot be written (permission denied)")
    DirectoryLock(path, "run directory").check()
    _check_holds_no_run(path)


FINGERPRINT = "fingerprint.json"
FROZEN = "frozen.pt"

#: What a run writes into its directory: a new run refuses a directory that holds any of them (a run, or the user's
#: own files of those names, which it would overwrite).
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints", "model.pt", "summary.json", FINGERPRINT, FROZEN)


def _check_holds_no_run(path: Path) -> None:
    if (path / "metrics.jsonl").exists():
        raise FileExistsError(f"{path} already holds a run; resume it or choose another output directory")
    present = [name for name in RUN_FILES if (path / name).exists()]
    if present:
        raise FileExistsError(
            f"{path} already holds {_listed(present)}, which a new run would overwrite; choose another output "
            "directory (or resume the run there, if it is one)"
        )


def _check_named(out_dir: str | Path) -> None:
    """ValueError when ``out_dir`` is an empty string (which would mean the current directory)."""
    if isinstance(out_dir, str) and not out_dir.strip():
        raise ValueError(f"the run directory is {out_dir!r}: name a directory (--out DIR)")


def _make_run_dir(path: Path) -> None:
    """Create run directory ``path`` and its parents (:func:`check_new_run_dir` passed); ValueError saying why when
    the system still refuses."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create the run directory {path}: {err.strerror}") from None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-round records of a run directory: rounds 0, 1, 2, ... in order.

    A last line that does not parse is dropped: a run killed while appending a record leaves half a line. Any other
    line that is not UTF-8 text, not JSON, or not an object holding the next round as an integer "round" raises
    ValueError naming the file and line.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    lines = [(number, line) for number, line in enumerate(path.read_bytes().split(b"\n"), 1) if line.strip()]
    records: list[dict[str, Any]] = []
    for number, line in lines:
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise ValueError(f"{path}: line {number} is not text (not UTF-8): {line[:40]!r}") from None
        except json.JSONDecodeError:
            if number == lines[-1][0]:
                break
            raise ValueError(f"{path}: line {number} is not valid JSON: {line[:80].decode()!r}") from None
        done = record.get("round") if isinstance(record, dict) else None
        if isinstance(done, bool) or not isinstance(done, int):
            raise ValueError(f'{path}: line {number} is not a round\'s record (a JSON object with an integer "round")')
        if done != len(records):
            raise ValueError(f"{path}: line {number} holds round {done}, expected round {len(records)}")
        records.append(record)
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
    spent = [m["dp_epsilon"] for m in metrics if "dp_epsilon" in m]
    if spent:  # central DP: the privacy budget spent by the whole run
        out["dp_epsilon"] = spent[-1]
    if target is not None:
        out["target"] = target
        out["rounds_to_target"] = next((m["round"] for m in evals if m["test_acc"] >= target), None)
    return out


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def write_fingerprint(run_dir: str | Path, digests: dict[str, str]) -> None:
    """Keep the digests of a run's model structure, data and split in ``run_dir``/fingerprint.json."""
    _atomic_write(Path(run_dir) / FINGERPRINT, _json_bytes(digests, indent=2))


def check_fingerprint(run_dir: str | Path, digests: dict[str, str], action: str = "resume") -> None:
    """ValueError naming what changed when ``digests`` differ from those kept in ``run_dir``, which is about to be
    resumed or reused (``action``); a run without fingerprint.json, or a digest it lacks, is not checked."""
    path = Path(run_dir) / FINGERPRINT
    if not path.exists():
        return
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot {action} {run_dir}: {path} is not readable JSON ({err})") from None
    if not isinstance(stored, dict):
        raise ValueError(f"cannot {action} {run_dir}: {path} does not hold the run's digests")
    changed = [key for key, value in digests.items() if key in stored and stored[key] != value]
    if changed:
        raise ValueError(
            f"cannot {action} {run_dir}: {_listed(['the ' + c for c in changed])} "
            f"{'differ' if len(changed) > 1 else 'differs'} from the run's (see {FINGERPRINT}); "
            f"{action} it with the same model, data and split, or start a new run"
        )


def write_frozen(run_dir: str | Path, frozen: dict[str, torch.Tensor]) -> None:
    """Keep a model's frozen parameters {name: tensor} in ``run_dir``/frozen.pt (nothing when there are none)."""
    if frozen:
        buffer = io.BytesIO()
        torch.save({name: value.detach().cpu().clone() for name, value in frozen.items()}, buffer)
        _atomic_write(Path(run_dir) / FROZEN, buffer.getvalue())


def check_frozen(run_dir: str | Path, frozen: dict[str, torch.Tensor], action: str = "resume") -> None:
    """ValueError naming the first frozen parameter of ``frozen`` {name: tensor} whose name, shape or values differ
    from those kept in ``run_dir``/frozen.pt (none kept: the run's model had no frozen parameter)."""
    path = Path(run_dir) / FROZEN
    try:
        stored = torch.load(path, weights_only=True) if path.exists() else {}
    except Exception as err:  # a damaged file: torch raises several types
        raise ValueError(f"cannot {action} {run_dir}: {path} is not readable ({type(err).__name__})") from None
    if not isinstance(stored, dict) or stored.keys() != frozen.keys():
        held = ", ".join(map(str, stored)) if isinstance(stored, dict) and stored else "none"
        raise ValueError(
            f"cannot {action} {run_dir}: the run's frozen parameters ({held}) are not the model's "
            f"({', '.join(frozen) or 'none'})"
        )
    for name, value in frozen.items():
        kept = stored[name]
        if not isinstance(kept, torch.Tensor) or not torch.equal(kept, value.detach().cpu()):
            raise ValueError(
                f"cannot {action} {run_dir}: the frozen parameter {name} differs from the run's ({path}); "
                f"{action} it with the same model"
            )


def _listed(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
