"""LEAF's JSON layout (FEMNIST, Shakespeare, Sent140): files written here load with their natural split."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from pyfedkern import Experiment
from pyfedkern.cli import main
from pyfedkern.data.datasets import load_dataset
from pyfedkern.data.leaf import SHAKESPEARE_LETTERS, load_leaf


def _write(folder, files):
    """LEAF files: ``files`` maps a file name to {user: (xs, ys)}."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, users in files.items():
        blob = {
            "users": list(users),
            "num_samples": [len(ys) for _, ys in users.values()],
            "user_data": {u: {"x": xs, "y": ys} for u, (xs, ys) in users.items()},
        }
        (folder / name).write_text(json.dumps(blob))


def _femnist(root, rng):
    """Three writers in two train files (f_0001 split across both, as LEAF's sampling can leave it) and a test file."""

    def samples(n, label):
        return [rng.random(784).round(3).tolist() for _ in range(n)], [int(label)] * n

    train = {
        "all_data_0_niid_train_9.json": {"f_0001": samples(3, 7), "f_0002": samples(2, 61)},
        "all_data_1_niid_train_9.json": {"f_0003": samples(4, 0), "f_0001": samples(1, 7)},
    }
    test = {"all_data_0_niid_test_9.json": {"f_0001": samples(1, 7), "f_0003": samples(2, 0)}}
    _write(root / "data" / "train", train)
    _write(root / "data" / "test", test)
    return train, test


def test_femnist_loads_with_one_client_per_writer(tmp_path):
    train, _ = _femnist(tmp_path, np.random.default_rng(0))
    data = load_leaf(tmp_path)
    assert data.x_train.shape == (10, 1, 28, 28) and data.x_test.shape == (3, 1, 28, 28)
    assert data.x_train.dtype == np.float32 and data.num_classes == 62
    # writers in order of first appearance, each writer's samples together
    assert data.client_ids.tolist() == [0] * 4 + [1] * 2 + [2] * 4
    assert data.y_train.tolist() == [7] * 4 + [61] * 2 + [0] * 4
    first = train["all_data_0_niid_train_9.json"]["f_0001"][0][0]
    np.testing.assert_allclose(data.x_train[0].reshape(-1), first, rtol=1e-6)
    moved = train["all_data_1_niid_train_9.json"]["f_0001"][0][0]  # f_0001's sample from the second file
    np.testing.assert_allclose(data.x_train[3].reshape(-1), moved, rtol=1e-6)
    experiment = Experiment("cnn", data, clients="natural", rounds=1, batched=False)
    assert [ix.tolist() for ix in experiment.simulation.client_indices] == [[0, 1, 2, 3], [4, 5], [6, 7, 8, 9]]
    assert np.isfinite(experiment.run()[-1]["test_loss"])


def test_shakespeare_characters_and_next_character_labels(tmp_path):
    lines = {"THE_KING": ["To be, or not", "o be, or not "], "HAMLET": ["What's in a n"]}
    users = {u: ([t[:-1] for t in texts], [t[-1] for t in texts]) for u, texts in lines.items()}
    _write(tmp_path / "train", {"train.json": users})
    _write(tmp_path / "test", {"test.json": {"HAMLET": (["hat's in a n"], ["a"])}})
    data = load_leaf(tmp_path)
    assert data.name == "leaf:shakespeare" and data.num_classes == len(SHAKESPEARE_LETTERS) == 80
    assert data.x_train.shape == (3, 12) and data.x_train.dtype == np.int64
    assert "".join(SHAKESPEARE_LETTERS[i] for i in data.x_train[0]) == "To be, or no"
    assert [SHAKESPEARE_LETTERS[i] for i in data.y_train] == ["t", " ", "n"]
    assert data.client_ids.tolist() == [0, 0, 1]
    assert SHAKESPEARE_LETTERS[data.y_test[0]] == "a" and data.x_test.shape == (1, 12)


def test_sent140_words_on_the_training_vocabulary(tmp_path):
    def tweet(text):
        return ["1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", "someone", text]

    _write(
        tmp_path / "train",
        {"t.json": {"ann": ([tweet("Good day, good day!"), tweet("bad")], [1, 0]), "bob": ([tweet("day")], [1])}},
    )
    _write(tmp_path / "test", {"t.json": {"ann": ([tweet("good unseen day")], [1])}})
    data = load_leaf(tmp_path, sequence_length=5)
    assert data.num_classes == 2 and data.x_train.shape == (3, 5)
    # vocabulary by frequency: day (3), good (2), then in order of first appearance; 0 pads, 1 is unknown
    vocab = {"day": 2, "good": 3, ",": 4, "!": 5, "bad": 6}
    assert data.x_train[0].tolist() == [vocab["good"], vocab["day"], vocab[","], vocab["good"], vocab["day"]]
    assert data.x_train[1].tolist() == [vocab["bad"], 0, 0, 0, 0]
    assert data.x_test[0].tolist() == [vocab["good"], 1, vocab["day"], 0, 0]
    assert data.client_ids.tolist() == [0, 0, 1]


