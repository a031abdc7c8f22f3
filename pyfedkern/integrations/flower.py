"""pyfedkern inside Flower (flwr): drop-in aggregation, streaming strategies, and ClientApp helpers.

Server side (Flower's Message API, ``flwr.serverapp``):

- :func:`aggregate` / :func:`aggregate_inplace`: drop-in replacements of ``flwr.server.strategy.aggregate.aggregate``
  (Flower's results bit for bit, in its dtypes) and ``aggregate_inplace`` computed with
  :func:`pyfedkern.ops.weighted_sum`: one pass over the inputs, one output model of memory, inputs untouched.
- :class:`FedAvg`: ``flwr.serverapp.strategy.FedAvg`` that folds each reply into one running weighted mean per
  array as the reply arrives (:func:`pyfedkern.ops.weighted_sum` on a zero-copy view of the reply's bytes), so
  aggregation needs one model of memory instead of one per client. Its ``start`` pulls replies from the SuperLink
  as they come instead of waiting for the slowest node.
- :class:`FedPBC`, :class:`BHerd`, :class:`FedSpeed`, :class:`DynamicInit`: the papers' server steps on top of it.
- Central DP: ``FedAvg(central_dp=...)`` clips the replies' updates and sums them in one fused op
  (:func:`pyfedkern.ops.clip_accumulate`) and adds the noise of :class:`pyfedkern.privacy.CentralDP` (the
  simulator's, from the same seeded stream); :func:`central_dp_of` builds it from a config's ``dp-*`` keys. The
  strategies also run inside Flower's own wrappers (``DifferentialPrivacyServerSideFixedClipping``, and
  ``DifferentialPrivacyClientSideFixedClipping`` with ``make_client_app(mods=[fixedclipping_mod])``).
- :class:`LegacyFedAvg`: the same for the legacy ``flwr.server.strategy.FedAvg.aggregate_fit``.
- :func:`mean_metrics` (the strategies' train-metric aggregation: real measurements only) and
  :func:`server_evaluation` (an ``evaluate_fn``: the global model's test/train loss and accuracy each round).

Client side: :func:`make_client_app` returns a ``ClientApp`` that runs a pyfedkern algorithm's local update on
the node's partition of an :class:`~pyfedkern.sim.config.ExperimentConfig` (the data, model and random streams
of :mod:`pyfedkern.sim`, so a Flower run reproduces the simulation). Messages carry the trainable parameters only,
one array per trainable tensor keyed by its name (:func:`vector_arrays`; frozen parameters and buffers are never
sent); the strategies' arithmetic is per array or on the concatenation in message order, i.e. on the flat vector
(:func:`arrays_vector`). :func:`initial_arrays` builds the first global model.
"""

from __future__ import annotations

import numbers

try:
    import flwr  # noqa: F401
    from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid
    from flwr.serverapp.strategy import FedAvg as _FlowerFedAvg
    from flwr.serverapp.strategy import Result
except ImportError as exc:  # pragma: no cover - exercised only without flwr
    raise ImportError('pyfedkern.integrations.flower needs Flower: pip install "flwr>=1.20"') from exc

import functools
import io
import json
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from pyfedkern import ops
from pyfedkern.algorithms.context import FLContext, Team
from pyfedkern.data.spec import is_reference
from pyfedkern.flat import FlatLayout, pack, unpack
from pyfedkern.ops import robust as robust_ops

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
MODEL_KEY = "model"


# Zero-copy views of serialized arrays ---------------------------------------------------------------------


_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}


def _npy_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, data offset) of an ``np.save`` buffer; parsed headers are cached."""
    major = data[6] if len(data) > 8 and data[:6] == b"\x93NUMPY" else 0
    if major not in (1, 2, 3):
        raise ValueError("not an np.save buffer (bad magic string)")
    size = 2 if major == 1 else 4
    end = 8 + size + int.from_bytes(data[8 : 8 + size], "little")
    header = data[:end]
    if header not in _HEADERS:
        stream = io.BytesIO(header)
        version = np.lib.format.read_magic(stream)
        if len(_HEADERS) > 4096:
            _HEADERS.clear()
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        _HEADERS[header] = read(stream)
    shape, fortran, dtype = _HEADERS[header]
    return shape, fortran, dtype, end


def _npy_view(data: bytes) -> np.ndarray:
    """The array stored in ``data`` (``np.save`` format) as a read-only view of those bytes when possible."""
    shape, fortran, dtype, offset = _npy_header(data)
    if dtype.hasobject or fortran:
        return np.load(io.BytesIO(data), allow_pickle=False)
    return np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


def array_view(array: Array) -> np.ndarray:
    """A Flower ``Array`` as a NumPy array, without copying its bytes when they hold a plain ``np.save`` array."""
    if array.stype == "numpy.ndarray" and isinstance(array.data, bytes):
        return _npy_view(array.data)
    return array.numpy()


# Drop-in aggregation functions --------------------------------------------------------------------------


def _check_counts(counts: list[Any], name: str) -> list[Any]:
    """The clients' num_examples (Flower's arithmetic depends on their Python/NumPy types): real numbers (not
    strings, None, bools or complex), finite, >= 0, not all 0. Counts of other real types than Python's and NumPy's
    (``fractions.Fraction``) become float64 scalars: Flower's arithmetic turns them into Python floats."""
    if len(counts) == 0:
        raise ValueError(f"{name} is empty: nothing to aggregate")
    checked = []
    for k, n in enumerate(counts):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Real):
            raise TypeError(f"{name}[{k}]: num_examples must be a real number, got {type(n).__qualname__} {n!r}")
        try:
            value = float(n)
        except OverflowError:  # an int beyond float64
            value = math.inf
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}[{k}]: num_examples must be finite and >= 0, got {n!r}")
        checked.append(_numpy_number(n))
    if not any(checked):
        raise ValueError(f"{name}: every num_examples is 0; nothing to average")
    return checked


def _numpy_number(n: Any) -> Any:
    """n when NumPy knows its type (Python and NumPy numbers), else float(n) as a float64 scalar."""
    return n if isinstance(n, (int, float, np.integer, np.floating)) else np.float64(float(n))


def _check_layers(models: list[list[Any]]) -> list[list[np.ndarray]]:
    """Every client's layers as real-valued NumPy arrays (None, strings, objects and complex are refused)."""
    checked = []
    for k, layers in enumerate(models):
        arrays = []
        for i, layer in enumerate(layers):
            if layer is None:
                raise TypeError(f"results[{k}] layer {i} is None; every layer must be a NumPy array")
            a = np.asarray(layer)
            if a.dtype.kind not in "biuf":
                raise TypeError(f"results[{k}] layer {i} has dtype {a.dtype}; layers must hold real numbers")
            arrays.append(a)
        checked.append(arrays)
    return checked


def _check_shapes(layers: list[np.ndarray]) -> None:
    for k, layer in enumerate(layers):
        if layer.shape != layers[0].shape:
            raise ValueError(f"results[{k}] has a layer of shape {layer.shape}, expected {layers[0].shape}")


def _mean_dtype(dtypes: Iterable[np.dtype]) -> np.dtype:
    """The dtype of a mean of arrays of ``dtypes``, whatever their order: NumPy's promotion of them (float32 and
    float64 → float64, float16 and float32 → float32) when that is float16/32/64, else float64 (integers)."""
    dtype = functools.reduce(np.promote_types, dtypes)
    return dtype if dtype in _FLOATS or dtype == np.float16 else np.dtype(np.float64)


def _layer_mean(layers: list[np.ndarray], p: np.ndarray) -> np.ndarray:
    """Σ_k p_k·layers[k] for one layer, in :func:`_mean_dtype` of the layers through ops.weighted_sum (float16
    accumulated in float32)."""
    _check_shapes(layers)
    first = layers[0]
    dtype = _mean_dtype(x.dtype for x in layers)
    out = np.empty(first.shape, dtype=dtype)
    if first.size:
        ops.weighted_sum([x.reshape(-1).astype(dtype, copy=False) for x in layers], p, out=out.reshape(-1))
    return out


