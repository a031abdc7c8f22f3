"""The robust ops against the float64 reference (exactly for the order statistics, to rounding for the means) on
random, duplicated, tied, constant and extreme inputs, against Flower's own aggregate functions, for every thread
count, on strided and listed inputs, and their misuse errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.server.strategy import aggregate as flower

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern._runtime import native
from pyfedkern.ops import robust
from pyfedkern.testing import DTYPES, LIBS_CPU, dtype_of, lib_of, make, supports, to_numpy64

EXTREME = {"float64": 1e300, "float32": 3e38, "float16": 6e4, "bfloat16": 3e38}


def inputs(kind: str, K: int, d: int, dtype: str, seed: int = 0) -> np.ndarray:
    """float64 values exactly representable in ``dtype``: random, duplicated rows, heavy ties, constant, extreme."""
    rng = np.random.default_rng(seed)
    if kind == "random":
        x = rng.standard_normal((K, d)) * rng.choice([1e-3, 1.0, 1e2], size=(K, 1))
    elif kind == "duplicates":
        x = rng.standard_normal((K, d))[rng.integers(0, max(1, K // 2), size=K)]
    elif kind == "ties":
        x = rng.integers(-2, 3, size=(K, d)).astype(np.float64)
    elif kind == "constant":
        x = np.full((K, d), 0.375)
    else:  # extreme: ±the dtype's large values mixed with ordinary ones
        x = rng.choice([-1.0, 1.0, 1e-3, 0.5], size=(K, d)) * np.where(rng.random((K, d)) < 0.5, EXTREME[dtype], 1.0)
    return to_numpy64(make("torch", x, dtype))  # rounded to the dtype, as the kernel reads it


KINDS = ["random", "duplicates", "ties", "constant", "extreme"]
KS = [1, 2, 3, 4, 7, 10, 33, 64, 100]


def assert_means_close(got, want, values: np.ndarray, dtype: str):
    """Equal to a rounding of the output dtype (relative to the largest |value| averaged)."""
    g, w = to_numpy64(got), to_numpy64(want)
    scale = np.abs(values).max(0)
    eps = {"float64": 4e-16, "float32": 1.2e-7, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    assert np.all(np.abs(g - w) <= 4 * eps * scale), np.abs(g - w).max()


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_median_and_trimmed_mean_match_reference(lib, dtype, kind):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    for K in KS:
        x = inputs(kind, K, 301, dtype, seed=K)
        u = make(lib, x, dtype)
        got = ops.coordinate_median(u)
        assert lib_of(got) == lib and dtype_of(got) == dtype and tuple(got.shape) == (301,)
        want = reference.coordinate_median(u)
        if K % 2 or dtype in ("float32", "float64"):  # a value of the input, or one rounding of a float64 mean
            np.testing.assert_array_equal(to_numpy64(got), to_numpy64(want))
        else:
            assert_means_close(got, want, x, dtype)
        for beta in (0.0, 0.1, 0.25, 0.49):
            assert_means_close(ops.trimmed_mean(u, beta), reference.trimmed_mean(u, beta), x, dtype)


@pytest.mark.parametrize("K", [1, 4, 9, 23, 40, 45, 50])
def test_trimmed_selection_is_exact(K):
    """With every kept value equal per coordinate, the trimmed mean is that value: the selection is exact (cuts of
    1, 4 and 8 per side take the kernel's register chains, 9 and 10 its sorting network, 0 the plain sum)."""
    rng = np.random.default_rng(K)
    cut = int(0.2 * K)
    mid = rng.integers(-1000, 1000, 300) / 8.0  # sums of a few of these are exact
    x = np.tile(mid, (K, 1))
    x[:cut] = mid - 1e3 - rng.random((cut, 300))  # the cut values, on both sides, in any row order
    x[K - cut :] = mid + 1e3 + rng.random((cut, 300))
    x = x[rng.permutation(K)]
    np.testing.assert_array_equal(ops.trimmed_mean(x, 0.2), mid)


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_weighted_median_matches_reference(lib, dtype):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    for K in (1, 2, 5, 8, 31):
        for kind in ("random", "ties", "duplicates"):
            x = inputs(kind, K, 203, dtype, seed=K)
            u = make(lib, x, dtype)
            rng = np.random.default_rng(K)
            for w in (rng.random(K), rng.integers(0, 3, K).astype(float), np.full(K, 0.1)):
                if w.sum() == 0:
                    w[0] = 1.0
                got = ops.coordinate_median(u, w)
                np.testing.assert_array_equal(to_numpy64(got), to_numpy64(reference.coordinate_median(u, w)))


def test_weighted_median_rules():
    x = np.array([[1.0], [2.0], [3.0], [4.0]])
    assert ops.coordinate_median(x, [1, 1, 1, 1])[0] == 2.5  # equal weights: np.median
    assert ops.coordinate_median(x, [0.1] * 4)[0] == 2.5
    assert ops.coordinate_median(x, [1, 1, 2, 0])[0] == 2.5  # exactly half below 2: the mean with the next value
    assert ops.coordinate_median(x, [1, 1, 3, 0])[0] == 3.0
    assert ops.coordinate_median(x, [5, 1, 1, 1])[0] == 1.0
    nan_row = np.vstack([x, [[np.nan]]])
    assert ops.coordinate_median(nan_row, [1, 1, 3, 0, 0])[0] == 3.0  # a row of weight 0 is not read


def test_torch_rules_match_reference():
    """The torch path (what CUDA inputs take) on CPU tensors."""
    for K in (1, 4, 7, 20):
        for kind in KINDS[:4]:
            x = inputs(kind, K, 97, "float64", seed=K)
            t = torch.tensor(x)
            np.testing.assert_array_equal(robust.torch_rule(t, 0, 0), reference.coordinate_median(x))
            cut = int(0.2 * K)
            np.testing.assert_allclose(robust.torch_rule(t, 1, cut), reference.trimmed_mean(x, 0.2), rtol=1e-14)
            w = np.random.default_rng(K).random(K) + 0.1
            np.testing.assert_array_equal(robust.torch_rule(t, 3, 0, w), reference.coordinate_median(x, w))
            if K >= 3:
                f = (K - 3) // 4
                beta = K - 4 * f
                s = np.sort(x, axis=0)
                sel = torch.tensor(s)  # all rows: the closest-to-median mean alone
                want = reference.bulyan(x, 0) if f == 0 else None
                got = robust.torch_rule(sel, 2, beta)
                if want is not None:
                    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-300)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_krum_matches_reference_and_flower(dtype):
    for K, f in ((3, 0), (5, 1), (10, 2), (23, 5)):
        x = np.random.default_rng(K).standard_normal((K, 500))  # rows of one scale: see krum_scores on rounding
        u = x.astype(dtype)
        scores = ops.krum_scores(u, f)
        assert scores.dtype == np.float64 and scores.shape == (K,)
        np.testing.assert_allclose(scores, reference.krum_scores(u, f), rtol=1e-4 if dtype == "float32" else 1e-10)
        for m in (1, 2, K):
            np.testing.assert_array_equal(ops.krum_select(u, f, m), reference.krum_select(u, f, m))
        results = [([row], 1) for row in u]
        np.testing.assert_array_equal(flower.aggregate_krum(results, f, 0)[0], u[ops.krum_select(u, f)[0]])
        if K > 3:
            multi = flower.aggregate_krum(results, f, 3)[0]
            np.testing.assert_allclose(multi, u[ops.krum_select(u, f, 3)].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_krum_of_rows_sharing_a_large_part_matches_reference(lib):
    """Models rather than updates: ‖x‖² ≈ 2·10⁸ against squared distances ≈ 4, far below the rounding of the raw
    rows' float32 Gram product; the distances must come from the shifted rows (the ranking is the reference's)."""
    rng = np.random.default_rng(7)
    x = (100.0 + 0.01 * rng.standard_normal((12, 20_000)) * rng.uniform(0.5, 2.0, (12, 1))).astype(np.float32)
    u = make(lib, x, "float32")
    want = reference.krum_scores(x, 2)
    np.testing.assert_allclose(to_numpy64(ops.krum_scores(u, 2)), want, rtol=1e-3)
    np.testing.assert_array_equal(to_numpy64(ops.krum_select(u, 2, 4)), reference.krum_select(x, 2, 4))


@pytest.mark.parametrize("shift", [None, 2])
def test_torch_gram_sums_its_chunks(monkeypatch, shift):
    """The CUDA path's chunked GEMMs, run on CPU tensors."""
    monkeypatch.setattr(robust, "_GRAM_CHUNK_ELEMENTS", 5 * 300)  # 300 columns per GEMM: 4 chunks, the last short
    x = np.random.default_rng(3).standard_normal((5, 1100))
    for dtype, rtol in (("float32", 1e-5), ("float64", 1e-13), ("bfloat16", 1e-5)):
        got = robust._torch_gram(make("torch", x, dtype), shift)
        y = to_numpy64(make("torch", x, dtype))
        y = y if shift is None else y - y[shift]
        want = y @ y.T
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def native_distances(rows, shift: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(Gram matrix, squared distances, shift used) of the native ``robust_distances``."""
    ref = robust._update_rows(rows)
    g, dist = np.empty((ref.count, ref.count)), np.empty((ref.count, ref.count))
    used = native().robust_distances(ref.first.dtype, ref.d, g.ctypes.data, dist.ctypes.data, *ref.native_args(), shift)
    return g, dist, used


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("K", [1, 3, 4, 5, 10])
def test_native_gram_is_within_its_bound(dtype, K):
    """The CPU kernel against the float64 product of the same (shifted) values, within its block bound
    (min(512, d)/L + 5 units of roundoff times Σ|y_ic·y_jc|), on row counts around its tiles of 4 × 3 rows, d
    around its 512-column blocks and its 16 column groups, stacked, strided and listed rows, shifted or not; the
    matrix is symmetric, a duplicate row's entries are bit for bit those of its original, and the distances are
    max(0, G_ii + G_jj − 2G_ij) with a zero diagonal."""
    rng = np.random.default_rng(K)
    lanes, unit = (4, 2.0**-53) if dtype == "float64" else (8, 2.0**-24)
    for d in (1, 7, 512, 513, 16 * 512 + 3, 40 * 512 + 100):
        x = rng.standard_normal((K, d)) * rng.uniform(0.1, 10.0, (K, 1))
        if K > 2:
            x[2] = x[0]
        stacked = make("torch", x, dtype)
        y = to_numpy64(stacked)
        for shift in (-1, 0, K - 1):
            layouts = (stacked, list(stacked), stacked.repeat_interleave(2, dim=1)[:, ::2])
            for layout, rows in zip(("stack", "list", "strided"), layouts, strict=True):
                got, dist, used = native_distances(rows, shift)
                z = y if used == -1 else y - y[used]
                want, scale = z @ z.T, np.abs(z) @ np.abs(z).T
                np.testing.assert_array_equal(got, got.T)
                err = np.abs(got - want)
                assert np.all(err <= (min(512, d) / lanes + 5) * unit * scale * (1 + 1e-9)), (d, shift, layout)
                diag = np.diag(got)
                want_dist = np.maximum(diag[:, None] + diag[None, :] - 2.0 * got, 0.0)
                np.fill_diagonal(want_dist, 0.0)
                np.testing.assert_array_equal(dist, want_dist)
                if K > 2:
                    np.testing.assert_array_equal(got[2], got[0])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_native_probe_and_retry_are_the_torch_ones(dtype):
    """The native probe (CPU) picks the shift the CUDA path's :func:`robust._probe` picks on the same columns (d at
    and around 256, all columns, and beyond, 16 runs of 16), for updates (no shift), models (their medoid) and models
    with an outlying row (an honest medoid), stacked, listed and strided; a misleading pick is retaken around the
    medoid, as the CUDA path does."""
    rng = np.random.default_rng(4)
    for d in (1, 255, 256, 257, 4099, 100_003):
        updates = rng.standard_normal((6, d))
        models = 100.0 + 0.01 * rng.standard_normal((6, d)) * rng.uniform(0.5, 2.0, (6, 1))
        attacked = models.copy()
        attacked[1] = 100.0 + 100.0 * rng.standard_normal(d)
        for x in (updates, models, attacked):
            stacked = make("torch", x, dtype)
            want = robust._probe(stacked)
            for rows in (stacked, list(stacked), stacked.repeat_interleave(2, dim=1)[:, ::2]):
                assert native_distances(rows, -2)[2] == (-1 if want is None else want), d
    x = 100.0 + 0.01 * rng.standard_normal((6, 3000))
    _, dist, used = native_distances(make("torch", x, dtype), -1)  # the raw product of models misleads: retaken
    assert used in range(6)
    want = ((to_numpy64(make("torch", x, dtype))[:, None, :] - to_numpy64(make("torch", x, dtype))[None]) ** 2).sum(-1)
    np.testing.assert_allclose(dist, want, rtol=1e-2 if dtype in ("float16", "bfloat16") else 1e-3)


def krum_error_bounds(x: np.ndarray, honest: list[int], f: int) -> np.ndarray:
    """[K] proven bounds of the float32 Gram-product Krum scores of float32-valued rows x against the float64 ones,
    for any shift s among the rows ``honest``: each distance from y = fl(x − s) and float32 products summed in any
    order is within (2γ_d + 5u)(‖x_i − s‖² + ‖x_j − s‖²) (u = 2⁻²⁴, γ_d = du/(1 − du)), and a score, the sum of its
    n smallest distances, within n times the largest such bound of a row that can be among its n nearest."""
    K, d = x.shape
    u = 2.0**-24
    sq = np.stack([((x - x[s]) ** 2).sum(1) for s in honest]).max(0)
    err = (2 * d * u / (1 - d * u) + 5 * u) * (sq[:, None] + sq[None, :]) * (1 + 1e-9)
    dist = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1) + np.diag(np.full(K, np.inf))
    n = min(K - 1, max(1, K - f - 2))
    reach = np.sort(dist + err, axis=1)[:, n - 1 : n]  # any perturbed n nearest lie below the n-th (D + err)
    return n * np.where(dist - err <= reach, err, 0.0).max(1)


def assert_margins(x: np.ndarray, honest: list[int], f: int, m: int):
    """The reference's Multi-Krum picks 1..m win by more than twice the bounds of both scores (the op's tie band is
    below them), so any computation within the bounds must pick the same rows."""
    scores, bounds = reference.krum_scores(x, f), krum_error_bounds(x, honest, f)
    remaining = list(range(len(x)))
    for _ in range(m):
        w = min(remaining, key=lambda k: (scores[k], k))
        remaining.remove(w)
        for j in remaining:
            assert scores[j] - scores[w] > 2 * (bounds[j] + bounds[w]), (w, j)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("attacker", [False, True])
@pytest.mark.parametrize("probe", ["probe", "raw", "row 0", "row 5"])
def test_krum_of_near_identical_rows_is_the_reference_choice(lib, attacker, probe):
    """Models: a common part of ‖x‖² ≈ 2·10⁸ against squared distances of 1–16, far below the rounding of the raw
    rows' float32 Gram product, optionally with an attacker's huge row first. Whatever shift is proposed for the
    Gram product (the probe's pick on a sample of columns, the raw rows, the attacker's row, an honest one), the
    choice is the reference's."""
    rng = np.random.default_rng(11)
    K, d, f = 12, 20_000, 2
    x = 100.0 + 0.01 * rng.standard_normal((K, d)) * np.linspace(0.5, 2.0, K)[rng.permutation(K), None]
    if attacker:
        x[0] = 100.0 + 100.0 * rng.standard_normal(d)
    x = x.astype(np.float32).astype(np.float64)
    honest = list(range(1 if attacker else 0, K))
    assert_margins(x, honest, f, 3)
    u = make(lib, x, "float32")
    shift = robust._PROBE if probe == "probe" else -1 if probe == "raw" else int(probe[4:])
    if probe == "probe":
        assert native_distances(u, shift)[2] in honest
        assert robust._probe(torch.from_numpy(x.astype(np.float32))) in honest  # the CUDA path's probe
    dist, bound = robust._squared_distances("krum_select", u, robust._update_rows(u), shift)
    np.testing.assert_array_equal(robust._pick(dist, bound, f, 3), reference.krum_select(x, f, 3))
    got, want = robust._scores(dist, bound, f)[0], reference.krum_scores(x, f)
    assert np.all(np.abs(got - want) <= krum_error_bounds(x, honest, f))
    np.testing.assert_array_equal(to_numpy64(ops.krum_select(u, f, 3)), reference.krum_select(x, f, 3))


