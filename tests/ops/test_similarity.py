"""similarity_weights / similarity_combine against the float64 per-segment reference: metrics, segments and
include masks, zero-norm segments, 16-bit storage, limits of the scale, strided and list inputs, thread
invariance, bad input, and CUDA when present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern.flat import FlatLayout
from pyfedkern.testing import (
    DTYPES,
    LIBS_CPU,
    dtype_of,
    lib_of,
    make,
    pool_wakes,
    supports,
    to_numpy64,
    written_after_sleep,
)

METRICS = ("l2", "layer_l2", "layer_cos")


def bank_near(rng: np.random.Generator, K: int, d: int, spread: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """A query and K rows at varied distances from it (so the weights are neither uniform nor one-hot)."""
    q = rng.standard_normal(d)
    bank = q + spread * rng.standard_normal((K, d)) * rng.uniform(0.2, 2.0, size=(K, 1))
    return q, bank


def l2_scale(q: np.ndarray) -> float:
    """A scale giving l2 distances (which grow like √d) logits of order 1."""
    return 3.0 / np.linalg.norm(q)


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    return to_numpy64(make("torch", values, dtype))


def check_weights(weights, expected, rtol=1e-5):
    got = to_numpy64(weights)
    exp = to_numpy64(expected)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, exp, rtol=rtol, atol=1e-30)
    assert abs(got.sum() - 1.0) < 1e-6


SEGMENTS = np.array([0, 3, 100, 4096 + 7, 4096 + 7, 9000, 15_000, 20_011])
INCLUDE = np.array([True, False, True, True, True, False, True])


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("segmented", [False, True])
def test_weights_match_float64_reference(lib, dtype, metric, segmented):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    rng = np.random.default_rng(hash((dtype, metric, segmented)) % 2**32)
    q, bank = bank_near(rng, 9, 20_011)
    scale = l2_scale(q) if metric == "l2" else 10.0
    seg, inc = (SEGMENTS, INCLUDE) if segmented else (None, None)
    qa, ba = make(lib, q, dtype), make(lib, bank, dtype)
    w, s = ops.similarity_weights(qa, ba, scale, metric, seg, inc, return_scores=True)
    assert lib_of(w) == lib and tuple(w.shape) == (9,)
    assert dtype_of(w) == ("float64" if dtype == "float64" else "float32")
    # The reference reads the same stored (rounded) values, so 16-bit storage is held to the same tolerance.
    w_ref, s_ref = reference.similarity_weights(qa, ba, scale, metric, seg, inc, return_scores=True)
    check_weights(w, w_ref)
    np.testing.assert_allclose(to_numpy64(s), to_numpy64(s_ref), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("metric", METRICS)
def test_scale_zero_is_uniform_and_combine_is_the_mean(metric):
    rng = np.random.default_rng(1)
    q, bank = bank_near(rng, 5, 1000)
    models = rng.standard_normal((5, 333))
    w = ops.similarity_weights(q, bank, 0.0, metric)
    assert np.all(w == 0.2)
    blend = ops.similarity_combine(q, bank, models, 0.0, metric)
    np.testing.assert_allclose(blend, models.mean(0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("scale", [1e4, 1e300])
def test_large_scale_is_one_hot_on_the_nearest(metric, scale):
    rng = np.random.default_rng(2)
    q = rng.standard_normal(5000).astype(np.float32)
    bank = rng.standard_normal((6, 5000)).astype(np.float32)
    bank[4] = q + 0.05 * rng.standard_normal(5000).astype(np.float32)  # the nearest, most similar row
    models = rng.standard_normal((6, 100)).astype(np.float32)
    models[0] = np.nan  # rows whose weight underflows to 0 are never read
    blend, w = ops.similarity_combine(q, bank, models, scale, metric, return_weights=True)
    assert w.tolist() == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert np.array_equal(blend, models[4])


def test_ties_share_the_weight_and_negative_scale_prefers_the_farthest():
    q = np.ones(10)
    bank = np.stack([2 * np.ones(10), np.ones(10), np.ones(10), -np.ones(10)])
    w = ops.similarity_weights(q, bank, 1e6, "l2")
    assert w.tolist() == [0.0, 0.5, 0.5, 0.0]
    assert ops.similarity_weights(q, bank, -1e6, "l2").tolist() == [0.0, 0.0, 0.0, 1.0]


def test_layer_metrics_ignore_per_segment_magnitudes():
    rng = np.random.default_rng(3)
    q, bank = bank_near(rng, 4, 600)
    seg = np.array([0, 100, 350, 600])
    scaled = bank.copy()
    scaled[:, 100:350] *= 1e3  # one layer's gradient much larger: normalised metrics do not care
    scaled[2, 0:100] *= 1e-3
    for metric in ("layer_l2", "layer_cos"):
        a = ops.similarity_weights(q, bank, 10.0, metric, seg)
        b = ops.similarity_weights(q, scaled, 10.0, metric, seg)
        np.testing.assert_allclose(a, b, rtol=1e-9)
    a = ops.similarity_weights(q, bank, l2_scale(q), "l2", seg)
    b = ops.similarity_weights(q, scaled, l2_scale(q), "l2", seg)
    assert not np.allclose(a, b)


def test_layer_l2_distance_range_and_known_values():
    q = np.array([1.0, 0.0, 0.0, 2.0])
    bank = np.array([[1.0, 0.0, 0.0, 5.0], [-3.0, 0.0, 0.0, -1.0], [0.0, 7.0, 0.0, 0.0]])
    seg = np.array([0, 2, 4])
    _, s = ops.similarity_weights(q, bank, 1.0, "layer_l2", seg, return_scores=True)
    # row 0: identical directions in both segments; row 1: opposite in both (distance 2); row 2: orthogonal in
    # the first (√2) and a zero second segment against a unit one (1).
    np.testing.assert_allclose(s, [0.0, 2.0, (np.sqrt(2) + 1) / 2], atol=1e-12)
    _, c = ops.similarity_weights(q, bank, 1.0, "layer_cos", seg, return_scores=True)
    np.testing.assert_allclose(c, [1.0, -1.0, 0.0], atol=1e-12)


@pytest.mark.parametrize("metric", METRICS)
def test_zero_norm_segments_give_no_nan(metric):
    rng = np.random.default_rng(4)
    q, bank = bank_near(rng, 4, 300)
    seg = np.array([0, 100, 200, 300])
    q[100:200] = 0.0  # a layer the footprint round never changed
    bank[1, :100] = 0.0
    bank[2, 100:200] = 0.0  # zero in both query and row
    bank[3] = 0.0  # an all-zero row
    w, s = ops.similarity_weights(q.astype(np.float32), bank.astype(np.float32), 5.0, metric, seg, return_scores=True)
    assert np.all(np.isfinite(w)) and np.all(np.isfinite(s))
    w_ref, s_ref = reference.similarity_weights(
        q.astype(np.float32), bank.astype(np.float32), 5.0, metric, seg, return_scores=True
    )
    check_weights(w, w_ref)
    np.testing.assert_allclose(s, s_ref, atol=1e-6)


def test_excluded_segments_are_not_read():
    rng = np.random.default_rng(5)
    q, bank = bank_near(rng, 3, 500)
    seg = np.array([0, 200, 210, 500])
    include = np.array([True, False, True])
    clean = ops.similarity_weights(q, bank, 10.0, "layer_l2", seg, include)
    q[200:210] = np.nan
    bank[:, 200:210] = np.inf
    dirty = ops.similarity_weights(q, bank, 10.0, "layer_l2", seg, include)
    assert np.array_equal(clean, dirty)


def test_non_finite_included_values_are_an_error():
    q, bank = np.ones(10), np.ones((3, 10))
    bank[1, 4] = np.nan
    with pytest.raises(ValueError, match="bank row 1 holds non-finite"):
        ops.similarity_weights(q, bank, 1.0)


def test_flat_layout_gives_offsets_and_the_bias_free_mask():
    net = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    layout = FlatLayout.of(list(net.named_parameters()))
    rng = np.random.default_rng(6)
    q, bank = bank_near(rng, 4, layout.size)
    qt, bt = torch.from_numpy(q).float(), torch.from_numpy(bank).float()
    by_layout = ops.similarity_weights(qt, bt, 10.0, segments=layout)
    explicit = ops.similarity_weights(qt, bt, 10.0, "layer_l2", layout.segments(), layout.include_mask())
    assert torch.equal(by_layout, explicit)
    assert layout.include_mask().tolist() == [True, False, True, False]
    check_weights(by_layout, reference.similarity_weights(qt, bt, 10.0, segments=layout))


@pytest.mark.parametrize("lib", LIBS_CPU)
def test_strided_and_list_banks_read_in_place(lib):
    rng = np.random.default_rng(7)
    q, bank = bank_near(rng, 6, 3001)
    wide = np.repeat(bank, 2, axis=1)  # rows of 6002, the bank is every other column
    qa = make(lib, q, "float32")
    expected = ops.similarity_weights(qa, make(lib, bank, "float32"), 10.0)
    strided = make(lib, wide, "float32")[:, ::2]
    assert strided.shape == (6, 3001)
    check_weights(ops.similarity_weights(qa, strided, 10.0), expected, rtol=1e-6)
    ring_order = [make(lib, bank[k], "float32") for k in (3, 4, 5, 0, 1, 2)]
    got = to_numpy64(ops.similarity_weights(qa, ring_order, 10.0))
    np.testing.assert_allclose(got, to_numpy64(expected)[[3, 4, 5, 0, 1, 2]], rtol=1e-6)
    q_strided = make(lib, np.stack([q, q], 1), "float32")[:, 0]
    check_weights(ops.similarity_weights(q_strided, make(lib, bank, "float32"), 10.0), expected, rtol=1e-6)


@pytest.mark.parametrize("models_dtype", DTYPES)
def test_combine_matches_reference_with_any_model_storage(models_dtype):
    rng = np.random.default_rng(8)
    q, bank = bank_near(rng, 5, 4100)
    models = rng.standard_normal((5, 2049))
    qt, bt = make("torch", q, "float32"), make("torch", bank, "float32")
    mt = make("torch", models, models_dtype)
    blend, w = ops.similarity_combine(qt, bt, mt, 10.0, segments=np.array([0, 1000, 4100]), return_weights=True)
    assert dtype_of(blend) == models_dtype and tuple(blend.shape) == (2049,)
    w_ref = reference.similarity_weights(qt, bt, 10.0, segments=np.array([0, 1000, 4100]))
    check_weights(w, w_ref)
    expected = to_numpy64(w_ref) @ rounded(models, models_dtype)
    tol = {"float64": 1e-6, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[models_dtype]
    np.testing.assert_allclose(to_numpy64(blend), expected, rtol=tol, atol=tol * np.abs(models).max())
    out = torch.empty(2049, dtype=getattr(torch, models_dtype))
    assert ops.similarity_combine(qt, bt, mt, 10.0, out=out) is out


def test_combine_into_a_strided_output():
    rng = np.random.default_rng(9)
    q, bank = bank_near(rng, 3, 100)
    models = rng.standard_normal((3, 50)).astype(np.float32)
    big = np.zeros(100, np.float32)
    ops.similarity_combine(q.astype(np.float32), bank.astype(np.float32), models, 2.0, out=big[::2])
    expected = reference.similarity_combine(q.astype(np.float32), bank.astype(np.float32), models, 2.0)
    np.testing.assert_allclose(big[::2], expected, rtol=1e-5, atol=1e-6)
    assert np.all(big[1::2] == 0)


def test_float16_accumulates_in_float32():
    # 70,000 entries of 1.0: a float16 sum would stop at 2048; the weights must see the exact norms.
    q = torch.ones(70_000, dtype=torch.float16)
    bank = torch.stack([torch.ones(70_000), 2 * torch.ones(70_000)]).half()
    _, s = ops.similarity_weights(q, bank, 1.0, "l2", return_scores=True)
    np.testing.assert_allclose(s.numpy(), [0.0, np.sqrt(70_000)], rtol=1e-6)


def test_results_do_not_depend_on_thread_count():
    rng = np.random.default_rng(10)
    q, bank = bank_near(rng, 7, 200_003)
    q, bank = q.astype(np.float32), bank.astype(np.float32)
    models = rng.standard_normal((7, 50_001)).astype(np.float32)
    seg = np.array([0, 5, 70_000, 70_000, 200_003])
    before = pyfedkern.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            pyfedkern.set_num_threads(n)
            with pool_wakes(n > 1):
                results.append(ops.similarity_combine(q, bank, models, 10.0, "layer_l2", seg, return_weights=True))
    finally:
        pyfedkern.set_num_threads(before)
    for blend, w in results[1:]:
        assert np.array_equal(w, results[0][1]) and np.array_equal(blend, results[0][0])


@settings(max_examples=40, deadline=None)
@given(
    K=st.integers(1, 9),
    d=st.integers(1, 400),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    metric=st.sampled_from(METRICS),
    dtype=st.sampled_from(("float32", "float64", "bfloat16")),
    seed=st.integers(0, 2**32 - 1),
)
def test_weights_property(K, d, cuts, metric, dtype, seed):
    rng = np.random.default_rng(seed)
    q, bank = bank_near(rng, K, d, spread=rng.uniform(0.1, 2.0))
    seg = np.array(sorted({0, d, *(c for c in cuts if c <= d)}))
    include = rng.random(len(seg) - 1) < 0.7
    include[rng.integers(len(include))] = True
    scale = l2_scale(q) if metric == "l2" else 5.0
    qa, ba = make("torch", q, dtype), make("torch", bank, dtype)
    w = ops.similarity_weights(qa, ba, scale, metric, seg, include)
    check_weights(w, reference.similarity_weights(qa, ba, scale, metric, seg, include))


# bad input -----------------------------------------------------------------------------------------------

Q = np.ones(8, np.float32)
B = np.ones((3, 8), np.float32)


@pytest.mark.parametrize(
    ("query", "bank", "scale", "kwargs", "exc", "match"),
    [
        (Q, np.ones((0, 8), np.float32), 1.0, {}, ValueError, r"bank is empty.*K >= 1"),
        (Q, [], 1.0, {}, ValueError, r"K >= 1"),
        (Q, np.ones((3, 9), np.float32), 1.0, {}, ValueError, r"length 9, expected 8 \(the length of query\)"),
        (Q, [Q, np.ones(7, np.float32)], 1.0, {}, ValueError, r"bank\[1\] has length 7, expected 8"),
        (Q, B, float("nan"), {}, ValueError, "scale must be finite"),
        (Q, B, float("inf"), {}, ValueError, "scale must be finite"),
        (Q, B, "10", {}, TypeError, "scale must be a real number"),
        (Q, B, 1.0, {"segments": [0, 4, 9]}, ValueError, r"within \[0, 8\]"),
        (Q, B, 1.0, {"segments": [-1, 4, 8]}, ValueError, r"within \[0, 8\]"),
        (Q, B, 1.0, {"segments": [0, 5, 4, 8]}, ValueError, r"non-decreasing.*segments\[2\] = 4"),
        (Q, B, 1.0, {"segments": [0]}, ValueError, r"offsets \[L \+ 1\] with L >= 1"),
        (Q, B, 1.0, {"segments": [0.0, 8.0]}, TypeError, "integers"),
        (Q, B, 1.0, {"segments": [0, 4, 8], "include": [True]}, ValueError, "length 2"),
        (Q, B, 1.0, {"segments": [0, 4, 8], "include": [1, 1]}, TypeError, "boolean"),
        (Q, B, 1.0, {"segments": [0, 4, 8], "include": [False, False]}, ValueError, "no segment"),
        (Q, B, 1.0, {"metric": "cosine"}, ValueError, "metric must be one of l2, layer_l2, layer_cos"),
        (Q, B, 1.0, {"eps": -1.0}, ValueError, "eps must be >= 0"),
        (Q, B.astype(np.float64), 1.0, {}, TypeError, "bank has dtype float64, expected float32"),
        (Q, torch.ones(3, 8), 1.0, {}, ValueError, "mixing"),
        (np.ones((2, 8), np.float32), B, 1.0, {}, ValueError, "query must be a 1-D vector"),
        (np.ones(0, np.float32), np.ones((3, 0), np.float32), 1.0, {}, ValueError, r"query is empty"),
        (Q.astype(np.int32), B, 1.0, {}, TypeError, "query has dtype int32"),
        (Q, np.ones((2, 3, 8), np.float32), 1.0, {}, ValueError, "2-D"),
        ([1.0] * 8, B, 1.0, {}, TypeError, "query must be a numpy array"),
    ],
)
def test_bad_input(query, bank, scale, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ops.similarity_weights(query, bank, scale, **kwargs)


def test_combine_bad_input():
    models = np.ones((3, 5), np.float32)
    with pytest.raises(ValueError, match=r"models has 2 rows, expected 3"):
        ops.similarity_combine(Q, B, models[:2], 1.0)
    with pytest.raises(ValueError, match="mixing"):
        ops.similarity_combine(Q, B, torch.ones(3, 5), 1.0)
    with pytest.raises(ValueError, match="models are empty"):
        ops.similarity_combine(Q, B, np.ones((3, 0), np.float32), 1.0)
    with pytest.raises(ValueError, match=r"out must have shape \(5,\)"):
        ops.similarity_combine(Q, B, models, 1.0, out=np.ones(4, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        ops.similarity_combine(Q, B, models, 1.0, out=np.ones(5))
    with pytest.raises(ValueError, match=r"out overlaps models\[1\]"):
        ops.similarity_combine(Q, B, models, 1.0, out=models[1])
    with pytest.raises(ValueError, match="scale must be finite"):
        ops.similarity_combine(Q, B, models, float("-inf"))


# CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("metric", METRICS)
def test_cuda_weights_match_reference(dtype, metric):
    rng = np.random.default_rng(11)
    q, bank = bank_near(rng, 9, 20_011)
    scale = l2_scale(q) if metric == "l2" else 10.0
    qc, bc = make("torch", q, dtype, "cuda"), make("torch", bank, dtype, "cuda")
    for seg, inc in ((None, None), (SEGMENTS, INCLUDE)):
        w, s = ops.similarity_weights(qc, bc, scale, metric, seg, inc, return_scores=True)
        assert w.device.type == "cuda"
        w_ref, s_ref = reference.similarity_weights(qc.cpu(), bc.cpu(), scale, metric, seg, inc, return_scores=True)
        check_weights(w.cpu(), w_ref)
        np.testing.assert_allclose(to_numpy64(s), to_numpy64(s_ref), rtol=1e-6, atol=1e-7)
        cpu = ops.similarity_weights(qc.cpu(), bc.cpu(), scale, metric, seg, inc)
        np.testing.assert_allclose(to_numpy64(w), to_numpy64(cpu), rtol=1e-6)


@pytest.mark.cuda
def test_cuda_combine_zero_norm_strided_and_streams():
    rng = np.random.default_rng(12)
    q, bank = bank_near(rng, 6, 10_000)
    q[:2000] = 0.0
    bank[3] = 0.0
    models = rng.standard_normal((6, 7777))
    qc = torch.from_numpy(q).float().cuda()
    wide = torch.from_numpy(np.repeat(bank, 2, axis=1)).float().cuda()[:, 1::2]
    mc = torch.from_numpy(models).cuda().to(torch.bfloat16)
    seg = np.array([0, 2000, 5000, 10_000])
    stream = torch.cuda.Stream()
    # Query and models written late on `stream`: right answers prove the ops ran on `stream`.
    late_q, late_m = written_after_sleep(stream, qc), written_after_sleep(stream, mc)
    with torch.cuda.stream(stream):
        blend, w = ops.similarity_combine(late_q, wide, late_m, 10.0, "layer_l2", seg, return_weights=True)
    stream.synchronize()
    w_ref = reference.similarity_weights(qc.cpu(), torch.from_numpy(bank).float(), 10.0, "layer_l2", seg)
    check_weights(w.cpu(), w_ref)
    expected = to_numpy64(w_ref) @ to_numpy64(mc.cpu())
    np.testing.assert_allclose(to_numpy64(blend), expected, rtol=1.6e-2, atol=2e-2)
    one_hot = ops.similarity_weights(qc, wide, 1e300, "layer_l2", seg)
    assert torch.isfinite(one_hot).all() and one_hot.sum().item() == 1.0


@pytest.mark.cuda
def test_cuda_bad_input_and_threads_free():
    with pytest.raises(ValueError, match="mixing"):
        ops.similarity_weights(torch.ones(4, device="cuda"), torch.ones(2, 4), 1.0)


def test_benchmark_peers_agree_with_pyfedkern():
    from pyfedkern.benchmarks import similarity as bench

    cases = [c for c in bench.cases(quick=True) if c.group.startswith("similarity_combine K=16 d=1e5")]
    results = {}
    for c in cases:
        if c.is_limit:
            continue
        r = c.make()()
        results[c.name] = torch.cat([t.reshape(-1) for t in r]) if isinstance(r, list) else r
    ours = results.pop("pyfedkern").double().numpy()
    assert len(results) == 2
    for name, value in results.items():
        np.testing.assert_allclose(value.double().numpy(), ours, rtol=1e-4, atol=1e-5, err_msg=name)
    _, include, names = bench.layout(11_200_000)
    assert len(names) == 62 and include.sum() == 41 and sum(n for _, n in bench.resnet18_tensors()) == 11_181_642
