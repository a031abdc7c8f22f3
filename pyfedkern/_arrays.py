"""Array interop for pyfedkern.ops: describe numpy / torch / cupy arrays as raw memory for ``pyfedkern._C``.

An op turns each argument into an :class:`ArrayRef` (library, device, dtype, shape, element strides, data
pointer) through the library's documented interface (numpy's ``__array_interface__``, torch's
``data_ptr()/stride()``, cupy's ``__cuda_array_interface__``), validates the refs, allocates any output with the
caller's own library on the caller's device, and hands pointers and strides to the kernel. Nothing is copied:
strided inputs are read in place.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass(slots=True)
class ArrayRef:
    """Raw view of an array: ``element[i0, i1, ...]`` lives at ``ptr + itemsize * Σ i_k * strides[k]``."""

    obj: Any
    lib: str  # "numpy" | "torch" | "cupy"
    device: int  # -1 for host memory, else the CUDA device ordinal
    dtype: str  # canonical dtype name: "float32", "bfloat16", "int64", ...
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    ptr: int
    itemsize: int
    writeable: bool

    @property
    def where(self) -> str:
        """Human-readable library and device, for error messages."""
        return f"{self.lib} on {'cpu' if self.device < 0 else f'cuda:{self.device}'}"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def byte_span(self) -> tuple[int, int]:
        """The half-open byte range [lo, hi) that the array's elements touch (empty arrays: lo == hi)."""
        if self.size == 0:
            return self.ptr, self.ptr
        lo = hi = 0
        for n, s in zip(self.shape, self.strides, strict=True):
            if s > 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return self.ptr + lo * self.itemsize, self.ptr + (hi + 1) * self.itemsize

    def overlaps(self, other: ArrayRef) -> bool:
        """Whether the two arrays' byte spans intersect on the same device (a conservative aliasing test)."""
        if self.device != other.device:
            return False
        a0, a1 = self.byte_span()
        b0, b1 = other.byte_span()
        return a0 < b1 and b0 < a1

    def row(self, k: int) -> ArrayRef:
        """Row k of a 2-D array as a 1-D ref (no copy)."""
        return ArrayRef(
            self.obj,
            self.lib,
            self.device,
            self.dtype,
            self.shape[1:],
            self.strides[1:],
            self.ptr + k * self.strides[0] * self.itemsize,
            self.itemsize,
            self.writeable,
        )


