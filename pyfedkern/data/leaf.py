"""LEAF's federated datasets (FEMNIST, Shakespeare, Sent140) from the JSON files the user has made with LEAF's
scripts; nothing is downloaded.

Layout: a folder with ``train/`` and ``test/`` (or ``data/train/`` and ``data/test/``) holding ``*.json`` files, each
``{"users": [u, ...], "num_samples": [n_u, ...], "user_data": {u: {"x": [...], "y": [...]}}}``: distinct user
names, one count per user (optional), and each user's n_u samples under its name. The training samples keep their
writer/speaker/user as ``client_ids`` (the natural split: partition ``natural``); the test files are pooled into one
test set. How x is read depends on the data (``kind``, found from the first sample by default):

- ``femnist``: each x 784 numbers (the first x being so is how FEMNIST is recognised) → float32 [n, 1, 28, 28]; y
  int class labels in 0..61 (62 classes).
- ``numeric``: each x a list of numbers of another length → float32 [n, d]; y int class labels, the number of
  classes the largest label (of train and test) + 1. ``kind="numeric"`` reads 784 numbers so too, as [n, 1, 28, 28].
- ``shakespeare``: each x a string of characters, y the next character → int64 [n, len] indices into LEAF's
  80-character alphabet :data:`SHAKESPEARE_LETTERS`, y the next character's index (80 classes).
- ``sent140``: each x ``[id, date, query, user, text]``, y 0/1 → the text's words as int64 [n, 25] indices into a
  vocabulary of the training set's most frequent words (0 padding, 1 unknown), 2 classes.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyfedkern.data.dataset import Dataset

#: LEAF's Shakespeare alphabet (``leaf/models/utils/language_utils.py``): a character's index is its class.
SHAKESPEARE_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
KINDS = ("auto", "femnist", "numeric", "shakespeare", "sent140")
_WORDS = re.compile(r"[\w']+|[.,!?;]")


def load_leaf(
    root: str | Path, *, kind: str = "auto", sequence_length: int = 25, vocabulary_size: int = 10_000
) -> Dataset:
    """The LEAF dataset in ``root`` (see the module doc); ``sequence_length`` and ``vocabulary_size`` are for
    Sent140's word sequences."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    base = Path(root).expanduser()
    folder = next((f for f in (base, base / "data") if (f / "train").is_dir() and (f / "test").is_dir()), None)
    if folder is None:
        raise FileNotFoundError(
            f"LEAF data root {str(base)!r} needs train/ and test/ folders of *.json files (or data/train, data/test), "
            "as LEAF's preprocess.sh writes them"
        )
    train, test = _read_split(folder / "train"), _read_split(folder / "test")
    if kind == "auto":
        kind = _detect(train.xs[0], folder / "train")
    if kind == "shakespeare":
        x_train, y_train = _characters(train, "x"), _characters(train, "y")[:, 0]
        x_test, y_test = _characters(test, "x"), _characters(test, "y")[:, 0]
        classes = len(SHAKESPEARE_LETTERS)
    elif kind == "sent140":
        vocabulary = _vocabulary([_text(train, i) for i in range(len(train.xs))], vocabulary_size)
        x_train, x_test = (_words(split, vocabulary, sequence_length) for split in (train, test))
        y_train, y_test = _labels(train), _labels(test)
        classes = 2
    else:
        x_train, x_test = _numbers(train), _numbers(test)
        if kind == "femnist" and x_train.shape[1] != 784:
            raise ValueError(f"LEAF {folder}: FEMNIST's x are 784 pixels, got {x_train.shape[1]} numbers")
        if x_train.shape[1] == 784:
            x_train, x_test = x_train.reshape(-1, 1, 28, 28), x_test.reshape(-1, 1, 28, 28)
        y_train, y_test = _labels(train), _labels(test)
        classes = 62 if kind == "femnist" else int(max(y_train.max(), y_test.max(initial=0))) + 1
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"LEAF {folder}: train samples have shape {x_train.shape[1:]}, test {x_test.shape[1:]}")
    for split, y in ((train, y_train), (test, y_test)):
        if y.size and y.max() >= classes:
            i = int(np.argmax(y >= classes))
            raise ValueError(
                f"LEAF {split.where(i)}: labels must be in 0..{classes - 1} ({kind}: {classes} classes), got {y[i]}"
            )
    client_ids = np.repeat(np.arange(len(train.users), dtype=np.int64), [len(u) for u in train.users.values()])
    return Dataset(
        f"leaf:{kind}",
        x_train,
        y_train,
        x_test,
        y_test,
        classes,
        tuple(x_train.shape[1:]),
        "as stored",
        client_ids=client_ids,
    )


