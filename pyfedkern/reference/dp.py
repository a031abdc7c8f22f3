"""Reference differential-privacy ops: the clipped sum in float64, and the noise generator in plain NumPy.

The generator is :func:`pyfedkern.ops.gaussian_noise_`'s, step by step: ARS-5 (AES rounds) keyed by the seed, its
counter (block, stream), the blocks' 32-bit words turned into normals by Box-Muller (two words, two normals), whose
logarithm, sine and cosine are polynomials of +, −, ×, ÷ and √ evaluated in the output's precision, so the op must
give the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pyfedkern.reference._xp import cast_like, to_float64

_MASK64 = (1 << 64) - 1
_WEYL_LO, _WEYL_HI = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B  # ARS's round-key increments
_ARS_ROUNDS = 5


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


def _gf_mul(a: int, b: int) -> int:
    """a·b in AES's field GF(2^8) (x^8 + x^4 + x^3 + x + 1)."""
    p = 0
    for _ in range(8):
        if b & 1:
            p ^= a
        a = ((a << 1) ^ (0x1B if a & 0x80 else 0)) & 0xFF
        b >>= 1
    return p


def _sbox() -> np.ndarray:
    """AES's S-box: the field inverse (0 for 0; through powers of the generator 3), then the affine map."""
    power = [1]
    for _ in range(254):
        power.append(_gf_mul(power[-1], 3))
    log = {v: i for i, v in enumerate(power)}
    out = []
    for x in range(256):
        inv = power[(255 - log[x]) % 255] if x else 0
        rot = [((inv << n) | (inv >> (8 - n))) & 0xFF for n in range(1, 5)]
        out.append(inv ^ rot[0] ^ rot[1] ^ rot[2] ^ rot[3] ^ 0x63)
    return np.array(out, np.uint8)


SBOX = _sbox()
_TIMES2 = np.array([_gf_mul(x, 2) for x in range(256)], np.uint8)
_SHIFT_ROWS = np.array([r + 4 * ((c + r) % 4) for c in range(4) for r in range(4)])  # byte r + 4c ← this byte


def aes_round(state: np.ndarray, round_key: np.ndarray, last: bool = False) -> np.ndarray:
    """One AES encryption round on [n, 16] uint8 states (byte r + 4c = row r, column c): ShiftRows, SubBytes,
    MixColumns (not in the ``last`` round), then ``round_key`` ([16] uint8) added — AES-NI's aesenc/aesenclast."""
    t = SBOX[state[:, _SHIFT_ROWS]]
    if not last:
        a = t.reshape(-1, 4, 4)  # [block, column, row]
        a2 = _TIMES2[a]
        a3 = a2 ^ a
        rows = [
            a2[..., 0] ^ a3[..., 1] ^ a[..., 2] ^ a[..., 3],
            a[..., 0] ^ a2[..., 1] ^ a3[..., 2] ^ a[..., 3],
            a[..., 0] ^ a[..., 1] ^ a2[..., 2] ^ a3[..., 3],
            a3[..., 0] ^ a[..., 1] ^ a[..., 2] ^ a2[..., 3],
        ]
        t = np.stack(rows, axis=-1).reshape(-1, 16)
    return t ^ round_key


def ars4x32_5(blocks: np.ndarray, seed: int, stream: int) -> np.ndarray:
    """ARS-5 of counters (block, stream) under key ``seed``: [n, 4] uint32 words for n uint64 blocks.

    The 128-bit counter (low half: the block, high half: the stream) XOR the key (seed, 0), four AES rounds and a last
    one, under round keys that add (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B) to the 64-bit halves each round."""
    blocks = np.asarray(blocks, dtype=np.uint64)
    ctr = np.stack([blocks, np.full_like(blocks, stream)], axis=1).astype("<u8")
    state = ctr.view(np.uint8).reshape(-1, 16)
    for r in range(_ARS_ROUNDS + 1):
        key = np.array([(seed + r * _WEYL_LO) & _MASK64, (r * _WEYL_HI) & _MASK64], "<u8").view(np.uint8)
        state = state ^ key if r == 0 else aes_round(state, key, last=r == _ARS_ROUNDS)
    return np.ascontiguousarray(state).view("<u4").reshape(-1, 4).astype(np.uint32)


