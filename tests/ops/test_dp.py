"""DP ops: clip_accumulate against its float64 reference, gaussian_noise_ bit for bit against the NumPy generator,
and the generator's statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import pyfedkern
from pyfedkern import ops, reference
from pyfedkern._runtime import native
from pyfedkern.reference import dp as ref_dp

# ---- clip_accumulate -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [0.5, 3.0, 1e6, math.inf])
@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("d", [1, 7, 4099, 9000])
def test_clip_accumulate_matches_reference_float64(clip, centred, d):
    rng = np.random.default_rng(d)
    u = rng.standard_normal((13, d)) * rng.uniform(0.01, 3, (13, 1))
    c = rng.standard_normal(d) if centred else None
    total, norms = ops.clip_accumulate(u, clip, center=c, return_norms=True)
    want, want_norms = reference.clip_accumulate(u, clip, center=c, return_norms=True)
    np.testing.assert_allclose(total, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(norms, want_norms, rtol=1e-13)


def test_clip_accumulate_clips_each_row_to_the_clip():
    rng = np.random.default_rng(1)
    u = rng.standard_normal((6, 100))
    for k in range(6):
        norm = np.linalg.norm(ops.clip_accumulate(u[k : k + 1], 0.7))
        assert norm == pytest.approx(min(0.7, np.linalg.norm(u[k])), rel=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_clip_accumulate_low_precision_torch(dtype):
    rng = np.random.default_rng(2)
    u = torch.from_numpy(rng.standard_normal((9, 5000))).to(dtype)
    c = torch.from_numpy(rng.standard_normal(5000)).to(dtype)
    total, norms = ops.clip_accumulate(u, 2.0, center=c, return_norms=True)
    want, want_norms = reference.clip_accumulate(u, 2.0, center=c, return_norms=True)
    assert total.dtype == dtype and norms.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(total.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(norms.float(), want_norms.float(), rtol=tol, atol=0)


def test_clip_accumulate_strided_rows_list_and_outputs():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((400, 10))
    u = base.T[:, ::3]  # [10, 134], column stride 30
    c = rng.standard_normal(400)[::3]
    out, norms_out = np.empty(u.shape[1]), np.empty(10)
    got = ops.clip_accumulate(u, 1.5, out=out, norms_out=norms_out, center=c)
    assert got[0] is out and got[1] is norms_out
    want, want_norms = reference.clip_accumulate(np.ascontiguousarray(u), 1.5, center=c, return_norms=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(norms_out, want_norms, rtol=1e-13)
    as_list = ops.clip_accumulate([row for row in u], 1.5, center=c)
    np.testing.assert_allclose(as_list, want, rtol=1e-12, atol=1e-14)


def test_clip_accumulate_edge_rows():
    u = np.zeros((3, 50))
    u[1, :] = 10.0  # norm 70.7, clipped to 1
    np.testing.assert_allclose(ops.clip_accumulate(u, 1.0), np.full(50, 1 / math.sqrt(50)), rtol=1e-14)
    assert np.array_equal(ops.clip_accumulate(np.zeros((2, 5)), 1.0), np.zeros(5))  # norm 0 kept as it is
    plain = np.random.default_rng(4).standard_normal((5, 33))
    np.testing.assert_allclose(ops.clip_accumulate(plain, math.inf), plain.sum(0), rtol=1e-13, atol=1e-14)
    bad = plain.copy()
    bad[2, 7] = np.nan
    assert np.isnan(ops.clip_accumulate(bad, 1.0)).all()
    bad[2, 7] = np.inf
    assert not np.isfinite(ops.clip_accumulate(bad, 1.0)).all()


def test_clip_accumulate_same_bits_for_any_thread_count():
    rng = np.random.default_rng(5)
    u = rng.standard_normal((40, 300_000)).astype(np.float32)
    c = rng.standard_normal(300_000).astype(np.float32)
    before = pyfedkern.get_num_threads()
    try:
        pyfedkern.set_num_threads(1)
        one, n1 = ops.clip_accumulate(u, 100.0, center=c, return_norms=True)
        pyfedkern.set_num_threads(2)
        two, n2 = ops.clip_accumulate(u, 100.0, center=c, return_norms=True)
    finally:
        pyfedkern.set_num_threads(before)
    assert np.array_equal(one, two) and np.array_equal(n1, n2)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda u: ops.clip_accumulate(u, 0.0), ValueError, "clip must be > 0"),
        (lambda u: ops.clip_accumulate(u, -1.0), ValueError, "clip must be > 0"),
        (lambda u: ops.clip_accumulate(u, math.nan), ValueError, "clip must be > 0"),
        (lambda u: ops.clip_accumulate(u, True), TypeError, "clip must be a real number"),
        (lambda u: ops.clip_accumulate(u, 1.0, center=np.zeros(3)), ValueError, "center must have shape"),
        (lambda u: ops.clip_accumulate(u, 1.0, center=np.zeros(8, np.float32)), TypeError, "center has dtype"),
        (lambda u: ops.clip_accumulate(u, 1.0, out=np.zeros(3)), ValueError, "out must have shape"),
        (lambda u: ops.clip_accumulate(u, 1.0, out=u[0]), ValueError, "out overlaps the updates"),
        (lambda u: ops.clip_accumulate(u, 1.0, norms_out=np.zeros(2)), ValueError, "norms_out must have shape"),
        (lambda u: ops.clip_accumulate(u[:0], 1.0), ValueError, "updates is empty"),
        (lambda u: ops.clip_accumulate(u[0], 1.0), ValueError, "2-D"),
    ],
)
def test_clip_accumulate_refuses_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(np.ones((4, 8)))


def test_clip_accumulate_refuses_inputs_requiring_grad():
    u = torch.ones(3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="updates requires grad"):
        ops.clip_accumulate(u, 1.0)
    with torch.no_grad():
        assert ops.clip_accumulate(u, 1.0).shape == (4,)


def test_clip_accumulate_torch_operator():
    u = torch.randn(5, 64, dtype=torch.float64)
    total, norms = torch.ops.pyfedkern.clip_accumulate(u, 0.5, None)
    want, want_norms = reference.clip_accumulate(u, 0.5, return_norms=True)
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(norms, want_norms, rtol=1e-13, atol=0)


# ---- gaussian_noise_ -------------------------------------------------------------------------------------------


def test_aes_round_known_answer():
    """The reference's AES round, run as AES-128 (FIPS-197 key expansion, ten rounds), gives FIPS-197's example C.1."""
    rcon = [0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x1B, 0x36]
    words = [list(range(4 * i, 4 * i + 4)) for i in range(4)]  # key 00 01 ... 0f
    for i in range(4, 44):
        t = list(words[i - 1])
        if i % 4 == 0:
            t = [int(ref_dp.SBOX[b]) for b in t[1:] + t[:1]]
            t[0] ^= rcon[i // 4 - 1]
        words.append([a ^ b for a, b in zip(words[i - 4], t, strict=True)])
    keys = [np.array(words[4 * j : 4 * j + 4], np.uint8).reshape(16) for j in range(11)]
    state = np.frombuffer(bytes.fromhex("00112233445566778899aabbccddeeff"), np.uint8).reshape(1, 16) ^ keys[0]
    for j in range(1, 11):
        state = ref_dp.aes_round(state, keys[j], last=j == 10)
    assert bytes(state[0]).hex() == "69c4e0d86a7b0430d8cdb78070b4c55a"


def _aes_paths() -> list[str]:
    """The AES paths this CPU runs (the kernel refuses the others)."""
    found = []
    for aes in ("soft", "aesni", "vaes"):
        try:
            native().ars4x32_5(0, 0, 0, np.zeros((1, 4), np.uint32), aes)
        except ValueError:
            continue
        found.append(aes)
    return found


@pytest.mark.parametrize(
    ("seed", "stream", "first", "n"),
    [(0, 0, 0, 1), (2**64 - 1, 2**64 - 1, 2**64 - 1, 1), (7, 2**63 + 5, 2**32 - 37, 300), (1, 2, 13, 17)],
)
def test_native_ars_equals_the_reference(seed, stream, first, n):
    """The kernel's ARS-5 words (chunks of 64 blocks, the 64-bit block index wrapping) = the reference's, on every
    AES path of this CPU (portable tables, AES-NI, VAES)."""
    paths = _aes_paths()
    assert "soft" in paths
    blocks = np.array([(first + i) % 2**64 for i in range(n)], np.uint64)
    want = ref_dp.ars4x32_5(blocks, seed, stream)
    for aes in paths:
        out = np.zeros((n, 4), np.uint32)
        native().ars4x32_5(seed, stream, first, out, aes)
        assert np.array_equal(out, want), aes
    with pytest.raises(ValueError, match="aes must be"):
        native().ars4x32_5(0, 0, 0, np.zeros((1, 4), np.uint32), "aes9")


def _isas() -> list[str]:
    """The vector ISAs this CPU runs (the kernel refuses the others)."""
    found = []
    for isa in ("baseline", "avx2", "avx512"):
        try:
            native().gaussian_noise("float32", 1, np.zeros(1, np.float32).ctypes.data, 1, 1.0, 0, 0, isa)
        except ValueError:
            continue
        found.append(isa)
    return found


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gaussian_noise_same_bits_on_every_isa(dtype):
    """Every vector ISA (SSE2, AVX2, AVX-512) and AES path (tables, AES-NI, VAES) this CPU has gives the reference's
    bits, strided output included."""
    isas, paths = _isas(), _aes_paths()
    assert "baseline" in isas
    want = ref_dp.standard_normals(3001, 99, 3, 4, dtype=dtype)
    stream = ref_dp.stream_key((3, 4))
    for isa in isas:
        for aes in paths:
            if isa == "baseline" and aes == "vaes":
                continue
            z = np.zeros(2 * 3001, dtype)
            native().gaussian_noise(np.dtype(dtype).name, 3001, z.ctypes.data, 2, 1.0, 99, stream, isa, aes)
            assert np.array_equal(z[::2], want), (isa, aes)
            assert not np.any(z[1::2])
    with pytest.raises(ValueError, match="isa must be"):
        native().gaussian_noise("float32", 1, z.ctypes.data, 1, 1.0, 0, 0, "sse9")
    if "vaes" in paths:
        with pytest.raises(ValueError, match="needs isa avx2"):
            native().gaussian_noise("float32", 1, z.ctypes.data, 1, 1.0, 0, 0, "baseline", "vaes")


@pytest.mark.parametrize(
    ("dtype", "bits", "r_tol", "trig_tol"), [(np.float32, 24, 3e-7, 3e-7), (np.float64, 32, 1e-15, 2e-15)]
)
def test_generator_log_sin_cos_against_libm(dtype, bits, r_tol, trig_tol):
    """The polynomial radius sqrt(−2 ln u1) and sine/cosine of 2πu2 against float64 libm, on 2^20 evenly spaced
    uniforms and the edges (u1 = 2^−bits and 1, the quadrant and octant boundaries of the angle). Measured: float32
    radius 1.5e-7 relative, sine/cosine 1.5e-7 absolute; float64 3e-16 and 7e-16."""
    top = 1 << bits
    edges = [0, 1, 2, top - 1, top // 8 - 1, top // 8, top // 8 + 1, top // 4 - 1, top // 4, top // 4 + 1, top // 2]
    v = np.concatenate([np.arange(1 << 20, dtype=np.uint64) * np.uint64(top >> 20), np.array(edges, np.uint64)])
    words = (v << np.uint64(32 - bits)).astype(np.uint32)
    u = v.astype(np.float64) / top
    z_cos, z_sin = ref_dp._normals(words, np.zeros_like(words), np.dtype(dtype))  # angle 0: z_cos = r, z_sin = 0
    r = np.sqrt(-2 * np.log(u + 1.0 / top))
    assert np.all(z_sin == 0) and z_cos[v == top - 1][0] == 0
    inside = r > 0
    assert np.max(np.abs(z_cos[inside] - r[inside]) / r[inside]) < r_tol
    a = np.full_like(words, np.uint32(0x6A09E667))  # one radius, r0 in float64
    r0 = math.sqrt(-2 * math.log(((int(a[0]) >> (32 - bits)) + 1) / top))
    z_cos, z_sin = ref_dp._normals(a, words, np.dtype(dtype))
    assert np.max(np.abs(z_cos / r0 - np.cos(2 * np.pi * u))) < trig_tol
    assert np.max(np.abs(z_sin / r0 - np.sin(2 * np.pi * u))) < trig_tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gaussian_noise_kolmogorov_smirnov(dtype):
    """A million draws against N(0, 1)'s CDF: the KS distance below its 0.1 % critical value 1.95/sqrt(n)."""
    n = 1_000_000
    z = np.sort(ops.gaussian_noise_(np.zeros(n, dtype), 1.0, 77, 5).astype(np.float64))
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    d = max(np.max(np.arange(1, n + 1) / n - cdf), np.max(cdf - np.arange(n) / n))
    assert d < 1.95 / math.sqrt(n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [1, 255, 256, 257, 5000, 70_000])
