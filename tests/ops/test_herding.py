"""herding_order / herding_select / grab_select against the literal Algorithm 2 / 4 references: random and
adversarial data (large common mean with tiny deviations, duplicate rows, τ = 1, k = τ), batched forms, strides,
thread invariance, bad input, and CUDA when present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern.ops import herding
from pyfedkern.ops.herding import selection_size, tie_rel_tol
from pyfedkern.testing import (
    LIBS_CPU,
    dtype_of,
    lib_of,
    make,
    pool_wakes,
    supports,
    to_numpy64,
    written_after_sleep,
)


def as_np(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.cpu().numpy()


def random_grads(rng, tau, d, mean_scale=1.0, dev_scale=1.0):
    return rng.standard_normal(d) * mean_scale + rng.standard_normal((tau, d)) * dev_scale


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize(("tau", "d"), [(1, 1), (2, 3), (7, 17), (33, 101), (64, 1000), (130, 300)])
def test_order_matches_reference_float64(lib, tau, d):
    rng = np.random.default_rng(tau * 7919 + d)
    y = make(lib, random_grads(rng, tau, d), "float64")
    for k in sorted({1, max(1, tau // 2), tau}):
        got = ops.herding_order(y, k)
        assert lib_of(got) == lib and tuple(got.shape) == (k,)
        assert np.array_equal(as_np(got), as_np(reference.herding_order(y, k)))


@settings(max_examples=40, deadline=None)
@given(
    tau=st.integers(1, 24),
    d=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    mean_scale=st.sampled_from([0.0, 1.0, 1e3]),
)
def test_order_matches_reference_hypothesis(tau, d, seed, mean_scale):
    rng = np.random.default_rng(seed)
    y = random_grads(rng, tau, d, mean_scale)
    k = int(rng.integers(1, tau + 1))
    assert_same_or_tied(y, ops.herding_order(y, k), reference.herding_order(y, k))


def assert_same_or_tied(y: np.ndarray, got: np.ndarray, expected: np.ndarray) -> None:
    """Equal orders, or equal up to the first step where both picks tie exactly in exact arithmetic (e.g. τ = 2,
    where z_1 = −z_0): then the reference's choice is decided by its own rounding, not by the algorithm."""
    z = y - y.mean(0)
    s = np.zeros(y.shape[1])
    for a, b in zip(got.tolist(), expected.tolist(), strict=True):
        if a != b:
            na, nb = np.linalg.norm(s + z[a]), np.linalg.norm(s + z[b])
            assert abs(na - nb) <= 1e-12 * (np.linalg.norm(s) + np.linalg.norm(z, axis=1).max()), (got, expected)
            return
        s = s + z[a]


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_cancellation_large_common_mean(lib, dtype):
    """‖μ‖ ≫ ‖z‖: the uncentred identity G_raw − r1ᵀ − 1rᵀ + m would cancel to noise; explicit centring does not."""
    rng = np.random.default_rng(5)
    tau, d = 40, 500
    base = rng.standard_normal(d) * 1e4 if dtype == "float64" else rng.integers(-512, 512, d).astype(float)
    y64 = base + rng.standard_normal((tau, d)) * (1e-3 if dtype == "float64" else 2**-6)
    y = make(lib, y64, dtype)
    exact = reference.herding_order(to_numpy64(y), tau)
    assert np.array_equal(as_np(ops.herding_order(y, tau)), exact)
    # the identity in float32, for contrast, does not even reproduce the first pick reliably
    raw = to_numpy64(y)
    naive = (raw.astype(np.float32) @ raw.astype(np.float32).T).astype(np.float64)
    r = naive.mean(axis=1)
    gram_naive = naive - r[:, None] - r[None, :] + naive.mean()
    assert np.abs(gram_naive - to_numpy64(ops.centred_gram(y))).max() > 1e-3 * np.abs(np.diag(gram_naive)).max()


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("d", [3, 257, 5000])
def test_duplicate_rows_tie_to_lowest_index(lib, dtype, d):
    rng = np.random.default_rng(d)
    rows = rng.standard_normal((6, d))
    y64 = np.concatenate([rows, rows[::-1], rows])  # each row three times
    y = make(lib, y64, dtype)
    got = as_np(ops.herding_order(y, len(y64)))
    assert np.array_equal(got, reference.herding_order(to_numpy64(y), len(y64)))
    # among copies of a row, the lower index is always picked first
    first_seen = {}
    for pos, idx in enumerate(got):
        key = to_numpy64(y)[idx].tobytes()
        first_seen.setdefault(key, []).append((pos, idx))
    for picks in first_seen.values():
        assert [i for _, i in picks] == sorted(i for _, i in picks)