def test_the_cli_runs_leaf_data_with_its_natural_split(tmp_path, capsys):
    _femnist(tmp_path / "femnist", np.random.default_rng(1))
    assert load_dataset("leaf", tmp_path / "femnist").client_ids.max() == 2
    args = ["run", "--dataset", "leaf", "--data-root", str(tmp_path / "femnist"), "--partition", "natural"]
    assert main([*args, "--clients", "3", "--model", "logreg", "--rounds", "1", "--no-progress"]) == 0
    assert "test accuracy" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda root: (root / "train" / "a.json").write_text("{not json"), "is not readable JSON"),
        (lambda root: (root / "train" / "a.json").write_text('{"users": []}'), "expected an object with 'users'"),
        (
            lambda root: _write(root / "train", {"a.json": {"u": ([[0.5, 0.5]], [0, 1])}}),
            "user 'u' has 1 x, 2 y",
        ),
        (
            lambda root: _write(root / "train", {"a.json": {"u": (["abc", "abcd"], ["d", "e"])}}),
            r"user 'u', sample 1: x must be a non-empty string, all as long as the first x \(3\), got 'abcd'",
        ),
        (
            lambda root: _write(root / "train", {"a.json": {"u": (["ab\u00e9"], ["d"])}}),
            "user 'u', sample 0: character 'é' is not in LEAF's alphabet",
        ),
        (lambda root: (root / "test" / "t.json").unlink(), "no \\*.json files in"),
    ],
)
def test_damaged_files_are_refused_naming_them(tmp_path, damage, message):
    _write(tmp_path / "train", {"a.json": {"u": ([[0.5, 0.5]], [1])}})
    _write(tmp_path / "test", {"t.json": {"u": ([[0.5, 0.5]], [1])}})
    damage(tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        load_leaf(tmp_path)


GOOD = {"shakespeare": ("abc", "d"), "numeric": ([0.5, 0.5], 1), "sent140": (["1", "d", "q", "u", "hi"], 1)}


def _sample_at_fault(kind, x, y):
    """LEAF files of ``kind`` whose sample 1 of user 'v' in train/b.json (v's second file) has (x, y)."""
    good = GOOD[kind]
    return {
        "a.json": {"u": ([good[0]], [good[1]]), "v": ([good[0]] * 2, [good[1]] * 2)},
        "b.json": {"v": ([good[0], x], [good[1], y])},
    }


@pytest.mark.parametrize(
    ("kind", "x", "y", "message"),
    [
        ("shakespeare", "abc", "ab", "y must be one character, got 'ab'"),
        ("shakespeare", "abc", "", "y must be one character, got ''"),
        ("shakespeare", "abc", 5, "y must be one character, got 5$"),
        ("shakespeare", "ab", "d", r"x must be a non-empty string, all as long as the first x \(3\), got 'ab'"),
        ("shakespeare", "abc", "\u00e9", "character 'é' is not in LEAF's alphabet"),
        ("numeric", [0.5, 0.5], 1e30, r"y must be a class label \(an integer ≥ 0\), got 1e\+30"),
        ("numeric", [0.5, 0.5], 10**401, r"y must be a class label \(an integer ≥ 0\), got 1000000000"),
        ("numeric", [0.5, 0.5], -1, "y must be a class label .*, got -1$"),
        ("numeric", [0.5, 0.5], 2.5, "y must be a class label .*, got 2.5"),
        ("numeric", [0.5, 0.5], "1", "y must be a class label .*, got 1"),
        ("numeric", [0.5, 0.5], True, "y must be a class label .*, got True"),
        (
            "numeric",
            [0.5, 10**401],
            1,
            r"x must be finite float32 numbers shaped as the first x \(2,\), got \[0.5, 1000",
        ),
        (
            "numeric",
            [0.5, 1e39],
            1,
            r"x must be finite float32 numbers shaped as the first x \(2,\), got \[0.5, 1e\+39",
        ),
        ("numeric", [0.5, float("nan")], 1, "x must be finite float32 numbers .*, got \\[0.5, nan\\]"),
        ("numeric", [0.5], 1, "x must be finite float32 numbers .*, got \\[0.5\\]"),
        ("numeric", [0.5, "x"], 1, "x must be finite float32 numbers .*, got \\[0.5, 'x'\\]"),
        ("sent140", ["1", "d", "q", "u"], 1, r"x must be \[id, date, query, user, text\], got \['1'"),
        ("sent140", ["1", "d", "q", "u", "hi"], 2, r"labels must be in 0\.\.1 \(sent140: 2 classes\), got 2"),
    ],
)
def test_a_sample_at_fault_is_named_by_file_user_and_index(tmp_path, kind, x, y, message):
    """Targets of more than one character were read as their first, 1e30 as -2**63, and a 401-digit number or an empty
    target raised a bare OverflowError/IndexError: each is refused naming where it is (v's samples are moved
    together, so the position in the loaded split is not the one in the file)."""
    _write(tmp_path / "train", _sample_at_fault(kind, x, y))
    _write(tmp_path / "test", {"t.json": _sample_at_fault(kind, x, y)["a.json"]})
    where = f"file {tmp_path / 'train' / 'b.json'}, user 'v', sample 1: "
    with pytest.raises(ValueError, match=re.escape(where) + message):
        load_leaf(tmp_path)
    _write(tmp_path / "train", _sample_at_fault(kind, *GOOD[kind]))
    assert load_leaf(tmp_path).x_train.shape[0] == 5


def test_the_cli_names_the_leaf_sample_at_fault_in_one_line(tmp_path, capsys):
    _write(tmp_path / "train", _sample_at_fault("shakespeare", "abc", "ab"))
    _write(tmp_path / "test", {"t.json": _sample_at_fault("shakespeare", "abc", "d")["a.json"]})
    args = ["run", "--dataset", "leaf", "--data-root", str(tmp_path), "--model", "logreg", "--no-progress"]
    assert main([*args, "--partition", "natural", "--clients", "2", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "user 'v', sample 1: y must be one character, got 'ab'" in err, err


def test_a_folder_without_train_and_test_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="needs train/ and test/ folders"):
        load_leaf(tmp_path)


def _blob(**change):
    """A LEAF file's object with two users, ``change`` replacing its entries."""
    blob = {
        "users": ["a", "b"],
        "num_samples": [1, 2],
        "user_data": {"a": {"x": [[0.5, 0.5]], "y": [1]}, "b": {"x": [[0.1, 0.2], [0.3, 0.4]], "y": [0, 1]}},
    }
    return {**blob, **change}


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (_blob(user_data=[1, 2]), "'user_data' must be an object keyed by the users"),
        (_blob(num_samples=5), "'num_samples' must be a list of one count per user"),
        (_blob(num_samples=[1]), "'num_samples' must be a list of one count per user"),
        (_blob(users=["a", "b", "a"], num_samples=[1, 2, 1]), "'users' must be a list of distinct user names"),
        (_blob(users=[["a"], "b"]), "'users' must be a list of distinct user names"),
        (_blob(users=["a"], num_samples=[1]), "user 'b' is in only one of 'users' and 'user_data'"),
        (_blob(num_samples=[1, 3]), "user 'b' has 2 x, 2 y and num_samples 3"),
    ],
)
def test_inconsistent_users_are_refused_naming_the_file(tmp_path, blob, message):
    _write(tmp_path / "test", {"t.json": {"a": ([[0.5, 0.5]], [1])}})
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.json").write_text(json.dumps(blob))
    with pytest.raises(ValueError, match=f"LEAF file {tmp_path / 'train' / 'a.json'}: {message}"):
        load_leaf(tmp_path)
    (tmp_path / "train" / "a.json").write_text(json.dumps(_blob()))
    assert load_leaf(tmp_path).client_ids.tolist() == [0, 1, 1]


