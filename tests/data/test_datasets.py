"""Datasets: digits split and normalisation, synthetic and quadratic generators, MNIST IDX and CIFAR-10 readers."""

from __future__ import annotations

import gzip
import os
import pickle

import numpy as np
import pytest

from pyfedkern.data import datasets
from pyfedkern.data.datasets import load_dataset, to_parity


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_names():
    assert set(datasets.DATASETS) == {"digits", "synthetic", "synthetic-iid", "mnist", "cifar10", "quadratic", "leaf"}


def test_digits_split_and_standardisation(digits):
    assert digits.x_train.shape == (1347, 1, 8, 8) and digits.x_test.shape == (450, 1, 8, 8)
    assert digits.x_train.dtype == np.float32 and digits.y_train.dtype == np.int64
    assert digits.input_shape == (1, 8, 8) and digits.num_classes == 10 and digits.client_ids is None
    # Stratified: every class keeps its share in both halves.
    train_share = np.bincount(digits.y_train) / 1347
    test_share = np.bincount(digits.y_test) / 450
    assert np.abs(train_share - test_share).max() < 0.01
    flat = digits.x_train.reshape(1347, -1).astype(np.float64)
    assert np.abs(flat.mean(axis=0)).max() < 1e-5
    std = flat.std(axis=0)
    varying = std > 0  # a few corner pixels are 0 in every training image
    assert varying.sum() > 55
    np.testing.assert_allclose(std[varying], 1.0, atol=1e-4)
    assert digits.normalization.startswith("standard")


def test_digits_unit_none_and_split_seed(digits):
    raw = load_dataset("digits", normalize="none")
    unit = load_dataset("digits", normalize="unit")
    assert raw.x_train.min() == 0 and raw.x_train.max() == 16
    np.testing.assert_array_equal(unit.x_train, raw.x_train / 16)
    np.testing.assert_array_equal(raw.y_train, digits.y_train)  # normalisation does not change the split
    again = load_dataset("digits", normalize="none")
    np.testing.assert_array_equal(again.x_train, raw.x_train)
    other = load_dataset("digits", normalize="none", split_seed=1)
    assert not np.array_equal(other.y_train, raw.y_train)
    # Standardised test data uses the train statistics: x_test = (raw_test − μ_train) / σ_train.
    mean = raw.x_train.reshape(1347, -1).astype(np.float64).mean(0)
    std = raw.x_train.reshape(1347, -1).astype(np.float64).std(0)
    expected = (raw.x_test.reshape(450, -1) - mean) / np.where(std > 0, std, 1.0)
    np.testing.assert_allclose(digits.x_test.reshape(450, -1), expected, atol=1e-4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="normalize"):
        load_dataset("digits", normalize="zscore")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="no arguments"):
        load_dataset("digits:3")
    with pytest.raises(ValueError, match="clients"):
        load_dataset("synthetic:1,1,2.5")
    with pytest.raises(ValueError, match="split_seed"):
        load_dataset("digits", split_seed=-1)


def test_synthetic_shapes_determinism_and_clients():
    a = load_dataset("synthetic:0.5,0.5,12,20,5", split_seed=3, normalize="none")
    b = load_dataset("synthetic:0.5,0.5,12,20,5", split_seed=3, normalize="none")
    c = load_dataset("synthetic:0.5,0.5,12,20,5", split_seed=4, normalize="none")
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    assert not np.array_equal(a.x_train[:10], c.x_train[:10])
    assert a.input_shape == (20,) and a.num_classes == 5 and a.x_train.shape[1] == 20
    assert a.client_ids.shape == a.y_train.shape and a.client_ids.dtype == np.int64
    sizes = np.bincount(a.client_ids, minlength=12)
    assert np.array_equal(np.unique(a.client_ids), np.arange(12))
    # Client sizes are in [50, 1000] before the 80/20 split.
    assert sizes.min() >= 40 and sizes.max() <= 800
    assert len(a.y_test) == pytest.approx(len(a.y_train) / 4, rel=0.1)
    assert a.y_train.min() >= 0 and a.y_train.max() < 5
    # Σ_jj = j^-1.2: later features vary less within a client.
    x0 = a.x_train[a.client_ids == 0]
    assert x0[:, 0].std() > 2 * x0[:, -1].std()


