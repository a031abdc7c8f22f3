"""seeded_permutations against NumPy's own generators: seeds of one to several 32-bit words, keys at the ends of
their range, sizes 0 to 10^5, k = 0, j = 0, thread invariance, the engine's key shape, and bad input."""

from __future__ import annotations

import numpy as np
import pytest

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern._runtime import native
from pyfedkern.testing import pool_wakes

SEEDS = [0, 1, 12345, 2**32 - 1, 2**32, 2**64 - 1, 2**64, 3**80]


def random_rows(k: int, j: int, max_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys [k, j] that include 0 and 2**32 - 1, and sizes [k] in [0, max_size] that include 0 and 1."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**32, size=(k, j), dtype=np.int64)
    sizes = rng.integers(0, max_size + 1, size=k)
    if k >= 4 and j:
        keys[0, 0], keys[1, -1], keys[2] = 0, 2**32 - 1, 0
    if k >= 4:
        sizes[:3] = [0, 1, 2]
    return keys, sizes


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("j", [0, 1, 2, 4, 6])
def test_matches_numpy(seed, j):
    keys, sizes = random_rows(40, j, 300, seed % 1000 + j)
    got = ops.seeded_permutations(seed, keys, sizes)
    expected = reference.seeded_permutations(seed, keys, sizes)
    assert got.dtype == np.int64 and got.shape == (int(sizes.sum()),)
    assert np.array_equal(got, expected)


def test_large_sizes_match_numpy():
    keys = np.array([[2, 0, 5, 1], [2, 3, 5, 4], [7, 2**32 - 1, 0, 0]])
    sizes = np.array([100_000, 65_537, 70_001])  # rows cross the 16- and 17-bit masks of the bounded draws
    got = ops.seeded_permutations(2**40 + 3, keys, sizes)
    assert np.array_equal(got, reference.seeded_permutations(2**40 + 3, keys, sizes))


@pytest.mark.parametrize("seed", [0, 7, 2**33 + 1])
def test_engine_key_shape_matches_default_rng(seed):
    """The engine's minibatch order: default_rng([seed, _BATCH, t, cid, epoch]).permutation(n), row by row."""
    rows = [(2, t, cid, epoch) for t in (0, 1, 499) for cid in (0, 3, 99) for epoch in range(5)]
    sizes = [14, 1, 0, 17, 100, 13] * (len(rows) // 6) + [14] * (len(rows) % 6)
    got = ops.seeded_permutations(seed, np.array(rows), sizes)
    offset = 0
    for row, n in zip(rows, sizes, strict=True):
        expected = np.random.default_rng([seed, *row]).permutation(n)
        assert np.array_equal(got[offset : offset + n], expected), (row, n)
        offset += n
    assert offset == got.shape[0]


def test_empty_inputs():
    for j in (0, 3):
        got = ops.seeded_permutations(5, np.zeros((0, j), np.int64), np.zeros(0, np.int64))
        assert got.dtype == np.int64 and got.shape == (0,)
    got = ops.seeded_permutations(5, np.zeros((3, 2), np.int64), [0, 0, 0])
    assert got.shape == (0,)


def test_seed_only_rows_equal_default_rng_of_the_seed():
    got = ops.seeded_permutations(2**70 + 9, np.zeros((2, 0), np.int64), [10, 33])
    assert np.array_equal(got[:10], np.random.default_rng(2**70 + 9).permutation(10))
    assert np.array_equal(got[10:], np.random.default_rng(2**70 + 9).permutation(33))


def test_key_and_size_containers():
    """Lists, uint32/int32/uint64 arrays, numpy integer seeds and strided views give the same result."""
    keys, sizes = random_rows(30, 3, 50, 4)
    expected = reference.seeded_permutations(11, keys, sizes)
    wide = np.zeros((30, 6), np.int64)
    wide[:, ::2] = keys
    for k, n, s in [
        (keys.tolist(), sizes.tolist(), 11),
        (keys.astype(np.uint32), sizes.astype(np.int32), np.uint8(11)),
        (keys.astype(np.uint64), sizes.astype(np.uint64), np.int64(11)),
        (wide[:, ::2], sizes[::-1][::-1], 11),
        (np.asfortranarray(keys), sizes, 11),
    ]:
        assert np.array_equal(ops.seeded_permutations(s, k, n), expected)


def test_thread_count_does_not_change_the_result():
    keys, sizes = random_rows(10_000, 4, 40, 9)  # many chunks of rows, enough work for the pool
    before = pyfedkern.get_num_threads()
    try:
        pyfedkern.set_num_threads(1)
        one = ops.seeded_permutations(3, keys, sizes)
        pyfedkern.set_num_threads(2)
        with pool_wakes(True):
            two = ops.seeded_permutations(3, keys, sizes)
    finally:
        pyfedkern.set_num_threads(before)
    assert np.array_equal(one, two)
    assert np.array_equal(one, reference.seeded_permutations(3, keys, sizes))


@pytest.mark.parametrize(
    ("seed", "keys", "sizes", "error", "name"),
    [
        (-1, [[1]], [3], ValueError, "seed"),
        (1.0, [[1]], [3], TypeError, "seed"),
        (True, [[1]], [3], TypeError, "seed"),
        ("7", [[1]], [3], TypeError, "seed"),
        (1, [[-1]], [3], ValueError, "keys"),
        (1, [[2**32]], [3], ValueError, "keys"),
        (1, [[2**70]], [3], TypeError, "keys"),
        (1, [[1.0]], [3], TypeError, "keys"),
        (1, [[True]], [3], TypeError, "keys"),
        (1, [1, 2], [3, 3], ValueError, "keys"),
        (1, [[1, 2], [3]], [3, 3], ValueError, "keys"),
        (1, [[1]], [-1], ValueError, "sizes"),
        (1, [[1]], [2**32 + 1], ValueError, "sizes"),
        (1, [[1]], [3.0], TypeError, "sizes"),
        (1, [[1]], [[3]], ValueError, "sizes"),
        (1, [[1]], 3, ValueError, "sizes"),
        (1, [[1], [2]], [3], ValueError, "sizes"),
    ],
)
def test_bad_input_names_the_argument(seed, keys, sizes, error, name):
    with pytest.raises(error, match=name):
        ops.seeded_permutations(seed, keys, sizes)


def test_native_rejects_out_of_range_rows():
    """The kernel checks what it reads even when called without the Python layer's validation."""
    out = np.empty(8, np.int64)
    keys = np.array([[1]], np.int64)
    for key, size, name in [(1, -1, "sizes"), (1, 2**32 + 1, "sizes"), (-5, 2, "keys"), (2**32, 2, "keys")]:
        keys[0, 0] = key
        sizes = np.array([size], np.int64)
        with pytest.raises(ValueError, match=name):
            native().seeded_permutations([1], keys.ctypes.data, 1, 1, sizes.ctypes.data, out.ctypes.data)
    with pytest.raises(ValueError, match="seed_words"):
        native().seeded_permutations([], keys.ctypes.data, 1, 1, sizes.ctypes.data, out.ctypes.data)
