"""Experiment: the engine on the user's own model and data (Python API and the CLI's module:factory), its run
options, its checks of bad input before any training, and the resume fingerprint."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pyfedkern import Experiment, models
from pyfedkern.algorithms import ALGORITHMS
from pyfedkern.cli import main
from pyfedkern.data.datasets import load_dataset
from pyfedkern.sim import checkpoints
from pyfedkern.sim.config import ExperimentConfig
from pyfedkern.sim.engine import Simulation

SETTINGS = {"rounds": 3, "fraction": 0.5, "batch_size": 16, "lr": 0.05, "eval_train_max": 200, "seed": 3}
CONFIG = ExperimentConfig(dataset="digits", partition="dirichlet:0.5", clients=8, **SETTINGS)

# A user's module: the built-in mlp and cnn written out again, and a data factory (the bundled digits).
USER_MODULE = textwrap.dedent(
    """
    import math

    from torch import nn

    from pyfedkern.data.datasets import load_dataset


    class MyMLP(nn.Module):
        def __init__(self, inputs, classes, widths=(64, 64)):
            super().__init__()
            layers, width = [nn.Flatten()], inputs
            for h in widths:
                layers += [nn.Linear(width, h), nn.ReLU()]
                width = h
            self.body = nn.Sequential(*layers)
            self.classifier = nn.Linear(width, classes)

        def forward(self, x):
            return self.classifier(self.body(x))

        def layer_chain(self):
            return [*self.body, self.classifier]


    def make_mlp(input_shape, num_classes):
        return MyMLP(math.prod(input_shape), num_classes)


    class MyCNN(nn.Module):
        def __init__(self, channels, side, classes):
            super().__init__()
            self.conv = nn.Sequential(
                nn.Conv2d(channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            )
            self.fc = nn.Sequential(nn.Linear(32 * (side // 4) ** 2, 256), nn.ReLU())
            self.classifier = nn.Linear(256, classes)

        def forward(self, x):
            return self.classifier(self.fc(self.conv(x)))


    def make_cnn(input_shape, num_classes):
        return MyCNN(input_shape[0], input_shape[1], num_classes)


    def digits():
        return load_dataset("digits")


    NOT_CALLABLE = 3


    def broken(num_classes):
        raise RuntimeError("no GPU here")
    """
)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    (folder / "my_parts.py").write_text(USER_MODULE)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def _numbers(metrics):
    """The metrics without the wall-clock timings."""
    return [{k: v for k, v in m.items() if not k.startswith("time_")} for m in metrics]


def test_a_user_module_identical_to_a_builtin_gives_its_metrics_bit_for_bit(user_dir):
    import my_parts

    builtin = Simulation(CONFIG).run()
    data = load_dataset("digits")
    mine = Experiment(my_parts.make_mlp, data, clients="dirichlet:0.5", num_clients=8, **SETTINGS).run()
    assert _numbers(mine) == _numbers(builtin)
    assert mine[-1]["test_acc"] > mine[0]["test_acc"] + 0.2  # it learns
    by_reference = Simulation(dataclasses.replace(CONFIG, model="my_parts:make_mlp", dataset="my_parts:digits")).run()
    assert _numbers(by_reference) == _numbers(builtin)


def test_the_cli_runs_a_user_cnn_like_the_builtin(user_dir, tmp_path):
    common = ["--partition", "iid", "--clients", "4", "--rounds", "1", "--batch-size", "32", "--no-progress"]
    common += ["--batched", "false"]  # the same path in both processes (the engine's timed choice may differ)
    out = {}
    for label, model in (("builtin", "cnn"), ("user", "my_parts:make_cnn")):
        run = subprocess.run(
            [sys.executable, "-m", "pyfedkern", "run", "--model", model, "--dataset", "my_parts:digits", *common,
             "--out", str(tmp_path / label)],
            cwd=user_dir, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        out[label] = [json.loads(line) for line in (tmp_path / label / "metrics.jsonl").read_text().splitlines()]
    assert _numbers(out["user"]) == _numbers(out["builtin"])
    assert json.loads((tmp_path / "user" / "config.json").read_text())["model"] == "my_parts:make_cnn"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--model", "no_such_module:make"], "cannot import module 'no_such_module'"),
        (["--model", "my_parts:missing"], "has no attribute 'missing'"),
        (["--model", "my_parts:NOT_CALLABLE"], "NOT_CALLABLE is a int, not callable"),
        (["--dataset", "my_parts:NOT_CALLABLE"], "dataset 'my_parts:NOT_CALLABLE'"),
        (["--model", "my_parts:broken"], "the factory broken raised RuntimeError: no GPU here"),
    ],
)
def test_the_cli_refuses_a_bad_module_attr_in_one_line(user_dir, capsys, monkeypatch, option, message):
    monkeypatch.chdir(user_dir)
    assert main(["run", "--rounds", "1", "--no-progress", *option]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


# the Python API on data of other shapes -------------------------------------------------------------------------


def _blobs(n=240, classes=3, shape=(6,), seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.normal(size=(n, *shape)).astype(np.float32) + y.reshape(-1, *[1] * len(shape))
    return x, y


def test_regression_targets_with_a_user_loss():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(5, 2))
    x = rng.normal(size=(300, 5)).astype(np.float32)
    y = (x @ w).astype(np.float32)
    metrics = Experiment(
        nn.Linear(5, 2), (x[:240], y[:240]), (x[240:], y[240:]), clients="iid", num_clients=6, loss=F.mse_loss,
        rounds=15, lr=0.1, eval_every=5,
    ).run()  # fmt: skip
    assert np.isnan(metrics[-1]["test_acc"]) and "train_loss" in metrics[-1]
    assert metrics[-1]["test_loss"] < 0.05 * metrics[0]["test_loss"]


def test_token_sequences_and_a_map_style_dataset():
    class Sequences(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randint(0, 20, (n, 12), generator=g)
            self.y = (self.x[:, 0] % 4).long()  # the class is the first token mod 4

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            return self.x[i], self.y[i]

    class Tagger(nn.Module):
        def __init__(self, num_classes):
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.lstm = nn.LSTM(8, 16, batch_first=True)
            self.out = nn.Linear(16, num_classes)

        def forward(self, tokens):
            return self.out(self.lstm(self.embed(tokens).flip(1))[0][:, -1])

    experiment = Experiment(
        Tagger,
        Sequences(400, 0),
        Sequences(100, 1),
        clients="iid",
        num_clients=5,
        rounds=10,
        local_epochs=3,
        lr=0.5,
        batched=False,
    )
    assert experiment.parts.data.num_classes == 4 and experiment.parts.data.x_train.dtype == np.int64
    metrics = experiment.run()
    assert metrics[-1]["test_acc"] > 0.5


def test_index_lists_overlap_only_when_declared_and_an_evaluation_function():
    x, y = _blobs()
    lists = [np.arange(0, 100), np.arange(80, 200)]
    with pytest.raises(ValueError, match=r"clients\[1\] and clients\[0\] both hold sample 80; pass allow_overlap"):
        Experiment(nn.Linear(6, 3), (x[:200], y[:200]), (x[200:], y[200:]), clients=lists)
    seen = []

    def evaluate(model, xt, yt):
        seen.append(model.training)
        return {"mean_score": model(xt).mean()}

    experiment = Experiment(
        nn.Linear(6, 3), (x[:200], y[:200]), (x[200:], y[200:]), clients=lists, allow_overlap=True,
        evaluate=evaluate, rounds=2,
    )  # fmt: skip
    assert experiment.config.clients == 2 and experiment.config.partition == "given"
    assert [len(ix) for ix in experiment.simulation.client_indices] == [100, 120]
    metrics = experiment.run()
    assert all("test_mean_score" in m for m in metrics) and seen == [False] * 3


@pytest.mark.parametrize("name", ["acc", "loss"])
def test_a_user_metric_named_like_the_engines_own_is_refused(tmp_path, name):
    """test_acc/test_loss (and summary.json's accuracy) are the engine's: a user's metric of the same name would have
    replaced them silently."""
    x, y = _blobs()
    experiment = Experiment(
        nn.Linear(6, 3), (x[:200], y[:200]), (x[200:], y[200:]), clients="iid", num_clients=2, rounds=1,
        evaluate=lambda model, xt, yt: {"f1": 0.5, name: -1.0},
    )  # fmt: skip
    with pytest.raises(ValueError, match=rf"evaluate: metric '{name}' would replace the engine's own test_{name}"):
        experiment.run(tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_user_factory_named_like_a_built_in_model_is_the_users(tmp_path):
    """A built-in is told by its factory (the one models.builtin makes), not by name: a user's ``cnn`` was called as
    the built-in is (with input_shape) before it was built, and failed with a TypeError."""

    def cnn(num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(6, num_classes))

    assert models.builtin_name(models.builtin("cnn", channels=4)) == "cnn"
    assert models.builtin_name(models.ModelSpec(factory=cnn, name="cnn")) is None
    x, y = _blobs()
    experiment = Experiment(cnn, (x[:200], y[:200]), (x[200:], y[200:]), clients="iid", num_clients=2, rounds=1)
    assert experiment.config.model == "cnn" and np.isfinite(experiment.run(tmp_path / "run")[-1]["test_loss"])
    assert experiment.simulation.initial_vector.numel() == 6 * 3 + 3  # the user's model, not the built-in CNN
    with pytest.raises(ValueError, match="model 'mlp' takes input_shape from the data"):
        models.builtin("mlp", input_shape=(6,))


def test_per_sample_client_ids_are_natural_clients():
    x, y = _blobs(n=120)
    ids = np.repeat([7, 3, 5], 40)
    experiment = Experiment(nn.Linear(6, 3), (x, y), (x, y), clients=ids, rounds=1)
    indices = experiment.simulation.client_indices
    assert [ix.tolist() for ix in indices] == [list(range(40, 80)), list(range(80, 120)), list(range(40))]


def test_an_algorithm_instance_and_its_parameters_in_the_config(tmp_path):
    from pyfedkern.algorithms import make_algorithm

    x, y = _blobs()
    algorithm = make_algorithm("fedprox", mu=0.25)
    experiment = Experiment(nn.Linear(6, 3), (x[:200], y[:200]), (x[200:], y[200:]), algorithm=algorithm, rounds=1)
    experiment.run(tmp_path / "run")
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["algorithm"] == "fedprox" and stored["algorithm_params"]["mu"] == 0.25


# run options ------------------------------------------------------------------------------------------------------


def test_initial_and_train_evaluations_can_be_skipped_or_subsampled():
    x, y = _blobs()
    base = {"clients": "iid", "num_clients": 4, "rounds": 2}
    parts = (nn.Linear(6, 3), (x[:200], y[:200]), (x[200:], y[200:]))
    full = Experiment(*parts, **base).run()
    assert {"test_loss", "train_loss"} <= set(full[0])
    lean = Experiment(*parts, **base, eval_initial=False, eval_train_max=0).run()
    assert lean[0] == {"round": 0}
    assert "train_loss" not in lean[-1] and lean[-1]["test_loss"] == full[-1]["test_loss"]
    sub = Experiment(*parts, **base, eval_test_max=10)
    assert sub.simulation.evaluator.x_test.shape[0] == 10
    again = Experiment(*parts, **base, eval_test_max=10).simulation
    assert torch.equal(sub.simulation.evaluator.x_test, again.evaluator.x_test)


def test_clients_sampled_with_replacement():
    x, y = _blobs()
    parts = (nn.Linear(6, 3), (x[:200], y[:200]), (x[200:], y[200:]))
    sim = Experiment(*parts, clients="iid", num_clients=10, sample_with_replacement=True).simulation
    drawn = [sim.sample_clients(t) for t in range(20)]
    assert all(len(d) == 10 for d in drawn)
    assert any(len(np.unique(d)) < 10 for d in drawn)  # a client drawn twice in some round
    plain = Experiment(*parts, clients="iid", num_clients=10).simulation
    assert all(np.array_equal(plain.sample_clients(t), np.arange(10)) for t in range(3))
    for algorithm in ("fedavg", "scaffold"):
        metrics = Experiment(*parts, clients="iid", num_clients=10, algorithm=algorithm, fraction=0.5,
                             sample_with_replacement=True, rounds=3).run()  # fmt: skip
        assert np.isfinite(metrics[-1]["test_loss"]) and metrics[-1]["clients"] == 5


def test_a_fixed_batch_order_is_kept_across_rounds():
    x, y = _blobs()
    parts = (nn.Linear(6, 3), (x[:200], y[:200]), (x[200:], y[200:]))
    fixed = Experiment(*parts, clients="iid", num_clients=4, batch_size=8, batch_order="fixed").simulation
    reshuffled = Experiment(*parts, clients="iid", num_clients=4, batch_size=8).simulation

    def order(sim, t):
        return np.concatenate(sim.batch_indices(1, t)).tolist()

    assert order(fixed, 0) == order(fixed, 1) == order(fixed, 7)
    assert order(reshuffled, 0) != order(reshuffled, 1)
    stacked = next(iter(fixed.stacked_batches([1], 5)))[0][0]  # the batched path follows the same order
    torch.testing.assert_close(stacked, fixed.client_x[1][torch.as_tensor(order(fixed, 5)[:8])])


# bad input, before any training -----------------------------------------------------------------------------------


def _refused(error, match, *args, **kwargs):
    x, y = _blobs()
    defaults = {"clients": "iid", "num_clients": 4}
    model = kwargs.pop("model", nn.Linear(6, 3))
    train = kwargs.pop("train", (x[:200], y[:200]))
    test = kwargs.pop("test", (x[200:], y[200:]))
    with pytest.raises(error, match=match) as info:
        Experiment(model, train, test, **{**defaults, **kwargs}).simulation  # noqa: B018 (building it checks)
    return info.value


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": nn.Linear(6, 2)}, r"model 'Linear': its output \(2, 2\) must score the 3 classes"),
        ({"model": nn.Linear(5, 3)}, r"model 'Linear' fails on a batch of training samples x \(2, 6\)"),
        ({"loss": F.mse_loss}, r"loss: fails on the model's output \(2, 3\) and the targets \(2,\)"),
        ({"loss": lambda out, y: out.sum() * float("nan")}, "loss: is nan"),
        ({"loss": lambda out, y: torch.tensor(1.0)}, "loss: must return a scalar tensor that depends on"),
        ({"clients": [[0, 1], [2, 500]]}, r"clients\[1\]: index 500 is out of range for the 200 training samples"),
        ({"clients": [[0, 1], [-1]]}, r"clients\[1\]: index -1 is out of range"),
        ({"clients": [[0, 1], []]}, r"clients\[1\] is empty"),
        ({"clients": [[0, 1, 1]]}, r"clients\[0\] lists a sample twice"),
        ({"clients": np.zeros(7, np.int64)}, "per-sample client ids must be 200 integers"),
        ({"num_classes": 2}, r"train: label 2 \(sample \d+\) is outside the 2 classes 0..1"),
        ({"num_clients": 500}, "clients=500 is more than the 200 training samples"),
        ({"rounds": 0}, "rounds must be an integer from 1 to 2\\^63 - 1, got 0"),
        ({"batch_order": "random"}, "batch_order must be one of reshuffle, fixed"),
        (
            {"predict": lambda out: out.argmax(1, keepdim=True)},  # compared with the labels [B]: a [B, B] accuracy
            r"predict: must return integer classes \[B\], one per sample; got torch.int64 \(2, 1\) for the output",
        ),
        ({"predict": lambda out: out.argmax(1).float()}, r"predict: .* got torch.float32 \(2,\)"),
        ({"predict": lambda out: out.softmax(1)}, r"predict: .* got torch.float32 \(2, 3\)"),
        ({"predict": lambda out: out[:, 7]}, r"predict: fails on the model's output \(2, 3\) \(IndexError"),
    ],
)
@pytest.mark.filterwarnings("ignore:Using a target size")  # mse_loss on class labels: the bad input checked here
def test_bad_input_is_refused_naming_the_argument(kwargs, match):
    _refused(ValueError, match, **kwargs)


def test_non_finite_features_are_refused():
    x, y = _blobs()
    x[17, 2] = np.nan
    _refused(ValueError, r"train: the features hold NaN or inf \(first in sample 17\)", train=(x[:200], y[:200]))
    x[17, 2], x[203, 0] = 0.0, np.inf
    _refused(ValueError, r"test: the features hold NaN or inf \(first in sample 3\)", test=(x[200:], y[200:]))


@pytest.mark.parametrize(
    ("columns", "model"),
    [(None, nn.Linear(6, 1)), (1, nn.Linear(6, 1)), (3, nn.Linear(6, 3))],  # (1): a cross-entropy of 0, always
)
def test_regression_targets_without_a_loss_are_refused(columns, model):
    x, _ = _blobs()
    y = np.random.default_rng(2).normal(size=(len(x), *([] if columns is None else [columns]))).astype(np.float32)
    got = r"\(2,\)" if columns is None else rf"\(2, {columns}\)"
    match = rf"loss: the default cross-entropy reads float targets as class probabilities .* got targets {got}"
    train, test = (x[:200], y[:200]), (x[200:], y[200:])
    _refused(ValueError, match + ".* pass a loss for regression targets", model=model, train=train, test=test)


def test_class_probabilities_train_with_the_default_cross_entropy():
    x, labels = _blobs()
    y = np.eye(3, dtype=np.float32)[labels] * 0.9 + 0.1 / 3  # smoothed one-hot rows
    train, test = (x[:200], y[:200]), (x[200:], y[200:])
    metrics = Experiment(nn.Linear(6, 3), train, test, clients="iid", num_clients=4, rounds=2).run()
    assert metrics[-1]["test_loss"] < metrics[0]["test_loss"] and math.isnan(metrics[-1]["test_acc"])
    _refused(ValueError, r"got targets \(2, 3\) and output \(2, 4\)", model=nn.Linear(6, 4), train=train, test=test)


@pytest.mark.parametrize("name", ["lstm", "transformer"])
@pytest.mark.parametrize(
    ("split", "sample", "token", "fix"),
    [
        ("train", 57, 50, "pass --model-param vocab=51"),
        ("train", 0, 12, "pass --model-param vocab=13"),  # in the samples the model is first run on
        ("test", 10, 50, "pass --model-param vocab=51"),
        ("train", 57, -1, "token ids must be >= 0"),
    ],
)
def test_token_ids_outside_a_builtin_model_s_vocabulary_are_refused(name, split, sample, token, fix):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 10, size=(120, 12)), rng.integers(0, 10, 120)  # vocab: the 10 classes
    x[sample + (100 if split == "test" else 0), 3] = token
    match = rf"model '{name}': {split} sample {sample} holds token id {token}, outside the model's vocabulary 0..9; "
    spec = models.builtin(name, layers=1)
    _refused(ValueError, match + fix, model=spec, train=(x[:100], y[:100]), test=(x[100:], y[100:]))
    within = Experiment(spec, (x[:100] % 10, y[:100]), (x[100:] % 10, y[100:]), clients="iid", num_clients=4)
    assert within.simulation.local.module.embedding.num_embeddings == 10


def test_the_cli_refuses_token_ids_outside_the_vocabulary_in_one_line(tmp_path, capsys, monkeypatch):
    module = "import numpy as np\n\n\ndef tokens():\n    x = np.arange(240).reshape(20, 12) % 30\n"
    module += "    return (x[:16], np.arange(16) % 10), (x[16:], np.arange(4) % 10)\n"
    (tmp_path / "vocab_parts.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["run", "--rounds", "1", "--clients", "2", "--partition", "iid", "--no-progress", "--model", "lstm"]
    assert main([*args, "--dataset", "vocab_parts:tokens", "--model-param", "hidden=4"]) == 2
    err = capsys.readouterr().err
    assert "train sample 0 holds token id 10, outside the model's vocabulary 0..9; pass --model-param vocab=30" in err
    assert err.count("\n") == 1


class _Samples(torch.utils.data.Dataset):
    """A map-style dataset of 6 samples (x float32 [6], y int64) whose ``len()`` may claim more, with sample
    ``odd`` replaced by ``(x, y)``; indexed as a dict, so an index past the data raises KeyError."""

    def __init__(self, claimed=6, odd=None, x=None, y=None):
        rng = np.random.default_rng(0)
        self.samples = {i: (rng.normal(size=6).astype(np.float32), np.int64(i % 3)) for i in range(6)}
        if odd is not None:
            self.samples[odd] = (x, y)
        self.claimed = claimed

    def __len__(self):
        return self.claimed

    def __getitem__(self, i):
        return self.samples[i]


@pytest.mark.parametrize("split", ["train", "test"])
@pytest.mark.parametrize(
    ("dataset", "error", "match"),
    [
        (_Samples(claimed=9), ValueError, r"sample 6 of the dataset's 9 \(its len\(\)\) cannot be read: KeyError: 6"),
        (
            _Samples(odd=4, x=np.zeros(5, np.float32), y=1),
            ValueError,
            r"sample 4's x has shape \(5,\), but sample 0's \(6,\)",
        ),
        (
            _Samples(odd=2, x=np.zeros(6, np.float32), y=[1, 2]),
            ValueError,
            r"sample 2's y has shape \(2,\), but sample 0's \(\)",
        ),
        (_Samples(odd=1, x=np.zeros(6, np.float32), y="a"), TypeError, "sample 1's y must hold numbers"),
        (_Samples(odd=5, x=None, y=None), TypeError, "sample 5's x must hold numbers"),
        (_Samples(odd=3, x=np.zeros(6, np.float32), y=None), TypeError, "sample 3's y must hold numbers"),
    ],
)
def test_a_map_style_dataset_s_bad_sample_is_named_by_split_and_index(split, dataset, error, match):
    """A KeyError or IndexError of the user's dataset (a len() longer than its data) was reported as "must be an (x, y)
    pair or a map-style dataset", and a sample of another shape as NumPy's bare "all input arrays must have the same
    shape"."""
    good = _Samples()
    parts = {"train": good, "test": good, split: dataset}
    err = _refused(error, f"^{split}: {match}", **parts)
    if "KeyError" in match:
        assert isinstance(err.__cause__, KeyError)  # the dataset's own exception, with its traceback


def test_the_cli_names_a_map_style_dataset_s_unreadable_sample_in_one_line(tmp_path, capsys, monkeypatch):
    module = textwrap.dedent(
        """
        import numpy as np


        class Short:  # claims 50 samples, holds 40
            def __len__(self):
                return 50

            def __getitem__(self, i):
                return np.ones((40, 4), np.float32)[i], i % 2


        def load():
            return Short(), Short()
        """
    )
    (tmp_path / "short_parts.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["run", "--rounds", "1", "--clients", "2", "--partition", "iid", "--no-progress", "--model", "logreg"]
    assert main([*args, "--dataset", "short_parts:load", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train: sample 40 of the dataset's 50 (its len()) cannot be read: IndexError: index 40 is out" in err, err
    assert err.count("\n") == 1


def test_a_factory_that_raises_is_reported_with_its_traceback_as_the_cause():
    def make(num_classes):
        raise KeyError("width")

    err = _refused(ValueError, r"model 'make': the factory make raised KeyError: 'width'", model=make)
    assert isinstance(err.__cause__, KeyError) and err.__cause__.__traceback__ is not None


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"model": 3}, TypeError, "model must be an nn.Module, a factory"),
        ({"model": lambda: "not a module"}, TypeError, "the factory returned a str, not an nn.Module"),
        ({"model": nn.ReLU()}, ValueError, "has no trainable parameters"),
        ({"train": [1, 2, 3]}, TypeError, r"train: sample 0 must be an \(x, y\) pair, got 1"),
        ({"train": "xy"}, TypeError, "train must be an"),
        ({"train": (np.zeros((4, 6)), np.zeros(3, np.int64))}, ValueError, "train: x .* one row per sample"),
        ({"train": (np.zeros((4, 6)), np.array(["a"] * 4))}, TypeError, "train: y must hold numbers"),
        ({"test": (np.zeros((4, 5), np.float32), np.zeros(4, np.int64))}, ValueError, r"test: samples of shape \(5,\)"),
        ({"loss": "mse"}, TypeError, "loss must be callable"),
        ({"learning_rate": 0.1}, TypeError, "unknown setting"),
        ({"algorithm": "fedsgd"}, ValueError, "fedsgd"),
    ],
)
def test_bad_parts_are_refused(kwargs, error, match):
    _refused(error, match, **kwargs)


# resume -----------------------------------------------------------------------------------------------------------


def _linear_without_bias():
    def linear():  # the same name as the run's factory, another structure
        return nn.Linear(6, 3, bias=False)

    return linear


def _dropout_mlp():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


@pytest.mark.parametrize("batched", [False, True])
def test_a_resumed_run_of_a_dropout_model_continues_as_the_uninterrupted_one(tmp_path, batched):
    """The model's own randomness (dropout, torch's generator) is seeded per client and round, so the rounds after a
    resume draw what the uninterrupted run drew (before, torch's generator restarted from the run's seed)."""
    x, y = _blobs()

    def experiment(rounds):
        return Experiment(
            _dropout_mlp,
            (x[:200], y[:200]),
            (x[200:], y[200:]),
            clients="iid",
            num_clients=6,
            rounds=rounds,
            fraction=0.5,
            batch_size=8,
            lr=0.1,
            dtype="float64",
            batched=batched,
        )

    full = experiment(3).run()
    experiment(2).run(tmp_path / "run")
    resumed = experiment(3).run(tmp_path / "run", resume=True)
    assert [m["test_loss"] for m in resumed] == [m["test_loss"] for m in full]
    assert full[-1]["test_loss"] != full[-2]["test_loss"]


def test_a_resumed_run_of_a_batchnorm_model_continues_as_the_uninterrupted_one(tmp_path):
    """The model's buffers (BatchNorm's running statistics, updated by each client's training in turn) are kept in
    checkpoints: a resumed run evaluates with what the uninterrupted run had (before, it restarted from the initial
    statistics); a checkpoint whose buffers do not fit the model is refused, naming them."""
    x, y = _blobs()

    def experiment(rounds, norm=nn.BatchNorm1d):
        def net():
            torch.manual_seed(5)
            return nn.Sequential(nn.Linear(6, 16), norm(16), nn.ReLU(), nn.Linear(16, 3))

        return Experiment(
            net,
            (x[:200], y[:200]),
            (x[200:], y[200:]),
            clients="iid",
            num_clients=5,  # 40 samples each: no batch of one (BatchNorm refuses it)
            rounds=rounds,
            fraction=0.5,
            batch_size=8,
            lr=0.1,
            dtype="float64",
        )

    full = experiment(3).run()
    experiment(2).run(tmp_path / "run")
    resumed = experiment(3).run(tmp_path / "run", resume=True)
    assert [m["test_loss"] for m in resumed] == [m["test_loss"] for m in full]
    sim = experiment(3).simulation
    sim.algorithm.setup(sim, sim.initial_vector)
    state = checkpoints.checkpoint_state(sim, 2)
    assert set(state["buffers"]) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    other = experiment(3, norm=lambda n: nn.LayerNorm(n)).simulation  # no buffers
    refused = r"c\.pt: its model buffers \(1\.running_mean, .*\) do not fit the model's \(none\)"
    with pytest.raises(ValueError, match=refused):
        checkpoints.restore(other, tmp_path / "c.pt", state)


def test_a_client_s_dropout_does_not_depend_on_the_clients_trained_before_it():
    """On the per-client loop, client c's update in round t is the same whether it trains alone or after others (as
    on another rank of a distributed run)."""
    x, y = _blobs()
    sim = Experiment(
        _dropout_mlp,
        (x[:200], y[:200]),
        (x[200:], y[200:]),
        clients="iid",
        num_clients=6,
        batch_size=8,
        lr=0.1,
        batched=False,
    ).simulation
    algo = sim.algorithm
    algo.setup(sim, sim.initial_vector)
    alone = algo.client_update(1, np.array([4]), sim).vectors
    updates = algo.client_update(1, np.array([0, 2, 4]), sim)
    after_others, row = updates.vectors, int(np.flatnonzero(updates.clients == 4)[0])
    assert alone.keys() == after_others.keys() and row > 0  # client 4 trained after another
    for name in alone:
        torch.testing.assert_close(alone[name][0], after_others[name][row], rtol=0, atol=0)
    assert not torch.equal(after_others["model"][0], after_others["model"][1])


#: parameters that let an algorithm run two short rounds of a small experiment
_SHORT_RUN = {"fnrfl": {"public_size": 5}, "dynamic": {"sessions": 2, "session_rounds": 1}}


class _DropoutNet(nn.Module):
    """_dropout_mlp with the features/classifier split that FNR-FL needs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5))
        self.classifier = nn.Linear(16, 3)

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.classifier(self.features(x))


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_trains_a_dropout_model_reproducibly(algorithm, batched):
    """Every algorithm trains a model with dropout on both paths (FNR-FL's batched refinement used to raise: its
    vmap refused random operations), and a rerun gives the same numbers."""
    x, y = _blobs()

    def run():
        return Experiment(
            _DropoutNet,
            (x[:200], y[:200]),
            (x[200:], y[200:]),
            algorithm=algorithm,
            algorithm_params=_SHORT_RUN.get(algorithm, {}),
            clients="iid",
            num_clients=4,
            rounds=2,
            batch_size=16,
            lr=0.1,
            dtype="float64",
            batched=batched,
        ).run()

    first = run()
    assert all(math.isfinite(m["test_loss"]) for m in first)
    assert [m["test_loss"] for m in run()] == [m["test_loss"] for m in first]


def test_resume_refuses_a_different_model_data_or_split_naming_it(tmp_path):
    x, y = _blobs()
    halves = [np.arange(100), np.arange(100, 200)]
    settings = {"clients": halves, "rounds": 4, "checkpoint_every": 2}

    def linear():
        return nn.Linear(6, 3)

    def experiment(model=linear, train=(x[:200], y[:200]), **changes):
        return Experiment(model, train, (x[200:], y[200:]), **{**settings, **changes})

    full = experiment().run()
    interrupted = experiment()
    original = interrupted.algorithm.round

    def crash(t, ctx):
        if t == 3:
            raise KeyboardInterrupt
        return original(t, ctx)

    interrupted.algorithm.round = crash
    run_dir = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        interrupted.run(run_dir)
    assert set(json.loads((run_dir / "fingerprint.json").read_text())) == {
        "model structure", "training data", "test data", "client split"
    }  # fmt: skip
    y_changed = y.copy()
    y_changed[5] = (y_changed[5] + 1) % 3
    for change, named in (
        ({"model": _linear_without_bias()}, "the model structure differs"),
        ({"train": (x[:200], y_changed[:200])}, "the training data differs"),
        ({"clients": [np.arange(90), np.arange(90, 200)]}, "the client split differs"),
        ({"model": nn.Linear(6, 3)}, "the config differs in model"),
    ):
        with pytest.raises(ValueError, match=named):
            experiment(**change).run(run_dir, resume=True)
    resumed = experiment().run(run_dir, resume=True)
    assert _numbers(resumed) == _numbers(full)


def test_the_cli_takes_the_run_options(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "--rounds", "2", "--clients", "5", "--no-progress", "--out", str(out), "--eval-initial", "false"]
    args += ["--eval-train-max", "0", "--eval-test-max", "50", "--sample-with-replacement", "true"]
    assert main([*args, "--batch-order", "fixed"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["eval_initial"] is False and config["eval_train_max"] == 0 and config["eval_test_max"] == 50
    assert config["sample_with_replacement"] is True and config["batch_order"] == "fixed"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0] == {"round": 0} and "train_loss" not in metrics[-1] and "test_acc" in metrics[-1]
    assert main(["run", "--batch-order", "sorted", "--rounds", "1", "--no-progress"]) == 2
    assert "batch_order must be one of reshuffle, fixed" in capsys.readouterr().err


def test_the_cli_resume_refuses_changed_data_from_a_module_factory(tmp_path):
    module = "from pyfedkern.data.datasets import load_dataset\n\n\ndef data():\n    return load_dataset('digits')\n"
    (tmp_path / "resume_parts.py").write_text(module)
    sys.path.insert(0, str(tmp_path))
    try:
        config = dataclasses.replace(CONFIG, dataset="resume_parts:data", rounds=4, checkpoint_every=2)
        full = Simulation(config).run()
        sim = Simulation(config)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("resume_parts", None)
    original = sim.algorithm.round

    def crash(t, ctx):
        if t == 3:
            raise KeyboardInterrupt
        return original(t, ctx)

    sim.algorithm.round = crash
    with pytest.raises(KeyboardInterrupt):
        sim.run(tmp_path / "run")

    def resume():
        command = [sys.executable, "-m", "pyfedkern", "run", "--resume", "--out", "run", "--no-progress"]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)

    changed = module.replace("load_dataset('digits')", "load_dataset('digits', split_seed=1)")
    (tmp_path / "resume_parts.py").write_text(changed)
    refused = resume()
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "the training data, the test data and the client split differ from the run's" in refused.stderr
    (tmp_path / "resume_parts.py").write_text(module)
    resumed = resume()
    assert resumed.returncode == 0, resumed.stderr
    stored = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert _numbers(stored) == _numbers(full)
