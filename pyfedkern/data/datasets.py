"""Datasets for simulations, as NumPy arrays: x float32 [n, *input_shape], y int64 [n].

- ``digits``: scikit-learn's bundled 8×8 digits (no download), a seeded stratified 1347/450 split.
- ``synthetic:α,β[,clients[,dim[,classes]]]``: the synthetic(α, β) benchmark of Li et al. (FedProx), with natural
  clients (``client_ids``); every client has its own model, so no one model fits many clients.
- ``synthetic-iid[:clients[,dim[,classes]]]``: Li et al.'s synthetic IID set: the same model for every client, so one
  model fits them all, however many there are.
- ``mnist`` / ``cifar10``: read from files you download (``root``); nothing is fetched from the network.
- ``quadratic:m,d``: FedPBC's toy problem F_i(x) = ½‖x − u_i‖² (not a real dataset; see :func:`load_dataset`).
- ``leaf``: a LEAF dataset (FEMNIST, Shakespeare, Sent140) from the JSON files in ``root``, with its natural clients
  (:mod:`pyfedkern.data.leaf`).

Normalisation (``normalize``): ``"standard"`` subtracts the training set's mean and divides by its std (per feature
for digits/synthetic, per channel for MNIST/CIFAR-10), applied to train and test alike; ``"unit"`` scales pixels to
[0, 1] (synthetic: per-feature min-max of the training set); ``"none"`` keeps raw values (pixels 0..16 or 0..255).
"""

from __future__ import annotations

import gzip
import math
import pickle
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pyfedkern.data.dataset import Dataset
from pyfedkern.data.leaf import load_leaf
from pyfedkern.data.spec import parse_spec

DATASETS = ("digits", "synthetic", "synthetic-iid", "mnist", "cifar10", "quadratic", "leaf")
NORMALIZATIONS = ("standard", "unit", "none")

MNIST_URL = "http://yann.lecun.com/exdb/mnist/"
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
LEAF_URL = "https://github.com/TalwalkarLab/leaf"


