"""SessionHistory: a bounded ring buffer of past sessions' final models and footprint gradients.

The dynamic initial-model method keeps, for every finished post-pilot session z, its last global model w_z [d] and
its footprint gradient G_z [d_g]. Storing all of them grows by 2W per session; this store keeps the newest
``capacity`` sessions in two preallocated [capacity, ·] buffers (float32, or bfloat16 to halve the memory) and
overwrites the oldest slot when full. Rows are handed to the ops as views, oldest first, without copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class SessionHistory:
    """The newest ``capacity`` (session id, model [model_dim], gradient [grad_dim]) entries.

    Args:
        capacity: number of sessions kept (H >= 1).
        model_dim: length of a stored model.
        grad_dim: length of a stored gradient (0: models only).
        dtype: "float32" or "bfloat16" storage.
        device: torch device of the buffers.
    """

    def __init__(
        self,
        capacity: int,
        model_dim: int,
        grad_dim: int = 0,
        *,
        dtype: str = "float32",
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an integer >= 1, got {capacity!r}")
        if model_dim < 1 or grad_dim < 0:
            raise ValueError(f"need model_dim >= 1 and grad_dim >= 0, got {model_dim} and {grad_dim}")
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype!r}")
        torch_dtype = STORAGE_DTYPES[dtype]
        self.capacity = capacity
        self.models = torch.zeros(capacity, model_dim, dtype=torch_dtype, device=device)
        self.grads = torch.zeros(capacity, grad_dim, dtype=torch_dtype, device=device) if grad_dim else None
        self.sessions = np.full(capacity, -1, dtype=np.int64)
        self.pushed = 0  # entries ever pushed; the next slot is pushed % capacity

    def __len__(self) -> int:
        return min(self.pushed, self.capacity)

    def push(self, session: int, model: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Store a session's model (and gradient), overwriting the oldest entry when full."""
        if (grad is None) != (self.grads is None):
            raise ValueError("push a gradient exactly when the history was built with grad_dim > 0")
        slot = self.pushed % self.capacity
        self.models[slot].copy_(model)
        if grad is not None:
            self.grads[slot].copy_(grad)
        self.sessions[slot] = session
        self.pushed += 1

    def slots(self) -> list[int]:
        """Buffer rows of the retained entries, oldest first."""
        return [i % self.capacity for i in range(self.pushed - len(self), self.pushed)]

    def model_rows(self) -> list[torch.Tensor]:
        """Views of the retained models, oldest first."""
        return [self.models[i] for i in self.slots()]

    def grad_rows(self) -> list[torch.Tensor]:
        """Views of the retained gradients, oldest first."""
        if self.grads is None:
            raise ValueError("this history stores no gradients (grad_dim = 0)")
        return [self.grads[i] for i in self.slots()]

    def session_ids(self) -> np.ndarray:
        """Session ids of the retained entries, oldest first."""
        return self.sessions[self.slots()].copy()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"models": self.models, "sessions": self.sessions.copy(), "pushed": self.pushed}
        if self.grads is not None:
            state["grads"] = self.grads
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.models.copy_(state["models"])
        if self.grads is not None:
            self.grads.copy_(state["grads"])
        self.sessions[:] = np.asarray(state["sessions"], dtype=np.int64)
        self.pushed = int(state["pushed"])
