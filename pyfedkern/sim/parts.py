"""An experiment's parts: the model (:class:`~pyfedkern.models.ModelSpec`), the data
(:class:`~pyfedkern.data.dataset.Dataset`) and its split among clients, with the checks they pass before any
training. :func:`parts_from_config` is the one place a config's names become parts; :func:`model_spec`,
:func:`from_arrays` and :func:`split` make them from the user's own objects
(:class:`~pyfedkern.sim.experiment.Experiment`). The engine (:class:`~pyfedkern.sim.engine.Simulation`) takes parts,
whichever way they were made, and checks the model (:func:`check_model`) before any training.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from pyfedkern import models
from pyfedkern.data import datasets, partitions
from pyfedkern.data.spec import import_object, is_reference
from pyfedkern.sim.config import check_client_count

if TYPE_CHECKING:
    from pyfedkern.algorithms import LocalModel
    from pyfedkern.sim.config import ExperimentConfig

_INTEGER_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_PUBLIC = 5  # the public set's random stream (after the seed), as the engine's other streams
#: ``evaluate(model, x, y)`` → {metric name: value}: the user's own metrics of the global model on the test set.
Evaluate = Callable[[nn.Module, torch.Tensor, torch.Tensor], dict[str, float]]


@dataclass
class Parts:
    """What the engine trains: the model, the data, the clients' training samples (``partition.client_indices``:
    int64 arrays of positions in ``data.x_train``), the training samples held out as a labelled public set (for
    algorithms that need one; empty otherwise), and the user's evaluation function (None: loss and accuracy only).
    """

    model: models.ModelSpec
    data: datasets.Dataset
    partition: partitions.Partition
    public: np.ndarray
    evaluate: Evaluate | None = None


# config → parts ---------------------------------------------------------------------------------------------------


def parts_from_config(config: ExperimentConfig, public_per_class: int = 0) -> Parts:
    """The parts a config names: built-in or ``module:attr`` model and dataset, split as ``config.partition`` says
    (``public_per_class`` samples per class held out first, for algorithms that need a public set)."""
    if is_reference(config.model):
        factory = _with_keywords(import_object(config.model, "model"), config.model_params)
        spec = models.ModelSpec(factory=factory, name=config.model)
    else:
        spec = models.builtin(config.model, **config.model_params)
    data = load_data(config.dataset, config.data_root, config.normalize)
    by = (data.y_train, data.num_classes)  # partitions follow the original classes, also for the parity task
    if config.parity:
        data = datasets.to_parity(data)
    partition, public = split(
        data, config.partition, config.clients, seed=config.seed, public_per_class=public_per_class, by=by
    )
    return Parts(spec, data, partition, public)


def load_data(dataset: str, root: str | None = None, normalize: str = "standard") -> datasets.Dataset:
    """The checked data of a built-in dataset name (``datasets.load_dataset``) or a ``module:factory`` reference."""
    if is_reference(dataset):
        data = as_dataset(call_factory(import_object(dataset, "dataset"), "dataset", root=root), dataset)
    else:
        data = datasets.load_dataset(dataset, root, normalize=normalize)
    check_data(data)
    return data


def call_factory(factory: Callable[..., Any], what: str, **offered: Any) -> Any:
    """``factory`` called with the keywords of ``offered`` its signature accepts (all of them with ``**kwargs``);
    ValueError naming ``what`` when it raises (its traceback as the cause)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing
        parameters = []
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    kwargs = {k: v for k, v in offered.items() if takes_all or k in names}
    try:
        return factory(**kwargs)
    except Exception as err:
        name = getattr(factory, "__name__", type(factory).__name__)
        raise ValueError(f"{what}: the factory {name} raised {type(err).__name__}: {err}") from err


def _with_keywords(factory: Callable[..., nn.Module], params: dict[str, Any]) -> Callable[..., nn.Module]:
    if not params:
        return factory

    def build(**kwargs: Any) -> nn.Module:
        return factory(**kwargs, **params)

    return build


