"""class_feature_norms (forward, backward) and per-sample gradient norms against the references and torch.func."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pyfedkern
from pyfedkern import ops, persample, reference
from pyfedkern.testing import DTYPES, LIBS_CPU, make, pool_wakes, supports, to_numpy64, written_after_sleep

NORM_TOL = {"float64": 1e-13, "float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}


def _labels(lib: str, y: np.ndarray, dtype: str = "int64", device: str = "cpu"):
    if lib == "numpy":
        return y.astype(dtype)
    return torch.tensor(y, dtype=getattr(torch, dtype), device=device)


def _expected(f64: np.ndarray, y: np.ndarray, C: int):
    norms = np.sqrt((f64 * f64).sum(1))
    sums = np.array([norms[y == c].sum() for c in range(C)])
    counts = np.bincount(y, minlength=C)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    return norms, sums, means, counts


def _check(result, f64, y, C, dtype):
    norms, sums, means, counts = _expected(f64, y, C)
    tol = NORM_TOL[dtype]
    np.testing.assert_allclose(to_numpy64(result.norms), norms, rtol=tol, atol=1e-30)
    np.testing.assert_allclose(to_numpy64(result.class_sum), sums, rtol=tol, atol=1e-30)
    np.testing.assert_allclose(to_numpy64(result.class_mean), means, rtol=tol, atol=1e-30)
    assert np.array_equal(to_numpy64(result.counts), counts)


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "D", "C"), [(1, 1, 1), (1, 7, 3), (5, 17, 4), (300, 129, 10), (1030, 512, 100)])
def test_matches_reference(lib, dtype, B, D, C):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")
    rng = np.random.default_rng(B * 31 + D)
    x = rng.standard_normal((B, D)) * rng.choice([1e-3, 1.0, 30.0], size=(B, 1))
    y = rng.integers(0, C, B)
    feats = make(lib, x, dtype)
    res = ops.class_feature_norms(feats, _labels(lib, y), C)
    assert type(res.norms) is type(feats) and str(res.norms.dtype) == str(feats.dtype)
    assert tuple(res.norms.shape) == (B,) and tuple(res.class_mean.shape) == (C,) and res.correct is None
    _check(res, to_numpy64(feats), y, C, dtype)
    if dtype in ("float32", "float64"):
        ref = reference.class_feature_norms(feats, _labels(lib, y), C)
        _check(ref, to_numpy64(feats), y, C, dtype)


@pytest.mark.parametrize("lib", LIBS_CPU)
def test_all_labels_in_one_class_and_empty_classes(lib):
    x = np.random.default_rng(0).standard_normal((50, 9))
    res = ops.class_feature_norms(make(lib, x, "float64"), _labels(lib, np.full(50, 3)), 6)
    counts, means, sums = to_numpy64(res.counts), to_numpy64(res.class_mean), to_numpy64(res.class_sum)
    assert counts.tolist() == [0, 0, 0, 50, 0, 0]
    assert means[[0, 1, 2, 4, 5]].tolist() == [0.0] * 5 and sums[[0, 1, 2, 4, 5]].tolist() == [0.0] * 5
    assert not np.any(np.isnan(means))
    np.testing.assert_allclose(means[3], np.linalg.norm(x, axis=1).mean(), rtol=1e-14)


def test_correct_count_from_logits():
    rng = np.random.default_rng(1)
    B, C = 333, 7
    logits = rng.standard_normal((B, C)).astype(np.float32)
    y = rng.integers(0, C, B)
    y[:40] = logits[:40].argmax(1)
    res = ops.class_feature_norms(rng.standard_normal((B, 5)).astype(np.float32), y, C, logits=logits)
    assert int(res.correct) == int((logits.argmax(1) == y).sum())
    ref = reference.class_feature_norms(rng.standard_normal((B, 5)), y, C, logits=logits)
    assert int(ref.correct) == int(res.correct)
    # ties go to the first maximum, NaN counts as the maximum (numpy/torch argmax)
    tie = np.array([[1.0, 1.0, 0.0], [0.0, np.nan, 5.0], [2.0, 2.0, 2.0]], np.float32)
    out = ops.class_feature_norms(np.ones((3, 2), np.float32), np.array([0, 1, 1]), 3, logits=tie)
    assert int(out.correct) == 2
    t = ops.class_feature_norms(torch.ones(3, 2), torch.tensor([0, 1, 0]), 3, logits=torch.from_numpy(tie))
    assert isinstance(t.correct, torch.Tensor) and t.correct.dtype == torch.int64 and int(t.correct) == 3


def test_strided_features_labels_and_int32():
    rng = np.random.default_rng(2)
    base = rng.standard_normal((40, 66))
    y = rng.integers(0, 5, 80)
    views = [base[::2, 1::3], base.T.copy().T, base[:, ::-1]]
    for v in views:
        lab = y[: v.shape[0] * 2 : 2]
        res = ops.class_feature_norms(v, lab.astype(np.int32), 5)
        _check(res, v, lab, 5, "float64")
    t = torch.from_numpy(base.astype(np.float32))
    res = ops.class_feature_norms(t.T.contiguous().T[:, 3:], torch.from_numpy(y[::2]).to(torch.int16), 5)
    _check(res, base[:, 3:], y[::2], 5, "float32")


def test_results_do_not_depend_on_thread_count():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20_000, 65)).astype(np.float32)  # enough rows for the pool
    y = rng.integers(0, 13, 20_000)
    before = pyfedkern.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            pyfedkern.set_num_threads(n)
            with pool_wakes(n > 1):
                outs.append(ops.class_feature_norms(x, y, 13))
    finally:
        pyfedkern.set_num_threads(before)
    for r in outs[1:]:
        for a, b in zip(r[:4], outs[0][:4], strict=True):
            assert np.array_equal(a, b)


def test_zero_rows_have_zero_norm_and_zero_gradient():
    f = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    res = ops.class_feature_norms(f, torch.tensor([0, 0, 1]), 2)
    assert res.norms.tolist() == [0.0] * 3
    (res.norms.sum() + res.class_mean.sum()).backward()
    assert torch.all(f.grad == 0)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 40), D=st.integers(1, 40), C=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_property_matches_numpy(B, D, C, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, D)) * 10.0 ** rng.integers(-3, 4)
    y = rng.integers(0, C, B)
    _check(ops.class_feature_norms(x, y, C), x, y, C, "float64")


# backward ------------------------------------------------------------------------------------------------


def _objective(res, wn, ws, wm):
    return (res.norms * wn).sum() + (res.class_sum * ws).sum() + (res.class_mean * wm).sum()


def test_backward_matches_finite_differences_float64():
    torch.manual_seed(0)
    B, D, C = 9, 6, 4
    f = torch.randn(B, D, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1, 1, 3, 3, 3, 0, 1, 3])  # class 2 is empty
    wn, ws, wm = torch.randn(B, dtype=torch.float64), torch.randn(C, dtype=torch.float64), torch.randn(C).double()
    assert torch.autograd.gradcheck(
        lambda t: _objective(ops.class_feature_norms(t, y, C), wn, ws, wm), (f,), eps=1e-6, atol=1e-8
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_matches_autograd_through_reference(dtype):
    torch.manual_seed(1)
    B, D, C = 257, 33, 10
    x = torch.randn(B, D, dtype=dtype)
    y = torch.randint(0, C - 1, (B,))
    weights = torch.randn(B, dtype=dtype), torch.randn(C, dtype=dtype), torch.randn(C, dtype=dtype)
    grads = []
    for fn in (ops.class_feature_norms, reference.class_feature_norms):
        f = x.clone().requires_grad_(True)
        _objective(fn(f, y, C), *weights).backward()
        grads.append(f.grad)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(grads[0], grads[1], rtol=tol, atol=tol)
    # each output alone (the others' gradients are None in backward)
    for part in ("norms", "class_sum", "class_mean"):
        f = x.clone().requires_grad_(True)
        getattr(ops.class_feature_norms(f, y, C), part).sum().backward()
        g = x.clone().requires_grad_(True)
        getattr(reference.class_feature_norms(g, y, C), part).sum().backward()
        torch.testing.assert_close(f.grad, g.grad, rtol=tol, atol=tol)


def test_backward_strided_features_and_no_grad_mode():
    base = torch.randn(20, 30, dtype=torch.float64)
    f = base.T.contiguous().T[:, 2:].requires_grad_(True)
    y = torch.randint(0, 3, (20,))
    ops.class_feature_norms(f, y, 3).class_mean.sum().backward()
    g = base[:, 2:].clone().requires_grad_(True)
    reference.class_feature_norms(g, y, 3).class_mean.sum().backward()
    torch.testing.assert_close(f.grad, g.grad)
    with torch.no_grad():
        assert not ops.class_feature_norms(f, y, 3).norms.requires_grad


# bad input -----------------------------------------------------------------------------------------------

F32 = np.ones((4, 3), np.float32)
Y = np.array([0, 1, 2, 1])


@pytest.mark.parametrize(
    ("features", "labels", "C", "logits", "exc", "match"),
    [
        (F32, np.array([0, 1, 5, 1]), 3, None, ValueError, r"labels\[2\] = 5 is out of range \[0, 3\)"),
        (F32, np.array([0, -1, 0, 1]), 3, None, ValueError, "out of range"),
        (F32, Y.astype(np.float32), 3, None, TypeError, "integer dtype"),
        (F32, Y.astype(bool), 3, None, TypeError, "integer dtype"),
        (F32, Y[:3], 3, None, ValueError, r"labels must have shape \(4,\)"),
        (F32, torch.tensor(Y), 3, None, ValueError, "mixing"),
        (F32, Y, 0, None, ValueError, "num_classes must be an integer >= 1"),
        (F32, Y, 2.5, None, ValueError, "num_classes"),
        (F32, Y, True, None, ValueError, "num_classes"),
        (np.ones(4, np.float32), Y, 3, None, ValueError, "2-D"),
        (np.ones((0, 3), np.float32), Y[:0], 3, None, ValueError, "empty"),
        (np.ones((4, 3), np.int64), Y, 3, None, TypeError, "dtype int64"),
        ([[1.0]], Y, 3, None, TypeError, "numpy array, torch tensor or cupy array"),
        (F32, Y, 3, np.ones((4, 2), np.float32), ValueError, r"logits must have shape \(4, 3\)"),
        (F32, Y, 3, np.ones((4, 3), np.float64), TypeError, "logits has dtype float64"),
    ],
)
def test_bad_input(features, labels, C, logits, exc, match):
    with pytest.raises(exc, match=match):
        ops.class_feature_norms(features, labels, C, logits=logits)


def test_bad_input_on_the_differentiable_torch_path():
    f = torch.ones(4, 3, requires_grad=True)
    y = torch.tensor(Y)
    with pytest.raises(ValueError, match=r"labels\[2\] = 5 is out of range"):
        ops.class_feature_norms(f, torch.tensor([0, 1, 5, 1]), 3)
    with pytest.raises(TypeError, match="integer dtype"):
        ops.class_feature_norms(f, y.float(), 3)
    with pytest.raises(ValueError, match="2-D"):
        ops.class_feature_norms(torch.ones(4, 3, 1, requires_grad=True), y, 3)
    with pytest.raises(TypeError, match="logits has dtype float64"):
        ops.class_feature_norms(f, y, 3, logits=torch.ones(4, 3, dtype=torch.float64))


# per-sample gradient norms --------------------------------------------------------------------------------


def _layer_grads(layer: nn.Module, x: torch.Tensor):
    """(input, per-sample output gradient) of a layer under a random per-sample loss."""
    out = layer(x)
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * w).sum(), out)
    return x, g


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6, 11), (5, 7, 11), (3, 40, 11), (2, 3, 4, 11)])
def test_linear_per_sample_norms_match_reference(bias, shape):
    torch.manual_seed(2)
    layer = nn.Linear(11, 5, bias=bias).double()
    a, g = _layer_grads(layer, torch.randn(*shape, dtype=torch.float64))
    ours = ops.per_sample_grad_norms(layer, a, g)
    torch.testing.assert_close(ours, reference.per_sample_grad_norms(layer, a, g), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("layer", "shape"),
    [(nn.Linear(11, 5), (0, 11)), (nn.Linear(11, 5), (0, 7, 11)), (nn.Conv2d(3, 4, 3), (0, 3, 9, 8))],
)
def test_per_sample_norms_of_an_empty_batch_are_empty(layer, shape):
    a, g = _layer_grads(layer.double(), torch.randn(*shape, dtype=torch.float64))
    assert ops.per_sample_grad_norms(layer, a, g).shape == (0,)  # (the reference cannot reshape an empty batch)


def test_gram_and_materialised_paths_agree():
    from pyfedkern.ops.norms import _sequence_sq_norms, gram_is_cheaper

    assert gram_is_cheaper(4, 64, 64) and not gram_is_cheaper(784, 9, 32)
    a, g = torch.randn(3, 6, 20, dtype=torch.float64), torch.randn(3, 6, 30, dtype=torch.float64)
    w = nn.Parameter(torch.zeros(1))
    direct = torch.einsum("bto,bti->boi", g, a).pow(2).sum((1, 2))
    torch.testing.assert_close(_sequence_sq_norms(a, g, w, None), direct)  # Gram (T=6)
    a2, g2 = torch.randn(3, 50, 4, dtype=torch.float64), torch.randn(3, 50, 5, dtype=torch.float64)
    direct2 = torch.einsum("bto,bti->boi", g2, a2).pow(2).sum((1, 2))
    torch.testing.assert_close(_sequence_sq_norms(a2, g2, w, None), direct2)  # materialised (T=50)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel_size": 3},
        {"kernel_size": 3, "padding": 1, "stride": 2},
        {"kernel_size": (2, 3), "dilation": 2, "bias": False},
        {"kernel_size": 3, "padding": "same"},
        {"kernel_size": 4, "padding": "same", "dilation": 2},
        {"kernel_size": 3, "padding": (2, 0), "stride": (3, 2), "dilation": (1, 2)},
        {"kernel_size": 3, "padding": "valid", "stride": 4},
        {"kernel_size": 3, "stride": 3, "in_channels": 16, "out_channels": 16},  # Gram form (T = 6)
        {"kernel_size": 3, "padding": "same", "in_channels": 16, "out_channels": 24, "input": (3, 3)},  # Gram, T=9
    ],
)
def test_conv2d_per_sample_norms_match_reference(kwargs):
    """Per-sample weight gradients as a grouped convolution (the first seven) or in the Gram form (the last two)."""
    from pyfedkern.ops.norms import gram_is_cheaper

    torch.manual_seed(3)
    kwargs = dict(kwargs)
    c_in, c_out, size = kwargs.pop("in_channels", 3), kwargs.pop("out_channels", 4), kwargs.pop("input", (9, 8))
    layer = nn.Conv2d(c_in, c_out, **kwargs).double()
    a, g = _layer_grads(layer, torch.randn(5, c_in, *size, dtype=torch.float64))
    patch = c_in * layer.kernel_size[0] * layer.kernel_size[1]
    assert gram_is_cheaper(g.shape[2] * g.shape[3], patch, c_out) == (c_in == 16)
    torch.testing.assert_close(
        ops.per_sample_grad_norms(layer, a, g), reference.per_sample_grad_norms(layer, a, g), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("chunk_elements", [100, 2000])
def test_per_sample_norms_in_several_batch_chunks_match_reference(monkeypatch, chunk_elements):
    """Tiny chunk budgets split the batch of 7 into chunks of 1 or 2 (the last one partial) on every path."""
    import pyfedkern.ops.norms as norms_module

    monkeypatch.setattr(norms_module, "_CHUNK_ELEMENTS", {"cpu": chunk_elements, "gpu": chunk_elements})
    torch.manual_seed(6)
    cases = [
        (nn.Conv2d(3, 4, 3, padding=1), (7, 3, 6, 5)),  # grouped weight gradients, 108 elements per sample
        (nn.Conv2d(3, 4, 3, padding="same", bias=False), (7, 3, 6, 5)),
        (nn.Conv2d(12, 12, 3, stride=2), (7, 12, 5, 5)),  # Gram (T=4, 108 inputs), 464 elements per sample
        (nn.Linear(20, 20), (7, 2, 20)),  # Gram (T=2), 48 elements per sample
        (nn.Linear(6, 5), (7, 9, 6)),  # materialised (T=9)
    ]
    for layer, shape in cases:
        layer = layer.double()
        a, g = _layer_grads(layer, torch.randn(*shape, dtype=torch.float64))
        torch.testing.assert_close(
            ops.per_sample_grad_norms(layer, a, g), reference.per_sample_grad_norms(layer, a, g), rtol=1e-12, atol=1e-12
        )


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2)
        self.fc1 = nn.Linear(8 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("which", ["linear", "conv2d", "cnn", "mlp-frozen"])
def test_grad_norms_match_torch_func(which, dtype):
    torch.manual_seed(4)
    if which == "linear":
        model, x = nn.Linear(13, 4), torch.randn(16, 13)
    elif which == "conv2d":
        model, x = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten()), torch.randn(8, 2, 6, 6)
    elif which == "cnn":
        model, x = SmallCNN(), torch.randn(12, 1, 28, 28)
    else:
        model, x = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, 3)), None
        x = torch.randn(10, 10)
        model[2].weight.requires_grad_(False)
    model, x = model.to(dtype), x.to(dtype)
    out_dim = model(x[:1]).shape[1]
    y = torch.randint(0, out_dim, (x.shape[0],))
    ours = persample.grad_norms(model, F.cross_entropy, x, y)
    expected = reference.grad_norms(model, F.cross_entropy, x, y)
    tol = 1e-11 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(ours, expected, rtol=tol, atol=tol)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(label_smoothing=0.2),
        nn.CrossEntropyLoss(reduction="sum"),
        lambda o, t: F.nll_loss(F.log_softmax(o, 1), t),
    ],
    ids=["ce-label-smoothing", "ce-sum", "log-softmax-nll (vmap)"],
)
def test_grad_norms_losses_match_torch_func(loss_fn):
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 4)).double()
    x, y = torch.randn(11, 7, dtype=torch.float64), torch.randint(0, 4, (11,))
    torch.testing.assert_close(
        persample.grad_norms(model, loss_fn, x, y), reference.grad_norms(model, loss_fn, x, y), rtol=1e-11, atol=1e-11
    )


def test_grad_norms_per_pixel_cross_entropy_matches_torch_func():
    """[B, C, H, W] logits: one sample's cross-entropy is its mean over its H·W pixels (not the batch sum)."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 1)).double()
    x, y = torch.randn(5, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5, 6, 6))
    torch.testing.assert_close(
        persample.grad_norms(model, F.cross_entropy, x, y),
        reference.grad_norms(model, F.cross_entropy, x, y),
        rtol=1e-11,
        atol=1e-11,
    )


