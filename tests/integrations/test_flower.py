"""pyfedkern.integrations.flower: drop-in aggregation vs Flower's own and NumPy, strategies on in-process messages,
client updates vs pyfedkern.sim, and real SuperLink + SuperNodes on loopback with a node killed mid-run (slow)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters  # noqa: E402
from flwr.common.config import get_project_config  # noqa: E402
from flwr.server.strategy.aggregate import aggregate as flower_aggregate  # noqa: E402
from flwr.server.strategy.aggregate import aggregate_inplace as flower_aggregate_inplace  # noqa: E402
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg  # noqa: E402
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from pyfedkern import ops  # noqa: E402
from pyfedkern.algorithms import local_sgd, make_algorithm  # noqa: E402
from pyfedkern.algorithms.fedavg import FedAvg as FedAvgAlgorithm  # noqa: E402
from pyfedkern.integrations import flower as pf  # noqa: E402
from pyfedkern.sim.config import ExperimentConfig  # noqa: E402
from pyfedkern.sim.engine import Simulation  # noqa: E402

APP = Path(__file__).resolve().parents[2] / "examples" / "flower"


@pytest.fixture(autouse=True)
def task_identity():
    """Flower messages need a run id outside a running app."""
    before = TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = before


def _results(rng, k=5, dtype=np.float32):
    shapes = [(4, 3, 3), (7,), (2, 5)]
    return [([rng.standard_normal(s).astype(dtype) for s in shapes], int(rng.integers(1, 100))) for _ in range(k)]


def _numpy_mean(results):
    n = np.array([c for _, c in results], dtype=np.float64)
    return [sum(r[0][i].astype(np.float64) * c for r, c in zip(results, n, strict=True)) / n.sum() for i in range(3)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_aggregate_matches_flower_and_numpy(dtype):
    rng = np.random.default_rng(0)
    results = _results(rng, dtype=dtype)
    copies = [[layer.copy() for layer in layers] for layers, _ in results]
    ours = pf.aggregate(results)
    tol = 1e-6 if dtype == np.float32 else 1e-12
    for a, b, c in zip(ours, flower_aggregate(results), _numpy_mean(results), strict=True):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
        np.testing.assert_allclose(a, c, rtol=tol, atol=tol)
    for layers, saved in zip(results, copies, strict=True):
        for x, y in zip(layers[0], saved, strict=True):
            np.testing.assert_array_equal(x, y)


def _bitwise_equal(ours, theirs):
    """Same dtypes and shapes, NaN where the other has NaN (any payload), every other element bit for bit."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        nan = np.isnan(a) if a.dtype.kind == "f" else np.zeros(a.shape, bool)
        assert np.array_equal(nan, np.isnan(b) if b.dtype.kind == "f" else nan)
        assert a[~nan].tobytes() == b[~nan].tobytes(), np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))


def test_aggregate_keeps_integer_inputs_exact_as_flower():
    """Flower's own test case: identical integer models with counts 1 and 2 average to exactly themselves."""
    first, second = np.arange(1, 7).reshape(2, 3), np.arange(7, 11)
    results = [([first, second], 1), ([first.copy(), second.copy()], 2)]
    ours = pf.aggregate(results)
    np.testing.assert_equal(ours, [first, second])  # 7.0 exactly, not 6.999999999999999
    _bitwise_equal(ours, flower_aggregate(results))
    assert [a.dtype for a in ours] == [np.float64, np.float64]


@pytest.mark.filterwarnings("ignore:overflow encountered")  # float16 sums overflow to inf, as Flower's do
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16])
def test_aggregate_is_flower_bit_for_bit(dtype):
    rng = np.random.default_rng(11)
    for _ in range(12):
        k = int(rng.integers(1, 14))
        results = []
        for i in range(k):
            layers = [(rng.standard_normal(s) * 20).astype(dtype) for s in [(3, 4), (1,), (4097,)]]
            results.append((layers, int(rng.integers(1 if i == 0 else 0, 500))))
        _bitwise_equal(pf.aggregate(results), flower_aggregate(results))


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_aggregate_follows_flower_on_edge_values():
    neg0 = np.array([-0.0, -0.0, 0.0, 1e308, np.inf, 5.0])
    results = [([neg0], 3), ([np.array([-0.0, 0.0, -0.0, 1e308, 1.0, np.nan])], 4)]
    _bitwise_equal(pf.aggregate(results), flower_aggregate(results))  # -0.0 kept, overflow to inf, inf and NaN
    assert np.signbit(pf.aggregate(results)[0][0])
    with np.errstate(invalid="ignore"):  # a count-0 client's inf gives NaN (inf·0), its -0.0 keeps the sign rule
        results = [([np.array([1.0, -0.0, 2.0], np.float32)], 0), ([np.array([1.0, -0.0, np.inf], np.float32)], 2)]
        results[0][0][0][0] = np.inf
        _bitwise_equal(pf.aggregate(results), flower_aggregate(results))
    assert np.isnan(pf.aggregate(results)[0][0]) and np.signbit(pf.aggregate(results)[0][1])


def test_aggregate_follows_numpy_type_rules_of_the_counts():
    rng = np.random.default_rng(12)
    layers = [[rng.standard_normal(8).astype(np.float32)] for _ in range(3)]
    for counts in ([3, 5, 7], [np.int64(3), np.int64(5), np.int64(7)], [1.5, 2.0, 0.25], [np.float32(2), 1, 1]):
        results = list(zip(layers, counts, strict=True))
        ours = pf.aggregate(results)
        _bitwise_equal(ours, flower_aggregate(results))
    assert pf.aggregate([(layers[0], 1), (layers[1], 2)])[0].dtype == np.float32  # Python ints keep float32
    assert pf.aggregate([(layers[0], np.int64(1)), (layers[1], 2)])[0].dtype == np.float64  # NumPy ints promote
    mixed = [([np.ones(5, np.float32)], 1), ([np.full(5, 0.1)], 2)]  # float32 and float64 clients: float64
    _bitwise_equal(pf.aggregate(mixed), flower_aggregate(mixed))


def test_aggregate_float16_stays_float16():
    rng = np.random.default_rng(13)
    results = [([rng.standard_normal((6, 5)).astype(np.float16)], int(rng.integers(1, 9))) for _ in range(4)]
    ours = pf.aggregate(results)
    assert ours[0].dtype == np.float16
    _bitwise_equal(ours, flower_aggregate(results))


def test_aggregate_rejects_bad_input():
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="results is empty"):
        pf.aggregate([])
    with pytest.raises(ValueError, match="num_examples"):
        pf.aggregate([([np.ones(3, np.float32)], 0)])
    with pytest.raises(ValueError, match="layers"):
        pf.aggregate([([np.ones(3, np.float32)], 1), ([np.ones(3, np.float32)] * 2, 1)])
    with pytest.raises(ValueError, match="shape"):
        pf.aggregate([([np.ones(3, np.float32)], 1), ([np.ones(4, np.float32)], 1)])
    with pytest.raises(TypeError, match="results"):
        pf.aggregate(rng)


