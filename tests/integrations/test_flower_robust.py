"""pyfedkern's robust Flower strategies against Flower's own (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan) on
random replies: the same arrays (float32/float64 bit for bit where the same arithmetic is done, else to rounding),
the same chosen replies, the same metrics; and Flower's legacy ``aggregate_*`` functions as a second opinion."""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.server.strategy import aggregate as legacy  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from pyfedkern.integrations import flower as pf  # noqa: E402

SHAPES = {"w": (3, 5), "b": (5,), "c": (2, 2, 2)}


@pytest.fixture(autouse=True)
def task_identity():
    """Flower messages need a run id outside a running app."""
    before = TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = before


def _payloads(seed: int, k: int, dtype) -> list[tuple[dict[str, np.ndarray], int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        arrays = {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES.items()}
        out.append((arrays, int(rng.integers(1, 100))))
    for arrays, _ in out[:2]:  # two outliers far from the rest
        for value in arrays.values():
            value *= 50
    return out


def _replies(payloads) -> list[Message]:
    """Fresh messages (Flower's strategies pop the arrays out of the replies they read)."""
    replies = []
    for node, (arrays, n) in enumerate(payloads, start=1):
        content = RecordDict(
            {
                "arrays": ArrayRecord({k: Array(np.array(v)) for k, v in arrays.items()}),
                "metrics": MetricRecord({"num-examples": n, "loss": float(node)}),
            }
        )
        reply = Message(content, dst_node_id=node, message_type="train")
        reply.metadata.__dict__["_src_node_id"] = node
        reply.metadata.__dict__["_reply_to_message_id"] = f"m{node}"
        replies.append(reply)
    return replies


def _both(ours, theirs, payloads):
    arrays, metrics = ours.aggregate_train(1, _replies(payloads))
    ref_arrays, ref_metrics = theirs.aggregate_train(1, _replies(payloads))
    assert sorted(arrays) == sorted(ref_arrays)
    return arrays, metrics, ref_arrays, ref_metrics


CASES = [
    ("median", lambda: pf.FedMedian(), lambda: flower.FedMedian(), True),
    ("trimmed", lambda: pf.FedTrimmedAvg(beta=0.2), lambda: flower.FedTrimmedAvg(beta=0.2), False),
    ("trimmed-0", lambda: pf.FedTrimmedAvg(beta=0.0), lambda: flower.FedTrimmedAvg(beta=0.0), False),
    (
        "krum",
        lambda: pf.Krum(num_malicious_nodes=2),
        lambda: flower.Krum(num_malicious_nodes=2),
        True,
    ),
    (
        "multikrum",
        lambda: pf.MultiKrum(num_malicious_nodes=2, num_nodes_to_select=4),
        lambda: flower.MultiKrum(num_malicious_nodes=2, num_nodes_to_select=4),
        True,
    ),
    ("bulyan", lambda: pf.Bulyan(num_malicious_nodes=1), lambda: flower.Bulyan(num_malicious_nodes=1), True),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [7, 8, 11])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("case", "ours", "theirs", "exact"), CASES, ids=[c[0] for c in CASES])
def test_each_strategy_equals_flower_s(case, ours, theirs, exact, dtype, k, seed):
    arrays, metrics, ref_arrays, ref_metrics = _both(ours(), theirs(), _payloads(seed, k, dtype))
    for name in SHAPES:
        got, want = arrays[name].numpy(), ref_arrays[name].numpy()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            rtol = 1e-6 if dtype == np.float32 else 1e-13
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol, err_msg=name)
    assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=1e-12)  # the same replies' metrics


@pytest.mark.parametrize("k", [7, 10])
def test_krum_and_bulyan_leave_the_outliers_out(k):
    payloads = _payloads(5, k, np.float32)
    strategy = pf.MultiKrum(num_malicious_nodes=2, num_nodes_to_select=k - 2)
    _, metrics = strategy.aggregate_train(1, _replies(payloads))
    losses = [float(node) for node in range(3, k + 1)]  # the chosen: every reply but the two outliers (nodes 1, 2)
    weights = [payloads[node - 1][1] for node in range(3, k + 1)]
    assert metrics["loss"] == pytest.approx(np.average(losses, weights=weights), rel=1e-12)
    bulyan, _ = pf.Bulyan(num_malicious_nodes=1).aggregate_train(1, _replies(payloads))
    assert np.abs(bulyan["w"].numpy()).max() < 5  # the outliers are 50× the others