def test_synthetic_draws_are_the_per_client_streams(monkeypatch):
    """The generator draws many clients' normals at once but must give exactly the data of drawing them client by
    client (v, W, b, then x, with NumPy's normal), as every recorded synthetic result was made with."""
    monkeypatch.setattr(datasets, "_SYNTHETIC_DRAW", 5000)  # several groups of clients
    data = load_dataset("synthetic:0.7,1.3,9,6,4", split_seed=2, normalize="none")
    rng = np.random.default_rng(2)
    sizes = np.minimum(rng.lognormal(4.0, 2.0, 9).astype(np.int64) + 50, 1000)
    u, shift = rng.normal(0.0, 0.7, 9), rng.normal(0.0, 1.3, 9)
    std = np.arange(1, 7, dtype=np.float64) ** -0.6
    xs, ys = [], []
    for k in range(9):
        v, w, b = rng.normal(shift[k], 1.0, 6), rng.normal(u[k], 1.0, (6, 4)), rng.normal(u[k], 1.0, 4)
        x = v + rng.standard_normal((sizes[k], 6)) * std
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))
    n_train = [int(0.8 * n) for n in sizes]
    x_train = np.concatenate([x[:m] for x, m in zip(xs, n_train, strict=True)]).astype(np.float32)
    np.testing.assert_array_equal(data.x_train, x_train)
    np.testing.assert_array_equal(data.y_test, np.concatenate([y[m:] for y, m in zip(ys, n_train, strict=True)]))
    np.testing.assert_array_equal(data.client_ids, np.repeat(np.arange(9), n_train))


