"""FedPBC server ops (pbc_agg_bcast_, weighted_delta_, mifa_update_) against the float64 references: k = 0, k = m,
dtypes, strided views, thread invariance, bad input, and CUDA when present."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern.testing import DTYPES, LIBS_CPU, REL_TOL, make, pool_wakes, supports, to_numpy64, written_after_sleep


def tol(dtype: str, scale: float) -> float:
    return REL_TOL[dtype] * 4 * scale + 1e-30


def rand_store(m: int, d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, d)) * rng.choice([1e-2, 1.0, 1e2], size=(m, 1))


# pbc_agg_bcast_ ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "d", "k"), [(1, 1, 1), (5, 3, 2), (100, 5003, 10), (7, 4099, 7), (9, 2048, 5)])
def test_agg_bcast_matches_reference(lib, dtype, m, d, k):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    values = rand_store(m, d, m * 31 + d)
    active = np.random.default_rng(k).choice(m, size=k, replace=False)
    store, server = make(lib, values, dtype), make(lib, np.zeros(d), dtype)
    store_ref, server_ref = make(lib, values, dtype), make(lib, np.zeros(d), dtype)
    assert ops.pbc_agg_bcast_(store, server, active) is server
    reference.pbc_agg_bcast_(store_ref, server_ref, active)
    scale = float(np.abs(values[active]).max())
    assert np.abs(to_numpy64(server) - to_numpy64(server_ref)).max() <= tol(dtype, scale)
    got = to_numpy64(store)
    # active rows hold exactly the server's bits; the others are untouched
    assert np.array_equal(got[active], np.broadcast_to(to_numpy64(server), (k, d)))
    inactive = np.setdiff1d(np.arange(m), active)
    assert np.array_equal(got[inactive], to_numpy64(make(lib, values, dtype))[inactive])


def test_agg_bcast_k_zero_is_a_no_op():
    store = np.full((4, 6), np.nan, np.float32)
    server = np.arange(6, dtype=np.float32)
    for empty in ([], np.zeros(0, np.int64), np.zeros(4, bool), torch.zeros(0, dtype=torch.long)):
        ops.pbc_agg_bcast_(store, server, empty)
        assert server.tolist() == list(range(6)) and np.isnan(store).all()


def test_agg_bcast_k_equals_m_and_mask():
    values = rand_store(6, 1001, 1)
    store, server = values.copy(), np.zeros(1001)
    ops.pbc_agg_bcast_(store, server, np.ones(6, bool))
    assert np.allclose(server, values.mean(0), rtol=1e-13, atol=1e-13)
    assert np.array_equal(store, np.broadcast_to(server, store.shape))


def test_agg_bcast_order_of_indices_does_not_matter():
    values = rand_store(50, 3000, 2).astype(np.float32)
    a, b = values.copy(), values.copy()
    sa, sb = np.zeros(3000, np.float32), np.zeros(3000, np.float32)
    ops.pbc_agg_bcast_(a, sa, [40, 3, 17, 8, 22])
    ops.pbc_agg_bcast_(b, sb, torch.tensor([3, 8, 17, 22, 40]))
    assert np.array_equal(sa, sb) and np.array_equal(a, b)


@pytest.mark.parametrize("view", ["column_slice", "transposed", "row_step"])
def test_agg_bcast_strided_store(view):
    base = torch.from_numpy(rand_store(12, 3001, 3))
    if view == "column_slice":
        store = base[:, ::3]
    elif view == "transposed":
        store = base.T.contiguous().T
    else:
        store = base[::2]
    expected = store.clone()
    server_ref = torch.zeros(store.shape[1], dtype=torch.float64)
    server_out = torch.zeros(2 * store.shape[1], dtype=torch.float64)[::2]  # a strided server vector
    ops.pbc_agg_bcast_(store, server_out, [0, 2, 5])
    reference.pbc_agg_bcast_(expected, server_ref, [0, 2, 5])
    assert torch.allclose(server_out, server_ref, rtol=1e-13, atol=1e-13)
    assert torch.allclose(store, expected, rtol=1e-13, atol=1e-13)


def test_agg_bcast_thread_invariance():
    values = rand_store(100, 300_001, 4).astype(np.float32)
    active = np.arange(0, 100, 7)
    before = pyfedkern.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            pyfedkern.set_num_threads(n)
            store, server = values.copy(), np.zeros(values.shape[1], np.float32)
            with pool_wakes(n > 1):
                ops.pbc_agg_bcast_(store, server, active)
            results.append(server)
    finally:
        pyfedkern.set_num_threads(before)
    assert all(np.array_equal(r, results[0]) for r in results[1:])


# weighted_delta_ -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "d", "k"), [(1, 1, 1), (4, 5, 3), (100, 4099, 10), (20, 2049, 20)])
def test_weighted_delta_matches_reference(lib, dtype, m, d, k):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    rng = np.random.default_rng(m + d + k)
    values = rand_store(m, d, d)
    x0 = rng.standard_normal(d)
    rows = rng.choice(m, size=k, replace=False)
    w = rng.random(k) * 3
    scale = 1.5 / m
    x, x_ref = make(lib, x0, dtype), make(lib, x0, dtype)
    store = make(lib, values, dtype)
    assert ops.weighted_delta_(x, store, w, scale, rows=rows) is x
    reference.weighted_delta_(x_ref, store, w, scale, rows=rows)
    bound = abs(scale) * float((w[:, None] * (np.abs(values[rows]) + np.abs(x0))).sum(0).max()) + np.abs(x0).max()
    assert np.abs(to_numpy64(x) - to_numpy64(x_ref)).max() <= tol(dtype, bound)


def test_weighted_delta_list_input_and_fedavg_identity():
    rng = np.random.default_rng(5)
    models = [torch.from_numpy(rng.standard_normal(777)) for _ in range(4)]
    x = torch.from_numpy(rng.standard_normal(777))
    ops.weighted_delta_(x, models, np.ones(4), 1.0 / 4)  # η_g = 1: x becomes the plain mean
    assert torch.allclose(x, torch.stack(models).mean(0), rtol=1e-12, atol=1e-12)


def test_weighted_delta_zero_weights_are_not_read_and_empty_is_a_no_op():
    store = np.ones((3, 8), np.float32)
    store[1] = np.nan
    x = np.zeros(8, np.float32)
    ops.weighted_delta_(x, store, [1.0, 0.0, 1.0], 0.5)
    assert np.all(x == 1.0)
    ops.weighted_delta_(x, store, [], 0.5, rows=[])
    assert np.all(x == 1.0)


def test_weighted_delta_strided():
    base = torch.from_numpy(rand_store(10, 4000, 6))
    store = base[:, 1::2]
    x = torch.zeros(4000, dtype=torch.float64)[::2]
    x_ref = x.clone()
    weights, rows = [0.5, 2.0, 1.5, 0.25, 3.0, 1.0, 0.75], [9, 3, 0, 5, 7, 1, 2]  # a 4-row, a 2-row, a 1-row sweep
    ops.weighted_delta_(x, store, weights, 0.1, rows=rows)
    reference.weighted_delta_(x_ref, store, weights, 0.1, rows=rows)
    assert torch.allclose(x, x_ref, rtol=1e-12, atol=1e-12)


# mifa_update_ --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("updates_are", ["models", "deltas"])
def test_mifa_matches_reference_over_rounds(lib, dtype, updates_are):
    rng = np.random.default_rng(7)
    m, d = 12, 3001
    x, x_ref = make(lib, rng.standard_normal(d), dtype), make(lib, np.zeros(d), dtype)
    x_ref[...] = x
    mem, mem_ref = make(lib, np.zeros((m, d)), dtype), make(lib, np.zeros((m, d)), dtype)
    tot, tot_ref = make(lib, np.zeros(d), dtype), make(lib, np.zeros(d), dtype)
    for t in range(8):
        k = int(rng.integers(0, m + 1))
        rows = rng.choice(m, size=k, replace=False)
        upd = make(lib, rng.standard_normal((max(k, 1), d))[:k], dtype)
        ops.mifa_update_(x, mem, tot, upd, rows, 0.8, updates_are=updates_are, resum=t == 5)
        reference.mifa_update_(x_ref, mem_ref, tot_ref, upd, rows, 0.8, updates_are=updates_are)
    scale = 50.0
    assert np.abs(to_numpy64(mem) - to_numpy64(mem_ref)).max() <= tol(dtype, scale)
    assert np.abs(to_numpy64(tot) - to_numpy64(tot_ref)).max() <= tol(dtype, scale * m)
    assert np.abs(to_numpy64(x) - to_numpy64(x_ref)).max() <= tol(dtype, scale * m)


def test_mifa_resum_removes_drift():
    m, d = 4, 5
    mem = np.zeros((m, d), np.float32)
    tot = np.full(d, 123.0, np.float32)  # a drifted running sum
    x = np.zeros(d, np.float32)
    ops.mifa_update_(x, mem, tot, np.ones((1, d), np.float32), [2], 1.0, updates_are="deltas", resum=True)
    assert tot.tolist() == [1.0] * d and np.allclose(x, 0.25)


def test_mifa_strided_views():
    rng = np.random.default_rng(3)
    m, d, k = 9, 2500, 5  # two 2-row sweeps and one single row
    mem = torch.zeros(m, 2 * d, dtype=torch.float64)[:, ::2]
    tot, x = torch.zeros(2 * d, dtype=torch.float64)[1::2], torch.from_numpy(rng.standard_normal(d))
    mem_ref, tot_ref, x_ref = mem.clone(), tot.clone(), x.clone()
    for _ in range(3):
        rows = rng.choice(m, size=k, replace=False)
        upd = torch.from_numpy(rng.standard_normal((d, k))).T  # rows of stride 1 apart, elements k apart
        ops.mifa_update_(x, mem, tot, upd, rows, 0.7)
        reference.mifa_update_(x_ref, mem_ref, tot_ref, upd, rows, 0.7)
    for got, want in ((mem, mem_ref), (tot, tot_ref), (x, x_ref)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_mifa_list_updates_and_mask_rows():
    m, d = 5, 9
    mem, tot, x = np.zeros((m, d)), np.zeros(d), np.zeros(d)
    ops.mifa_update_(x, mem, tot, [np.ones(d), 2 * np.ones(d)], np.array([0, 1, 0, 1, 0], bool))
    assert mem[1].tolist() == [1.0] * d and mem[3].tolist() == [2.0] * d
    assert np.allclose(x, 3.0 / m)


# bad input -----------------------------------------------------------------------------------------------

S = np.zeros((4, 6), np.float32)
V = np.zeros(6, np.float32)


@pytest.mark.parametrize(
    ("store", "server", "active", "exc", "match"),
    [
        (np.zeros(6, np.float32), V, [0], ValueError, "2-D"),
        (np.zeros((0, 6), np.float32), V, [], ValueError, "empty"),
        (S, np.zeros(5, np.float32), [0], ValueError, "length 5, expected 6"),
        (S, np.zeros(6, np.float64), [0], TypeError, "server has dtype float64"),
        (S, torch.zeros(6), [0], ValueError, "mixing"),
        (S, V, [4], ValueError, r"row index 4, expected indices in \[0, 4\)"),
        (S, V, [-1], ValueError, "row index -1"),
        (S, V, [1, 1], ValueError, "duplicate"),
        (S, V, [0.5], TypeError, "integer row indices"),
        (S, V, np.ones(3, bool), ValueError, "mask of length 3, expected 4"),
        (S, V, [[0]], ValueError, "1-D"),
        (S, S[0], [0], ValueError, "overlaps store"),
        (np.zeros((4, 6), np.int32), V, [0], TypeError, "dtype int32"),
        (np.broadcast_to(np.float32(0), (4, 6)), V, [0], ValueError, "read-only"),
        (S, np.broadcast_to(np.float32(0), (6,)), [0], ValueError, "read-only"),
        ([[0.0]], V, [0], TypeError, "numpy array, torch tensor or cupy array"),
    ],
)
def test_agg_bcast_bad_input(store, server, active, exc, match):
    with pytest.raises(exc, match=match):
        ops.pbc_agg_bcast_(store, server, active)


@pytest.mark.parametrize("n", [5, 32, 33, 200])  # index lists up to 32 are checked as Python lists, longer by numpy
def test_index_checks_short_and_long(n):
    store, server = np.zeros((300, 3), np.float32), np.zeros(3, np.float32)
    rows = list(np.random.default_rng(n).permutation(300)[:n])
    ops.pbc_agg_bcast_(store, server, rows)  # valid
    for bad, match in (
        ([*rows[:-1], rows[0]], "duplicate"),
        ([*rows[:-1], 300], "row index 300, expected"),
        ([*rows[:-1], -2], "row index -2"),
    ):
        with pytest.raises(ValueError, match=match):
            ops.pbc_agg_bcast_(store, server, bad)
    x = np.zeros(3, np.float32)
    ops.weighted_delta_(x, store, np.ones(n), rows=rows)  # unsorted rows keep their order with their weights
    store[rows[0]] = 1.0
    ops.weighted_delta_(x, store, [1.0] + [0.0] * (n - 1), rows=rows)
    assert (x == 1.0).all()


def test_agg_bcast_rejects_overlapping_rows():
    t = torch.zeros(10)
    with pytest.raises(ValueError, match="rows overlap"):
        ops.pbc_agg_bcast_(t.as_strided((4, 6), (1, 1)), torch.zeros(6), [0, 1])


@pytest.mark.parametrize(
    ("x", "models", "weights", "scale", "rows", "exc", "match"),
    [
        (V.copy(), S, [1, 1], 1.0, None, ValueError, "length 2, expected 4"),
        (V.copy(), S, [1], 1.0, [0, 0], ValueError, "duplicate"),
        (V.copy(), S, [1], float("nan"), [0], ValueError, "finite"),
        (V.copy(), S, [np.inf], 1.0, [0], ValueError, "finite"),
        (V.copy(), np.zeros((4, 5), np.float32), [1], 1.0, [0], ValueError, "5 columns, expected 6"),
        (V.copy(), [np.zeros(6, np.float32)], [1], 1.0, [0], ValueError, "rows selects rows of a 2-D stack"),
        (V.copy(), [np.zeros(6, np.float64)], [1], 1.0, None, TypeError, r"models\[0\] has dtype"),
        (V.copy(), "abc", [1], 1.0, None, TypeError, "2-D array or a list"),
        (S[0], S, [1], 1.0, [1], ValueError, "overlaps"),
        (V.copy(), S, [1e300, -1e300], 1e10, [0, 1], ValueError, r"weights × scale overflows float64"),
    ],
)
def test_weighted_delta_bad_input(x, models, weights, scale, rows, exc, match):
    with pytest.raises(exc, match=match):
        ops.weighted_delta_(x, models, weights, scale, rows=rows)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"updates": np.zeros((2, 6), np.float32), "rows": [0]}, ValueError, "2 rows but rows selects 1"),
        ({"updates": np.zeros((1, 6), np.float32), "rows": [0], "updates_are": "x"}, ValueError, "updates_are"),
        ({"updates": np.zeros((1, 6), np.float64), "rows": [0]}, TypeError, "dtype float64"),
        ({"updates": S[:1], "rows": [0]}, ValueError, "overlaps"),
        ({"updates": np.zeros((1, 6), np.float32), "rows": [9]}, ValueError, "row index 9"),
        ({"updates": np.zeros((1, 6), np.float32), "rows": [0], "server_lr": np.nan}, ValueError, "finite"),
        ({"updates": np.zeros((1, 6), np.float32), "rows": [0], "resum": "no"}, TypeError, "resum must be a bool"),
    ],
)
def test_mifa_bad_input(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ops.mifa_update_(np.zeros(6, np.float32), S, np.zeros(6, np.float32), **kwargs)


# CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "d", "k"), [(1, 1, 1), (100, 100_003, 10), (8, 4097, 8)])
def test_cuda_ops_match_reference(dtype, m, d, k):
    values = rand_store(m, d, k)
    active = np.random.default_rng(d).choice(m, size=k, replace=False)
    store, server = make("torch", values, dtype, "cuda"), make("torch", np.zeros(d), dtype, "cuda")
    store_ref, server_ref = make("torch", values, dtype), make("torch", np.zeros(d), dtype)
    ops.pbc_agg_bcast_(store, server, active)
    reference.pbc_agg_bcast_(store_ref, server_ref, active)
    scale = float(np.abs(values[active]).max())
    assert np.abs(to_numpy64(server) - to_numpy64(server_ref)).max() <= tol(dtype, scale)
    assert np.array_equal(to_numpy64(store)[active], np.broadcast_to(to_numpy64(server), (k, d)))
    w = np.linspace(0.5, 2.0, k)
    x, x_ref = make("torch", values[0], dtype, "cuda"), make("torch", values[0], dtype)
    ops.weighted_delta_(x, store, w, 0.3, rows=active)
    reference.weighted_delta_(x_ref, store_ref, w, 0.3, rows=active)
    assert np.abs(to_numpy64(x) - to_numpy64(x_ref)).max() <= tol(dtype, 10 * k * scale)
    if dtype in ("float32", "float64"):
        mem, tot = torch.zeros_like(store), torch.zeros_like(server)
        mem_ref, tot_ref = torch.zeros_like(store_ref), torch.zeros_like(server_ref)
        upd = store[: len(active)].clone()
        ops.mifa_update_(x, mem, tot, upd, active, 0.5, resum=True)
        reference.mifa_update_(x_ref, mem_ref, tot_ref, upd.cpu(), active, 0.5)
        assert np.abs(to_numpy64(x) - to_numpy64(x_ref)).max() <= tol(dtype, 10 * k * scale)
        assert np.abs(to_numpy64(mem) - to_numpy64(mem_ref)).max() <= tol(dtype, 10 * scale)


@pytest.mark.cuda
def test_cuda_strided_store_and_stream():
    base = torch.randn(10, 9001, device="cuda", dtype=torch.float64)
    expected = base[:, 1::2].cpu().clone()
    stream = torch.cuda.Stream()
    store = written_after_sleep(stream, base)[:, 1::2]  # written late on `stream`: right answers prove the op ran there
    server = torch.zeros(store.shape[1], device="cuda", dtype=torch.float64)
    server_ref = torch.zeros(store.shape[1], dtype=torch.float64)
    stream.wait_stream(torch.cuda.current_stream())  # the zeroed server is ready on `stream`
    with torch.cuda.stream(stream):
        ops.pbc_agg_bcast_(store, server, [1, 4, 9])
    stream.synchronize()
    reference.pbc_agg_bcast_(expected, server_ref, [1, 4, 9])
    assert torch.allclose(server.cpu(), server_ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(store.cpu(), expected, rtol=1e-12, atol=1e-12)


def test_benchmark_cases_run_and_the_idioms_agree():
    """Every peer of every group computes the same result as pyfedkern, each case on fresh inputs."""
    from pyfedkern.benchmarks import pbc

    cases = pbc.cases(quick=True)
    assert {c.group.split()[0] for c in cases} == {"pbc_agg_bcast", "weighted_delta", "mifa_update", "fedpbc_round"}
    results: dict[str, dict[str, torch.Tensor]] = {}
    for i, case in enumerate(cases):
        fresh = pbc.cases(quick=True)[i]  # a new input cache: no case sees another's in-place writes
        out = fresh.make()()
        if not case.is_limit:
            results.setdefault(case.group, {})[case.name] = out.clone()
    assert len(results) == 3 * len(pbc.QUICK_SIZES) + 1
    for group, by_name in results.items():
        # pyfedkern, the idiom and the loop; the engine round: batched and the per-client loop
        assert "pyfedkern" in by_name and len(by_name) >= (2 if group.startswith("fedpbc_round") else 3), group
        for name, value in by_name.items():
            torch.testing.assert_close(value, by_name["pyfedkern"], rtol=1e-5, atol=1e-5, msg=f"{group}: {name}")
