"""Tiny helpers so references can be written once for numpy, torch and cupy arrays."""

from __future__ import annotations

from typing import Any

import numpy as np


def to_float64(x: Any) -> Any:
    """x converted to float64 in its own library and on its own device."""
    if isinstance(x, np.ndarray):
        return x.astype(np.float64)
    lib = type(x).__module__.split(".")[0]
    if lib == "torch":
        import torch

        return x.detach().to(torch.float64)
    return x.astype("float64")  # cupy


def cast_like(x: Any, like: Any) -> Any:
    """x converted to like's dtype (same library and device)."""
    if isinstance(x, np.ndarray):
        return x.astype(like.dtype)
    lib = type(x).__module__.split(".")[0]
    if lib == "torch":
        return x.to(like.dtype)
    return x.astype(like.dtype)


def zeros_float64_like(x: Any) -> Any:
    """A float64 array of zeros with x's shape, in x's library and on x's device."""
    if isinstance(x, np.ndarray):
        return np.zeros(x.shape, np.float64)
    lib = type(x).__module__.split(".")[0]
    if lib == "torch":
        import torch

        return torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    import cupy

    return cupy.zeros(x.shape, "float64")
