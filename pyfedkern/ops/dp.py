"""Differential-privacy ops: the clipped sum of k update rows (central DP's aggregation) and Gaussian noise from a
counter-based generator (central DP's noise on the round's sum, DP-SGD's on a step's gradient).

- :func:`clip_accumulate`: ``Σ_k min(1, C/‖u_k − c‖)·(u_k − c)`` in two passes over the rows (their norms, then the
  scaled sum), with the norms if asked. Norms are summed in float64; the sum accumulates in the rows' precision
  (float32 for 16-bit storage). Rows are read in place (any strides).
- :func:`gaussian_noise_`: ``x += std·z`` in one pass, z standard normal from ARS-5 (Salmon et al. 2011: five AES
  rounds of a 128-bit counter, keyed by the seed, the counter the block index and a 64-bit stream derived from the
  keys) and Box-Muller with polynomial logarithm, sine and cosine: the same numbers for a given (seed, keys, length,
  dtype) on every machine, every vector ISA, with or without AES instructions (AES-NI, VAES, or portable tables on a
  CPU without them) and for every thread count, and equal bit for bit to :func:`pyfedkern.reference.gaussian_noise_`.
  float32 draws take each word's top 24 bits (normals reach ±5.8), float64 draws all 32 bits (±6.7); a normal beyond
  that has probability below 1e-8. The logarithm, sine and cosine agree with libm to 2e-7 (float32) and 1e-15
  (float64). Five rounds is where ARS's authors found it free of failures in TestU01's BigCrush (Intel's MKL ships
  ARS-5; their own library defaults to seven, for margin).
  It is a statistical generator, not a cryptographic one: fine for simulations and DP research, but a deployment
  whose privacy must hold against an adversary who could predict the noise needs a cryptographically secure source
  (the role of Opacus's "secure mode").

Both give the same bits for any number of CPU threads. They are not differentiable: torch inputs that require grad
are refused while grad mode is on. On CUDA (torch or cupy) no kernel is run yet: clip_accumulate runs torch's ops,
and gaussian_noise_ draws the same numbers on the host and adds them on the device (a host-to-device copy).
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np

from pyfedkern import _arrays
from pyfedkern._runtime import native
from pyfedkern.ops import _declare
from pyfedkern.ops.aggregate import _check_output, _update_rows

A = TypeVar("A")

_MASK64 = (1 << 64) - 1


def clip_accumulate(
    updates: Any,
    clip: float,
    out: A | None = None,
    norms_out: Any = None,
    *,
    center: Any = None,
    return_norms: bool = False,
) -> A | tuple[A, Any]:
    """Σ_k s_k·(u_k − c) with s_k = min(1, clip/‖u_k − c‖): each row clipped to ℓ2 norm ``clip``, then summed.

    Args:
        updates: a [K, d] array or a list of K 1-D arrays of length d (numpy, torch CPU/CUDA or cupy; float32,
            float64, float16 or bfloat16; one library, device and dtype).
        clip: C > 0, or ``math.inf`` for the plain sum. A row of norm 0 is kept as it is; a row with a non-finite
            value gives a non-finite sum.
        out: optional [d] output (updates' library, device and dtype), not overlapping the updates.
        norms_out: optional [K] output for the norms ‖u_k − c‖ (updates' library, device and dtype).
        center: optional [d] vector c subtracted from every row before its norm (the global model, when the rows are
            the clients' models); 0 when None.
        return_norms: return the norms too (in a new array unless ``norms_out`` is given).

    Returns:
        ``out`` (or a new [d] array), or ``(sum, norms)`` when ``norms_out`` is given or ``return_norms`` is set.
    """
    _declare.refuse_grad("clip_accumulate", ("updates", "center"), updates, center)
    clip = _clip_value(clip)
    if _declare.operator_needed(updates, center, out, norms_out):
        import torch

        stack = updates if _declare.is_tensor(updates) else torch.stack(list(updates))  # the operator takes [K, d]
        total, norms = _declare.torch_op("clip_accumulate")(stack, clip, center)
        if out is not None:
            out.copy_(total)
            total = out
        if norms_out is not None:
            norms_out.copy_(norms)
            norms = norms_out
        return (total, norms) if return_norms or norms_out is not None else total
    return _clip_accumulate(updates, clip, out, norms_out, center, return_norms or norms_out is not None)


def _clip_value(clip: Any) -> float:
    if isinstance(clip, bool) or not isinstance(clip, (int, float, np.integer, np.floating)):
        raise TypeError(f"clip must be a real number, got {type(clip).__qualname__}")
    clip = float(clip)
    if not clip > 0:
        raise ValueError(f"clip must be > 0 (math.inf: no clipping), got {clip}")
    return clip


def _clip_operands(updates: Any, center: Any) -> tuple[Any, Any]:
    """(the updates' RowSet, center's ArrayRef or None), checked: the direct path's and the fake function's checks."""
    rows = _update_rows(updates)
    c_ref = None
    if center is not None:
        c_ref = _arrays.describe(center, "center")
        _arrays.check_same(c_ref, rows.first, "center", "updates")
        if c_ref.shape != (rows.d,):
            raise ValueError(f"center must have shape ({rows.d},), got {c_ref.shape}")
    return rows, c_ref


def _clip_accumulate(updates: Any, clip: float, out: Any, norms_out: Any, center: Any, with_norms: bool) -> Any:
    """The direct path of :func:`clip_accumulate` (any library)."""
    rows, c_ref = _clip_operands(updates, center)
    first, d, k = rows.first, rows.d, rows.count
    if out is None:
        out = _arrays.empty_like_lib(first, (d,))
        out_ref = _arrays.describe(out, "out")
    else:
        out_ref = _check_output(out, "out", first, d)
        if any(out_ref.overlaps(r) for r in ([rows.stack] if rows.stack is not None else rows.refs)):
            raise ValueError("out overlaps the updates; pass a separate output array")
        if c_ref is not None and out_ref.overlaps(c_ref):
            raise ValueError("out overlaps center; pass a separate output array")
    norms_ref = None
    if norms_out is not None:
        norms_ref = _arrays.describe(norms_out, "norms_out")
        _arrays.check_same(norms_ref, first, "norms_out", "updates")
        if norms_ref.shape != (k,):
            raise ValueError(f"norms_out must have shape ({k},), got {norms_ref.shape}")
        _arrays.check_output(norms_ref, "norms_out")
    if first.device >= 0:
        return _clip_accumulate_torch(updates, clip, out, norms_out, center, with_norms)
    norms = np.empty(k, dtype=np.float64)
    native().clip_accumulate(
        first.dtype,
        d,
        out_ref.ptr,
        out_ref.strides[0],
        *rows.native_args(),
        0 if c_ref is None else c_ref.ptr,
        0 if c_ref is None else c_ref.strides[0],
        clip,
        norms,
    )
    _arrays.mark_written(out_ref)
    if not with_norms:
        return out
    if norms_out is None:
        norms_out = _arrays.empty_like_lib(first, (k,))
        norms_ref = _arrays.describe(norms_out, "norms_out")
    _copy_host(norms, norms_ref.obj)  # (a memoryview's numpy array)
    _arrays.mark_written(norms_ref)
    return out, norms_out


def _copy_host(values: np.ndarray, dest: Any) -> None:
    """dest[...] = values (float64 host values into a host array of any library)."""
    if isinstance(dest, np.ndarray):
        dest[...] = values
    else:  # torch on the CPU
        import torch

        with torch.no_grad():
            dest.copy_(torch.from_numpy(values))


def _as_torch(x: Any) -> Any:
    """x as a torch tensor sharing its memory (cupy through DLPack)."""
    import torch

    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def _clip_accumulate_torch(updates: Any, clip: float, out: Any, norms_out: Any, center: Any, with_norms: bool) -> Any:
    """:func:`clip_accumulate` on a GPU with torch's ops (float64 norms, the sum in the rows' accumulation dtype)."""
    import torch

    stack = _as_torch(updates) if _arrays.is_array(updates) else torch.stack([_as_torch(u) for u in updates])
    acc = _declare.accumulation_dtype(stack)
    with torch.no_grad():
        diffs = stack.to(acc) if center is None else stack.to(acc) - _as_torch(center).to(acc)
        norms = torch.linalg.vector_norm(diffs.double(), dim=1)
        scales = torch.where(norms <= clip, torch.ones_like(norms), clip / norms)
        total = (scales.to(acc) @ diffs).to(stack.dtype)
        if out is not None:
            _as_torch(out).copy_(total)
        if norms_out is not None:
            _as_torch(norms_out).copy_(norms)
    like = updates if _arrays.is_array(updates) else updates[0]
    result = out if out is not None else _like(total, like)
    if not with_norms:
        return result
    return result, norms_out if norms_out is not None else _like(norms.to(stack.dtype), like)


def _like(t: Any, like: Any) -> Any:
    """A torch tensor as an array of like's library (cupy through DLPack)."""
    import torch

    if isinstance(like, torch.Tensor):
        return t
    import cupy

    return cupy.from_dlpack(t)


def _clip_accumulate_fake(updates: Any, clip: float, center: Any) -> Any:
    _clip_operands(updates, center)
    return updates.new_empty(updates.shape[1:]), updates.new_empty(updates.shape[:1])


@_declare.declare(
    "clip_accumulate",
    "(Tensor updates, float clip, Tensor? center) -> (Tensor, Tensor)",
    fake=_clip_accumulate_fake,
)
def _clip_accumulate_native(updates: Any, clip: float, center: Any) -> Any:
    return _clip_accumulate(updates, clip, None, None, center, True)


def stream_key(keys: tuple[int, ...]) -> int:
    """The generator's 64-bit stream for ``keys``: SplitMix64's mixer chained over the number of keys and the keys."""

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    h = mix(len(keys))
    for k in keys:
        h = mix(h ^ k)
    return h


def _key(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {type(value).__qualname__}")
    value = int(value)
    if not 0 <= value <= _MASK64:
        raise ValueError(f"{name} must be an integer from 0 to 2^64 - 1, got {value}")
    return value


def gaussian_noise_(x: A, std: float, seed: int, *keys: int) -> A:
    """In place ``x += std·z``, z [d] standard normal numbers of the stream (``seed``, ``*keys``), in one pass.

    Args:
        x: a 1-D float32 or float64 array (numpy, torch CPU/CUDA or cupy), any stride, updated in place.
        std: the noise's standard deviation, finite and ≥ 0 (0 leaves x unchanged, to the bit).
        seed: the generator's key, an integer in [0, 2^64).
        keys: integers in [0, 2^64) naming the stream (round, client, step, ...): each (seed, keys) gives its own
            independent numbers, element i of x always the stream's i-th.

    Returns:
        ``x``.
    """
    _declare.refuse_grad("gaussian_noise_", ("x", "std"), x, std)
    std = _arrays.host_scalar(std, "std")
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    seed = _key(seed, "seed")
    stream = stream_key(tuple(_key(k, f"keys[{i}]") for i, k in enumerate(keys)))
    if _declare.operator_needed(x):
        signed = lambda v: v - (1 << 64) if v >= 1 << 63 else v  # noqa: E731 (the schema's int is int64)
        _declare.torch_op("gaussian_noise_")(x, std, signed(seed), signed(stream))
        return x
    return _gaussian_noise(x, std, seed, stream)


def _noise_target(x: Any) -> Any:
    """x's ArrayRef, checked (a writeable, non-empty float32/float64 vector): the direct path's and the fake
    function's checks."""
    ref = _arrays.describe(x, "x")
    if len(ref.shape) != 1:
        raise ValueError(f"x must be a 1-D vector, got shape {ref.shape}")
    if ref.dtype not in ("float32", "float64"):
        raise TypeError(f"x has dtype {ref.dtype}; expected float32 or float64")
    if ref.shape[0] == 0:
        raise ValueError("x is empty (d = 0)")
    _arrays.check_output(ref, "x")
    return ref


def _gaussian_noise(x: Any, std: float, seed: int, stream: int) -> Any:
    """The direct path of :func:`gaussian_noise_` (any library)."""
    ref = _noise_target(x)
    if std == 0:
        return x
    if ref.device >= 0:  # the same numbers, drawn on the host
        z = np.zeros(ref.shape[0], dtype=ref.dtype)
        native().gaussian_noise(ref.dtype, z.shape[0], z.ctypes.data, 1, 1.0, seed, stream)
        t = _as_torch(x)
        import torch

        with torch.no_grad():
            t.add_(torch.from_numpy(z).to(t.device), alpha=std)
        _arrays.mark_written(ref)
        return x
    native().gaussian_noise(ref.dtype, ref.shape[0], ref.ptr, ref.strides[0], std, seed, stream)
    _arrays.mark_written(ref)
    return x


def _gaussian_noise_fake(x: Any, std: float, seed: int, stream: int) -> None:
    _noise_target(x)


@_declare.declare(
    "gaussian_noise_",
    "(Tensor(a!) x, float std, int seed, int stream) -> ()",
    fake=_gaussian_noise_fake,
    mutates=("x",),
)
def _gaussian_noise_native(x: Any, std: float, seed: int, stream: int) -> None:
    _gaussian_noise(x, std, seed & _MASK64, stream & _MASK64)


__all__ = ["clip_accumulate", "gaussian_noise_", "stream_key"]
