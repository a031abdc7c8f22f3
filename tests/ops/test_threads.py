"""pyfedkern's CPU thread pool: small inputs run on the calling thread and wake no worker, large ones use the
workers; the default thread count; a forked child gets a working pool."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pyfedkern
from pyfedkern import ops
from pyfedkern.testing import pool_wakes

linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts worker wake-ups in /proc")


@pytest.fixture
def two_threads():
    before = pyfedkern.get_num_threads()
    pyfedkern.set_num_threads(2)
    yield
    pyfedkern.set_num_threads(before)


def _small_calls(rng):
    """One small input per op family: each a few microseconds to tens of microseconds of work."""
    store = torch.from_numpy(rng.standard_normal((20, 7850)).astype(np.float32))
    server = torch.empty(7850)
    updates = rng.standard_normal((10, 20_000)).astype(np.float32)
    x, g = (rng.standard_normal(50_000).astype(np.float32) for _ in range(2))
    feats, labels = rng.standard_normal((256, 64)).astype(np.float32), rng.integers(0, 10, 256)
    bank = rng.standard_normal((5, 10_000)).astype(np.float32)
    grads = rng.standard_normal((4, 10, 2000)).astype(np.float32)
    keys, sizes = np.arange(40).reshape(20, 2), np.full(20, 16)
    return [
        lambda: ops.pbc_agg_bcast_(store, server, [0, 4, 8, 12, 16]),
        lambda: ops.weighted_delta_(server, store, np.ones(5), 0.1, rows=[1, 2, 3, 5, 7]),
        lambda: ops.weighted_sum(updates, np.full(10, 0.1)),
        lambda: ops.sam_perturb(x, g, 0.05),
        lambda: ops.fedspeed_update_(x, g, 0.01, clip_norm=10.0),
        lambda: ops.class_feature_norms(feats, labels, 10),
        lambda: ops.similarity_weights(bank[0], bank, 1.0, "l2"),
        lambda: ops.herding_select(grads, 0.5),
        lambda: ops.seeded_permutations(1, keys, sizes),
    ]


@linux_only
def test_small_inputs_wake_no_worker_and_large_ones_do(two_threads):
    rng = np.random.default_rng(0)
    big = rng.standard_normal((10, 400_000)).astype(np.float32)
    with pool_wakes(True):  # starts the pool if this process has none yet
        ops.weighted_sum(big, np.full(10, 0.1))
    calls = _small_calls(rng)
    with pool_wakes(False):
        for _ in range(20):
            for call in calls:
                call()
    with pool_wakes(True):
        ops.weighted_sum(big, np.full(10, 0.1))


def test_default_thread_count_follows_omp_num_threads(tmp_path):
    code = "import pyfedkern; print(pyfedkern.get_num_threads(), pyfedkern.build_info()['max_threads'])"
    # the pyfedkern under test, run outside the checkout (`python -c` puts the cwd first on sys.path, and the source
    # tree has no compiled _C)
    root = str(Path(pyfedkern.__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "3", "PYTHONPATH": root}
    run = {"env": env, "cwd": tmp_path, "capture_output": True, "text": True, "check": True}
    out = subprocess.run([sys.executable, "-c", code], **run).stdout
    assert out.split() == ["3", "3"]
    env.pop("OMP_NUM_THREADS")
    out = subprocess.run([sys.executable, "-c", code], **run).stdout
    assert int(out.split()[0]) == len(os.sched_getaffinity(0))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_runs_parallel_ops(two_threads):
    """The child has none of the parent's pool threads; its large calls must neither hang nor differ."""
    rng = np.random.default_rng(1)
    big = rng.standard_normal((8, 300_000)).astype(np.float32)
    w = rng.standard_normal(8)
    expected = ops.weighted_sum(big, w)  # the parent's pool is running now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: compute twice on the (new) pool, report, and leave without running pytest's teardown
        try:
            same = all(np.array_equal(ops.weighted_sum(big, w), expected) for _ in range(2))
            os.write(write, b"1" if same else b"0")
        finally:
            os._exit(0)
    os.close(write)
    end = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > end:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in a parallel op")
        time.sleep(0.05)
    assert os.read(read, 1) == b"1"
    os.close(read)
