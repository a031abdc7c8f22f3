"""Shared test configuration: CUDA tests (marked `cuda`) run only when a usable GPU is present; tests marked
`hugemem` (2^31-element arrays, several GiB of RAM) run only when asked for, with `-m hugemem` or
PYFEDKERN_HUGEMEM=1; fixtures for run-directory tests (a snapshot of a directory's files, a directory that cannot
be written)."""

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


def _hugemem_wanted(config) -> bool:
    """True when the run asks for the huge-memory tests: a -m expression naming them, or PYFEDKERN_HUGEMEM=1."""
    return "hugemem" in (config.getoption("markexpr") or "") or os.environ.get("PYFEDKERN_HUGEMEM") == "1"


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device and a CUDA build of pyfedkern")
    skip_hugemem = pytest.mark.skip(reason="needs 4-9 GB of RAM: run with -m hugemem or PYFEDKERN_HUGEMEM=1")
    hugemem = _hugemem_wanted(config)
    for item in items:
        if "cuda" in item.keywords and not CUDA:
            item.add_marker(skip_cuda)
        if "hugemem" in item.keywords and not hugemem:
            item.add_marker(skip_hugemem)


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
