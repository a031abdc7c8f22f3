"""pyfedkern's ops as PyTorch operators: torch.library.opcheck per op, torch.compile (fullgraph, dynamic shapes, no
recompile on a second shape, zero graph breaks) equal to eager, gradcheck of the differentiable ops, refusal of
inputs that require grad by the others, and compiled FedSpeed / SAM steps equal to the eager steps.

Compiled functions use the ``aot_eager`` backend (Dynamo + AOTAutograd + functionalization, the part that must
understand the operators) to keep the CPU cost low; the FedSpeed and SAM steps also run under inductor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from pyfedkern import ops, reference
from pyfedkern.algorithms.fedspeed import FedSpeedOptimizer

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SHAPES = ((3, 5), (4, 7))  # (K, d) of the first call and of the second, which must not recompile


@dataclass(frozen=True)
class Case:
    """One op: ``make(K, d, gen, device)`` builds tensors (mutated ones included); ``fn`` calls the public op and
    returns what to compare (the mutated tensors for in-place ops); ``op_args`` maps the tensors to the
    arguments of ``torch.ops.pyfedkern.<name>``."""

    make: Callable[..., tuple]
    fn: Callable[..., object]
    op_args: Callable[..., tuple]


def _r(gen: torch.Generator, device: str, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(device)


def _idx(device: str, *values: int) -> torch.Tensor:
    return torch.tensor(values, device=device)


CASES: dict[str, Case] = {
    "weighted_sum": Case(
        lambda K, d, g, dev: (_r(g, dev, K, d), _r(g, dev, K)),
        lambda u, w: ops.weighted_sum(u, w),
        lambda u, w: (u, w),
    ),
    "accumulate_": Case(
        lambda K, d, g, dev: (_r(g, dev, d), _r(g, dev, d)),
        lambda acc, u: ops.accumulate_(acc, u, 0.5),
        lambda acc, u: (acc, u, 0.5, None),
    ),
    "sam_perturb": Case(
        lambda K, d, g, dev: (_r(g, dev, d), _r(g, dev, d)),
        lambda x, grad: ops.sam_perturb(x, grad, 0.05),
        lambda x, grad: (x, grad, 0.05, 1e-7, True, torch.empty_like(x), None),
    ),
    "fedspeed_update_": Case(  # the row form: one client per row
        lambda K, d, g, dev: tuple(_r(g, dev, K, d) for _ in range(4)),
        lambda x, g2, g1, anchor: ops.fedspeed_update_(
            x, g2, 0.1, g1=g1, alpha=0.5, anchor=anchor, prox_coef=0.1, weight_decay=1e-3
        ),
        lambda x, g2, g1, anchor: (x, g2, 0.1, g1, 0.5, anchor, 0.1, 1e-3, None, None),
    ),
    "fedspeed_round_end_": Case(
        lambda K, d, g, dev: tuple(_r(g, dev, d) for _ in range(4)),
        lambda h, xl, xg, acc: (ops.fedspeed_round_end_(h, xl, xg, acc=acc, acc_weight=0.5), acc),
        lambda h, xl, xg, acc: (h, xl, xg, acc, 0.5, True, None),
    ),
    "pbc_agg_bcast_": Case(
        lambda K, d, g, dev: (_r(g, dev, K, d), _r(g, dev, d), _idx(dev, 0, 2)),
        lambda store, server, active: (ops.pbc_agg_bcast_(store, server, active), store),
        lambda store, server, active: (store, server, active),
    ),
    "weighted_delta_": Case(
        lambda K, d, g, dev: (_r(g, dev, d), _r(g, dev, K, d), _r(g, dev, K)),
        lambda x, models, w: ops.weighted_delta_(x, models, w, 0.5),
        lambda x, models, w: (x, models, w, 0.5, None),
    ),
    "mifa_update_": Case(
        lambda K, d, g, dev: (_r(g, dev, d), _r(g, dev, K, d), _r(g, dev, d), _r(g, dev, 2, d), _idx(dev, 2, 0)),
        lambda x, memory, total, updates, rows: (ops.mifa_update_(x, memory, total, updates, rows), memory, total),
        lambda x, memory, total, updates, rows: (x, memory, total, updates, rows, 1.0, "models", False),
    ),
    "row_norms": Case(
        lambda K, d, g, dev: (_r(g, dev, K, d),),
        lambda x: ops.row_norms(x),
        lambda x: (x,),
    ),
    "class_feature_norms": Case(
        lambda K, d, g, dev: (
            _r(g, dev, K, d),
            torch.randint(0, 3, (K,), generator=g).to(dev),
            _r(g, dev, K, 3),
        ),
        lambda f, y, logits: tuple(ops.class_feature_norms(f, y, 3, logits)),
        lambda f, y, logits: (f, y, 3, logits),
    ),
    "similarity_weights": Case(
        lambda K, d, g, dev: (_r(g, dev, d), _r(g, dev, K, d)),
        lambda q, bank: ops.similarity_weights(q, bank, 2.0, "layer_l2", return_scores=True),
        lambda q, bank: (q, bank, 2.0, "layer_l2", [0, 2, q.shape[0]], [True, True], 1e-12),
    ),
    "similarity_combine": Case(
        lambda K, d, g, dev: (_r(g, dev, d), _r(g, dev, K, d), _r(g, dev, K, d + 1)),
        lambda q, bank, models: ops.similarity_combine(q, bank, models, 2.0, "l2", return_weights=True),
        lambda q, bank, models: (q, bank, models, 2.0, "l2", [0, q.shape[0]], [True], 1e-12),
    ),
    "centred_gram": Case(
        lambda K, d, g, dev: (_r(g, dev, K, d),),
        lambda grads: ops.centred_gram(grads),
        lambda grads: (grads,),
    ),
    "herding_order": Case(
        lambda K, d, g, dev: (_r(g, dev, K, d),),
        lambda grads: ops.herding_order(grads, 2),
        lambda grads: (grads, 2),
    ),
    "herding_select": Case(
        lambda K, d, g, dev: (_r(g, dev, 2, K, d),),  # two clients
        lambda grads: ops.herding_select(grads, 0.5),
        lambda grads: (grads, 0.5),
    ),
    "grab_select": Case(
        lambda K, d, g, dev: (_r(g, dev, K, d),),
        lambda grads: ops.grab_select(grads),
        lambda grads: (grads, False),
    ),
    "clip_accumulate": Case(
        lambda K, d, g, dev: (_r(g, dev, K, d), _r(g, dev, d)),
        lambda u, c: ops.clip_accumulate(u, 1.5, center=c, return_norms=True),
        lambda u, c: (u, 1.5, c),
    ),
    "gaussian_noise_": Case(
        lambda K, d, g, dev: (_r(g, dev, d),),
        lambda x: ops.gaussian_noise_(x, 0.5, 7, 3, 2**64 - 1),
        lambda x: (x, 0.5, 7, -(2**62)),
    ),
}


def _flat(result: object) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for r in result for t in _flat(r)]


def _clone(args: tuple) -> tuple:
    return tuple(a.clone() for a in args)


def test_every_public_op_is_a_registered_operator():
    registered = {name for name in dir(torch.ops.pyfedkern) if not name.startswith("_")}
    arrays_only = {"seeded_permutations"}  # host integer sampling: numpy in, numpy out
    public = {name for name in ops.__all__ if name[0].islower()} - arrays_only - {"per_sample_grad_norms"}
    assert public <= registered, public - registered


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(name, device):
    case = CASES[name]
    args = case.op_args(*case.make(*SHAPES[0], torch.Generator().manual_seed(0), device))
    torch.library.opcheck(getattr(torch.ops.pyfedkern, name).default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_equals_eager_with_dynamic_shapes(name, device):
    case = CASES[name]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(case.fn, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(1)
    calls = [case.make(K, d, gen, device) for K, d in SHAPES]
    for args in calls:
        eager_args, compiled_args = _clone(args), _clone(args)
        for a, first, second in zip(compiled_args, *calls, strict=True):  # K and d: the dimensions that change
            torch._dynamo.mark_dynamic(a, [i for i in range(a.dim()) if first.shape[i] != second.shape[i]])
        expected, got = _flat(case.fn(*eager_args)), _flat(compiled(*compiled_args))
        assert len(expected) == len(got)
        for e, g in zip(expected, got, strict=True):
            assert e.shape == g.shape and e.dtype == g.dtype
            assert torch.equal(e, g)
    assert counter.frame_count == 1, "the second shape recompiled"
    explained = torch._dynamo.explain(lambda *a: [t * 1 for t in _flat(case.fn(*a))])(*calls[0])
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


# Bad operands under torch.compile, and torch.func.vmap -----------------------------------------------------------


def _v(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.float64)


BAD_OPERANDS: dict[str, tuple[Callable[..., object], Callable[[], tuple]]] = {  # one wrong operand per op
    "weighted_sum": (lambda u, w: ops.weighted_sum(u, w), lambda: (_v(7), _v(7))),
    "accumulate_": (lambda acc, u: ops.accumulate_(acc, u, 0.5), lambda: (_v(2, 3), _v(2, 3))),
    "sam_perturb": (lambda x, g: ops.sam_perturb(x, g, 0.05), lambda: (_v(3), _v(4))),
    "fedspeed_update_": (lambda x, g2: ops.fedspeed_update_(x, g2, 0.1), lambda: (_v(3), _v(4))),
    "fedspeed_round_end_": (lambda h, xl, xg: ops.fedspeed_round_end_(h, xl, xg), lambda: (_v(3), _v(4), _v(3))),
    "pbc_agg_bcast_": (lambda s, v, a: ops.pbc_agg_bcast_(s, v, a), lambda: (_v(2, 3), _v(4), torch.tensor([0]))),
    "weighted_delta_": (lambda x, m, w: ops.weighted_delta_(x, m, w, 0.5), lambda: (_v(3), _v(2, 4), _v(2))),
    "mifa_update_": (
        lambda x, m, t, u, r: ops.mifa_update_(x, m, t, u, r),
        lambda: (_v(3), _v(2, 4), _v(3), _v(1, 3), torch.tensor([0])),
    ),
    "row_norms": (lambda x: ops.row_norms(x), lambda: (_v(7),)),
    "class_feature_norms": (
        lambda f, y: ops.class_feature_norms(f, y, 0),
        lambda: (_v(2, 3), torch.zeros(2, dtype=torch.int64)),
    ),
    "similarity_weights": (lambda q, bank: ops.similarity_weights(q, bank, 2.0), lambda: (_v(3), _v(2, 4))),
    "similarity_combine": (
        lambda q, bank, models: ops.similarity_combine(q, bank, models, 2.0),
        lambda: (_v(3), _v(2, 3), _v(3, 5)),
    ),
    "centred_gram": (lambda g: ops.centred_gram(g), lambda: (_v(7),)),
    "herding_order": (lambda g: ops.herding_order(g, 5), lambda: (_v(3, 4),)),
    "herding_select": (lambda g: ops.herding_select(g, 2.0), lambda: (_v(2, 3, 4),)),
    "grab_select": (lambda g: ops.grab_select(g), lambda: (_v(3, 0),)),
    "clip_accumulate": (lambda u, c: ops.clip_accumulate(u, 1.0, center=c), lambda: (_v(2, 3), _v(4))),
    "gaussian_noise_": (lambda x: ops.gaussian_noise_(x, 1.0, 0), lambda: (_v(2, 3),)),
}


ROBUST_BAD_OPERANDS: dict[str, tuple[Callable[..., object], Callable[[], tuple]]] = {
    "coordinate_median": (lambda u: ops.coordinate_median(u), lambda: (_v(7),)),
    "trimmed_mean": (lambda u: ops.trimmed_mean(u, 0.5), lambda: (_v(4, 3),)),
    "krum_scores": (lambda u: ops.krum_scores(u, 4), lambda: (_v(4, 3),)),
    "krum_select": (lambda u: ops.krum_select(u, 1, 5), lambda: (_v(4, 3),)),
    "bulyan": (lambda u: ops.bulyan(u, 1), lambda: (_v(6, 3),)),
    "geometric_median": (lambda u: ops.geometric_median(u, eps=0.0), lambda: (_v(4, 3),)),
    "centred_clip": (lambda u, c: ops.centred_clip(u, c, 1.0), lambda: (_v(4, 3), _v(5))),
}


def test_every_operator_case_has_a_bad_operand_case():
    assert set(BAD_OPERANDS) == set(CASES)
    assert set(ROBUST_BAD_OPERANDS) == set(ROBUST_VMAPPED)


@pytest.mark.parametrize("name", [*BAD_OPERANDS, *ROBUST_BAD_OPERANDS])
def test_compiled_calls_refuse_bad_operands_with_the_eager_message(name):
    """The fake function runs the direct path's operand checks (on fake tensors, which have no data pointer)."""
    fn, make = {**BAD_OPERANDS, **ROBUST_BAD_OPERANDS}[name]
    with pytest.raises((ValueError, TypeError)) as eager:
        fn(*make())
    torch._dynamo.reset()
    with pytest.raises(Exception) as compiled:  # Dynamo wraps what the fake function raised
        torch.compile(fn, backend="eager", fullgraph=True)(*make())
    assert str(eager.value) in str(compiled.value)