def test_synthetic_defaults_and_standardisation():
    s = load_dataset("synthetic:1,1")
    assert s.name == "synthetic:1,1,30,60,10" and s.input_shape == (60,) and s.num_classes == 10
    assert np.unique(s.client_ids).size == 30
    np.testing.assert_allclose(s.x_train.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(s.x_train.std(axis=0), 1.0, atol=1e-3)


def test_quadratic():
    q = load_dataset("quadratic:7,5", split_seed=2)
    assert q.x_train.shape == (7, 5) and q.input_shape == (5,) and q.num_classes == 7
    np.testing.assert_array_equal(q.y_train, np.arange(7))
    np.testing.assert_array_equal(q.client_ids, np.arange(7))
    np.testing.assert_array_equal(q.x_test, q.x_train)
    assert q.normalization == "none"
    big = load_dataset("quadratic", normalize="unit")
    assert big.x_train.shape == (100, 100)
    # u_i ~ N((i/1000)·1, 0.01·I), i = 1..m.
    np.testing.assert_allclose(big.x_train.mean(axis=1), np.arange(1, 101) / 1000, atol=0.04)
    assert big.x_train.std() == pytest.approx(0.1, rel=0.1)


@pytest.mark.parametrize(
    ("spec", "split_seed"),
    [("digits", 0), ("digits", 5), ("synthetic:1,1,12,4", 3), ("synthetic-iid:12,4", 1), ("quadratic:7,2", 0)],
)
def test_train_size_is_known_without_loading(spec, split_seed):
    data = load_dataset(spec, split_seed=split_seed)
    assert datasets.train_size(spec, split_seed=split_seed) == data.y_train.size
    planned = (data.y_train.size, data.y_test.size, data.input_shape)
    assert datasets.planned_size(spec, split_seed=split_seed) == planned


def test_synthetic_iid_is_one_task_for_every_client_and_synthetic_is_not():
    """synthetic-iid: the clients' sizes and split as synthetic's, and one linear model labels every client's data
    (a classifier fitted on the pooled train set is near perfect on the test set); synthetic(0, 0) gives every
    client its own model, so the pooled data are not one linear task."""
    from sklearn.linear_model import LogisticRegression

    iid = load_dataset("synthetic-iid:40,6,3", split_seed=2, normalize="none")
    other = load_dataset("synthetic:0,0,40,6,3", split_seed=2, normalize="none")
    assert iid.name == "synthetic-iid:40,6,3" and iid.input_shape == (6,) and iid.num_classes == 3
    np.testing.assert_array_equal(iid.client_ids, other.client_ids)  # the same client sizes and 80/20 split
    assert iid.x_test.shape == other.x_test.shape and iid.x_train.dtype == np.float32
    again = load_dataset("synthetic-iid:40,6,3", split_seed=2, normalize="none")
    np.testing.assert_array_equal(iid.x_train, again.x_train)
    assert not np.array_equal(iid.x_train, load_dataset("synthetic-iid:40,6,3", split_seed=3).x_train)
    for data, low, high in ((iid, 0.95, 1.0), (other, 0.0, 0.8)):
        fit = LogisticRegression(C=100.0, max_iter=2000).fit(data.x_train, data.y_train)
        assert low <= fit.score(data.x_test, data.y_test) <= high
    assert load_dataset("synthetic-iid").name == "synthetic-iid:30,60,10"
    with pytest.raises(ValueError, match="at most 3 arguments"):
        load_dataset("synthetic-iid:1,2,3,4")
    with pytest.raises(ValueError, match="synthetic-iid: classes must be an integer >= 2"):
        datasets.planned_size("synthetic-iid:5,4,1")


def test_train_size_of_file_datasets_is_unknown_and_arguments_are_checked():
    assert datasets.train_size("mnist") is None and datasets.train_size("cifar10") is None
    for spec, message in [("digits:3", "no arguments"), ("mnist:1", "no arguments"), ("synthetic:-1", "α and β")]:
        with pytest.raises(ValueError, match=message):
            datasets.train_size(spec)
    with pytest.raises(ValueError, match="quadratic: m"):
        datasets.train_size("quadratic:0")


def test_to_parity(digits):
    p = to_parity(digits)
    assert p.num_classes == 2 and p.name == "digits:parity"
    np.testing.assert_array_equal(p.y_train, digits.y_train % 2)
    np.testing.assert_array_equal(p.y_test, digits.y_test % 2)
    assert p.x_train is digits.x_train


# MNIST --------------------------------------------------------------------------------------------------------


def _idx_bytes(array: np.ndarray, magic: int) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_mnist(folder, *, gz: bool, n_train: int = 12, n_test: int = 5, side: int = 28):
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": (rng.integers(0, 256, (n_train, side, side)), 2051),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10, 2049),
        "t10k-images-idx3-ubyte": (rng.integers(0, 256, (n_test, side, side)), 2051),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10, 2049),
    }
    for name, (array, magic) in arrays.items():
        data = _idx_bytes(array, magic)
        if gz:
            with gzip.open(folder / f"{name}.gz", "wb") as f:
                f.write(data)
        else:
            (folder / name).write_bytes(data)
    return {name: a for name, (a, _) in arrays.items()}


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_plain_and_gz(tmp_path, gz):
    arrays = _write_mnist(tmp_path, gz=gz)
    data = load_dataset("mnist", tmp_path, normalize="none")
    assert data.x_train.shape == (12, 1, 28, 28) and data.x_test.shape == (5, 1, 28, 28)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    np.testing.assert_array_equal(data.x_train[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(data.y_test, np.arange(5) % 10)
    unit = load_dataset("mnist", tmp_path, normalize="unit")
    np.testing.assert_allclose(unit.x_test, data.x_test / 255)
    std = load_dataset("mnist", tmp_path)
    assert abs(float(std.x_train.mean())) < 1e-5 and float(std.x_train.std()) == pytest.approx(1.0, abs=1e-4)


def test_mnist_torchvision_layout(tmp_path):
    _write_mnist(tmp_path / "MNIST" / "raw", gz=True)
    assert load_dataset("mnist", tmp_path).x_train.shape == (12, 1, 28, 28)


def test_mnist_missing_file(tmp_path):
    _write_mnist(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte") as err:
        load_dataset("mnist", tmp_path)
    assert str(tmp_path) in str(err.value) and "yann.lecun.com" in str(err.value)
    with pytest.raises(FileNotFoundError, match="data root"):
        load_dataset("mnist")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_dataset("mnist", tmp_path / "absent")


def test_mnist_malformed(tmp_path):
    _write_mnist(tmp_path, gz=False)
    labels = tmp_path / "train-labels-idx1-ubyte"
    good = labels.read_bytes()
    labels.write_bytes((2051).to_bytes(4, "big") + good[4:])
    with pytest.raises(ValueError, match="magic number 2051, expected 2049"):
        load_dataset("mnist", tmp_path)
    labels.write_bytes(good[:-3])
    with pytest.raises(ValueError, match="dimensions"):
        load_dataset("mnist", tmp_path)
    labels.write_bytes(_idx_bytes(np.arange(11) % 10, 2049))
    with pytest.raises(ValueError, match="12 images but 11 labels"):
        load_dataset("mnist", tmp_path)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ((2**31, 2**31, 4), "need 18446744073709551632 bytes, the file has 16"),  # 2^64 + 16: int64 wraps to 16
        ((2**32 - 1,) * 3, r"dimensions \(4294967295, 4294967295, 4294967295\) need"),  # unsigned, not -1
        ((12, 0, 0), "images of 0x0 pixels"),
        ((12, 2**31, 0), "images of 2147483648x0 pixels"),
        ((0, 28, 28), "holds no images"),
    ],
)
def test_an_impossible_idx_header_names_the_file(tmp_path, dims, message):
    _write_mnist(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes((2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims))
    with pytest.raises(ValueError, match=f"IDX file {path}.*{message}"):
        load_dataset("mnist", tmp_path)


def _flip_a_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def _bad_block_type(data: bytes) -> bytes:
    """The first deflate block given the reserved type 3 (zlib.error, not OSError, when read)."""
    assert data[3] & 0x08  # the header carries the file name, NUL-terminated, after its 10 fixed bytes
    start = data.index(b"\x00", 10) + 1
    return data[:start] + bytes([data[start] | 0b110]) + data[start + 1 :]


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: data[:5],  # cut inside the gzip header
        lambda data: b"not gzip at all" * 10,
        _flip_a_byte,  # the CRC no longer matches
        _bad_block_type,
        lambda data: data[:-8] + b"\x00" * 8,  # CRC and length zeroed
    ],
    ids=["truncated", "header-cut", "not-gzip", "byte-flipped", "bad-block-type", "trailer-zeroed"],
)
def test_a_corrupt_mnist_gz_names_the_file(tmp_path, damage):
    _write_mnist(tmp_path, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ValueError, match=f"IDX file {path}"):
        load_dataset("mnist", tmp_path)


