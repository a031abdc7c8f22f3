"""Herding ops of BHerd (arXiv 2403.16557): greedy gradient selection (Algorithm 2) and GraB balancing (Algorithm 4).

How :func:`herding_order` / :func:`herding_select` compute (the Gram form of docs/bherd.md §2):

1. **Gram matrix of the centred gradients**, G = Z Zᵀ with z_λ = y_λ − μ, computed in the Python layer with the
   caller's own library matmul (MKL/OpenBLAS for numpy and torch on the CPU, cuBLAS for torch/cupy on the GPU).
   The columns are processed in chunks: each chunk is shifted explicitly by the first row (y'_λ = y_λ − y_1, in
   the GEMM dtype: float64 for float64 gradients, float32 otherwise) and multiplied, the chunk products being
   summed into a float64 G'; then G = G' − r1ᵀ − 1rᵀ + m with r = G'1/τ, m = 1ᵀG'1/τ². On the CPU one batched
   GEMM call takes several chunks at once (:func:`_chunk_plan`), so the library runs whole chunk products in
   parallel rather than splitting each small [τ, c]·[c, τ] product between threads, and the call count stays low.
   The shift keeps the mean of the shifted rows as small as the deviations, so this identity does not suffer the
   cancellation the raw identity has when ‖μ‖ ≫ ‖z‖ (docs/bherd.md §2). One pass over the [τ, d] buffer, no
   separate mean pass, compute-bound.
   On the GPU, TF32 matmul (``torch.backends.cuda.matmul.allow_tf32``) lowers the precision of G; leave it off.
2. **Greedy loop** in native code (``pyfedkern._C.herding_greedy``; the CPU thread pool over clients; on the GPU one
   warp per client with its state in registers for τ ≤ 512, one block per client above):
   ‖s + z_m‖² = ‖s‖² + 2c_m + G_mm with c_m = ⟨s, z_m⟩, so each step is an argmin over the remaining m of
   2c_m + G_mm followed by c += G[j, :]. O(k·τ) per client, no τ³ term. Ties go to the lowest
   index; a score ties with the minimum when it is within the rounding scale of the Gram form,
   ρ·(G_mm + 2·sqrt(G_mm·Σ_{j picked} G_jj)) with ρ = max(8, √d) ulps of the GEMM dtype (:func:`tie_rel_tol`), so
   exact duplicate rows tie however the library's GEMM rounded their entries (a multithreaded GEMM's blocked sums
   differ between duplicate rows by tens of ulps at d = 5000; for float64 data and d = 5000, ρ ≈ 1.6e-14).
3. **Masked row sum** in native code (``pyfedkern._C.herding_masked_sum``): the sum of the selected *raw* rows, in
   ascending row order (so with k = τ it does not depend on the order), float32 accumulation for 16-bit storage.

Gradients are given as one [τ, d] matrix, a [N, τ, d] stack (N clients with the same τ) or a list of N matrices of
different τ and the same d. Non-finite gradients (or squared norms that overflow) raise ValueError; this check
reads G on the host, the only synchronisation of a GPU call, made after all of the call's kernels are launched.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pyfedkern import _arrays
from pyfedkern._arrays import ArrayRef
from pyfedkern._runtime import native
from pyfedkern.ops import _declare

#: Shifted Gram chunking (elements = rows × columns). CPU: one chunk product is [τ, c]·[c, τ] with τ·c ≈ 2^18
#: (1 MiB of float32, within L2), and one batched GEMM call takes ≈ 2^20 elements of chunks (4 per call for one
#: client), which the library runs as whole products on separate threads (a lone product that small runs at a
#: fraction of the GEMM rate when split between threads). GPU: one call per chunk of ≈ 2^24 elements over all
#: clients (64 MiB), which keeps the number of launches small.
GRAM_CHUNK_ELEMENTS = {"cpu": 1 << 18, "gpu": 1 << 24}
GRAM_CALL_ELEMENTS_CPU = 1 << 20


def tie_rel_tol(dtype: str, d: int) -> float:
    """Relative rounding scale of Gram entries that are length-d dot products: max(8, √d) ulps of the GEMM dtype
    (float64 for float64 gradients, float32 otherwise)."""
    return max(8.0, math.sqrt(d)) * float(np.finfo(np.float64 if dtype == "float64" else np.float32).eps)


@dataclass
class _Clients:
    """The validated gradient matrices of N clients."""

    kind: str  # "single" ([τ, d]), "stack" ([N, τ, d]) or "list"
    objs: list[Any]  # per client [τ_i, d] (single/list), or the one [N, τ, d] stack
    refs: list[ArrayRef]  # one 2-D ref per client
    taus: list[int]
    d: int

    @property
    def lib(self) -> str:
        return self.refs[0].lib

    @property
    def first(self) -> ArrayRef:
        return self.refs[0]


def _matrix_ref(ref: ArrayRef, n: int) -> ArrayRef:
    """Client n of a 3-D stack as a 2-D ref."""
    return ArrayRef(
        ref.obj,
        ref.lib,
        ref.device,
        ref.dtype,
        ref.shape[1:],
        ref.strides[1:],
        ref.ptr + n * ref.strides[0] * ref.itemsize,
        ref.itemsize,
        ref.writeable,
    )


def _grads_array(grads: Any, name: str) -> ArrayRef:
    """The checked [τ, d] matrix or [N, τ, d] stack of gradients (not their values)."""
    ref = _arrays.describe(grads, name)
    _arrays.check_float_dtype(ref, name)
    if len(ref.shape) not in (2, 3):
        raise ValueError(
            f"{name} must be a [τ, d] matrix, a [N, τ, d] stack or a list of [τ_i, d] matrices, got shape {ref.shape}"
        )
    if len(ref.shape) == 3 and ref.shape[0] == 0:
        raise ValueError(f"{name} has no clients (shape {ref.shape})")
    _check_sizes(ref.shape[-2], ref.shape[-1], name)
    return ref


def _check_sizes(min_tau: int, d: int, name: str) -> None:
    if min_tau < 1:
        raise ValueError(f"{name} has a client with no gradients (τ = 0)")
    if d < 1:
        raise ValueError(f"{name} has empty gradients (d = 0)")


def _clients(grads: Any, name: str = "grads") -> _Clients:
    if _arrays.is_array(grads):
        ref = _grads_array(grads, name)
        if len(ref.shape) == 2:
            kind, refs, objs = "single", [ref], [ref.obj]
        else:
            kind, refs, objs = "stack", [_matrix_ref(ref, n) for n in range(ref.shape[0])], [ref.obj]
    elif isinstance(grads, Sequence) and not isinstance(grads, (str, bytes)):
        if len(grads) == 0:
            raise ValueError(f"{name} is an empty list: need at least one client")
        refs = [_arrays.describe(g, f"{name}[{n}]") for n, g in enumerate(grads)]
        _arrays.check_float_dtype(refs[0], f"{name}[0]")
        for n, r in enumerate(refs):
            if len(r.shape) != 2:
                raise ValueError(f"{name}[{n}] must be a 2-D [τ, d] matrix, got shape {r.shape}")
            if n:
                _arrays.check_same(r, refs[0], f"{name}[{n}]", f"{name}[0]")
                if r.shape[1] != refs[0].shape[1]:
                    raise ValueError(
                        f"{name}[{n}] has d = {r.shape[1]} columns, expected {refs[0].shape[1]} (the d of {name}[0])"
                    )
        kind, objs = "list", [r.obj for r in refs]
    else:
        raise TypeError(f"{name} must be an array or a list of arrays, got {type(grads).__qualname__}")
    taus = [r.shape[0] for r in refs]
    d = refs[0].shape[1]
    _check_sizes(min(taus), d, name)
    return _Clients(kind, objs, refs, taus, d)


def selection_size(tau: int, alpha: float) -> int:
    """K = round(α·τ) = ⌊α·τ + 0.5⌋, clamped to [1, τ] (docs/bherd.md §7.4)."""
    return min(tau, max(1, math.floor(alpha * tau + 0.5)))


def check_alpha(alpha: Any) -> float:
    """α as a float; ValueError unless 0 < α ≤ 1."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha must be a real number in (0, 1], got {type(alpha).__qualname__}")
    a = float(alpha)
    if not (math.isfinite(a) and 0.0 < a <= 1.0):
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return a


