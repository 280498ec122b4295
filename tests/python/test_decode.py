"""Split-KV decode (vec) + reduce + fused FWHT undo against the float64 reference."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from flashmetal._arrays import tensor
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn
from cabi import err_text

HEAD_DIMS = [64, 128, 256, 512]
KV_DTYPES = [F32, F16, BF16]
MASKS = ["none", "causal", "window"]


def run(registry, rng, *, b=None, h=4, hkv=2, cap=80, kv_len=70, d=128, kv=F16, mask="none", window=24,
        scale=None, softcap=0.0, signs=None, fwht=False, q_mult=1.0):
    qs = (h, d) if b is None else (b, h, d)
    ks = (hkv, cap, d) if b is None else (b, hkv, cap, d)
    q = randn(rng, qs, F32) * np.float32(q_mult)
    k = randn(rng, ks, kv)
    v = randn(rng, ks, kv)
    w = window if mask == "window" else None
    out = fm.flash_attn_decode(q, k, v, kv_len, scale=scale, causal=mask == "causal", window=w,
                               softcap=softcap, fwht=fwht, fwht_signs=signs, registry=registry)
    assert out.dtype == F32 and out.shape == q.shape
    exp = reference.decode(q, k, v, kv_len, scale=scale, window=w, softcap=softcap)
    if fwht or signs is not None:
        exp = reference.fwht_undo(exp, signs)
    # q stays float32 on every backend: decode is held to the f32 tolerance.
    assert_close(out, exp, F32, f"{registry.backend} d={d} kv={kv} mask={mask} q*{q_mult:g}")
    return q, k, v, out


@pytest.mark.parametrize("d,kv,mask", list(itertools.product(HEAD_DIMS, KV_DTYPES, MASKS)))
def test_matrix(registry, rng, d, kv, mask):
    run(registry, rng, d=d, kv=kv, mask=mask)


def test_gqa_16_8(registry, rng):
    run(registry, rng, h=16, hkv=8, d=128, cap=40, kv_len=40)


@pytest.mark.parametrize("kv_len,cap", [(1, 1), (1, 64), (31, 64), (33, 33), (100, 128), (1025, 1100)])
def test_lengths(registry, rng, kv_len, cap):
    run(registry, rng, kv_len=kv_len, cap=cap, d=64, kv=BF16)


def test_kv_len_lt_capacity_ignores_tail(registry, rng):
    q, k, v, out = run(registry, rng, kv_len=50, cap=90, d=64)
    k2, v2 = k.copy(), v.copy()
    k2[:, 50:] = np.float16(np.nan)
    v2[:, 50:] = np.float16(1e4)
    out2 = fm.flash_attn_decode(q, k2, v2, 50, causal=False, registry=registry)
    assert_bits_equal(out, out2, "tail beyond kv_len is never read")


def test_batch_3(registry, rng):
    q, k, v, out = run(registry, rng, b=3, h=4, hkv=2, d=128, kv_len=45, cap=64, mask="window", window=20)
    for i in range(3):
        one = fm.flash_attn_decode(q[i], k[i], v[i], 45, window=20, registry=registry)
        assert_bits_equal(out[i], one, f"batch row {i}")


@pytest.mark.parametrize("window", [1, 5, 32, 1000])
def test_windows(registry, rng, window):
    run(registry, rng, mask="window", window=window, kv_len=77, cap=77, d=64)


def test_scale_and_softcap(registry, rng):
    run(registry, rng, d=256, scale=4 / math.sqrt(256))
    run(registry, rng, d=128, scale=0.3, softcap=5.0, kv=F32)


@pytest.mark.parametrize("scale", [None, 1e-5])
def test_q_beyond_half_range(registry, rng, scale):
    """|q| ~ 1e5 (past half's 65504): finite and at the f32 tolerance. With
    scale 1e-5 the scores are O(1), so a q rounded to half would show."""
    q, k, v, out = run(registry, rng, d=128, kv=F32, q_mult=1e5, scale=scale)
    assert np.abs(q).max() > 65504 and np.all(np.isfinite(out))


def test_scale_one_d256(registry, rng):
    run(registry, rng, d=256, kv=F16, scale=1.0, mask="causal")


def test_determinism(registry, rng):
    q, k, v, out = run(registry, rng, d=256, kv=BF16, kv_len=300, cap=300)
    again = fm.flash_attn_decode(q, k, v, 300, registry=registry)
    assert_bits_equal(out, again, "two runs")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_fwht_undo(registry, rng, d):
    signs = rng.integers(0, 256, d // 8, dtype=np.uint8)
    run(registry, rng, d=d, signs=signs, kv=F32)
    run(registry, rng, d=d, fwht=True, kv=BF16, mask="window")  # no signs: all +1


def test_fwht_reference_is_an_involution_up_to_signs(rng):
    # H_D H_D = D I, so undoing twice (no signs) gives the input back.
    x = rng.standard_normal((3, 64))
    assert np.allclose(reference.fwht_undo(reference.fwht_undo(x)), x)
    h = reference.hadamard(8)
    assert np.array_equal(h[1], [1, -1, 1, -1, 1, -1, 1, -1])  # natural (Sylvester) order
    assert np.array_equal(reference.sign_vector(np.array([0b10000001], np.uint8), 8),
                          [-1, 1, 1, 1, 1, 1, 1, -1])


def test_fwht_all_ones_vs_zero_signs(registry, rng):
    q = randn(rng, (2, 64), F32)
    k = randn(rng, (1, 40, 64), F32)
    a = fm.flash_attn_decode(q, k, k, 40, fwht=True, registry=registry)
    b = fm.flash_attn_decode(q, k, k, 40, fwht_signs=np.zeros(8, np.uint8), registry=registry)
    assert_bits_equal(a, b, "absent signs == all-zero bitmask")
    c = fm.flash_attn_decode(q, k, k, 40, fwht_signs=np.full(8, 255, np.uint8), registry=registry)
    assert np.array_equal(c, -a)


def test_explicit_tmp(cpu, rng):
    """A caller-provided tmp holds mlx-native's layout: partial O, then (S, M) pairs.
    Keys are dealt in contiguous runs of FM_VEC_CHUNK = 32-key chunks (one chunk
    per workgroup here); a workgroup without keys writes S = 0 and leaves its O."""
    h, d, kvl = 2, 64, 70
    q = randn(rng, (h, d), F32)
    k = randn(rng, (1, kvl, d), F32)
    v = randn(rng, (1, kvl, d), F32)
    nwg = 32
    tmp = np.full(h * nwg * (d + 2), np.nan, np.float32)
    out = np.empty((h, d), np.float32)
    ffi = cpu._ffi
    opts = ffi.new("FMVecOptions *")
    opts.scale, opts.kv_len = 1 / 8, kvl
    cpu._call("fm_dispatch_vec", tensor(ffi, q), tensor(ffi, k), tensor(ffi, v), ffi.NULL, tensor(ffi, tmp),
              tensor(ffi, out), opts)
    o_part = tmp[: h * nwg * d].reshape(h, nwg, d)
    sm = tmp[h * nwg * d:].reshape(h, nwg, 2)
    # 70 keys in chunks of 32: workgroups 0-2 see 32, 32, 6 keys; the rest none.
    assert np.all(sm[:, 3:, 0] == 0) and np.all(np.isnan(o_part[:, 3:]))
    assert np.all(sm[:, :3, 0] > 0)
    s = (1 / 8) * (q.astype(np.float64) @ k[0].T.astype(np.float64))
    for w, (lo, hi) in enumerate([(0, 32), (32, 64), (64, 70)]):
        assert np.allclose(sm[:, w, 1], s[:, lo:hi].max(axis=1), rtol=1e-5, atol=1e-5)
        p = np.exp(s[:, lo:hi] - sm[:, w, 1:2])
        assert np.allclose(sm[:, w, 0], p.sum(axis=1), rtol=1e-4)
        assert np.allclose(o_part[:, w], p @ v[0, lo:hi], rtol=1e-4, atol=1e-4)
    assert_close(out, reference.decode(q, k, v, kvl, scale=1 / 8), F16)
    with pytest.raises(ValueError, match=r"flash_attn_vec: tmp buffer too small: expected at least 16896 bytes"):
        cpu._call("fm_dispatch_vec", tensor(ffi, q), tensor(ffi, k), tensor(ffi, v), ffi.NULL,
                  tensor(ffi, tmp[:-1]), tensor(ffi, out), opts)


def _qkv(h=4, hkv=2, cap=16, d=64, kv=F32, b=None):
    qs = (h, d) if b is None else (b, h, d)
    ks = (hkv, cap, d) if b is None else (b, hkv, cap, d)
    return np.zeros(qs, F32), np.zeros(ks, kv), np.zeros(ks, kv)


@pytest.mark.parametrize("make,kwargs,exc,msg", [
    (lambda: _qkv(d=600), {}, ValueError, r"head_dim must be in 1\.\.\.512 or 576, got 600"),
    (lambda: _qkv(d=0), {}, ValueError, r"head_dim must be in 1\.\.\.512 or 576, got 0"),
    (lambda: _qkv(h=6, hkv=4), {}, ValueError, r"the q heads \(6\) must be a multiple of the k_cache heads \(4\)"),
    (lambda: _qkv(hkv=0), {}, ValueError, "the k_cache heads must be > 0, got 0"),
    (lambda: _qkv(), dict(kv_len=17), ValueError, r"kv_len \(17\) must be <= the cache capacity \(16\)"),
    (lambda: _qkv(), dict(kv_len=0), ValueError, "kv_len must be > 0"),
    (lambda: _qkv(), dict(window=0), ValueError, "window must be > 0"),
    (lambda: _qkv(), dict(softcap=-1.0), ValueError, "softcap must be 0"),
    (lambda: _qkv(), dict(softcap=float("inf")), ValueError, "softcap must be 0"),
    (lambda: _qkv(), dict(scale=float("nan")), ValueError, "scale must be finite"),
    (lambda: (np.zeros((4, 64), F16),) + _qkv()[1:], {}, TypeError, "q must be float32"),
    (lambda: _qkv(kv=np.dtype(np.uint8)), {}, TypeError, "k_cache must be float32 or float16 or bfloat16"),
    (lambda: (_qkv()[0], _qkv()[1], _qkv(kv=F16)[2]), {}, TypeError, "v_cache dtype float16 does not match k_cache dtype float32"),
    (lambda: (_qkv()[0], _qkv()[1], np.zeros((2, 15, 64), F32)), {}, ValueError, "v_cache shape"),
    (lambda: (np.zeros((1, 4, 64, 1), F32),) + _qkv()[1:], {}, ValueError, "q must have rank 2 or 3"),
    (lambda: (_qkv()[0], np.zeros((1, 2, 16, 64), F32), np.zeros((1, 2, 16, 64), F32)), {}, ValueError,
     "k_cache must have rank 3"),
    (lambda: (np.zeros((2, 4, 64), F32),) + _qkv(b=3)[1:], {}, ValueError, r"k_cache batch \(3\) must equal q batch \(2\)"),
    (lambda: (_qkv()[0], np.zeros((2, 16, 128), F32), np.zeros((2, 16, 128), F32)), {}, ValueError,
     r"k_cache head_dim \(128\) must equal q head_dim \(64\)"),
    (lambda: _qkv(), dict(fwht_signs=np.zeros(4, np.uint8)), ValueError,
     r"flash_attn_decode: fwht_signs must hold head_dim/8 = 8 bytes"),
    (lambda: _qkv(), dict(fwht_signs=np.zeros(8, np.int8)), TypeError, "fwht_signs"),
    (lambda: _qkv(), dict(out=np.zeros((4, 64), F16)), TypeError, "out must be float32, got float16"),
    (lambda: (np.zeros((4, 64), F16),) + _qkv(kv=BF16)[1:], {}, TypeError, "q must be float32 or bfloat16"),
    (lambda: _qkv(kv=BF16), dict(out=np.zeros((4, 64), F16)), TypeError, "out must be float32 or bfloat16, got "
                                                                            "float16"),
    (lambda: _qkv(), dict(out=np.zeros((4, 63), F32)), ValueError, "out"),
    (lambda: _qkv(), dict(out=np.zeros((4, 64), np.float64)), TypeError, "out dtype float64 is not supported"),
])
def test_errors(registry, make, kwargs, exc, msg):
    q, k, v = make()
    kw = dict(kv_len=16)
    kw.update(kwargs)
    with pytest.raises(exc, match=msg) as e:
        fm.flash_attn_decode(q, k, v, registry=registry, **kw)
    assert str(e.value).startswith("flash_attn_decode: ")
    if isinstance(e.value, fm.Error):  # _arrays' own checks still raise the built-in types
        assert e.value.op == "flash_attn_decode"
        # The caches are named as the signature names them, never the C function's k/v.
        assert e.value.argument not in ("k", "v"), e.value.argument


def test_abi_errors(cpu):
    ffi, lib = cpu._ffi, cpu._lib
    err = ffi.new("FMError *")
    q, k, v = _qkv()
    out = np.zeros_like(q)
    opts = ffi.new("FMVecOptions *")
    opts.scale, opts.kv_len = 1.0, 16

    def call(*args):
        st = lib.fm_dispatch_vec(cpu._handle, *args, err)
        return st, err_text(err).decode()

    T = lambda a: tensor(ffi, a)  # noqa: E731
    assert call(ffi.NULL, T(k), T(v), ffi.NULL, ffi.NULL, T(out), opts) == (1, "flash_attn_vec: q is null")
    assert call(T(q), T(k), T(v), ffi.NULL, ffi.NULL, T(out), ffi.NULL) == (1, "flash_attn_vec: options is null")
    opts.mask_type = 3
    st, msg = call(T(q), T(k), T(v), ffi.NULL, ffi.NULL, T(out), opts)
    assert st == 1 and "mask_type must be 0 (none), 1 (causal) or 2 (sliding window), got 3" in msg
    opts.mask_type = 2
    st, msg = call(T(q), T(k), T(v), ffi.NULL, ffi.NULL, T(out), opts)
    assert st == 1 and "window must be > 0 with the sliding-window mask, got 0" in msg
    opts.mask_type, opts.fwht = 0, 2
    st, msg = call(T(q), T(k), T(v), ffi.NULL, ffi.NULL, T(out), opts)
    assert st == 1 and "fwht must be 0 or 1" in msg
    opts.fwht = 0
    st, msg = call(T(q), T(k), T(v), T(np.zeros(8, np.uint8)), ffi.NULL, T(out), opts)
    assert st == 1 and "fwht_signs given without fwht" in msg
    st, msg = call(T(q), T(k), T(v), ffi.NULL, T(np.zeros(10, np.float16)), T(out), opts)
    assert st == 2 and "flash_attn_vec: tmp must be float32" in msg
    # a q whose buffer is shorter than its shape is refused before any read
    tq = T(q)
    tq.nbytes = 100
    st, msg = call(tq, T(k), T(v), ffi.NULL, ffi.NULL, T(out), opts)
    assert st == 1 and "q buffer too small" in msg


@pytest.mark.parametrize("kv", [F16, BF16])
def test_kv_conversion_exact_for_every_finite_value(registry, kv):
    """With one key the output is V itself: every finite 16-bit value converts exactly."""
    vals = np.arange(65536, dtype=np.uint16).view(kv)
    vals = vals[np.isfinite(vals.astype(np.float32))]
    d = 512
    n = -(-vals.size // d)
    v = np.zeros(n * d, kv)
    v[: vals.size] = vals
    v = v.reshape(n, 1, d)
    q = np.zeros((n, d), F32)
    out = fm.flash_attn_decode(q, np.zeros_like(v), v, 1, registry=registry)
    # value equality: -0.0 comes out as +0.0 (0 * factor + 1 * -0.0), as on any backend
    assert np.array_equal(out, v[:, 0].astype(F32)), f"{kv} -> float32"


@pytest.mark.parametrize("kv", [F16, BF16])
@pytest.mark.parametrize("d,mask", [(64, "none"), (80, "window"), (128, "causal"), (256, "none")])
def test_q_and_out_in_the_caches_dtype(registry, rng, kv, d, mask):
    """q and the output in the caches' 16-bit dtype: q is read exactly (its
    float32 widening gives the same bits as a float32 q) and the float32
    result is rounded once to nearest even, by the kernel itself; float32
    out of a 16-bit q is the float32 result. Against the float64 reference too."""
    q = randn(rng, (2, 8, d), kv)
    k = randn(rng, (2, 4, 50, d), kv)
    v = randn(rng, (2, 4, 50, d), kv)
    w = 17 if mask == "window" else None
    kw = dict(causal=mask == "causal", window=w, softcap=8.0, registry=registry)
    wide = fm.flash_attn_decode(q.astype(F32), k, v, 45, **kw)
    out = fm.flash_attn_decode(q, k, v, 45, **kw)
    assert out.dtype == kv and out.shape == q.shape
    assert_bits_equal(out, wide.astype(kv), f"{registry.backend} {kv} d={d}: one rounding of the float32 result")
    into32 = np.full(q.shape, np.nan, F32)
    assert fm.flash_attn_decode(q, k, v, 45, out=into32, **kw) is into32
    assert_bits_equal(into32, wide, "a 16-bit q read exactly")
    exp = reference.decode(q, k, v, 45, window=w, softcap=8.0)
    assert_close(out, exp, kv, f"{registry.backend} {kv} d={d} mask={mask}")


def test_decode_in_a_batch_scope_on_metal_writes_q_dtype(rng):
    """Inside a batch scope on metal the work runs when the scope ends: the
    decode kernel writes the 16-bit output itself, so it is there then."""
    reg = fm.Registry("metal-sim")
    q, k, v = randn(rng, (1, 8, 64), BF16), randn(rng, (1, 2, 40, 64), BF16), randn(rng, (1, 2, 40, 64), BF16)
    with reg.batch():
        inside = fm.flash_attn_decode(q, k, v, 40, registry=reg)
    assert_bits_equal(inside, fm.flash_attn_decode(q, k, v, 40, registry=reg), "same bits inside and outside")
    assert_close(inside, reference.decode(q, k, v, 40), BF16, "bf16 decode in a batch scope")


@pytest.mark.parametrize("kv", [F16, BF16])
def test_fwht_undo_into_the_caches_dtype(registry, rng, kv):
    """The fused FWHT-undo reduce writes a 16-bit output too: the bits of the
    float32 result rounded once, and the reference within kv's tolerance."""
    q, k, v = randn(rng, (2, 8, 128), kv), randn(rng, (2, 4, 40, 128), kv), randn(rng, (2, 4, 40, 128), kv)
    signs = rng.integers(0, 256, 16).astype(np.uint8)
    out = fm.flash_attn_decode(q, k, v, 33, fwht_signs=signs, registry=registry)
    wide = fm.flash_attn_decode(q.astype(F32), k, v, 33, fwht_signs=signs, registry=registry)
    assert out.dtype == kv
    assert_bits_equal(out, wide.astype(kv), f"{registry.backend} {kv}: one rounding after the undo")
    assert_close(out, reference.fwht_undo(reference.decode(q, k, v, 33), signs), kv, f"{registry.backend} {kv} fwht")