def test_identical_rows_give_identity_order():
    y = np.ones((9, 13))
    assert np.array_equal(ops.herding_order(y, 9), np.arange(9))


def test_tau_one_and_k_equals_tau():
    y = np.random.default_rng(0).standard_normal((1, 50))
    assert np.array_equal(ops.herding_order(y, 1), [0])
    idx, total = ops.herding_select(y, 0.3)
    assert np.array_equal(idx, [0]) and np.array_equal(total, y[0])


@pytest.mark.parametrize("lib", LIBS_CPU)
def test_first_pick_is_row_nearest_mean(lib):
    rng = np.random.default_rng(3)
    y64 = random_grads(rng, 50, 200, 5.0)
    expected = int(np.argmin(np.linalg.norm(y64 - y64.mean(0), axis=1)))
    assert int(ops.herding_order(make(lib, y64, "float32"), 1)[0]) == expected


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mean_scale", [0.0, 10.0, 1e3])
def test_full_order_is_permutation_and_centred_sum_returns_to_zero(dtype, mean_scale):
    rng = np.random.default_rng(4)
    tau, d = 37, 300
    y = random_grads(rng, tau, d, mean_scale).astype(dtype)
    order = ops.herding_order(y, tau)
    assert sorted(order.tolist()) == list(range(tau))
    _, total, gap = ops.herding_select(y, 1.0, return_gap=True)
    # The Gram form gets ‖s‖² as the running sum of the τ picks' scores 2c_j + G_jj, where each G entry is a
    # length-d dot product rounded at √d ulps of the GEMM dtype: with k = τ, ‖s‖² must come back to 0 within
    # that rounding, 8·τ·√d·ε·max‖z‖² (gap = ‖s‖/k).
    z = y.astype(np.float64) - y.astype(np.float64).mean(0)
    eps = np.finfo(dtype).eps
    assert (tau * gap[0]) ** 2 <= 8 * tau * np.sqrt(d) * eps * (z**2).sum(1).max()
    assert np.allclose(total, y.astype(np.float64).sum(0), rtol=8 * tau * eps, atol=8 * tau * eps * np.abs(y).max())
    _, _, ref_gap = reference.herding_select(y, 1.0, return_gap=True)
    assert ref_gap[0] < 1e-12 * np.linalg.norm(z, axis=1).max()


def greedy_margins(y: np.ndarray, k: int) -> np.ndarray:
    """Per step but the last of Algorithm 2 (float64): how far the runner-up's score is above the pick's, in units
    of the kernel's float32 tie tolerance for both rows (below 1, float32 rounding may swap them)."""
    z = y - y.mean(0)
    gram = z @ z.T
    diag = np.diag(gram)
    rel = tie_rel_tol("float32", y.shape[1])
    c, taken, picked, out = np.zeros(len(y)), np.zeros(len(y), dtype=bool), 0.0, []
    for _ in range(k - 1):
        score = np.where(taken, np.inf, 2 * c + diag)
        j, runner_up = np.argsort(score, kind="stable")[:2]
        tol = sum(rel * (diag[m] + 2 * np.sqrt(diag[m] * picked)) for m in (j, runner_up))
        out.append((score[runner_up] - score[j]) / tol)
        taken[j], picked, c = True, picked + diag[j], c + gram[j]
    return np.array(out)