# CIFAR-10 -----------------------------------------------------------------------------------------------------


def _write_cifar(folder, n: int = 4, protocol: int = 2):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"batch_label": name.encode(),
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)
        written[name] = batch
    return written


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_load(tmp_path, protocol):
    written = _write_cifar(tmp_path / "cifar-10-batches-py", protocol=protocol)
    data = load_dataset("cifar10", tmp_path, normalize="none")
    assert data.x_train.shape == (20, 3, 32, 32) and data.x_test.shape == (4, 3, 32, 32)
    assert data.input_shape == (3, 32, 32) and data.num_classes == 10
    np.testing.assert_array_equal(data.x_train[4:8].reshape(4, -1), written["data_batch_2"][b"data"])
    np.testing.assert_array_equal(data.y_test, written["test_batch"][b"labels"])
    std = load_dataset("cifar10", tmp_path)
    channel_means = std.x_train.astype(np.float64).mean(axis=(0, 2, 3))
    np.testing.assert_allclose(channel_means, 0.0, atol=1e-5)
    np.testing.assert_allclose(std.x_train.std(axis=(0, 2, 3)), 1.0, atol=1e-4)


def test_cifar10_batches_directly_in_root(tmp_path):
    _write_cifar(tmp_path)
    assert load_dataset("cifar10", tmp_path).x_test.shape == (4, 3, 32, 32)


