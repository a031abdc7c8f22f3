"""The benchmark cases compute what they claim (every peer of a group gives pyfedkern's result) and report ratios."""

import functools
import os

import numpy as np
import pytest
import torch

import pyfedkern
from pyfedkern.benchmarks import aggregate, fedspeed, runner, sampling, shared_cpu
from pyfedkern.benchmarks import compile as compiled_step
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


def test_compiled_step_eager_peers_agree():
    """One eager step of pyfedkern's operators, of the flat torch step and of FedSpeedOptimizer from the same x give
    the same x (the compiled forms are checked against eager in tests/ops/test_torch_library.py)."""
    cases = [c for c in compiled_step.cases(quick=True) if "eager" in c.name]
    for group in dict.fromkeys(c.group for c in cases):
        results = {c.name: _flat(c.make()()) for c in cases if c.group == group}
        ours = results.pop("pyfedkern eager")
        assert sorted(results) == ["FedSpeedOptimizer eager", "torch flat eager"]
        for name, value in results.items():
            np.testing.assert_allclose(value, ours, rtol=1e-5, atol=1e-6, err_msg=f"{group}: {name}")


def test_sampling_peers_give_pyfedkern_values():
    cases = sampling.cases(quick=True)
    for group in dict.fromkeys(c.group for c in cases if c.group.startswith("seeded_permutations")):
        results = {c.name: c.make()() for c in cases if c.group == group}
        ours = results.pop("pyfedkern")
        assert len(results) == 1 and ours.dtype == np.int64
        for name, value in results.items():
            assert np.array_equal(value, ours), f"{group}: {name}"
    # the Poisson plan of a round against its batches drawn one at a time: the same positions, batch after batch
    poisson = {c.name: c.make()() for c in cases if c.group.startswith("poisson plan")}
    plan = poisson.pop("pyfedkern")
    (batches,) = poisson.values()
    assert np.array_equal(plan.length, np.concatenate([lengths for _, lengths in batches]))
    assert np.array_equal(plan.perms, np.concatenate([positions for positions, _ in batches]))
    (fixed,) = [c.make()() for c in cases if c.group.startswith("fixed-size plan")]
    assert np.array_equal(fixed.counts, plan.counts)  # the same steps, fixed-size batches
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


def test_shared_cpu_cases_agree_and_set_their_threads():
    """Every case of a group computes the op of the group (fresh inputs each); each case's untimed torch step
    sets the thread counts it names; the background load starts one busy process per CPU and restores them."""
    threads = torch.get_num_threads(), pyfedkern.get_num_threads()
    with shared_cpu.background_load(processes=2):
        cases = shared_cpu.cases(quick=True)
        assert len(cases) == 2 * 5 and all(c.before and c.statistic == "mean" and c.rounds for c in cases)
        for group in dict.fromkeys(c.group for c in cases):
            results = {}
            for name in [c.name for c in cases if c.group == group]:
                case = next(c for c in shared_cpu.cases(quick=True) if c.group == group and c.name == name)
                case.before()()
                if "all on 1 thread" in name:
                    assert torch.get_num_threads() == 1 and pyfedkern.get_num_threads() == 1
                elif name == "pyfedkern on 1 thread":
                    assert torch.get_num_threads() == threads[0] and pyfedkern.get_num_threads() == 1
                else:
                    assert (torch.get_num_threads(), pyfedkern.get_num_threads()) == threads
                results[name] = _flat(case.make()())
            ours = results.pop("pyfedkern")
            assert len(results) == 4
            for name, value in results.items():
                np.testing.assert_allclose(value, ours, rtol=1e-5, atol=1e-6, err_msg=f"{group}: {name}")
        assert time_case(cases[0]) > 0  # the mean of the case's rounds, each after its torch step
    assert (torch.get_num_threads(), pyfedkern.get_num_threads()) == threads
    assert shared_cpu.cases(device="cuda") == []