def load_dataset(
    spec: str, root: str | Path | None = None, *, normalize: str = "standard", split_seed: int = 0
) -> Dataset:
    """Load the dataset named by ``spec`` (``"digits"``, ``"synthetic:1,1"``, ``"mnist"``, ...).

    ``root`` is the directory holding MNIST/CIFAR-10 files. ``split_seed`` seeds the digits train/test split and
    the generated data of synthetic and quadratic.

    ``quadratic:m,d`` (defaults 100, 100) carries FedPBC's targets u_i ~ N((i/1000)·1, 0.01·I), i = 1..m, as
    x_train = u (float32 [m, d]) with y_train = client_ids = arange(m); the test split is the same data, and
    ``normalize`` is ignored. Pair it with the ``quadratic`` model and the ``natural`` partition, so that client i
    holds exactly u_i.
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}")
    if isinstance(split_seed, bool) or not isinstance(split_seed, (int, np.integer)) or split_seed < 0:
        raise ValueError(f"split_seed must be an integer >= 0, got {split_seed!r}")
    name, args = parse_spec(spec, what="dataset", choices=DATASETS)
    if name == "synthetic":
        return _synthetic(args, normalize, int(split_seed))
    if name == "synthetic-iid":
        return _synthetic_iid(args, normalize, int(split_seed))
    if name == "quadratic":
        return _quadratic(args, int(split_seed))
    _no_arguments(name, args, spec)
    if name == "digits":
        return _digits(normalize, int(split_seed))
    if name == "leaf":
        return load_leaf(_require_root(root, "leaf", "train/ and test/ folders of LEAF *.json files", LEAF_URL))
    if name == "mnist":
        return _mnist(root, normalize)
    return _cifar10(root, normalize)


def train_size(spec: str, *, split_seed: int = 0) -> int | None:
    """The number of training samples ``load_dataset(spec, split_seed=split_seed)`` gives, found without loading
    it (digits, synthetic, synthetic-iid, quadratic; the arguments are checked); None for datasets read from files."""
    size = planned_size(spec, split_seed=split_seed)
    return None if size is None else size[0]


def planned_size(spec: str, *, split_seed: int = 0) -> tuple[int, int, tuple[int, ...]] | None:
    """(training samples, test samples, input shape) of ``load_dataset(spec, split_seed=split_seed)``, found
    without making the data (digits, synthetic, synthetic-iid, quadratic; the arguments are checked); None for
    datasets read from files. For a synthetic set of more than 10^7 clients, the least it can hold (50 samples a
    client): more than any memory holds in float32 with a few features."""
    name, args = parse_spec(spec, what="dataset", choices=DATASETS)
    if name in ("synthetic", "synthetic-iid"):
        clients, dim, _ = synthetic_shape(spec)
        if clients > _EXACT_SIZES_UP_TO:  # drawing the sizes would take memory: the least the clients hold
            least = _SYNTHETIC_MIN_SIZE
            return clients * _synthetic_train_part(least), clients * (least - _synthetic_train_part(least)), (dim,)
        sizes = _synthetic_sizes(np.random.default_rng(split_seed), clients)
        train = sum(_synthetic_train_part(n) for n in sizes.tolist())
        return train, int(sizes.sum()) - train, (dim,)
    if name == "quadratic":
        m, d = _quadratic_args(args)
        return m, m, (d,)
    _no_arguments(name, args, spec)
    return (_DIGITS_SAMPLES - _DIGITS_TEST, _DIGITS_TEST, (1, 8, 8)) if name == "digits" else None


def _no_arguments(name: str, args: list[float], spec: str) -> None:
    if args:
        raise ValueError(f"dataset {name!r} takes no arguments, got {spec!r}")


def to_parity(data: Dataset) -> Dataset:
    """The same data with labels y % 2 (even = 0, odd = 1) and 2 classes; the name gets a ``:parity`` suffix."""
    if data.name.startswith("quadratic"):
        raise ValueError("to_parity: the quadratic dataset has no class labels")
    return replace(
        data,
        name=f"{data.name}:parity",
        y_train=data.y_train % 2,
        y_test=data.y_test % 2,
        num_classes=2,
    )


# Normalisation ------------------------------------------------------------------------------------------------


def _normalize(
    x_train: np.ndarray, x_test: np.ndarray, mode: str, *, per: str, pixel_max: float | None
) -> tuple[np.ndarray, np.ndarray, str]:
    """Apply ``mode`` in place to float32 arrays; ``per`` is "feature" or "channel" (axis 1 of [n, C, H, W])."""
    if mode == "none":
        return x_train, x_test, "none"
    if mode == "unit":
        if pixel_max is not None:
            x_train /= pixel_max
            x_test /= pixel_max
            return x_train, x_test, f"unit: pixels / {pixel_max:g}"
        low, high = x_train.min(axis=0), x_train.max(axis=0)
        span = np.where(high > low, high - low, 1.0).astype(np.float32)
        for x in (x_train, x_test):
            x -= low
            x /= span
        return x_train, x_test, "unit: per-feature min-max of the train set"
    mean, std = _train_stats(x_train, per)
    for x in (x_train, x_test):
        x -= mean
        x /= std
    return x_train, x_test, f"standard: per-{per} train mean/std"


def _train_stats(x: np.ndarray, per: str, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Float64 mean and std (std 0 → 1) over samples, and over pixels too when ``per == "channel"``.

    Accumulated in chunks so a float64 copy of the whole set is never made. Returns float32 arrays that broadcast
    against x.
    """
    axes = (0,) if per == "feature" else (0, *range(2, x.ndim))
    total = np.zeros((), np.float64)
    sums = squares = None
    for start in range(0, x.shape[0], chunk):
        part = x[start : start + chunk].astype(np.float64)
        s, q = part.sum(axis=axes, keepdims=True), np.square(part).sum(axis=axes, keepdims=True)
        sums, squares = (s, q) if sums is None else (sums + s, squares + q)
        total += part.size / s.size
    mean = sums / total
    var = np.maximum(squares / total - mean**2, 0.0)
    std = np.sqrt(var)
    std[std < 1e-8] = 1.0
    return mean[0].astype(np.float32), std[0].astype(np.float32)


# digits, synthetic, quadratic --------------------------------------------------------------------------------


_DIGITS_SAMPLES, _DIGITS_TEST = 1797, 450


def _digits(normalize: str, split_seed: int) -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.data.astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=_DIGITS_TEST, stratify=y, random_state=split_seed
    )
    x_train, x_test, how = _normalize(
        np.ascontiguousarray(x_train), np.ascontiguousarray(x_test), normalize, per="feature", pixel_max=16.0
    )
    return Dataset("digits", x_train, y_train, x_test, y_test, 10, (1, 8, 8), how)