def _check_k(k: Any, taus: list[int], name: str = "k") -> list[int]:
    def one(value: Any, tau: int, label: str) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{label} must be an integer, got {type(value).__qualname__}")
        if not 1 <= int(value) <= tau:
            raise ValueError(f"{label} must be in [1, τ] = [1, {tau}], got {value}")
        return int(value)

    if isinstance(k, Sequence) or (_arrays.is_array(k) and len(k.shape) == 1):
        values = list(_arrays.host_float64(k, name)) if _arrays.is_array(k) else list(k)
        if _arrays.is_array(k):
            if any(v != int(v) for v in values):
                raise TypeError(f"{name} must hold integers")
            values = [int(v) for v in values]
        if len(values) != len(taus):
            raise ValueError(f"{name} has {len(values)} entries, expected one per client ({len(taus)})")
        return [one(v, tau, f"{name}[{n}]") for n, (v, tau) in enumerate(zip(values, taus, strict=True))]
    return [one(k, tau, name if len(taus) == 1 else f"{name} (client {n})") for n, tau in enumerate(taus)]


# ---------------------------------------------------------------------------------------------------------------
# Centred Gram matrices with the caller's library.


def _chunk_plan(batch: int, tau: int, d: int, gpu: bool) -> tuple[int, int]:
    """(c, p): columns per chunk and chunks per GEMM call for ``batch`` clients of [τ, d] gradients. The d columns
    are split into chunks of equal width c (the last one narrower by less than the number of chunks)."""
    rows = batch * tau if gpu else tau  # the GPU chunk spans all clients; the CPU chunk is one client's product
    wanted = max(256, GRAM_CHUNK_ELEMENTS["gpu" if gpu else "cpu"] // rows)
    chunks = -(-d // wanted)
    c = -(-d // chunks)
    if gpu:
        return c, 1
    return c, max(1, min(chunks, GRAM_CALL_ELEMENTS_CPU // (batch * tau * c)))


def _chunk_calls(d: int, c: int, p: int) -> list[tuple[int, int, int]]:
    """Per GEMM call: (first column, whole chunks n, columns r of a last, partial chunk) over the d columns."""
    return [(lo, *divmod(min(d, lo + p * c) - lo, c)) for lo in range(0, d, p * c)]


def _chunks(a: Any, lo: int, n: int, c: int, permute: Any) -> Any:
    """Columns lo .. lo + n·c of a [B, rows, d] array as n chunks, [n, B, rows, c] (a strided view)."""
    return permute(a[:, :, lo : lo + n * c].reshape(*a.shape[:2], n, c), (2, 0, 1, 3))


def _gram_torch(y: Any) -> Any:
    import torch

    y = y.detach()
    batch, tau, d = y.shape
    work = torch.float64 if y.dtype == torch.float64 else torch.float32
    shift = y[:, :1, :].to(work)
    raw = None
    c, p = _chunk_plan(batch, tau, d, y.is_cuda)
    buf = torch.empty(p, batch, tau, c, dtype=work, device=y.device)  # shifted chunks, [p, B, τ, c]
    for lo, n, r in _chunk_calls(d, c, p):
        torch.sub(_chunks(y, lo, n, c, torch.permute), _chunks(shift, lo, n, c, torch.permute), out=buf[:n])
        if r:  # a last, partial chunk, zero padded to c columns
            end = lo + n * c
            torch.sub(y[:, :, end : end + r], shift[:, :, end : end + r], out=buf[n, :, :, :r])
            buf[n, :, :, r:] = 0
        z = buf[: n + (r > 0)].flatten(0, 1)
        part = torch.bmm(z, z.transpose(1, 2)).view(-1, batch, tau, tau).sum(0, dtype=torch.float64)
        raw = part if raw is None else raw.add_(part)
    return _centre_gram(raw, tau)


def _gram_xp(xp: Any, y: Any) -> Any:
    batch, tau, d = y.shape
    work = xp.float64 if y.dtype == xp.float64 else xp.float32
    shift = y[:, :1, :].astype(work)
    raw = None
    c, p = _chunk_plan(batch, tau, d, xp is not np)
    buf = xp.empty((p, batch, tau, c), dtype=work)  # shifted chunks, [p, B, τ, c]
    for lo, n, r in _chunk_calls(d, c, p):
        xp.subtract(
            _chunks(y, lo, n, c, xp.transpose), _chunks(shift, lo, n, c, xp.transpose), out=buf[:n], casting="unsafe"
        )
        if r:  # a last, partial chunk, zero padded to c columns
            end = lo + n * c
            xp.subtract(y[:, :, end : end + r], shift[:, :, end : end + r], out=buf[n, :, :, :r], casting="unsafe")
            buf[n, :, :, r:] = 0
        z = buf[: n + (r > 0)].reshape(-1, tau, c)
        part = xp.matmul(z, z.transpose(0, 2, 1)).reshape(-1, batch, tau, tau).sum(0, dtype=xp.float64)
        raw = part if raw is None else xp.add(raw, part, out=raw)
    return _centre_gram(raw, tau)


def _centre_gram(raw: Any, tau: int) -> Any:
    """G = G' − r1ᵀ − 1rᵀ + m (r = G'1/τ, m = 1ᵀG'1/τ²): the Gram of the rows centred on their mean, from the
    Gram G' of the rows shifted by the first row. The shift makes ‖mean of the shifted rows‖ of the order of the
    deviations, so this identity does not cancel (it does for the raw rows when ‖μ‖ ≫ ‖z‖)."""
    r = raw.sum(-1) / tau
    m = r.sum(-1) / tau
    return raw - r[:, :, None] - r[:, None, :] + m[:, None, None]


def _gram_batch(lib: str, y: Any) -> Any:
    """float64 [B, τ, τ] Gram matrices of the centred rows of a [B, τ, d] array, in y's library and device."""
    if lib == "torch":
        return _gram_torch(y)
    if lib == "numpy":
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite input is reported after the Gram
            return _gram_xp(np, y)
    import cupy

    with cupy.cuda.Device(y.device.id):
        return _gram_xp(cupy, y)


def centred_gram(grads: Any) -> Any:
    """Gram matrix of the centred gradients, float64 [τ, τ] (or [N, τ_max, τ_max], zero-padded, for N clients).

    Computed with the caller's library matmul as described in the module docstring. Not differentiable.
    """
    _declare.refuse_grad("centred_gram", ("grads",), grads)
    if _declare.operator_needed(grads):
        return _per_client(grads, lambda g: _declare.torch_op("centred_gram")(g))
    return _centred_gram_direct(grads)


def _centred_gram_direct(grads: Any) -> Any:
    cl = _clients(grads)
    gram = _centred_gram(cl)
    return gram[0] if cl.kind == "single" else gram


def _centred_gram(cl: _Clients) -> Any:
    """float64 [N, T, T] (T = max τ, zero padded), contiguous, in the caller's library/device."""
    if cl.kind == "single":
        return _gram_batch(cl.lib, cl.objs[0][None])
    if cl.kind == "stack":
        return _gram_batch(cl.lib, cl.objs[0])
    big = max(cl.taus)
    gram = _arrays.empty_like_lib(cl.first, (len(cl.taus), big, big), "float64")
    gram[...] = 0
    for n, (y, tau) in enumerate(zip(cl.objs, cl.taus, strict=True)):
        gram[n, :tau, :tau] = _gram_batch(cl.lib, y[None])[0]
    return gram


def _finite_per_client(lib: str, gram: Any) -> np.ndarray:
    if lib == "torch":
        import torch

        return torch.isfinite(gram).flatten(1).all(dim=1).cpu().numpy()
    if lib == "numpy":
        return np.isfinite(gram).reshape(gram.shape[0], -1).all(axis=1)
    import cupy

    return cupy.isfinite(gram).reshape(gram.shape[0], -1).all(axis=1).get()


# ---------------------------------------------------------------------------------------------------------------
# Native greedy loop and masked sum.


@dataclass
class _Herd:
    order: Any  # int64 [N, kmax], -1 padded
    mask: Any  # uint8 [N, T]
    sq_norm: Any  # float64 [N]: ‖Σ_{selected} z‖²
    gram: Any  # float64 [N, T, T]


def _check_finite(cl: _Clients, herd: _Herd) -> None:
    """ValueError unless every client's Gram matrix is finite: the op's one host read, made after all its launches
    (the greedy loop and the masked sum are safe on non-finite input), so that the GPU never waits for the host."""
    finite = _finite_per_client(cl.lib, herd.gram)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        where = "" if cl.kind == "single" else f" (client {bad})"
        raise ValueError(
            f"grads contain non-finite values (inf or NaN), or their squared norms overflow{where}; "
            "check the gradients before selecting"
        )


def _herd(cl: _Clients, ks: list[int]) -> _Herd:
    """The greedy orders, launched but not yet checked (call :func:`_check_finite` before returning them)."""
    gram = _centred_gram(cl)
    n, big, kmax = len(cl.taus), max(cl.taus), max(ks)
    like = cl.first
    order = _arrays.empty_like_lib(like, (n, kmax), "int64")
    mask = _arrays.empty_like_lib(like, (n, big), "uint8")
    sq_norm = _arrays.empty_like_lib(like, (n,), "float64")
    gram_ref = _arrays.describe(gram, "gram")
    _arrays.call_native(
        native().herding_greedy,
        like,
        like.device,
        _arrays.stream_handle(like),
        gram_ref.ptr,
        big,
        cl.taus,
        ks,
        tie_rel_tol(like.dtype, cl.d),
        _arrays.describe(order, "order").ptr,
        kmax,
        _arrays.describe(mask, "mask").ptr,
        _arrays.describe(sq_norm, "sq_norm").ptr,
    )
    return _Herd(order, mask, sq_norm, gram)


def _masked_sum(cl: _Clients, mask: Any) -> Any:
    like = cl.first
    out = _arrays.empty_like_lib(like, (len(cl.taus), cl.d))
    out_ref = _arrays.describe(out, "out")
    mask_ref = _arrays.describe(mask, "mask")
    _arrays.call_native(
        native().herding_masked_sum,
        like,
        like.device,
        _arrays.stream_handle(like),
        like.dtype,
        cl.d,
        [r.ptr for r in cl.refs],
        cl.taus,
        [r.strides[0] for r in cl.refs],
        [r.strides[1] for r in cl.refs],
        mask_ref.ptr,
        mask_ref.strides[0],
        out_ref.ptr,
        out_ref.strides[0],
        out_ref.strides[1],
    )
    return out


def _orders(cl: _Clients, order: Any, ks: list[int], listed: bool) -> Any:
    if cl.kind == "single":
        return order[0, : ks[0]]
    if cl.kind == "list" or listed:
        return [order[n, :k] for n, k in enumerate(ks)]
    return order


def _gaps(cl: _Clients, herd: _Herd, ks: list[int]) -> np.ndarray:
    sq = _arrays.host_float64(herd.sq_norm, "sq_norm") if cl.lib != "numpy" else herd.sq_norm
    return np.sqrt(np.maximum(sq, 0.0)) / np.asarray(ks, dtype=np.float64)


# ---------------------------------------------------------------------------------------------------------------
# Public ops.


def herding_order(grads: Any, k: Any) -> Any:
    """The first k indices of the greedy herding permutation (BHerd Algorithm 2) of the rows of ``grads``.

    Step j picks, among the rows not yet picked, the m minimising ‖s + z_m‖ with z_m = y_m − μ (μ the mean row)
    and s the sum of the centred rows picked so far; ties go to the lowest index. The first pick is the row
    nearest the mean.

    Args:
        grads: [τ, d] matrix, [N, τ, d] stack or list of N [τ_i, d] matrices (numpy, torch CPU/CUDA or cupy;
            float32, float64, float16 or bfloat16; rows may be strided).
        k: number of steps, 1 ≤ k ≤ τ; an integer, or one per client for batched input.

    Returns:
        int64 indices in the caller's library and device: [k] for one matrix, [N, k] for a stack with one k, a list
        of N 1-D arrays for a list input or per-client k. A selection: not differentiable.
    """
    _declare.refuse_grad("herding_order", ("grads",), grads)
    if _declare.operator_needed(grads):
        if isinstance(k, Sequence) or _declare.is_tensor(k):
            return [_declare.torch_op("herding_order")(g, int(kn)) for g, kn in zip(grads, k, strict=True)]
        return _per_client(grads, lambda g: _declare.torch_op("herding_order")(g, int(k)))
    return _herding_order(grads, k)


def _herding_order(grads: Any, k: Any) -> Any:
    cl = _clients(grads)
    _arrays.refuse_capture(cl.first, "herding", "checking that the gradients' Gram matrix is finite")
    ks = _check_k(k, cl.taus)
    herd = _herd(cl, ks)
    _check_finite(cl, herd)
    listed = isinstance(k, Sequence) or _arrays.is_array(k)
    return _orders(cl, herd.order, ks, listed)


def herding_select(grads: Any, alpha: Any, *, return_gap: bool = False) -> tuple[Any, ...]:
    """Herding selection of K = round(α·τ) (clamped to [1, τ]) gradients and the sum of the selected raw rows.

    Args:
        grads: [τ, d], [N, τ, d] or a list of N [τ_i, d] matrices (see :func:`herding_order`).
        alpha: selection fraction α ∈ (0, 1].
        return_gap: also return, per client, ‖g/K − μ‖ (the distance between the mean of the selected gradients
            and the mean of all of them; BHerd's Fig. 4d), a float64 numpy [N] array, computed from the Gram
            matrix at no extra pass over the gradients.

    Returns:
        ``(indices, sums)`` or ``(indices, sums, gap)``: indices as in :func:`herding_order` (selection order),
        sums the [d] (one matrix) or [N, d] sums Σ_{selected} y in the caller's library, device and dtype.
        A selection: not differentiable. In compiled code (``torch.compile``) the gap is a float64 CPU tensor.
    """
    _declare.refuse_grad("herding_select", ("grads",), grads)
    if _declare.operator_needed(grads):
        if not _declare.is_tensor(grads):  # a list of clients of different τ: one operator call each
            results = [_declare.torch_op("herding_select")(g, float(alpha)) for g in grads]
            indices, sums, gaps = ([r[i] for r in results] for i in range(3))
            import torch

            result = (indices, torch.stack(sums), torch.cat(gaps))
        else:
            result = _declare.torch_op("herding_select")(grads, float(alpha))
        return result if return_gap else result[:2]
    return _herding_select(grads, alpha, return_gap)


def _herding_select(grads: Any, alpha: Any, return_gap: bool) -> tuple[Any, ...]:
    cl = _clients(grads)
    _arrays.refuse_capture(cl.first, "herding", "checking that the gradients' Gram matrix is finite")
    a = check_alpha(alpha)
    ks = [selection_size(tau, a) for tau in cl.taus]
    herd = _herd(cl, ks)
    sums = _masked_sum(cl, herd.mask)
    _check_finite(cl, herd)
    if cl.kind == "single":
        sums = sums[0]
    result = (_orders(cl, herd.order, ks, False), sums)
    return (*result, _gaps(cl, herd, ks)) if return_gap else result


#: largest τ of a :class:`GrabBalancer` (far beyond any round's steps; it allocates τ bytes of flags)
MAX_TAU = 2**31 - 1


class GrabBalancer:
    """GraB-FedAvg's online balancing (BHerd Algorithm 4) for one client and one round, with O(d) state.

    For each gradient y_λ (λ = 1..τ), in order: μ ← μ + y/τ (the paper's literal rule; with ``running_mean`` the true
    running mean μ ← μ + (y − μ)/λ); z = y − μ; the gradient is selected when ⟨s, z⟩ < 0 (i.e. ‖s + z‖ < ‖s − z‖),
    then s += z and g += y, otherwise s −= z. The first gradient (s = 0) is never selected.

    State (μ, s, g) is float64 for float64 gradients and float32 otherwise, in the gradients' library and device.
    The decisions stay on the device until :meth:`selected` / :attr:`count` is read.

    Args:
        tau: number of gradients this round (τ_i).
        running_mean: use the true running mean instead of the literal /τ rule.
    """

    def __init__(self, tau: int, *, running_mean: bool = False) -> None:
        if isinstance(tau, bool) or not isinstance(tau, numbers.Integral) or tau < 1:
            raise ValueError(f"tau must be an integer >= 1, got {tau!r}")
        if tau > MAX_TAU:  # one flag byte per gradient is allocated at the first step
            raise ValueError(f"tau must be at most 2**31 - 1 = {MAX_TAU} gradients, got {tau}")
        self.tau = int(tau)
        self.running_mean = bool(running_mean)
        self.steps = 0
        self._like: ArrayRef | None = None
        self.mean: Any = None
        self.s: Any = None
        self.g: Any = None
        self.picked: Any = None

    def _allocate(self, ref: ArrayRef) -> None:
        state = "float64" if ref.dtype == "float64" else "float32"
        d = ref.shape[-1]
        self._like = ref
        self.mean, self.s, self.g = (_arrays.empty_like_lib(ref, (d,), state) for _ in range(3))
        for v in (self.mean, self.s, self.g):
            v[...] = 0
        self.picked = _arrays.empty_like_lib(ref, (self.tau,), "uint8")
        self.picked[...] = 0

    def step(self, y: Any) -> None:
        """Balance one gradient [d] or several rows [r, d] (in order)."""
        ref = _arrays.describe(y, "y")
        _arrays.check_float_dtype(ref, "y")
        if len(ref.shape) == 1:
            rows, row_stride, col_stride = 1, 0, ref.strides[0]
        elif len(ref.shape) == 2:
            rows, row_stride, col_stride = ref.shape[0], ref.strides[0], ref.strides[1]
        else:
            raise ValueError(f"y must be a [d] vector or a [r, d] matrix, got shape {ref.shape}")
        if rows == 0 or ref.shape[-1] == 0:
            raise ValueError(f"y is empty (shape {ref.shape})")
        if self._like is None:
            self._allocate(ref)
        else:
            _arrays.check_same(ref, self._like, "y", "the first gradient")
            if ref.shape[-1] != self._like.shape[-1]:
                raise ValueError(f"y has d = {ref.shape[-1]}, expected {self._like.shape[-1]}")
        if self.steps + rows > self.tau:
            raise ValueError(f"GrabBalancer got {self.steps + rows} gradients, more than tau = {self.tau}")
        picked = _arrays.describe(self.picked, "picked")
        _arrays.call_native(
            native().grab_steps,
            ref,
            ref.device,
            _arrays.stream_handle(ref),
            ref.dtype,
            rows,
            ref.shape[-1],
            ref.ptr,
            row_stride,
            col_stride,
            _arrays.describe(self.mean, "mean").ptr,
            _arrays.describe(self.s, "s").ptr,
            _arrays.describe(self.g, "g").ptr,
            picked.ptr + self.steps,
            self.steps + 1,
            self.tau,
            self.running_mean,
        )
        self.steps += rows

    def picked_mask(self) -> np.ndarray:
        """bool [steps] numpy: which of the gradients seen so far were selected.

        Raises ValueError when the balancing state is not finite (a non-finite gradient was seen).
        """
        if not self.steps:
            return np.zeros(0, dtype=bool)
        _arrays.host_float64(self.s, "GraB running sum s (non-finite gradients?)")
        return _arrays.host_float64(self.picked[: self.steps], "picked").astype(bool)

    def selected(self) -> Any:
        """int64 indices of the selected gradients, ascending, in the gradients' library and device."""
        idx = np.flatnonzero(self.picked_mask()).astype(np.int64)
        if self._like is None or self._like.lib == "numpy":
            return idx
        if self._like.lib == "torch":
            import torch

            return torch.as_tensor(idx, device=self._like.obj.device)
        import cupy

        with cupy.cuda.Device(self._like.device):
            return cupy.asarray(idx)

    @property
    def count(self) -> int:
        """Number of selected gradients."""
        return int(self.picked_mask().sum())

    @property
    def alpha(self) -> float:
        """α_i = count / τ."""
        return self.count / self.tau


def grab_select(grads: Any, *, running_mean: bool = False) -> tuple[Any, Any]:
    """GraB's online balancing (BHerd Algorithm 4) over the rows of a [τ, d] matrix, in row order.

    Args:
        grads: [τ, d] gradients of one client in the order they were computed (numpy, torch or cupy; float32,
            float64, float16 or bfloat16).
        running_mean: use the true running mean (/λ) instead of the paper's literal μ += y/τ.

    Returns:
        ``(indices, sums)``: int64 ascending indices of the selected rows and Σ_{selected} y [d], in the caller's
        library, device and dtype (accumulated in float32, float64 for float64 gradients). A selection: not
        differentiable.
    """
    _declare.refuse_grad("grab_select", ("grads",), grads)
    if _declare.operator_needed(grads):
        return _declare.torch_op("grab_select")(grads, running_mean)
    return _grab_select(grads, running_mean)


def _grab_grads(grads: Any) -> ArrayRef:
    """GraB's checked [τ, d] gradients (not their values)."""
    ref = _arrays.describe(grads, "grads")
    _arrays.check_float_dtype(ref, "grads")
    if len(ref.shape) != 2 or ref.shape[0] < 1 or ref.shape[1] < 1:
        raise ValueError(f"grads must be a non-empty [τ, d] matrix, got shape {ref.shape}")
    return ref


def _grab_select(grads: Any, running_mean: bool) -> tuple[Any, Any]:
    ref = _grab_grads(grads)
    balancer = GrabBalancer(ref.shape[0], running_mean=running_mean)
    balancer.step(grads)
    sums = balancer.g
    if ref.dtype not in ("float32", "float64"):
        sums = sums.to(grads.dtype) if ref.lib == "torch" else sums.astype(grads.dtype)
    return balancer.selected(), sums


# torch.library declarations -----------------------------------------------------------------------------------


def _per_client(grads: Any, op: Any) -> Any:
    """op(grads) for a tensor, one op call per client for a list of [τ_i, d] matrices."""
    return op(grads) if _declare.is_tensor(grads) else [op(g) for g in grads]


def _fake_grads(grads: Any) -> tuple[int, ...]:
    """The leading dimensions ([] or [N]) and τ of a [τ, d] or [N, τ, d] tensor, checked as the direct path does."""
    ref = _grads_array(grads, "grads")
    return tuple(ref.shape[:-2]), ref.shape[-2]


def _gram_fake(grads: Any) -> Any:
    import torch

    lead, tau = _fake_grads(grads)
    return grads.new_empty((*lead, tau, tau), dtype=torch.float64)


def _order_fake(grads: Any, k: int) -> Any:
    import torch

    lead, _ = _fake_grads(grads)
    return grads.new_empty((*lead, k), dtype=torch.int64)


def _select_fake(grads: Any, alpha: float) -> tuple[Any, Any, Any]:
    import torch

    lead, tau = _fake_grads(grads)
    k = selection_size(tau, alpha) if isinstance(tau, int) else torch.library.get_ctx().new_dynamic_size()
    gap = torch.empty(lead if lead else (1,), dtype=torch.float64)
    return grads.new_empty((*lead, k), dtype=torch.int64), grads.new_empty((*lead, grads.shape[-1])), gap


def _grab_fake(grads: Any, running_mean: bool) -> tuple[Any, Any]:
    import torch

    _grab_grads(grads)
    count = torch.library.get_ctx().new_dynamic_size()
    return grads.new_empty((count,), dtype=torch.int64), grads.new_empty(grads.shape[1:])


@_declare.declare("centred_gram", "(Tensor grads) -> Tensor", fake=_gram_fake)
def _centred_gram_native(grads: Any) -> Any:
    return _centred_gram_direct(grads)


@_declare.declare("herding_order", "(Tensor grads, int k) -> Tensor", fake=_order_fake)
def _herding_order_native(grads: Any, k: int) -> Any:
    return _herding_order(grads, k)


@_declare.declare("herding_select", "(Tensor grads, float alpha) -> (Tensor, Tensor, Tensor)", fake=_select_fake)
def _herding_select_native(grads: Any, alpha: float) -> tuple[Any, Any, Any]:
    """(indices, sums, gap as a float64 CPU tensor of one value per client)."""
    import torch

    indices, sums, gap = _herding_select(grads, alpha, True)
    return indices, sums, torch.from_numpy(np.atleast_1d(gap))


@_declare.declare("grab_select", "(Tensor grads, bool running_mean) -> (Tensor, Tensor)", fake=_grab_fake)
def _grab_select_native(grads: Any, running_mean: bool) -> tuple[Any, Any]:
    return _grab_select(grads, running_mean)