@pytest.mark.parametrize("lib", LIBS_CPU)
def test_float32_matches_float64_reference_at_large_d(lib):
    """float32 gradients at d ≈ 1e5 with a common mean 30× the deviations (the shift must hold the cancellation) give
    exactly the float64 reference's permutation, on data with no near-ties: rows of distinct scales."""
    rng = np.random.default_rng(0)
    tau, d, k = 32, 100_003, 16
    scales = rng.permutation(1 + 0.1 * np.arange(tau))
    y64 = (rng.standard_normal(d) * 30 + rng.standard_normal((tau, d)) * scales[:, None]).astype(np.float32)
    y64 = y64.astype(np.float64)  # the float32 values, exactly, for the float64 reference
    assert greedy_margins(y64, k).min() > 4  # the precondition: every pick wins by over 4 tie tolerances
    expected = reference.herding_order(y64, k)
    assert not np.array_equal(expected, np.argsort(scales)[:k])  # not merely the rows sorted by scale
    y = make(lib, y64, "float32")
    assert np.array_equal(as_np(ops.herding_order(y, k)), expected)
    idx, total = ops.herding_select(y, 0.5)
    assert np.array_equal(as_np(idx), expected)
    assert np.allclose(to_numpy64(total), y64[np.sort(expected)].sum(0), rtol=1e-5, atol=1e-5 * 30 * k)


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("call_chunks", [1, 5, 1000])
def test_gram_chunking_over_many_calls_with_a_partial_chunk(lib, call_chunks, monkeypatch):
    """Chunks of ~256 columns, 1, 5 or all of them per GEMM call, and a narrower last chunk, for one client, a stack
    and a list: the same centred Gram (float64; float32 with a large common mean) and the reference's order."""
    tau, d = 9, 3001  # 12 chunks of 251 columns, the last 240
    monkeypatch.setitem(herding.GRAM_CHUNK_ELEMENTS, "cpu", 1)
    monkeypatch.setattr(herding, "GRAM_CALL_ELEMENTS_CPU", call_chunks * 3 * tau * 251)
    assert herding._chunk_plan(3, tau, d, gpu=False) == (251, min(call_chunks, 12))
    rng = np.random.default_rng(call_chunks)
    stack64 = 1e3 * rng.standard_normal(d) + rng.standard_normal((3, tau, d))
    exact = np.stack([(m - m.mean(0)) @ (m - m.mean(0)).T for m in stack64])
    scale = np.abs(exact).max()
    for dtype, tol in (("float64", 1e-12), ("float32", 1e-4)):
        stack = make(lib, stack64, dtype)
        got = {
            "single": to_numpy64(ops.centred_gram(stack[1]))[None],
            "stack": to_numpy64(ops.centred_gram(stack)),
            "list": to_numpy64(ops.centred_gram([stack[n] for n in range(3)])),
        }
        for kind, gram in got.items():
            want = exact[1:2] if kind == "single" else exact
            assert np.abs(gram - want).max() <= tol * scale, (dtype, kind)
    stack = make(lib, stack64, "float64")
    assert np.array_equal(as_np(ops.herding_order(stack, 6)), as_np(reference.herding_order(stack, 6)))


def test_permuting_rows_permutes_the_order():
    rng = np.random.default_rng(6)
    y = random_grads(rng, 30, 80)
    perm = rng.permutation(30)
    base = ops.herding_order(y, 20)
    permuted = ops.herding_order(y[perm], 20)
    assert np.array_equal(perm[permuted], base)


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("alpha", [0.1, 0.5, 1.0])
def test_select_matches_reference(lib, dtype, alpha):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    rng = np.random.default_rng(11)
    tau, d = 23, 4099
    y = make(lib, random_grads(rng, tau, d, 0.5), dtype)
    idx, total, gap = ops.herding_select(y, alpha, return_gap=True)
    ridx, rtotal, rgap = reference.herding_select(y, alpha, return_gap=True)
    k = selection_size(tau, alpha)
    assert tuple(idx.shape) == (k,) and lib_of(total) == lib and dtype_of(total) == dtype
    assert np.array_equal(as_np(idx), as_np(ridx))
    exact = to_numpy64(y)[np.sort(as_np(idx))].sum(0)
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}[dtype]
    assert np.allclose(to_numpy64(total), exact, rtol=tol, atol=tol * k)
    assert np.allclose(to_numpy64(rtotal), exact, rtol=tol, atol=tol * k)
    scale = float(np.linalg.norm(to_numpy64(y) - to_numpy64(y).mean(0), axis=1).max())
    eps = np.finfo(np.float64 if dtype == "float64" else np.float32).eps
    # ‖s‖² is a running sum of scores in the Gram form: its rounding is ε·τ·‖z‖², so ‖s‖ carries √(ε·τ)·‖z‖
    assert np.allclose(gap, rgap, rtol=1e-3 if dtype != "float64" else 1e-9, atol=np.sqrt(64 * eps) * scale)


