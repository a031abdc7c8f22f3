"""Flat parameter vectors: one contiguous buffer per model, so every kernel runs once over the whole model.

- :class:`FlatLayout` records where each named tensor lives in the vector (offsets, shapes, dtypes); its
  ``segments()`` / ``include_mask()`` feed the per-layer similarity ops.
- :func:`pack` / :func:`unpack` convert named tensors (a ``state_dict``) or NumPy arrays (Flower's ``NDArrays``)
  to a flat float vector and back. Floating-point entries go into the vector; integer and bool entries (e.g.
  BatchNorm's ``num_batches_tracked``) are *carried* beside it unchanged and are never averaged as floats.
- :class:`FlatParameters` rebinds a module's parameters and gradients to views of two flat buffers, so the
  optimizer, aggregation and FL state can all work on ``[d]`` vectors with no copies.

The federated vector is a module's *trainable* parameters (:func:`trainable_parameters`: ``requires_grad=True``,
each distinct tensor once, so tied weights and a module used twice count once): :class:`FlatParameters`,
:func:`parameters_to_vector` and :func:`vector_to_parameters_` hold and write only those. Frozen parameters and
buffers stay in the module, shared by everything that uses it. :func:`state_dict_to_vector` and
:func:`vector_to_state_dict` are the whole ``state_dict`` (frozen parameters and buffers included), for saving or
loading a complete model, not for federating it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "Entry",
    "FlatLayout",
    "FlatParameters",
    "ndarrays_to_vector",
    "pack",
    "parameters_to_vector",
    "state_dict_to_vector",
    "trainable_parameters",
    "unpack",
    "vector_to_ndarrays",
    "vector_to_parameters_",
    "vector_to_state_dict",
]


@dataclass(frozen=True)
class Entry:
    """One named tensor: its shape, dtype name and offset in the flat vector (-1 when carried)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements of the tensor."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def carried(self) -> bool:
        """True for an integer or bool entry, carried beside the vector instead of in it."""
        return self.offset < 0


def _is_float_dtype(name: str) -> bool:
    return name in ("float16", "bfloat16", "float32", "float64")


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class FlatLayout:
    """Positions of named tensors in a flat vector of ``size`` floats."""

    entries: tuple[Entry, ...]
    size: int

    @classmethod
    def of(cls, named: Iterable[tuple[str, Any]]) -> FlatLayout:
        """Layout of (name, tensor-or-ndarray) pairs, in order; non-float entries are carried."""
        entries, offset = [], 0
        for name, value in named:
            dtype = _dtype_name(value)
            shape = tuple(int(s) for s in value.shape)
            if _is_float_dtype(dtype):
                entries.append(Entry(name, shape, dtype, offset))
                offset += int(np.prod(shape, dtype=np.int64))
            else:
                entries.append(Entry(name, shape, dtype, -1))
        return cls(tuple(entries), offset)

    @property
    def float_entries(self) -> list[Entry]:
        """The entries stored in the vector (floating point), in vector order."""
        return [e for e in self.entries if not e.carried]

    def segments(self) -> np.ndarray:
        """int64 [L + 1] offsets: float entry l occupies [segments[l], segments[l + 1])."""
        floats = self.float_entries
        return np.array([e.offset for e in floats] + [self.size], dtype=np.int64)

    def include_mask(self, exclude_substrings: Sequence[str] = ("bias",)) -> np.ndarray:
        """bool [L]: float entries whose name contains none of ``exclude_substrings`` (biases by default)."""
        return np.array([not any(s in e.name for s in exclude_substrings) for e in self.float_entries], dtype=bool)

    def names(self) -> list[str]:
        """Every entry's name, carried entries included, in layout order."""
        return [e.name for e in self.entries]


def _check_matches(layout: FlatLayout, named: Sequence[tuple[str, Any]]) -> None:
    if [n for n, _ in named] != layout.names():
        raise ValueError(f"names {[n for n, _ in named]} do not match the layout's {layout.names()}")
    for (name, value), e in zip(named, layout.entries, strict=True):
        if tuple(value.shape) != e.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, the layout says {e.shape}")


def pack(
    named: Mapping[str, Any] | Sequence[tuple[str, Any]],
    layout: FlatLayout | None = None,
    dtype: Any = None,
) -> tuple[Any, dict[str, Any], FlatLayout]:
    """Concatenate the float entries of ``named`` into one vector; return (vector, carried, layout).

    ``named`` is a mapping or (name, value) pairs of torch tensors or NumPy arrays (all one library). The vector
    has ``dtype`` (default float32) and lives in that library (torch: on the first tensor's device). ``carried``
    maps the names of integer/bool entries to copies of their values.
    """
    items = list(named.items()) if isinstance(named, Mapping) else list(named)
    if not items:
        raise ValueError("named is empty: nothing to pack")
    layout = layout or FlatLayout.of(items)
    _check_matches(layout, items)
    carried: dict[str, Any] = {}
    if isinstance(items[0][1], torch.Tensor):
        device = items[0][1].device
        vec = torch.empty(layout.size, dtype=dtype or torch.float32, device=device)
        for (name, value), e in zip(items, layout.entries, strict=True):
            if e.carried:
                carried[name] = value.detach().clone()
            else:
                vec[e.offset : e.offset + e.numel].copy_(value.detach().reshape(-1))
        return vec, carried, layout
    vec = np.empty(layout.size, dtype=dtype or np.float32)
    for (name, value), e in zip(items, layout.entries, strict=True):
        value = np.asarray(value)
        if e.carried:
            carried[name] = value.copy()
        else:
            vec[e.offset : e.offset + e.numel] = value.reshape(-1)
    return vec, carried, layout