def test_grad_norms_cross_entropy_is_summed_without_vmap(monkeypatch):
    """F.cross_entropy and a plain nn.CrossEntropyLoss take one batched loss; class weights go through vmap."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64))
    expected = {fn: reference.grad_norms(model, fn, x, y) for fn in (F.cross_entropy, weighted)}
    calls = []
    vmap = torch.func.vmap
    monkeypatch.setattr(torch.func, "vmap", lambda *a, **k: calls.append(1) or vmap(*a, **k))
    for fn in (F.cross_entropy, nn.CrossEntropyLoss()):
        torch.testing.assert_close(persample.grad_norms(model, fn, x, y), expected[F.cross_entropy])
    assert calls == []
    torch.testing.assert_close(persample.grad_norms(model, weighted, x, y), expected[weighted])
    assert calls == [1]
    # a sample whose target is ignore_index has no gradient: norm 0 (the others are unchanged)
    y_ignored = y.clone()
    y_ignored[2] = -100
    norms = persample.grad_norms(model, F.cross_entropy, x, y_ignored)
    assert norms[2] == 0
    torch.testing.assert_close(norms[[0, 1, 3]], expected[F.cross_entropy][[0, 1, 3]])


class _SideBranch(nn.Module):
    """A trainable layer whose output is discarded, and a frozen one that makes the output."""

    def __init__(self, frozen_output: bool) -> None:
        super().__init__()
        self.side, self.head = nn.Linear(3, 2), nn.Linear(3, 2)
        self.head.requires_grad_(not frozen_output)

    def forward(self, x):
        self.side(x)
        return self.head(x)


@pytest.mark.parametrize("frozen_output", [True, False])
def test_grad_norms_layers_that_do_not_reach_the_loss_count_zero(frozen_output):
    torch.manual_seed(10)
    model = _SideBranch(frozen_output)
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    torch.testing.assert_close(
        persample.grad_norms(model, F.cross_entropy, x, y), reference.grad_norms(model, F.cross_entropy, x, y)
    )
    if frozen_output:
        assert (persample.grad_norms(model, F.cross_entropy, x, y) == 0).all()


def test_grad_norms_batch_of_one_and_mse_loss():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    x, y = torch.randn(1, 4, dtype=torch.float64), torch.randn(1, 2, dtype=torch.float64)
    torch.testing.assert_close(
        persample.grad_norms(model, F.mse_loss, x, y), reference.grad_norms(model, F.mse_loss, x, y)
    )


def test_grad_norms_errors():
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(TypeError, match=r"LayerNorm.*not supported"):
        persample.grad_norms(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 2)), F.cross_entropy, x, y)
    with pytest.raises(ValueError, match="training mode"):
        persample.grad_norms(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False)), F.cross_entropy, x, y)
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="more than once"):
        persample.grad_norms(nn.Sequential(shared, nn.ReLU(), shared), F.cross_entropy, x, torch.randint(0, 3, (4,)))
    with pytest.raises(ValueError, match="no trainable"):
        persample.grad_norms(nn.ReLU(), F.cross_entropy, x, y)
    with pytest.raises(ValueError, match=r"scalar for one sample, got \(2,\)"):
        persample.grad_norms(nn.Linear(3, 2), lambda o, t: (o - t).square()[0], x, torch.randn(4, 2))
    with pytest.raises(TypeError, match=r"Linear and nn\.Conv2d"):
        ops.per_sample_grad_norms(nn.LayerNorm(3), x, x)
    with pytest.raises(ValueError, match="groups=2"):
        ops.per_sample_grad_norms(nn.Conv2d(2, 2, 1, groups=2), torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3))
    conv = nn.Conv2d(2, 3, 2, stride=(1, 2))  # a [1, 2, 4, 7] input gives a [1, 3, 3, 3] output
    ops.per_sample_grad_norms(conv, torch.randn(1, 2, 4, 7), torch.randn(1, 3, 3, 3))
    for wrong in ((3, 4), (1, 9), (9, 1)):  # (1, 9) and (9, 1) have the right number of positions
        with pytest.raises(ValueError, match=r"spatial size .* does not match the layer's output \(3, 3\)"):
            ops.per_sample_grad_norms(conv, torch.randn(1, 2, 4, 7), torch.randn(1, 3, *wrong))
    with pytest.raises(ValueError, match="same batch size"):
        ops.per_sample_grad_norms(nn.Linear(3, 2), torch.randn(4, 3), torch.randn(3, 2))
    with pytest.raises(ValueError, match="do not match"):
        ops.per_sample_grad_norms(nn.Linear(3, 2), torch.randn(4, 3), torch.randn(4, 5))


# CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "D", "C"), [(1, 1, 1), (5, 33, 4), (4096, 512, 100)])
def test_cuda_matches_reference(dtype, B, D, C):
    rng = np.random.default_rng(B + D)
    x = rng.standard_normal((B, D))
    y = rng.integers(0, C, B)
    logits = rng.standard_normal((B, C))
    feats = make("torch", x, dtype, "cuda")
    res = ops.class_feature_norms(
        feats, _labels("torch", y, device="cuda"), C, logits=make("torch", logits, dtype, "cuda")
    )
    assert res.norms.device.type == "cuda" and res.counts.device.type == "cuda"
    _check(res, to_numpy64(feats), y, C, dtype)
    expected_correct = int((to_numpy64(make("torch", logits, dtype)).argmax(1) == y).sum())
    assert int(res.correct) == expected_correct
    cpu = ops.class_feature_norms(feats.cpu(), torch.from_numpy(y).to(torch.int32), C)
    assert torch.equal(cpu.counts, res.counts.cpu())


@pytest.mark.cuda
def test_cuda_runs_on_the_current_stream():
    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((600, 90)), rng.integers(0, 7, 600)
    labels = torch.from_numpy(y).cuda()
    stream = torch.cuda.Stream()
    late = written_after_sleep(stream, torch.from_numpy(x).cuda())  # right answers prove the op ran on `stream`
    stream.wait_stream(torch.cuda.current_stream())  # the labels are on the device before `stream` reads them
    with torch.cuda.stream(stream):
        res = ops.class_feature_norms(late, labels, 7)
    stream.synchronize()
    _check(res, x, y, 7, "float64")


@pytest.mark.cuda
def test_cuda_backward_and_label_errors():
    torch.manual_seed(6)
    x = torch.randn(300, 70, dtype=torch.float64, device="cuda")
    y = torch.randint(0, 9, (300,), device="cuda")
    grads = []
    for fn in (ops.class_feature_norms, reference.class_feature_norms):
        f = x.clone().requires_grad_(True)
        r = fn(f, y, 10)
        (r.norms.sum() + (r.class_mean * torch.arange(10, device="cuda")).sum()).backward()
        grads.append(f.grad)
    torch.testing.assert_close(grads[0], grads[1])
    # on the GPU an out-of-range label is reported in the outputs (no host round trip to raise)
    res = ops.class_feature_norms(x, torch.full((300,), 10, device="cuda"), 10)
    assert torch.isnan(res.class_mean).all() and (res.counts == -1).all()
    f = x.clone().requires_grad_(True)
    y_bad = y.clone()
    y_bad[3] = -1
    ops.class_feature_norms(f, y_bad, 10).class_mean.sum().backward()
    assert torch.isnan(f.grad[3]).all() and torch.isfinite(f.grad[4]).all()


@pytest.mark.cuda
def test_cuda_grad_norms_match_torch_func():
    torch.manual_seed(7)
    model = SmallCNN().cuda()
    x, y = torch.randn(16, 1, 28, 28, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    torch.testing.assert_close(
        persample.grad_norms(model, F.cross_entropy, x, y),
        reference.grad_norms(model, F.cross_entropy, x, y),
        rtol=2e-5,
        atol=2e-5,
    )


# benchmark cases compute what they claim -------------------------------------------------------------------


def test_benchmark_peers_agree_with_pyfedkern():
    from pyfedkern.benchmarks import norms as bench

    cases = bench.cases(quick=True)
    first_norm = [c for c in cases if c.group == cases[0].group and not c.is_limit]
    results = {c.name: c.make()() for c in first_norm}
    ours = results.pop("pyfedkern")
    for name, value in results.items():
        torch.testing.assert_close(value[0], ours.norms, msg=name)
        torch.testing.assert_close(value[-1 if "loop" in name else 2], ours.class_mean, msg=name)
    grad_group = next(c.group for c in cases if c.group.startswith("grad_norms cnn"))
    grads = {c.name: c.make()() for c in cases if c.group == grad_group and not c.is_limit}
    ours = grads.pop("pyfedkern")
    assert len(grads) >= 2
    for name, value in grads.items():
        torch.testing.assert_close(value, ours, rtol=1e-4, atol=1e-5, msg=name)
