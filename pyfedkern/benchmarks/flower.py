"""Benchmark cases of server aggregation in Flower: pyfedkern's strategy and drop-ins vs Flower's own.

K client results of d float32 parameters split into ResNet-18-like layers (62 tensors), in the three forms Flower
servers hold them: reply Messages with ArrayRecords (Message API), ``(NDArrays, num_examples)`` pairs
(``aggregate``) and ``(ClientProxy, FitRes)`` pairs with serialized Parameters (``aggregate_inplace``). Every case
of a group computes the same weighted average. Besides time, :func:`peak_memory` measures each case's peak of
newly allocated memory with :mod:`tracemalloc` (NumPy reports its buffers to it; pyfedkern's kernels allocate
nothing), the inputs excluded. Without flwr installed there are no cases.

``python -m pyfedkern.benchmarks.flower [quick|medium|resnet|full] [threads]`` prints time and peak memory per case.
"""

from __future__ import annotations

import sys
import tracemalloc
from typing import Any

import numpy as np

from pyfedkern.benchmarks.aggregate import _layer_bounds
from pyfedkern.benchmarks.common import Case, InputCache, fmt_size, time_case

SIZES = {
    "quick": [(10, 1_000_000)],
    "medium": [(20, 2_800_000)],
    "resnet": [(100, 11_200_000)],  # 100 × ResNet-18: ~4.5 GB per input form, ~10 GB at peak
    "full": [(20, 2_800_000), (100, 11_200_000)],
}


def _flower_available() -> bool:
    try:
        import flwr  # noqa: F401
    except ImportError:
        return False
    return True


def _build(form: str, K: int, d: int) -> Any:
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
    from flwr.supercore.task_identity import TaskIdentity

    rng = np.random.default_rng(0)
    bounds = _layer_bounds(d)
    sizes = rng.integers(50, 500, size=K)
    out = []
    for k in range(K):
        flat = rng.standard_normal(d, dtype=np.float32)
        layers = [flat[lo:hi].copy() for lo, hi in bounds]
        del flat
        if form == "ndarrays":
            out.append((layers, int(sizes[k])))
        elif form == "fitres":
            out.append((None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(layers), int(sizes[k]), {})))
        else:
            for attr, name in (("_run_id", "run_id"), ("_task_id", "task_id"), ("_node_id", "node_id")):
                if getattr(TaskIdentity, attr) is None:  # outside a running Flower app
                    setattr(TaskIdentity, name, 1)
            record = ArrayRecord({f"layer{i}": Array(x) for i, x in enumerate(layers)})
            content = RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": int(sizes[k])})})
            out.append(Message(content=content, message_type="train", dst_node_id=k + 1))
    return out


def cases(quick: bool = False, device: str = "cpu", size: str | None = None) -> list[Case]:
    """One group per (K, d) on the CPU (none on other devices or without flwr)."""
    if device != "cpu" or not _flower_available():
        return []
    from flwr.server.strategy.aggregate import aggregate as flower_aggregate
    from flwr.server.strategy.aggregate import aggregate_inplace as flower_inplace
    from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

    from pyfedkern.integrations import flower as pf

    cache = InputCache()
    out: list[Case] = []
    for K, d in SIZES[size or ("quick" if quick else "full")]:
        group = f"flower aggregation K={K} d={fmt_size(d)} float32 cpu"
        nbytes = (K + 1) * d * 4

        def make(form: str, fn: Any, K: int = K, d: int = d) -> Any:
            def build() -> Any:
                results = cache.get((K, d, form), lambda: _build(form, K, d))
                return lambda: fn(results)

            return build

        strategy, flower_strategy = pf.FedAvg(), FlowerFedAvg()
        out += [
            Case(group, "pyfedkern", make("messages", lambda r, s=strategy: s.aggregate_train(1, r)), nbytes),
            Case(
                group,
                "flower FedAvg.aggregate_train",
                make("messages", lambda r, s=flower_strategy: s.aggregate_train(1, r)),
                nbytes,
            ),
            Case(group, "pyfedkern aggregate", make("ndarrays", pf.aggregate), nbytes),
            Case(group, "flower aggregate", make("ndarrays", flower_aggregate), nbytes),
            Case(group, "pyfedkern aggregate_inplace", make("fitres", pf.aggregate_inplace), nbytes),
            Case(group, "flower aggregate_inplace", make("fitres", flower_inplace), nbytes),
        ]
    return out


def peak_memory(case: Case) -> int:
    """Peak bytes newly allocated during one call of the case (tracemalloc; inputs built beforehand)."""
    fn = case.make()
    fn()  # warm-up, and keeps lazily built inputs out of the measurement
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del result
    return int(peak)


def main(argv: list[str] | None = None) -> int:
    """Print time and peak memory of every case of one size ("quick", "medium", "resnet" or "full"), optionally
    with pyfedkern limited to a number of CPU threads (second argument; NumPy and Flower use one)."""
    args = sys.argv[1:] if argv is None else argv
    size = args[0] if args else "quick"
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if len(args) > 1:
        import pyfedkern

        pyfedkern.set_num_threads(int(args[1]))
    if not _flower_available():
        print('flwr is not installed: pip install "flwr>=1.20"')
        return 1
    rows = []
    for case in cases(size=size):
        seconds = time_case(case, min_time=0.0, max_rounds=3)
        rows.append((case.group, case.name, seconds, peak_memory(case)))
        print(f"{case.group} | {case.name}: {seconds * 1e3:.1f} ms, peak {rows[-1][3] / 2**20:.1f} MiB", flush=True)
    for group in dict.fromkeys(r[0] for r in rows):
        members = [r for r in rows if r[0] == group]
        ours = next(r for r in members if r[1] == "pyfedkern")
        print(f"\n### {group}\n\n| case | time (ms) | peak memory (MiB) | pyfedkern faster | pyfedkern less memory |")
        print("|---|---:|---:|---:|---:|")
        for _, name, sec, peak in members:
            faster, less = sec / ours[2], peak / max(ours[3], 1)
            print(f"| {name} | {sec * 1e3:.1f} | {peak / 2**20:.1f} | {faster:.2f}× | {less:.1f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