def unpack(vector: Any, layout: FlatLayout, carried: Mapping[str, Any] | None = None) -> OrderedDict[str, Any]:
    """Split a flat vector back into named tensors/arrays of the layout's shapes and original dtypes.

    Float entries are copies cast to their recorded dtype; carried entries come from ``carried`` (required
    when the layout has any).
    """
    if tuple(vector.shape) != (layout.size,):
        raise ValueError(f"vector has shape {tuple(vector.shape)}, expected ({layout.size},)")
    carried = carried or {}
    out: OrderedDict[str, Any] = OrderedDict()
    is_torch = isinstance(vector, torch.Tensor)
    for e in layout.entries:
        if e.carried:
            if e.name not in carried:
                raise ValueError(f"carried value for {e.name!r} is missing")
            out[e.name] = carried[e.name].clone() if is_torch else np.array(carried[e.name], copy=True)
            continue
        piece = vector[e.offset : e.offset + e.numel].reshape(e.shape)
        out[e.name] = piece.to(getattr(torch, e.dtype)).clone() if is_torch else piece.astype(e.dtype)
    return out


def state_dict_to_vector(module_or_state: nn.Module | Mapping[str, torch.Tensor], dtype: Any = None):
    """(vector, carried, layout) of a module's ``state_dict()`` (parameters and buffers)."""
    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    return pack(state, dtype=dtype)


def vector_to_state_dict(vector: torch.Tensor, layout: FlatLayout, carried: Mapping[str, Any] | None = None):
    """The ``state_dict`` a vector stands for (load it with ``module.load_state_dict``)."""
    return unpack(vector, layout, carried)


def ndarrays_to_vector(arrays: Sequence[np.ndarray], dtype: Any = np.float32):
    """(vector, carried, layout) of a list of NumPy arrays (Flower's NDArrays); entries are named "0", "1", ..."""
    return pack([(str(i), np.asarray(a)) for i, a in enumerate(arrays)], dtype=dtype)


def vector_to_ndarrays(vector: np.ndarray, layout: FlatLayout, carried: Mapping[str, Any] | None = None):
    """The list of NumPy arrays a vector stands for, in layout order, with original dtypes."""
    return list(unpack(np.asarray(vector), layout, carried).values())


def trainable_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the module's trainable parameters (``requires_grad=True``) in ``named_parameters``
    order, each distinct tensor once under its first name (tied weights and a module used twice count once);
    ValueError when there is none."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"module {type(module).__name__} has no trainable parameters (none with requires_grad=True)")
    return params


def parameters_to_vector(module: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new flat copy of the module's trainable parameters (:func:`trainable_parameters`)."""
    vec, _, _ = pack(trainable_parameters(module), dtype=dtype)
    return vec


def vector_to_parameters_(vector: torch.Tensor, module: nn.Module) -> None:
    """Copy a flat vector into the module's trainable parameters in place (frozen ones are left as they are)."""
    params = trainable_parameters(module)
    layout = FlatLayout.of(params)
    if tuple(vector.shape) != (layout.size,):
        raise ValueError(f"vector has shape {tuple(vector.shape)}, the module has {layout.size} trainable parameters")
    with torch.no_grad():
        for (_, p), e in zip(params, layout.entries, strict=True):
            p.copy_(vector[e.offset : e.offset + e.numel].view(e.shape))


class FlatParameters:
    """Rebind a module's trainable parameters (:func:`trainable_parameters`) and their ``.grad`` to views of two
    flat buffers ``data`` and ``grad`` [d]; frozen parameters are left where they are.

    After this, ``model(x).backward()`` accumulates straight into ``grad`` (a tied weight's gradients summed, as
    torch does); writing into ``data`` changes the model. Clear gradients with :meth:`zero_grad` (torch's
    ``optimizer.zero_grad()`` would detach ``.grad`` from the buffer by setting it to None). All trainable
    parameters must share one floating-point dtype and device.
    """

    def __init__(self, module: nn.Module) -> None:
        params = trainable_parameters(module)
        dtypes = {p.dtype for _, p in params}
        devices = {p.device for _, p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"all parameters must share one dtype and device, got {dtypes} and {devices}")
        self.module = module
        self.layout = FlatLayout.of(params)
        self.data, _, _ = pack(params, self.layout, dtype=params[0][1].dtype)
        self.grad = torch.zeros_like(self.data)
        for (_, p), e in zip(params, self.layout.entries, strict=True):
            p.data = self.data[e.offset : e.offset + e.numel].view(e.shape)
            p.grad = self.grad[e.offset : e.offset + e.numel].view(e.shape)

    @property
    def size(self) -> int:
        """d, the length of the flat buffers."""
        return self.layout.size

    def zero_grad(self) -> None:
        """Set the flat gradient buffer to 0 (keeps ``.grad`` bound to it)."""
        self.grad.zero_()

    def load_(self, vector: torch.Tensor) -> None:
        """Copy a flat [d] vector into the parameters."""
        self.data.copy_(vector)