def _fit_results(results):
    return [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(layers), n, {})) for layers, n in results]


def test_aggregate_inplace_matches_flower_and_leaves_inputs():
    rng = np.random.default_rng(2)
    results = _results(rng)
    fits = _fit_results(results)
    payload = [list(fit.parameters.tensors) for _, fit in fits]
    ours = pf.aggregate_inplace(fits)
    assert [list(fit.parameters.tensors) for _, fit in fits] == payload  # serialized inputs untouched
    for a, b, c in zip(ours, flower_aggregate_inplace(_fit_results(results)), _numpy_mean(results), strict=True):
        assert a.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_aggregate_inplace_keeps_float_dtypes_as_flower(dtype):
    rng = np.random.default_rng(5)
    shapes = [(4, 3, 3), (7,), (2, 5)]  # _numpy_mean's three layers
    results = [([rng.standard_normal(s).astype(dtype) for s in shapes], int(rng.integers(1, 99))) for _ in range(6)]
    ours, theirs = pf.aggregate_inplace(_fit_results(results)), flower_aggregate_inplace(_fit_results(results))
    if dtype == np.float64:
        _bitwise_equal(ours, theirs)
    for a, b, c in zip(ours, theirs, _numpy_mean(results), strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(a.astype(np.float64), c, rtol=1e-3, atol=1e-3)  # float16 rounding


def _extreme_counts_case(counts, seed):
    """K clients' float32 "w" and float64 "b" arrays with ``counts``, and the exact float64 weighted means."""
    rng = np.random.default_rng(seed)
    payload = [
        {"w": (rng.standard_normal((3, 4)) * 10).astype(np.float32), "b": rng.standard_normal(4)} for _ in counts
    ]
    total = sum(Fraction(c) for c in counts)
    shares = [float(Fraction(c) / total) for c in counts]
    exact = {key: sum(p[key].astype(np.float64) * w for p, w in zip(payload, shares, strict=True)) for key in "wb"}
    return payload, exact


EXTREME_COUNTS = [
    [1e38, 1e38, 3e38],  # each product of a float32 layer by its count overflows float32
    [1.0, 1e38],
    [1e300, 3e300],
    [1e-310, 3e-310, 2e-310],  # subnormal: 1 / total overflows
    [1e308, 1e308],  # the float sum of the counts overflows
    [5, 0, 7],
]


@pytest.mark.parametrize("counts", EXTREME_COUNTS, ids=str)
@pytest.mark.parametrize("arrival", ["streamed", "list"])
def test_fedavg_normalises_the_counts_before_multiplying(counts, arrival):
    payload, exact = _extreme_counts_case(counts, seed=len(counts))
    nodes = list(range(1, len(counts) + 1))
    grid = FakeGrid(nodes, lambda node, msg: _reply(payload[node - 1], counts[node - 1], loss=float(node)))
    msgs = [Message(RecordDict({"x": ConfigRecord({})}), message_type="train", dst_node_id=n) for n in nodes]
    replies = pf.ArrivalGrid(grid).send_and_receive(msgs, timeout=5)
    replies = list(replies) if arrival == "list" else replies
    arrays, metrics = pf.FedAvg().aggregate_train(1, replies)
    for key, tol in (("w", 1e-6), ("b", 1e-15)):
        got = arrays[key].numpy()
        assert got.dtype == payload[0][key].dtype
        np.testing.assert_allclose(got, exact[key], rtol=tol, atol=tol * 10)
    loss = sum(
        float(Fraction(c) / sum(Fraction(x) for x in counts)) * node for c, node in zip(counts, nodes, strict=True)
    )
    assert metrics["loss"] == pytest.approx(loss, rel=1e-15)
    if math.isfinite(sum(counts)):  # Flower's FedAvg normalises first too: the same means (it sums inf otherwise)
        grid = FakeGrid(nodes, lambda node, msg: _reply(payload[node - 1], counts[node - 1], loss=float(node)))
        theirs, _ = FlowerFedAvg().aggregate_train(1, list(pf.ArrivalGrid(grid).send_and_receive(msgs, timeout=5)))
        for key in "wb":
            np.testing.assert_allclose(arrays[key].numpy(), theirs[key].numpy(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("counts", EXTREME_COUNTS, ids=str)
def test_aggregate_inplace_normalises_the_counts_before_multiplying(counts):
    payload, exact = _extreme_counts_case(counts, seed=7)
    fits = _fit_results([([p["w"], p["b"]], c) for p, c in zip(payload, counts, strict=True)])
    ours = pf.aggregate_inplace(fits)
    np.testing.assert_allclose(ours[0], exact["w"], rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(ours[1], exact["b"], rtol=1e-15, atol=1e-14)
    if math.isfinite(sum(counts)):  # Flower's shares n/N are exact too: float64 layers bit for bit
        _bitwise_equal(ours[1:], flower_aggregate_inplace(fits)[1:])


def test_mean_metrics_is_exact_for_any_finite_weights():
    def replies(weights):
        return [
            RecordDict({"metrics": MetricRecord({"num-examples": w, "loss": float(k + 1)})})
            for k, w in enumerate(weights)
        ]

    for weights, expected in [([1e308, 1e308], 1.5), ([1e308, 3e307], (1 + 0.6) / 1.3), ([1e-310, 3e-310], 1.75)]:
        assert pf.mean_metrics(replies(weights), "num-examples")["loss"] == pytest.approx(expected, rel=1e-15)
    normal = replies([3, 10, 0.5])  # where Flower's own sum of the weights is finite: Flower's value, bit for bit
    assert pf.mean_metrics(normal, "num-examples")["loss"] == aggregate_metricrecords(normal, "num-examples")["loss"]
    with pytest.raises(ValueError, match=r"records\[1\]: 'num-examples' must be finite and >= 0"):
        pf.mean_metrics(replies([1.0, -2.0]), "num-examples")


def test_complex_layers_are_refused_by_every_aggregation():
    real, cplx = np.ones(3), np.array([1 + 2j, 3j, 1])
    with pytest.raises(TypeError, match=r"results\[1\] layer 0 has dtype complex128"):
        pf.aggregate([([real], 1), ([cplx], 1)])
    with pytest.raises(TypeError, match=r"results\[1\]: array '0' has dtype complex128"):
        pf.aggregate_inplace(_fit_results([([real], 1), ([cplx], 1)]))
    strategy = pf.LegacyFedAvg(accept_failures=False)
    with pytest.raises(TypeError, match="has dtype complex128"):
        strategy.aggregate_fit(1, _fit_results([([cplx], 1)]), [])
    grid = FakeGrid([1, 2], lambda node, msg: _reply({"model": real if node == 1 else cplx}, 1))
    msgs = [Message(RecordDict({"x": ConfigRecord({})}), message_type="train", dst_node_id=n) for n in (1, 2)]
    for listed in (False, True):
        replies = pf.ArrivalGrid(grid).send_and_receive(msgs, timeout=5)
        with pytest.raises(TypeError, match="reply of node 2: array 'model' has dtype complex128"):
            pf.FedAvg().aggregate_train(1, list(replies) if listed else replies)


def test_fraction_counts_are_taken_as_flower_takes_them():
    rng = np.random.default_rng(21)
    counts = [Fraction(1, 3), Fraction(2, 7), 2, Fraction(5, 3)]
    for dtype in (np.float32, np.float64):
        results = [
            ([rng.standard_normal((4, 3)).astype(dtype), rng.standard_normal(5).astype(dtype)], n) for n in counts
        ]
        theirs = flower_aggregate(results)  # object arrays of Python floats
        assert theirs[0].dtype == object
        ours = pf.aggregate(results)
        _bitwise_equal(ours, [np.asarray(layer, dtype=np.float64) for layer in theirs])
    integers = [([np.arange(6).reshape(2, 3)], n) for n in counts]  # Flower: exact rationals; pyfedkern: float64
    exact = [np.asarray(layer, dtype=np.float64) for layer in flower_aggregate(integers)]
    np.testing.assert_allclose(pf.aggregate(integers)[0], exact[0], rtol=1e-15)
    inplace = pf.aggregate_inplace(_fit_results(results))  # Flower's own aggregate_inplace fails on fractions
    np.testing.assert_allclose(inplace[0], ours[0], rtol=1e-15)
    with pytest.raises(ValueError, match=r"results\[1\]: num_examples must be finite and >= 0"):
        pf.aggregate([([np.ones(2)], 1), ([np.ones(2)], Fraction(-1, 2))])
    with pytest.raises(ValueError, match=r"results\[0\]: num_examples must be finite"):
        pf.aggregate([([np.ones(2)], 10**400)])


def test_legacy_fedavg_aggregate_fit():
    rng = np.random.default_rng(3)
    results = _results(rng)
    strategy = pf.LegacyFedAvg(accept_failures=False)
    assert isinstance(strategy, flwr.server.strategy.FedAvg)
    params, _ = strategy.aggregate_fit(1, _fit_results(results), [])
    got = flwr.common.parameters_to_ndarrays(params)
    for a, c in zip(got, _numpy_mean(results), strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-6, atol=1e-6)
    assert strategy.aggregate_fit(1, _fit_results(results), [RuntimeError("x")]) == (None, {})


# In-process messages -------------------------------------------------------------------------------------


class FakeGrid:
    """A Grid whose nodes answer with ``handler(node, message) -> RecordDict | Error | None`` (None: no reply)."""

    def __init__(self, nodes, handler):
        self.nodes = list(nodes)
        self.handler = handler
        self.replies: dict[str, Message] = {}
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            self.sent.append(msg)
            answer = self.handler(msg.metadata.dst_node_id, msg)
            if answer is not None:
                reply = Message(answer, reply_to=msg)
                reply.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
                self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def _reply(arrays: dict, n: float, **metrics) -> RecordDict:
    record = ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})
    return RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": n, **metrics})})


def test_fedavg_aggregate_train_matches_flower_strategy():
    rng = np.random.default_rng(4)
    payload = {n: {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4)} for n in (1, 2, 3)}
    sizes = {1: 10, 2: 30, 3: 5}

    def handler(node, msg):
        return _reply(payload[node], sizes[node], loss=float(node))

    ours, theirs = pf.FedAvg(), FlowerFedAvg()
    grid = FakeGrid([1, 2, 3], handler)
    msgs = [Message(RecordDict({"x": ConfigRecord({})}), message_type="train", dst_node_id=n) for n in (1, 2, 3)]
    replies = list(pf.ArrivalGrid(grid).send_and_receive(msgs, timeout=5))
    arrays, metrics = ours.aggregate_train(1, iter(replies))
    ref_arrays, ref_metrics = theirs.aggregate_train(1, replies)
    for key in ("w", "b"):
        expected = sum(payload[n][key].astype(np.float64) * sizes[n] for n in (1, 2, 3)) / 45
        np.testing.assert_allclose(arrays[key].numpy(), expected, rtol=1e-6)
        np.testing.assert_allclose(arrays[key].numpy(), ref_arrays[key].numpy(), rtol=1e-6)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"])
    assert ours.history[-1].received == [1, 2, 3] and ours.history[-1].failed == []


@pytest.mark.parametrize(
    ("dtypes", "promoted"),
    [
        ((np.float32, np.float64), np.float64),
        ((np.float64, np.float32), np.float64),
        ((np.float32, np.float16, np.float32), np.float32),
        ((np.float16, np.int8), np.float16),
        ((np.int32, np.float32), np.float64),
        ((np.int64, np.int64), np.float64),
    ],
    ids=str,
)
@pytest.mark.parametrize("arrival", ["streamed", "list"])
def test_fedavg_replies_of_different_dtypes_average_in_numpys_promotion_of_them(dtypes, promoted, arrival):
    """A float32 reply then a float64 one gave float32 streamed and float64 listed: now both give NumPy's promotion
    of the replies' dtypes, in whatever order they arrive (aggregate_inplace too)."""
    rng = np.random.default_rng(len(dtypes))
    payload = [(rng.standard_normal(4099) * 20).astype(dtype) for dtype in dtypes]
    counts = [3, 1, 2][: len(dtypes)]
    exact = sum(x.astype(np.float64) * n for x, n in zip(payload, counts, strict=True)) / sum(counts)
    nodes = list(range(1, len(dtypes) + 1))
    grid = FakeGrid(nodes, lambda node, msg: _reply({"model": payload[node - 1]}, counts[node - 1]))
    msgs = [Message(RecordDict({"x": ConfigRecord({})}), message_type="train", dst_node_id=n) for n in nodes]
    replies = pf.ArrivalGrid(grid).send_and_receive(msgs, timeout=5)
    arrays, _ = pf.FedAvg().aggregate_train(1, list(replies) if arrival == "list" else replies)
    got = arrays["model"].numpy()
    tol = 4 * np.finfo(promoted).eps * 20  # a few roundings of values of size ~20·4
    assert got.dtype == promoted
    np.testing.assert_allclose(got, exact, rtol=tol, atol=tol * 4)
    inplace = pf.aggregate_inplace(_fit_results([([x], n) for x, n in zip(payload, counts, strict=True)]))
    assert inplace[0].dtype == promoted
    np.testing.assert_allclose(inplace[0], exact, rtol=tol, atol=tol * 4)


def test_fedavg_counts_errors_and_timeouts_as_failures():
    def handler(node, msg):
        if node == 2:
            return Error(code=5, reason="node unavailable")
        if node == 3:
            return None  # never answers
        return _reply({"model": np.full(3, float(node), np.float32)}, 1)

    strategy = pf.FedAvg(min_available_nodes=1, min_train_nodes=1)
    grid = pf.ArrivalGrid(FakeGrid([1, 2, 3, 4], handler), poll_interval=0.01)
    strategy._grid = grid
    msgs = strategy.configure_train(1, ArrayRecord({"model": Array(np.zeros(3, np.float32))}), ConfigRecord(), grid)
    arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(msgs, timeout=0.3))
    np.testing.assert_allclose(arrays["model"].numpy(), np.full(3, 2.5))
    assert strategy.history[-1].received == [1, 4]
    assert strategy.history[-1].failed == [2, 3]


