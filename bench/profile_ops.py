"""Where the time of a GPU op call goes: torch.profiler tables (CPU-side and GPU-side) of a few ops at benchmark
sizes, for the developers' notes. Usage: python bench/profile_ops.py > profile.txt"""

from __future__ import annotations

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pyfedkern import ops


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(1, 64, 100_000, generator=gen).cuda()
    q, bank, models = (
        torch.randn(*s, generator=gen).cuda() for s in ((11_173_962,), (64, 11_173_962), (64, 11_173_962))
    )
    offsets = np.linspace(0, 11_173_962, 63).astype(np.int64)
    X = torch.randn(10, 1_000_000, generator=gen).cuda()
    cases = {
        "herding_select tau=64 d=1e5": lambda: ops.herding_select(grads, 0.5),
        "similarity_combine K=64 d=1.12e7 L=62": lambda: ops.similarity_combine(q, bank, models, 5.0, segments=offsets),
        "weighted_sum K=10 d=1e6": lambda: ops.weighted_sum(X, [0.1] * 10),
    }
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        print(f"\n## {name} (5 calls)\n")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
