"""Which local-training path and which image layout is faster for a model: rules where the answer is known, else a
short measurement of both, kept for the process.

:func:`choose_path` picks between the batched path (:class:`~pyfedkern.algorithms.batched.BatchedLocal`, rows of
one [k, d] tensor) and the per-client loop; :func:`choose_layout` picks the memory format of the loop's image
batches. The engine (:class:`~pyfedkern.sim.engine.Simulation`) takes each choice unless the user forces one.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pyfedkern.algorithms.batched import Unbatchable, can_batch, trainer_for
from pyfedkern.algorithms.context import FLContext
from pyfedkern.algorithms.local import LocalModel

#: Most participants one measurement of :func:`choose_path` trains (per path): enough to show how a path scales
#: with the rows, few enough that measuring costs less than a round of a large model.
PROBE_ROWS = 16
#: Timed calls of each path in one measurement (the fastest counts: a busy machine only ever slows a call down).
MEASUREMENTS = 2
#: :func:`choose_layout` takes channels-last batches only when their step takes less than this fraction of the
#: contiguous step's time: a gain within a busy machine's timing noise is no gain, and a wrong switch slows the loop.
LAYOUT_MARGIN = 0.95
#: :func:`choose_path` takes the batched path only when its step takes at most this fraction of the loop's: where
#: the two are close, timing noise would pick either from one process to the next, and the paths agree only to
#: rounding, so two runs of one command could differ in the last digits.
PATH_MARGIN = 0.8


@dataclass(frozen=True)
class PathChoice:
    """The local-training path of a model: ``batched`` (True: rows of one [k, d] tensor, False: the per-client
    loop), why, and the measured seconds of one local step of the probed clients on each path (None when a rule
    decided without measuring)."""

    batched: bool
    reason: str
    seconds: dict[str, float] | None = None


def faster_path(seconds: dict[str, float]) -> bool:
    """Whether the batched path wins a measurement {"batched": s, "loop": s}: when its step takes at most
    :data:`PATH_MARGIN` × the loop's."""
    return seconds["batched"] <= PATH_MARGIN * seconds["loop"]


_CHOICES: dict[tuple, PathChoice] = {}


def choose_path(ctx: FLContext, rows: int) -> PathChoice:
    """The faster local-training path for ``ctx``'s model when ``rows`` participants train at once.

    Rules first: a model with persistent buffers takes the loop (it cannot be batched); a Flatten/Linear/ReLU chain
    takes the batched path (its hand-written backward is many times faster than the loop). Any other model is
    measured: one local step (gradient and update) of min(rows, :data:`PROBE_ROWS`) clients on their first minibatch
    of round 0, batched and looped (``_measure_paths``); the faster wins (:func:`faster_path`), the loop when the
    batched step fails (:class:`~pyfedkern.algorithms.batched.Unbatchable`: a model ``vmap`` cannot run). The
    measurement leaves the model's parameters and torch's random state as it found them, and is kept for the process,
    per model structure, device, dtype, rows, batch shape and thread count, so every simulation of that model in the
    process takes the same path.
    """
    local = ctx.local
    if not can_batch(local):
        return PathChoice(False, "the model has persistent buffers (e.g. BatchNorm statistics)")
    if trainer_for(local).chain is not None:
        return PathChoice(True, "a Flatten/Linear/ReLU chain (hand-written batched backward)")
    xb, yb, wb = _probe_batch(ctx, rows)
    data = local.flat.data
    key = (
        repr(local.module),
        tuple((e.name, e.shape) for e in local.flat.layout.entries),
        str(data.device),
        data.dtype,
        tuple(xb.shape),
        xb.dtype,
        torch.get_num_threads(),
    )
    if key not in _CHOICES:
        try:
            seconds = _measure_paths(ctx, xb, yb, wb)
        except Unbatchable as err:
            _CHOICES[key] = PathChoice(False, f"the model cannot be batched ({err.reason})")
        else:
            _CHOICES[key] = PathChoice(
                faster_path(seconds),
                f"measured on one local step of {xb.shape[0]} clients",
                {k: round(v, 6) for k, v in seconds.items()},
            )
    return _CHOICES[key]