VMAPPED = [  # the out-of-place operators of fixed-size results (torch's fallback batches none of the in-place ones)
    "weighted_sum", "row_norms", "class_feature_norms", "similarity_weights", "similarity_combine", "centred_gram",
    "herding_order", "herding_select", "clip_accumulate",
]  # fmt: skip


@pytest.mark.parametrize("name", VMAPPED)
def test_public_ops_under_vmap_equal_the_loop_of_single_calls(name):
    """Functorch's wrapped tensors have no memory for the kernels: the public op takes the registered operator."""
    case = CASES[name]
    gen = torch.Generator().manual_seed(2)
    calls = [case.make(*SHAPES[0], gen, "cpu") for _ in range(3)]
    got = _flat(torch.func.vmap(case.fn)(*(torch.stack(a) for a in zip(*calls, strict=True))))
    loop = [_flat(case.fn(*args)) for args in calls]
    assert len(got) == len(loop[0])
    for i, g in enumerate(got):
        # the same kernel on each slice; a slice's alignment may change its vector loops' split: rounding only
        torch.testing.assert_close(g, torch.stack([one[i] for one in loop]), rtol=1e-12, atol=1e-15)


ROBUST_VMAPPED = {  # [K, d] updates per call (and a [d] centre)
    "coordinate_median": lambda u, c: ops.coordinate_median(u),
    "trimmed_mean": lambda u, c: ops.trimmed_mean(u, 0.2),
    "krum_scores": lambda u, c: ops.krum_scores(u, 1),
    "krum_select": lambda u, c: ops.krum_select(u, 1, 2),
    "bulyan": lambda u, c: ops.bulyan(u, 1),
    "geometric_median": lambda u, c: ops.geometric_median(u),
    "centred_clip": lambda u, c: ops.centred_clip(u, c, 1.0),
}


