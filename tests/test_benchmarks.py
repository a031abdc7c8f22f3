"""The benchmark cases compute what they claim (every peer of a group gives pyfedkern's result) and report ratios."""

import numpy as np
import torch

from pyfedkern.benchmarks import aggregate, fedspeed, sampling
from pyfedkern.benchmarks.common import time_case
from pyfedkern.benchmarks.runner import Row, report


def _flat(result) -> np.ndarray:
    if isinstance(result, list):
        return np.concatenate([_flat(r).reshape(-1) for r in result])
    if isinstance(result, torch.Tensor):
        return result.detach().cpu().double().numpy()
    return np.asarray(result, dtype=np.float64)


def test_aggregate_peers_agree_with_pyfedkern():
    cases = [c for c in aggregate.cases(quick=True) if c.group == aggregate.cases(quick=True)[-1].group]
    results = {c.name: _flat(c.make()()) for c in cases if not c.is_limit}
    ours = results.pop("pyfedkern")
    assert len(results) >= 5
    for name, value in results.items():
        np.testing.assert_allclose(value, ours, rtol=1e-4, atol=1e-5, err_msg=name)


def test_fedspeed_step_peers_agree_with_pyfedkern():
    """One step of every peer (per-tensor, flat) from fresh inputs equals the fused step, in both groups."""
    groups = dict.fromkeys(c.group for c in fedspeed.cases(quick=True) if not c.is_limit)
    assert len(groups) == 2
    for group in groups:
        names = [c.name for c in fedspeed.cases(quick=True) if c.group == group and not c.is_limit]
        assert "pyfedkern" in names and any("per-tensor" in n for n in names) and len(names) >= 3
        results = {}
        for name in names:  # a fresh InputCache per case: every step starts from the same x
            case = next(c for c in fedspeed.cases(quick=True) if c.group == group and c.name == name)
            results[name] = _flat(case.make()())
        ours = results.pop("pyfedkern")
        for name, value in results.items():
            np.testing.assert_allclose(value, ours, rtol=1e-5, atol=1e-7, err_msg=f"{group}: {name}")


def test_sampling_peer_gives_pyfedkern_values():
    for group in dict.fromkeys(c.group for c in sampling.cases(quick=True)):
        results = {c.name: c.make()() for c in sampling.cases(quick=True) if c.group == group}
        ours = results.pop("pyfedkern")
        assert len(results) == 1 and ours.dtype == np.int64
        for name, value in results.items():
            assert np.array_equal(value, ours), f"{group}: {name}"
    assert sampling.cases(quick=True, device="cuda") == []


def test_time_case_and_report():
    case = aggregate.cases(quick=True)[0]
    seconds = time_case(case, min_time=0.0)
    assert seconds > 0
    rows = [
        Row("g", "pyfedkern", 1e-3, 4_000_000, 0),
        Row("g", "peer", 3e-3, 4_000_000, 0),
        Row("g", "limit:copy", 1e-3, 5_000_000, 0),
    ]
    text = report(rows)
    assert "| peer | 3.000 | 1.3 |  | 3.00× |" in text
    assert "vs fastest peer (peer): 3.00×" in text
    assert "bandwidth vs limit:copy: 80%" in text