def test_gaussian_noise_equals_the_reference_bit_for_bit(dtype, d):
    rng = np.random.default_rng(d)
    x = rng.standard_normal(d).astype(dtype)
    got = ops.gaussian_noise_(x.copy(), 0.37, 12345, 7, 2**64 - 1)
    want = reference.gaussian_noise_(x.copy(), 0.37, 12345, 7, 2**64 - 1)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gaussian_noise_strided_torch_and_keys(dtype):
    base = torch.zeros(3000, dtype=dtype)
    view = base[::3]
    ops.gaussian_noise_(view, 1.0, 2**64 - 1, 0)
    assert torch.count_nonzero(base[1::3]) == 0 and torch.count_nonzero(base[2::3]) == 0
    want = ref_dp.standard_normals(1000, 2**64 - 1, 0, dtype=np.dtype(str(dtype).removeprefix("torch.")))
    assert np.array_equal(view.numpy(), want)
    other = ops.gaussian_noise_(torch.zeros(1000, dtype=dtype), 1.0, 2**64 - 1, 1)
    no_keys = ops.gaussian_noise_(torch.zeros(1000, dtype=dtype), 1.0, 2**64 - 1)
    assert not torch.equal(other, view) and not torch.equal(no_keys, view)
    assert torch.equal(ops.gaussian_noise_(torch.zeros(1000, dtype=dtype), 1.0, 2**64 - 1, 0), view)


