"""Central DP on Flower: pyfedkern's strategies inside Flower's own DP wrappers (server-side fixed clipping, and
client-side fixed clipping with the ``fixedclipping_mod`` client mod around pyfedkern's ClientApp), run in-process
on Flower's Strategy.start with every node running the ClientApp; and pyfedkern's fused option
``FedAvg(central_dp=...)`` against Flower's wrapper, a plain clip-then-average reference and the simulator."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
pytest.importorskip("dp_accounting")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp.mod import fixedclipping_mod  # noqa: E402
from flwr.serverapp import strategy as flower  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from pyfedkern.integrations import flower as pf  # noqa: E402
from pyfedkern.privacy import CentralDP  # noqa: E402
from pyfedkern.sim.config import ExperimentConfig  # noqa: E402
from pyfedkern.sim.engine import Simulation  # noqa: E402

ROUNDS = 2
COMMON = {"min_available_nodes": 1, "min_train_nodes": 1, "fraction_evaluate": 0.0}


@pytest.fixture(autouse=True)
def task_identity():
    """Flower messages need a run id outside a running app."""
    before = TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._run_id, TaskIdentity._task_id, TaskIdentity._node_id = before


def _config(**kw) -> ExperimentConfig:
    return ExperimentConfig(algorithm="fedavg", clients=3, rounds=ROUNDS, local_steps=3, lr=0.1, seed=1, **kw)


class AppGrid:
    """A Grid whose node n (client n - 1) answers by running ``app`` (a ClientApp, mods included) in-process."""

    def __init__(self, config, app):
        self.nodes = list(range(1, config.clients + 1))
        self.app = app
        self.contexts = {n: Context(1, n, {"partition-id": n - 1}, RecordDict(), {}) for n in self.nodes}
        self.replies: dict[str, Message] = {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            node = msg.metadata.dst_node_id
            reply = self.app(msg, self.contexts[node])
            reply.metadata.__dict__["_src_node_id"] = node
            self.replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def _run(config, strategy, mods=None, rounds=ROUNDS):
    """``strategy.start`` on Flower's runtime, every node running pyfedkern's ClientApp (with ``mods``); returns
    the final model vector and the Result."""
    grid = pf.ArrivalGrid(AppGrid(config, pf.make_client_app(config, mods=mods)), poll_interval=0.01)
    result = strategy.start(grid=grid, initial_arrays=pf.initial_arrays(config), num_rounds=rounds, timeout=30)
    return pf.arrays_vector(result.arrays, pf.model_layout(config)), result


def _clip(update: np.ndarray, clip: float) -> np.ndarray:
    norm = np.linalg.norm(update)
    return update * min(1.0, clip / norm) if norm > 0 else update


def _clipped_average_reference(config, clip: float) -> np.ndarray:
    """One round in float64: x0 + Σ_i w_i·clip(x_i − x0) / Σ_i w_i, x_i the clients' own models from x0 (computed
    by the client's code outside Flower), w_i their num-examples (Flower's FedAvg weighting)."""
    x0 = pf.arrays_vector(pf.initial_arrays(config), pf.model_layout(config)).astype(np.float64)
    content = RecordDict({"arrays": pf.initial_arrays(config), "config": ConfigRecord({"server-round": 1})})
    total, weight = np.zeros_like(x0), 0.0
    for cid in range(config.clients):
        reply = pf.client_train(config, cid, 1, content, RecordDict())
        xi = pf.arrays_vector(reply["arrays"], pf.model_layout(config)).astype(np.float64)
        n = float(reply["metrics"]["num-examples"])
        total += n * _clip(xi - x0, clip)
        weight += n
    return x0 + total / weight


# pyfedkern's strategies inside Flower's DP wrappers ------------------------------------------------------------


def _server_side(inner, noise, clip, count=3):
    return flower.DifferentialPrivacyServerSideFixedClipping(inner, noise, clip, count)


def _client_side(inner, noise, clip, count=3):
    return flower.DifferentialPrivacyClientSideFixedClipping(inner, noise, clip, count)


WRAPPERS = {"server-side": (_server_side, None), "client-side": (_client_side, [fixedclipping_mod])}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("inner", [pf.FedAvg, pf.FedTrimmedAvg])
def test_wrapped_at_sigma_0_and_a_large_clip_equals_the_unwrapped_strategy(wrapper, inner):
    config = _config()
    wrap, mods = WRAPPERS[wrapper]
    plain, plain_result = _run(config, inner(**COMMON))
    wrapped, result = _run(config, wrap(inner(**COMMON), 0.0, 1e6), mods)
    # the wrappers form x + (x_i − x): the replies' models to rounding
    np.testing.assert_allclose(wrapped, plain, rtol=1e-5, atol=1e-6)
    assert sorted(result.train_metrics_clientapp) == list(range(1, ROUNDS + 1))
    for rnd, metrics in result.train_metrics_clientapp.items():
        assert metrics["local-loss"] == pytest.approx(plain_result.train_metrics_clientapp[rnd]["local-loss"])


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapped_fedavg_with_a_small_clip_equals_clip_then_average(wrapper):
    config = _config()
    wrap, mods = WRAPPERS[wrapper]
    clip = 0.05
    got, _ = _run(config, wrap(pf.FedAvg(**COMMON), 0.0, clip), mods, rounds=1)
    expected = _clipped_average_reference(config, clip)
    x0 = pf.arrays_vector(pf.initial_arrays(config), pf.model_layout(config))
    assert np.linalg.norm(got - x0) <= clip * (1 + 1e-5)  # every update was clipped: the mean is within C
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapped_fedavg_adds_noise_of_the_expected_scale(wrapper):
    """Flower's noise N(0, (σC/n)²) on the mean: the difference from the σ = 0 run, whose updates are the same
    (one round), has that standard deviation (650 coordinates: 3 % standard error of the estimate)."""
    config = _config()
    wrap, mods = WRAPPERS[wrapper]
    sigma, clip, n = 2.0, 0.05, config.clients
    quiet, _ = _run(config, wrap(pf.FedAvg(**COMMON), 0.0, clip), mods, rounds=1)
    np.random.seed(5)  # noqa: NPY002 (Flower draws its noise from NumPy's global generator)
    noisy, _ = _run(config, wrap(pf.FedAvg(**COMMON), sigma, clip), mods, rounds=1)
    diff = (noisy - quiet).astype(np.float64)
    assert diff.size > 500
    assert np.std(diff) == pytest.approx(sigma * clip / n, rel=0.12)
    assert abs(np.mean(diff)) < 4 * sigma * clip / n / math.sqrt(diff.size)


# pyfedkern's fused central DP ---------------------------------------------------------------------------------


def _replies(payloads) -> list[Message]:
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


class _Nodes:
    def __init__(self, k):
        self.k = k

    def get_node_ids(self):
        return list(range(1, self.k + 1))


SHAPES = {"w": (30, 20), "b": (20,), "c": (2, 3, 4)}


def _round_inputs(seed, k, dtype, same_weight=False):
    """(global arrays, K replies' payloads): updates of norms 0.1 to 10 around the global model."""
    rng = np.random.default_rng(seed)
    x = {name: rng.standard_normal(shape).astype(dtype) for name, shape in SHAPES.items()}
    payloads = []
    for _ in range(k):
        scale = 10.0 ** rng.uniform(-1, 1) / math.sqrt(sum(math.prod(s) for s in SHAPES.values()))
        arrays = {name: (x[name] + scale * rng.standard_normal(x[name].shape)).astype(dtype) for name in SHAPES}
        payloads.append((arrays, 7 if same_weight else int(rng.integers(1, 50))))
    return x, payloads


def _aggregate(strategy, x, payloads):
    record = ArrayRecord({name: Array(v) for name, v in x.items()})
    list(strategy.configure_train(1, record, ConfigRecord(), _Nodes(len(payloads))))
    return strategy.aggregate_train(1, _replies(payloads))


def _dp(clip, sigma=0.0, k=7, **kw):
    return CentralDP(clip=clip, noise_multiplier=sigma, delta=1e-4, population=100, cohort=k, rounds=10, **kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("clip", [0.3, 1.0, 1e6])
def test_fused_central_dp_equals_flowers_server_side_wrapper_at_sigma_0(clip, dtype):
    """Flower's wrapper around Flower's FedAvg (equal num-examples: its weighted mean is the uniform one) and
    around pyfedkern's uniform FedAvg (any num-examples), and a float64 clip-then-average reference."""
    for same_weight in (True, False):
        x, payloads = _round_inputs(3, 7, dtype, same_weight)
        arrays, metrics = _aggregate(pf.FedAvg(central_dp=_dp(clip), **COMMON), x, payloads)
        theirs_inner = flower.FedAvg(**COMMON) if same_weight else pf.FedAvg(uniform=True, **COMMON)
        ref_arrays, _ = _aggregate(_server_side(theirs_inner, 0.0, clip, 7), x, payloads)
        rtol = 1e-5 if dtype == np.float32 else 1e-12
        names = list(SHAPES)
        flat_x = np.concatenate([x[n].reshape(-1) for n in names]).astype(np.float64)
        updates = [np.concatenate([a[n].reshape(-1) for n in names]).astype(np.float64) - flat_x for a, _ in payloads]
        reference = flat_x + np.mean([_clip(u, clip) for u in updates], axis=0)
        got = np.concatenate([arrays[n].numpy().reshape(-1) for n in names])
        for name in names:
            assert arrays[name].numpy().dtype == dtype and arrays[name].numpy().shape == SHAPES[name]
            np.testing.assert_allclose(arrays[name].numpy(), ref_arrays[name].numpy(), rtol=rtol, atol=rtol)
        np.testing.assert_allclose(got, reference, rtol=rtol, atol=rtol)
        assert metrics["dp-epsilon"] == math.inf and metrics["dp-clip"] == clip
        assert metrics["loss"] == pytest.approx(4.0)  # the uniform mean of the replies' metrics


def test_fused_central_dp_noise_has_the_scale_of_sigma_c_over_n():
    name = "w"
    x = {name: np.zeros((100, 100))}  # one large array: 10,000 coordinates (1 % standard error of the std)
    rng = np.random.default_rng(8)
    payloads = [({name: rng.standard_normal((100, 100))}, 1) for _ in range(5)]
    sigma, clip = 1.5, 0.5
    quiet, _ = _aggregate(pf.FedAvg(central_dp=_dp(clip, k=5), **COMMON), x, payloads)
    noisy, metrics = _aggregate(pf.FedAvg(central_dp=_dp(clip, sigma, k=5), seed=3, **COMMON), x, payloads)
    diff = noisy[name].numpy() - quiet[name].numpy()
    assert np.std(diff) == pytest.approx(sigma * clip / 5, rel=0.04)
    assert abs(np.mean(diff)) < 4 * sigma * clip / 5 / 100
    assert metrics["dp-epsilon"] == pytest.approx(_dp(clip, sigma, k=5).epsilon(1), rel=1e-12)
    again, _ = _aggregate(pf.FedAvg(central_dp=_dp(clip, sigma, k=5), seed=3, **COMMON), x, payloads)
    np.testing.assert_array_equal(again[name].numpy(), noisy[name].numpy())  # the seeded stream: reproducible
    other, _ = _aggregate(pf.FedAvg(central_dp=_dp(clip, sigma, k=5), seed=4, **COMMON), x, payloads)
    assert not np.array_equal(other[name].numpy(), noisy[name].numpy())


def _example_server_app():
    """examples/flower/server_app.py as a module."""
    path = Path(__file__).resolve().parents[2] / "examples" / "flower" / "server_app.py"
    spec = importlib.util.spec_from_file_location("example_server_app", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "params",
    [{"dp_noise_multiplier": 1.0}, {"dp_epsilon": 20.0}, {"dp_noise_multiplier": 0.0, "dp_adaptive_clip": 0.5}],
)
def test_the_example_with_central_dp_equals_the_simulators_run(params):
    """The example's strategy for ``dp = "central"`` (run-config keys as the CLI's --dp-* options) on Flower's
    runtime computes the simulator's central-DP run, noise included (the same seeded stream), and reports its ε
    and (adaptive) clip."""
    run_config = {"clients": 3, "rounds": ROUNDS, "local-steps": 3, "lr": 0.1, "seed": 1, "dp": "central"}
    run_config |= {"dp-clip": 0.05, "dp-delta": 1e-3, **{k.replace("_", "-"): v for k, v in params.items()}}
    config = pf.config_from_run_config({**run_config, "dp-population": "", "dp-noise-cohort": ""})
    assert config.dp == "central" and config.dp_population is None
    strategy = _example_server_app().make_strategy(config)
    assert strategy.central_dp is not None
    strategy.poll_interval = 0.01
    got, result = _run(config, strategy)
    sim = Simulation(config)
    recorded = sim.run()
    np.testing.assert_allclose(got, sim.algorithm.global_model().numpy(), rtol=1e-5, atol=1e-6)
    for record in recorded[1:]:
        metrics = result.train_metrics_clientapp[record["round"]]
        assert metrics["dp-epsilon"] == pytest.approx(record["dp_epsilon"], rel=1e-12)
        assert metrics["dp-clip"] == pytest.approx(record["dp_clip"], rel=1e-12)


def test_central_dp_is_refused_where_it_does_not_apply():
    with pytest.raises(TypeError, match=r"central_dp must be a pyfedkern\.privacy\.CentralDP"):
        pf.FedAvg(central_dp={"clip": 1.0})
    with pytest.raises(ValueError, match="central_dp: FedMedian aggregates its own way"):
        pf.FedMedian(central_dp=_dp(1.0))
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        pf.FedAvg(central_dp=_dp(1.0), seed=-1)
    with pytest.raises(ValueError, match="aggregate_train before configure_train"):
        pf.FedAvg(central_dp=_dp(1.0)).aggregate_train(1, [])
    config = _config(aggregator="median", dp="central", dp_clip=1.0, dp_delta=1e-3, dp_noise_multiplier=1.0)
    with pytest.raises(ValueError, match="central DP cannot be combined with a robust aggregator"):
        pf.central_dp_of(config)
    assert pf.central_dp_of(_config()) is None