def _flower_layer_sum(layers: list[np.ndarray], counts: list[Any]) -> np.ndarray:
    """Flower's ``reduce(np.add, [x_k * n_k for k])`` for one layer, bit for bit, without its K products.

    When every product keeps the layers' common float32/float64 dtype, ops.weighted_sum forms the same products
    and adds them in the same order in that dtype (no fused multiply-add); it starts from +0.0 and skips rows of
    count 0, so the two places where that could show are restored: a sum of only -0.0 terms is -0.0, and a count-0
    row's inf/NaN makes NaN (inf·0). Other dtypes (integers, float16, mixed) take NumPy's own steps, one product
    at a time.
    """
    _check_shapes(layers)
    dtype = layers[0].dtype
    native = dtype in _FLOATS and all(
        x.dtype == dtype and np.result_type(x, n) == dtype for x, n in zip(layers, counts, strict=True)
    )
    if not native:
        total = layers[0] * counts[0]
        for x, n in zip(layers[1:], counts[1:], strict=True):
            total = total + x * n
        return total
    rows = [x.reshape(-1) for x in layers]
    out = np.empty(layers[0].shape, dtype=dtype)
    flat = out.reshape(-1)
    if flat.size == 0:
        return out
    ops.weighted_sum(rows, [float(n) for n in counts], out=flat)
    zeros = np.flatnonzero(flat == 0)
    if zeros.size:
        negative = np.ones(zeros.size, dtype=bool)
        for x, n in zip(rows, counts, strict=True):
            term = x[zeros] * n
            negative &= (term == 0) & np.signbit(term)
        flat[zeros[negative]] = -0.0
    for x, n in zip(rows, counts, strict=True):
        if n == 0:
            flat[~np.isfinite(x)] = np.nan
    return out


def aggregate(results: list[tuple[list[np.ndarray], int]]) -> list[np.ndarray]:
    """Weighted average of K clients' layers: drop-in for ``flwr.server.strategy.aggregate.aggregate``.

    Args:
        results: K pairs (list of L NumPy layers, num_examples); every client has the same layer shapes.

    Returns:
        L layers ``(Σ_k layer_k·n_k) / Σ_k n_k`` with Flower's own results, bit for bit and in its dtypes (NumPy's
        rules: float32/float64/float16 layers keep their dtype, integer layers give float64). float32 and float64
        layers take one pass over the inputs and no copies of them (Flower's makes K weighted copies of the model).
        ``fractions.Fraction`` counts give Flower's values as float64 (Flower's are object arrays of floats).
    """
    if not isinstance(results, (list, tuple)):
        raise TypeError(f"results must be a list of (NDArrays, num_examples) pairs, got {type(results).__name__}")
    counts = _check_counts([n for _, n in results], "results")
    total = _numpy_number(sum(n for _, n in results))  # as Flower sums them (exactly for ints and fractions)
    if not math.isfinite(total):
        raise ValueError(f"results: num_examples must sum to a finite number, got a sum of {total}")
    models = _check_layers([list(layers) for layers, _ in results])
    num_layers = len(models[0])
    for k, layers in enumerate(models):
        if len(layers) != num_layers:
            raise ValueError(f"results[{k}] has {len(layers)} layers, expected {num_layers} (as results[0])")
    means = []
    for i in range(num_layers):
        summed = _flower_layer_sum([m[i] for m in models], counts)
        if summed.dtype.kind == "f" and np.result_type(summed, total) == summed.dtype:
            means.append(np.divide(summed, total, out=summed))  # the same division, in place
        else:
            means.append(summed / total)
    return means


def _fractions(weights: list[float]) -> np.ndarray:
    """float64 [K] shares w_k / Σ_j w_j of finite weights >= 0 with a positive sum, computed on the weights scaled by
    one power of two (exact) so that the sum cannot overflow (weights of 1e308) and tiny ones keep their precision
    (1e-310): the same bits as ``w / sum(w)`` wherever that is finite and normal."""
    w = np.asarray(weights, dtype=np.float64)
    scaled = np.ldexp(w, -math.frexp(float(w.max()))[1])
    return scaled / sum(scaled.tolist())  # Python's sum, as Flower's


class _RunningMean:
    """Σ_k w_k·arrays_k / Σ_k w_k per name, one client at a time, with O(1) models of extra memory.

    Streaming (default): each name keeps the weighted mean of the clients so far, and client k (weight w_k) updates
    it in one :func:`pyfedkern.ops.weighted_sum` pass as it comes: mean ← (W_{k-1}/W_k)·mean + (w_k/W_k)·x_k, with
    both shares computed from the exact (rational) totals W, so no weight of any size multiplies a layer and nothing
    overflows or underflows. ``deferred=True``, for clients that are all in memory already (a list of replies):
    only views are kept, and :meth:`mean` makes one weighted-sum pass per name over all clients with the shares
    w_k / Σ w (:func:`_fractions`). Either way a mean's dtype is :func:`_mean_dtype` of the clients' (a streamed
    float32 mean is widened to float64 when a float64 client comes), so it does not depend on their order.
    """

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self.acc: dict[str, np.ndarray] = {}
        self.views: dict[str, list[np.ndarray]] = {}
        self.weights: list[float] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.total = Fraction(0)  # the exact sum of the weights
        self.count = 0
        self._mean: dict[str, np.ndarray] | None = None  # deferred: the mean, once made

    def add(self, arrays: Iterable[tuple[str, np.ndarray]], weight: float, who: str) -> None:
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"{who}: the weight must be finite and >= 0, got {weight}")
        keep = take = 0.0  # the shares of the mean so far and of this client
        if weight > 0:
            total = self.total + Fraction(weight)
            keep, take = float(self.total / total), float(Fraction(weight) / total)
            self.total = total
        seen = []
        for name, value in arrays:
            seen.append(name)
            if value.dtype.kind not in "biuf":
                raise TypeError(f"{who}: array {name!r} has dtype {value.dtype}; arrays must hold real numbers")
            if name not in self.shapes:
                if self.count:
                    raise ValueError(f"{who} has an array {name!r} that earlier results did not have")
                self.shapes[name] = value.shape
                self.views[name] = []
            if value.shape != self.shapes[name]:
                raise ValueError(f"{who}: array {name!r} has shape {value.shape}, expected {self.shapes[name]}")
            if self.deferred:
                self.views[name].append(value)
                continue
            self.dtypes[name] = _mean_dtype([self.dtypes.get(name, value.dtype), value.dtype])
            flat = value.reshape(-1)
            wanted = self.dtypes[name] if self.dtypes[name] in _FLOATS else np.dtype(np.float64)  # float16: float64
            if name not in self.acc or self.acc[name].dtype.itemsize < wanted.itemsize:
                old = self.acc.get(name)
                self.acc[name] = np.zeros(flat.size, dtype=wanted) if old is None else old.astype(wanted)
            acc = self.acc[name]
            if flat.size and take:
                x = flat if flat.dtype == acc.dtype else flat.astype(acc.dtype)
                ops.weighted_sum([acc, x], [keep, take], out=acc)
        if self.count and len(seen) != len(self.shapes):
            raise ValueError(f"{who} has arrays {seen}, expected {list(self.shapes)}")
        self.weights.append(weight)
        self.count += 1

    def mean(self) -> dict[str, np.ndarray]:
        """The weighted mean of every name (ValueError when nothing or only zero weight was added)."""
        if self.count == 0 or self.total <= 0:
            raise ValueError("no results with a positive weight to average")
        if self.deferred:
            if self._mean is None:
                p = _fractions(self.weights)
                self._mean = {name: _layer_mean(views, p) for name, views in self.views.items()}
            return self._mean
        return {
            name: acc.reshape(self.shapes[name]).astype(self.dtypes[name], copy=False) for name, acc in self.acc.items()
        }

    def drop_nonfinite(self) -> list[int]:
        """Deferred: remove the clients whose arrays hold NaN or inf when the mean does (one check of the mean, a
        check of each client only then); their positions, in the order they were added."""
        assert self.deferred
        if self.count == 0 or self.total <= 0 or all(_all_finite(m) for m in self.mean().values()):
            return []
        bad = [k for k in range(self.count) if not all(_all_finite(v[k]) for v in self.views.values())]
        keep = [k for k in range(self.count) if k not in bad]
        self.views = {name: [views[k] for k in keep] for name, views in self.views.items()}
        self.weights = [self.weights[k] for k in keep]
        self.total = sum((Fraction(w) for w in self.weights), Fraction(0))
        self.count, self._mean = len(keep), None
        return bad


def aggregate_inplace(results: list[tuple[Any, Any]]) -> list[np.ndarray]:
    """Weighted average of ``FitRes`` parameters: drop-in for ``flwr.server.strategy.aggregate.aggregate_inplace``.

    Args:
        results: K pairs (ClientProxy, FitRes) as ``Strategy.aggregate_fit`` receives them.

    Returns:
        The L averaged layers Σ_k (n_k/N)·layer_k, float layers in their dtype (as Flower's; layers of different
        dtypes in NumPy's promotion of them, where Flower's keeps the first result's dtype): float64 ones bit
        for bit Flower's (but +0.0 where all of an element's terms are -0.0), float32 ones to rounding (Flower
        rounds each product, formed in float64, to float32; pyfedkern forms it in float32), float16 ones summed in
        float32. Each result's serialized tensors are read in place (no deserialized copy); unlike Flower's, the
        results are not modified and integer layers are averaged in float64 (Flower's in-place cast truncates
        their weights to 0).
    """
    if not isinstance(results, (list, tuple)):
        raise TypeError(f"results must be a list of (ClientProxy, FitRes) pairs, got {type(results).__name__}")
    counts = _check_counts([fit_res.num_examples for _, fit_res in results], "results")
    running = _RunningMean(deferred=True)  # weights n_k / N, as Flower's scaling factors
    for k, (_, fit_res) in enumerate(results):
        tensors = fit_res.parameters.tensors
        running.add(((str(i), _npy_view(t)) for i, t in enumerate(tensors)), float(counts[k]), f"results[{k}]")
    layers = running.mean()
    return [layers[str(i)] for i in range(len(layers))]