@pytest.mark.parametrize("strategy", [pf.FedAvg, pf.FedMedian], ids=["fedavg", "fedmedian"])
@pytest.mark.parametrize(
    ("uploaded", "message"),
    [
        ({"head": np.ones(3, np.float32), "backbone": np.ones(2, np.float32)}, r"arrays \['backbone'\] that the round"),
        ({"other": np.ones(3, np.float32)}, r"arrays \['other'\] that the round"),
    ],
    ids=["a frozen layer too", "another name"],
)
def test_replies_must_hold_the_arrays_the_round_sent(strategy, uploaded, message):
    """A client uploading arrays the round did not send (its frozen backbone, say) is refused by name, instead of
    the arrays joining the global model."""

    def handler(node, msg):
        return _reply(uploaded, 1)

    ours = strategy(min_available_nodes=1, min_train_nodes=1)
    grid = pf.ArrivalGrid(FakeGrid([1, 2], handler), poll_interval=0.01)
    ours._grid = grid
    x0 = ArrayRecord({"head": Array(np.zeros(3, np.float32))})
    replies = list(grid.send_and_receive(ours.configure_train(1, x0, ConfigRecord(), grid), timeout=1))
    with pytest.raises(ValueError, match=message):
        ours.aggregate_train(1, replies)