# the user's objects → parts ---------------------------------------------------------------------------------------


def model_spec(
    model: Any,
    *,
    loss: Callable | None = None,
    penalty: Callable | None = None,
    predict: Callable | None = None,
) -> models.ModelSpec:
    """A :class:`ModelSpec` from a built-in name, a ``module:attr`` factory, an ``nn.Module`` (each run trains a
    copy of it), a factory or a ModelSpec; ``loss``, ``penalty`` and ``predict`` replace its own when given."""
    if isinstance(model, models.ModelSpec):
        spec = model
    elif isinstance(model, str):
        if is_reference(model):
            spec = models.ModelSpec(factory=import_object(model, "model"), name=model)
        else:
            spec = models.builtin(model)
    elif isinstance(model, nn.Module):
        spec = models.ModelSpec(factory=lambda: copy.deepcopy(model), name=type(model).__name__)
    elif callable(model):
        spec = models.ModelSpec(factory=model, name=getattr(model, "__name__", type(model).__name__))
    else:
        raise TypeError(f"model must be an nn.Module, a factory, a built-in name or a ModelSpec, got {type(model)}")
    given = {"loss": loss, "penalty": penalty, "predict": predict}
    for key, value in given.items():
        if value is not None and not callable(value):
            raise TypeError(f"{key} must be callable, got {type(value).__name__}")
    return replace(spec, **{k: v for k, v in given.items() if v is not None})


def as_dataset(made: Any, name: str, *, num_classes: int | None = None) -> datasets.Dataset:
    """A Dataset from what a dataset factory returns: a Dataset, or ``(train, test)`` with each ``(x, y)`` arrays or
    tensors or a map-style dataset of ``(x, y)`` pairs (see :func:`arrays`)."""
    if isinstance(made, datasets.Dataset):
        return made
    if not (isinstance(made, (tuple, list)) and len(made) == 2):
        raise ValueError(
            f"dataset {name!r}: expected a pyfedkern Dataset or a (train, test) pair, got {type(made).__name__}"
        )
    return from_arrays(made[0], made[1], name=name, num_classes=num_classes)


def from_arrays(train: Any, test: Any, *, name: str = "data", num_classes: int | None = None) -> datasets.Dataset:
    """A Dataset of the user's train and test data (see :func:`arrays`). Integer targets are class labels
    (``num_classes`` defaults to the largest label + 1); float targets are regression targets (no classes)."""
    x_train, y_train = arrays(train, "train")
    x_test, y_test = arrays(test, "test")
    if y_train.shape[1:] != y_test.shape[1:] or (y_train.dtype.kind == "f") != (y_test.dtype.kind == "f"):
        raise ValueError(
            f"test: targets {y_test.dtype} {y_test.shape[1:]}, but train has {y_train.dtype} {y_train.shape[1:]}"
        )
    classes = y_train.dtype.kind in "iu"
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
            raise ValueError(f"num_classes must be an integer >= 1, got {num_classes!r}")
        if not classes:
            raise ValueError(f"num_classes={num_classes} given, but the targets are {y_train.dtype}, not class labels")
    elif classes:
        num_classes = int(max(y_train.max(), y_test.max(initial=0))) + 1
    return datasets.Dataset(name, x_train, y_train, x_test, y_test, num_classes, x_train.shape[1:], "as given")