# Metrics -------------------------------------------------------------------------------------------------


def mean_metrics(records: list[RecordDict], weighting_metric_name: str, *, uniform: bool = False) -> MetricRecord:
    """The replies' metrics averaged key by key, weighted by ``weighting_metric_name`` (or with equal weights when
    ``uniform``), which is itself left out of the result. Each key averages the replies that report a finite value
    for it (a client without local steps reports a NaN loss), so the result holds only real measurements.
    The weights are normalised before they multiply the values (as Flower's), in a way that stays exact for any
    finite weights (1e308 or 1e-310). Drop-in for Flower's ``train_metrics_aggr_fn`` / ``evaluate_metrics_aggr_fn``."""
    measured: dict[str, tuple[list[float], list[float]]] = {}
    for k, content in enumerate(records):
        values = {key: v for record in content.metric_records.values() for key, v in record.items()}
        if not uniform and weighting_metric_name not in values:
            raise ValueError(f"records[{k}] has no metric {weighting_metric_name!r} to weight it by")
        weight = 1.0 if uniform else values[weighting_metric_name]
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"records[{k}]: {weighting_metric_name!r} must be a number, got {weight!r}")
        weight = float(weight)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"records[{k}]: {weighting_metric_name!r} must be finite and >= 0, got {weight}")
        for key, value in values.items():
            if key == weighting_metric_name or isinstance(value, list) or not math.isfinite(value):
                continue
            weights, found = measured.setdefault(key, ([], []))
            weights.append(weight)
            found.append(float(value))
    return MetricRecord(
        {
            key: sum(p * v for p, v in zip(_fractions(weights).tolist(), found, strict=True))
            for key, (weights, found) in measured.items()
            if any(weights)
        }
    )


def server_evaluation(config: Any) -> Callable[[int, ArrayRecord], MetricRecord]:
    """An ``evaluate_fn`` for ``Strategy.start``: the global model's "test-loss", "test-acc", "train-loss" and
    "train-acc" on ``config``'s test set and train-evaluation subset, as the simulator measures them each round."""
    sim = _simulation(config)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        scores = sim.evaluate(torch.from_numpy(arrays_vector(arrays, sim.local.flat.layout)).to(sim.initial_vector))
        return MetricRecord({key.replace("_", "-"): float(value) for key, value in scores.items()})

    return evaluate


# Streaming replies ---------------------------------------------------------------------------------------


class ArrivalGrid:
    """Wraps a Flower ``Grid`` so ``send_and_receive`` yields each reply as soon as the SuperLink has it.

    Flower's own ``send_and_receive`` returns once every reply arrived (or the timeout passed); a strategy consuming
    this generator aggregates while slower nodes are still training and never holds all replies at once.
    After the generator is exhausted, ``unanswered`` lists the nodes that did not reply before the timeout.
    """

    def __init__(self, grid: Grid, poll_interval: float = 0.1) -> None:
        if not (math.isfinite(poll_interval) and poll_interval > 0):
            raise ValueError(f"poll_interval must be finite and > 0, got {poll_interval}")
        self._grid = grid
        self.poll_interval = poll_interval
        self.destinations: dict[str, int] = {}
        self.unanswered: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def node_of(self, reply: Message) -> int:
        """The node a reply answers for (error replies made by the SuperLink name no source node)."""
        return self.destinations.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterator[Message]:
        """Push ``messages`` and yield each reply as it arrives (until all replied or ``timeout`` seconds passed)."""
        messages = list(messages)
        ids = list(self._grid.push_messages(messages))
        pending = {mid: msg.metadata.dst_node_id for mid, msg in zip(ids, messages, strict=True)}
        self.destinations.update(pending)
        del messages
        return self._replies(pending, timeout)

    def _replies(self, pending: dict[str, int], timeout: float | None) -> Iterator[Message]:
        end = None if timeout is None else time.monotonic() + timeout
        while pending and (end is None or time.monotonic() < end):
            replies = list(self._grid.pull_messages(list(pending)))
            for reply in replies:
                pending.pop(reply.metadata.reply_to_message_id, None)
                yield reply
            if pending and not replies:
                time.sleep(self.poll_interval)
        self.unanswered = sorted(pending.values())


@dataclass
class RoundRecord:
    """What a strategy saw in one training round: nodes whose results arrived, and failed nodes (error replies,
    replies holding NaN or inf, and nodes that did not answer before the timeout)."""

    server_round: int
    received: list[int]
    failed: list[int]


