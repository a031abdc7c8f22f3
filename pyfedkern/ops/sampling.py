"""Seeded index sampling that gives NumPy's random permutations bit for bit, many generators in one native call.

:func:`seeded_permutations` returns, for each row r, exactly
``np.random.default_rng([seed, *keys[r]]).permutation(sizes[r])``: the native kernel runs NumPy's own chain
(SeedSequence → PCG64 → ``Generator.permutation``'s Fisher–Yates shuffle) instead of building one Python
``Generator`` per row, which costs about 10 µs each (hashing the seed and seeding PCG64 dominate; shuffling ~14
items is ~1 µs). Simulations that draw every client's minibatch order from such generators keep their exact
sampling while paying a fraction of that.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from pyfedkern import _arrays
from pyfedkern._runtime import native

#: largest size per row (bigger rows would make NumPy draw 64-bit bounded integers, which the kernel does not do)
MAX_SIZE = 2**32


def seed_words(seed: Any) -> list[int]:
    """The little-endian 32-bit words NumPy's SeedSequence reads from a non-negative int (0 → [0])."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be a non-negative integer, got {type(seed).__qualname__}")
    value = int(seed)
    if value < 0:
        raise ValueError(f"seed must be non-negative, got {value}")
    words = [value & 0xFFFFFFFF]
    value >>= 32
    while value:
        words.append(value & 0xFFFFFFFF)
        value >>= 32
    return words


def _integers(values: Any, name: str, ndim: int, low: int, high: int) -> np.ndarray:
    """A C-contiguous int64 copy of an integer array-like of ``ndim`` dimensions with values in [low, high]."""
    try:
        arr = _arrays.host_array(values, name)
    except ValueError as exc:  # ragged nested lists
        raise ValueError(f"{name} must be a rectangular integer array: {exc}") from None
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size == 0 and arr.dtype.kind == "f":  # an empty list becomes float64: accept it as empty integers
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < low or hi > high:
            bad = lo if lo < low else hi
            raise ValueError(f"{name} holds {bad}, expected values in [{low}, {high}]")
    return np.ascontiguousarray(arr, dtype=np.int64)


def seeded_permutations(seed: Any, keys: Any, sizes: Any) -> np.ndarray:
    """Row r's permutation ``np.random.default_rng([seed, *keys[r]]).permutation(sizes[r])``, all rows concatenated.

    Args:
        seed: non-negative int of any size (NumPy reads it as its little-endian 32-bit words).
        keys: integer array-like [k, j], each key in [0, 2**32) (one 32-bit entropy word each); j may be 0.
        sizes: integer array-like [k], each in [0, 2**32].

    Returns:
        int64 numpy array of length Σ sizes: the permutation of row r is at ``[offsets[r], offsets[r] + sizes[r])``
        with ``offsets = cumsum(sizes) - sizes``. Rows run in parallel on pyfedkern's CPU threads.
    """
    words = seed_words(seed)
    key_rows = _integers(keys, "keys", 2, 0, 2**32 - 1)
    n = _integers(sizes, "sizes", 1, 0, MAX_SIZE)
    if n.shape[0] != key_rows.shape[0]:
        raise ValueError(f"sizes has {n.shape[0]} entries but keys has {key_rows.shape[0]} rows")
    out = np.empty(int(n.sum()), dtype=np.int64)
    rows, key_len = key_rows.shape
    native().seeded_permutations(words, key_rows.ctypes.data, rows, key_len, n.ctypes.data, out.ctypes.data)
    return out