def test_selection_size_rounding():
    assert selection_size(10, 0.25) == 3  # floor(2.5 + 0.5)
    assert selection_size(10, 0.01) == 1
    assert selection_size(7, 1.0) == 7
    assert selection_size(120, 0.5) == 60


@pytest.mark.parametrize("lib", LIBS_CPU)
def test_batched_stack_and_list(lib):
    rng = np.random.default_rng(12)
    stack64 = random_grads(rng, 16, 300)[None] + rng.standard_normal((4, 16, 300))
    stack = make(lib, stack64, "float64")
    order = ops.herding_order(stack, 8)
    assert tuple(order.shape) == (4, 8)
    assert np.array_equal(as_np(order), as_np(reference.herding_order(stack, 8)))
    idx, sums = ops.herding_select(stack, 0.5)
    for n in range(4):
        single_idx, single_sum = ops.herding_select(stack[n], 0.5)
        assert np.array_equal(as_np(idx[n]), as_np(single_idx))
        assert np.array_equal(to_numpy64(sums[n]), to_numpy64(single_sum))
    mats = [make(lib, rng.standard_normal((tau, 300)), "float32") for tau in (5, 17, 1, 9)]
    orders = ops.herding_order(mats, [5, 3, 1, 9])
    assert [tuple(o.shape) for o in orders] == [(5,), (3,), (1,), (9,)]
    idx, sums = ops.herding_select(mats, 0.5)
    assert tuple(sums.shape) == (4, 300)
    for n, m in enumerate(mats):
        single_idx, single_sum = ops.herding_select(m, 0.5)
        assert np.array_equal(as_np(idx[n]), as_np(single_idx))
        assert np.array_equal(to_numpy64(sums[n]), to_numpy64(single_sum))
        assert np.array_equal(as_np(orders[n]), as_np(ops.herding_order(m, [5, 3, 1, 9][n])))


@pytest.mark.parametrize("view", ["column_slice", "transposed", "row_step"])
def test_strided_views(view):
    rng = np.random.default_rng(13)
    base = random_grads(rng, 20, 3001)
    y = {"column_slice": base[:, ::3], "transposed": np.asfortranarray(base), "row_step": base[::2]}[view]
    idx, total = ops.herding_select(y, 0.4)
    cidx, ctotal = ops.herding_select(np.ascontiguousarray(y), 0.4)
    assert np.array_equal(idx, cidx) and np.allclose(total, ctotal, rtol=1e-14, atol=1e-12)
    ts = torch.tensor(base)[:, ::3]
    assert np.array_equal(ops.herding_select(ts, 0.4)[0].numpy(), ops.herding_select(base[:, ::3], 0.4)[0])


def test_thread_count_invariance():
    rng = np.random.default_rng(14)
    stack = rng.standard_normal((5, 30, 9000)).astype(np.float32)  # the row sums run on the pool
    many = rng.standard_normal((40, 160, 50)).astype(np.float32)  # the greedy loops of 40 clients run on the pool
    wide = rng.standard_normal((4, 400_000)).astype(np.float32)  # each GraB row runs on the pool
    before = pyfedkern.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            pyfedkern.set_num_threads(n)
            with pool_wakes(n > 1):
                idx, sums = ops.herding_select(stack, 0.5)
            with pool_wakes(n > 1):
                order = ops.herding_order(many, 80)
            with pool_wakes(n > 1):
                g_idx, g_sum = ops.grab_select(wide)
            results.append((idx.copy(), sums.copy(), np.asarray(order).copy(), g_idx.copy(), g_sum.copy()))
        for a, b in zip(*results, strict=True):
            assert np.array_equal(a, b)
    finally:
        pyfedkern.set_num_threads(before)


# GraB ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("running_mean", [False, True])
@pytest.mark.parametrize(("tau", "d"), [(1, 5), (2, 3), (20, 4097), (60, 100)])
def test_grab_matches_reference(lib, running_mean, tau, d):
    rng = np.random.default_rng(tau + d)
    y = make(lib, random_grads(rng, tau, d, 0.3), "float64")
    idx, total = ops.grab_select(y, running_mean=running_mean)
    ridx, rtotal = reference.grab_select(y, running_mean=running_mean)
    assert np.array_equal(as_np(idx), as_np(ridx))
    assert np.allclose(to_numpy64(total), to_numpy64(rtotal), rtol=1e-12, atol=1e-12)
    assert 0 not in as_np(idx).tolist()  # s = 0 at the first step: never selected