def test_replies_lacking_an_array_the_round_sent_are_refused():
    strategy = pf.FedAvg(min_available_nodes=1, min_train_nodes=1)
    grid = pf.ArrivalGrid(FakeGrid([1], lambda node, msg: _reply({"a": np.ones(2)}, 1)), poll_interval=0.01)
    strategy._grid = grid
    x0 = ArrayRecord({"a": Array(np.zeros(2)), "b": Array(np.zeros(2))})
    replies = list(grid.send_and_receive(strategy.configure_train(1, x0, ConfigRecord(), grid), timeout=1))
    with pytest.raises(ValueError, match=r"lack arrays \['b'\] of the round's model"):
        strategy.aggregate_train(1, replies)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_fedavg_leaves_out_a_reply_holding_nan_or_inf_as_failed(bad):
    def handler(node, msg):
        model = np.full(3, float(node), np.float32)
        if node == 2:
            model[1] = bad  # a client whose training diverged
        return _reply({"model": model}, 1, loss=float(node))

    for listed in (False, True):  # replies streamed (each checked) or all in memory (the mean checked first)
        strategy = pf.FedAvg(min_available_nodes=1, min_train_nodes=1)
        grid = pf.ArrivalGrid(FakeGrid([1, 2, 3], handler), poll_interval=0.01)
        strategy._grid = grid
        x0 = ArrayRecord({"model": Array(np.zeros(3, np.float32))})
        replies = grid.send_and_receive(strategy.configure_train(1, x0, ConfigRecord(), grid), timeout=1)
        with pytest.warns(UserWarning, match="round 1: the reply of node 2 holds NaN or inf"):
            arrays, metrics = strategy.aggregate_train(1, list(replies) if listed else replies)
        np.testing.assert_array_equal(arrays["model"].numpy(), np.full(3, 2.0))  # the mean of nodes 1 and 3
        assert strategy.history[-1].received == [1, 3] and strategy.history[-1].failed == [2]
        assert metrics["loss"] == 2.0  # its metrics are left out too


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_finiteness_probe_finds_every_nan_and_inf(dtype):
    """float32/float64 go through a BLAS product with zeros: a BLAS that skipped zero factors would miss them."""
    from pyfedkern.integrations.flower import _ROW, _all_finite

    for n in (0, 5, _ROW, 3 * _ROW + 7):
        values = np.ones(n, dtype)
        assert _all_finite(values) and _all_finite(values.reshape(-1, 1))
        for position in {0, n // 2, n - 1} if n else ():
            for bad in (np.nan, np.inf, -np.inf):
                values[position] = bad
                assert not _all_finite(values), (n, position, bad)
                values[position] = 1
    assert _all_finite(np.array([np.finfo(dtype).max, np.finfo(dtype).tiny], dtype))  # large or tiny is finite
    assert _all_finite(np.arange(5))  # integers are always finite


def test_fedavg_rejects_reply_without_weight():
    strategy = pf.FedAvg()
    grid = FakeGrid([7], lambda node, msg: RecordDict({"arrays": ArrayRecord({"model": Array(np.ones(2))})}))
    msgs = [Message(RecordDict({"x": ConfigRecord({})}), message_type="train", dst_node_id=7)]
    with pytest.raises(ValueError, match="node 7 has no metric 'num-examples'"):
        strategy.aggregate_train(1, pf.ArrivalGrid(grid).send_and_receive(msgs, timeout=1))


def test_fedpbc_only_arrived_clients_receive_the_model():
    models = {1: np.full(4, 1.0, np.float32), 2: np.full(4, 2.0, np.float32), 3: np.full(4, 6.0, np.float32)}
    down = {1, 3}  # node 2 fails in round 1 only... round 2 everyone answers

    def handler(node, msg):
        if node in down:
            down.discard(node) if node == 1 else None
            if node == 3:
                return Error(code=5, reason="link down")
        return _reply({"model": models[node]}, 123)

    down = {3}
    strategy = pf.FedPBC(min_available_nodes=1, min_train_nodes=1)
    grid = pf.ArrivalGrid(FakeGrid([1, 2, 3], handler), poll_interval=0.01)
    strategy._grid = grid
    x0 = ArrayRecord({"model": Array(np.zeros(4, np.float32))})
    msgs = list(strategy.configure_train(1, x0, ConfigRecord(), grid))
    assert all(m.content["config"]["pbc-adopt"] for m in msgs)  # first contact: everyone gets x0
    x1, _ = strategy.aggregate_train(1, grid.send_and_receive(msgs, timeout=1))
    np.testing.assert_allclose(x1["model"].numpy(), np.full(4, 1.5))  # uniform mean of nodes 1 and 2
    assert strategy.history[-1].failed == [3]
    down.clear()
    msgs = {m.metadata.dst_node_id: m for m in strategy.configure_train(2, x1, ConfigRecord(), grid)}
    assert msgs[1].content["config"]["pbc-adopt"] and msgs[2].content["config"]["pbc-adopt"]
    assert not msgs[3].content["config"]["pbc-adopt"] and len(msgs[3].content["arrays"]) == 0


def test_bherd_server_step():
    config = ExperimentConfig(algorithm="bherd", algorithm_params={"alpha": 0.5}, clients=2, lr=0.2, local_steps=4)
    layout = pf.model_layout(config)
    rng = np.random.default_rng(0)
    g = {node: rng.normal(size=layout.size).astype(np.float32) for node in (1, 2)}
    replies = {node: dict(pf.vector_arrays({"g": g[node]}, layout).items()) for node in (1, 2)}
    assert sorted(replies[1]) == sorted(f"g/{name}" for name in layout.names())  # one array per parameter
    grid = FakeGrid([1, 2], lambda node, msg: _reply({k: a.numpy() for k, a in replies[node].items()}, node))
    strategy = pf.BHerd(config, min_available_nodes=1, min_train_nodes=2)
    strategy._grid = pf.ArrivalGrid(grid)
    x = rng.normal(size=layout.size).astype(np.float32)
    msgs = strategy.configure_train(1, pf.vector_arrays({"model": x}, layout), ConfigRecord(), grid)
    new, _ = strategy.aggregate_train(1, strategy._grid.send_and_receive(msgs, timeout=1))
    assert list(new) == layout.names()
    mean = (1 * g[1] + 2 * g[2]) / 3
    np.testing.assert_allclose(_vector(config, new), x - 0.2 * (1.0 / 0.5) * mean, rtol=1e-5, atol=1e-6)


def test_bherd_reply_without_g_is_a_clear_error():
    config = ExperimentConfig(algorithm="bherd", algorithm_params={"alpha": 0.5}, clients=2, lr=0.2, local_steps=4)
    layout = pf.model_layout(config)
    model = {k: a.numpy() for k, a in pf.vector_arrays({"model": np.ones(layout.size, np.float32)}, layout).items()}
    grid = FakeGrid([1, 2], lambda node, msg: _reply(model, node))
    strategy = pf.BHerd(config, min_available_nodes=1, min_train_nodes=2)
    strategy._grid = pf.ArrivalGrid(grid)
    msgs = strategy.configure_train(1, pf.vector_arrays({"model": np.zeros(layout.size)}, layout), ConfigRecord(), grid)
    with pytest.raises(ValueError, match=r"the replies must carry 'g'.*lack \['g/"):
        strategy.aggregate_train(1, strategy._grid.send_and_receive(msgs, timeout=1))


def _dynamic_config(**params):
    return ExperimentConfig(
        algorithm="dynamic",
        algorithm_params={"sessions": 5, "pilot_sessions": 2, "scale": 10.0, **params},
        dataset="digits",
        partition="groups:0.2,0.3",
        clients=6,
        model="mlp",
        model_params={"hidden": 16},
        rounds=10,  # 5 sessions of T = 2 rounds
        local_steps=2,
        batch_size=32,
        lr=0.1,
        seed=2,
    )


def test_dynamic_init_equals_the_simulation():
    """Nodes of group A, then B, A, B, A (node id = client id + 100) with pyfedkern's clients: the pilot mean
    (P = 2), the footprint gradients (constant LR η0/2, their own minibatches), the initial models and the final
    model equal pyfedkern.algorithms.dynamic in the simulation; footprint rounds are not training rounds."""
    T = 2
    config = _dynamic_config()
    sim = Simulation(config)
    sim.run()
    groups = sim.partition.groups
    members = [[int(c) + 100 for c in np.flatnonzero(groups == g)] for g in (0, 1)]
    sent = []

    def handler(node, msg):
        sent.append(dict(msg.content["config"]))
        return pf.client_train(
            config, node - 100, int(msg.content["config"]["server-round"]), msg.content, RecordDict()
        )

    grid = FakeGrid(members[0], handler)

    def next_session(rnd, arrays):  # after the last round of a session, its nodes leave and the other group joins
        if rnd % T == 0:
            grid.nodes = members[(rnd // T) % 2]

    strategy = pf.DynamicInit(config, min_available_nodes=1, min_train_nodes=1, fraction_evaluate=0.0)
    result = strategy.start(grid, pf.initial_arrays(config), num_rounds=10, timeout=5, evaluate_fn=next_session)

    ours, theirs = strategy.builder, sim.algorithm.builder
    torch.testing.assert_close(ours.pilot, theirs.pilot, rtol=1e-5, atol=1e-6)  # mean of both pilot sessions
    assert ours.store.session_ids().tolist() == theirs.store.session_ids().tolist() == [3, 4]  # history = 2
    for mine, ref in zip(ours.store.grad_rows(), theirs.store.grad_rows(), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-6)  # footprint gradients G_3, G_4
    for mine, ref in zip(ours.store.model_rows(), theirs.store.model_rows(), strict=True):
        torch.testing.assert_close(mine, ref, rtol=1e-4, atol=1e-5)  # last models of sessions 3, 4
    np.testing.assert_allclose(ours.last_alpha, theirs.last_alpha, rtol=1e-4, atol=1e-6)
    final = _vector(config, result.arrays)
    np.testing.assert_allclose(final, sim.algorithm.global_model().numpy(), rtol=1e-4, atol=1e-5)

    assert [s["round"] for s in strategy.sessions] == [1, 3, 5, 7, 9]
    assert [len(s["alpha"]) for s in strategy.sessions] == [0, 0, 0, 1, 2]
    assert [r.server_round for r in strategy.history] == list(range(1, 11))  # training rounds only
    assert [r.server_round for r in strategy.footprint_history] == [5, 7, 9]  # before sessions 2, 3, 4
    assert [r.received for r in strategy.footprint_history] == [members[0], members[1], members[0]]
    footprint = [c for c in sent if "footprint-round" in c]
    assert [(c["session"], c["footprint-round"]) for c in footprint[:: len(members[0])]] == [(2, 0), (3, 0), (4, 0)]
    training = [c for c in sent if "footprint-round" not in c]
    assert [c["session-start"] for c in training[:: len(members[0])]] == [1, 1, 3, 3, 5, 5, 7, 7, 9, 9]


def test_dynamic_client_uses_the_footprint_lr_and_its_own_minibatches():
    config = _dynamic_config(footprint_lr=0.25)
    x0 = _vector(config, pf.initial_arrays(config))
    footprint = pf.client_train(
        config, 0, 7, _server_content(config, x0, 7, session=3, **{"footprint-round": 0}), RecordDict()
    )
    training = pf.client_train(
        config, 0, 7, _server_content(config, x0, 7, session=3, **{"session-start": 7}), RecordDict()
    )
    sim = Simulation(config)
    algo = make_algorithm("fedavg")
    view = sim.algorithm.footprint_view(sim, 3)
    assert view.lr(0) == pytest.approx(0.25 * 0.1)
    algo.setup(view, torch.from_numpy(x0))
    expected = algo.client_update(0, np.array([0]), view).vectors["model"][0].numpy()
    np.testing.assert_allclose(_vector(config, footprint["arrays"]), expected, atol=1e-6)
    assert np.abs(_vector(config, footprint["arrays"]) - _vector(config, training["arrays"])).max() > 1e-4


@pytest.mark.parametrize(
    "params, match",
    [
        ({"method": "average"}, "must be 'proposed'"),
        ({"host": "scaffold"}, "fedavg or fedprox"),
        ({"host_params": "server_lr=0.5"}, "server_lr = 1"),
    ],
)
def test_dynamic_init_rejects_what_flower_cannot_run(params, match):
    with pytest.raises(ValueError, match=match):
        pf.DynamicInit(_dynamic_config(**params))
    with pytest.raises(ValueError, match="must be 'dynamic'"):
        pf.DynamicInit(_tiny())


# Client updates vs the simulation ----------------------------------------------------------------------


def _tiny(algorithm="fedavg", **kw):
    return ExperimentConfig(algorithm=algorithm, clients=3, rounds=3, local_steps=3, lr=0.1, seed=1, **kw)


def _server_content(config, x: np.ndarray, rnd: int, **cfg) -> RecordDict:
    """The server's message of round ``rnd``: the model vector x [d] of ``config``'s model as named arrays."""
    arrays = pf.vector_arrays({"model": x}, pf.model_layout(config))
    return RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": rnd, **cfg})})


def _vector(config, arrays) -> np.ndarray:
    """The model vector [d] of a message's named arrays."""
    return pf.arrays_vector(arrays, pf.model_layout(config))


def test_client_train_equals_sim_client_update():
    config = _tiny()
    sim = Simulation(config)
    algo = make_algorithm("fedavg")
    algo.setup(sim, sim.initial_vector)
    expected = algo.client_update(1, np.array([2]), sim)
    x0 = sim.initial_vector.numpy()
    reply = pf.client_train(config, 2, 2, _server_content(config, x0, 2), RecordDict())
    np.testing.assert_allclose(_vector(config, reply["arrays"]), expected.vectors["model"][0].numpy(), atol=1e-6)
    assert reply["metrics"]["num-examples"] == sim.client_sizes[2]


@pytest.mark.parametrize(
    ("algorithm", "params", "match"),
    [
        ("fedavg", {"server_lr": 0.5}, "server_lr = 1 and ref_compat = False"),
        ("fedprox", {"mu": 0.1, "ref_compat": True}, "server_lr = 1 and ref_compat = False"),
        ("fedspeed", {"corr_avg": "all"}, "corr_avg = 'active'"),
        ("dynamic", {"host": "fedavg", "host_params": "ref_compat=true"}, "the dynamic host must have server_lr = 1"),
    ],
)
def test_client_train_refuses_a_server_rule_the_strategies_do_not_take(algorithm, params, match):
    config = _tiny(algorithm, algorithm_params=params)
    x0 = _vector(_tiny(), pf.initial_arrays(_tiny()))
    with pytest.raises(ValueError, match=match):
        pf.client_train(config, 0, 1, _server_content(_tiny(), x0, 1), RecordDict())


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: pf.FedAvg(poll_interval=-1), ValueError, "poll_interval must be finite and > 0"),
        (lambda: pf.FedAvg(poll_interval="x"), TypeError, "poll_interval must be a number"),
        (lambda: pf.BHerd(None), TypeError, "config must be a pyfedkern ExperimentConfig, got NoneType"),
        (lambda: pf.DynamicInit({}), TypeError, "config must be a pyfedkern ExperimentConfig, got dict"),
        (lambda: pf.config_from_run_config({"algorithm-params": "{bad"}), ValueError, "algorithm-params must be JSON"),
        (
            lambda: pf.mean_metrics([RecordDict({"m": MetricRecord({"loss": 1.0})})], "num-examples"),
            ValueError,
            r"records\[0\] has no metric 'num-examples'",
        ),
        (
            lambda: pf.mean_metrics([RecordDict({"m": MetricRecord({"num-examples": [1, 2]})})], "num-examples"),
            TypeError,
            r"records\[0\]: 'num-examples' must be a number",
        ),
        (
            lambda: pf.client_train(_tiny(), 0, 0, _server_content(_tiny(), _zeros(), 0), RecordDict()),
            ValueError,
            "server_round must be >= 1",
        ),
    ],
)
def test_flower_helpers_name_what_is_wrong(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _zeros() -> np.ndarray:
    return np.zeros(pf.model_layout(_tiny()).size, np.float32)


def test_client_refuses_a_model_of_another_config():
    """A message whose named arrays lack one of the model's trainable tensors, have one more, have one of another
    shape, or are float64 for a float32 model is refused, naming the array."""
    config = _tiny()
    arrays = dict(pf.initial_arrays(config).items())
    names = list(arrays)
    first, last = names[0], names[-1]
    shape = arrays[first].numpy().shape
    wrong = {
        f"lack \\['{last}'\\]": {k: a for k, a in arrays.items() if k != last},
        "have \\['extra.weight'\\]": {**arrays, "extra.weight": Array(np.zeros(2, np.float32))},
        f"array '{first}' has shape": {**arrays, first: Array(np.zeros((shape[0] + 1, *shape[1:]), np.float32))},
        "is torch.float64": {k: Array(a.numpy().astype(np.float64)) for k, a in arrays.items()},
    }
    for match, named in wrong.items():
        content = RecordDict({"arrays": ArrayRecord(named), "config": ConfigRecord({"server-round": 1})})
        with pytest.raises(ValueError, match=f"the received model .*{match}"):
            pf.client_train(config, 0, 1, content, RecordDict())
        with pytest.raises(ValueError, match=f"the received model .*{match}"):
            pf.client_evaluate(config, 0, content)


def test_client_fedpbc_keeps_its_model_when_not_adopting():
    config = _tiny("fedpbc", batched=False)
    state = RecordDict()
    x0 = _vector(config, pf.initial_arrays(config))
    first = pf.client_train(config, 0, 1, _server_content(config, x0, 1, **{"pbc-adopt": True}), state)
    own = _vector(config, first["arrays"])
    np.testing.assert_array_equal(state["client-state:clients"]["clients"].numpy(), own)
    empty = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"server-round": 2, "pbc-adopt": False})})
    second = pf.client_train(config, 0, 2, empty, state)
    sim = Simulation(config)
    expected = local_sgd(sim, 0, 1, torch.from_numpy(own.copy())).x.numpy()
    np.testing.assert_allclose(_vector(config, second["arrays"]), expected, atol=1e-6)
    with pytest.raises(ValueError, match="carries no model and the node keeps no state"):
        pf.client_train(config, 1, 2, empty, RecordDict())  # a node with nothing kept must be sent the model