def arrays(part: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(x [n, ...], y [n, ...]) NumPy arrays of ``part``: an ``(x, y)`` pair of arrays or tensors, or a map-style
    dataset (``len`` and ``[i]`` → an (x, y) pair), read once into arrays. Booleans and other non-numeric data are
    refused."""
    if isinstance(part, (tuple, list)) and len(part) == 2:
        x, y = (_numeric(v, f"{what}: {axis}") for v, axis in zip(part, ("x", "y"), strict=True))
    elif hasattr(part, "__len__") and hasattr(part, "__getitem__") and not isinstance(part, (str, bytes)):
        x, y = _read_samples(part, what)
    else:
        raise TypeError(
            f"{what} must be an (x, y) pair of arrays or tensors, or a map-style dataset, got {type(part).__name__}"
        )
    if x.ndim == 0 or y.ndim == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(f"{what}: x {x.shape} and y {y.shape} must have one row per sample, the same number")
    if x.shape[0] == 0:
        raise ValueError(f"{what}: no samples")
    return x, y


def _read_samples(dataset: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(x [n, ...], y [n, ...]) of the ``len(dataset)`` samples ``dataset[i]``, each an (x, y) pair shaped as the
    first; the error names the split (``what``), the sample and what the dataset raised."""
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{what}: the dataset is empty")
    xs, ys = [], []
    for i in range(n):
        try:
            pair = dataset[i]
        except Exception as err:  # whatever the user's dataset raises
            raise ValueError(
                f"{what}: sample {i} of the dataset's {n} (its len()) cannot be read: {type(err).__name__}: {err}"
            ) from err
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"{what}: sample {i} must be an (x, y) pair, got {pair!r:.60}")
        for axis, value, out in (("x", pair[0], xs), ("y", pair[1], ys)):
            array = _numeric(value, f"{what}: sample {i}'s {axis}")
            if out and array.shape != out[0].shape:
                raise ValueError(f"{what}: sample {i}'s {axis} has shape {array.shape}, but sample 0's {out[0].shape}")
            out.append(array)
    return np.stack(xs), np.stack(ys)


def _numeric(value: Any, what: str) -> np.ndarray:
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype.kind not in "iuf":
        raise TypeError(f"{what} must hold numbers (integers or floats), got {array.dtype}")
    if array.dtype.kind == "u":
        array = array.astype(np.int64)
    return np.ascontiguousarray(array) if array.ndim else array


def check_data(data: datasets.Dataset) -> None:
    """ValueError naming the split: NaN or inf in features or targets, class labels outside 0..num_classes−1, train
    and test samples of different shapes."""
    if data.x_train.shape[1:] != data.x_test.shape[1:]:
        raise ValueError(f"test: samples of shape {data.x_test.shape[1:]}, but train has {data.x_train.shape[1:]}")
    for split in ("train", "test"):
        x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
        for axis, array in (("features", x), ("targets", y)):
            if array.dtype.kind != "f":
                continue
            for start in range(0, array.shape[0], 4096):  # in chunks: no mask as large as the data
                finite = np.isfinite(array[start : start + 4096].reshape(min(4096, array.shape[0] - start), -1))
                if not finite.all():
                    row = start + int(np.flatnonzero(~finite.all(axis=1))[0])
                    raise ValueError(f"{split}: the {axis} hold NaN or inf (first in sample {row})")
        if data.num_classes is not None and y.size:
            bad = np.flatnonzero((y < 0) | (y >= data.num_classes))
            if bad.size:
                raise ValueError(
                    f"{split}: label {int(y.flat[bad[0]])} (sample {int(bad[0])}) is outside the "
                    f"{data.num_classes} classes 0..{data.num_classes - 1}"
                )


# the split --------------------------------------------------------------------------------------------------------


