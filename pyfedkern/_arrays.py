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
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    span: tuple[int, int] | None = field(default=None, repr=False, compare=False)  # byte_span(), once computed

    @property
    def where(self) -> str:
        """Human-readable library and device, for error messages."""
        return f"{self.lib} on {'cpu' if self.device < 0 else f'cuda:{self.device}'}"

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def byte_span(self) -> tuple[int, int]:
        """The half-open byte range [lo, hi) that the array's elements touch (empty arrays: lo == hi)."""
        if self.span is None:
            if self.size == 0:
                self.span = (self.ptr, self.ptr)
            else:
                lo = hi = 0
                for n, s in zip(self.shape, self.strides, strict=True):
                    if s > 0:
                        hi += (n - 1) * s
                    else:
                        lo += (n - 1) * s
                self.span = (self.ptr + lo * self.itemsize, self.ptr + (hi + 1) * self.itemsize)
        return self.span

    def overlaps(self, other: ArrayRef) -> bool:
        """Whether the two arrays' byte spans intersect on the same device (a conservative aliasing test; empty and
        fake arrays, of pointer 0, overlap nothing)."""
        if self.device != other.device or not self.ptr or not other.ptr:  # (fake tensors: pointer 0)
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


_torch_tensor: Any = None  # torch.Tensor, once torch is imported (pyfedkern never imports torch just to check)
_torch_strided: Any = None
_cupy_ndarray: Any = None
_masked_array: Any = None  # numpy.ma.MaskedArray, once an ndarray subclass is seen (numpy imports numpy.ma lazily)


def _torch_loaded() -> bool:
    """Whether torch is imported (then ``_torch_tensor`` is set): no object can be a tensor before, and any tensor
    (of any subclass, defined in any module) is recognised after, whichever tensor an op sees first."""
    if _torch_tensor is None and "torch" in sys.modules:
        _torch_type()
    return _torch_tensor is not None


def is_array(x: Any) -> bool:
    """Whether x is a numpy array (or a memoryview, read as one), torch tensor or cupy array (checked with the
    library's own array type)."""
    if isinstance(x, (np.ndarray, memoryview)) or (
        (_torch_tensor is not None or _torch_loaded()) and isinstance(x, _torch_tensor)
    ):
        return True
    return _module_name(x) == "cupy" and _cupy_type() is not None and isinstance(x, _cupy_ndarray)


def _torch_type() -> Any:
    global _torch_tensor, _torch_strided
    if _torch_tensor is None:
        import torch

        _TORCH_DTYPE_NAMES.update({getattr(torch, n): n for n in (*FLOAT_DTYPES, "int32", "int64", "uint8")})
        _torch_strided = torch.strided
        _torch_tensor = torch.Tensor
    return _torch_tensor


def _cupy_type() -> Any:
    """cupy.ndarray, or None when cupy cannot be imported (then no object is a cupy array)."""
    global _cupy_ndarray
    if _cupy_ndarray is None:
        try:
            import cupy
        except ImportError:
            return None
        _cupy_ndarray = cupy.ndarray
    return _cupy_ndarray


def describe(x: Any, name: str) -> ArrayRef:
    """The :class:`ArrayRef` of x; TypeError naming ``name`` when x is not a supported array.

    An object is taken for a torch tensor or cupy array only when it is an instance of that library's own type
    (a class that merely calls its module "cupy" is refused), and a cupy array's pointer must be device memory of
    the device it claims. A memoryview is read as the numpy array over its buffer (its format, shape and strides;
    ``ref.obj`` is that array). numpy masked arrays are refused: the ops would read the masked values too.
    """
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray:
            _refuse_masked(x, name)
        return _describe_numpy(x, name)
    if (_torch_tensor is not None or _torch_loaded()) and isinstance(x, _torch_tensor):
        return _describe_torch(x, name)
    if isinstance(x, memoryview):
        return _describe_numpy(_memoryview_array(x, name), name)
    if _module_name(x) == "cupy" and _cupy_type() is not None and isinstance(x, _cupy_ndarray):
        return _describe_cupy(x, name)
    raise TypeError(f"{name} must be a numpy array, torch tensor or cupy array, got {type(x).__qualname__}")


def _refuse_masked(x: np.ndarray, name: str) -> None:
    global _masked_array
    if _masked_array is None:
        _masked_array = np.ma.MaskedArray
    if isinstance(x, _masked_array):
        raise TypeError(
            f"{name} is a numpy masked array, whose mask the ops would ignore; pass numpy.ma.filled(x, value) "
            "(or x.data to use the masked values too)"
        )


def host_array(values: Any, name: str) -> np.ndarray:
    """``np.asarray(values)`` for host arguments read as values (indices, offsets, flags), masked arrays refused."""
    if isinstance(values, np.ndarray) and type(values) is not np.ndarray:
        _refuse_masked(values, name)
    return np.asarray(values)