def test_grab_float32_and_streaming_equal_one_shot():
    rng = np.random.default_rng(21)
    y = torch.tensor(random_grads(rng, 25, 700, 0.2), dtype=torch.float32)
    idx, total = ops.grab_select(y)
    ridx, _ = reference.grab_select(y)
    assert np.array_equal(idx.numpy(), ridx.numpy())
    balancer = ops.GrabBalancer(25)
    for row in y:
        balancer.step(row)
    assert np.array_equal(balancer.selected().numpy(), idx.numpy())
    assert torch.equal(balancer.g, total)
    assert balancer.count == len(idx) and balancer.alpha == len(idx) / 25


def test_grab_running_mean_differs_from_literal():
    rng = np.random.default_rng(22)
    y = random_grads(rng, 40, 50, 3.0)
    a, _ = ops.grab_select(y)
    b, _ = ops.grab_select(y, running_mean=True)
    assert not np.array_equal(a, b)


def test_grab_bad_input():
    b = ops.GrabBalancer(2)
    b.step(np.ones(4))
    with pytest.raises(ValueError, match="d = 3"):
        b.step(np.ones(3))
    b.step(np.ones(4))
    with pytest.raises(ValueError, match="more than tau"):
        b.step(np.ones(4))
    with pytest.raises(ValueError, match="tau must be"):
        ops.GrabBalancer(0)
    bad = np.ones((3, 4))
    bad[1, 2] = np.nan
    balancer = ops.GrabBalancer(3)
    balancer.step(bad)
    with pytest.raises(ValueError, match="finite"):
        balancer.selected()


# Bad input -------------------------------------------------------------------------------------------------------


def test_bad_input():
    y = np.random.default_rng(0).standard_normal((5, 8))
    for alpha in (0.0, -0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha"):
            ops.herding_select(y, alpha)
    with pytest.raises(TypeError, match="alpha"):
        ops.herding_select(y, "0.5")
    for k in (0, 6, -1):
        with pytest.raises(ValueError, match=r"k must be in \[1, τ\]"):
            ops.herding_order(y, k)
    with pytest.raises(TypeError, match="k must be an integer"):
        ops.herding_order(y, 2.5)
    with pytest.raises(ValueError, match="d = 7 columns, expected 8"):
        ops.herding_select([y, np.ones((3, 7))], 0.5)
    with pytest.raises(ValueError, match="2-D"):
        ops.herding_select([y, np.ones(8)], 0.5)
    with pytest.raises(ValueError, match="one per client"):
        ops.herding_order([y, y], [1, 2, 3])
    with pytest.raises(ValueError, match="shape"):
        ops.herding_order(np.ones(5), 1)
    with pytest.raises(ValueError, match="τ = 0"):
        ops.herding_order(np.ones((0, 5)), 1)
    with pytest.raises(ValueError, match="empty list"):
        ops.herding_order([], 1)
    with pytest.raises(TypeError, match="dtype int64"):
        ops.herding_order(np.ones((3, 4), dtype=np.int64), 1)
    with pytest.raises(TypeError, match="dtype"):
        ops.herding_select([y, y.astype(np.float32)], 0.5)
    for bad_value in (np.nan, np.inf, -np.inf):
        bad = y.copy()
        bad[2, 3] = bad_value
        with pytest.raises(ValueError, match="non-finite"):
            ops.herding_select(bad, 0.5)
    with pytest.raises(ValueError, match=r"client 1"):
        ops.herding_select([y, 1e300 * np.sign(y[:3] + 1e-9)], 0.5)  # squared norms overflow


# CUDA ------------------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_cuda_matches_cpu(dtype):
    rng = np.random.default_rng(31)
    stack64 = random_grads(rng, 40, 5000)[None] + rng.standard_normal((3, 40, 5000))
    cpu = make("torch", stack64, dtype)
    gpu = cpu.cuda()
    idx, sums, gap = ops.herding_select(gpu, 0.5, return_gap=True)
    cidx, csums, cgap = ops.herding_select(cpu, 0.5, return_gap=True)
    assert idx.is_cuda and sums.is_cuda and sums.dtype == gpu.dtype
    assert torch.equal(idx.cpu(), cidx)
    tol = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2e-2}[dtype]
    assert torch.allclose(sums.cpu().double(), csums.double(), rtol=tol, atol=tol * 20)
    assert np.allclose(gap, cgap, rtol=1e-4)
    if dtype == "float64":
        assert torch.equal(ops.herding_order(gpu[0], 40).cpu(), reference.herding_order(cpu[0], 40))


