"""sam_perturb, fedspeed_update_ and fedspeed_round_end_ against the float64 reference: dtypes, libraries, sizes,
strided views, clipping, zero gradients, thread-count invariance, bad input, and CUDA when present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern.testing import DTYPES, LIBS_CPU, REL_TOL, make, pool_wakes, supports, to_numpy64

SIZES = [1, 7, 4097, 40_003]


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    return to_numpy64(make("torch", values, dtype))


def assert_close(result, expected: np.ndarray, scale: np.ndarray, dtype: str) -> None:
    err = np.abs(to_numpy64(result) - expected)
    tol = REL_TOL[dtype] * (scale + np.finfo(np.float64).tiny) + (6e-8 if dtype == "float16" else 0.0)
    assert np.all(err <= tol), f"max err {err.max()} (tol there {tol[np.argmax(err - tol)]})"


def acc_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def skip_unsupported(lib, dtype):
    if not supports(lib, dtype):
        pytest.skip("numpy has no bfloat16")


# sam_perturb ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize("normalize", [True, False])
def test_perturb_matches_reference(lib, dtype, d, normalize):
    skip_unsupported(lib, dtype)
    rng = np.random.default_rng(d)
    x, g = rng.standard_normal(d), rng.standard_normal(d) * 1e-2
    xr, gr = rounded(x, dtype), rounded(g, dtype)
    norm = make(lib, np.zeros(1), acc_dtype(dtype)) if normalize else None
    out = ops.sam_perturb(make(lib, x, dtype), make(lib, g, dtype), 0.05, normalize=normalize, norm_out=norm)
    assert type(out).__module__.split(".")[0] == lib and str(out.dtype).removeprefix("torch.") == dtype
    norm_ref = np.zeros(1)
    expected = reference.sam_perturb(xr, gr, 0.05, normalize=normalize, norm_out=norm_ref if normalize else None)
    s = 0.05 / (norm_ref[0] + 1e-7) if normalize else 0.05
    assert_close(out, expected, np.abs(xr) + s * np.abs(gr), dtype)
    if normalize:
        assert abs(to_numpy64(norm)[0] - norm_ref[0]) <= 1e-6 * norm_ref[0]


def test_perturb_into_second_buffer_and_in_place():
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    keep = x.copy()
    second = np.empty_like(x)
    assert ops.sam_perturb(x, g, 0.1, out=second) is second
    assert np.array_equal(x, keep), "x must not change when out is a second buffer"
    ops.sam_perturb(x, g, 0.1, out=x)
    assert np.array_equal(x, second)


def test_perturb_has_norm_rho():
    rng = np.random.default_rng(2)
    x, g = rng.standard_normal(5000), rng.standard_normal(5000)
    out = ops.sam_perturb(x, g, 0.3, eps=0.0)
    assert abs(np.linalg.norm(out - x) - 0.3) < 1e-12


@pytest.mark.parametrize("eps", [0.0, 1e-7])
@pytest.mark.parametrize("lib", LIBS_CPU)
def test_zero_gradient_gives_x(eps, lib):
    x = make(lib, np.linspace(-1, 1, 1001), "float32")
    g = make(lib, np.zeros(1001), "float32")
    norm = make(lib, np.full(1, 7.0), "float32")
    out = ops.sam_perturb(x, g, 0.1, eps=eps, norm_out=norm)
    assert np.array_equal(to_numpy64(out), to_numpy64(x)) and to_numpy64(norm)[0] == 0.0
    ref = reference.sam_perturb(x, g, 0.1, eps=eps)
    assert np.array_equal(to_numpy64(ref), to_numpy64(x))


def test_perturb_strided_views():
    rng = np.random.default_rng(3)
    base_x, base_g = rng.standard_normal(9000), rng.standard_normal(9000)
    x, g = base_x[::3].astype(np.float64), base_g[::-3]
    out = np.zeros(6000)
    ops.sam_perturb(x, g, 0.2, out=out[::2])
    expected = reference.sam_perturb(x, g, 0.2)
    assert np.allclose(out[::2], expected, rtol=1e-14, atol=1e-14) and np.all(out[1::2] == 0)
    t = torch.from_numpy(base_x.astype(np.float32))
    out_t = ops.sam_perturb(t[1::2], t[::2], 0.2)
    assert torch.allclose(out_t, reference.sam_perturb(t[1::2], t[::2], 0.2), rtol=1e-6, atol=1e-6)


# fedspeed_update_ ----------------------------------------------------------------------------------------

UPDATE_CASES = [
    # alpha, prox_coef, weight_decay, clip_norm
    (1.0, 0.0, 0.0, None),
    (1.0, 0.1, 1e-3, None),
    (0.9375, 0.1, 1e-3, None),
    (0.0, 0.001, 0.0, None),
    (1.0, 0.1, 1e-3, 10.0),
    (0.5, 0.1, 1e-3, 0.5),  # the clip is active
    (0.75, 0.0, 1e-2, 1e-3),
]


def update_inputs(d: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal(d) * 3


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", SIZES)
@pytest.mark.parametrize(("alpha", "c", "wd", "clip"), UPDATE_CASES)
def test_update_matches_reference(lib, dtype, d, alpha, c, wd, clip):
    skip_unsupported(lib, dtype)
    x, g1, g2, anchor = update_inputs(d, d + int(alpha * 100))
    xr, g1r, g2r, dr = (rounded(v, dtype) for v in (x, g1, g2, anchor))
    xa = make(lib, x, dtype)
    norm = make(lib, np.zeros(1), acc_dtype(dtype)) if clip else None
    kwargs = dict(alpha=alpha, prox_coef=c, weight_decay=wd, clip_norm=clip)
    result = ops.fedspeed_update_(
        xa, make(lib, g2, dtype), 0.1, g1=make(lib, g1, dtype), anchor=make(lib, anchor, dtype), norm_out=norm, **kwargs
    )
    assert result is xa
    expected = xr.copy()
    norm_ref = np.zeros(1)
    reference.fedspeed_update_(expected, g2r, 0.1, g1=g1r, anchor=dr, norm_out=norm_ref if clip else None, **kwargs)
    v_abs = (1 - alpha) * np.abs(g1r) + alpha * np.abs(g2r) + c * np.abs(dr)
    assert_close(xa, expected, np.abs(xr) + 0.1 * (v_abs + (c + wd) * np.abs(xr)), dtype)
    if clip:
        assert abs(to_numpy64(norm)[0] - norm_ref[0]) <= 1e-6 * norm_ref[0]


def test_update_is_algorithm_one_step():
    """x − η[g̃ − ĝ + (1/λ)(x − x^t) + wd·x] with D = h − x^t and h = −λ·ĝ."""
    rng = np.random.default_rng(4)
    d, lam, eta, alpha, wd = 2000, 7.0, 0.05, 0.9, 1e-3
    x, x_t, g_hat, g1, g2 = (rng.standard_normal(d) for _ in range(5))
    h = -lam * g_hat
    g_tilde = (1 - alpha) * g1 + alpha * g2
    expected = x - eta * (g_tilde - g_hat + (x - x_t) / lam + wd * x)
    out = x.copy()
    ops.fedspeed_update_(out, g2, eta, g1=g1, alpha=alpha, anchor=h - x_t, prox_coef=1 / lam, weight_decay=wd)
    assert np.allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_update_clip_matches_torch_clip_grad_norm_then_sgd():
    """The reference code: clip_grad_norm_(g2 + D/λ, M), then SGD with weight_decay = wd + 1/λ."""
    torch.manual_seed(0)
    d, c, wd, lr, clip = 3000, 0.1, 1e-3, 0.1, 10.0
    x, g2, anchor = torch.randn(d), torch.randn(d), torch.randn(d) * 400
    p = torch.nn.Parameter(x.clone())
    p.grad = g2 + c * anchor
    torch.nn.utils.clip_grad_norm_([p], clip)
    torch.optim.SGD([p], lr=lr, weight_decay=wd + c).step()
    ours = x.clone()
    ops.fedspeed_update_(ours, g2, lr, anchor=anchor, prox_coef=c, weight_decay=wd, clip_norm=clip)
    assert torch.allclose(ours, p.detach(), rtol=1e-5, atol=1e-6)


def test_update_does_not_read_unused_inputs():
    x = np.ones(100, np.float32)
    nan = np.full(100, np.nan, np.float32)
    ops.fedspeed_update_(x, np.ones(100, np.float32), 0.5, g1=nan, alpha=1.0, anchor=nan, prox_coef=0.0)
    assert np.all(x == 0.5)


def test_update_strided():
    rng = np.random.default_rng(5)
    base = rng.standard_normal((4, 5000))
    x = np.array(base[0])
    big = np.zeros(10_000)
    big[::2] = x
    ops.fedspeed_update_(big[::2], base[1], 0.1, g1=base[2], alpha=0.5, anchor=base[3][::-1], prox_coef=0.2)
    reference.fedspeed_update_(x, base[1], 0.1, g1=base[2], alpha=0.5, anchor=base[3][::-1], prox_coef=0.2)
    assert np.allclose(big[::2], x, rtol=1e-14, atol=1e-14) and np.all(big[1::2] == 0)


# fedspeed_round_end_ -------------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 4097])
@pytest.mark.parametrize("mode", ["h_only", "acc_with_h", "acc_without_h_and_sum"])
def test_round_end_matches_reference(lib, dtype, d, mode):
    skip_unsupported(lib, dtype)
    rng = np.random.default_rng(d)
    h, xk, xt, acc, hs = (rng.standard_normal(d) for _ in range(5))
    arrays = {k: make(lib, v, dtype) for k, v in dict(h=h, xk=xk, xt=xt, acc=acc, hs=hs).items()}
    expect = {k: rounded(v, dtype) for k, v in dict(h=h, xk=xk, xt=xt, acc=acc, hs=hs).items()}
    kwargs: dict = {}
    ref_kwargs: dict = {}
    if mode != "h_only":
        kwargs = dict(acc=arrays["acc"], acc_weight=0.25, include_h=mode == "acc_with_h")
        ref_kwargs = dict(acc=expect["acc"], acc_weight=0.25, include_h=mode == "acc_with_h")
    if mode == "acc_without_h_and_sum":
        kwargs["h_sum"], ref_kwargs["h_sum"] = arrays["hs"], expect["hs"]
    assert ops.fedspeed_round_end_(arrays["h"], arrays["xk"], arrays["xt"], **kwargs) is arrays["h"]
    scale_h = np.abs(expect["h"]) + np.abs(expect["xk"]) + np.abs(expect["xt"])
    reference.fedspeed_round_end_(expect["h"], expect["xk"], expect["xt"], **ref_kwargs)
    assert_close(arrays["h"], expect["h"], scale_h, dtype)
    if mode != "h_only":
        assert_close(arrays["acc"], expect["acc"], np.abs(expect["acc"]) + 0.25 * (scale_h + np.abs(xk)), dtype)
    else:
        assert np.array_equal(to_numpy64(arrays["acc"]), rounded(acc, dtype)), "acc was written"
    if mode == "acc_without_h_and_sum":
        assert_close(arrays["hs"], expect["hs"], np.abs(expect["hs"]) + scale_h, dtype)


def test_round_end_is_storage_form_of_algorithm_one():
    """h += x_K − x^t and x̂ = x_K + h equal ĝ⁺ = ĝ − (x_K − x^t)/λ and x̂ = x_K − λ·ĝ⁺."""
    rng = np.random.default_rng(6)
    lam, d = 5.0, 300
    g_hat, xk, xt = rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal(d)
    h = -lam * g_hat
    acc = np.zeros(d)
    ops.fedspeed_round_end_(h, xk, xt, acc=acc)
    g_hat_new = g_hat - (xk - xt) / lam
    assert np.allclose(h, -lam * g_hat_new, atol=1e-12)
    assert np.allclose(acc, xk - lam * g_hat_new, atol=1e-12)


# thread invariance, hypothesis ---------------------------------------------------------------------------


def test_results_do_not_depend_on_thread_count():
    rng = np.random.default_rng(7)
    d = 600_001  # enough for the pool
    x, g1, g2, anchor = (rng.standard_normal(d).astype(np.float32) for _ in range(4))
    before = pyfedkern.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            pyfedkern.set_num_threads(n)
            norm, cnorm = np.zeros(1, np.float32), np.zeros(1, np.float32)
            with pool_wakes(n > 1):
                out = ops.sam_perturb(x, g1, 0.1, norm_out=norm)
            upd = x.copy()
            ops.fedspeed_update_(upd, g2, 0.1, g1=g1, alpha=0.5, anchor=anchor, prox_coef=0.1, clip_norm=5.0,
                                 norm_out=cnorm)  # fmt: skip
            results.append((out, norm, upd, cnorm))
    finally:
        pyfedkern.set_num_threads(before)
    for r in results[1:]:
        for a, b in zip(r, results[0], strict=True):
            assert np.array_equal(a, b)


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(1, 500),
    dtype=st.sampled_from(["float32", "float64"]),
    alpha=st.floats(0, 1),
    c=st.sampled_from([0.0, 1e-3, 0.1, 1.0]),
    clip=st.sampled_from([None, 1e-2, 10.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_update_property(d, dtype, alpha, c, clip, seed):
    x, g1, g2, anchor = update_inputs(d, seed)
    xr, g1r, g2r, dr = (rounded(v, dtype) for v in (x, g1, g2, anchor))
    xa = make("torch", x, dtype)
    kwargs = dict(alpha=alpha, prox_coef=c, weight_decay=1e-3, clip_norm=clip)
    ops.fedspeed_update_(xa, make("torch", g2, dtype), 0.2, g1=make("torch", g1, dtype),
                         anchor=make("torch", anchor, dtype), **kwargs)  # fmt: skip
    expected = xr.copy()
    reference.fedspeed_update_(expected, g2r, 0.2, g1=g1r, anchor=dr, **kwargs)
    v_abs = (1 - alpha) * np.abs(g1r) + alpha * np.abs(g2r) + c * np.abs(dr)
    assert_close(xa, expected, np.abs(xr) + 0.2 * (v_abs + (c + 1e-3) * np.abs(xr)), dtype)


# bad input -----------------------------------------------------------------------------------------------

V = np.ones(8, np.float32)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(rho=-0.1), ValueError, "rho must be >= 0"),
        (dict(rho=float("nan")), ValueError, "finite"),
        (dict(eps=-1.0), ValueError, "eps must be >= 0"),
        (dict(grad=np.ones(9, np.float32)), ValueError, "grad has length 9, expected 8"),
        (dict(grad=np.ones(8, np.float64)), TypeError, "grad has dtype float64"),
        (dict(grad=torch.ones(8)), ValueError, "mixing"),
        (dict(x=np.ones((2, 2, 2), np.float32)), ValueError, "1-D"),
        (dict(x=np.ones(0, np.float32), grad=np.ones(0, np.float32)), ValueError, "empty"),
        (dict(x=np.ones(8, np.int32), grad=np.ones(8, np.int32)), TypeError, "dtype int32"),
        (dict(out=np.ones(8, np.float64)), TypeError, "out has dtype"),
        (dict(norm_out=np.ones(1, np.float64)), TypeError, "norm_out has dtype float64, expected float32"),
        (dict(norm_out=np.ones(2, np.float32)), ValueError, "exactly one element"),
        (dict(normalize=False, norm_out=np.ones(1, np.float32)), ValueError, "normalize=True"),
        (dict(normalize=1), TypeError, "bool"),
    ],
)
def test_perturb_bad_input(kwargs, exc, match):
    args = dict(x=V, grad=V.copy(), rho=0.1) | kwargs
    with pytest.raises(exc, match=match):
        ops.sam_perturb(**args)


def test_perturb_overlaps_are_rejected():
    buf = np.ones(20, np.float32)
    with pytest.raises(ValueError, match="out overlaps grad"):
        ops.sam_perturb(buf[:10], buf[10:], 0.1, out=buf[10:])
    with pytest.raises(ValueError, match="partially overlaps x"):
        ops.sam_perturb(buf[:10], np.ones(10, np.float32), 0.1, out=buf[1:11])


def test_norm_out_must_not_overlap_an_operand():
    """The norm is written between the two passes: in an operand's memory it would change what the second reads."""
    buf = np.ones(5, np.float32)
    for name, kwargs in (("x", {"x": buf[:4]}), ("grad", {"grad": buf[:4]}), ("out", {"out": buf[:4]})):
        args = {"x": np.ones(4, np.float32), "grad": np.ones(4, np.float32), "rho": 0.1, **kwargs}
        with pytest.raises(ValueError, match=f"norm_out overlaps {name}"):
            ops.sam_perturb(**args, norm_out=buf[3:4])
    for name in ("x", "g1", "g2", "anchor"):
        args = {n: np.ones(4, np.float32) for n in ("x", "g1", "g2", "anchor")} | {name: buf[:4]}
        with pytest.raises(ValueError, match=f"norm_out overlaps {name}"):
            ops.fedspeed_update_(
                args["x"], args["g2"], 0.1, g1=args["g1"], alpha=0.5, anchor=args["anchor"], prox_coef=0.1,
                clip_norm=100.0, norm_out=buf[3:4],
            )  # fmt: skip
    assert (buf == 1).all()  # nothing was written


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (dict(alpha=1.5), ValueError, "alpha must be <= 1"),
        (dict(alpha=-0.1), ValueError, "alpha must be >= 0"),
        (dict(lr=-1.0), ValueError, "lr must be >= 0"),
        (dict(prox_coef=-0.1), ValueError, "prox_coef must be >= 0"),
        (dict(weight_decay=-1e-3), ValueError, "weight_decay must be >= 0"),
        (dict(clip_norm=0.0), ValueError, "clip_norm must be > 0"),
        (dict(alpha=0.5, g1=None), ValueError, "g1 is required"),
        (dict(prox_coef=0.1, anchor=None), ValueError, "anchor .* is required"),
        (dict(norm_out=np.ones(1, np.float32)), ValueError, "norm_out needs clip_norm"),
        (dict(g2=np.ones(7, np.float32)), ValueError, "g2 has length 7"),
        (dict(x=np.broadcast_to(np.float32(1), (8,))), ValueError, "read-only"),
        (dict(lr=float("inf")), ValueError, "finite"),
    ],
)
def test_update_bad_input(kwargs, exc, match):
    args = dict(x=V.copy(), g2=V.copy(), lr=0.1, g1=V.copy(), anchor=V.copy(), prox_coef=0.1) | kwargs
    with pytest.raises(exc, match=match):
        ops.fedspeed_update_(**args)