def test_machine_load_warns_when_busy(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    assert runner.machine_load() == "machine load: 0.30 (1-minute average) on 2 CPUs"
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    text = runner.machine_load()
    assert text.startswith("machine load: 3.50 (1-minute average) on 2 CPUs\nwarning: the machine is busy")


def test_engine_round_peers_compute_the_same_round():
    """Each engine_round group's batched round and per-client loop give the same global model; the Flower task's
    group has pyfedkern's round (and Flower's when Ray is installed)."""
    from pyfedkern.benchmarks import engine

    cases = engine.cases(quick=True)
    groups = dict.fromkeys(c.group for c in cases if c.group.startswith("engine_round"))
    assert len(groups) == len(engine.ALGORITHMS)
    for group in groups:
        results = {c.name: _flat(c.make()()) for c in cases if c.group == group}
        assert set(results) == {"pyfedkern", "per-client loop (batched=False)"}
        np.testing.assert_allclose(
            results["per-client loop (batched=False)"], results["pyfedkern"], rtol=1e-4, atol=1e-5
        )
    flower = [c.name for c in cases if c.group.startswith("flower_round")]
    assert flower == ["pyfedkern"] + (["flower simulation engine (Ray)"] if engine.flower_available() else [])
    assert engine.client_steps(engine.flower_config(engine.QUICK_FLOWER_CLIENTS)) > engine.QUICK_FLOWER_CLIENTS


def test_trainable_round_cases_compute_the_same_round_and_row_sizes():
    """Each trainable_round group's batched round and per-client loop give the same global model (the trainable
    parameters only); the whole-model case's rows hold every parameter."""
    from pyfedkern.benchmarks import trainable

    cases = trainable.cases(quick=True)
    groups = dict.fromkeys(c.group for c in cases if c.group.startswith("trainable_round"))
    assert len(groups) >= 1
    for group in groups:
        members = {c.name: c for c in cases if c.group == group}
        results = {name: _flat(members[name].make()()) for name in ("pyfedkern", "per-client loop (batched=False)")}
        info = members["pyfedkern"].info
        assert results["pyfedkern"].shape == (info["d"],) and info["d"] < info["model"]
        np.testing.assert_allclose(
            results["per-client loop (batched=False)"], results["pyfedkern"], rtol=1e-4, atol=1e-5
        )
        assert members["whole model as the vector (unfrozen, batched)"].info["row"] == info["model"]


def test_engine_models_cases_compute_the_same_rounds():
    """The engine_models groups hold the three pyfedkern paths (and pfl when installed) at 1 and 2 threads, two
    worker processes at 2 threads, and the GEMM, convolution and bare-loop limits for the CNN (the bare loop trains:
    its loss on its one batch falls; split over two processes, both answer); the Shakespeare-shaped round (no
    dropout) is the same on every path, and the engine's choice there is one of the two paths."""
    from pyfedkern.benchmarks import engine_models

    cases = engine_models.cases(quick=True)
    groups = dict.fromkeys(c.group for c in cases)
    assert len(groups) == 4 and engine_models.cases(quick=True, device="cuda") == []
    paths = set(engine_models.PATHS) | ({"pfl 0.6"} if engine_models.pfl_available() else set())
    for group in groups:
        names = {c.name for c in cases if c.group == group}
        limits = {"limit:gemm", "limit:conv batch 10", "limit:bare steps"} if "simple_cnn" in group else set()
        workers = {"pyfedkern 2 workers × 1 thread"} if group.endswith("t=2") else set()
        if group.endswith("t=2") and "simple_cnn" in group:
            limits.add("limit:bare steps, 2 processes × 1 thread")
        assert names == paths | limits | workers, group
    bare = next(c for c in cases if c.name == "limit:bare steps").make()
    assert bare().item() > bare().item()
    split = next(c for c in cases if c.name == "limit:bare steps, 2 processes × 1 thread").make()
    try:
        split()
        assert len(split.__self__.peak_mb) == 2 and all(mb > 0 for mb in split.__self__.peak_mb)
    finally:
        split.__self__.close()
    text = next(g for g in groups if "lstm" in g and g.endswith("t=1"))
    results = {c.name: _flat(c.make()()) for c in cases if c.group == text and c.name in engine_models.PATHS}
    ours = results.pop("pyfedkern per-client loop")
    for name, value in results.items():
        np.testing.assert_allclose(value, ours, rtol=1e-4, atol=1e-5, err_msg=name)


def test_central_dp_round_cases_alternate_and_pfl_adds_its_noise():
    """Each central-DP round case's untimed step is its partner's round (the same two runs, alternating); pfl's DP
    case adds N(0, (σ·C/N')²) per coordinate to the mean, measured against its clip-only round on the same users."""
    from pyfedkern.benchmarks import dp, engine_models

    cases = [c for c in dp.cases(quick=True) if c.group.startswith("central_dp_round")]
    pfl = {"pfl 0.6 central DP", "pfl 0.6 plain"} if engine_models.pfl_available() else set()
    for group in dict.fromkeys(c.group for c in cases):
        pair = [c for c in cases if c.group == group]
        names = {c.name for c in pair}
        assert names == {"pyfedkern central DP", "pyfedkern plain"} | (pfl if "cifar" in group else set()), group
        for a, b in zip(pair[::2], pair[1::2], strict=True):
            assert a.before is b.make and b.before is a.make
    if not pfl:
        return
    clip, sigma, noise_cohort = dp.PFL_DP
    noised = torch.nn.utils.parameters_to_vector(engine_models.pfl_rounds("cifar", True, 1, dp.PFL_DP)().parameters())
    clipped = engine_models.pfl_rounds("cifar", True, 1, (clip, 0.0, noise_cohort))().parameters()
    std = (noised - torch.nn.utils.parameters_to_vector(clipped)).detach().double().std().item()
    assert std == pytest.approx(sigma * clip / noise_cohort, rel=0.05)


def test_worker_rounds_raise_a_failing_worker_s_error_instead_of_waiting(tmp_path, monkeypatch):
    """A worker process that fails (here: building its simulation, or a plain process building its callable) makes
    the round raise, naming the rank."""
    from pyfedkern.benchmarks import distributed
    from pyfedkern.sim.engine import Simulation

    run = distributed.worker_rounds(functools.partial(Simulation, "not a config"), 1)
    try:
        with pytest.raises(
            RuntimeError, match=r"(?s)rank 0 failed:\n.*AttributeError: .str. object has no attribute .validate."
        ):
            run()
    finally:
        distributed.stop_workers()
    # a source checkout without the compiled extension ahead on the path (a test before this one may leave the
    # checkout there): the processes still import the pyfedkern running here, and fail on the build alone
    checkout = tmp_path / "checkout" / "pyfedkern"
    checkout.mkdir(parents=True)
    (checkout / "__init__.py").write_text("raise ImportError('the source checkout was imported')\n")
    monkeypatch.syspath_prepend(str(checkout.parent))
    plain = distributed.WorkerRounds(functools.partial(int, "not a number"), 2, serve=distributed.serve_calls)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)rank \d failed:\n.*ValueError: invalid literal"):
            plain.round()
    finally:
        plain.close()