class FedAvg(_FlowerFedAvg):
    """Flower's message-API FedAvg aggregating each reply into a running weighted mean as it arrives.

    Same arguments as ``flwr.serverapp.strategy.FedAvg`` plus:

    Args:
        uniform: average with equal weights instead of ``weighted_by_key`` (FedPBC, FedSpeed).
        poll_interval: seconds between polls of the SuperLink while waiting for replies (Flower's default waits 3).
        central_dp: a :class:`pyfedkern.privacy.CentralDP` (:func:`central_dp_of` builds one from a config) for
            user-level DP of the aggregate: each reply's update (its arrays minus the round's global arrays, all
            arrays as one vector) is clipped to ℓ2 norm C and the clipped updates are summed in one
            :func:`pyfedkern.ops.clip_accumulate` call, noise N(0, (σC)²) is added once to the sum, and the sum is
            divided by the n replies (every weight 1, so ``uniform`` is implied; the round's K replies are held, as
            flat vectors). The round's train metrics add "dp-epsilon" (spent so far) and "dp-clip" (the round's
            clip). FedAvg only: its subclasses refuse it.
        seed: the seed of central DP's noise: round t = server_round − 1 draws the stream the simulator's central
            DP draws for (seed, t), so a run equals :class:`~pyfedkern.sim.engine.Simulation`'s to rounding.

    ``history`` keeps a :class:`RoundRecord` per training round. Replies must carry one ArrayRecord and a
    MetricRecord with ``weighted_by_key`` (unless ``uniform``); a malformed reply is a ValueError naming its node.
    Every round's train metrics average the replies' metrics (:func:`mean_metrics`), for every strategy.
    """

    def __init__(
        self,
        *args: Any,
        uniform: bool = False,
        poll_interval: float = 0.1,
        central_dp: Any = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if isinstance(poll_interval, bool) or not isinstance(poll_interval, numbers.Real):
            raise TypeError(f"poll_interval must be a number of seconds, got {poll_interval!r}")
        if not (math.isfinite(poll_interval) and poll_interval > 0):
            raise ValueError(f"poll_interval must be finite and > 0 seconds, got {poll_interval}")
        if central_dp is not None:
            from pyfedkern.privacy import CentralDP

            if not isinstance(central_dp, CentralDP):
                raise TypeError(f"central_dp must be a pyfedkern.privacy.CentralDP, got {type(central_dp).__name__}")
            if type(self).aggregate_train is not FedAvg.aggregate_train:
                raise ValueError(f"central_dp: {type(self).__name__} aggregates its own way; central DP takes FedAvg")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
        kwargs.setdefault("train_metrics_aggr_fn", mean_metrics)
        super().__init__(*args, **kwargs)
        self.uniform = uniform or central_dp is not None
        self.poll_interval = poll_interval
        self.central_dp = central_dp
        self.seed = int(seed)
        self.history: list[RoundRecord] = []
        self._grid: ArrivalGrid | None = None
        self._global: ArrayRecord | None = None  # the arrays of the round being trained (central DP's centre)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start`` with replies streamed through an :class:`ArrivalGrid`."""
        self._grid = grid if isinstance(grid, ArrivalGrid) else ArrivalGrid(grid, self.poll_interval)
        return super().start(self._grid, initial_arrays, *args, **kwargs)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._global = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def _node_of(self, reply: Message) -> int:
        return self._grid.node_of(reply) if self._grid is not None else reply.metadata.src_node_id

    def _reply_weight(self, content: RecordDict, node: int) -> float:
        if self.uniform:
            return 1.0
        for record in content.metric_records.values():
            if self.weighted_by_key in record:
                weight = record[self.weighted_by_key]
                if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                    raise TypeError(f"reply of node {node}: {self.weighted_by_key!r} must be a number, got {weight!r}")
                return float(weight)
        raise ValueError(f"reply of node {node} has no metric {self.weighted_by_key!r} to weight it by")

    def stream_train(
        self, server_round: int, replies: Iterable[Message], history: list[RoundRecord] | None = None
    ) -> tuple[_RunningMean, list[RecordDict]]:
        """Add every valid reply's arrays into a running mean (weighted per ``uniform``/``weighted_by_key``) as
        it arrives (when ``replies`` is a list, all arrived already: one weighted-sum pass per array at the end);
        record the round in ``history`` (default: ``self.history``). Returns (the running mean, the replies' metric
        records)."""
        running = _RunningMean(deferred=isinstance(replies, (list, tuple)))
        metrics: list[RecordDict] = []
        received: list[int] = []
        failed: list[int] = []
        for reply in replies:
            node = self._node_of(reply)
            if reply.has_error():
                failed.append(node)
                continue
            content = reply.content
            if len(content.array_records) != 1:
                raise ValueError(f"reply of node {node} has {len(content.array_records)} ArrayRecords, expected 1")
            weight = self._reply_weight(content, node)
            arrays = [(k, array_view(a)) for k, a in next(iter(content.array_records.values())).items()]
            if not running.deferred and not all(_all_finite(a) for _, a in arrays):  # streamed: checked one by one
                failed.append(_left_out(server_round, node))
                continue
            running.add(arrays, weight, f"reply of node {node}")
            metrics.append(RecordDict(dict(content.metric_records)))
            received.append(node)
            del reply, content, arrays
        if running.deferred:  # all in memory: one check of the mean, and of each reply only when it fails
            for k in reversed(running.drop_nonfinite()):
                failed.append(_left_out(server_round, received.pop(k)))
                del metrics[k]
        if self._grid is not None:
            failed.extend(self._grid.unanswered)
            self._grid.unanswered = []
        (self.history if history is None else history).append(
            RoundRecord(server_round, sorted(received), sorted(failed))
        )
        return running, metrics

    def _metrics(self, metrics: list[RecordDict]) -> MetricRecord | None:
        """The round's train metrics: ``train_metrics_aggr_fn`` (default :func:`mean_metrics`) weighted by
        ``weighted_by_key``, or the replies' plain mean for ``uniform`` strategies."""
        if not metrics:
            return None
        if self.uniform:
            return mean_metrics(metrics, self.weighted_by_key, uniform=True)
        return self.train_metrics_aggr_fn(metrics, self.weighted_by_key)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.central_dp is not None:
            return self._private_round(server_round, replies)
        running, metrics = self.stream_train(server_round, replies)
        if running.count == 0 or running.total <= 0:
            return None, None
        self._check_names(running)
        return _record(running.mean()), self._metrics(metrics)

    def _check_names(self, running: _RunningMean) -> None:
        """ValueError unless the replies hold the arrays the round sent (:meth:`configure_train`'s), no more, no
        fewer: a client that uploads its frozen layers, or drops some, would otherwise change the global model's
        arrays."""
        if self._global is None:
            return
        sent, got = list(self._global.keys()), list(running.shapes)
        if extra := [name for name in got if name not in self._global]:
            raise ValueError(f"the replies have arrays {extra} that the round's model has not (it sent {sent})")
        if missing := [name for name in sent if name not in running.shapes]:
            raise ValueError(f"the replies lack arrays {missing} of the round's model (it sent {sent})")

    def _private_round(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Central DP's round (see ``central_dp``): the replies' updates clipped and summed in one
        :func:`pyfedkern.ops.clip_accumulate` call over their flat vectors, :meth:`CentralDP.finish
        <pyfedkern.privacy.CentralDP.finish>`'s noise on the sum, divided by the n replies."""
        from pyfedkern.algorithms.base import RoundSums

        if self._global is None:
            raise ValueError("central_dp: aggregate_train before configure_train (no global arrays to clip against)")
        running, metrics = self.stream_train(server_round, list(replies))  # every reply's views, none averaged
        n = running.count
        if n == 0:
            return None, None
        names = list(running.views)
        missing = [name for name in names if name not in self._global]
        if missing:
            raise ValueError(f"central_dp: the replies have arrays {missing} that the global model has not")
        dtypes = {name: running.views[name][0].dtype for name in names}
        dtype = _mean_dtype(dtypes.values())
        rows = [np.concatenate([running.views[name][k].reshape(-1) for name in names], dtype=dtype) for k in range(n)]
        x = np.concatenate([array_view(self._global[name]).reshape(-1) for name in names], dtype=dtype)
        dp = self.central_dp
        total, norms = ops.clip_accumulate(rows, dp.clip, center=x, return_norms=True)
        sums = RoundSums()
        sums.vectors[MODEL_KEY] = torch.from_numpy(total)
        sums.add_scalar("weight", n)
        sums.add_scalar("dp_unclipped", float((norms <= dp.clip).sum()))
        extras = dp.finish(server_round - 1, sums, torch.from_numpy(x), MODEL_KEY, self._rng)
        mean = total / n
        arrays, offset = {}, 0
        for name in names:
            shape = running.shapes[name]
            size = math.prod(shape)
            arrays[name] = mean[offset : offset + size].reshape(shape).astype(dtypes[name])
            offset += size
        report = self._metrics(metrics) or MetricRecord()
        report["dp-epsilon"], report["dp-clip"] = float(extras["dp_epsilon"]), float(extras["dp_clip"])
        return _record(arrays), report

    def _rng(self, *keys: int) -> np.random.Generator:
        """The generator of (seed, ``*keys``), as the simulator's ``rng``."""
        return np.random.default_rng([self.seed, *(int(k) for k in keys)])


def _left_out(server_round: int, node: int) -> int:
    """Warn that ``node``'s reply holds NaN or inf and is left out of the round as a failed node; return ``node``."""
    warnings.warn(
        f"round {server_round}: the reply of node {node} holds NaN or inf (its training diverged?); it is left out "
        "of the round as a failed node",
        stacklevel=3,
    )
    return node


_ROW = 4096  # values per row of the finiteness probe


def _all_finite(array: np.ndarray) -> bool:
    """Whether a real array holds no NaN or inf. float32/float64: one matrix-vector product of its values, as rows
    of :data:`_ROW`, with zeros (0·x is 0 for a finite x and NaN for NaN or ±inf), one BLAS pass that takes a
    quarter of an accumulation's time, where ``np.isfinite`` takes half; other dtypes: ``np.isfinite`` in chunks."""
    if array.dtype.kind != "f":
        return True
    flat = array.reshape(-1)
    if flat.dtype not in (np.float32, np.float64):
        return all(np.isfinite(flat[i : i + _ROW]).all() for i in range(0, flat.size, _ROW))
    whole = flat.size - flat.size % _ROW
    with np.errstate(invalid="ignore"):
        rows = flat[:whole].reshape(-1, _ROW) @ np.zeros(_ROW, flat.dtype)
    return bool(np.isfinite(rows).all() and np.isfinite(flat[whole:]).all())


def _record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in arrays.items()})


def _flat(record: ArrayRecord, key: str = MODEL_KEY) -> np.ndarray:
    if key not in record:
        raise ValueError(f"the ArrayRecord has no array {key!r} (has {sorted(record)})")
    return np.array(array_view(record[key]), copy=True).reshape(-1)


def model_layout(config: Any) -> FlatLayout:
    """The layout of ``config``'s federated vector: its model's trainable parameters (names, shapes, offsets)."""
    return _simulation(config).local.flat.layout


def _prefix(key: str) -> str:
    return "" if key == MODEL_KEY else f"{key}/"


def vector_arrays(vectors: dict[str, Any], layout: FlatLayout) -> ArrayRecord:
    """The ArrayRecord of a message: each flat vector [d] (NumPy or CPU torch) over ``layout`` split into one array
    per trainable tensor, keyed by the parameter's name for the model vector ``"model"`` and by
    ``"<vector>/<name>"`` for any other (e.g. BHerd's ``"g/fc.weight"``)."""
    arrays: dict[str, np.ndarray] = {}
    for key, vector in vectors.items():
        vector = vector.detach().cpu().numpy() if isinstance(vector, torch.Tensor) else np.asarray(vector)
        arrays.update((_prefix(key) + name, value) for name, value in unpack(vector, layout).items())
    return _record(arrays)


