"""Shared test configuration: CUDA tests (marked `cuda`) run only when a usable GPU is present; fixtures for
run-directory tests (a snapshot of a directory's files, a directory that cannot be written)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

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


def _files_under(directory: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and directory (None) under ``directory``, by relative path."""
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else None for p in sorted(directory.rglob("*"))
    }


@pytest.fixture
def files_under():
    """``files_under(dir)``: a snapshot of dir to compare before and after (no file lost or changed)."""
    return _files_under


@contextlib.contextmanager
def _unwritable(directory: Path):
    """``directory`` (created if needed) made unwritable inside the block: by chmod for a normal user; for root,
    whose write permission chmod does not take away, by the immutable attribute (chattr +i). Skips the test where
    neither works."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        directory.chmod(0o500)
        undo = ["chmod", "700", str(directory)]
    else:
        try:
            subprocess.run(["chattr", "+i", str(directory)], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            pytest.skip("running as root where chattr +i does not work: no way to make a directory unwritable")
        undo = ["chattr", "-i", str(directory)]
    try:
        if os.access(directory, os.W_OK):
            pytest.skip(f"{directory} is still writable for this user")
        yield directory
    finally:
        subprocess.run(undo, check=True)


@pytest.fixture
def unwritable():
    """``with unwritable(dir):`` dir cannot be written inside the block (see :func:`_unwritable`)."""
    return _unwritable