def test_krum_ties_go_to_the_lowest_index():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 1000)).astype(np.float32) * 10
    x[2] = x[6] = x[4] = rng.standard_normal(1000).astype(np.float32) * 0.01  # three identical, central rows
    assert ops.krum_select(x, 1).tolist() == [2]
    assert ops.krum_select(x, 1, 3).tolist() == [2, 4, 6]
    assert ops.krum_select(torch.tensor(x), 1, 3).tolist() == [2, 4, 6]
    assert ops.krum_select(np.ones((5, 7)), 1, 5).tolist() == [0, 1, 2, 3, 4]  # all equal
    assert ops.krum_scores(np.ones((1, 7)), 0).tolist() == [0.0]


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_bulyan_matches_reference_and_flower(lib, dtype):
    for K, f in ((3, 0), (7, 1), (12, 2), (20, 4)):
        for kind in ("random", "ties", "duplicates"):
            x = inputs(kind, K, 211, dtype, seed=K)
            u = make(lib, x, dtype)
            got = ops.bulyan(u, f)
            assert lib_of(got) == lib and dtype_of(got) == dtype
            assert_means_close(got, reference.bulyan(u, f), x, dtype)
    x = inputs("random", 11, 300, "float32", seed=3).astype(np.float32)
    want = flower.aggregate_bulyan([([r], 1) for r in x], 2, flower.aggregate_krum, to_keep=0)[0]
    assert_means_close(ops.bulyan(x, 2), want, x, "float32")