@dataclass
class _Split:
    """The samples of train/ or test/, each user's together: ``users`` maps a user to the positions of their samples
    in ``xs`` and ``ys``; ``blocks`` holds (first position, file, user) of each user's samples from one file, in
    order of position."""

    users: dict[str, list[int]]
    xs: list
    ys: list
    blocks: list[tuple[int, Path, str]]

    def where(self, i: int) -> str:
        """Where sample ``i`` is stored: "file F, user 'u', sample j" (j: its index in that user's x and y)."""
        start, path, user = self.blocks[bisect_right([b[0] for b in self.blocks], i) - 1]
        return f"file {path}, user {user!r}, sample {i - start}"


def _read_split(folder: Path) -> _Split:
    """The samples of the JSON files in ``folder``, file after file, each user's moved together."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"LEAF: no *.json files in {folder}")
    users: dict[str, list[int]] = {}
    chunks: dict[str, list[tuple[Path, int]]] = {}  # user → (file, number of samples) of each file holding them
    xs: list = []
    ys: list = []
    for path in files:
        try:
            blob = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"LEAF file {path} is not readable JSON ({err})") from None
        if not isinstance(blob, dict) or not isinstance(blob.get("users"), list) or "user_data" not in blob:
            raise ValueError(f"LEAF file {path}: expected an object with 'users' and 'user_data'")
        names, user_data = blob["users"], blob["user_data"]
        counts = blob.get("num_samples", [None] * len(names))
        if not all(isinstance(u, str) for u in names) or len(set(names)) != len(names):
            raise ValueError(f"LEAF file {path}: 'users' must be a list of distinct user names (strings)")
        if not isinstance(counts, list) or len(counts) != len(names):
            raise ValueError(f"LEAF file {path}: 'num_samples' must be a list of one count per user in 'users'")
        if not isinstance(user_data, dict):
            raise ValueError(f"LEAF file {path}: 'user_data' must be an object keyed by the users in 'users'")
        if set(user_data) != set(names):
            odd = sorted(set(user_data) ^ set(names))[0]
            raise ValueError(f"LEAF file {path}: user {odd!r} is in only one of 'users' and 'user_data'")
        for user, count in zip(names, counts, strict=True):
            data = user_data[user]
            if not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list):
                raise ValueError(f"LEAF file {path}: user {user!r} has no 'x' and 'y' lists in user_data")
            if len(data["x"]) != len(data["y"]) or (count is not None and count != len(data["y"])):
                raise ValueError(
                    f"LEAF file {path}: user {user!r} has {len(data['x'])} x, {len(data['y'])} y and num_samples "
                    f"{count}"
                )
            if not data["y"]:
                continue
            users.setdefault(user, []).extend(range(len(ys), len(ys) + len(data["y"])))
            chunks.setdefault(user, []).append((path, len(data["y"])))
            xs.extend(data["x"])
            ys.extend(data["y"])
    if not ys:
        raise ValueError(f"LEAF: the files in {folder} hold no samples")
    if any(p != list(range(p[0], p[0] + len(p))) for p in users.values()):  # a user split across files
        order = [i for positions in users.values() for i in positions]
        xs, ys = [xs[i] for i in order], [ys[i] for i in order]
    blocks, start = [], 0
    for user, positions in users.items():
        users[user] = list(range(start, start + len(positions)))
        for path, count in chunks[user]:
            blocks.append((start, path, user))
            start += count
    return _Split(users, xs, ys, blocks)


def _detect(first: object, folder: Path) -> str:
    if isinstance(first, str):
        return "shakespeare"
    if isinstance(first, list) and len(first) == 5 and isinstance(first[4], str):
        return "sent140"
    if isinstance(first, list) and all(isinstance(v, (int, float)) for v in first[:10]):
        return "femnist" if len(first) == 784 else "numeric"  # FEMNIST: 28×28 pixels
    raise ValueError(f"LEAF {folder}: cannot tell the data's kind from its first x ({str(first)[:60]}); pass kind=")


def _numbers(split: _Split) -> np.ndarray:
    """float32 [n, d]: each x a list of finite numbers, all of the first x's shape (d numbers, d ≥ 1)."""
    try:
        with np.errstate(over="ignore"):  # numbers beyond float32 become inf, refused below
            array = np.asarray(split.xs, dtype=np.float32).reshape(len(split.xs), -1)
        if array.size and np.isfinite(array.min()) and np.isfinite(array.max()):  # min/max: NaN propagates
            return array
    except (TypeError, ValueError, OverflowError):
        pass
    shape = None
    for i, x in enumerate(split.xs):  # the first sample at fault
        try:
            with np.errstate(over="ignore"):
                row = np.asarray(x, dtype=np.float32)
        except (TypeError, ValueError, OverflowError):
            row = np.array([np.nan])
        shape = row.shape if shape is None else shape
        if not (row.shape == shape and row.size and np.isfinite(row).all()):
            raise ValueError(
                f"LEAF {split.where(i)}: x must be finite float32 numbers shaped as the first x {shape}, got "
                f"{str(x)[:60]}"
            )
    raise ValueError(f"LEAF {split.where(0)}: the x from there on do not form one array of numbers")


