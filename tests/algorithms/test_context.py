"""FLContext: every member an algorithm may read, declared with its default (the engine, Flower's client and the
test contexts of tests/algorithms subclass it; a context that sets only the members without a default runs every
algorithm on the loop and the batched path: test_reference_compat.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pyfedkern.algorithms import FLContext, RoundSums
from pyfedkern.algorithms.context import ListedBatches
from pyfedkern.algorithms.dynamic import DynamicInit

OPTIONAL = ("sample_input", "aggregator", "attack", "central_dp", "dpsgd", "rounds", "active_clients", "eval_labels")
OPTIONAL += ("data", "partition", "client_y", "public_x", "public_y")


class Batches(FLContext):
    """Client i has sizes[i] samples x = i·100 + sample index (as [n, 2] rows), in minibatches of 2 in order."""

    def __init__(self, sizes):
        self.sizes = sizes

    def batches(self, cid, t, *, epochs=None, steps=None, order="reshuffle", drop_last=False, batch_size=None):
        x = torch.arange(self.sizes[cid], dtype=torch.float64)[:, None].repeat(1, 2) + 100 * cid + 1000 * t
        y = torch.arange(self.sizes[cid])
        for start in range(0, self.sizes[cid], 2):
            yield x[start : start + 2], y[start : start + 2]


def test_the_defaults_are_one_process_batched_and_nothing_optional():
    ctx = FLContext()
    clients = np.array([3, 1, 2])
    sums, losses = RoundSums(), [torch.ones(2)]
    assert (ctx.team.rank, ctx.team.size) == (0, 1) and ctx.team.keep_client_state() is None
    assert ctx.team.mine(clients) is clients and ctx.team.everyone(0, [sums]) == [sums]
    assert ctx.team.combine(0, sums, losses, 7) == (sums, losses, 7)
    assert ctx.batched is True and ctx.client_chunk is None and ctx.device_sharers == 1
    assert [name for name in OPTIONAL if vars(FLContext)[name] is not None] == []
    with ctx.timer("local"):
        ctx.seed_model_randomness(0, 1)
    for method in (ctx.lr, ctx.sample_clients, ctx.rng):
        with pytest.raises(NotImplementedError):
            method(0)
    with pytest.raises(NotImplementedError):
        ctx.batches(0, 0)


def test_default_stacked_batches_are_each_clients_batches_by_descending_steps():
    ctx = Batches([3, 6, 1, 4])
    stacked = ctx.stacked_batches([0, 1, 2, 3], 2)
    assert isinstance(stacked, ListedBatches)
    np.testing.assert_array_equal(stacked.clients, [1, 0, 3, 2])  # 3, 2, 2, 1 steps: ties keep the given order
    np.testing.assert_array_equal(stacked.steps, [3, 2, 2, 1])
    expected = {cid: list(ctx.batches(cid, 2)) for cid in range(4)}
    steps = list(stacked)
    assert len(steps) == 3
    for s, (xb, yb, wb) in enumerate(steps):
        rows = [cid for cid, n in zip(stacked.clients, stacked.steps, strict=True) if n > s]
        assert xb.shape[0] == len(rows)
        for r, cid in enumerate(rows):
            x, y = expected[cid][s]
            torch.testing.assert_close(xb[r, : len(y)], x, rtol=0, atol=0)
            torch.testing.assert_close(yb[r, : len(y)], y, rtol=0, atol=0)
            if wb is not None:  # a short batch is zero-padded and its real samples weigh 1/b
                weights = [1 / len(y)] * len(y) + [0.0] * (2 - len(y))
                torch.testing.assert_close(wb[r], torch.tensor(weights, dtype=torch.float64))
        assert (wb is None) == all(len(expected[cid][s][1]) == 2 for cid in rows)


def test_dynamic_sessions_need_the_contexts_rounds_or_session_rounds():
    algo, ctx = DynamicInit(sessions=2), FLContext()
    with pytest.raises(ValueError, match="session_rounds must be set"):
        algo.session_view(ctx, 0)
    ctx.rounds = 7
    with pytest.raises(ValueError, match=r"rounds \(7\) must be a multiple of sessions \(2\)"):
        algo.session_view(ctx, 0)
    ctx.rounds = 8
    assert algo.session_view(ctx, 4)._rounds == 4