def test_cifar10_missing_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    (folder / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3") as err:
        load_dataset("cifar10", tmp_path)
    assert str(folder) in str(err.value) and "cs.toronto.edu/~kriz/cifar.html" in str(err.value)


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_cifar10_refuses_foreign_globals(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    with open(folder / "data_batch_1", "wb") as f:
        pickle.dump({b"data": np.zeros((1, 3072), np.uint8), b"labels": [_Exploit()]}, f, protocol=2)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"CIFAR-10 batch {folder / 'data_batch_1'}: refusing to load global .*system"):
        load_dataset("cifar10", tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_cifar10_bad_content(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match=r"uint8 \[n, 3072\]"):
        load_dataset("cifar10", tmp_path)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump([1, 2, 3], f)
    with pytest.raises(ValueError, match="b'data'"):
        load_dataset("cifar10", tmp_path)
    whole = (folder / "data_batch_5").read_bytes()
    (folder / "data_batch_5").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"CIFAR-10 batch .*data_batch_5"):
        load_dataset("cifar10", tmp_path)
    for junk in (b"", os.urandom(500), b"\x80\x02}q\x00(X\x04\x00\x00\x00data"):
        (folder / "data_batch_5").write_bytes(junk)
        with pytest.raises(ValueError, match=r"CIFAR-10 batch .*data_batch_5"):
            load_dataset("cifar10", tmp_path)


@pytest.mark.parametrize(
    ("data", "labels", "message"),
    [
        (np.zeros((0, 3072), np.uint8), [], "test_batch holds no images"),
        (np.zeros((3, 3072), np.uint8), [1.7, 1.7, 1.7], "test_batch: b'labels' must be integers"),
        (np.zeros((3, 3072), np.uint8), [[1], [2], [3]], "test_batch: b'labels' must be a flat list"),
        (np.zeros((3, 3072), np.uint8), [[1, 2], [3]], "test_batch: b'labels' must be a flat list"),
        (np.zeros((3, 3072), np.uint8), "123", "test_batch: b'labels' must be a flat list"),
        (np.zeros((3, 3072), np.uint8), [1, 2], "3 images but 2 labels"),
    ],
)
def test_cifar10_refuses_empty_batches_and_labels_that_are_not_flat_integers(tmp_path, data, labels, message):
    _write_cifar(tmp_path)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": data, b"labels": labels}, f)
    with pytest.raises(ValueError, match=message):
        load_dataset("cifar10", tmp_path)


def test_cifar10_labels_may_be_an_integer_array(tmp_path):
    _write_cifar(tmp_path)
    with open(tmp_path / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((3, 3072), np.uint8), b"labels": np.array([1, 2, 9], np.uint8)}, f)
    assert load_dataset("cifar10", tmp_path).y_test.tolist() == [1, 2, 9]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("synthetic:1,1,1e12", r"of its 1,000,000,000,000 clients fit \(a smaller N in synthetic:α,β,N\)"),
        ("synthetic-iid:1e30", r"of its 1e\+30 clients fit \(a smaller N in synthetic-iid:N\)"),
        ("synthetic:1,1,30,60,1e12", r"drawing a model of 60×1,000,000,000,000 values .* classes fit"),
        ("synthetic-iid:30,1e300", r"features fit with 2 classes \(a smaller dim\)"),
    ],
)
def test_synthetic_too_large_for_memory_is_refused_before_anything_is_drawn(spec, message):
    from pyfedkern.sim.config import ExperimentConfig, check_data_memory

    with pytest.raises(ValueError, match=message) as err:
        check_data_memory(ExperimentConfig(dataset=spec, model="logreg"), 1 << 30)
    assert str(err.value).startswith(f"dataset {spec}") and " are available" in str(err.value)


def test_planned_size_of_huge_synthetic_sets_draws_nothing():
    """Beyond 10^7 clients the least they hold (50 samples each, 40 of them for training): no array of sizes."""
    assert datasets.planned_size("synthetic:1,1,1e12") == (40 * 10**12, 10 * 10**12, (60,))


def test_synthetic_memory_check_counts_the_classes():
    from pyfedkern.sim.config import ExperimentConfig, check_data_memory

    check_data_memory(ExperimentConfig(dataset="synthetic:1,1,2,60,10", model="logreg"), 10 << 20)  # fits
    with pytest.raises(ValueError, match="at most about 1,235 classes fit"):  # 2000 × (60 + 1001) float64: 16 MiB
        check_data_memory(ExperimentConfig(dataset="synthetic:1,1,2,60,2000", model="logreg"), 10 << 20)


def test_the_cli_refuses_a_synthetic_dataset_too_large_in_one_line(capsys):
    from pyfedkern.cli import main

    assert main(["run", "--dataset", "synthetic:1,1,30,60,1e12", "--model", "logreg", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "classes fit (a smaller classes)" in err