def _int_arg(value: float, what: str, minimum: int) -> int:
    if not np.isfinite(value) or value != int(value) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value:g}")
    return int(value)


#: The defaults of ``synthetic:α,β,clients,dim,classes``.
SYNTHETIC_DEFAULTS = (1.0, 1.0, 30.0, 60.0, 10.0)


def _synthetic_args(args: list[float]) -> tuple[float, float, int, int, int]:
    """Checked (α, β, clients, dim, classes) of ``synthetic:...``, defaults filled in."""
    if len(args) > 5:
        raise ValueError(f"dataset synthetic takes at most 5 arguments (α,β,clients,dim,classes), got {len(args)}")
    alpha, beta, clients, dim, classes = [*args, *SYNTHETIC_DEFAULTS[len(args) :]]
    if not (np.isfinite(alpha) and alpha >= 0 and np.isfinite(beta) and beta >= 0):
        raise ValueError(f"synthetic: α and β must be finite and >= 0, got α={alpha:g}, β={beta:g}")
    return (
        alpha,
        beta,
        _int_arg(clients, "synthetic: clients", 1),
        _int_arg(dim, "synthetic: dim", 1),
        _int_arg(classes, "synthetic: classes", 2),
    )


#: A synthetic client holds at least this many samples (train + test).
_SYNTHETIC_MIN_SIZE = 50
#: :func:`planned_size` draws the clients' sizes up to this many clients; beyond, it gives the least they hold.
_EXACT_SIZES_UP_TO = 10**7


def _synthetic_sizes(rng: np.random.Generator, clients: int) -> np.ndarray:
    """Samples per client (train + test): the first draw from the dataset's generator."""
    return np.minimum(rng.lognormal(4.0, 2.0, clients).astype(np.int64) + _SYNTHETIC_MIN_SIZE, 1000)


def _synthetic_train_part(size: int) -> int:
    return int(0.8 * size)


def synthetic_shape(spec: str) -> tuple[int, int, int]:
    """(clients, dim, classes) of a ``synthetic:...`` or ``synthetic-iid:...`` spec, its arguments checked."""
    name, args = parse_spec(spec, what="dataset", choices=("synthetic", "synthetic-iid"))
    return _synthetic_args(args)[2:] if name == "synthetic" else _synthetic_iid_args(args)


def _synthetic(args: list[float], normalize: str, seed: int) -> Dataset:
    """Li et al.'s synthetic(α, β): per client k, u_k ~ N(0, α²), B_k ~ N(0, β²), W_k, b_k ~ N(u_k, 1),
    v_k ~ N(B_k, 1) per feature, x ~ N(v_k, Σ) with Σ_jj = j^-1.2, y = argmax(W_k x + b_k).

    α and β default to 1, then 30 clients, dim 60, 10 classes. Client sizes are ⌊lognormal(4, 2)⌋ + 50, capped at
    1000; each client's samples split 80/20 train/test (train and test rows grouped by client).
    """
    alpha, beta, clients, dim, classes = _synthetic_args(args)
    rng = np.random.default_rng(seed)
    sizes = _synthetic_sizes(rng, clients)
    u = rng.normal(0.0, alpha, clients)
    b_shift = rng.normal(0.0, beta, clients)
    feature_std = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of Σ_jj = j^-1.2
    n_train = np.array([_synthetic_train_part(n) for n in sizes.tolist()], dtype=np.int64)
    n_test = sizes - n_train
    x_train, x_test = np.empty((n_train.sum(), dim), np.float32), np.empty((n_test.sum(), dim), np.float32)
    y_train, y_test = np.empty(n_train.sum(), np.int64), np.empty(n_test.sum(), np.int64)
    at_train, at_test = np.cumsum(n_train) - n_train, np.cumsum(n_test) - n_test  # client k's rows start here
    for group in _synthetic_groups(sizes, dim, classes):
        for k, x, y in _synthetic_clients(rng, group, sizes, u, b_shift, feature_std, classes):
            a, b, m = at_train[k], at_test[k], n_train[k]
            x_train[a : a + m], y_train[a : a + m] = x[:m], y[:m]
            x_test[b : b + n_test[k]], y_test[b : b + n_test[k]] = x[m:], y[m:]
    x_train, x_test, how = _normalize(x_train, x_test, normalize, per="feature", pixel_max=None)
    return Dataset(
        f"synthetic:{alpha:g},{beta:g},{clients},{dim},{classes}",
        x_train,
        y_train,
        x_test,
        y_test,
        classes,
        (dim,),
        how,
        client_ids=np.repeat(np.arange(clients, dtype=np.int64), n_train),
    )


