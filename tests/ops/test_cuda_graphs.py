"""The GPU steady state of every op family: CUDA-graph capture and replay on new input values equal to eager calls,
no host synchronisation (torch's sync debug mode) and no device allocation or host round trip inside a call
(profiler), and a clear error, never a faulting replay, where an op cannot be captured."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyfedkern import ops

pytestmark = pytest.mark.cuda

D = 10_007  # odd: every kernel's vector body and tail run
K = 6


def _vectors(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).cuda()


# Each case: setup(gen) -> dict of CUDA tensors (the graph's static inputs), run(t) -> the tensors to compare (an
# op's output, and any input it writes in place). Host values (weights, indices, scalars) are fixed by the capture.
CASES = {
    "weighted_sum (device weights)": (
        lambda g: {"X": _vectors(g, K, D), "w": torch.rand(K, generator=g).cuda()},
        lambda t: ops.weighted_sum(t["X"], t["w"]),
    ),
    "weighted_sum (host weights, list)": (
        lambda g: {"X": _vectors(g, K, D)},
        lambda t: ops.weighted_sum(list(t["X"].unbind(0)), [0.5, 0.0, 1.0, 2.0, -1.0, 0.25]),
    ),
    "accumulate_": (
        lambda g: {"acc": _vectors(g, D), "u": _vectors(g, D), "w": torch.rand(1, generator=g).cuda()},
        lambda t: (ops.accumulate_(t["acc"], t["u"], 0.5), ops.accumulate_(t["acc"], t["u"], t["w"])),
    ),
    "sam_perturb": (
        lambda g: {"x": _vectors(g, D), "g": _vectors(g, D), "norm": torch.zeros(1).cuda()},
        lambda t: (ops.sam_perturb(t["x"], t["g"], 0.05, norm_out=t["norm"]), t["norm"]),
    ),
    "fedspeed_update_": (
        lambda g: {"x": _vectors(g, D), "g1": _vectors(g, D), "g2": _vectors(g, D), "h": _vectors(g, D)},
        lambda t: ops.fedspeed_update_(t["x"], t["g2"], 0.1, g1=t["g1"], alpha=0.5, anchor=t["h"], prox_coef=0.1),
    ),
    "fedspeed_round_end_": (
        lambda g: {"h": _vectors(g, D), "xl": _vectors(g, D), "xg": _vectors(g, D), "acc": _vectors(g, D)},
        lambda t: (ops.fedspeed_round_end_(t["h"], t["xl"], t["xg"], acc=t["acc"], acc_weight=0.3), t["acc"]),
    ),
    "pbc_agg_bcast_": (
        lambda g: {"store": _vectors(g, 10, D), "server": _vectors(g, D)},
        lambda t: (ops.pbc_agg_bcast_(t["store"], t["server"], np.array([1, 4, 7])), t["store"]),
    ),
    "weighted_delta_": (
        lambda g: {"x": _vectors(g, D), "store": _vectors(g, 10, D)},
        lambda t: ops.weighted_delta_(t["x"], t["store"], [1.0, 2.0, 0.5], 0.1, rows=np.array([0, 3, 9])),
    ),
    "mifa_update_": (
        lambda g: {"x": _vectors(g, D), "mem": _vectors(g, 10, D), "tot": _vectors(g, D), "u": _vectors(g, 3, D)},
        lambda t: (
            ops.mifa_update_(t["x"], t["mem"], t["tot"], t["u"], np.array([2, 5, 8]), 0.7),
            t["mem"],
            t["tot"],
        ),
    ),
    "class_feature_norms": (
        lambda g: {
            "f": _vectors(g, 512, 64),
            "y": torch.randint(0, 10, (512,), generator=g).cuda(),
            "logits": _vectors(g, 512, 10),
        },
        lambda t: tuple(x for x in ops.class_feature_norms(t["f"], t["y"], 10, logits=t["logits"])),
    ),
    "similarity_weights": (
        lambda g: {"q": _vectors(g, D), "bank": _vectors(g, K, D)},
        lambda t: ops.similarity_weights(t["q"], t["bank"], 5.0, segments=[0, 100, 5000, D]),
    ),
    "similarity_combine": (
        lambda g: {"q": _vectors(g, D), "bank": _vectors(g, K, D), "models": _vectors(g, K, 3 * D)},
        lambda t: ops.similarity_combine(t["q"], t["bank"], t["models"], 5.0, segments=[0, 100, 5000, D]),
    ),
}


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


@pytest.mark.parametrize("name", list(CASES))
def test_capture_and_replay_on_new_values_equals_eager(name):
    setup, run = CASES[name]
    static = setup(torch.Generator().manual_seed(0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        run(setup(torch.Generator().manual_seed(0)))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _as_tuple(run(static))
    for seed in (1, 2):  # new values in the same memory, then replay
        fresh = setup(torch.Generator().manual_seed(seed))
        for key, value in fresh.items():
            static[key].copy_(value)
        graph.replay()
        expected = _as_tuple(run(fresh))
        torch.cuda.synchronize()
        assert len(captured) == len(expected)
        for got, want in zip(captured, expected, strict=True):
            assert torch.equal(got, want), f"{name}: replay differs from the eager call (seed {seed})"


@pytest.mark.parametrize("name", list(CASES))
def test_steady_state_does_not_synchronise(name):
    setup, run = CASES[name]
    t = setup(torch.Generator().manual_seed(0))
    run(t)  # first call: module load, lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            run(t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


FORBIDDEN = ("malloc", "free", "synchronize", "memcpydtoh", "memcpyhtod", "memcpy2d", "memcpyasync", "memcpy(")


def _profile(fn) -> tuple[list[str], list[str]]:
    """(host-side events inside fn's span, names of the GPU kernels it launched)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, record_function("op-under-test"):
        fn()
    torch.cuda.synchronize()
    events = prof.events()
    span = next(e for e in events if e.name == "op-under-test").time_range
    inside = [e.name for e in events if span.start <= e.time_range.start and e.time_range.end <= span.end]
    kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return inside, kernels


@pytest.mark.parametrize("name", list(CASES))
def test_steady_state_neither_allocates_nor_round_trips(name):
    setup, run = CASES[name]
    t = setup(torch.Generator().manual_seed(0))
    run(t)
    torch.cuda.synchronize()
    calls, kernels = _profile(lambda: run(t))
    assert kernels, f"the profiler saw no kernel of {name}"
    bad = [n for n in calls if n.lower().startswith("cu") and any(f in n.lower() for f in FORBIDDEN)]
    assert not bad, f"{name} called {bad} in its steady state"


def test_profiler_sees_pyfedkern_runtime_calls():
    """The positive control of the test above: tables over 8 KiB are copied from the host (cudaMemcpyAsync by
    pyfedkern's own CUDA runtime), and the profiler records that call."""
    X = torch.randn(4000, 64, device="cuda")  # 4000 host weights: a 16 KB table
    w = np.random.default_rng(0).random(4000)
    ops.weighted_sum(X, w)
    calls, _ = _profile(lambda: ops.weighted_sum(X, w))
    assert any("memcpy" in n.lower() for n in calls), calls
    expected = (torch.from_numpy(w).cuda()[:, None] * X.double()).sum(0)
    torch.testing.assert_close(ops.weighted_sum(X, w).double(), expected, rtol=1e-4, atol=1e-3)


def test_large_tables_refuse_capture_cleanly():
    X = torch.randn(4000, 64, device="cuda")
    w = np.random.default_rng(0).random(4000)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="CUDA graph"), torch.cuda.graph(graph):
        ops.weighted_sum(X, w)
    # the process's CUDA context is intact, and device weights (no host table) capture fine at that size
    w_dev = torch.from_numpy(w).float().cuda()
    expected = (w_dev[:, None] * X).sum(0)
    torch.testing.assert_close(ops.weighted_sum(X, w), expected, rtol=1e-4, atol=1e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.weighted_sum(X, w_dev)
    graph.replay()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


def test_ops_that_read_host_values_refuse_capture_cleanly():
    grads = torch.randn(3, 16, 50, device="cuda")
    store = torch.randn(10, 50, device="cuda")
    server = torch.empty(50, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="CUDA graph"), torch.cuda.graph(graph):
        ops.herding_select(grads, 0.5)
    active = torch.tensor([1, 2], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="CUDA graph"), torch.cuda.graph(graph):
        ops.pbc_agg_bcast_(store, server, active)
    ops.pbc_agg_bcast_(store, server, active)  # eager: fine (one host round trip for the indices)
    torch.testing.assert_close(server, store[1])


def test_device_labels_out_of_range_poison_the_class_outputs():
    f = torch.randn(8, 4, device="cuda")
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 9], device="cuda")
    res = ops.class_feature_norms(f, y, 4, logits=torch.randn(8, 4, device="cuda"))
    assert torch.isnan(res.class_sum).all() and torch.isnan(res.class_mean).all()
    assert (res.counts == -1).all() and int(res.correct) == -1
    torch.testing.assert_close(res.norms, f.norm(dim=1))