def test_femnist_is_recognised_by_its_784_pixels_and_has_62_classes(tmp_path):
    pixels = [[0.5] * 784, [0.25] * 784]
    _write(tmp_path / "train", {"a.json": {"f_1": (pixels, [3, 4])}})
    _write(tmp_path / "test", {"t.json": {"f_1": (pixels[:1], [0])}})
    data = load_leaf(tmp_path)
    assert data.name == "leaf:femnist" and data.num_classes == 62 and data.x_train.shape == (2, 1, 28, 28)
    numeric = load_leaf(tmp_path, kind="numeric")  # classes from the labels, the pixels still 28×28
    assert numeric.name == "leaf:numeric" and numeric.num_classes == 5 and numeric.x_train.shape == (2, 1, 28, 28)
    _write(tmp_path / "train", {"a.json": {"f_1": (pixels, [3, 62])}})
    message = r"a.json, user 'f_1', sample 1: labels must be in 0\.\.61 \(femnist: 62 classes\), got 62"
    with pytest.raises(ValueError, match=message):
        load_leaf(tmp_path)
    assert load_leaf(tmp_path, kind="numeric").num_classes == 63


def test_other_numbers_have_as_many_classes_as_the_largest_label_and_femnist_needs_784(tmp_path):
    _write(tmp_path / "train", {"a.json": {"u": ([[0.5, 0.5], [0.1, 0.2]], [0, 2])}})
    _write(tmp_path / "test", {"t.json": {"u": ([[0.5, 0.5]], [4])}})
    data = load_leaf(tmp_path)
    assert data.name == "leaf:numeric" and data.num_classes == 5 and data.x_train.shape == (2, 2)
    with pytest.raises(ValueError, match="FEMNIST's x are 784 pixels, got 2 numbers"):
        load_leaf(tmp_path, kind="femnist")