_SYNTHETIC_DRAW = 1 << 22  # standard normals drawn per call (32 MiB)


def _synthetic_iid_args(args: list[float]) -> tuple[int, int, int]:
    """Checked (clients, dim, classes) of ``synthetic-iid:...``, defaults filled in."""
    if len(args) > 3:
        raise ValueError(f"dataset synthetic-iid takes at most 3 arguments (clients,dim,classes), got {len(args)}")
    clients, dim, classes = [*args, *SYNTHETIC_DEFAULTS[2 + len(args) :]]
    return (
        _int_arg(clients, "synthetic-iid: clients", 1),
        _int_arg(dim, "synthetic-iid: dim", 1),
        _int_arg(classes, "synthetic-iid: classes", 2),
    )


def _synthetic_iid(args: list[float], normalize: str, seed: int) -> Dataset:
    """Li et al.'s synthetic IID set: one W [dim, classes] and b [classes] ~ N(0, 1) for every client, x ~ N(0, Σ)
    with Σ_jj = j^-1.2, y = argmax(W x + b). Clients differ only in size (as in :func:`_synthetic`: ⌊lognormal(4,
    2)⌋ + 50, capped at 1000, split 80/20 train/test), so one model fits them all. Defaults: 30 clients, dim 60,
    10 classes."""
    clients, dim, classes = _synthetic_iid_args(args)
    rng = np.random.default_rng(seed)
    sizes = _synthetic_sizes(rng, clients)
    w, b = rng.standard_normal((dim, classes)), rng.standard_normal(classes)
    feature_std = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of Σ_jj = j^-1.2
    n_train = np.array([_synthetic_train_part(n) for n in sizes.tolist()], dtype=np.int64)
    # samples client after client; the first n_train[k] of client k are its training samples
    rank = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    is_train = rank < np.repeat(n_train, sizes)
    x_train, x_test = (
        np.empty((n_train.sum(), dim), np.float32),
        np.empty((sizes.sum() - n_train.sum(), dim), np.float32),
    )
    y_train, y_test = np.empty(len(x_train), np.int64), np.empty(len(x_test), np.int64)
    at_train = at_test = 0
    rows = max(1, _SYNTHETIC_DRAW // (dim + classes))  # x [rows, dim] and logits [rows, classes]
    for start in range(0, len(is_train), rows):
        train = is_train[start : start + rows]
        x = rng.standard_normal((len(train), dim)) * feature_std
        y = np.argmax(x @ w + b, axis=1)
        k, m = int(train.sum()), int((~train).sum())
        x_train[at_train : at_train + k], y_train[at_train : at_train + k] = x[train], y[train]
        x_test[at_test : at_test + m], y_test[at_test : at_test + m] = x[~train], y[~train]
        at_train, at_test = at_train + k, at_test + m
    x_train, x_test, how = _normalize(x_train, x_test, normalize, per="feature", pixel_max=None)
    return Dataset(
        f"synthetic-iid:{clients},{dim},{classes}",
        x_train,
        y_train,
        x_test,
        y_test,
        classes,
        (dim,),
        how,
        client_ids=np.repeat(np.arange(clients, dtype=np.int64), n_train),
    )


def _synthetic_groups(sizes: np.ndarray, dim: int, classes: int) -> list[np.ndarray]:
    """Consecutive clients whose draws (v, W, b, then x: dim + dim·classes + classes + n·dim normals each) make
    about one call of :data:`_SYNTHETIC_DRAW` normals."""
    per_client = dim + dim * classes + classes + sizes * dim
    cuts = np.searchsorted(np.cumsum(per_client), np.arange(_SYNTHETIC_DRAW, per_client.sum(), _SYNTHETIC_DRAW))
    return [g for g in np.split(np.arange(len(sizes)), np.unique(cuts)) if len(g)]


def _synthetic_clients(rng, group, sizes, u, b_shift, feature_std, classes):
    """(k, x_k, y_k) of the clients in ``group``, from one standard-normal draw for all of them.

    Bit for bit the per-client draws v ~ N(B_k, 1) [dim], W ~ N(u_k, 1) [dim, classes], b ~ N(u_k, 1) [classes],
    x = v + N(0, 1)[n_k, dim]·std (NumPy's normal(loc, 1) is loc + one standard normal, in stream order)."""
    dim = feature_std.size
    head = dim + dim * classes + classes
    lengths = head + sizes[group] * dim
    z = rng.standard_normal(int(lengths.sum()))
    starts = np.cumsum(lengths) - lengths
    for j, k in enumerate(group.tolist()):
        block = z[starts[j] : starts[j] + lengths[j]]
        v = b_shift[k] + block[:dim]
        w = u[k] + block[dim : dim + dim * classes].reshape(dim, classes)
        b = u[k] + block[dim + dim * classes : head]
        x = v + block[head:].reshape(-1, dim) * feature_std
        yield k, x, np.argmax(x @ w + b, axis=1)


def _quadratic_args(args: list[float]) -> tuple[int, int]:
    """Checked (m, d) of ``quadratic:m,d``, defaults filled in."""
    if len(args) > 2:
        raise ValueError(f"dataset quadratic takes at most 2 arguments (m,d), got {len(args)}")
    m, d = [*args, *(100.0, 100.0)[len(args) :]]
    return _int_arg(m, "quadratic: m (clients)", 1), _int_arg(d, "quadratic: d (dimension)", 1)


def _quadratic(args: list[float], seed: int) -> Dataset:
    m, d = _quadratic_args(args)
    rng = np.random.default_rng(seed)
    centres = np.arange(1, m + 1, dtype=np.float64)[:, None] / 1000.0
    u = (centres + 0.1 * rng.standard_normal((m, d))).astype(np.float32)
    ids = np.arange(m, dtype=np.int64)
    return Dataset(f"quadratic:{m},{d}", u, ids, u.copy(), ids.copy(), m, (d,), "none", client_ids=ids.copy())


# MNIST ----------------------------------------------------------------------------------------------------------

_MNIST_FILES = {
    "train_x": ("train-images-idx3-ubyte", 2051),
    "train_y": ("train-labels-idx1-ubyte", 2049),
    "test_x": ("t10k-images-idx3-ubyte", 2051),
    "test_y": ("t10k-labels-idx1-ubyte", 2049),
}


def _require_root(root: str | Path | None, dataset: str, layout: str, url: str) -> Path:
    if root is None:
        raise FileNotFoundError(
            f"dataset {dataset!r} needs a data root (data_root / --data-root): a directory holding {layout}; "
            f"get the files from {url}"
        )
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{dataset} data root {str(path)!r} is not a directory; get the files from {url}")
    return path


def _mnist(root: str | Path | None, normalize: str) -> Dataset:
    base = _require_root(root, "mnist", "the four IDX files (optionally .gz, or under MNIST/raw/)", MNIST_URL)
    folders = [base, base / "MNIST" / "raw", base / "raw"]
    arrays = {}
    for key, (stem, magic) in _MNIST_FILES.items():
        candidates = [folder / name for folder in folders for name in (stem, f"{stem}.gz")]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            looked = ", ".join(str(f) for f in folders)
            raise FileNotFoundError(
                f"MNIST file {stem} (or {stem}.gz) not found; looked in {looked}. Download it from {MNIST_URL} "
                f"or with torchvision.datasets.MNIST(root, download=True)"
            )
        arrays[key] = _read_idx(path, magic)
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"MNIST {split}: {images.shape[0]} images but {labels.shape[0]} labels")
        if labels.size and labels.max() > 9:
            raise ValueError(f"MNIST {split}: label {int(labels.max())} out of range 0..9")
    if arrays["train_x"].shape[1:] != arrays["test_x"].shape[1:]:
        raise ValueError(f"MNIST: train images {arrays['train_x'].shape[1:]} vs test {arrays['test_x'].shape[1:]}")
    rows, cols = arrays["train_x"].shape[1:]
    x_train = arrays["train_x"].astype(np.float32).reshape(-1, 1, rows, cols)
    x_test = arrays["test_x"].astype(np.float32).reshape(-1, 1, rows, cols)
    x_train, x_test, how = _normalize(x_train, x_test, normalize, per="channel", pixel_max=255.0)
    y_train, y_test = arrays["train_y"].astype(np.int64), arrays["test_y"].astype(np.int64)
    return Dataset("mnist", x_train, y_train, x_test, y_test, 10, (1, rows, cols), how)