def test_update_overlap_is_rejected():
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="x overlaps g2"):
        ops.fedspeed_update_(x, x, 0.1)


def test_round_end_bad_input():
    h, x = np.zeros(8, np.float32), np.ones(8, np.float32)
    with pytest.raises(ValueError, match="h overlaps x_local"):
        ops.fedspeed_round_end_(h, h, x)
    with pytest.raises(ValueError, match="h overlaps acc"):
        ops.fedspeed_round_end_(h, x, x.copy(), acc=h)
    with pytest.raises(ValueError, match="acc_weight"):
        ops.fedspeed_round_end_(h, x, x.copy(), acc=np.zeros(8, np.float32), acc_weight=float("nan"))
    with pytest.raises(TypeError, match="x_global has dtype"):
        ops.fedspeed_round_end_(h, x, np.ones(8))


# row forms ([k, d], one client per row) ----------------------------------------------------------------------

ROW_SHAPES = [(1, 7), (5, 1), (9, 1000), (3, 20_011)]  # d < one chunk (rows in parallel) and d > one chunk


def row_inputs(k: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    x, g1, g2 = (rng.standard_normal((k, d)) for _ in range(3))
    anchor = rng.standard_normal((k, d)) * 3
    if k > 2:  # adversarial rows: a zero gradient, a huge one (the clip acts), a tiny one
        g1[1] = 0.0
        g2[1] = 0.0
        g2[2] *= 1e4
        g1[-1] *= 1e-30
    return x, g1, g2, anchor


@pytest.mark.parametrize("lib", LIBS_CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "d"), ROW_SHAPES)
def test_row_forms_match_the_reference(lib, dtype, k, d):
    skip_unsupported(lib, dtype)
    x, g1, g2, anchor = row_inputs(k, d, k * d)
    xr, g1r, g2r, dr = (rounded(v, dtype) for v in (x, g1, g2, anchor))
    norms = make(lib, np.zeros(k), acc_dtype(dtype))
    out = ops.sam_perturb(make(lib, x, dtype), make(lib, g1, dtype), 0.05, norm_out=norms)
    norm_ref = np.zeros(k)
    expected = reference.sam_perturb(xr, g1r, 0.05, norm_out=norm_ref)
    scale = 0.05 / (norm_ref + 1e-7)
    assert_close(out, expected, np.abs(xr) + scale[:, None] * np.abs(g1r), dtype)
    assert np.all(np.abs(to_numpy64(norms) - norm_ref) <= 1e-6 * norm_ref)
    assert k <= 2 or np.array_equal(to_numpy64(out)[1], to_numpy64(make(lib, x, dtype))[1])  # zero gradient row

    kwargs = dict(alpha=0.75, prox_coef=0.1, weight_decay=1e-3, clip_norm=10.0)
    xa = make(lib, x, dtype)
    clip_norms = make(lib, np.zeros(k), acc_dtype(dtype))
    ops.fedspeed_update_(xa, make(lib, g2, dtype), 0.1, g1=make(lib, g1, dtype), anchor=make(lib, anchor, dtype),
                         norm_out=clip_norms, **kwargs)  # fmt: skip
    exp = xr.copy()
    clip_ref = np.zeros(k)
    reference.fedspeed_update_(exp, g2r, 0.1, g1=g1r, anchor=dr, norm_out=clip_ref, **kwargs)
    v_abs = 0.25 * np.abs(g1r) + 0.75 * np.abs(g2r) + 0.1 * np.abs(dr)
    assert_close(xa, exp, np.abs(xr) + 0.1 * (v_abs + 0.101 * np.abs(xr)), dtype)
    assert np.all(np.abs(to_numpy64(clip_norms) - clip_ref) <= 1e-6 * np.linalg.norm(v_abs, axis=1))

    rng = np.random.default_rng(1)
    h, acc, hs, xt = rng.standard_normal((k, d)), rng.standard_normal(d), rng.standard_normal(d), x[0] + 1
    arrays = [make(lib, v, dtype) for v in (h, x, xt, acc, hs)]
    ops.fedspeed_round_end_(arrays[0], arrays[1], arrays[2], acc=arrays[3], acc_weight=0.25, h_sum=arrays[4])
    he, xe, te, ae, hse = (rounded(v, dtype) for v in (h, x, xt, acc, hs))
    reference.fedspeed_round_end_(he, xe, te, acc=ae, acc_weight=0.25, h_sum=hse)
    row_scale = np.abs(he) + np.abs(xe) + np.abs(te)
    total_scale = np.abs(ae) + np.abs(hse) + row_scale.sum(0)
    assert_close(arrays[0], he, row_scale, dtype)
    assert_close(arrays[3], ae, k * total_scale, dtype)
    assert_close(arrays[4], hse, k * total_scale, dtype)