def test_client_fedspeed_matches_sim_round():
    config = _tiny("fedspeed", algorithm_params={"rho": 0.05}, fraction=1.0)
    sim_config = ExperimentConfig(**{**config.to_dict(), "rounds": 2})
    sim = Simulation(sim_config)
    sim.run()
    states = [RecordDict() for _ in range(3)]
    x = _vector(config, pf.initial_arrays(config))
    for rnd in (1, 2):
        uploads = [pf.client_train(config, c, rnd, _server_content(config, x, rnd), states[c]) for c in range(3)]
        x = np.mean([_vector(config, u["arrays"]) for u in uploads], axis=0)
    np.testing.assert_allclose(x, sim.algorithm.global_model().numpy(), atol=1e-5)
    assert "client-state:h_store" in states[0].array_records  # h_i lives on the client


def _client_grid(config):
    """A FakeGrid whose nodes 1..clients run pyfedkern's ClientApp logic (node n is client n - 1)."""
    states = {n: RecordDict() for n in range(1, config.clients + 1)}

    def handler(node, msg):
        server_round = int(msg.content["config"]["server-round"])
        return pf.client_train(config, node - 1, server_round, msg.content, states[node])

    return FakeGrid(list(states), handler)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedpbc", "bherd", "fedspeed", "dynamic"])