def split(
    data: datasets.Dataset,
    clients: Any,
    num_clients: int | None = None,
    *,
    seed: int = 0,
    public_per_class: int = 0,
    allow_overlap: bool = False,
    by: tuple[np.ndarray, int | None] | None = None,
) -> tuple[partitions.Partition, np.ndarray]:
    """(partition, public set) of ``data``'s training samples.

    ``clients``: a partition spec (``"dirichlet:0.3"``, ``"natural"`` for the data's own ``client_ids``, ...) for
    ``num_clients`` clients; index lists (one sequence of sample positions per client; overlapping ones only with
    ``allow_overlap``); or one client id per training sample (a flat integer sequence: its natural clients). With
    a spec, the public set (``public_per_class`` samples of each class) is held out first; with index lists or ids,
    it is drawn from the samples no client holds. ``by``: the (labels, classes) a spec splits by (default the
    data's).
    """
    n = len(data.y_train)
    labels, classes = (data.y_train, data.num_classes) if by is None else by
    if isinstance(clients, str):
        public = _carve_public(data.y_train, data.num_classes, public_per_class, seed, np.arange(n))
        rest = np.setdiff1d(np.arange(n), public)
        if num_clients is None:
            raise ValueError("num_clients is needed with a partition spec")
        if labels.dtype.kind not in "iu" and partitions.parse_partition(clients, num_clients)[0] not in (
            "iid",
            "quantity",
            "noise",
            "natural",
        ):
            raise ValueError(f"partition {clients!r} splits by class, but the targets are not class labels")
        check_client_count(num_clients, rest.size, data.name)
        partition = partitions.make_partition(
            clients,
            labels[rest] if labels.dtype.kind in "iu" else np.zeros(rest.size, np.int64),
            num_clients,
            seed=seed,
            num_classes=classes,
            client_ids=None if data.client_ids is None else data.client_ids[rest],
        )
        partition.client_indices = [rest[ix] for ix in partition.client_indices]
        empty = [i for i, ix in enumerate(partition.client_indices) if ix.size == 0]
        if empty:
            raise ValueError(f"partition {clients!r} left clients {empty[:10]} without data; use fewer clients")
        return partition, public
    lists = _client_lists(clients, n, allow_overlap)
    if num_clients is not None and num_clients != len(lists):
        raise ValueError(f"num_clients={num_clients}, but clients lists {len(lists)} clients")
    held = np.zeros(n, bool)
    for ix in lists:
        held[ix] = True
    public = _carve_public(data.y_train, data.num_classes, public_per_class, seed, np.flatnonzero(~held))
    return partitions.Partition("given", lists), public