@pytest.mark.parametrize("name", list(ROBUST_VMAPPED))
def test_robust_ops_under_vmap_equal_the_loop_of_single_calls(name):
    gen = torch.Generator().manual_seed(4)
    u, c = _r(gen, "cpu", 3, 7, 5), _r(gen, "cpu", 3, 5)
    fn = ROBUST_VMAPPED[name]
    loop = torch.stack([fn(u[i], c[i]) for i in range(3)])
    torch.testing.assert_close(torch.func.vmap(fn)(u, c), loop, rtol=1e-12, atol=1e-15)  # (rounding only, as above)


def test_public_ops_under_vmap_of_a_row():
    x = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(
        torch.func.vmap(lambda r: ops.row_norms(r[None]))(x)[:, 0], x.norm(dim=1), rtol=1e-14, atol=0
    )


# Autograd ----------------------------------------------------------------------------------------------------


def _leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).requires_grad_()


def test_gradcheck_weighted_sum_in_rows_and_weights():
    u, w = _leaf(3, 5), _leaf(3, seed=1)
    assert torch.autograd.gradcheck(ops.weighted_sum, (u, w))
    assert torch.autograd.gradgradcheck(ops.weighted_sum, (u, w))
    vectors = [_leaf(5, seed=s) for s in range(3)]  # the list form is differentiable too
    assert torch.autograd.gradcheck(lambda *v: ops.weighted_sum(list(v), [0.5, -1.0, 2.0]), vectors)