def _memoryview_array(x: memoryview, name: str) -> np.ndarray:
    """The numpy array over a memoryview's buffer (no copy; writeable when the memoryview is)."""
    try:
        shape = x.shape  # a released memoryview raises ValueError here
        arr = np.asarray(x)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise TypeError(f"{name} is a memoryview that numpy cannot read as an array: {exc}") from None
    if arr.dtype.hasobject or arr.shape != shape:  # numpy wrapped a buffer it does not understand as one object
        raise TypeError(f"{name} is a memoryview of format {x.format!r}, which numpy cannot read as an array")
    return arr


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
    if x.layout is not _torch_strided:
        raise TypeError(f"{name} must be a dense (strided) torch tensor, got layout {x.layout}")
    if x.is_cuda:
        device = x.get_device()
    elif x.is_cpu:
        device = -1
    else:
        raise TypeError(f"{name} is on torch device {x.device}; pyfedkern supports cpu and cuda")
    if x.is_conj() or x.is_neg():
        raise TypeError(f"{name} is a lazily conjugated/negated view; call .resolve_conj()/.resolve_neg() first")
    try:
        ptr = x.data_ptr()
    except RuntimeError:  # no memory to point at (a fake or functorch-wrapped tensor)
        ptr = 0
    if ptr == 0 and not _is_fake(x) and x.numel():
        raise TypeError(f"{name} is a {type(x).__qualname__} tensor without memory of its own (a wrapper subclass)")
    dtype = _TORCH_DTYPE_NAMES.get(x.dtype) or str(x.dtype).removeprefix("torch.")
    return ArrayRef(x, "torch", device, dtype, tuple(x.shape), x.stride(), ptr, x.element_size(), True)


_TORCH_DTYPE_NAMES: dict[Any, str] = {}  # torch.dtype -> canonical name, filled by _torch_type()


def _is_fake(x: Any) -> bool:
    """Whether x is a fake tensor (shapes and dtypes only), as the registered operators' fake functions get when
    ``torch.compile`` traces a call: described with pointer 0, so that they run the direct path's operand checks
    (pointers are compared only when the operator runs on real tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)


def _describe_cupy(x: Any, name: str) -> ArrayRef:
    import cupy

    itemsize = x.dtype.itemsize
    cai = x.__cuda_array_interface__
    ptr, device = int(cai["data"][0]), int(x.device.id)
    if x.size and ptr:
        attrs = cupy.cuda.runtime.pointerGetAttributes(ptr)
        if attrs.type not in (cupy.cuda.runtime.memoryTypeDevice, cupy.cuda.runtime.memoryTypeManaged) or (
            attrs.device != device
        ):
            raise TypeError(f"{name} claims device memory of cuda:{device} at {ptr:#x}, which is not")
    return ArrayRef(
        x,
        "cupy",
        device,
        x.dtype.name,
        tuple(x.shape),
        _element_strides(x.strides, itemsize, name),
        ptr,
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
    if _torch_loaded() and isinstance(x, _torch_tensor):
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
    return ref.obj


def host_float64(values: Any, name: str, length: int | None = None) -> np.ndarray:
    """A 1-D float64 numpy copy of real numbers: a list/tuple or an array of any library or device (a GPU array is
    copied to the host, which synchronises). TypeError for anything that is not a real number (strings, None,
    complex, objects), ValueError for a wrong shape or a non-finite value."""
    if type(values) is np.ndarray and values.dtype == np.float64 and values.ndim == 1:  # already the right kind
        if (length is None or values.shape[0] == length) and np.isfinite(values).all():
            return values.copy()
    elif isinstance(values, (list, tuple)):  # the common case: a short list of Python floats
        try:
            if all(map(math.isfinite, values)):
                arr = np.asarray(values, dtype=np.float64)
                if arr.ndim == 1 and (length is None or arr.shape[0] == length):
                    return arr
        except (TypeError, OverflowError):
            pass  # the general path below says what is wrong
    if is_array(values):
        ref = describe(values, name)
        refuse_capture(ref, name, "reading a GPU array's values")
        if ref.lib == "torch":
            import torch

            if values.is_complex():
                raise TypeError(f"{name} must be real numbers, got dtype {ref.dtype}")
            values = values.detach().to("cpu", dtype=torch.float64).numpy()
        elif ref.lib == "cupy":
            values = values.get()
    arr = values if isinstance(values, np.ndarray) else _real_array(values, name)
    if arr.dtype.kind not in "iufb":
        raise TypeError(f"{name} must be real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise ValueError(f"{name} has length {arr.shape[0]}, expected {length}")
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name} must be finite, but {name}[{bad}] = {arr[bad]}")
    return arr


def _real_array(values: Any, name: str) -> np.ndarray:
    """values as a numpy array without conversions numpy would make silently (strings, None, complex)."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be real numbers, got {type(values).__qualname__}") from None
    if arr.dtype.kind not in "iufb":
        got = "strings" if arr.dtype.kind in "US" else f"dtype {arr.dtype}" if arr.dtype.kind != "O" else "objects"
        raise TypeError(f"{name} must be real numbers, got {got}")
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
        arr = host_float64(describe(value, name).obj.reshape(-1), name)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        arr = host_float64([value], name)
    else:
        raise TypeError(f"{name} must be a real number, got {type(value).__qualname__}")
    if arr.shape[0] != 1:
        raise ValueError(f"{name} must be a single number, got {arr.shape[0]} values")
    return float(arr[0])