def arrays_vector(record: ArrayRecord | dict[str, Any], layout: FlatLayout, key: str = MODEL_KEY) -> np.ndarray:
    """The flat vector ``key`` [d] of a message written by :func:`vector_arrays` (an ArrayRecord, or a dict of
    arrays such as a strategy's mean), in the dtype of its arrays. The record must hold exactly that vector's arrays:
    ValueError naming a missing, extra or misshaped array."""
    prefix = _prefix(key)
    expected = [prefix + e.name for e in layout.entries]
    if missing := [name for name in expected if name not in record]:
        raise ValueError(f"the arrays lack {missing} (the {key!r} vector has {len(expected)} arrays: {expected})")
    if extra := [name for name in record if name not in set(expected)]:
        raise ValueError(f"the arrays have {extra}, which the {key!r} vector has not (it has {expected})")
    views = [
        (name, record[name] if isinstance(record[name], np.ndarray) else array_view(record[name])) for name in expected
    ]
    for (name, value), e in zip(views, layout.entries, strict=True):
        if tuple(value.shape) != e.shape:
            raise ValueError(f"array {name!r} has shape {tuple(value.shape)}, expected {e.shape}")
    return pack(
        [(e.name, value) for (_, value), e in zip(views, layout.entries, strict=True)], layout, views[0][1].dtype
    )[0]


class FedPBC(FedAvg):
    """FedPBC (postponed broadcast) on Flower: every connected node trains from its own model each round.

    The server model is the uniform mean of the models whose results arrived this round, and only those nodes
    receive it (with the next round's message, which tells them to adopt it); the others keep training their own
    model. A node whose reply is a Flower error or misses the timeout is a failed link: it neither counts in the
    mean nor receives the model. A node seen for the first time receives the current model.
    Pair with :func:`make_client_app` for ``algorithm="fedpbc"``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("fraction_train", 1.0)
        kwargs["uniform"] = True
        super().__init__(*args, **kwargs)
        self.receivers: set[int] = set()
        self.seen: set[int] = set()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            adopt = node in self.receivers or node not in self.seen
            self.seen.add(node)
            cfg = ConfigRecord({**dict(msg.content[self.configrecord_key]), "pbc-adopt": adopt})
            payload = arrays if adopt else ArrayRecord()
            content = RecordDict({self.arrayrecord_key: payload, self.configrecord_key: cfg})
            out.append(Message(content=content, message_type=msg.metadata.message_type, dst_node_id=node))
        return out

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        running, metrics = self.stream_train(server_round, replies)
        self.receivers = set(self.history[-1].received)
        if running.count == 0:
            return None, None
        return _record(running.mean()), self._metrics(metrics)


@dataclass
class _ServerContext(FLContext):
    """The :class:`~pyfedkern.algorithms.FLContext` of a server step: the LR schedule and the local work."""

    config: Any
    local_epochs: float = field(init=False)
    local_steps: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.config.validate()
        self.local_epochs = self.config.local_epochs
        self.local_steps = self.config.local_steps

    def lr(self, t: int) -> float:
        from pyfedkern.sim.config import parse_lr_schedule
        from pyfedkern.sim.engine import Simulation

        view = SimpleNamespace(config=self.config, _lr_schedule=parse_lr_schedule(self.config.lr_schedule))
        return Simulation.lr(view, t)  # the engine's schedule, without loading any data


class BHerd(FedAvg):
    """BHerd-FedAvg on Flower: clients send the sum of their herding-selected gradients ``"g"``; the server applies
    w ← w − η_t·(E/α)·Σ p_i g_i (:meth:`pyfedkern.algorithms.bherd.BHerd.server_scale`), p_i ∝ num-examples,
    with Σ p_i g_i accumulated as replies arrive.

    Args:
        config: the :class:`~pyfedkern.sim.config.ExperimentConfig` the clients use (algorithm "bherd").
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        from pyfedkern.algorithms import make_algorithm
        from pyfedkern.algorithms.bherd import BHerd as BHerdAlgorithm

        _check_config(config)
        super().__init__(*args, **kwargs)
        self.ctx = _ServerContext(config)
        self.layout = model_layout(config)
        self.algorithm = make_algorithm(config.algorithm, **config.algorithm_params)
        if not isinstance(self.algorithm, BHerdAlgorithm):
            raise ValueError(f"config.algorithm must be 'bherd', got {config.algorithm!r}")
        self._current: np.ndarray | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._current = arrays_vector(arrays, self.layout)
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        running, metrics = self.stream_train(server_round, replies)
        if running.count == 0 or running.total <= 0:
            return None, None
        try:
            g = arrays_vector(running.mean(), self.layout, "g")
        except ValueError as exc:
            raise ValueError(
                f"BHerd: the replies must carry 'g' (the sum of each client's herding-selected gradients) as "
                f"'g/<parameter>' arrays; pair this strategy with make_client_app for algorithm 'bherd': {exc}"
            ) from None
        step = self.ctx.lr(server_round - 1) * self.algorithm.server_scale(self.ctx)
        x = self._current.astype(g.dtype, copy=False)
        new = ops.weighted_sum([x, g], [1.0, -step])
        return vector_arrays({MODEL_KEY: new}, self.layout), self._metrics(metrics)


class FedSpeed(FedAvg):
    """FedSpeed on Flower: each client keeps its correction h_i in its node state and uploads x̂_i = x_K + h_i;
    the server model is the uniform mean of the x̂_i that arrived (Algorithm 1, ``corr_avg="active"``).
    Pair with :func:`make_client_app` for ``algorithm="fedspeed"``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["uniform"] = True
        super().__init__(*args, **kwargs)


# Byzantine-robust strategies ------------------------------------------------------------------------------


def _robust_layer(views: list[np.ndarray], rule: Callable[[list[np.ndarray]], np.ndarray]) -> np.ndarray:
    """``rule`` (a :mod:`pyfedkern.ops.robust` op on K rows) per coordinate of one array of K replies, in the dtype
    NumPy's own rule would give: float32/float64 arrays of one dtype are read in place as rows; other dtypes and
    mixed ones are stacked and taken in float64 (cast to the dtype ``np.median`` returns for them)."""
    first = views[0]
    _check_shapes(views)
    if first.dtype in _FLOATS and all(v.dtype == first.dtype for v in views):
        if first.size == 0:
            return np.empty(first.shape, dtype=first.dtype)
        return np.asarray(rule([v.reshape(-1) for v in views])).reshape(first.shape)
    stacked = np.stack(views)
    dtype = np.median(stacked.reshape(len(views), -1)[:, :0], axis=0).dtype  # NumPy's result dtype
    rows = stacked.reshape(len(views), -1).astype(np.float64)
    return np.asarray(rule(list(rows))).reshape(first.shape).astype(dtype)


def _check_count(value: Any, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


class _RobustFedAvg(FedAvg):
    """A :class:`FedAvg` whose round combines the replies with a robust rule instead of their mean: the round's
    replies are kept (zero-copy views of their bytes, K models of memory where the mean streams in one), replies
    with NaN or inf are left out as failed nodes (:class:`RoundRecord`), and :meth:`combine` gives the new arrays
    and the replies whose metrics count."""

    def combine(self, running: _RunningMean) -> tuple[dict[str, np.ndarray] | None, list[int]]:
        """(the new arrays, or None to skip the round; positions of the replies whose metrics the round reports)."""
        raise NotImplementedError

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        running, metrics = self.stream_train(server_round, list(replies))
        if running.count == 0:
            return None, None
        self._check_names(running)
        arrays, chosen = self.combine(running)
        if arrays is None:
            return None, None
        return _record(arrays), self._metrics([metrics[k] for k in chosen])

    def _krum_rows(self, running: _RunningMean) -> list[np.ndarray]:
        """Each reply's arrays as one row (a view when it has one float array; else concatenated, as Flower)."""
        views = running.views
        if len(views) == 1:
            (arrays,) = views.values()
            if all(a.dtype in _FLOATS and a.dtype == arrays[0].dtype for a in arrays):
                return [a.reshape(-1) for a in arrays]
        return [np.concatenate([views[name][k].reshape(-1) for name in views]) for k in range(running.count)]

    def _select(self, running: _RunningMean, f: int, m: int) -> list[int]:
        """Multi-Krum's choice: the m replies of lowest Krum score, lowest first (ties: the earlier reply)."""
        return [int(k) for k in robust_ops.krum_select(self._krum_rows(running), f, m=m)]


class FedMedian(_RobustFedAvg):
    """``flwr.serverapp.strategy.FedMedian`` on :func:`pyfedkern.ops.coordinate_median`: each array the
    coordinate-wise median of the replies' (the mean of the two middle values for an even count, as ``np.median``),
    the weights ignored; Flower's results bit for bit for float32/float64 arrays. Same arguments as :class:`FedAvg`."""

    def combine(self, running):
        arrays = {name: _robust_layer(views, robust_ops.coordinate_median) for name, views in running.views.items()}
        return arrays, list(range(running.count))