@pytest.mark.parametrize("rows_require_grad", [False, True])
def test_weights_given_as_a_list_of_tensors_keep_their_gradients(rows_require_grad):
    """0-d tensor weights in a list, also after a float (the eager routing looks past the first element)."""
    u = _leaf(3, 5) if rows_require_grad else _leaf(3, 5).detach()
    a, b = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (0.3, -1.2))
    assert torch.autograd.gradcheck(lambda a, b: ops.weighted_sum(u, [a, 0.5, b]), (a, b))
    ops.weighted_sum(u, [0.5, a, b]).sum().backward()
    torch.testing.assert_close(a.grad, u[1].detach().sum(), rtol=0, atol=1e-12)


def test_gradcheck_row_norms_and_class_feature_norms():
    f = _leaf(6, 4)
    y = torch.tensor([0, 1, 2, 1, 0, 1])
    assert torch.autograd.gradcheck(ops.row_norms, (f,))
    assert torch.autograd.gradcheck(lambda a: tuple(ops.class_feature_norms(a, y, 4))[:3], (f,))


def test_the_differentiable_path_checks_its_arguments_as_the_direct_path_does():
    """Inputs that require grad take the registered operator: floats are not offsets, integers not flags, and a
    wrong out= is an error, not a silent cast."""
    q, bank = _leaf(6), _leaf(3, 6, seed=1)
    with pytest.raises(TypeError, match="segments must hold integers"):
        ops.similarity_weights(q, bank, 1.0, segments=[0, 2.7, 6])
    with pytest.raises(TypeError, match="include must be a boolean mask"):
        ops.similarity_weights(q, bank, 1.0, segments=[0, 3, 6], include=[1, 0])
    with pytest.raises(ValueError, match=r"out must be a \[6\] torch.float64 tensor"):
        ops.weighted_sum(bank, [1.0, 2.0, 3.0], out=torch.empty(6, dtype=torch.float32))


