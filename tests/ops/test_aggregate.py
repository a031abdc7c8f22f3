"""weighted_sum and accumulate_ against the float64 reference: random, edge-case and adversarial inputs,
strided views, thread-count invariance, concurrency, bad input, and CUDA when present."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern.testing import (
    DTYPES,
    LIBS_CPU,
    REL_TOL,
    dtype_of,
    lib_of,
    make,
    pool_wakes,
    supports,
    to_numpy64,
    written_after_sleep,
)


def expected_and_scale(rows: list[np.ndarray], weights) -> tuple[np.ndarray, np.ndarray]:
    """Float64 result and Σ|w_k u_k| (the magnitude rounding errors scale with)."""
    exp = sum(w * r for w, r in zip(weights, rows, strict=True))
    scale = sum(abs(w) * np.abs(r) for w, r in zip(weights, rows, strict=True))
    return exp, scale


def assert_close_to(result, rows64, weights, dtype):
    exp, scale = expected_and_scale(rows64, weights)
    err = np.abs(to_numpy64(result) - exp)
    tol = REL_TOL[dtype] * (scale + np.finfo(np.float64).tiny) + (6e-8 if dtype == "float16" else 0.0)
    assert np.all(err <= tol), f"max err {err.max()} vs tol {tol[np.argmax(err - tol)]}"


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """values rounded to dtype storage, back in float64 (what the kernel actually reads)."""
    return to_numpy64(make("torch", values, dtype))


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("K", "d"), [(1, 1), (3, 5), (4, 4097), (17, 10_003), (100, 257)])
def test_weighted_sum_matches_reference(lib, dtype, K, d):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    rng = np.random.default_rng(K * 1000 + d)
    x = rng.standard_normal((K, d)) * rng.choice([1e-3, 1.0, 1e3], size=(K, 1))
    w = rng.standard_normal(K)
    stack = make(lib, x, dtype)
    out = ops.weighted_sum(stack, w)
    assert lib_of(out) == lib and dtype_of(out) == dtype and tuple(out.shape) == (d,)
    assert_close_to(out, list(rounded(x, dtype)), w, dtype)
    ref = reference.weighted_sum(stack, w)
    assert lib_of(ref) == lib and dtype_of(ref) == dtype and tuple(ref.shape) == (d,)
    assert_close_to(ref, list(rounded(x, dtype)), w, dtype)


@pytest.mark.parametrize("lib", LIBS_CPU)
def test_list_input_equals_stack_input(lib):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 1001))
    w = rng.random(6)
    stack = make(lib, x, "float32")
    listed = [make(lib, row, "float32") for row in x]
    assert np.array_equal(to_numpy64(ops.weighted_sum(stack, w)), to_numpy64(ops.weighted_sum(listed, w)))


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("view", ["column_slice", "transposed", "row_step", "negative_stride"])
def test_strided_views_are_read_in_place(lib, view):
    rng = np.random.default_rng(2)
    base = rng.standard_normal((8, 3001))
    if view == "column_slice":
        x = base[:, ::3]
    elif view == "transposed":
        x = np.ascontiguousarray(base.T).T  # column-major [8, 3001]
    elif view == "row_step":
        x = base[::2]
    else:
        if lib == "torch":
            pytest.skip("torch has no negative strides")
        x = base[::-1, ::-2]
    w = rng.standard_normal(x.shape[0])
    arr = x.astype(np.float32) if lib == "numpy" else _torch_view(base, view)
    out = ops.weighted_sum(arr, w)
    assert_close_to(out, list(rounded(np.asarray(x), "float32")), w, "float32")


def _torch_view(base: np.ndarray, view: str) -> torch.Tensor:
    t = torch.from_numpy(base.astype(np.float32))
    if view == "column_slice":
        return t[:, ::3]
    if view == "transposed":
        return t.T.contiguous().T
    return t[::2]


def test_strided_output():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 777)).astype(np.float32)
    w = rng.random(5)
    big = np.zeros(777 * 2, np.float32)
    ops.weighted_sum(x, w, out=big[::2])
    assert_close_to(big[::2], list(x.astype(np.float64)), w, "float32")
    assert np.all(big[1::2] == 0), "wrote outside the strided output"


@pytest.mark.parametrize("impl", [ops, reference], ids=["op", "reference"])
@pytest.mark.parametrize("lib", LIBS_CPU)
def test_zero_weight_rows_are_not_read(impl, lib):
    x = np.ones((4, 1000))
    x[1] = np.nan
    x[3] = np.inf
    out = impl.weighted_sum(make(lib, x, "float32"), [0.5, 0.0, 2.0, 0.0])
    assert np.all(to_numpy64(out) == 2.5)
    listed = [make(lib, row, "float32") for row in x]
    assert np.all(to_numpy64(impl.weighted_sum(listed, [0.0, 0.0, 1.0, 0.0])) == 1.0)


@pytest.mark.parametrize("impl", [ops, reference], ids=["op", "reference"])
def test_all_zero_weights_give_zeros(impl):
    x = np.full((3, 10), np.nan, np.float32)
    out = impl.weighted_sum(x, [0.0, 0.0, 0.0])
    assert out.dtype == np.float32 and np.all(out == 0)


def test_negative_weights_and_cancellation():
    x = np.array([[1e8, 1.0, -3.0], [1e8, 2.0, 5.0]], np.float64)
    out = ops.weighted_sum(x, [1.0, -1.0])
    assert out.tolist() == [0.0, -1.0, -8.0]


def test_out_is_filled_and_returned():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.full(4, 7.0, np.float32)
    result = ops.weighted_sum(x, [1, 1, 1], out=out)
    assert result is out and out.tolist() == [12.0, 15.0, 18.0, 21.0]


def test_float16_accumulates_in_float32():
    # 2048 rows of 1.0 in float16: a float16 accumulator would stop at 2048 + rounding; float32 is exact.
    x = torch.ones(4096, 3, dtype=torch.float16)
    out = ops.weighted_sum(x, np.ones(4096))
    assert out.tolist() == [4096.0] * 3
    tiny = torch.full((1000, 2), 1e-4, dtype=torch.float16)
    assert abs(ops.weighted_sum(tiny, np.ones(1000)).float()[0].item() - 0.1) < 1e-4


@pytest.mark.parametrize("case", ["float32", "float16", "strided"])
def test_results_do_not_depend_on_thread_count(case):
    rng = np.random.default_rng(4)
    values = rng.standard_normal((13, 600_002))
    w = rng.standard_normal(13)
    if case == "float32":
        x = values[:, ::2].astype(np.float32)
    elif case == "float16":
        x = make("torch", values[:, ::2], "float16")
    else:
        x = values.astype(np.float32)[:, 1::2]
        assert not x.flags.c_contiguous
    before = pyfedkern.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 8):
            pyfedkern.set_num_threads(n)
            assert pyfedkern.get_num_threads() == n
            with pool_wakes(n > 1):
                results.append(to_numpy64(ops.weighted_sum(x, w)))
    finally:
        pyfedkern.set_num_threads(before)
    assert_close_to(results[0], list(to_numpy64(x)), w, "float16" if case == "float16" else "float32")
    for r in results[1:]:
        assert np.array_equal(r, results[0])


def test_concurrent_calls_from_python_threads():
    rng = np.random.default_rng(5)
    jobs = [(rng.standard_normal((5, 250_000)).astype(np.float32), rng.standard_normal(5)) for _ in range(16)]
    serial = [ops.weighted_sum(x, w) for x, w in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        parallel = list(pool.map(lambda job: ops.weighted_sum(*job), jobs))
    for a, b in zip(serial, parallel, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.hugemem
def test_sixty_four_bit_indexing():
    # 2^31 + 5 elements: a zero-stride input row keeps the input tiny; the float16 output is 4 GiB.
    d = 2**31 + 5
    row = np.lib.stride_tricks.as_strided(np.array([1.5], np.float16), shape=(d,), strides=(0,))
    out = ops.weighted_sum([row], [2.0])
    assert out[0] == 3.0 and out[2**31 - 1] == 3.0 and out[2**31] == 3.0 and out[-1] == 3.0
    assert np.count_nonzero(out[2**31 - 4096 :] != 3.0) == 0


@pytest.mark.hugemem
def test_sixty_four_bit_indexing_contiguous():
    # A real 4 GiB float16 row of 2^31 + 5 elements (the contiguous path), with marked values across the 2^31 boundary.
    d = 2**31 + 5
    row = np.full(d, 1.5, np.float16)
    row[2**31 - 2 : 2**31 + 2] = [0.25, 0.5, 0.75, 1.0]
    row[-1] = -2.0
    out = ops.weighted_sum([row], [2.0])
    assert out[0] == 3.0 and out[-2] == 3.0 and out[-1] == -4.0
    assert out[2**31 - 2 : 2**31 + 2].tolist() == [0.5, 1.0, 1.5, 2.0]
    ops.accumulate_(out, row, -1.0)
    assert out[0] == 1.5 and out[-1] == -2.0
    assert out[2**31 - 2 : 2**31 + 2].tolist() == [0.25, 0.5, 0.75, 1.0]


def test_torch_parameters_get_their_gradients_through_weighted_sum():
    p = torch.nn.Parameter(torch.ones(5))
    q = torch.nn.Parameter(torch.full((5,), 2.0))
    out = ops.weighted_sum([p, q], [0.25, 0.5])
    assert out.requires_grad and out.tolist() == [1.25] * 5
    out.sum().backward()
    assert p.grad.tolist() == [0.25] * 5 and q.grad.tolist() == [0.5] * 5
    with torch.no_grad():
        assert not ops.weighted_sum([p, q], [0.25, 0.5]).requires_grad


@settings(max_examples=60, deadline=None)
@given(
    K=st.integers(1, 12),
    d=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**32 - 1),
    zero_mask=st.integers(0, 2**12 - 1),
)
def test_weighted_sum_property(K, d, dtype, seed, zero_mask):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((K, d)) * 10.0 ** rng.integers(-3, 4, size=(K, 1))
    w = rng.standard_normal(K) * np.array([(zero_mask >> k) & 1 for k in range(K)])
    out = ops.weighted_sum(make("torch", x, dtype), w)
    assert_close_to(out, list(rounded(x, dtype)), w, dtype)


# accumulate_ ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_matches_reference(lib, dtype):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    rng = np.random.default_rng(6)
    a, u = rng.standard_normal(5003), rng.standard_normal(5003)
    acc = make(lib, a, dtype)
    acc_ref = make(lib, a, dtype)
    result = ops.accumulate_(acc, make(lib, u, dtype), -0.75)
    reference.accumulate_(acc_ref, make(lib, u, dtype), -0.75)
    assert result is acc
    assert_close_to(acc, [rounded(a, dtype), rounded(u, dtype)], [1.0, -0.75], dtype)
    assert_close_to(acc_ref, [rounded(a, dtype), rounded(u, dtype)], [1.0, -0.75], dtype)


def test_accumulate_streaming_equals_weighted_sum():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 4099)).astype(np.float32)
    w = rng.random(9)
    acc = np.zeros(4099, np.float32)
    for k in range(9):
        ops.accumulate_(acc, x[k], w[k])
    assert np.array_equal(acc, ops.weighted_sum(x, w))


def test_accumulate_into_itself_and_scalar_kinds():
    acc = torch.ones(10)
    ops.accumulate_(acc, acc, torch.tensor(2.0))
    assert acc.tolist() == [3.0] * 10
    ops.accumulate_(acc, torch.ones(10), np.float32(0.5))
    assert acc.tolist() == [3.5] * 10


# bad input -----------------------------------------------------------------------------------------------

X = np.ones((3, 4), np.float32)


@pytest.mark.parametrize(
    ("updates", "weights", "out", "exc", "match"),
    [
        (np.ones((2, 3, 4), np.float32), [1, 1], None, ValueError, "2-D"),
        (np.ones(4, np.float32), [1], None, ValueError, "2-D"),
        (X, [1, 1], None, ValueError, "weights has length 2, expected 3"),
        (X, [[1, 1, 1]], None, ValueError, "weights must be 1-D"),
        (X, [1, np.nan, 1], None, ValueError, r"weights\[1\] = nan"),
        (X, [1, 1, np.inf], None, ValueError, "finite"),
        (X, ["a", 1, 1], None, TypeError, "real numbers"),
        (
            [np.ones(4, np.float32), np.ones(4, np.float64)],
            [1, 1],
            None,
            TypeError,
            r"updates\[1\] has dtype",
        ),
        ([np.ones(4, np.float32), torch.ones(4)], [1, 1], None, ValueError, "mixing"),
        ([np.ones(4, np.float32), np.ones(5, np.float32)], [1, 1], None, ValueError, "length 5, expected 4"),
        ([np.ones((2, 2), np.float32)], [1], None, ValueError, "1-D vector"),
        ([], [], None, ValueError, "empty"),
        (np.ones((0, 4), np.float32), [], None, ValueError, "empty"),
        (np.ones((2, 0), np.float32), [1, 1], None, ValueError, "d = 0"),
        (np.ones((2, 4), np.int64), [1, 1], None, TypeError, "dtype int64"),
        ([[1.0, 2.0], [3.0, 4.0]], [1, 1], None, TypeError, "numpy array, torch tensor or cupy array"),
        ("abc", [1], None, TypeError, "2-D array or a list"),
        (X, [1, 1, 1], np.ones(5, np.float32), ValueError, r"out must have shape \(4,\)"),
        (X, [1, 1, 1], np.ones(4, np.float64), TypeError, "out has dtype float64"),
        (X, [1, 1, 1], torch.ones(4), ValueError, "mixing"),
        (X, [1, 1, 1], X[0, ::-1], ValueError, "partially overlaps"),
        (X, [1, 1, 1], X.reshape(-1)[1:5], ValueError, "partially overlaps"),
        (X, [1, 1, 1], np.broadcast_to(np.float32(0), (4,)), ValueError, "read-only"),
        (X, [1, 1, 1], [0.0] * 4, TypeError, "out must be a numpy array"),
    ],
)
def test_weighted_sum_bad_input(updates, weights, out, exc, match):
    with pytest.raises(exc, match=match):
        ops.weighted_sum(updates, weights, out=out)


def test_out_may_be_one_of_the_updates_exactly():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ops.weighted_sum(x, [0.5, 1.0, 1.0], out=x[0])
    assert x[0].tolist() == [12.0, 14.5, 17.0, 19.5]
    t = torch.arange(8, dtype=torch.float32)
    ops.weighted_sum([t, torch.ones(8)], [2.0, 1.0], out=t)
    assert t.tolist() == [1.0, 3.0, 5.0, 7.0, 9.0, 11.0, 13.0, 15.0]


def test_out_aliasing_a_zero_weight_row_is_allowed():
    x = np.ones((3, 4), np.float32)
    ops.weighted_sum(x[:2], [1.0, 0.0], out=x[1])
    assert x[1].tolist() == [1.0] * 4


@pytest.mark.parametrize(
    ("acc", "update", "weight", "exc", "match"),
    [
        (np.ones((2, 2), np.float32), np.ones(4, np.float32), 1.0, ValueError, "acc must be a 1-D"),
        (np.ones(4, np.float32), np.ones(5, np.float32), 1.0, ValueError, "length 5, expected 4"),
        (np.ones(4, np.float32), np.ones(4, np.float64), 1.0, TypeError, "update has dtype"),
        (np.ones(4, np.float32), torch.ones(4), 1.0, ValueError, "mixing"),
        (np.ones(4, np.float32), np.ones(4, np.float32), float("nan"), ValueError, "finite"),
        (np.ones(4, np.float32), np.ones(4, np.float32), "2", TypeError, "real number"),
        (np.ones(4, np.float32), np.ones(4, np.float32), True, TypeError, "real number"),
        (np.ones(4, np.float32), np.ones(4, np.float32), np.ones(2), ValueError, "single number"),
        (np.ones(0, np.float32), np.ones(0, np.float32), 1.0, ValueError, "empty"),
        (np.ones(4, np.int32), np.ones(4, np.int32), 1.0, TypeError, "dtype int32"),
        (np.broadcast_to(np.float32(1), (4,)), np.ones(4, np.float32), 1.0, ValueError, "read-only"),
    ],
)
def test_accumulate_bad_input(acc, update, weight, exc, match):
    with pytest.raises(exc, match=match):
        ops.accumulate_(acc, update, weight)


def test_accumulate_partial_overlap_is_rejected():
    buf = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="partially overlaps"):
        ops.accumulate_(buf[1:], buf[:-1], 1.0)


def test_set_num_threads_validates():
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        pyfedkern.set_num_threads(0)


# CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("K", "d"), [(1, 1), (3, 7), (17, 100_003)])
def test_cuda_weighted_sum_matches_reference(dtype, K, d):
    rng = np.random.default_rng(K + d)
    x = rng.standard_normal((K, d))
    w = rng.standard_normal(K)
    out = ops.weighted_sum(make("torch", x, dtype, "cuda"), w)
    assert out.device.type == "cuda" and dtype_of(out) == dtype
    assert_close_to(out, list(rounded(x, dtype)), w, dtype)


@pytest.mark.cuda
def test_cuda_strided_unaligned_and_streams():
    rng = np.random.default_rng(8)
    base = torch.from_numpy(rng.standard_normal((6, 10_001))).float().cuda()
    w = rng.random(6)
    for view in (base[:, 1:], base[:, ::2], base.T.contiguous().T):
        expected = (torch.from_numpy(w).float().cuda()[:, None] * view).sum(0)
        assert torch.allclose(ops.weighted_sum(view, w), expected, rtol=1e-5, atol=1e-5)
    stream = torch.cuda.Stream()
    late = written_after_sleep(stream, base)  # correct results prove the ops ran on `stream`
    with torch.cuda.stream(stream):
        out = ops.weighted_sum(late, w)
        acc = torch.zeros_like(out)
        ops.accumulate_(acc, out, 2.0)
    stream.synchronize()
    assert torch.allclose(acc, 2 * (torch.from_numpy(w).float().cuda()[:, None] * base).sum(0), rtol=1e-5, atol=1e-4)


@pytest.mark.cuda
def test_cuda_and_cpu_mixing_is_rejected():
    with pytest.raises(ValueError, match="mixing"):
        ops.weighted_sum([torch.ones(4, device="cuda"), torch.ones(4)], [1, 1])
    with pytest.raises(ValueError, match="mixing"):
        ops.weighted_sum(torch.ones(2, 4, device="cuda"), [1, 1], out=torch.empty(4))


@pytest.mark.cuda
def test_cupy_arrays_when_installed():
    cupy = pytest.importorskip("cupy")
    x = cupy.random.standard_normal((5, 1001), dtype=cupy.float32)
    out = ops.weighted_sum(x, [1, 2, 3, 4, 5])
    assert isinstance(out, cupy.ndarray)
    assert cupy.allclose(out, (cupy.arange(1, 6, dtype=cupy.float32)[:, None] * x).sum(0), rtol=1e-5, atol=1e-5)
