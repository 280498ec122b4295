"""The serving prefill kernel (fm_dispatch_attn; flashmetal_kernels.h "serving
extension") on the sim, through the public flash-attn API, against the float64
serving reference: varlen q/k, per-sequence
cache lengths, paged K/V through shuffled block tables, window (left/right,
with and without causal), softcap, sinks and the natural-log LSE, for both
kernel bodies (D <= 256: a simdgroup per 8 rows; D = 512: simdgroups
splitting keys and head dim). Shapes are tiny: a sim prefill tile costs
milliseconds."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from flashmetal.reference import attend_sequence
from numerics import BF16, F16, assert_close, randn
from serving_cases import check_sink_limits


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
    out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=causal, window_size=window,
                                            softcap=softcap, return_attn_probs=True, sinks=sinks, registry=sim)
    eo, el = reference.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap,
                                         sinks=sinks)
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
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True,
                                          return_softmax_lse=True, registry=sim)
    eo, el = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True)
    check(out, lse, eo, el, dtype, f"paged D={d}")


def test_cache_lengths_contiguous(sim, rng):
    """[B, cap, Hkv, D] caches with per-sequence lengths (0 included: that
    sequence's rows see nothing, output 0 and lse -inf)."""
    d, h = 64, 2
    lens = np.array([0, 9, 33])
    kc, vc = randn(rng, (3, 40, 2, d), BF16), randn(rng, (3, 40, 2, d), BF16)
    q = randn(rng, (3, 4, h, d), BF16)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, softcap=4.0,
                                          return_softmax_lse=True, registry=sim)
    eo, el = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, softcap=4.0)
    check(out, lse, eo, el, BF16, "cache lengths")
    assert not out[0].astype(np.float32).any() and np.all(lse[0] == -np.inf)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_before_the_keys(sim, rng, with_sinks):
    """flash_attn_func with qL > kL, causal: rows at t < 0 see no key (out 0;
    lse -inf, or the sink's logit with sinks)."""
    d, h = 64, 2
    q, k, v = randn(rng, (1, 6, h, d), BF16), randn(rng, (1, 4, 1, d), BF16), randn(rng, (1, 4, 1, d), BF16)
    sinks = np.array([0.5, -1.0], np.float32) if with_sinks else None
    out, lse, _ = fm.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, sinks=sinks, registry=sim)
    eo, el = attend_sequence(q[0], k[0], v[0], causal=True, sinks=sinks)
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
    h, ql, kl, page = 2, 8, 128, 16
    window = (11, 0)
    q = randn(rng, (1, ql, h, d), dtype)
    k, v = randn(rng, (1, kl, 1, d), dtype), randn(rng, (1, kl, 1, d), dtype)
    # rows sit at 120..127; the window keeps keys >= 109: keys [0, 64) (pages 0-3; key tiles of
    # 16 at D = 64, of 64 at D = 512) are outside.
    outside = 64
    exp_out, exp_lse = attend_sequence(q[0], k[0], v[0], window_size=window)
    k[:, :outside], v[:, :outside] = np.nan, np.nan
    out, lse, _ = fm.flash_attn_func(q, k, v, window_size=window, return_attn_probs=True, registry=sim)
    check(out[0], lse[0], exp_out, exp_lse, dtype, "contiguous, NaN outside the window")
    pages_k = k[0].reshape(kl // page, page, 1, d)[::-1].copy()  # shuffled: logical page j at 7 - j
    pages_v = v[0].reshape(kl // page, page, 1, d)[::-1].copy()
    table = np.arange(kl // page)[::-1][None].copy()
    out_p, lse_p = fm.flash_attn_with_kvcache(q, pages_k, pages_v, block_table=table, window_size=window,
                                              return_softmax_lse=True, registry=sim)
    check(out_p[0], lse_p[0], exp_out, exp_lse, dtype, "paged, NaN pages outside the window")


def test_window_bit_identical_to_mask(sim, rng):
    """In-kernel window == the same visibility as a dense additive mask, bit
    for bit (a key tile a row cannot see leaves its state unchanged)."""
    d, ql, kl = 64, 40, 72
    q, k, v = randn(rng, (1, ql, 2, d), BF16), randn(rng, (1, kl, 2, d), BF16), randn(rng, (1, kl, 2, d), BF16)
    got = fm.flash_attn_func(q, k, v, window_size=(9, 4), registry=sim)
    t = kl - ql + np.arange(ql)[:, None]
    p = np.arange(kl)[None, :]
    mask = np.where((p >= t - 9) & (p <= t + 4), 0.0, -np.inf).astype(BF16)
    ref = fm.flash_attn_prefill(q, k, v, mask=mask, layout="blhd", registry=sim)
    assert np.array_equal(got.view(np.uint16), ref.view(np.uint16))


@pytest.mark.parametrize("call,message", [
    (lambda q, k, reg: fm.flash_attn_func(q, k, k, window_size=(-2, -1), registry=reg),
     "flash_attn_func: window_size[0] must be -1 (unbounded) or >= 0, got -2"),
    (lambda q, k, reg: fm.flash_attn_func(q, k, k, window_size=(3, -5), registry=reg),
     "flash_attn_func: window_size[1] must be -1 (unbounded) or >= 0, got -5"),
    (lambda q, k, reg: fm.flash_attn_with_kvcache(q, k[:, :0].reshape(1, 0, 1, 64), k[:, :0].reshape(1, 0, 1, 64),
                                                  cache_seqlens=[0], block_table=[[0]], registry=reg),
     "flash_attn_with_kvcache: k_cache page size 0 (its dim 1) must be positive"),
    (lambda q, k, reg: fm.flash_attn_with_kvcache(q, k.reshape(1, 16, 1, 64), k.reshape(1, 16, 1, 64),
                                                  cache_seqlens=[4], block_table=[[1]], registry=reg),
     "flash_attn_with_kvcache: block_table[0, 0] = 1 is out of range [0, 1) (the pages of k_cache)"),
])
def test_bad_windows_and_pages(sim, rng, call, message):
    """Errors name the public function, the argument and the value."""
    q, k = randn(rng, (1, 4, 2, 64), BF16), randn(rng, (1, 16, 1, 64), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        call(q, k, sim)
    assert str(e.value) == message


@pytest.mark.parametrize("d", [64, 512])  # both bodies (D <= 256 and the wide one)
def test_sink_limits(sim, rng, d):
    """+inf / -inf / NaN sinks on the Metal prefill (serving_cases.check_sink_limits)."""
    check_sink_limits(sim, rng, 7, BF16, d)