class FedTrimmedAvg(_RobustFedAvg):
    """``flwr.serverapp.strategy.FedTrimmedAvg`` on :func:`pyfedkern.ops.trimmed_mean`: per coordinate the
    mean after dropping the ⌊β·K⌋ smallest and largest of the K replies' values (Flower's results to rounding: the
    kept values are summed in float64).

    Args:
        beta: the fraction β cut at each end, 0 ≤ β < 0.5 (Flower's default 0.2).
    """

    def __init__(self, *args: Any, beta: float = 0.2, **kwargs: Any) -> None:
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= beta < 0.5:
            raise ValueError(f"beta must be in the range [0, 0.5), got {beta!r}")
        super().__init__(*args, **kwargs)
        self.beta = float(beta)

    def combine(self, running):
        def trimmed(rows):
            return robust_ops.trimmed_mean(rows, self.beta)

        arrays = {name: _robust_layer(views, trimmed) for name, views in running.views.items()}
        return arrays, list(range(running.count))


class MultiKrum(_RobustFedAvg):
    """``flwr.serverapp.strategy.MultiKrum`` on :func:`pyfedkern.ops.krum_select` (the pairwise distances
    through one Gram product): the ``num_nodes_to_select`` replies of lowest Krum score (the sum of squared
    distances to its max(1, K − f − 2) nearest others), averaged with the weights of ``weighted_by_key`` in that
    order, as Flower's ``aggregate_arrayrecords`` (float32/float64 arrays bit for bit); the round's metrics are the
    chosen replies'.

    Args:
        num_malicious_nodes: f ≥ 0.
        num_nodes_to_select: m ≥ 1 (1: Krum).
    """

    def __init__(self, *args: Any, num_malicious_nodes: int = 0, num_nodes_to_select: int = 1, **kwargs: Any) -> None:
        self.num_malicious_nodes = _check_count(num_malicious_nodes, "num_malicious_nodes", 0)
        self.num_nodes_to_select = _check_count(num_nodes_to_select, "num_nodes_to_select", 1)
        super().__init__(*args, **kwargs)

    def combine(self, running):
        chosen = self._select(running, self.num_malicious_nodes, min(self.num_nodes_to_select, running.count))
        weights = [running.weights[k] for k in chosen]
        total = sum(weights)
        if not total > 0:
            raise ValueError(f"the chosen replies' {self.weighted_by_key!r} must have a positive sum, got {total}")
        factors = [w / total for w in weights]
        arrays = {name: _flower_layer_sum([views[k] for k in chosen], factors) for name, views in running.views.items()}
        return arrays, chosen


class Krum(MultiKrum):
    """``flwr.serverapp.strategy.Krum``: :class:`MultiKrum` choosing one reply (the new arrays are its own).

    Args:
        num_malicious_nodes: f ≥ 0.
    """

    def __init__(self, *args: Any, num_malicious_nodes: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, num_malicious_nodes=num_malicious_nodes, num_nodes_to_select=1, **kwargs)


class Bulyan(_RobustFedAvg):
    """``flwr.serverapp.strategy.Bulyan`` with Multi-Krum's selection on :func:`pyfedkern.ops.krum_select`:
    θ = K − 2f replies of lowest Krum score, then per coordinate the mean of the β = θ − 2f of their values nearest
    their median (:func:`pyfedkern.ops.coordinate_median`), as Flower's (its results to rounding; values
    equally near the median may be taken in another order). With fewer than 4f + 3 replies the round is skipped (a
    warning), as Flower's; the round's metrics are the θ chosen replies'.

    Args:
        num_malicious_nodes: f ≥ 0.
    """

    def __init__(self, *args: Any, num_malicious_nodes: int = 0, **kwargs: Any) -> None:
        self.num_malicious_nodes = _check_count(num_malicious_nodes, "num_malicious_nodes", 0)
        super().__init__(*args, **kwargs)

    def combine(self, running):
        f, count = self.num_malicious_nodes, running.count
        if count < 4 * f + 3:
            warnings.warn(
                f"Bulyan skips the round: it needs at least {4 * f + 3} replies (4·num_malicious_nodes + 3), "
                f"got {count}",
                stacklevel=3,
            )
            return None, []
        theta = count - 2 * f
        beta = theta - 2 * f
        chosen = self._select(running, f, theta)
        arrays = {}
        for name, views in running.views.items():
            picked = [views[k] for k in chosen]
            median = _robust_layer(picked, robust_ops.coordinate_median)
            stacked = np.stack(picked)
            nearest = np.argpartition(np.abs(stacked - median), beta - 1, axis=0)[:beta]
            arrays[name] = np.mean(np.take_along_axis(stacked, nearest, axis=0), axis=0)
        return arrays, chosen


def robust_strategy(aggregator: str, **kwargs: Any) -> FedAvg:
    """The strategy of a run config's ``aggregator`` (:mod:`pyfedkern.algorithms.robust`): :class:`FedMedian` for
    ``median``, :class:`FedTrimmedAvg` for ``trimmed:β``, :class:`Krum`, :class:`MultiKrum` and :class:`Bulyan` for
    ``krum:f``, ``multikrum:f,m`` and ``bulyan:f``, :class:`FedAvg` for ``mean``; ``kwargs`` go to its constructor.
    The simulator's ``geomed`` and ``cclip`` have no Flower strategy (a ValueError naming ``aggregator``)."""
    from pyfedkern.algorithms.robust import parse_aggregator

    rule = parse_aggregator(aggregator)
    if rule.rule == "mean":
        return FedAvg(**kwargs)
    if rule.rule == "median":
        return FedMedian(**kwargs)
    if rule.rule == "trimmed":
        return FedTrimmedAvg(beta=rule.beta, **kwargs)
    if rule.rule == "krum":
        return Krum(num_malicious_nodes=rule.f, **kwargs)
    if rule.rule == "multikrum":
        return MultiKrum(num_malicious_nodes=rule.f, num_nodes_to_select=rule.m, **kwargs)
    if rule.rule == "bulyan":
        return Bulyan(num_malicious_nodes=rule.f, **kwargs)
    raise ValueError(
        f"aggregator {rule.spec!r} has no Flower strategy (Flower runs take mean, median, trimmed:β, krum:f, "
        "multikrum:f,m and bulyan:f)"
    )


def central_dp_of(config: Any) -> Any:
    """The :class:`pyfedkern.privacy.CentralDP` of a config with ``dp="central"`` (run-config keys ``dp``,
    ``dp-clip``, ``dp-delta``, ``dp-epsilon`` or ``dp-noise-multiplier``, ``dp-adaptive-clip``, ``dp-population``,
    ``dp-noise-cohort``, ``dp-accountant``: the CLI's ``--dp-*`` options), as the simulator builds it (σ solved
    from ε over the config's rounds); None without central DP. A new object each call (an adaptive clip changes)."""
    from pyfedkern.sim.engine import central_dp

    if config.dp == "central" and config.aggregator.strip().lower() != "mean":
        raise ValueError(f"central DP cannot be combined with a robust aggregator, got {config.aggregator!r}")
    return central_dp(config, _simulation(config).num_clients)


def _check_config(config: Any) -> None:
    from pyfedkern.sim.config import ExperimentConfig

    if not isinstance(config, ExperimentConfig):
        raise TypeError(f"config must be a pyfedkern ExperimentConfig, got {type(config).__qualname__}")


def dynamic_algorithm(config: Any) -> Any:
    """The :class:`~pyfedkern.algorithms.dynamic.DynamicInit` of ``config`` (algorithm "dynamic"), checked to run on
    Flower: method "proposed" and a host whose server step is FedAvg's model average (fedavg/fedprox, server_lr 1)."""
    from pyfedkern.algorithms import make_algorithm

    _check_config(config)
    if config.algorithm != "dynamic":
        raise ValueError(f"config.algorithm must be 'dynamic', got {config.algorithm!r}")
    algo = make_algorithm("dynamic", **config.algorithm_params)
    if algo.method != "proposed":
        raise ValueError(f"on Flower the dynamic method must be 'proposed', got {algo.method!r}")
    host = algo.make_host()
    if host.name not in ("fedavg", "fedprox"):
        raise ValueError(
            f"on Flower the dynamic host must be fedavg or fedprox (the server averages models), got {algo.host!r}"
        )
    _check_model_average(host, "the dynamic host")
    return algo


def _check_model_average(algo: Any, what: str) -> None:
    """Refuse a FedAvg/FedProx whose server step is not the |D_i|-weighted model average that :class:`FedAvg` and
    :class:`DynamicInit` take (a global step ``server_lr`` ≠ 1, or ``ref_compat``'s uniform weights)."""
    if algo.server_lr != 1.0 or algo.ref_compat:
        raise ValueError(
            f"on Flower {what} must have server_lr = 1 and ref_compat = False (the strategy's server step is the "
            f"average of the models weighted by num-examples), got server_lr = {algo.server_lr}, "
            f"ref_compat = {algo.ref_compat}"
        )