def _module_name(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def is_array(x: Any) -> bool:
    """Whether x is a numpy array, torch tensor or cupy array."""
    return isinstance(x, np.ndarray) or (_module_name(x) in ("torch", "cupy") and hasattr(x, "shape"))


def describe(x: Any, name: str) -> ArrayRef:
    """The :class:`ArrayRef` of x; TypeError naming ``name`` when x is not a supported array."""
    if isinstance(x, np.ndarray):
        return _describe_numpy(x, name)
    lib = _module_name(x)
    if lib == "torch":
        import torch

        if isinstance(x, torch.Tensor):
            if not _TORCH_DTYPE_NAMES:
                _TORCH_DTYPE_NAMES.update({getattr(torch, n): n for n in (*FLOAT_DTYPES, "int32", "int64", "uint8")})
            return _describe_torch(x, name)
    if lib == "cupy" and hasattr(x, "__cuda_array_interface__"):
        return _describe_cupy(x, name)
    raise TypeError(f"{name} must be a numpy array, torch tensor or cupy array, got {type(x).__qualname__}")


def _element_strides(byte_strides: Sequence[int], itemsize: int, name: str) -> tuple[int, ...]:
    if len(byte_strides) == 1 and byte_strides[0] % itemsize == 0:  # the common case, without generators
        return (byte_strides[0] // itemsize,)
    if any(s % itemsize for s in byte_strides):
        raise ValueError(f"{name} has byte strides {tuple(byte_strides)} that are not multiples of its item size")
    return tuple(s // itemsize for s in byte_strides)


_NUMPY_DTYPE_NAMES: dict[np.dtype, str] = {}  # dtype.name is slow (about 1 µs); ops describe many arrays per call


def _describe_numpy(x: np.ndarray, name: str) -> ArrayRef:
    dtype = x.dtype
    if not dtype.isnative:
        raise TypeError(f"{name} has non-native byte order {dtype.str}; convert it with .astype(native dtype)")
    dtype_name = _NUMPY_DTYPE_NAMES.get(dtype)
    if dtype_name is None:
        dtype_name = _NUMPY_DTYPE_NAMES.setdefault(dtype, dtype.name)
    itemsize = dtype.itemsize
    return ArrayRef(
        x,
        "numpy",
        -1,
        dtype_name,
        tuple(x.shape),
        _element_strides(x.strides, itemsize, name),
        int(x.__array_interface__["data"][0]),
        itemsize,
        bool(x.flags.writeable),
    )


def _describe_torch(x: Any, name: str) -> ArrayRef:
    import torch

    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) torch tensor, got layout {x.layout}")
    if x.is_cpu:
        device = -1
    elif x.is_cuda:
        device = x.get_device()
    else:
        raise TypeError(f"{name} is on torch device {x.device}; pyfedkern supports cpu and cuda")
    if x.is_conj() or x.is_neg():
        raise TypeError(f"{name} is a lazily conjugated/negated view; call .resolve_conj()/.resolve_neg() first")
    dtype = _TORCH_DTYPE_NAMES.get(x.dtype) or str(x.dtype).removeprefix("torch.")
    return ArrayRef(x, "torch", device, dtype, tuple(x.shape), tuple(x.stride()), x.data_ptr(), x.element_size(), True)


_TORCH_DTYPE_NAMES: dict[Any, str] = {}  # torch.dtype -> canonical name, filled on first use by describe()


def _describe_cupy(x: Any, name: str) -> ArrayRef:
    itemsize = x.dtype.itemsize
    cai = x.__cuda_array_interface__
    return ArrayRef(
        x,
        "cupy",
        int(x.device.id),
        x.dtype.name,
        tuple(x.shape),
        _element_strides(x.strides, itemsize, name),
        int(cai["data"][0]),
        itemsize,
        not cai["data"][1],
    )


def check_float_dtype(ref: ArrayRef, name: str) -> None:
    if ref.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {ref.dtype}; expected one of {', '.join(FLOAT_DTYPES)}")


def check_same(ref: ArrayRef, like: ArrayRef, name: str, like_name: str) -> None:
    """TypeError/ValueError unless ref has the library, device and dtype of ``like``."""
    if ref.lib != like.lib or ref.device != like.device:
        raise ValueError(
            f"{name} is a {ref.where} array but {like_name} is a {like.where} array; mixing is not allowed"
        )
    if ref.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {ref.dtype}, expected {like.dtype} (the dtype of {like_name})")


def empty_like_lib(like: ArrayRef, shape: tuple[int, ...], dtype: str | None = None) -> Any:
    """A new uninitialised array of ``shape`` with like's library and device (and dtype unless given)."""
    dtype = dtype or like.dtype
    if like.lib == "numpy":
        return np.empty(shape, dtype=dtype)
    if like.lib == "torch":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.obj.device)
    import cupy

    with cupy.cuda.Device(like.device):
        return cupy.empty(shape, dtype=dtype)


def as_contiguous(x: Any, dtype: str) -> Any:
    """x (a torch or cupy array) as a contiguous array of ``dtype`` on its device (x itself when it already is)."""
    if _module_name(x) == "torch":
        import torch

        return x.detach().to(dtype=getattr(torch, dtype)).contiguous()
    import cupy

    with cupy.cuda.Device(x.device.id):
        return cupy.ascontiguousarray(x, dtype=dtype)


def data_ptr(x: Any) -> int:
    """Address of the first element of an array made by :func:`empty_like_lib` (a cheap ``describe(x).ptr``)."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    if _module_name(x) == "torch":
        return x.data_ptr()
    return int(x.data.ptr)


def stream_handle(ref: ArrayRef) -> int:
    """The caller's current CUDA stream on ref's device (0 for host arrays)."""
    if ref.device < 0:
        return 0
    if ref.lib == "torch":
        global _torch_raw_stream
        if _torch_raw_stream is None:
            import torch

            _torch_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda device: torch.cuda.current_stream(device).cuda_stream
            )
        return int(_torch_raw_stream(ref.device))
    import cupy

    with cupy.cuda.Device(ref.device):
        return int(cupy.cuda.get_current_stream().ptr)


_torch_raw_stream: Any = None  # torch's current-stream lookup (its raw C++ form when available: ~0.2 µs)


def call_native(fn: Any, like: ArrayRef, *args: Any) -> None:
    """``fn(*args, scratch_ptr, scratch_bytes)`` for a native op that may need device scratch.

    The op returns 0 once it has run, or (having launched nothing) the bytes of scratch it needs: then the scratch
    is allocated with like's library on like's device (torch's caching allocator, cupy's pool: no cudaMalloc in
    the steady state) and the op is called again. The scratch may be freed as soon as the call returns: the
    library reuses it only in the order of like's stream.
    """
    need = fn(*args, 0, 0)
    if need:
        scratch = empty_like_lib(like, (int(need),), "uint8")
        fn(*args, data_ptr(scratch), int(need))


def check_output(ref: ArrayRef, name: str) -> None:
    """ValueError unless ref can be written element by element; for torch, autograd's in-place rules.

    A torch tensor that requires grad is refused while grad mode is on (as torch refuses in-place ops on leaves
    that require grad; pyfedkern's in-place ops are not recorded by autograd): write it under ``torch.no_grad()``
    or pass ``.detach()``. After writing, call :func:`mark_written` so tensors saved for backward are detected.
    """
    if not ref.writeable:
        raise ValueError(f"{name} is read-only")
    if any(n > 1 and s == 0 for n, s in zip(ref.shape, ref.strides, strict=True)):
        raise ValueError(f"{name} has stride 0 (a broadcast view); it must be writeable element by element")
    if ref.lib == "torch" and ref.obj.requires_grad:
        import torch

        if torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad: pyfedkern's in-place ops are not recorded by autograd; write it under "
                "torch.no_grad() or pass a tensor that does not require grad (.detach())"
            )


def mark_written(*refs: ArrayRef) -> None:
    """Bump the autograd version counter of every torch tensor an op wrote (as torch's own in-place ops do), so a
    backward pass that saved one of them raises instead of using the new values."""
    for ref in refs:
        if ref.lib == "torch":
            global _increment_version
            if _increment_version is None:
                import torch

                _increment_version = torch.autograd.graph.increment_version
            _increment_version(ref.obj)


_increment_version: Any = None


@dataclass(slots=True)
class RowSet:
    """K vectors of length d read by a native op: the rows of a [K, d] stack (in place) or a list of 1-D arrays.

    ``first`` describes the stack (2-D) or the first vector; ``refs`` holds one ref per vector of a list and is
    empty for a stack (no per-row work in Python).
    """

    first: ArrayRef
    stack: ArrayRef | None
    refs: list[ArrayRef]
    count: int
    d: int

    def native_args(self, rows: np.ndarray | None = None) -> tuple:
        """(ptrs, strides, base, step_bytes, count, col_stride) for the native ops; ``rows`` selects stack rows."""
        if self.stack is None:
            return [r.ptr for r in self.refs], [r.strides[0] for r in self.refs], 0, 0, 0, 0
        s = self.stack
        step = s.strides[0] * s.itemsize
        if rows is None:
            return [], [], s.ptr, step, self.count, s.strides[1]
        ptrs = (s.ptr + rows.astype(np.int64) * step).tolist()
        return ptrs, [s.strides[1]] * len(ptrs), 0, 0, 0, 0

    def row_refs(self) -> list[ArrayRef]:
        """One 1-D ref per vector (builds them for a stack)."""
        return self.refs if self.stack is None else [self.stack.row(k) for k in range(self.count)]


def refuse_capture(ref: ArrayRef, name: str, what: str) -> None:
    """ValueError when ref's current CUDA stream is capturing a graph: ``what`` (a host round trip) cannot be
    captured, and trying would invalidate the capture."""
    if ref.device < 0:
        return
    if ref.lib == "torch":
        import torch

        capturing = torch.cuda.is_current_stream_capturing()
    else:
        import cupy

        capturing = cupy.cuda.get_current_stream().is_capturing()
    if capturing:
        raise ValueError(
            f"{name}: {what} needs a host round trip, which a CUDA graph cannot capture; call it outside the capture"
        )


def to_host(x: Any, name: str) -> np.ndarray:
    """A numpy copy of an array of any library (a GPU array is copied to the host, which synchronises)."""
    ref = describe(x, name)
    refuse_capture(ref, name, "reading a GPU array's values")
    if ref.lib == "torch":
        return x.detach().cpu().numpy()
    if ref.lib == "cupy":
        return x.get()
    return x


def host_float64(values: Any, name: str, length: int | None = None) -> np.ndarray:
    """A 1-D float64 numpy copy of scalars or an array (any library or device), checked finite."""
    if is_array(values):
        ref = describe(values, name)
        refuse_capture(ref, name, "reading a GPU array's values")
        if ref.lib == "torch":
            import torch

            values = values.detach().to("cpu", dtype=torch.float64).numpy()
        elif ref.lib == "cupy":
            values = values.get()
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be real numbers, got {type(values).__qualname__}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name} has length {arr.shape[0]}, expected {length}")
    if not np.all(np.isfinite(arr)):
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name} must be finite, but {name}[{bad}] = {arr[bad]}")
    return arr


def host_scalar(value: Any, name: str) -> float:
    """A finite Python float from a real number or a one-element array (any library or device)."""
    if type(value) is float or type(value) is int:  # the common case, without numpy
        try:
            f = float(value)
        except OverflowError:
            f = math.inf
        if not math.isfinite(f):
            raise ValueError(f"{name} must be finite, but {name}[0] = {value}")
        return f
    if is_array(value):
        arr = host_float64(value.reshape(-1), name)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        arr = host_float64([value], name)
    else:
        raise TypeError(f"{name} must be a real number, got {type(value).__qualname__}")
    if arr.shape[0] != 1:
        raise ValueError(f"{name} must be a single number, got {arr.shape[0]} values")
    return float(arr[0])