def _poly(coefficients: list[float], q: np.ndarray, f: type) -> np.ndarray:
    """Σ_j c_j q^j by second-order Horner: even and odd coefficients in q², then even + q·odd (the kernel's order)."""
    c = [f(v) for v in coefficients]
    q2 = q * q
    even = np.full_like(q, c[(len(c) - 1) // 2 * 2])
    for j in range((len(c) - 1) // 2 * 2 - 2, -1, -2):
        even = even * q2 + c[j]
    odd = np.full_like(q, c[(len(c) - 2) // 2 * 2 + 1])
    for j in range((len(c) - 2) // 2 * 2 - 1, 0, -2):
        odd = odd * q2 + c[j]
    return even + q * odd


def _normals(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Box-Muller of the words a, b in ``dtype``: sqrt(−2 ln u1)·(cos, sin)(2π u2)."""
    f = np.dtype(dtype).type
    if f is np.float32:
        bits, log_terms, sin_terms, cos_terms = 24, 5, 5, 5
        uint, mant, bias, half_root = np.uint32, 23, 127, 0x3F3504F3
    else:
        bits, log_terms, sin_terms, cos_terms = 32, 12, 9, 10
        uint, mant, bias, half_root = np.uint64, 52, 1023, 0x3FE6A09E667F3BCD
    n1 = ((a.astype(np.uint64) >> np.uint64(32 - bits)) + np.uint64(1)).astype(dtype)  # u1 = n1 / 2^bits in (0, 1]
    # u1 = m·2^e, m in [√½, √2): adding the bits of 1 minus those of √½ carries into the exponent when n1's
    # significand is at least √2's
    shifted = n1.view(uint) + uint((bias << mant) - half_root)
    e = ((shifted >> uint(mant)).astype(np.int64) - (bias + bits)).astype(dtype)
    m = ((shifted & uint((1 << mant) - 1)) + uint(half_root)).view(dtype)
    s = (m - f(1)) / (m + f(1))  # ln m = 2 atanh(s)
    r2 = e * f(-2 * 0.6931471805599453) + (s * f(-4)) * _poly([1 / (2 * j + 1) for j in range(log_terms)], s * s, f)
    r = np.sqrt(r2)
    n2 = b.astype(np.uint64) >> np.uint64(32 - bits)  # u2 = n2 / 2^bits in [0, 1)
    quadrant = n2 >> np.uint64(bits - 2)
    frac = n2 & np.uint64((1 << (bits - 2)) - 1)
    swap = frac > np.uint64(1 << (bits - 3))
    g = np.where(swap, np.uint64(1 << (bits - 2)) - frac, frac)
    x = g.astype(dtype) * f(1.5707963267948966 / (1 << (bits - 2)))
    x2 = x * x
    sx = x * _poly([(-1.0 if j % 2 else 1.0) / math.factorial(2 * j + 1) for j in range(sin_terms)], x2, f)
    pc = _poly([(-1.0 if j % 2 else 1.0) / math.factorial(2 * j) for j in range(cos_terms)], x2, f)
    sin_q, cos_q = np.where(swap, pc, sx), np.where(swap, sx, pc)
    sin_t = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [sin_q, cos_q, -sin_q], -cos_q)
    cos_t = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [cos_q, -sin_q, -cos_q], sin_q)
    return r * cos_t, r * sin_t


def standard_normals(d: int, seed: int, *keys: int, dtype: Any = np.float64) -> np.ndarray:
    """The generator's first d standard normals for (seed, ``*keys``), [d] of ``dtype`` (float32 or float64).

    Word j of the stream (word j mod 4 of block j // 4) feeds element j: in each group of 2L elements (L = 8 for
    float32, 4 for float64), the first L words are u1 and the next L u2 of L Box-Muller pairs, whose cosine normals
    are the group's first L elements and sine normals the next L."""
    lanes = 8 if np.dtype(dtype) == np.float32 else 4
    blocks = np.arange(-(-d // (2 * lanes)) * 2 * lanes // 4, dtype=np.uint64)
    w = ars4x32_5(blocks, seed, stream_key(tuple(keys))).reshape(-1, 2, lanes)
    z_cos, z_sin = _normals(w[:, 0], w[:, 1], dtype)
    return np.stack([z_cos, z_sin], axis=1).reshape(-1)[:d]


def gaussian_noise_(x: Any, std: float, seed: int, *keys: int) -> Any:
    """x ← x + std·z (a 1-D float32 or float64 array) with z = ``standard_normals``, in x's precision."""
    host = x if isinstance(x, np.ndarray) else x.detach().cpu().numpy()
    z = standard_normals(host.shape[0], seed, *keys, dtype=host.dtype)
    x[...] = _like_library(host + host.dtype.type(std) * z, x)
    return x