def test_legacy_functions_agree():
    """Flower's legacy ``aggregate_*`` functions on the same models (one flat array per client)."""
    rng = np.random.default_rng(9)
    payloads = [({"model": rng.standard_normal(40).astype(np.float32)}, int(rng.integers(1, 50))) for _ in range(9)]
    results = [([a["model"]], n) for a, n in payloads]
    cases = [
        (pf.FedMedian(), legacy.aggregate_median(results)[0], True),
        (pf.FedTrimmedAvg(beta=0.25), legacy.aggregate_trimmed_avg(results, 0.25)[0], False),
        (pf.Krum(num_malicious_nodes=2), legacy.aggregate_krum(results, 2, 0)[0], True),
        (pf.MultiKrum(num_malicious_nodes=2, num_nodes_to_select=3), legacy.aggregate_krum(results, 2, 3)[0], False),
    ]
    for strategy, want, exact in cases:
        got = strategy.aggregate_train(1, _replies(payloads))[0]["model"].numpy()
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bulyan_skips_a_round_with_too_few_replies():
    with pytest.warns(UserWarning, match=r"needs at least 7 replies \(4·num_malicious_nodes \+ 3\), got 6"):
        assert pf.Bulyan(num_malicious_nodes=1).aggregate_train(1, _replies(_payloads(0, 6, np.float32))) == (
            None,
            None,
        )


def test_a_reply_holding_nan_is_left_out_as_a_failed_node():
    payloads = _payloads(1, 8, np.float64)
    payloads[4][0]["b"][2] = np.nan
    strategy = pf.FedMedian()
    with pytest.warns(UserWarning, match="node 5 holds NaN or inf"):
        arrays, _ = strategy.aggregate_train(1, _replies(payloads))
    rest = [p for i, p in enumerate(payloads) if i != 4]
    np.testing.assert_array_equal(arrays["b"].numpy(), np.median(np.stack([a["b"] for a, _ in rest]), axis=0))
    assert strategy.history[-1].failed == [5]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: pf.FedTrimmedAvg(beta=0.5), r"beta must be in the range \[0, 0.5\)"),
        (lambda: pf.FedTrimmedAvg(beta=-0.1), r"beta must be in the range \[0, 0.5\)"),
        (lambda: pf.Krum(num_malicious_nodes=-1), "num_malicious_nodes must be an integer >= 0"),
        (lambda: pf.MultiKrum(num_nodes_to_select=0), "num_nodes_to_select must be an integer >= 1"),
        (lambda: pf.Bulyan(num_malicious_nodes=1.5), "num_malicious_nodes must be an integer >= 0"),
    ],
)
def test_bad_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    ("spec", "cls", "settings"),
    [
        ("mean", pf.FedAvg, {}),
        ("median", pf.FedMedian, {}),
        ("trimmed:0.1", pf.FedTrimmedAvg, {"beta": 0.1}),
        ("krum:2", pf.Krum, {"num_malicious_nodes": 2, "num_nodes_to_select": 1}),
        ("multikrum:1,4", pf.MultiKrum, {"num_malicious_nodes": 1, "num_nodes_to_select": 4}),
        ("bulyan:3", pf.Bulyan, {"num_malicious_nodes": 3}),
    ],
)
def test_the_run_config_s_aggregator_chooses_the_strategy(spec, cls, settings):
    config = pf.config_from_run_config({"aggregator": spec, "rounds": 2})
    strategy = pf.robust_strategy(config.aggregator, min_train_nodes=1)
    assert type(strategy) is cls and strategy.min_train_nodes == 1
    assert all(getattr(strategy, key) == value for key, value in settings.items())


def test_the_run_config_refuses_what_flower_cannot_run():
    with pytest.raises(ValueError, match="aggregator 'geomed' has no Flower strategy"):
        pf.robust_strategy("geomed")
    with pytest.raises(ValueError, match=r"attack 'signflip:0\.2' is a simulator setting"):
        pf.config_from_run_config({"attack": "signflip:0.2"})
    with pytest.raises(ValueError, match="unknown aggregator 'avg'"):
        pf.config_from_run_config({"aggregator": "avg"})
