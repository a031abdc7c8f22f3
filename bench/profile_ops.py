"""Where the time of a GPU op call goes: torch.profiler tables (CPU-side and GPU-side) of a few ops at benchmark
sizes, to see whether launches, host work or the kernels dominate. Usage: python bench/profile_ops.py > profile.txt"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from pyfedkern import ops, persample
from pyfedkern.models import build_model


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(1, 64, 100_000, generator=gen).cuda()
    q, bank, models = (
        torch.randn(*s, generator=gen).cuda() for s in ((11_173_962,), (64, 11_173_962), (64, 11_173_962))
    )
    offsets = np.linspace(0, 11_173_962, 63).astype(np.int64)
    X = torch.randn(10, 1_000_000, generator=gen).cuda()
    store, x = torch.randn(100, 1_190_000, generator=gen).cuda(), torch.randn(1_190_000, generator=gen).cuda()
    active = np.arange(0, 100, 2)
    g1, g2, anchor, perturbed = (torch.randn(11_173_962, generator=gen).cuda() for _ in range(4))
    norm, clip_norm = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    mlp, cnn = (build_model(name, (1, 28, 28), 10).cuda() for name in ("mlp", "cnn"))
    images, labels = torch.randn(256, 1, 28, 28, generator=gen).cuda(), torch.randint(0, 10, (256,)).cuda()

    def fedspeed_step():
        w = models[0]
        ops.sam_perturb(w, g1, 0.1, out=perturbed, norm_out=norm)
        ops.fedspeed_update_(
            w, g2, 0.01, anchor=anchor, prox_coef=0.1, weight_decay=1e-3, clip_norm=10.0, norm_out=clip_norm
        )

    cases = {
        "herding_select tau=64 d=1e5": lambda: ops.herding_select(grads, 0.5),
        "similarity_combine K=64 d=1.12e7 L=62": lambda: ops.similarity_combine(q, bank, models, 5.0, segments=offsets),
        "similarity_combine K=4 d=1.12e7 L=62": lambda: ops.similarity_combine(
            q, bank[:4], models[:4], 5.0, segments=offsets
        ),
        "weighted_sum K=10 d=1e6": lambda: ops.weighted_sum(X, [0.1] * 10),
        "fedspeed step (sam_perturb + clipped fedspeed_update_) d=1.12e7": fedspeed_step,
        "weighted_delta_ k=50 d=1.19e6": lambda: ops.weighted_delta_(x, store, np.ones(50), 0.02, rows=active),
        "pbc_agg_bcast_ k=50 d=1.19e6": lambda: ops.pbc_agg_bcast_(store, x, active),
        "grad_norms mlp B=256": lambda: persample.grad_norms(mlp, F.cross_entropy, images, labels),
        "grad_norms cnn B=256": lambda: persample.grad_norms(cnn, F.cross_entropy, images, labels),
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
