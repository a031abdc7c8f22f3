"""Packaging: the source distribution carries every file the build reads (`python -m build` compiles the wheel from
it), and the version the command line prints is the one the package metadata declares."""

import importlib.util
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import pyfedkern

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
pytestmark = pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source checkout")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_matches_the_metadata():
    assert _pyproject()["project"]["version"] == pyfedkern.__version__


@pytest.mark.skipif(importlib.util.find_spec("build") is None, reason="needs the build package (pip install build)")
def test_sdist_carries_every_tracked_file_but_the_excluded_ones(tmp_path):
    git = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = {name for name in git.stdout.split("\0") if name and (ROOT / name).is_file()}
    build = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (sdist,) = tmp_path.glob("pyfedkern-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {member.name.partition("/")[2] for member in tar.getmembers() if member.isfile()}

    excluded = _pyproject()["tool"]["scikit-build"]["sdist"]["exclude"]
    expected = {name for name in tracked if not any(name == e or name.startswith(e + "/") for e in excluded)}
    assert not expected - names, f"missing from the sdist: {sorted(expected - names)}"
    # What CMake and the package metadata read, by name, so that a broad exclude cannot drop it unnoticed.
    build_inputs = {"CMakeLists.txt", "pyproject.toml", "README.md", "csrc/build_config.h.in", "pyfedkern/py.typed"}
    build_inputs |= {name for name in tracked if name.startswith(("csrc/", "cuda/", "pyfedkern/"))}
    assert any(name.endswith(".cu") for name in build_inputs)
    assert not build_inputs - names, f"missing from the sdist: {sorted(build_inputs - names)}"
    outputs = [name for name in names if name.startswith("build/") or name.endswith((".so", ".o", ".pyc"))]
    assert not outputs, f"build outputs in the sdist: {outputs}"
