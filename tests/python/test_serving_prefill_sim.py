"""The serving prefill kernel (fm_dispatch_attn; flashmetal.h "serving
extension") on the sim, against the float64 reference: varlen q/k, per-sequence
cache lengths, paged K/V through shuffled block tables, window (left/right,
with and without causal), softcap, sinks and the natural-log LSE, for both
kernel bodies (D <= 256 in registers, D = 512 in threadgroup memory). Shapes
are tiny: a sim prefill tile costs milliseconds."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _native
from flashmetal._arrays import tensor
from numerics import BF16, F16, assert_close, randn


def attend_sequence(q, k, v, *, scale, causal=False, window_size=(-1, -1), softcap=0.0, sinks=None):
    """float64 reference of one sequence (flash-attn's semantics): q [qL, H, D],
    k/v [kL, Hkv, D] -> (out [qL, H, D], lse [H, qL])."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    ql, h, _ = q.shape
    kl, hkv = k.shape[:2]
    kh = np.repeat(k.transpose(1, 0, 2), h // hkv, axis=0)
    vh = np.repeat(v.transpose(1, 0, 2), h // hkv, axis=0)
    s = scale * (q.transpose(1, 0, 2) @ kh.transpose(0, 2, 1))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    t = kl - ql + np.arange(ql)[:, None]
    p = np.arange(kl)[None, :]
    vis = np.ones((ql, kl), dtype=bool)
    if causal:
        vis &= p <= t
    if window_size[0] >= 0:
        vis &= p >= t - window_size[0]
    if window_size[1] >= 0:
        vis &= p <= t + window_size[1]
    s = np.where(vis, s, -np.inf)
    sink = np.full((h, 1, 1), -np.inf) if sinks is None else np.asarray(sinks, np.float64).reshape(h, 1, 1)
    m = np.maximum(s.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True) + np.exp(sink - m)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(denom))[..., 0]
    o = np.where(denom > 0, (e @ vh) / np.where(denom > 0, denom, 1.0), 0.0)
    return o.transpose(1, 0, 2), lse


def i32_tensor(ffi, a):
    """An FMTensor of an int32 array (the package's int32 inputs land with the serving API)."""
    if a is None:
        return ffi.NULL
    t = ffi.new("FMTensor *")
    t.data = ffi.cast("void *", a.__array_interface__["data"][0])
    t.nbytes = a.nbytes
    t.dtype = _native.constant("FM_DTYPE_I32")
    t.ndim = a.ndim
    t.shape[0:a.ndim] = a.shape
    return t


def dispatch_attn(reg, q, k, v, *, cu_q=None, cu_k=None, seqlens=None, block_table=None, sinks=None,
                  want_lse=False, causal=False, window=(-1, -1), softcap=0.0, scale=None, max_q=0, max_k=0):
    """fm_dispatch_attn through the C entry point -> (out, lse or None)."""
    ffi = _native.ffi()
    ints = [None if a is None else np.ascontiguousarray(a, dtype=np.int32) for a in (cu_q, cu_k, seqlens, block_table)]
    out = np.zeros_like(q)
    lse = None
    if want_lse:
        h = q.shape[-2]
        lse = np.full((h, q.shape[0]) if cu_q is not None else (q.shape[0], h, q.shape[1]), 7.0, np.float32)
    seq = ffi.new("FMSeqTensors *")
    ts = [i32_tensor(ffi, a) for a in ints] + [tensor(ffi, sinks), tensor(ffi, lse)]  # alive until the call
    seq.cu_seqlens_q, seq.cu_seqlens_k, seq.seqlens_k, seq.block_table, seq.sinks, seq.lse = ts
    o = _native.options("FMAttnOptions", scale=1 / math.sqrt(q.shape[-1]) if scale is None else scale,
                        softcap=softcap, causal=int(causal), window_left=window[0], window_right=window[1],
                        max_seqlen_q=max_q, max_seqlen_k=max_k)
    _native.call(reg, "fm_dispatch_attn", tensor(ffi, q), tensor(ffi, k), tensor(ffi, v), seq, tensor(ffi, out), o,
                 keep=(q, k, v, out, lse, sinks, *ints))
    return out, lse


@pytest.fixture(scope="module")
def sim():
    with fm.Registry("sim") as reg:
        yield reg


def check(out, lse, exp_out, exp_lse, dtype, what):
    assert_close(out, exp_out, dtype, what)
    if lse is not None:
        finite = np.isfinite(exp_lse)
        assert np.array_equal(np.isfinite(lse), finite), f"{what}: lse -inf rows differ"
        assert np.allclose(lse[finite], exp_lse[finite], atol=1e-4, rtol=1e-4), f"{what}: lse"


# (head dim, dtype): one case per kernel body and both I/O types.
BODIES = [(64, BF16), (512, F16)]


@pytest.mark.parametrize("d,dtype", BODIES)
@pytest.mark.parametrize("causal,window,softcap,with_sinks", [
    (True, (7, -1), 0.0, True),    # causal sliding window: the first key tile is skipped
    (False, (5, 3), 2.5, False),   # two-sided window without causal, softcap
])
def test_varlen(sim, rng, d, dtype, causal, window, softcap, with_sinks):
    """Packed q and k, ragged: lengths 3/17 queries over 17/40 keys (tile - 1,
    one tile + 1, several tiles)."""
    h, hkv = 4, 2
    cu_q, cu_k = np.array([0, 3, 20]), np.array([0, 17, 57])
    q, k, v = randn(rng, (20, h, d), dtype), randn(rng, (57, hkv, d), dtype), randn(rng, (57, hkv, d), dtype)
    sinks = rng.standard_normal(h).astype(np.float32) if with_sinks else None
    out, lse = dispatch_attn(sim, q, k, v, cu_q=cu_q, cu_k=cu_k, sinks=sinks, want_lse=True, causal=causal,
                             window=window, softcap=softcap, max_q=17, max_k=40)
    scale = 1 / math.sqrt(d)
    eo, el = np.zeros(q.shape), np.zeros((h, 20))
    for b in range(2):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        eo[qs], el[:, qs] = attend_sequence(q[qs], k[ks], v[ks], scale=scale, causal=causal, window_size=window,
                                            softcap=softcap, sinks=sinks)
    check(out, lse, eo, el, dtype, f"varlen D={d}")


@pytest.mark.parametrize("d,dtype", BODIES)
def test_paged_cache_lengths(sim, rng, d, dtype):
    """K/V through a shuffled block table (page 16), each sequence its own
    cache length; table entries past a sequence's pages are never read (-1)."""
    h, hkv, ql, page = 2, 1, 5, 16
    lens = np.array([17, 40])
    table = np.array([[4, 0, -1], [2, 5, 1]])
    kc, vc = randn(rng, (6, page, hkv, d), dtype), randn(rng, (6, page, hkv, d), dtype)
    q = randn(rng, (2, ql, h, d), dtype)
    out, lse = dispatch_attn(sim, q, kc, vc, seqlens=lens, block_table=table, want_lse=True, causal=True)
    for b in range(2):
        pos = np.arange(lens[b])
        kb, vb = kc[table[b][pos // page], pos % page], vc[table[b][pos // page], pos % page]
        eo, el = attend_sequence(q[b], kb, vb, scale=1 / math.sqrt(d), causal=True)
        check(out[b], lse[b], eo, el, dtype, f"paged D={d} seq {b}")


def test_cache_lengths_contiguous(sim, rng):
    """[B, cap, Hkv, D] caches with per-sequence lengths (0 included: that
    sequence's rows see nothing, output 0 and lse -inf)."""
    d, h = 64, 2
    lens = np.array([0, 9, 33])
    kc, vc = randn(rng, (3, 40, 2, d), BF16), randn(rng, (3, 40, 2, d), BF16)
    q = randn(rng, (3, 4, h, d), BF16)
    out, lse = dispatch_attn(sim, q, kc, vc, seqlens=lens, want_lse=True, causal=True, softcap=4.0)
    for b in range(3):
        eo, el = attend_sequence(q[b], kc[b, :lens[b]], vc[b, :lens[b]], scale=1 / math.sqrt(d), causal=True,
                                 softcap=4.0)
        check(out[b], lse[b], eo, el, BF16, f"cache lengths seq {b}")
    assert not out[0].astype(np.float32).any() and np.all(lse[0] == -np.inf)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_before_the_keys(sim, rng, with_sinks):
    """flash_attn_func with qL > kL, causal: rows at t < 0 see no key (out 0;
    lse -inf, or the sink's logit with sinks)."""
    d, h = 64, 2
    q, k, v = randn(rng, (1, 6, h, d), BF16), randn(rng, (1, 4, 1, d), BF16), randn(rng, (1, 4, 1, d), BF16)
    sinks = np.array([0.5, -1.0], np.float32) if with_sinks else None
    out, lse = dispatch_attn(sim, q, k, v, sinks=sinks, want_lse=True, causal=True)
    eo, el = attend_sequence(q[0], k[0], v[0], scale=1 / math.sqrt(d), causal=True, sinks=sinks)
    check(out[0], lse[0], eo, el, BF16, "qL > kL")
    assert not out[0, :2].astype(np.float32).any()
    want = np.log(np.exp(sinks.astype(np.float64))) if with_sinks else np.full(2, -np.inf)
    assert np.allclose(lse[0, :, :2], want[:, None], atol=1e-6)


@pytest.mark.parametrize("d,dtype", BODIES)
def test_window_tiles_outside_are_never_loaded(sim, rng, d, dtype):
    """Key tiles wholly outside every row's window hold NaN in K and V (and
    their pages point at NaN pages): loading one into the MMAs would make the
    output NaN (0 * NaN), so a finite result equal to the reference proves
    those tiles were skipped. Tiles partly inside are loaded and masked
    cell by cell."""
    h, ql, kl, page = 2, 8, 64, 16
    window = (11, 0)
    q = randn(rng, (1, ql, h, d), dtype)
    k, v = randn(rng, (1, kl, 1, d), dtype), randn(rng, (1, kl, 1, d), dtype)
    # rows sit at 56..63; the window keeps keys >= 45: tiles [0, 32) (page 16) are outside.
    outside = 32
    exp_out, exp_lse = attend_sequence(q[0], k[0], v[0], scale=1 / math.sqrt(d), window_size=window)
    k[:, :outside], v[:, :outside] = np.nan, np.nan
    out, lse = dispatch_attn(sim, q, k, v, want_lse=True, window=window)
    check(out[0], lse[0], exp_out, exp_lse, dtype, "contiguous, NaN outside the window")
    pages_k = k[0].reshape(kl // page, page, 1, d)[::-1].copy()  # shuffled: logical page j at 3 - j
    pages_v = v[0].reshape(kl // page, page, 1, d)[::-1].copy()
    table = np.array([[3, 2, 1, 0]])
    out_p, lse_p = dispatch_attn(sim, q, pages_k, pages_v, seqlens=np.array([kl]), block_table=table,
                                 want_lse=True, window=window)
    check(out_p[0], lse_p[0], exp_out, exp_lse, dtype, "paged, NaN pages outside the window")


def test_window_bit_identical_to_mask(sim, rng):
    """In-kernel window == the same visibility as a dense additive mask, bit
    for bit (a key tile a row cannot see leaves its state unchanged)."""
    d, ql, kl = 64, 40, 72
    q, k, v = randn(rng, (1, ql, 2, d), BF16), randn(rng, (1, kl, 2, d), BF16), randn(rng, (1, kl, 2, d), BF16)
    got, _ = dispatch_attn(sim, q, k, v, window=(9, 4))
    t = kl - ql + np.arange(ql)[:, None]
    p = np.arange(kl)[None, :]
    mask = np.where((p >= t - 9) & (p <= t + 4), 0.0, -np.inf).astype(BF16)
    ref = fm.flash_attn_prefill(q, k, v, mask=mask, layout="blhd", registry=sim)
    assert np.array_equal(got.view(np.uint16), ref.view(np.uint16))


@pytest.mark.parametrize("kwargs,shape_k,fn,message", [
    (dict(window=(-2, -1)), None, "flash_attn_func", "window_size[0] must be -1 (unbounded) or >= 0, got -2"),
    (dict(window=(3, -5)), None, "flash_attn_func", "window_size[1] must be -1 (unbounded) or >= 0, got -5"),
    (dict(seqlens=[4], block_table=[[0]]), (2, 8, 1, 64), "flash_attn_with_kvcache",
     "page_size (8) must be a positive multiple of 16, the key tile of head_dim 64"),
    (dict(seqlens=[4], block_table=[[2]]), (2, 16, 1, 64), "flash_attn_with_kvcache",
     "block_table[0, 0] = 2 is not a page of k_cache (num_pages 2)"),
    (dict(seqlens=[17], block_table=[[0]]), (2, 16, 1, 64), "flash_attn_with_kvcache",
     "cache_seqlens[0] = 17 must be in [0, 16] (the keys sequence 0 holds)"),
])
def test_bad_windows_and_pages(sim, rng, kwargs, shape_k, fn, message):
    q = randn(rng, (1, 4, 2, 64), BF16)
    k = randn(rng, shape_k or (1, 8, 1, 64), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        dispatch_attn(sim, q, k, k.copy(), **kwargs)
    assert str(e.value) == f"{fn}: {message}"