def test_gaussian_noise_prefix_does_not_depend_on_the_length():
    short = ops.gaussian_noise_(np.zeros(300), 1.0, 9, 1)
    long = ops.gaussian_noise_(np.zeros(100_000), 1.0, 9, 1)
    assert np.array_equal(short, long[:300])


def test_gaussian_noise_zero_std_leaves_x_unchanged():
    x = np.random.default_rng(0).standard_normal(1000)
    assert np.array_equal(ops.gaussian_noise_(x.copy(), 0.0, 1, 2), x)


def test_gaussian_noise_same_bits_for_any_thread_count():
    before = pyfedkern.get_num_threads()
    try:
        pyfedkern.set_num_threads(1)
        one = ops.gaussian_noise_(np.zeros(2_000_000, np.float32), 1.0, 3, 4)
        pyfedkern.set_num_threads(2)
        two = ops.gaussian_noise_(np.zeros(2_000_000, np.float32), 1.0, 3, 4)
    finally:
        pyfedkern.set_num_threads(before)
    assert np.array_equal(one, two)


@pytest.mark.parametrize(("dtype", "tol"), [(np.float32, 2e-6), (np.float64, 1e-14)])
def test_generator_polynomials_equal_box_muller(dtype, tol):
    """The polynomial logarithm, sine and cosine against NumPy's, on the generator's own uniforms."""
    w = ref_dp.ars4x32_5(np.arange(20_000, dtype=np.uint64), 5, 6)
    bits = 24 if dtype is np.float32 else 32
    u1 = ((w[:, 0].astype(np.float64) // 2 ** (32 - bits)) + 1) / 2**bits
    u2 = (w[:, 1].astype(np.float64) // 2 ** (32 - bits)) / 2**bits
    r = np.sqrt(-2 * np.log(u1))
    z_cos, z_sin = ref_dp._normals(w[:, 0], w[:, 1], np.dtype(dtype))
    scale = np.maximum(r, 1.0)
    assert np.max(np.abs(z_cos - r * np.cos(2 * np.pi * u2)) / scale) < tol
    assert np.max(np.abs(z_sin - r * np.sin(2 * np.pi * u2)) / scale) < tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gaussian_noise_statistics(dtype):
    """Mean, standard deviation, tails and pairs of a million draws: within a few standard errors of N(0, 1)."""
    n = 1_000_000
    z = ops.gaussian_noise_(np.zeros(n, dtype), 1.0, 2024, 11).astype(np.float64)
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.std() - 1) < 5 * math.sqrt(0.5 / n)
    for q, t in [(0.5, 0.0), (0.8413447460685429, 1.0), (0.9772498680518208, 2.0), (0.9986501019683699, 3.0)]:
        frac = np.mean(z <= t)
        assert abs(frac - q) < 5 * math.sqrt(q * (1 - q) / n)
        assert abs(np.mean(z <= -t) - (1 - q)) < 5 * math.sqrt(q * (1 - q) / n)
    kurtosis = np.mean(z**4)
    assert abs(kurtosis - 3) < 5 * math.sqrt(96 / n)
    for lag in (1, 4, 8, 16, 256):  # neighbours, words of a block, cosine/sine lanes, groups, chunks
        assert abs(np.mean(z[:-lag] * z[lag:])) < 5 / math.sqrt(n)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((-1.0, 1), ValueError, "std must be >= 0"),
        ((math.inf, 1), ValueError, "std must be finite"),
        ((1.0, -1), ValueError, "seed must be an integer from 0"),
        ((1.0, 2**64), ValueError, "seed must be an integer from 0"),
        ((1.0, 1.5), TypeError, "seed must be an integer"),
        ((1.0, 1, -3), ValueError, r"keys\[0\] must be an integer from 0"),
    ],
)
def test_gaussian_noise_refuses_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        ops.gaussian_noise_(np.zeros(4), *args)


def test_gaussian_noise_refuses_bad_arrays():
    with pytest.raises(TypeError, match="float32 or float64"):
        ops.gaussian_noise_(torch.zeros(4, dtype=torch.float16), 1.0, 0)
    with pytest.raises(ValueError, match="1-D"):
        ops.gaussian_noise_(np.zeros((2, 2)), 1.0, 0)
    with pytest.raises(ValueError, match="empty"):
        ops.gaussian_noise_(np.zeros(0), 1.0, 0)
    with pytest.raises(ValueError, match="requires grad"):
        ops.gaussian_noise_(torch.zeros(4, requires_grad=True), 1.0, 0)


def test_gaussian_noise_torch_operator_bumps_the_version():
    x = torch.zeros(600)
    version = x._version
    stream = ops.dp.stream_key((1,))
    torch.ops.pyfedkern.gaussian_noise_(x, 2.0, 5, stream - (1 << 64) if stream >= 1 << 63 else stream)  # int64
    assert x._version > version
    assert torch.equal(x, ops.gaussian_noise_(torch.zeros(600), 2.0, 5, 1))
