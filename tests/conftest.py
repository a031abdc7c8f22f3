"""Shared test configuration: CUDA tests (marked `cuda`) run only when a usable GPU is present."""

from __future__ import annotations

import pytest


def _cuda_ready() -> bool:
    try:
        import torch

        import pyfedkern

        return pyfedkern.cuda_available() and torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken CUDA stacks count as absent
        return False


CUDA = _cuda_ready()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device and a CUDA build of pyfedkern")
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(skip)