@pytest.mark.parametrize(("k", "d"), ROW_SHAPES)
def test_each_row_is_bit_for_bit_the_one_dimensional_op(k, d):
    """Row r of a row-form call gives exactly the bits of the 1-D op on row r (the batched FedSpeed clients equal the
    per-client loop's); round end adds the rows into acc in row order, as the 1-D op called row after row."""
    x, g1, g2, anchor = (v.astype(np.float32) for v in row_inputs(k, d, 3))
    norms = np.zeros(k, np.float32)
    out = ops.sam_perturb(x, g1, 0.1, norm_out=norms)
    rows = x.copy()
    ops.fedspeed_update_(rows, g2, 0.1, g1=g1, alpha=0.5, anchor=anchor, prox_coef=0.1, clip_norm=1.0)
    for r in range(k):
        norm = np.zeros(1, np.float32)
        assert np.array_equal(out[r], ops.sam_perturb(x[r], g1[r], 0.1, norm_out=norm)) and norm[0] == norms[r]
        one = x[r].copy()
        ops.fedspeed_update_(one, g2[r], 0.1, g1=g1[r], alpha=0.5, anchor=anchor[r], prox_coef=0.1, clip_norm=1.0)
        assert np.array_equal(rows[r], one)
    h, acc, hsum = anchor.copy(), np.zeros(d, np.float32), np.zeros(d, np.float32)
    ops.fedspeed_round_end_(h, x, g1[0], acc=acc, acc_weight=0.3, include_h=False, h_sum=hsum)
    h1, acc1, hsum1 = anchor.copy(), np.zeros(d, np.float32), np.zeros(d, np.float32)
    for r in range(k):
        ops.fedspeed_round_end_(h1[r], x[r], g1[0], acc=acc1, acc_weight=0.3, include_h=False, h_sum=hsum1)
    assert np.array_equal(h, h1) and np.array_equal(acc, acc1) and np.array_equal(hsum, hsum1)