def test_class_feature_norms_is_twice_differentiable():
    """With create_graph the backward is a torch formula: the second derivative reaches the features (it was
    silently missing when the backward was the native kernel alone)."""
    f = _leaf(6, 4).detach()
    f[3] = 0.0  # an all-zero row: gradient 0, and so is its derivative
    f.requires_grad_()
    y = torch.tensor([0, 1, 2, 1, 0, 1])
    assert torch.autograd.gradgradcheck(lambda a: tuple(ops.class_feature_norms(a, y, 4))[:3], (_leaf(6, 4),))
    (g,) = torch.autograd.grad(ops.class_feature_norms(f, y, 4).class_mean.sum(), f, create_graph=True)
    (g[:, 0].sum() + f.sum()).backward()
    r = f.detach().clone().requires_grad_()
    (gr,) = torch.autograd.grad(reference.class_feature_norms(r, y, 4).class_mean.sum(), r, create_graph=True)
    (gr[:, 0].sum() + r.sum()).backward()
    nonzero = [0, 1, 2, 4, 5]  # the reference's formula gives NaN on the zero row
    torch.testing.assert_close(f.grad[nonzero], r.grad[nonzero], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(f.grad[3], torch.ones(4, dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("metric", ["l2", "layer_l2", "layer_cos"])
def test_gradcheck_similarity(metric):
    q, bank, models = _leaf(7), _leaf(3, 7, seed=1), _leaf(3, 4, seed=2)
    segments, include = [0, 2, 5, 7], [True, False, True]

    def weights(a, b):
        return ops.similarity_weights(a, b, 1.5, metric, segments, include, return_scores=True)

    def combine(a, b, m):
        return ops.similarity_combine(a, b, m, 1.5, metric, segments, include, return_weights=True)

    assert torch.autograd.gradcheck(weights, (q, bank))
    assert torch.autograd.gradcheck(combine, (q, bank, models))


@pytest.mark.parametrize("layer", [torch.nn.Linear(4, 3), torch.nn.Conv2d(2, 3, 3, padding=1)], ids=["linear", "conv"])
def test_gradcheck_per_sample_grad_norms(layer):
    if isinstance(layer, torch.nn.Linear):
        a, g = _leaf(5, 4), _leaf(5, 3, seed=1)
    else:
        a, g = _leaf(2, 2, 4, 4), _leaf(2, 3, 4, 4, seed=1)
    layer = layer.double()
    assert torch.autograd.gradcheck(lambda x, y: ops.per_sample_grad_norms(layer, x, y), (a, g))


def test_differentiable_results_keep_the_graph_in_a_mixed_loss():
    """The gradient through the op adds to the gradient through the other terms (nothing dropped silently)."""
    x = _leaf(3, 4)
    w = torch.tensor([0.5, 1.0, -2.0], dtype=torch.float64)
    loss = ops.weighted_sum(x, w).square().sum() + x.sum()
    loss.backward()
    expected = 2 * w[:, None] * (w @ x.detach())[None, :] + 1
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=1e-12)


NON_DIFFERENTIABLE = {
    "sam_perturb": lambda t: ops.sam_perturb(t, t.detach().clone(), 0.1),
    "fedspeed_update_": lambda t: ops.fedspeed_update_(t.detach().clone(), t, 0.1),
    "accumulate_": lambda t: ops.accumulate_(torch.zeros(4, dtype=t.dtype), t, 1.0),
    "weighted_delta_": lambda t: ops.weighted_delta_(torch.zeros(4, dtype=t.dtype), [t], [1.0]),
    "herding_order": lambda t: ops.herding_order(t[None].expand(3, 4), 2),
    "grab_select": lambda t: ops.grab_select(t[None].expand(3, 4)),
    "clip_accumulate": lambda t: ops.clip_accumulate(t[None].expand(3, 4), 1.0),
    "clip_accumulate center": lambda t: ops.clip_accumulate(torch.ones(3, 4, dtype=t.dtype), 1.0, center=t),
    "gaussian_noise_": lambda t: ops.gaussian_noise_(t, 0.1, 0),
}


# Scalars that no op is differentiable in, given as 0-d tensors that require grad.
SCALARS = {
    "sam_perturb rho": lambda s: ops.sam_perturb(torch.ones(4), torch.ones(4), s),
    "sam_perturb eps": lambda s: ops.sam_perturb(torch.ones(4), torch.ones(4), 0.1, eps=s),
    "fedspeed_update_ lr": lambda s: ops.fedspeed_update_(torch.ones(4), torch.ones(4), s),
    "fedspeed_update_ clip_norm": lambda s: ops.fedspeed_update_(torch.ones(4), torch.ones(4), 0.1, clip_norm=s),
    "fedspeed_round_end_ acc_weight": lambda s: ops.fedspeed_round_end_(
        torch.zeros(4), torch.ones(4), torch.zeros(4), acc=torch.zeros(4), acc_weight=s
    ),
    "weighted_delta_ scale": lambda s: ops.weighted_delta_(torch.zeros(4), torch.ones(2, 4), [1.0, 1.0], s),
    "mifa_update_ server_lr": lambda s: ops.mifa_update_(
        torch.zeros(4), torch.zeros(2, 4), torch.zeros(4), torch.ones(1, 4), [0], s
    ),
    "similarity_weights scale": lambda s: ops.similarity_weights(_leaf(4), _leaf(3, 4), s),
    "similarity_combine scale": lambda s: ops.similarity_combine(torch.ones(4), torch.ones(3, 4), torch.ones(3, 2), s),
    "gaussian_noise_ std": lambda s: ops.gaussian_noise_(torch.zeros(4), s, 0),
}


@pytest.mark.parametrize("case", list(SCALARS))
def test_scalars_that_require_grad_are_refused(case):
    name, argument = case.split()
    s = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(ValueError, match=f"{name}: {argument} requires grad, but {name} is not differentiable in"):
        SCALARS[case](s)
    with torch.no_grad():
        SCALARS[case](s)


@pytest.mark.parametrize("name", list(NON_DIFFERENTIABLE))
def test_non_differentiable_ops_refuse_inputs_that_require_grad(name):
    t = _leaf(4)
    with pytest.raises(ValueError, match="not differentiable"):
        NON_DIFFERENTIABLE[name](t)
    with torch.no_grad():
        NON_DIFFERENTIABLE[name](t)  # allowed outside grad mode


def test_the_grad_check_of_eager_calls_sees_tensors_in_every_argument_form(monkeypatch):
    """The eager routing's check, argument type by argument type: a tensor that requires grad is found alone, in a
    list or a tuple (also after tensors that do not); floats, None, numpy arrays and lists of floats are passed
    over; traced calls always take the operator."""
    from pyfedkern.ops import _declare

    t, g = torch.ones(4), _leaf(4)
    plain = (t, [t, t], (t,), 0.5, None, np.ones(2), [0.5, 1.0], (np.float64(0.5),), [], 3)
    names = tuple("abcdefghij")
    assert not _declare.use_operator(*plain)
    _declare.refuse_grad("op", names, *plain)  # nothing requires grad: no error
    for form in (g, [t, g], (t, g), [g]):
        assert _declare.use_operator(*plain, form)
        with pytest.raises(ValueError, match="op: w requires grad"):
            _declare.refuse_grad("op", (*names, "w"), *plain, form)
        with torch.no_grad():
            assert not _declare.use_operator(*plain, form)
            _declare.refuse_grad("op", (*names, "w"), *plain, form)
    monkeypatch.setattr(_declare, "traced", lambda: True)
    assert _declare.use_operator(*plain)


# Compiled training steps ---------------------------------------------------------------------------------------


def _mlp(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(dtype)


def _cnn(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(2, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 3),
    ).to(dtype)


needs_traced_backward = pytest.mark.skipif(
    not hasattr(torch._dynamo.config, "trace_autograd_ops"), reason="this torch cannot put backward() into a graph"
)
MODELS = {"mlp": (_mlp, (6,)), "cnn": (_cnn, (2, 8, 8))}  # factory, shape of one sample
OPTIMIZERS = {  # FedSpeed with every term; SAM is the optimizer without prox and correction (λ = None, α = 1)
    "fedspeed": dict(lr=0.1, rho=0.05, alpha=0.7, lam=5.0, weight_decay=1e-3),
    "sam": dict(lr=0.1, rho=0.05, lam=None, weight_decay=1e-3),
}


def _batch(seed: int, sample: tuple[int, ...] = (6,), dtype: torch.dtype = torch.float64) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(5, *sample, generator=gen, dtype=dtype), torch.randint(0, 3, (5,), generator=gen)


def _train_step(model: torch.nn.Module, opt: FedSpeedOptimizer) -> Callable:
    """One whole local step: the closure's forward and backward (twice with ρ > 0) and the optimizer's update."""

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        def closure() -> torch.Tensor:
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            return loss

        return opt.step(closure)

    return step


def _train(
    model_name: str,
    opt_name: str,
    dtype: torch.dtype,
    backend: str | None,
    fullgraph: bool = True,
    zero_grad: str = "optimizer",
) -> dict:
    """Two rounds (3 steps, then 2 at another lr) eagerly (backend None) or with the step compiled, the gradients
    zeroed once by the "optimizer" or the "model": each round's upload, the parameters, gradients, losses and
    compiled frame counts."""
    factory, sample = MODELS[model_name]
    model = factory(dtype)
    opt = FedSpeedOptimizer(model.parameters(), **OPTIMIZERS[opt_name])
    step = _train_step(model, opt)
    counter = None
    if backend is not None:
        torch._dynamo.reset()  # no sizes or scalars remembered from other tests' compilations of the same code
        counter = CompileCounterWithBackend(backend)
        step = torch.compile(step, backend=counter, fullgraph=fullgraph)
    out: dict = {"losses": [], "uploads": [], "frames": []}
    for rnd, seeds in enumerate(((0, 1, 2), (3, 4))):
        opt.param_groups[0]["lr"] = 0.1 / (rnd + 1)
        opt.begin_round()
        for seed in seeds:
            if seed == 1:
                (opt if zero_grad == "optimizer" else model).zero_grad()
            out["losses"].append(step(*_batch(seed, sample, dtype)).detach())
        out["frames"].append(counter.frame_count if counter else 0)
        out["uploads"].append(opt.end_round())
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["grads"] = [p.grad for p in model.parameters()]
    return out


def _assert_same_training(got: dict, expected: dict, tol: float, keys=("losses", "uploads", "params", "grads")) -> None:
    for key in keys:
        for a, b in zip(got[key], expected[key], strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=key)


@needs_traced_backward
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_optimizer_step_is_one_graph_equal_to_eager(model_name, opt_name, dtype):
    """``FedSpeedOptimizer.step(closure)`` compiled with fullgraph=True (forward, backward, perturbation, second
    forward and backward, fused update in one graph): the eager results over several steps and two rounds, one
    compilation for the steps of a round (a new lr recompiles: the scalars are specialised)."""
    expected = _train(model_name, opt_name, dtype, None)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = _train(model_name, opt_name, dtype, "aot_eager")
    assert got["frames"][0] == 1
    _assert_same_training(got, expected, 1e-12 if dtype == torch.float64 else 1e-6)


@needs_traced_backward
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("model_name", [m if m == "mlp" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def test_compiled_optimizer_step_under_inductor_equals_eager(model_name, opt_name):
    """The same in float32 under inductor, which generates its own kernels around the operators (to rounding)."""
    expected = _train(model_name, opt_name, torch.float32, None)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = _train(model_name, opt_name, torch.float32, "inductor")
    assert got["frames"][0] == 1
    _assert_same_training(got, expected, 1e-5)


@needs_traced_backward
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_training_step_and_optimizer_step_have_no_graph_breaks(opt_name):
    """explain() of the whole training step (closure included) and of ``opt.step()`` alone (ρ = 0, gradients from
    an eager backward) reports one graph and zero breaks."""
    model = _cnn()
    opt = FedSpeedOptimizer(model.parameters(), **OPTIMIZERS[opt_name])
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        report = torch._dynamo.explain(_train_step(model, opt))(*_batch(0, MODELS["cnn"][1]))
    assert (report.graph_count, report.graph_break_count) == (1, 0)
    opt = FedSpeedOptimizer(model.parameters(), **{**OPTIMIZERS[opt_name], "rho": 0.0})
    F.cross_entropy(model(_batch(0, MODELS["cnn"][1])[0]), _batch(0, MODELS["cnn"][1])[1]).backward()
    report = torch._dynamo.explain(opt.step)()
    assert (report.graph_count, report.graph_break_count) == (1, 0)


def test_compiled_step_with_graph_breaks_at_backward_equals_eager():
    """Without ``trace_autograd_ops`` Dynamo breaks the graph at ``backward()``; the step still gives the eager
    results (the pieces agree on how x̆ is reached)."""
    expected = _train("mlp", "fedspeed", torch.float64, None)
    got = _train("mlp", "fedspeed", torch.float64, "aot_eager", fullgraph=False)
    assert got["frames"][0] > 1  # the pieces between the breaks
    _assert_same_training(got, expected, 1e-12)


@needs_traced_backward
def test_compiled_step_after_model_zero_grad_equals_eager():
    """``model.zero_grad()`` sets every ``.grad`` to None; the compiled step still gathers the gradients into its flat
    buffers and gives the eager parameters and losses. (Dynamo does not write back the ``.grad`` rebinding of a
    graph that also traces ``backward()``, so ``.grad`` stays None after such a compiled step: docs/torch.md.)"""
    expected = _train("mlp", "fedspeed", torch.float64, None, zero_grad="model")
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        got = _train("mlp", "fedspeed", torch.float64, "aot_eager", zero_grad="model")
    _assert_same_training(got, expected, 1e-12, keys=("losses", "uploads", "params"))


def _sam_step(x: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """SAM on a flat parameter vector: g1 at x, x̆ = x + ρ·g1/‖g1‖, g2 at x̆, x ← x − η·(g2 + wd·x)."""
    shapes = [p.shape for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]

    def loss(flat: torch.Tensor) -> torch.Tensor:
        params, start = {}, 0
        for n, s in zip(names, shapes, strict=True):
            params[n] = flat[start : start + s.numel()].view(s)
            start += s.numel()
        return F.cross_entropy(torch.func.functional_call(model, params, (xb,)), yb)

    g1 = torch.func.grad(loss)(x)
    g2 = torch.func.grad(loss)(ops.sam_perturb(x, g1, 0.05))
    return ops.fedspeed_update_(x, g2, 0.1, weight_decay=1e-3)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_sam_step_equals_eager(backend):
    model = _mlp()
    x0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    xb, yb = _batch(0)
    expected = _sam_step(x0.clone(), xb, yb, model)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(_sam_step, backend=counter, fullgraph=True)
    got = compiled(x0.clone(), xb, yb, model)
    assert counter.frame_count == 1
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert torch._dynamo.explain(_sam_step)(x0.clone(), xb, yb, model).graph_break_count == 0


# Inductor's lowerings of the FedSpeed step's ops (CPU) ----------------------------------------------------------

_KERNEL_CALLS = ("torch.ops.pyfedkern.sam_perturb.default(", "torch.ops.pyfedkern.fedspeed_update_.default(")


def _perturb_then_update(x, g1, g2, anchor, out, lr=0.1, rho=0.05, clip_norm=None):
    """x̆ = sam_perturb(x, g1) written to ``out``, then FedSpeed's update of x with every term; (x̆, x)."""
    ops.sam_perturb(x, g1 * 1.5, rho, out=out)  # a computed gradient: inductor fuses its producer with the ops
    ops.fedspeed_update_(
        x, g2 + 0.0, lr, g1=g1, alpha=0.7, anchor=anchor, prox_coef=0.2, weight_decay=1e-3, clip_norm=clip_norm
    )
    return out, x


def _step_inputs(dtype: torch.dtype, d: int = 37) -> tuple:
    gen = torch.Generator().manual_seed(3)
    return (*[torch.randn(d, generator=gen, dtype=dtype) for _ in range(4)], torch.empty(d, dtype=dtype))


def _run_inductor(fn: Callable, args: tuple, **kwargs) -> tuple:
    """(fn's results compiled by inductor, the generated code) on clones of ``args``; no code cached from before."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: fn(*a, **kwargs), backend="inductor", fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, code = run_and_get_code(compiled, *[a.clone() for a in args])
    return got, "\n".join(code)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_inductor_fuses_sam_perturb_and_fedspeed_update_on_the_cpu(dtype):
    """On the CPU inductor generates the two ops' code itself (they fuse with the torch code that computes their
    inputs; the generated code calls neither operator), while the graph it is given holds the operators; the
    results equal the kernels' (eager) to rounding."""
    args = _step_inputs(dtype)
    expected = _perturb_then_update(*[a.clone() for a in args])
    got, code = _run_inductor(_perturb_then_update, args)
    assert not any(call in code for call in _KERNEL_CALLS)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_perturb_then_update, backend=keep_graph, fullgraph=True)(*[a.clone() for a in args])
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {"pyfedkern.sam_perturb", "pyfedkern.fedspeed_update_"} <= targets


def test_inductor_lowering_matches_the_kernel_in_edge_cases():
    """A zero gradient with eps = 0 (scale 0: x̆ = x, no division by zero), ρ = 0 and lr = 0 give the kernels'
    results under the lowering too."""
    x, g1, _, _, out = _step_inputs(torch.float64)
    zero = torch.zeros_like(g1)

    def f(x, g, out, rho, lr):
        ops.sam_perturb(x, g, rho, eps=0.0, out=out)
        ops.fedspeed_update_(x, g, lr, weight_decay=1e-3)
        return out, x

    for g, rho, lr in ((zero, 0.05, 0.1), (g1, 0.0, 0.0)):
        expected = f(x.clone(), g, out.clone(), rho, lr)
        got, code = _run_inductor(f, (x, g, out), rho=rho, lr=lr)
        assert not any(call in code for call in _KERNEL_CALLS)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_inductor_leaves_other_calls_to_the_kernels():
    """Where the lowering does not apply (a clipped update, a norm output, half precision) the generated code calls
    the operator and the results are the kernels' exactly; an argument the kernel refuses (lr < 0) still raises
    its message from compiled code (while tracing: the fake implementation runs the kernel's operand checks)."""
    args = _step_inputs(torch.float32)
    expected = _perturb_then_update(*[a.clone() for a in args], clip_norm=0.5)
    got, code = _run_inductor(_perturb_then_update, args, clip_norm=0.5)
    assert _KERNEL_CALLS[1] in code and _KERNEL_CALLS[0] not in code
    torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)  # g1 * 1.5 and g2 + 0 are inductor's

    x, g = (t.to(torch.float16) for t in args[:2])
    got, code = _run_inductor(lambda x, g: ops.sam_perturb(x, g, 0.05), (x, g))
    assert _KERNEL_CALLS[0] in code
    assert torch.equal(got, ops.sam_perturb(x, g, 0.05))

    norm = torch.empty(1)
    got, code = _run_inductor(lambda x, g, n: (ops.sam_perturb(x, g, 0.05, norm_out=n), n), (*args[:2], norm))
    assert _KERNEL_CALLS[0] in code
    torch.testing.assert_close(got[1], args[1].norm().reshape(1), rtol=1e-6, atol=0)

    with pytest.raises(Exception, match=r"lr must be >= 0\.0, got -1\.0"):  # Dynamo wraps the fake's ValueError
        _run_inductor(_perturb_then_update, args, lr=-1.0)


def test_export_traces_the_operators():
    def f(u, w):
        return ops.weighted_sum(u, w) * 2

    u, w = torch.randn(3, 5), torch.tensor([0.5, 0.25, 1.0])
    program = torch.export.export(_Wrap(f), (u, w))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "pyfedkern.weighted_sum.default" in targets
    assert torch.equal(program.module()(u, w), f(u, w))


class _Wrap(torch.nn.Module):
    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


def test_numpy_callers_are_unchanged():
    u = np.random.default_rng(0).standard_normal((3, 5))
    out = ops.weighted_sum(u, [1.0, 2.0, 3.0])
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, u.T @ np.array([1.0, 2.0, 3.0]), rtol=1e-12)


# The references of the two ops added to pyfedkern.reference with this registration --------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_norms_matches_reference_with_zero_and_huge_rows(dtype):
    from pyfedkern import reference

    x = np.random.default_rng(0).standard_normal((6, 9)).astype(dtype)
    x[2] = 0.0  # an all-zero row: norm 0, gradient 0
    x[4] *= 1e18 if dtype == np.float32 else 1e150  # ‖x‖² near the top of the dtype's range, still finite
    got = ops.row_norms(x)
    np.testing.assert_allclose(got, reference.row_norms(x), rtol=1e-6 if dtype == np.float32 else 1e-13)
    t = torch.from_numpy(x).double().requires_grad_()
    ops.row_norms(t).sum().backward()
    assert torch.equal(t.grad[2], torch.zeros(9, dtype=torch.float64))


def test_centred_gram_matches_reference_for_stacks_lists_and_a_large_mean():
    from pyfedkern import reference

    rng = np.random.default_rng(1)
    grads = rng.standard_normal((2, 5, 40)) + 1e4  # a mean far larger than the deviations
    np.testing.assert_allclose(ops.centred_gram(grads), reference.centred_gram(grads), rtol=1e-9, atol=1e-6)
    clients = [grads[0], grads[1, :3]]
    np.testing.assert_allclose(ops.centred_gram(clients), reference.centred_gram(clients), rtol=1e-9, atol=1e-6)
    single = torch.from_numpy(grads[0])
    torch.testing.assert_close(ops.centred_gram(single), reference.centred_gram(single), rtol=1e-9, atol=1e-6)


def test_compiling_works_when_pyfedkern_is_imported_before_torch(tmp_path):
    """The operators exist from ``import pyfedkern.ops`` on: a trace never has to register them."""
    import subprocess
    import sys

    code = (
        "from pyfedkern import ops\n"
        "import torch\n"
        "f = torch.compile(lambda u, w: ops.weighted_sum(u, w), backend='eager', fullgraph=True)\n"
        "u, w = torch.ones(2, 3), torch.tensor([1.0, 2.0])\n"
        "assert f(u, w).tolist() == [3.0, 3.0, 3.0]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=tmp_path)  # not a checkout in the cwd


def test_registered_in_place_operators_bump_the_versions_of_what_they_write():
    """Called as registered operators, in-place ops give every tensor they write (optional ones included, passed by
    position or by name) a new version; the read-only inputs keep theirs."""
    x, g = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    out, norm = torch.empty_like(x), torch.empty(1, dtype=torch.float64)
    before = (x._version, g._version, out._version, norm._version)
    torch.ops.pyfedkern.sam_perturb(x, g, 0.1, 1e-7, True, out, norm)
    assert (x._version, g._version) == before[:2] and out._version > before[2] and norm._version > before[3]
    version = out._version
    torch.ops.pyfedkern.accumulate_(acc=out, update=g, weight=0.5, weight_tensor=None)
    assert out._version > version
    torch.testing.assert_close(out, x + 0.1 * g / (g.norm() + 1e-7) + 0.5 * g, rtol=1e-12, atol=1e-12)