def _read_idx(path: Path, magic: int) -> np.ndarray:
    """An IDX file (big-endian header: magic 2051 = images [n, rows, cols] or 2049 = labels [n]) as uint8."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as err:  # a damaged .gz raises any of the three
        raise ValueError(f"cannot read IDX file {path}: {err}") from None
    ndim, kind = (3, "images") if magic == 2051 else (1, "labels")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"IDX file {path} is truncated: {len(raw)} bytes, header needs {header}")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise ValueError(f"IDX file {path}: magic number {found}, expected {magic} (an MNIST {kind} file)")
    dims = tuple(int.from_bytes(raw[4 * i : 4 * i + 4], "big") for i in range(1, ndim + 1))  # unsigned 32-bit
    expected = header + math.prod(dims)  # a Python int: dimensions near 2^32 cannot overflow it
    if len(raw) != expected:
        raise ValueError(f"IDX file {path}: dimensions {dims} need {expected} bytes, the file has {len(raw)}")
    if dims[0] == 0:
        raise ValueError(f"IDX file {path} holds no {kind}")
    if ndim == 3 and 0 in dims[1:]:
        raise ValueError(f"IDX file {path}: images of {dims[1]}x{dims[2]} pixels; each needs at least one pixel")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


# CIFAR-10 ---------------------------------------------------------------------------------------------------------


def _latin1_encode(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for bytes objects, limited to latin-1."""
    if encoding.lower().replace("_", "-") not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return text.encode("latin-1")