def _client_lists(clients: Any, n: int, allow_overlap: bool) -> list[np.ndarray]:
    """Checked int64 index arrays of ``clients`` (index lists, or one client id per sample)."""
    if isinstance(clients, (np.ndarray, torch.Tensor)) and clients.ndim == 2:  # equal-sized lists as rows
        clients = list(clients)
    if (isinstance(clients, (np.ndarray, torch.Tensor)) and clients.ndim == 1) or (
        isinstance(clients, Sequence) and clients and all(isinstance(c, numbers.Integral) for c in clients)
    ):
        ids = np.asarray(clients.cpu() if isinstance(clients, torch.Tensor) else clients)
        if ids.dtype.kind not in "iu" or ids.shape != (n,):
            raise ValueError(
                f"clients: per-sample client ids must be {n} integers (one per training sample), "
                f"got {ids.dtype} {ids.shape}"
            )
        distinct, inverse = np.unique(ids, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        return np.split(order.astype(np.int64), np.cumsum(np.bincount(inverse, minlength=distinct.size))[:-1])
    if not isinstance(clients, Sequence) or isinstance(clients, (str, bytes)) or not clients:
        raise TypeError("clients must be a partition spec, a non-empty list of index lists, or per-sample client ids")
    lists = []
    for i, ix in enumerate(clients):
        array = np.asarray(ix.cpu() if isinstance(ix, torch.Tensor) else ix)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ValueError(f"clients[{i}]: expected a 1-D list of sample indices, got {array.dtype} {array.shape}")
        if array.size == 0:
            raise ValueError(f"clients[{i}] is empty: every client needs at least one training sample")
        if array.min() < 0 or array.max() >= n:
            bad = int(array[(array < 0) | (array >= n)][0])
            raise ValueError(f"clients[{i}]: index {bad} is out of range for the {n} training samples (0..{n - 1})")
        if np.unique(array).size != array.size:
            raise ValueError(f"clients[{i}] lists a sample twice")
        lists.append(array.astype(np.int64))
    if not allow_overlap:
        owner = np.full(n, -1)
        for i, ix in enumerate(lists):
            taken = owner[ix] >= 0
            if taken.any():
                j = int(ix[taken][0])
                raise ValueError(
                    f"clients[{i}] and clients[{int(owner[j])}] both hold sample {j}; pass allow_overlap=True "
                    "if clients may share samples"
                )
            owner[ix] = i
    return lists


def _carve_public(labels: np.ndarray, num_classes: int | None, per_class: int, seed: int, pool: np.ndarray):
    """``per_class`` samples of every class drawn from ``pool`` (sorted positions), or none when per_class is 0."""
    if per_class <= 0:
        return np.zeros(0, dtype=np.int64)
    if num_classes is None:
        raise ValueError("the algorithm needs a labelled public set, but the targets are not class labels")
    rng = np.random.default_rng([seed, _PUBLIC])
    chosen = []
    for c in range(num_classes):
        candidates = pool[labels[pool] == c]
        if len(candidates) < 2 * per_class:
            raise ValueError(
                f"public set: class {c} has {len(candidates)} training samples, too few to hold out {per_class}"
            )
        chosen.append(rng.choice(candidates, per_class, replace=False))
    return np.sort(np.concatenate(chosen))


# the model --------------------------------------------------------------------------------------------------------


def build_module(spec: models.ModelSpec, data: datasets.Dataset) -> nn.Module:
    """A fresh module from ``spec.factory`` (offered ``input_shape`` and ``num_classes``); ValueError naming the
    model when the factory raises, TypeError when it returns no module with parameters."""
    module = call_factory(
        spec.factory, f"model {spec.name!r}", input_shape=tuple(data.input_shape), num_classes=data.num_classes
    )
    if not isinstance(module, nn.Module):
        raise TypeError(f"model {spec.name!r}: the factory returned a {type(module).__name__}, not an nn.Module")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(f"model {spec.name!r} has no trainable parameters")
    if isinstance(module, (models.CharLSTM, models.TransformerClassifier)):
        _check_tokens(spec.name, data, module.embedding.num_embeddings)
    return module


def _check_tokens(name: str, data: datasets.Dataset, vocab: int) -> None:
    """ValueError naming the first training or test sample with a token id outside 0..vocab−1 (a built-in sequence
    model's embedding), suggesting the vocab that holds them all."""
    for split in ("train", "test"):
        x = getattr(data, f"x_{split}")
        if x.size == 0 or (x.min() >= 0 and x.max() < vocab):
            continue
        outside = (x < 0) | (x >= vocab)
        row = int(np.flatnonzero(outside.reshape(len(x), -1).any(axis=1))[0])
        value = x[row][outside[row]][0].item()
        if value < 0:
            fix = "token ids must be >= 0"
        else:
            needed = int(max(data.x_train.max(initial=0), data.x_test.max(initial=0))) + 1
            fix = f"pass --model-param vocab={needed} (models.builtin({name!r}, vocab={needed}))"
        raise ValueError(
            f"model {name!r}: {split} sample {row} holds token id {value}, outside the model's vocabulary "
            f"0..{vocab - 1}; {fix}"
        )


def check_model(local: LocalModel, name: str, x: torch.Tensor, y: torch.Tensor, num_classes: int | None) -> None:
    """ValueError, before any training, when the model's output on two training samples does not fit the targets,
    the loss or the prediction: the forward pass or the loss raises, the loss is not a finite scalar with a
    gradient, with the default cross-entropy the model scores fewer classes than the labels have or float targets
    are not class probabilities [B, C ≥ 2] shaped like the output, or (with accuracy) ``predict`` does not return
    integer classes [B]."""
    module = local.module
    was_training = module.training
    module.eval()  # no batch statistics updated, no dropout drawn
    try:
        out = module(x)
    except Exception as err:
        raise ValueError(
            f"model {name!r} fails on a batch of training samples x {tuple(x.shape)} ({type(err).__name__}: {err})"
        ) from err
    finally:
        module.train(was_training)
    if not isinstance(out, torch.Tensor) or out.shape[:1] != x.shape[:1]:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"model {name!r}: its output must be a tensor with one row per sample, got {got}")
    if local.loss is torch.nn.functional.cross_entropy and num_classes is not None:
        if out.dim() < 2 or out.shape[1] < num_classes:
            raise ValueError(
                f"model {name!r}: its output {tuple(out.shape)} must score the {num_classes} classes of the labels "
                f"([B, {num_classes}] logits for the cross-entropy loss)"
            )
    if local.loss is torch.nn.functional.cross_entropy and y.is_floating_point():  # read as class probabilities
        probabilities = y.dim() == 2 and y.shape[1] >= 2 and bool((y >= 0).all())
        if not probabilities or out.shape != y.shape or not torch.allclose(y.sum(1), y.new_ones(()), atol=1e-3):
            raise ValueError(
                "loss: the default cross-entropy reads float targets as class probabilities ([B, C] rows of C >= 2 "
                f"non-negative numbers summing to 1, shaped like the output); got targets {tuple(y.shape)} and output "
                f"{tuple(out.shape)}: pass a loss for regression targets, e.g. loss=F.mse_loss"
            )
    try:
        value = local.objective(out, y)
    except Exception as err:
        raise ValueError(
            f"loss: fails on the model's output {tuple(out.shape)} and the targets {tuple(y.shape)} "
            f"({type(err).__name__}: {err})"
        ) from err
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        raise ValueError("loss: must return a scalar tensor that depends on the model's parameters")
    if not torch.isfinite(value):
        raise ValueError(f"loss: is {value.item()} on two training samples at the initial model")
    if local.has_accuracy:
        _check_predict(local, out.detach())