def _client_algorithm(config: Any) -> Any:
    """The algorithm of ``config`` as :func:`client_train` runs it, refused where the paired strategy's server step
    would differ from the simulation's (so that Flower and the simulation compute the same models)."""
    from pyfedkern.algorithms import make_algorithm

    if config.algorithm == "dynamic":
        return dynamic_algorithm(config)
    algo = make_algorithm(config.algorithm, **config.algorithm_params)
    if config.algorithm in ("fedavg", "fedprox"):
        _check_model_average(algo, config.algorithm)
    if config.algorithm == "fedspeed" and algo.corr_avg != "active":
        raise ValueError(
            f"on Flower fedspeed must have corr_avg = 'active' (the FedSpeed strategy averages the uploads of the "
            f"nodes that answered), got {algo.corr_avg!r}"
        )
    return algo


class DynamicInit(FedAvg):
    """FedAvg in sessions: a session starts whenever the set of connected nodes changes, and the server builds its
    initial model as the dynamic initial-model method prescribes (Chang et al.), with the bookkeeping of
    :class:`pyfedkern.algorithms.dynamic.InitialModelBuilder`, as :class:`~pyfedkern.algorithms.dynamic.DynamicInit`
    does in the simulation.

    The first P = ``pilot_sessions`` sessions are the pilot; w_pilot is the mean of their last models. Each later
    session s first runs V = ``grad_rounds`` footprint rounds of FedAvg from w_pilot with its nodes (the clients use
    the constant LR ``footprint_lr``·η0 and minibatches no training round draws; see
    :meth:`~pyfedkern.algorithms.dynamic.DynamicInit.footprint_view`) and sets G_s = w_fp − w_pilot. Session P starts
    from ``first_init``, later ones from Σ_z α_z·w_z^last, α = softmax(−scale·distance(G_s, G_z)) over the stored
    post-pilot sessions. Footprint rounds are not training rounds: they do not count in ``num_rounds`` and are
    recorded in ``footprint_history``, not ``history``. ``sessions`` lists each session's first round, nodes and α.

    Args:
        config: the :class:`~pyfedkern.sim.config.ExperimentConfig` the clients use (algorithm "dynamic", method
            "proposed", host fedavg or fedprox): the method's hyper-parameters, the model layout (segments of the
            per-layer metrics, biases excluded) and the initial model.

    Messages carry the model as one array per trainable tensor (:func:`vector_arrays`); the config of a training
    round has ``"session"`` and ``"session-start"`` (the session's first server round), that of footprint round v has
    ``"session"`` and ``"footprint-round"`` = v. Pair with :func:`make_client_app`, which reads them.
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.algorithm = dynamic_algorithm(config)
        self.config = config
        self.layout = model_layout(config)
        self.footprint_history: list[RoundRecord] = []
        self.sessions: list[dict[str, Any]] = []
        self.builder = None  # the run's InitialModelBuilder (pilot, footprint gradient, history), set by start

    def _round(
        self, server_round: int, x: torch.Tensor, config: dict[str, Any], timeout: float, history: list[RoundRecord]
    ) -> tuple[torch.Tensor, MetricRecord | None]:
        """One FedAvg round from x with every connected node; (new model or x if nothing arrived, metrics)."""
        arrays = vector_arrays({MODEL_KEY: x}, self.layout)
        messages = self.configure_train(server_round, arrays, ConfigRecord(config), self._grid)
        replies = self._grid.send_and_receive(messages, timeout=timeout)
        running, metrics = self.stream_train(server_round, replies, history)
        if running.count == 0 or running.total <= 0:
            return x, None
        return torch.from_numpy(arrays_vector(running.mean(), self.layout)), self._metrics(metrics)

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start`` (train, client evaluation, ``evaluate_fn`` each round) with a new session,
        footprint rounds and initial model whenever the connected nodes change."""
        self._grid = grid if isinstance(grid, ArrivalGrid) else ArrivalGrid(grid, self.poll_interval)
        base = dict(train_config or {})
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        if evaluate_fn is not None and (res := evaluate_fn(0, initial_arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        x = torch.from_numpy(arrays_vector(initial_arrays, self.layout))
        self.builder = builder = self.algorithm.make_builder(x, self.layout)
        nodes: frozenset[int] | None = None
        session, first_round = -1, 1
        for rnd in range(1, num_rounds + 1):
            current = frozenset(self._grid.get_node_ids())
            if current != nodes:
                if session >= 0:
                    builder.end_session(session, x)
                session, nodes, first_round = session + 1, current, rnd
                if session >= builder.pilot_sessions:
                    w = builder.pilot
                    for v in range(self.algorithm.grad_rounds):
                        config = {**base, "session": session, "footprint-round": v}
                        w, _ = self._round(rnd, w, config, timeout, self.footprint_history)
                    builder.set_footprint(w)
                x, info = builder.initial_model(session, x)
                alpha = builder.last_alpha.tolist() if info else []
                self.sessions.append({"session": session, "round": rnd, "nodes": sorted(current), "alpha": alpha})
            config = {**base, "session": session, "session-start": first_round}
            x, metrics = self._round(rnd, x, config, timeout, self.history)
            arrays = result.arrays = vector_arrays({MODEL_KEY: x}, self.layout)
            if metrics is not None:
                result.train_metrics_clientapp[rnd] = metrics
            replies = self._grid.send_and_receive(
                self.configure_evaluate(rnd, arrays, ConfigRecord(dict(evaluate_config)), self._grid), timeout=timeout
            )
            if (evaluated := self.aggregate_evaluate(rnd, list(replies))) is not None:
                result.evaluate_metrics_clientapp[rnd] = evaluated
            if evaluate_fn is not None and (res := evaluate_fn(rnd, arrays)) is not None:
                result.evaluate_metrics_serverapp[rnd] = res
        if session >= 0:
            builder.end_session(session, x)  # the run's end closes the last session, as in the simulation
        return result


class LegacyFedAvg:
    """Factory of a legacy ``flwr.server.strategy.FedAvg`` whose ``aggregate_fit`` uses :func:`aggregate_inplace`
    (streaming, inputs untouched). ``LegacyFedAvg(**kwargs)`` takes FedAvg's arguments."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _legacy_class()(*args, **kwargs)


def _legacy_class() -> type:
    from flwr.common import ndarrays_to_parameters
    from flwr.server.strategy import FedAvg as LegacyBase

    class _LegacyFedAvg(LegacyBase):
        def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[Any, dict]:
            if not results or (failures and not self.accept_failures):
                return None, {}
            parameters = ndarrays_to_parameters(aggregate_inplace(results))
            metrics: dict = {}
            if self.fit_metrics_aggregation_fn:
                metrics = self.fit_metrics_aggregation_fn([(r.num_examples, r.metrics) for _, r in results])
            return parameters, metrics

    _LegacyFedAvg.__name__ = _LegacyFedAvg.__qualname__ = "LegacyFedAvg"
    return _LegacyFedAvg


# Configs, initial model and the ClientApp ---------------------------------------------------------------

#: Algorithms :func:`make_client_app` can run (each has a server strategy here): FedAvg/FedProx (:class:`FedAvg`),
#: BHerd, FedPBC, FedSpeed and the dynamic initial model (:class:`DynamicInit`).
CLIENT_ALGORITHMS = ("fedavg", "fedprox", "bherd", "fedpbc", "fedspeed", "dynamic")


def config_from_run_config(run_config: dict[str, Any]) -> Any:
    """An :class:`~pyfedkern.sim.config.ExperimentConfig` from a Flower run config.

    Keys are the options of :data:`~pyfedkern.sim.config.OPTIONS` with ``-`` for ``_`` (``local-steps``,
    ``lr-schedule``, ...); ``algorithm-params`` and ``model-params`` are JSON objects; an option that may be None
    is None for ``""`` or ``"none"`` (any case), and a count that may be None (``local-steps``, ``client-chunk``,
    ...) for 0; other keys are ignored (they belong to the app). ``aggregator`` chooses the server's strategy
    (:func:`robust_strategy`); ``attack`` is refused (the simulator's Byzantine clients).
    """
    from pyfedkern.sim.config import OPTIONS, ExperimentConfig

    values: dict[str, Any] = {}
    for key, value in run_config.items():
        option = OPTIONS.get(key.replace("-", "_"))
        if option is not None:
            values[option.name] = _run_config_value(option, key, value)
    config = ExperimentConfig(**values)
    config.validate()
    if config.attack is not None:
        raise ValueError(
            f"attack {config.attack!r} is a simulator setting: Flower runs have no Byzantine clients (remove it from "
            "the run config)"
        )
    return config


def _run_config_value(option: Any, key: str, value: Any) -> Any:
    """A run config's ``value`` of ``option`` (a :class:`~pyfedkern.sim.config.Option`) as the config field's."""
    if option.kind == "dict" and isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(f"{key} must be JSON, got {value!r} ({err})") from None
    text = isinstance(value, str) and value.strip().lower() in ("", "none")
    unset = text or (option.kind == "int" and value == 0 and not isinstance(value, bool))
    return None if option.optional and unset else value


def initial_arrays(config: Any) -> ArrayRecord:
    """The initial global model of ``config`` (as the simulation's): one array per trainable tensor, keyed by its
    parameter name (:func:`vector_arrays`); frozen parameters and buffers are not sent."""
    sim = _simulation(config)
    return vector_arrays({MODEL_KEY: sim.initial_vector}, sim.local.flat.layout)


_SIMULATIONS: dict[str, Any] = {}


def _simulation(config: Any) -> Any:
    """The (cached) simulation of ``config`` used as the client's FLContext (data, model, random streams)."""
    from pyfedkern.sim.engine import Simulation

    key = json.dumps(config.to_dict(), sort_keys=True)
    if key not in _SIMULATIONS:
        _SIMULATIONS.clear()
        _SIMULATIONS[key] = Simulation(config)
    return _SIMULATIONS[key]


class _NodeTeam(Team):
    """A Flower node's team: the one client it trains, whose per-client state rows are all it keeps."""

    def __init__(self, cid: int) -> None:
        self.owned = np.array([cid], dtype=np.int64)


class _NodeContext:
    """The client's simulation (an :class:`~pyfedkern.algorithms.FLContext`) as a node training client ``cid`` sees
    it: a team owning that client alone, so that per-client stores hold its row only; every other member is the
    simulation's."""

    def __init__(self, ctx: Any, cid: int) -> None:
        self._ctx = ctx
        self.team = _NodeTeam(cid)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


#: The prefix of the node's Context.state records that keep an algorithm's per-client state between rounds.
_STATE_PREFIX = "client-state:"


def client_train(config: Any, cid: int, server_round: int, content: RecordDict, state: RecordDict) -> RecordDict:
    """One local update of client ``cid`` for Flower round ``server_round`` (round t = server_round − 1 of the
    simulation); returns the reply content: ArrayRecord "arrays" (one array per trainable tensor and vector:
    :func:`vector_arrays`), MetricRecord "metrics" with
    "num-examples" (the partition's size) and "local-loss" (the mean loss of the local steps, NaN without steps).

    Every algorithm, a user's own (``package.module:Class``) included, runs the same way: set up from the received
    model in a context that owns client ``cid`` alone, its per-client state (:meth:`Algorithm.client_stores
    <pyfedkern.algorithms.Algorithm.client_stores>`: FedPBC's x_i, FedSpeed's h_i) restored from the node's
    persistent ``Context.state`` and saved back, the server's round settings handed to its ``node_round`` and
    ``node_receive`` hooks (DynamicInit's sessions, FedPBC's adoption), then its :meth:`client_update
    <pyfedkern.algorithms.Algorithm.client_update>` on the one row; it uploads the row's vectors and its server step
    is the strategy's.
    """
    from pyfedkern.sim.engine import _cpu_threads, threads_for_work

    if config.algorithm not in CLIENT_ALGORITHMS and not is_reference(config.algorithm):
        raise ValueError(
            f"algorithm {config.algorithm!r} has no Flower client; choose one of {CLIENT_ALGORITHMS}, or your own "
            "package.module:Class"
        )
    sim = _simulation(config)
    if not 0 <= cid < sim.num_clients:
        raise ValueError(f"partition-id must be in [0, {sim.num_clients}), got {cid}")
    if server_round < 1:
        raise ValueError(f"server_round must be >= 1 (Flower counts rounds from 1), got {server_round}")
    algo = _client_algorithm(config)
    received = content.array_records.get("arrays", ArrayRecord())
    settings = dict(content.config_records["config"]) if "config" in content.config_records else {}
    threads = config.threads or threads_for_work(sim.batch_size * sim.local.dim, torch.get_num_threads())
    with _cpu_threads(threads):
        worker, ctx, t = algo.node_round(_NodeContext(sim, cid), server_round - 1, settings)
        worker.setup(ctx, _model_vector(received, sim) if len(received) else sim.initial_vector)
        stores = worker.client_stores()
        kept = {name: _STATE_PREFIX + name for name in stores}
        restored = bool(stores) and all(key in state.array_records for key in kept.values())
        if not len(received) and not restored:  # FedPBC's server sends no model to a node that keeps its own
            raise ValueError("the message carries no model and the node keeps no state to train from")
        if restored:
            for name, store in stores.items():
                store[cid].copy_(torch.from_numpy(_flat(state.array_records[kept[name]], name)))
        worker.node_receive(cid, settings, restored)
        updates = worker.client_update(t, np.array([cid], dtype=np.int64), ctx)
        for name, store in stores.items():
            state.array_records[kept[name]] = _record({name: store[cid].numpy()})
    vectors = {name: rows[0] for name, rows in updates.vectors.items()}
    metrics = MetricRecord({"num-examples": int(sim.client_sizes[cid]), "local-loss": float(updates.losses[0])})
    arrays = vector_arrays(vectors, sim.local.flat.layout)
    return RecordDict({"arrays": arrays, "metrics": metrics})


def _model_vector(record: ArrayRecord, sim: Any) -> torch.Tensor:
    """The model vector of a message's ArrayRecord, checked against the config's model."""
    try:
        x = torch.from_numpy(arrays_vector(record, sim.local.flat.layout))
    except ValueError as exc:
        raise ValueError(
            f"the received model does not match this config's: {exc}; the server's initial_arrays must come from the "
            "same config as the nodes'"
        ) from None
    if x.dtype != sim.local.flat.data.dtype:
        raise ValueError(
            f"the received model is {x.dtype}, but this config's model is {sim.local.flat.data.dtype}: the server's "
            "initial_arrays must come from the same config as the nodes'"
        )
    return x


def client_evaluate(config: Any, cid: int, content: RecordDict) -> RecordDict:
    """Loss and accuracy of the received model on client ``cid``'s training partition."""
    sim = _simulation(config)
    x = _model_vector(content.array_records["arrays"], sim)
    loss, acc = sim.local.evaluate(x, sim.client_x[cid], sim.client_y[cid])
    n = int(sim.client_sizes[cid])
    return RecordDict({"metrics": MetricRecord({"num-examples": n, "eval-loss": float(loss), "eval-acc": float(acc)})})


def make_client_app(
    config: Any | Callable[[Context], Any] | None = None,
    *,
    partition_key: str = "partition-id",
    mods: list[Callable[..., Any]] | None = None,
) -> ClientApp:
    """A Flower ``ClientApp`` running a pyfedkern algorithm's local update on this node's partition.

    Args:
        config: an ExperimentConfig, a callable ``context -> ExperimentConfig``, or None to read it from the run
            config (:func:`config_from_run_config`). Every node must use the same config as the server.
        partition_key: the ``--node-config`` key holding this node's client id (partition).
        mods: Flower client mods around the app (``flwr.clientapp.mod.fixedclipping_mod`` for
            ``DifferentialPrivacyClientSideFixedClipping``).
    """

    def resolve(context: Context) -> Any:
        if config is None:
            return config_from_run_config(dict(context.run_config))
        return config(context) if callable(config) else config

    def cid_of(context: Context) -> int:
        if partition_key not in context.node_config:
            raise ValueError(f"node config has no {partition_key!r} (start the SuperNode with --node-config)")
        return int(context.node_config[partition_key])

    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        server_round = int(msg.content.config_records["config"]["server-round"])
        content = client_train(resolve(context), cid_of(context), server_round, msg.content, context.state)
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return Message(content=client_evaluate(resolve(context), cid_of(context), msg.content), reply_to=msg)

    return app


__all__ = [
    "CLIENT_ALGORITHMS",
    "MODEL_KEY",
    "ArrivalGrid",
    "BHerd",
    "Bulyan",
    "DynamicInit",
    "FedAvg",
    "FedMedian",
    "FedPBC",
    "FedSpeed",
    "FedTrimmedAvg",
    "Krum",
    "LegacyFedAvg",
    "MultiKrum",
    "RoundRecord",
    "aggregate",
    "aggregate_inplace",
    "array_view",
    "arrays_vector",
    "central_dp_of",
    "client_evaluate",
    "client_train",
    "config_from_run_config",
    "dynamic_algorithm",
    "initial_arrays",
    "make_client_app",
    "mean_metrics",
    "model_layout",
    "robust_strategy",
    "server_evaluation",
    "vector_arrays",
]
