"""Reference differential-privacy ops: the clipped sum in float64, and the noise generator in plain NumPy.

The generator is :func:`pyfedkern.ops.gaussian_noise_`'s, step by step: Philox4x32-10 keyed by the seed, its counter
(block, stream), each block's four 32-bit words turned into four normals by Box-Muller, whose logarithm, sine and
cosine are polynomials of +, −, ×, ÷ and √ evaluated in the output's precision, so the op must give the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pyfedkern.reference._xp import cast_like, to_float64

_MASK64 = (1 << 64) - 1
_M0, _M1, _W0, _W1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
_BLOCKS = 64  # Philox blocks per 256 elements


def clip_accumulate(
    updates: Any, clip: float, out: Any = None, norms_out: Any = None, *, center: Any = None, return_norms: bool = False
) -> Any:
    """Σ_k s_k·(u_k − c) with s_k = min(1, clip/‖u_k − c‖), in float64 (c = ``center``, or 0); with ``norms_out``
    or ``return_norms``, (that sum, the norms ‖u_k − c‖)."""
    rows = [to_float64(updates[k]) for k in range(len(updates))]
    diffs = rows if center is None else [u - to_float64(center) for u in rows]
    norms = [float((v * v).sum()) ** 0.5 for v in diffs]
    total = diffs[0] * 0.0
    for v, n in zip(diffs, norms, strict=True):
        total = total + v * (1.0 if n <= clip else clip / n)
    result = cast_like(total, updates[0])
    if out is not None:
        out[...] = result
        result = out
    if norms_out is None and not return_norms:
        return result
    values = cast_like(_like_library(np.array(norms), updates[0]), updates[0])
    if norms_out is not None:
        norms_out[...] = values
        values = norms_out
    return result, values


def _like_library(values: np.ndarray, like: Any) -> Any:
    """A NumPy array as an array of like's library on like's device."""
    if isinstance(like, np.ndarray):
        return values
    import torch

    return torch.from_numpy(values).to(like.device)


def stream_key(keys: tuple[int, ...]) -> int:
    """The 64-bit stream of the generator's counter for ``keys`` (SplitMix64's mixer chained over the keys)."""

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    h = mix(len(keys))
    for k in keys:
        h = mix(h ^ k)
    return h


def philox4x32_10(blocks: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """Philox4x32-10 of counters (block, stream) under key ``seed``: [4, n] uint32 words for n uint64 blocks."""
    blocks = np.asarray(blocks, dtype=np.uint64)
    lo32 = np.uint64(0xFFFFFFFF)
    c = [blocks & lo32, blocks >> np.uint64(32)]
    c += [np.full_like(blocks, stream & 0xFFFFFFFF), np.full_like(blocks, stream >> 32)]
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        p0 = np.uint64(_M0) * c[0]
        p1 = np.uint64(_M1) * c[2]
        c = [
            (p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0),
            p1 & lo32,
            (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
            p0 & lo32,
        ]
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return np.stack(c).astype(np.uint32)


def _normals(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Box-Muller of the words a, b in ``dtype``: sqrt(−2 ln u1)·(cos, sin)(2π u2)."""
    f = np.dtype(dtype).type
    bits, log_terms, sin_terms, cos_terms = (24, 6, 5, 6) if f is np.float32 else (32, 12, 9, 10)
    n1 = (a.astype(np.uint64) >> np.uint64(32 - bits)) + np.uint64(1)  # u1 = n1 / 2^bits in (0, 1]
    m, e = np.frexp(n1.astype(dtype) * f(1.0 / 2**bits))  # u1, exactly
    low = m < f(0.7071067811865476)
    m = np.where(low, m + m, m)
    e = np.where(low, e - 1, e).astype(dtype)
    s = (m - f(1)) / (m + f(1))
    s2 = s * s
    t = np.full_like(s, f(1.0 / (2 * log_terms - 1)))
    for j in range(log_terms - 2, -1, -1):
        t = t * s2 + f(1.0 / (2 * j + 1))
    ln_u1 = e * f(0.6931471805599453) + (s + s) * t
    r = np.sqrt(f(-2) * ln_u1)
    n2 = b.astype(np.uint64) >> np.uint64(32 - bits)  # u2 = n2 / 2^bits in [0, 1)
    quadrant = n2 >> np.uint64(bits - 2)
    frac = n2 & np.uint64((1 << (bits - 2)) - 1)
    swap = frac > np.uint64(1 << (bits - 3))
    g = np.where(swap, np.uint64(1 << (bits - 2)) - frac, frac)
    x = g.astype(dtype) * f(1.5707963267948966 / (1 << (bits - 2)))
    x2 = x * x
    ps = np.zeros_like(x)
    for j in range(sin_terms - 1, -1, -1):
        ps = ps * x2 + f((-1.0 if j % 2 else 1.0) / math.factorial(2 * j + 1))
    pc = np.zeros_like(x)
    for j in range(cos_terms - 1, -1, -1):
        pc = pc * x2 + f((-1.0 if j % 2 else 1.0) / math.factorial(2 * j))
    sx = x * ps
    sin_q, cos_q = np.where(swap, pc, sx), np.where(swap, sx, pc)
    sin_t = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [sin_q, cos_q, -sin_q], -cos_q)
    cos_t = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [cos_q, -sin_q, -cos_q], sin_q)
    return r * cos_t, r * sin_t


def standard_normals(d: int, seed: int, *keys: int, dtype: Any = np.float64) -> np.ndarray:
    """The generator's first d standard normals for (seed, ``*keys``), [d] of ``dtype`` (float32 or float64).

    Element i takes lane (i mod 256) // 64 of block 64·(i // 256) + i mod 64; a block's words (w0, w1) give lanes
    0 and 1 (cos, sin), (w2, w3) lanes 2 and 3."""
    chunks = -(-d // (4 * _BLOCKS))
    blocks = np.arange(chunks * _BLOCKS, dtype=np.uint64)
    w = philox4x32_10(blocks, seed, stream_key(tuple(keys)))
    z0, z1 = _normals(w[0], w[1], dtype)
    z2, z3 = _normals(w[2], w[3], dtype)
    lanes = np.stack([z0, z1, z2, z3]).reshape(4, chunks, _BLOCKS)  # [lane, chunk, block]
    return lanes.transpose(1, 0, 2).reshape(-1)[:d]


def gaussian_noise_(x: Any, std: float, seed: int, *keys: int) -> Any:
    """x ← x + std·z (a 1-D float32 or float64 array) with z = ``standard_normals``, in x's precision."""
    host = x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()
    z = standard_normals(host.shape[0], seed, *keys, dtype=host.dtype)
    x[...] = _like_library(host + host.dtype.type(std) * z, x)
    return x