def test_a_groups_limits_are_timed_before_and_after_its_cases_and_the_faster_kept(monkeypatch):
    from pyfedkern.benchmarks.common import Case

    def case(group, name):
        return Case(group, name, lambda: lambda: None, bytes_moved=1000)

    cases = [case("g1", "limit:copy"), case("g1", "pyfedkern"), case("g1", "peer"), case("g2", "pyfedkern")]
    cases.append(case("g2", "limit:copy"))
    module = type("Family", (), {"cases": staticmethod(lambda quick, device: cases)})
    monkeypatch.setattr(runner.importlib, "import_module", lambda name: module)
    times = iter([5.0, 1.0, 2.0, 3.0, 4.0, 7.0, 6.0])
    order = []

    def timed(c):
        order.append(c.id)
        return next(times)

    monkeypatch.setattr(runner, "time_case", timed)
    rows = runner.run("family", device="cpu", progress=False)
    first, second = ["limit:copy", "pyfedkern", "peer", "limit:copy"], ["limit:copy", "pyfedkern", "limit:copy"]
    assert order == [f"g1 | {name}" for name in first] + [f"g2 | {name}" for name in second]
    assert [(r.group, r.name, r.seconds) for r in rows] == [
        ("g1", "pyfedkern", 1.0),
        ("g1", "peer", 2.0),
        ("g1", "limit:copy", 3.0),  # min(5, 3): the limit measured when the machine was least busy
        ("g2", "pyfedkern", 7.0),
        ("g2", "limit:copy", 4.0),  # min(4, 6)
    ]


def test_a_fraction_of_the_limit_above_100_percent_is_flagged_unreliable():
    rows = [Row("g", "pyfedkern", 1.0, bytes_moved=3000), Row("g", "limit:copy", 2.0, bytes_moved=3000)]
    assert "bandwidth vs limit:copy: 200% (above 100 %: unreliable" in report(rows)
    rows = [Row("g", "pyfedkern", 2.0, bytes_moved=3000), Row("g", "limit:copy", 1.0, bytes_moved=3000)]
    assert "bandwidth vs limit:copy: 50%." in report(rows) and "unreliable" not in report(rows)