def test_every_strategy_reports_loss_and_accuracy_every_round(algorithm):
    """Train metrics are the clients' mean local loss (no client id or step count averaged as a metric); the
    server evaluation gives the global model's test/train loss and accuracy, every round, for every strategy."""
    params = {"dynamic": {"sessions": 3}}.get(algorithm, {})
    config = _tiny(algorithm, algorithm_params=params)
    common = {"min_available_nodes": 1, "min_train_nodes": 1, "fraction_evaluate": 0.0, "poll_interval": 0.01}
    strategy = {
        "fedavg": lambda: pf.FedAvg(**common),
        "fedpbc": lambda: pf.FedPBC(**common),
        "bherd": lambda: pf.BHerd(config, **common),
        "fedspeed": lambda: pf.FedSpeed(**common),
        "dynamic": lambda: pf.DynamicInit(config, **common),
    }[algorithm]()
    result = strategy.start(
        grid=_client_grid(config),
        initial_arrays=pf.initial_arrays(config),
        num_rounds=2,
        timeout=30,
        evaluate_fn=pf.server_evaluation(config),
    )
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    for metrics in result.train_metrics_clientapp.values():
        assert set(metrics) == {"local-loss"} and np.isfinite(metrics["local-loss"])
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    for metrics in result.evaluate_metrics_serverapp.values():
        assert set(metrics) == {"test-loss", "test-acc", "train-loss", "train-acc"}
        assert 0.0 <= metrics["test-acc"] <= 1.0
    sim = Simulation(config)
    expected = sim.evaluate(sim.initial_vector)
    assert result.evaluate_metrics_serverapp[0]["test-acc"] == pytest.approx(expected["test_acc"])