def _check_predict(local: LocalModel, out: torch.Tensor) -> None:
    """ValueError naming ``predict`` when it raises on the output [B, ...] or returns anything but integer classes
    [B] (compared with the labels [B] for the accuracy)."""
    try:
        with torch.no_grad():
            pred = local.predict(out)
    except Exception as err:
        raise ValueError(
            f"predict: fails on the model's output {tuple(out.shape)} ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(pred, torch.Tensor) or pred.shape != out.shape[:1] or pred.dtype not in _INTEGER_DTYPES:
        got = f"{pred.dtype} {tuple(pred.shape)}" if isinstance(pred, torch.Tensor) else type(pred).__name__
        raise ValueError(
            f"predict: must return integer classes [B], one per sample; got {got} for the output {tuple(out.shape)}"
        )


# resume fingerprint -------------------------------------------------------------------------------------------------


def fingerprint(parts: Parts, module: nn.Module) -> dict[str, str]:
    """Digests of what a run trains on: the model's structure (layers, parameter names and shapes, which are frozen,
    loss), the training data, the test data and the split (client lists and public set)."""

    def digest(*chunks: Any) -> str:
        h = hashlib.blake2b(digest_size=16)
        for chunk in chunks:
            h.update(chunk.tobytes() if isinstance(chunk, np.ndarray) else str(chunk).encode())
            h.update(b"|")
        return h.hexdigest()

    spec, data = parts.model, parts.data
    shapes = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    # names, not reprs: a partial's or a callable object's repr can hold a memory address, new in every process
    scoring = [getattr(f, "__qualname__", type(f).__qualname__) for f in (spec.loss, spec.penalty, spec.predict)]
    return {
        "model structure": digest(repr(module), shapes, scoring, *([frozen] if frozen else [])),
        "training data": digest(data.x_train.dtype, data.x_train.shape, data.x_train, data.y_train.dtype, data.y_train),
        "test data": digest(data.x_test.dtype, data.x_test.shape, data.x_test, data.y_test.dtype, data.y_test),
        "client split": digest(*[np.asarray(ix) for ix in parts.partition.client_indices], "public", parts.public),
    }