@pytest.mark.cuda
def test_cuda_ties_list_and_large_tau():
    rng = np.random.default_rng(32)
    rows = rng.standard_normal((5, 300))
    dup = torch.tensor(np.concatenate([rows, rows, rows]), device="cuda")
    assert torch.equal(ops.herding_order(dup, 15).cpu(), reference.herding_order(dup.cpu(), 15))
    mats = [torch.randn(t, 64, device="cuda", dtype=torch.float64) for t in (3, 4500, 7)]  # 4500: c in global memory
    orders = ops.herding_order(mats, [3, 100, 7])
    for m, o, k in zip(mats, orders, [3, 100, 7], strict=True):
        assert torch.equal(o.cpu(), ops.herding_order(m.cpu(), k))


@pytest.mark.cuda
@pytest.mark.parametrize("tau", [1, 2, 31, 32, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1500])
def test_cuda_greedy_every_launch_form_matches_cpu(tau):
    """τ ≤ 512: one warp per client with 1, 2, 4, 8 or 16 rows per lane; above: one block per client, c in shared
    memory (up to 4096). Exact duplicate rows (ties), a second client of a smaller τ, the full order on the first."""
    rng = np.random.default_rng(tau)
    rows = rng.standard_normal((tau // 3, 40))
    first = torch.tensor(np.concatenate([rows, rows, rows, rng.standard_normal((tau - 3 * (tau // 3), 40))]))
    assert first.shape == (tau, 40)
    mats = [first, torch.tensor(rng.standard_normal((max(1, tau // 2), 40)))]
    ks = [tau, max(1, tau // 4)]
    orders = ops.herding_order([m.cuda() for m in mats], ks)
    for m, o, k in zip(mats, orders, ks, strict=True):
        assert torch.equal(o.cpu(), ops.herding_order(m, k))
    idx, sums = ops.herding_select(first.cuda(), 0.5)
    cidx, csums = ops.herding_select(first, 0.5)
    assert torch.equal(idx.cpu(), cidx)
    torch.testing.assert_close(sums.cpu(), csums, rtol=1e-12, atol=1e-12)
    bad = first.clone().cuda()
    bad[tau // 2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ops.herding_select(bad, 0.5)


@pytest.mark.cuda
def test_cuda_runs_on_the_current_stream():
    rng = np.random.default_rng(34)
    cpu = torch.tensor(random_grads(rng, 50, 3000))
    stream = torch.cuda.Stream()
    late = written_after_sleep(stream, cpu.cuda())  # written late on `stream`: right answers prove the op ran there
    with torch.cuda.stream(stream):
        idx, sums = ops.herding_select(late, 0.5)
    stream.synchronize()
    cidx, csums = ops.herding_select(cpu, 0.5)
    assert torch.equal(idx.cpu(), cidx)
    assert torch.allclose(sums.cpu(), csums, rtol=1e-10, atol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("running_mean", [False, True])
def test_cuda_grab(running_mean):
    rng = np.random.default_rng(33)
    y = torch.tensor(random_grads(rng, 30, 9000, 0.3))
    idx, total = ops.grab_select(y.cuda(), running_mean=running_mean)
    ridx, rtotal = reference.grab_select(y, running_mean=running_mean)
    assert torch.equal(idx.cpu(), ridx)
    assert torch.allclose(total.cpu(), rtotal, rtol=1e-10, atol=1e-10)


def test_benchmark_peers_select_the_same_rows():
    from pyfedkern.benchmarks import herding as bench

    y = torch.tensor(random_grads(np.random.default_rng(40), 24, 500), dtype=torch.float64)
    idx, total = ops.herding_select(y, 0.5)
    for peer in (bench.torch_greedy_loop, bench.gram_python_loop):
        order, peer_total = peer(y, len(idx))
        assert order == idx.tolist()
        torch.testing.assert_close(peer_total, total)
    assert len(bench.cases(quick=True)) >= 8