def _example_server_app():
    """examples/flower/server_app.py as a module."""
    spec = importlib.util.spec_from_file_location("example_server_app", APP / "server_app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("algorithm", ["fedavg", "bherd"])
def test_the_example_reports_the_local_loss_the_simulator_records(algorithm):
    """The example's local-loss is the plain mean of the clients' mean local losses, as the simulator's local_loss;
    Flower's default (weighted by num-examples) gives 2.2343 instead of 2.2333 in the README's first round."""
    run_config = get_project_config(APP)["tool"]["flwr"]["app"]["config"]
    config = pf.config_from_run_config({**run_config, "algorithm": algorithm, "rounds": 2})
    sim = Simulation(config)
    assert len(set(sim.client_sizes.tolist())) > 1  # unequal partitions: the two means differ
    recorded = {r["round"]: r for r in sim.run()}
    strategy = _example_server_app().make_strategy(config)
    strategy.poll_interval = 0.01
    result = strategy.start(
        grid=_client_grid(config),
        initial_arrays=pf.initial_arrays(config),
        num_rounds=2,
        timeout=30,
        evaluate_fn=pf.server_evaluation(config),
    )
    for rnd in (1, 2):
        assert result.train_metrics_clientapp[rnd]["local-loss"] == pytest.approx(recorded[rnd]["local_loss"], rel=1e-6)
        assert result.evaluate_metrics_serverapp[rnd]["test-acc"] == pytest.approx(recorded[rnd]["test_acc"])
    if algorithm == "fedavg":  # Flower's weighting of the same replies: the example README's 2.2343 vs 2.2333
        grid = _client_grid(config)
        msgs = [
            Message(
                _server_content(config, _vector(config, pf.initial_arrays(config)), 1),
                message_type="train",
                dst_node_id=n,
            )
            for n in grid.nodes
        ]
        replies = [reply.content for reply in pf.ArrivalGrid(grid).send_and_receive(msgs, timeout=30)]
        weighted = pf.mean_metrics(replies, "num-examples")["local-loss"]
        assert round(weighted, 4) == 2.2343 and round(recorded[1]["local_loss"], 4) == 2.2333


def test_mean_metrics_averages_only_finite_measurements():
    replies = [
        RecordDict({"metrics": MetricRecord({"num-examples": 10, "local-loss": 1.0, "acc": 0.5})}),
        RecordDict({"metrics": MetricRecord({"num-examples": 30, "local-loss": 3.0})}),
        RecordDict({"metrics": MetricRecord({"num-examples": 60, "local-loss": float("nan"), "acc": 1.0})}),
    ]
    weighted = pf.mean_metrics(replies, "num-examples")
    assert dict(weighted) == {"local-loss": pytest.approx(2.5), "acc": pytest.approx((5 + 60) / 70)}
    uniform = pf.mean_metrics(replies, "num-examples", uniform=True)
    assert dict(uniform) == {"local-loss": 2.0, "acc": 0.75}


def test_config_from_run_config():
    cfg = pf.config_from_run_config(
        {"algorithm": "fedprox", "algorithm-params": '{"mu": 0.5}', "local-steps": 0, "clients": 4, "out-file": "x"}
    )
    assert cfg.algorithm == "fedprox" and cfg.algorithm_params == {"mu": 0.5} and cfg.local_steps is None
    with pytest.raises(ValueError, match="clients"):
        pf.config_from_run_config({"clients": 0})


def test_importing_pyfedkern_does_not_need_flwr():
    code = (
        "import sys; sys.modules['flwr'] = None\n"
        "import pyfedkern, pyfedkern.integrations, pyfedkern.ops\n"
        "try:\n    import pyfedkern.integrations.flower\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "flwr>=1.20"' in out


def test_ops_used_for_streaming_are_in_place():
    acc = np.zeros(3, np.float32)
    view = pf.array_view(Array(np.arange(3, dtype=np.float32)))
    assert not view.flags.writeable  # a view of the serialized bytes, not a copy
    ops.weighted_sum([acc, view], [0.5, 2.0], out=acc)  # the running mean's update writes acc in place
    np.testing.assert_array_equal(acc, [0, 2, 4])


# Real Flower processes on loopback ---------------------------------------------------------------------


def _run_sim(config, algorithm=None):
    sim = Simulation(config, algorithm)
    sim.run()
    return sim.algorithm.global_model().numpy()


def _close_and_check_processes(dep):
    """Every process of the deployment is found, also the SuperExec the SuperLink detaches into its own session,
    and none is left after close()."""
    alive = dep.processes()
    assert dep.link.pid in alive and all(p.pid in alive for p in dep.supernodes if p.poll() is None)
    detached = f"--parent-pid {dep.link.pid}"  # the SuperLink's SuperExec (start_new_session=True)
    assert any("flower-superexec" in command and detached in command for command in alive.values()), alive
    dep.close()
    assert dep.processes() == {}


def _check_killed_node_history(history):
    """Round 1: all three nodes reply. Then the killed node never replies again: in round 2 it is a failed node
    (sampled while the SuperLink still lists it); later it is failed or, once the SuperLink marked it offline, no
    longer sampled. Returns the survivors' node ids."""
    first = set(history[0]["received"])
    assert len(first) == 3 and not history[0]["failed"]
    lost = first - set(history[1]["received"])
    assert len(lost) == 1 and set(history[1]["failed"]) == lost
    for record in history[1:]:
        assert set(record["received"]) == first - lost and set(record["failed"]) <= lost
    return first - lost


KILLED = 1  # partition id of the node killed after round 1
RUN = {"clients": 3, "rounds": 3, "local-steps": 4, "lr": 0.1, "train-timeout": 40.0}  # slow ClientApp start-up


def _killed_run(dep, run_config):
    def after(round_done, record):
        if round_done == 1:
            dep.kill_node(KILLED)  # between round 1 and round 2

    return dep.run(run_config, on_round=after)


class _Arrived(FedAvgAlgorithm):
    """FedAvg whose round-t participants are the clients whose replies arrived in round t of the real run."""

    def __init__(self, arrived):
        super().__init__()
        self.arrived = arrived

    def participants(self, t, ctx):
        return np.asarray(self.arrived[t], dtype=np.int64)


@pytest.mark.slow
def test_real_superlink_fedavg_with_killed_node_equals_sim(flower_deployment):
    run_config = {"algorithm": "fedavg", "seed": 3, **RUN}
    dep = flower_deployment(3)
    model, history = _killed_run(dep, run_config)
    _check_killed_node_history(history)
    _close_and_check_processes(dep)
    # FedAvg averages the replies that arrived, weighted by the arrived clients' sizes
    survivors = [c for c in range(3) if c != KILLED]
    config = pf.config_from_run_config(run_config)
    expected = _run_sim(config, _Arrived([[0, 1, 2], survivors, survivors]))
    np.testing.assert_allclose(model, expected, rtol=1e-5, atol=1e-6)
    everyone = _run_sim(config)
    assert np.abs(everyone - model).max() > 1e-4  # the killed client's absence changed the model


class _Schedule:
    """A link model whose active clients per round are given (the links the real run had)."""

    def __init__(self, active):
        self.active = active

    def active_indices(self, t):
        return np.asarray(self.active[t], dtype=np.int64)


def _fedpbc_scheduled(active):
    """FedPBC whose links in round t are up exactly for the clients in ``active[t]``."""
    from dataclasses import dataclass

    from pyfedkern.algorithms.fedpbc import FedPBC as FedPBCAlgorithm

    @dataclass
    class Scheduled(FedPBCAlgorithm):
        def setup(self, ctx, x0):
            super().setup(ctx, x0)
            self.link_model = _Schedule(active)

    return Scheduled()


@pytest.mark.slow
def test_real_superlink_fedpbc_with_killed_node_equals_sim(flower_deployment):
    run_config = {"algorithm": "fedpbc", "batched": False, "seed": 4, **RUN}
    dep = flower_deployment(3)
    model, history = _killed_run(dep, run_config)
    _check_killed_node_history(history)
    _close_and_check_processes(dep)

    survivors = [c for c in range(3) if c != KILLED]
    config = pf.config_from_run_config(run_config)
    expected = _run_sim(config, _fedpbc_scheduled([[0, 1, 2], survivors, survivors]))
    np.testing.assert_allclose(model, expected, rtol=1e-5, atol=1e-6)
    # The killed client did not take part: the run differs from one where all three stayed connected.
    everyone = _run_sim(config)
    assert np.abs(everyone - model).max() > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedavg", "fedpbc"])
def test_simulation_runtime_equals_sim(flower_simulation, algorithm):
    """The example app under Flower's simulation runtime (Ray, 10 simulated SuperNodes, 3 rounds) computes the
    model of pyfedkern's own simulator and reports loss and accuracy every round."""
    run_config = {**RUN, "algorithm": algorithm, "batched": False, "clients": 10, "seed": 6}  # per client, as nodes
    sim_run = flower_simulation(10)
    model, history = sim_run.run(run_config)
    assert len(history) == 3 and all(len(r["received"]) == 10 and not r["failed"] for r in history)
    config = pf.config_from_run_config(run_config)
    # Every simulated node answers every round: for FedPBC every link is up.
    sim = Simulation(config, _fedpbc_scheduled([list(range(10))] * 3) if algorithm == "fedpbc" else None)
    rounds = sim.run()
    np.testing.assert_allclose(model, sim.algorithm.global_model().numpy(), rtol=1e-5, atol=1e-6)
    metrics = sim_run.metrics()
    assert sorted(metrics["train"]) == ["1", "2", "3"] and sorted(metrics["evaluate"]) == ["0", "1", "2", "3"]
    for record in rounds:  # the global model's accuracy as the simulator measures it, every round
        evaluated = metrics["evaluate"][str(record["round"])]
        assert evaluated["test-acc"] == pytest.approx(record["test_acc"], abs=1e-6)
        assert evaluated["train-loss"] == pytest.approx(record["train_loss"], rel=1e-5)
        if record["round"]:  # the clients' local loss: the example averages them as the simulator does
            train = metrics["train"][str(record["round"])]
            assert set(train) == {"local-loss"}
            assert train["local-loss"] == pytest.approx(record["local_loss"], rel=1e-5)


def test_benchmark_cases_agree_and_pyfedkern_allocates_less():
    from pyfedkern.benchmarks import flower as bench

    cases = bench.cases(quick=True)
    assert len({c.group for c in cases}) == 1 and len(cases) == 6
    results = {}
    for case in cases:
        out = case.make()()
        if isinstance(out, tuple):  # (ArrayRecord, MetricRecord) of the strategies
            out = [out[0][k].numpy() for k in out[0]]
        results[case.name] = np.concatenate([np.asarray(x).reshape(-1) for x in out])
    ours = results.pop("pyfedkern")
    for name, value in results.items():
        np.testing.assert_allclose(value, ours, rtol=1e-5, atol=1e-6, err_msg=name)
    peaks = {c.name: bench.peak_memory(c) for c in cases if c.name in ("pyfedkern", "flower aggregate")}
    assert peaks["flower aggregate"] > 5 * peaks["pyfedkern"]  # K weighted copies vs one output model