def test_median_and_trimmed_mean_equal_flower():
    rng = np.random.default_rng(1)
    for K in (5, 10, 31):
        x = rng.standard_normal((K, 1000)).astype(np.float32)
        results = [([r], 1) for r in x]
        np.testing.assert_array_equal(ops.coordinate_median(x), flower.aggregate_median(results)[0])
        for beta in (0.1, 0.3):
            want = flower.aggregate_trimmed_avg(results, beta)[0]
            np.testing.assert_allclose(ops.trimmed_mean(x, beta), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_geometric_median_and_centred_clip_match_reference(dtype):
    rtol = {"float64": 1e-9, "float32": 2e-4, "bfloat16": 2e-2}[dtype]
    for K in (1, 2, 5, 16):
        x = inputs("random", K, 400, dtype, seed=K)
        u = make("torch", x, dtype)
        scale = np.abs(x).max()
        w = np.random.default_rng(K).random(K)
        w[0] = 0.0 if K > 1 else w[0]
        for weights in (None, w):
            got = ops.geometric_median(u, weights, iters=20, tol=0.0)
            want = reference.geometric_median(u, weights, iters=20, tol=0.0)
            assert dtype_of(got) == dtype
            assert np.abs(to_numpy64(got) - to_numpy64(want)).max() <= rtol * scale
        center = make("torch", x.mean(0) * 0.5, dtype)
        for tau, iters in ((0.1, 1), (1.0, 3), (1e9, 2)):
            got = ops.centred_clip(u, center, tau, iters)
            want = reference.centred_clip(u, center, tau, iters)
            assert np.abs(to_numpy64(got) - to_numpy64(want)).max() <= rtol * scale


def test_geometric_median_resists_an_outlier_and_stops_at_tol():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((9, 50))
    x[0] = 1e6
    med = ops.geometric_median(x, eps=1e-8, iters=1000, tol=1e-12)
    np.testing.assert_allclose(med, reference.geometric_median(x, eps=1e-8, iters=1000, tol=1e-12), atol=1e-7)
    assert np.abs(med).max() < 2.0  # the mean is ~1e5
    np.testing.assert_allclose(ops.geometric_median(x, iters=0), x.mean(0), rtol=1e-12, atol=1e-12)


def test_every_thread_count_gives_the_same_result():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((12, 200_003)).astype(np.float32)
    w = rng.random(12)
    before = pyfedkern.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            pyfedkern.set_num_threads(n)
            results.append(
                [
                    ops.coordinate_median(x),
                    ops.coordinate_median(x, w),
                    ops.trimmed_mean(x, 0.2),
                    ops.bulyan(x, 2),
                    ops.krum_scores(x, 2),
                ]
            )
    finally:
        pyfedkern.set_num_threads(before)
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(a, b)


def test_strided_and_listed_inputs():
    rng = np.random.default_rng(2)
    big = rng.standard_normal((14, 2 * 333))
    strided = big[::2, ::2]  # 7 rows, column stride 2
    listed = [torch.tensor(big[k, 1::2]) for k in range(7)]
    np.testing.assert_array_equal(ops.coordinate_median(strided), reference.coordinate_median(strided))
    np.testing.assert_array_equal(ops.coordinate_median(listed), reference.coordinate_median(listed))
    out = np.empty(333)
    assert ops.trimmed_mean(strided, 0.2, out=out) is out
    np.testing.assert_allclose(out, reference.trimmed_mean(strided, 0.2), rtol=1e-14)
    np.testing.assert_allclose(ops.bulyan(listed, 1), reference.bulyan(listed, 1), rtol=1e-13)
    assert ops.krum_select(listed, 1, 2).tolist() == reference.krum_select(listed, 1, 2).tolist()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_every_non_finite_value_is_found(dtype):
    """A NaN or an infinity anywhere (a full or a partial group of 8 rows, a full vector of columns or the last,
    partial one) is refused, naming its row, by the order statistics' kernel."""
    rng = np.random.default_rng(5)
    for K, d in ((9, 37), (16, 19), (50, 301)):
        x = rng.standard_normal((K, d))
        for k, j in ((0, 0), (K - 1, d - 1), (K // 2, d // 2), (8 % K, d - 3)):
            for value in (np.nan, -np.inf):
                bad = x.copy()
                bad[k, j] = value
                u = make("torch", bad, dtype)
                with pytest.raises(ValueError, match=rf"updates\[{k}\]"):
                    ops.coordinate_median(u)
                with pytest.raises(ValueError, match=rf"updates\[{k}\]"):
                    ops.trimmed_mean(u, 0.45)


def test_misuse_is_refused_by_name():
    x = np.random.default_rng(0).standard_normal((7, 20))
    bad = x.copy()
    bad[4, 3] = np.inf
    with pytest.raises(ValueError, match=r"updates\[4\]"):
        ops.coordinate_median(bad)
    with pytest.raises(ValueError, match=r"updates\[4\]"):
        ops.trimmed_mean(bad, 0.1)
    bad[4, 3] = np.nan
    with pytest.raises(ValueError, match=r"updates\[4\]"):
        ops.krum_scores(bad, 1)
    with pytest.raises(ValueError, match=r"updates\[4\]"):
        ops.bulyan(bad, 1)
    with pytest.raises(ValueError, match=r"updates\[4\]"):
        ops.geometric_median(bad)
    with pytest.raises(ValueError, match="overflow"):
        ops.krum_scores(np.full((4, 3), 1e300) * np.arange(4)[:, None], 1)
    with pytest.raises(ValueError, match="beta"):
        ops.trimmed_mean(x, 0.5)
    with pytest.raises(ValueError, match="beta"):
        ops.trimmed_mean(x, -0.1)
    with pytest.raises(TypeError, match="beta"):
        ops.trimmed_mean(x, "0.1")
    with pytest.raises(ValueError, match="f = 7"):
        ops.krum_scores(x, 7)
    with pytest.raises(ValueError, match="4f"):
        ops.bulyan(x, 2)
    with pytest.raises(ValueError, match="m must"):
        ops.krum_select(x, 1, 8)
    with pytest.raises(ValueError, match="weights"):
        ops.coordinate_median(x, [1, 1, 1, -1, 1, 1, 1])
    with pytest.raises(ValueError, match="weights"):
        ops.coordinate_median(x, np.zeros(7))
    with pytest.raises(ValueError, match="weights"):
        ops.geometric_median(x, np.ones(6))
    with pytest.raises(ValueError, match="eps"):
        ops.geometric_median(x, eps=0.0)
    with pytest.raises(ValueError, match="tau"):
        ops.centred_clip(x, x[0], 0.0)
    with pytest.raises(ValueError, match="center"):
        ops.centred_clip(x, x[0, :5], 1.0)
    with pytest.raises(ValueError, match="out"):
        ops.coordinate_median(x, out=np.empty(19))
    with pytest.raises(ValueError, match="out overlaps"):
        ops.coordinate_median(x, out=x[2])
    with pytest.raises(ValueError, match="empty"):
        ops.coordinate_median(np.empty((0, 3)))
    with pytest.raises(TypeError, match="dtype"):
        ops.coordinate_median(np.ones((3, 3), dtype=np.int64))
    t = torch.tensor(x, requires_grad=True)
    for call in (
        lambda: ops.coordinate_median(t),
        lambda: ops.trimmed_mean(t, 0.1),
        lambda: ops.krum_select(t, 1),
        lambda: ops.geometric_median(t),
    ):
        with pytest.raises(ValueError, match="requires grad"):
            call()


OPCHECK = {
    "coordinate_median": lambda x: (x, None),
    "trimmed_mean": lambda x: (x, 0.2),
    "krum_scores": lambda x: (x, 1),
    "krum_select": lambda x: (x, 1, 2),
    "bulyan": lambda x: (x, 1),
    "geometric_median": lambda x: (x, None, 1e-6, 5, 0.0),
    "centred_clip": lambda x: (x, x[0].clone(), 0.5, 2),
}


@pytest.mark.parametrize("name", list(OPCHECK))
def test_opcheck(name):
    x = torch.randn(7, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.library.opcheck(getattr(torch.ops.pyfedkern, name).default, OPCHECK[name](x))


def test_compiled_calls_equal_eager():
    x = torch.randn(7, 13, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def fn(u):
        return ops.coordinate_median(u), ops.trimmed_mean(u, 0.2), ops.bulyan(u, 1), ops.krum_select(u, 1, 2)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(x), fn(x), strict=True):
        assert torch.equal(a, b)