def test_row_forms_strided_and_thread_invariant():
    rng = np.random.default_rng(8)
    base = rng.standard_normal((6, 3, 5002))
    x, g = base[:, 0, ::2], base[::-1, 1, 1::2]  # strided rows and columns
    out = np.zeros((6, 2 * 2501))
    before = pyfedkern.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            pyfedkern.set_num_threads(n)
            norms = np.zeros(6)
            ops.sam_perturb(x, g, 0.2, out=out[:, ::2], norm_out=norms)
            results.append((out.copy(), norms))
    finally:
        pyfedkern.set_num_threads(before)
    assert np.allclose(out[:, ::2], reference.sam_perturb(x, g, 0.2), rtol=1e-14, atol=1e-14)
    assert np.all(out[:, 1::2] == 0)
    for r in results[1:]:
        assert np.array_equal(r[0], results[0][0]) and np.array_equal(r[1], results[0][1])
    h = np.zeros((6, 2501))
    ops.fedspeed_round_end_(h, x, g[0])  # one strided x^t for every row
    assert np.allclose(h, x - g[0], rtol=1e-15, atol=1e-15)


M = np.ones((3, 8), np.float32)


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: ops.sam_perturb(M, np.ones((3, 9), np.float32), 0.1), ValueError, "grad has shape"),
        (lambda: ops.sam_perturb(M, np.ones(8, np.float32), 0.1), ValueError, r"\[k, d\] matrix"),
        (lambda: ops.sam_perturb(M, M.copy(), 0.1, norm_out=np.zeros(1, np.float32)), ValueError, "one norm per row"),
        (lambda: ops.sam_perturb(M, M.copy(), 0.1, norm_out=np.zeros(3)), TypeError, "norm_out has dtype"),
        (lambda: ops.sam_perturb(M, M, 0.1, out=M), ValueError, "out overlaps grad"),
        (lambda: ops.sam_perturb(np.ones((0, 8), np.float32), np.ones((0, 8), np.float32), 0.1), ValueError, "empty"),
        (lambda: ops.fedspeed_update_(M.copy(), M, 0.1, alpha=0.5), ValueError, "g1 is required"),
        (lambda: ops.fedspeed_update_(M.copy(), M, 0.1, prox_coef=0.1, anchor=M[:2]), ValueError, "anchor has shape"),
        (lambda: ops.fedspeed_update_(np.broadcast_to(M[0], (3, 8)), M, 0.1), ValueError, "read-only"),
        (lambda: ops.fedspeed_round_end_(M.copy(), M, np.ones(9, np.float32)), ValueError, "x_global has length 9"),
        (lambda: ops.fedspeed_round_end_(M.copy(), M, M[0], acc=np.ones((3, 8), np.float32)), ValueError, "1-D"),
        (lambda: ops.fedspeed_round_end_(M.copy(), M[:2], M[0]), ValueError, "x_local has shape"),
    ],
)
def test_row_forms_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 1000, 300_007])
def test_cuda_matches_reference(dtype, d):
    x, g1, g2, anchor = update_inputs(d, d)
    xr, g1r, g2r, dr = (rounded(v, dtype) for v in (x, g1, g2, anchor))
    dev = lambda v: make("torch", v, dtype, "cuda")  # noqa: E731
    norm = torch.zeros(1, dtype=getattr(torch, acc_dtype(dtype)), device="cuda")
    out = ops.sam_perturb(dev(x), dev(g1), 0.05, norm_out=norm)
    norm_ref = np.zeros(1)
    expected = reference.sam_perturb(xr, g1r, 0.05, norm_out=norm_ref)
    assert out.device.type == "cuda"
    assert_close(out, expected, np.abs(xr) + 0.05 / norm_ref[0] * np.abs(g1r), dtype)
    assert abs(norm.item() - norm_ref[0]) <= 1e-5 * norm_ref[0]
    for clip in (None, 0.5):
        xa = dev(x)
        kwargs = dict(alpha=0.75, prox_coef=0.1, weight_decay=1e-3, clip_norm=clip)
        ops.fedspeed_update_(xa, dev(g2), 0.1, g1=dev(g1), anchor=dev(anchor), **kwargs)
        exp = xr.copy()
        reference.fedspeed_update_(exp, g2r, 0.1, g1=g1r, anchor=dr, **kwargs)
        v_abs = 0.25 * np.abs(g1r) + 0.75 * np.abs(g2r) + 0.1 * np.abs(dr)
        assert_close(xa, exp, np.abs(xr) + 0.1 * (v_abs + 0.101 * np.abs(xr)) + 1e-6 * np.abs(exp), dtype)
    h, acc, hs = dev(anchor), dev(g2), dev(g1)
    ops.fedspeed_round_end_(h, dev(x), dev(g1), acc=acc, acc_weight=0.5, h_sum=hs)
    he, ae, hse = dr.copy(), g2r.copy(), g1r.copy()
    reference.fedspeed_round_end_(he, xr, g1r, acc=ae, acc_weight=0.5, h_sum=hse)
    scale = np.abs(dr) + np.abs(xr) + np.abs(g1r) + np.abs(g2r)
    for got, exp in ((h, he), (acc, ae), (hs, hse)):
        assert_close(got, exp, scale * 2, dtype)


