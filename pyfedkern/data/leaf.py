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
from collections import Counter
from pathlib import Path

import numpy as np

from pyfedkern.data.datasets import Dataset

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
    train_users, train_x, train_y = _read_split(folder / "train")
    _, test_x, test_y = _read_split(folder / "test")
    if kind == "auto":
        kind = _detect(train_x[0], folder / "train")
    if kind == "shakespeare":
        x_train, y_train = _characters(train_x, "train"), _characters(train_y, "train")[:, 0]
        x_test, y_test = _characters(test_x, "test"), _characters(test_y, "test")[:, 0]
        classes = len(SHAKESPEARE_LETTERS)
    elif kind == "sent140":
        vocabulary = _vocabulary([_text(x) for x in train_x], vocabulary_size)
        x_train, x_test = (_words(xs, vocabulary, sequence_length) for xs in (train_x, test_x))
        y_train, y_test = _labels(train_y, "train"), _labels(test_y, "test")
        classes = 2
    else:
        x_train, x_test = _numbers(train_x, "train"), _numbers(test_x, "test")
        if kind == "femnist" and x_train.shape[1] != 784:
            raise ValueError(f"LEAF {folder}: FEMNIST's x are 784 pixels, got {x_train.shape[1]} numbers")
        if x_train.shape[1] == 784:
            x_train, x_test = x_train.reshape(-1, 1, 28, 28), x_test.reshape(-1, 1, 28, 28)
        y_train, y_test = _labels(train_y, "train"), _labels(test_y, "test")
        classes = 62 if kind == "femnist" else int(max(y_train.max(), y_test.max(initial=0))) + 1
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"LEAF {folder}: train samples have shape {x_train.shape[1:]}, test {x_test.shape[1:]}")
    for split, y in (("train", y_train), ("test", y_test)):
        if y.size and (y.min() < 0 or y.max() >= classes):
            raise ValueError(
                f"LEAF {folder / split}: labels must be in 0..{classes - 1} ({kind}: {classes} classes), got "
                f"{int(y.min())}..{int(y.max())}"
            )
    client_ids = np.repeat(np.arange(len(train_users), dtype=np.int64), [len(u) for u in train_users.values()])
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


def _read_split(folder: Path) -> tuple[dict[str, list[int]], list, list]:
    """(user → positions of their samples, every x, every y) of the JSON files in ``folder``, file after file."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"LEAF: no *.json files in {folder}")
    users: dict[str, list[int]] = {}
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
            users.setdefault(str(user), []).extend(range(len(ys), len(ys) + len(data["y"])))
            xs.extend(data["x"])
            ys.extend(data["y"])
    if not ys:
        raise ValueError(f"LEAF: the files in {folder} hold no samples")
    if any(p != list(range(p[0], p[0] + len(p))) for p in users.values()):  # a user split across files
        order = [i for positions in users.values() for i in positions]
        xs, ys = [xs[i] for i in order], [ys[i] for i in order]
        start = 0
        for user, positions in users.items():
            users[user] = list(range(start, start + len(positions)))
            start += len(positions)
    return users, xs, ys


def _detect(first: object, folder: Path) -> str:
    if isinstance(first, str):
        return "shakespeare"
    if isinstance(first, list) and len(first) == 5 and isinstance(first[4], str):
        return "sent140"
    if isinstance(first, list) and all(isinstance(v, (int, float)) for v in first[:10]):
        return "femnist" if len(first) == 784 else "numeric"  # FEMNIST: 28×28 pixels
    raise ValueError(f"LEAF {folder}: cannot tell the data's kind from its first x ({str(first)[:60]}); pass kind=")


def _numbers(xs: list, split: str) -> np.ndarray:
    try:
        array = np.asarray(xs, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise ValueError(f"LEAF {split}: every x must be a list of numbers of one length ({err})") from None
    return array.reshape(len(xs), -1)


def _labels(ys: list, split: str) -> np.ndarray:
    try:
        array = np.asarray(ys, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"LEAF {split}: every y must be an integer class label") from None
    if array.ndim != 1 or not np.all(array == np.round(array)):
        raise ValueError(f"LEAF {split}: every y must be an integer class label")
    return array.astype(np.int64)


def _characters(texts: list, split: str) -> np.ndarray:
    """int64 [n, len] alphabet indices of equally long strings."""
    lookup = {c: i for i, c in enumerate(SHAKESPEARE_LETTERS)}
    if not all(isinstance(t, str) for t in texts) or len({len(t) for t in texts}) != 1:
        raise ValueError(f"LEAF shakespeare {split}: every x must be a string of one length, every y one character")
    try:
        return np.array([[lookup[c] for c in t] for t in texts], dtype=np.int64)
    except KeyError as err:
        raise ValueError(f"LEAF shakespeare {split}: character {err.args[0]!r} is not in LEAF's alphabet") from None


def _text(x: object) -> str:
    if not (isinstance(x, list) and len(x) == 5 and isinstance(x[4], str)):
        raise ValueError(f"LEAF sent140: every x must be [id, date, query, user, text], got {str(x)[:60]}")
    return x[4]


def _vocabulary(texts: list[str], size: int) -> dict[str, int]:
    """The ``size`` most frequent words (ties: first seen) → 2, 3, ... (0: padding, 1: unknown)."""
    counts = Counter(w for t in texts for w in _WORDS.findall(t.lower()))
    return {w: i + 2 for i, (w, _) in enumerate(counts.most_common(size))}


def _words(xs: list, vocabulary: dict[str, int], length: int) -> np.ndarray:
    out = np.zeros((len(xs), length), dtype=np.int64)
    for row, x in enumerate(xs):
        ids = [vocabulary.get(w, 1) for w in _WORDS.findall(_text(x).lower())][:length]
        out[row, : len(ids)] = ids
    return out