def _probe_batch(ctx: FLContext, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The stacked first minibatch (xb, yb, wb) of round 0 of the first min(rows, :data:`PROBE_ROWS`) clients, on
    which the engine's measurements are taken."""
    rows = max(1, min(int(rows), PROBE_ROWS, int(ctx.num_clients)))
    device = ctx.local.flat.data.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # the engine seeds torch there
        return next(iter(ctx.stacked_batches(np.arange(rows), 0, steps=1)))


def _measure_paths(ctx: FLContext, xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor | None) -> dict[str, float]:
    """Seconds of one local step of xb.shape[0] clients on each path ({"batched", "loop"}; see
    ``_timed_alternately``)."""
    local, lr = ctx.local, 0.0  # lr 0: the updates cost the same and keep every call at the same model
    x0 = local.flat.data.clone()
    trainer = trainer_for(local)

    def batched() -> None:
        models = x0.expand(xb.shape[0], -1).clone()
        g, _ = trainer.gradients(models, xb, yb, wb)
        models.add_(g, alpha=-lr)

    with warnings.catch_warnings():  # torch warns that its vmap fallback is slow: the measurement finds that out
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        return _timed_alternately(ctx, {"batched": batched, "loop": _loop_step(local, _client_batches(xb, yb, wb))})


def _client_batches(xb: torch.Tensor, yb: torch.Tensor, wb: torch.Tensor | None) -> list[tuple[torch.Tensor, ...]]:
    """Each client's own batch (its samples without the padding) of a stacked step."""
    sizes = [xb.shape[1]] * xb.shape[0] if wb is None else (wb > 0).sum(1).tolist()
    return [(xb[r, :n], yb[r, :n]) for r, n in enumerate(sizes)]


def _loop_step(local: LocalModel, batches: list[tuple[torch.Tensor, ...]]) -> Callable[[], None]:
    """One loop step (gradient and update) of every client batch, each from the current parameters."""
    x0, lr = local.flat.data.clone(), 0.0  # lr 0: the update costs the same and keeps every call at the same model

    def loop() -> None:
        for xb, yb in batches:
            local.load_(x0)
            local.loss_and_grad(xb, yb)
            local.flat.data.add_(local.flat.grad, alpha=-lr)

    return loop


def _timed_alternately(ctx: FLContext, calls: dict[str, Callable[[], None]]) -> dict[str, float]:
    """Seconds of each call: the fastest of :data:`MEASUREMENTS` timed calls of each, alternating (load hits all
    alike), after an untimed call of each. The model's parameters and torch's random state are restored."""
    local = ctx.local
    x0 = local.flat.data.clone()
    device = x0.device

    def timed(fn: Callable[[], None]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        for fn in calls.values():
            fn()
        times = [{name: timed(fn) for name, fn in calls.items()} for _ in range(MEASUREMENTS)]
        return {name: min(t[name] for t in times) for name in calls}
    finally:
        local.load_(x0)
        local.flat.zero_grad()
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


@dataclass(frozen=True)
class LayoutChoice:
    """The memory format of the per-client loop's image batches: ``channels_last`` or contiguous, why, and the
    measured seconds of one loop step of the probed clients in each layout (None when not measured)."""

    channels_last: bool
    reason: str
    seconds: dict[str, float] | None = None


def is_image_batch(x: torch.Tensor) -> bool:
    """Whether a batch is floating-point images [B, C, H, W] of several channels, what the channels-last layout
    changes (one channel's two layouts are the same memory)."""
    return x.dim() == 4 and x.shape[1] > 1 and x.is_floating_point()


_LAYOUTS: dict[tuple, LayoutChoice] = {}


def choose_layout(ctx: FLContext, rows: int) -> LayoutChoice:
    """Whether the per-client loop feeds ``ctx``'s model channels-last image batches.

    Only image batches are measured (:func:`is_image_batch`; other inputs keep their layout): one loop step
    (gradient and update) of min(rows, :data:`PROBE_ROWS`) clients on their first minibatch of round 0 with
    contiguous and with channels-last batches, alternating, the fastest of :data:`MEASUREMENTS` timed calls of
    each; channels-last when its time is under :data:`LAYOUT_MARGIN` × the contiguous one. Kept for the process
    per model structure, device, dtype, batch shape and thread count, as :func:`choose_path`'s."""
    xb, yb, wb = _probe_batch(ctx, rows)
    if not is_image_batch(xb[0]):  # xb: [clients, B, ...]
        return LayoutChoice(False, "the inputs are not image batches [B, C, H, W]")
    local = ctx.local
    data = local.flat.data
    key = (repr(local.module), str(data.device), data.dtype, tuple(xb.shape), xb.dtype, torch.get_num_threads())
    if key not in _LAYOUTS:
        batches = _client_batches(xb, yb, wb)
        channels_last = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
        layouts = {"contiguous": _loop_step(local, batches), "channels_last": _loop_step(local, channels_last)}
        seconds = _timed_alternately(ctx, layouts)
        _LAYOUTS[key] = LayoutChoice(
            seconds["channels_last"] < LAYOUT_MARGIN * seconds["contiguous"],
            f"measured on one local step of {len(batches)} clients",
            {k: round(v, 6) for k, v in seconds.items()},
        )
    return _LAYOUTS[key]