@pytest.mark.cuda
def test_cuda_no_host_sync_and_streams():
    """The ops only queue work on the caller's stream. Two checks: under ``set_sync_debug_mode("error")`` any
    PyTorch-level synchronisation in the Python layer (``.item()``, a blocking copy) raises; and a sleep kernel queued
    first is still running when the calls return, so nothing inside the extension waited for the stream either."""
    torch.manual_seed(1)
    x, g = torch.randn(100_000, device="cuda"), torch.randn(100_000, device="cuda")
    ops.fedspeed_update_(ops.sam_perturb(x, g, 0.1), g, 0.1, clip_norm=1.0)  # warm-up (lazy initialisation)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1 << 30)  # ~0.5 s of GPU time, far longer than queueing the two ops
            out = ops.sam_perturb(x, g, 0.1)  # norm kept in an internal device buffer
            ops.fedspeed_update_(out, g, 0.1, clip_norm=1.0)
            busy_after_calls = not stream.query()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    stream.synchronize()
    assert busy_after_calls, "the ops waited for the stream (a host synchronisation)"
    expected = x + 0.1 / (g.norm() + 1e-7) * g
    expected -= 0.1 * torch.clamp(1.0 / (g.norm() + 1e-6), max=1.0) * g
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_cuda_zero_gradient_and_determinism():
    x, g = torch.randn(50_001, device="cuda"), torch.zeros(50_001, device="cuda")
    assert torch.equal(ops.sam_perturb(x, g, 0.1, eps=0.0), x)
    g = torch.randn(2_000_003, device="cuda")
    n1, n2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    a = ops.sam_perturb(g, g, 0.1, out=torch.empty_like(g), norm_out=n1)
    b = ops.sam_perturb(g, g, 0.1, out=torch.empty_like(g), norm_out=n2)
    assert torch.equal(a, b) and torch.equal(n1, n2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize(("k", "d"), [(1, 7), (9, 1000), (3, 300_007), (70_000, 3)])
def test_cuda_row_forms_match_the_reference(dtype, k, d):
    """The row forms on the GPU: one norm per row (zero, huge and tiny rows), round end summing every row; more rows
    than a grid dimension holds (70,000)."""
    x, g1, g2, anchor = row_inputs(k, d, d)
    xr, g1r, g2r, dr = (rounded(v, dtype) for v in (x, g1, g2, anchor))
    dev = lambda v: make("torch", v, dtype, "cuda")  # noqa: E731
    norms = torch.zeros(k, dtype=getattr(torch, acc_dtype(dtype)), device="cuda")
    out = ops.sam_perturb(dev(x), dev(g1), 0.05, norm_out=norms)
    norm_ref = np.zeros(k)
    expected = reference.sam_perturb(xr, g1r, 0.05, norm_out=norm_ref)
    assert_close(out, expected, np.abs(xr) + (0.05 / (norm_ref + 1e-7))[:, None] * np.abs(g1r), dtype)
    assert np.all(np.abs(norms.double().cpu().numpy() - norm_ref) <= 1e-5 * norm_ref)
    kwargs = dict(alpha=0.75, prox_coef=0.1, weight_decay=1e-3, clip_norm=10.0)
    xa = dev(x)
    ops.fedspeed_update_(xa, dev(g2), 0.1, g1=dev(g1), anchor=dev(anchor), **kwargs)
    exp = xr.copy()
    reference.fedspeed_update_(exp, g2r, 0.1, g1=g1r, anchor=dr, **kwargs)
    v_abs = 0.25 * np.abs(g1r) + 0.75 * np.abs(g2r) + 0.1 * np.abs(dr)
    assert_close(xa, exp, np.abs(xr) + 0.1 * (v_abs + 0.101 * np.abs(xr)) + 1e-6 * np.abs(exp), dtype)
    h, acc, hs = dev(anchor), dev(g2[0]), dev(g1[0])
    ops.fedspeed_round_end_(h, dev(x), dev(g1[-1]), acc=acc, acc_weight=0.5, h_sum=hs)
    he, ae, hse = dr.copy(), g2r[0].copy(), g1r[0].copy()
    reference.fedspeed_round_end_(he, xr, g1r[-1], acc=ae, acc_weight=0.5, h_sum=hse)
    row_scale = np.abs(dr) + np.abs(xr) + np.abs(g1r[-1])
    assert_close(h, he, 2 * row_scale, dtype)
    for got, want in ((acc, ae), (hs, hse)):
        assert_close(got, want, 2 * k * (np.abs(want) + row_scale.sum(0)), dtype)


# benchmark cases ---------------------------------------------------------------------------------------


def test_benchmark_peers_compute_the_same_step():
    from pyfedkern.benchmarks import fedspeed as bench

    assert len(bench.resnet18_gn_shapes()) == 62
    assert sum(int(np.prod(s)) for s in bench.resnet18_gn_shapes()) == bench.RESNET18_GN_CIFAR10_D
    assert sum(bench.layer_sizes(10**6)) == 10**6 and len(bench.layer_sizes(10**6)) == 62
    groups = sorted({c.group for c in bench.cases(quick=True)})
    assert len(groups) == 2
    for group in groups:
        results = {}
        for name in [c.name for c in bench.cases(quick=True) if c.group == group and not c.is_limit]:
            case = next(c for c in bench.cases(quick=True) if c.group == group and c.name == name)  # fresh inputs
            result = case.make()()
            if isinstance(result, list):
                result = torch.cat([p.detach().reshape(-1) for p in result])
            results[name] = result.double().numpy()
        ours = results.pop("pyfedkern")
        assert len(results) >= 1
        for name, value in results.items():
            np.testing.assert_allclose(value, ours, rtol=1e-5, atol=1e-6, err_msg=f"{group}: {name}")