def _numpy_globals() -> dict[tuple[str, str], Any]:
    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # NumPy < 2
        from numpy.core import multiarray, numeric
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
    }
    for module in ("numpy.core", "numpy._core"):
        allowed[(f"{module}.multiarray", "_reconstruct")] = multiarray._reconstruct
        allowed[(f"{module}.numeric", "_frombuffer")] = numeric._frombuffer
    return allowed


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only resolves the globals NumPy arrays need; any other global is refused unresolved."""

    _allowed = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: CIFAR batches only contain NumPy arrays and lists"
            ) from None


def _load_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 python batch: images uint8 [n, 3, 32, 32] and labels int64 [n]."""
    try:
        with open(path, "rb") as f:
            batch = _ArrayUnpickler(f, encoding="bytes").load()
    except pickle.UnpicklingError as err:  # refused globals included
        raise ValueError(f"CIFAR-10 batch {path}: {err}") from None
    except Exception as err:  # whatever else a damaged pickle raises (EOFError, TypeError, ...)
        raise ValueError(f"CIFAR-10 batch {path} is not a readable pickle ({type(err).__name__}: {err})") from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"CIFAR-10 batch {path}: expected a dict with keys b'data' and b'labels'")
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        got = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"CIFAR-10 batch {path}: b'data' must be uint8 [n, 3072], got {got}")
    if data.shape[0] == 0:
        raise ValueError(f"CIFAR-10 batch {path} holds no images")
    labels = batch[b"labels"]
    try:
        labels = np.asarray(labels) if isinstance(labels, (list, np.ndarray)) else None
    except ValueError:  # a ragged nested list
        labels = None
    if labels is None or labels.ndim != 1:
        raise ValueError(f"CIFAR-10 batch {path}: b'labels' must be a flat list (or 1-D array) of integers")
    if labels.shape[0] != data.shape[0]:
        raise ValueError(f"CIFAR-10 batch {path}: {data.shape[0]} images but {labels.shape[0]} labels")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"CIFAR-10 batch {path}: b'labels' must be integers, got {labels.dtype} values")
    labels = labels.astype(np.int64)
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"CIFAR-10 batch {path}: labels must be in 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar10(root: str | Path | None, normalize: str) -> Dataset:
    base = _require_root(root, "cifar10", "cifar-10-batches-py/ (the python version)", CIFAR10_URL)
    folder = base / "cifar-10-batches-py" if (base / "cifar-10-batches-py").is_dir() else base
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"CIFAR-10 file {name} not found in {folder}; download 'CIFAR-10 python version' from "
                f"{CIFAR10_URL} and extract it into {base}"
            )
    batches = [_load_cifar_batch(folder / name) for name in names]
    x_train = np.concatenate([b[0] for b in batches[:5]]).astype(np.float32)
    y_train = np.concatenate([b[1] for b in batches[:5]])
    x_test, y_test = batches[5][0].astype(np.float32), batches[5][1]
    x_train, x_test, how = _normalize(x_train, x_test, normalize, per="channel", pixel_max=255.0)
    return Dataset("cifar10", x_train, y_train, x_test, y_test, 10, (3, 32, 32), how)