def _labels(split: _Split) -> np.ndarray:
    """int64 [n]: each y a class label (an integer, or an integral float, 0 ≤ y < 2**63)."""
    for i, y in enumerate(split.ys):
        number = isinstance(y, (int, float)) and not isinstance(y, bool)
        if not (number and (isinstance(y, int) or y.is_integer()) and 0 <= y < 2**63):
            raise ValueError(f"LEAF {split.where(i)}: y must be a class label (an integer ≥ 0), got {str(y)[:60]}")
    return np.array(split.ys, dtype=np.int64)


def _characters(split: _Split, name: str) -> np.ndarray:
    """int64 [n, len] alphabet indices of the split's x (``name`` "x": non-empty strings as long as the first) or of
    its y ("y": single characters, len 1)."""
    lookup = {c: i for i, c in enumerate(SHAKESPEARE_LETTERS)}
    texts = split.xs if name == "x" else split.ys
    length = len(texts[0]) if name == "x" and isinstance(texts[0], str) else 1
    wanted = "one character" if name == "y" else f"a non-empty string, all as long as the first x ({length})"
    for i, t in enumerate(texts):
        if not (isinstance(t, str) and len(t) == length and length):
            raise ValueError(f"LEAF shakespeare {split.where(i)}: {name} must be {wanted}, got {t!r:.60}")
    try:
        return np.array([[lookup[c] for c in t] for t in texts], dtype=np.int64).reshape(len(texts), length)
    except KeyError as err:
        odd = err.args[0]
        i = next(i for i, t in enumerate(texts) if odd in t)
        raise ValueError(f"LEAF shakespeare {split.where(i)}: character {odd!r} is not in LEAF's alphabet") from None


def _text(split: _Split, i: int) -> str:
    """The text of the split's sample ``i`` (a Sent140 x: [id, date, query, user, text])."""
    x = split.xs[i]
    if not (isinstance(x, list) and len(x) == 5 and isinstance(x[4], str)):
        raise ValueError(f"LEAF sent140 {split.where(i)}: x must be [id, date, query, user, text], got {str(x)[:60]}")
    return x[4]


def _vocabulary(texts: list[str], size: int) -> dict[str, int]:
    """The ``size`` most frequent words (ties: first seen) → 2, 3, ... (0: padding, 1: unknown)."""
    counts = Counter(w for t in texts for w in _WORDS.findall(t.lower()))
    return {w: i + 2 for i, (w, _) in enumerate(counts.most_common(size))}


def _words(split: _Split, vocabulary: dict[str, int], length: int) -> np.ndarray:
    out = np.zeros((len(split.xs), length), dtype=np.int64)
    for row in range(len(split.xs)):
        ids = [vocabulary.get(w, 1) for w in _WORDS.findall(_text(split, row).lower())][:length]
        out[row, : len(ids)] = ids
    return out
