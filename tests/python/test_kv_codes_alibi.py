"""ALiBi (flash-attn's alibi_slopes) over QuantizedKV caches: the score of
key p for the row at position t (bottom-right per sequence) gains
-slope * |t - p| after the softcap, in the decode over codes (split or not,
each cpu work layout) and the tiled prefill over codes, through
flash_attn_with_kvcache (contiguous, paged, appending, cache_leftpad,
cache_batch_idx), flash_attn_varlen_func over quantized pages and
flash_attn_func over codes, on every backend. Outputs and LSE equal float64
attention over the dequantized caches K̂, V̂ with the same slopes
(reference.flash_attn_kvcache / flash_attn_varlen): the kernels add no error
beyond the codec."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F32, randn
from test_kv_codec_kvcache import check, check_lse, dequantized
from test_kv_codes_prefill import caches

FEATURES = {
    "full": dict(causal=False),
    "causal": dict(causal=True),
    "window": dict(causal=False, window_size=(5, 2)),
    "softcap_chunk": dict(causal=True, softcap=2.0, attention_chunk=6),
}


def slopes(rng, shape) -> np.ndarray:
    """Slopes large enough that the bias reorders the scores, one of them
    zero (that head is plain attention)."""
    s = rng.uniform(0.05, 0.8, shape).astype(np.float32)
    s.reshape(-1)[0] = 0.0
    return s


def reference_kw(kw: dict) -> dict:
    return {("scale" if name == "softmax_scale" else name): val for name, val in kw.items()}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("ql", [1, 5], ids=["decode", "prefill"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("hkv", [1, 2], ids=["Hkv1", "Hkv2"])
def test_kvcache_against_float64(registry, rng, feature, ql, paged, hkv):
    """GQA (8 query heads), [B, H] slopes, sinks and LSE; one sequence with
    fewer keys than the other (its rows sit at other positions)."""
    kw = FEATURES[feature]
    b, cap, h, d = 2, 24, 8, 64
    k, v, table = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=8, vbits=4, page=4 if paged else None)
    lens = np.array([9, 22], np.int32)
    q = randn(rng, (b, ql, h, d), F32)
    sl = slopes(rng, (b, h))
    sinks = rng.standard_normal(h).astype(np.float32)
    o, lse = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, sinks=sinks, alibi_slopes=sl,
                                        return_softmax_lse=True, registry=registry, **kw)
    eo, el = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens, block_table=table,
                                          sinks=sinks, alibi_slopes=sl, **reference_kw(kw))
    what = f"{registry.backend} {feature} ql={ql} paged={paged} hkv={hkv}"
    check(o, eo, F32, what)
    check_lse(lse, el, what + " lse")


@pytest.mark.parametrize("ql", [1, 3], ids=["decode", "prefill"])
def test_slopes_change_the_result(registry, rng, ql):
    """The bias is applied: the same call without slopes differs from the
    float64 reference with them (so the comparison above can fail)."""
    b, cap, hkv, h, d = 1, 16, 2, 4, 64
    k, v, _ = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=8, vbits=8)
    q = randn(rng, (b, ql, h, d), F32)
    sl = np.full(h, 0.7, np.float32)
    with_bias = fm.flash_attn_with_kvcache(q, k, v, alibi_slopes=sl, causal=True, registry=registry)
    without = fm.flash_attn_with_kvcache(q, k, v, causal=True, registry=registry)
    eo, _ = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), causal=True, alibi_slopes=sl)
    check(with_bias, eo, F32, f"{registry.backend} biased")
    assert np.abs(np.asarray(without, np.float64) - eo).max() > 0.05


@pytest.mark.parametrize("keys", [300, 1100])
def test_split_decode(registry, rng, keys):
    """Long caches: the decode split over keys (several threadgroups per
    head group on sim, several shares per row on the cpu), each split's
    keys biased by their own positions; [H] slopes, bf16 q."""
    b, hkv, h, d = 1, 2, 8, 64
    k, v, _ = caches(rng, registry, b=b, cap=keys, hkv=hkv, d=d, kbits=4, vbits=8)
    q = randn(rng, (b, 1, h, d), BF16)
    sl = (slopes(rng, h) / 16).astype(np.float32)
    lens = np.array([keys - 7], np.int32)
    o, lse = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, alibi_slopes=sl, return_softmax_lse=True,
                                        registry=registry)
    eo, el = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens, alibi_slopes=sl)
    check(o, eo, BF16, f"{registry.backend} keys={keys}")
    check_lse(lse, el, f"{registry.backend} keys={keys} lse")


@pytest.mark.parametrize("ql", [1, 4], ids=["decode", "prefill"])
def test_append_leftpad_and_batch_idx(registry, rng, ql):
    """k/v appended (encoded) in the same call, then attended with the
    bias; cache_leftpad counts positions from each sequence's first key
    (the unpadded bias); cache_batch_idx picks the cache rows."""
    b, cap, hkv, h, d = 2, 20, 2, 4, 64
    k, v, _ = caches(rng, registry, b=3, cap=cap, hkv=hkv, d=d, kbits=8, vbits=4)
    kd, vd = dequantized(k), dequantized(v)
    idx = np.array([2, 0], np.int32)
    lens = np.array([6, 11], np.int32)
    pad = np.array([2, 0], np.int32)
    q = randn(rng, (b, ql, h, d), F32)
    kn, vn = randn(rng, (b, 2, hkv, d), F32), randn(rng, (b, 2, hkv, d), F32)
    sl = slopes(rng, (b, h))
    o, lse = fm.flash_attn_with_kvcache(q, k, v, kn, vn, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pad,
                                        causal=True, alibi_slopes=sl, return_softmax_lse=True, registry=registry)
    # The appended rows as the library encoded them (the reference reads K̂, V̂ after the append).
    ka, va = dequantized(k), dequantized(v)
    for i, r in enumerate(idx):
        assert np.array_equal(ka[r, :lens[i]], kd[r, :lens[i]]), "K rows before the append unchanged"
        assert np.array_equal(va[r, :lens[i]], vd[r, :lens[i]]), "V rows before the append unchanged"
    eo, el = reference.flash_attn_kvcache(q, ka, va, cache_seqlens=lens + 2, cache_batch_idx=idx, cache_leftpad=pad,
                                          causal=True, alibi_slopes=sl)
    check(o, eo, F32, f"{registry.backend} append leftpad ql={ql}")
    check_lse(lse, el, f"{registry.backend} append leftpad ql={ql} lse")


def test_varlen_over_pages(registry, rng):
    """flash_attn_varlen_func over QuantizedKV pages: sequences of 1, 5 and
    3 query rows (decode-like and prefill rows in one call), causal, [H]
    slopes."""
    hkv, h, d, page = 2, 4, 64, 4
    k, v, table = caches(rng, registry, b=3, cap=16, hkv=hkv, d=d, kbits=6, vbits=8, page=page)
    cq = np.array([0, 1, 6, 9], np.int32)
    ck = np.array([0, 7, 23, 35], np.int32)
    q = randn(rng, (int(cq[-1]), h, d), F32)
    sl = slopes(rng, h)
    o, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, 5, 16, causal=True, block_table=table, alibi_slopes=sl,
                                          return_attn_probs=True, registry=registry)
    eo, el = reference.flash_attn_varlen(q, dequantized(k), dequantized(v), cq, ck, block_table=table, causal=True,
                                         alibi_slopes=np.broadcast_to(sl, (3, h)))
    check(o, eo, F32, f"{registry.backend} varlen")
    check_lse(lse, el, f"{registry.backend} varlen lse")


def test_flash_attn_func_over_codes(registry, rng):
    """flash_attn_func with QuantizedKV k/v (qL < kL, bottom-right), bf16 q
    over a dense bf16 V beside K codes."""
    b, kl, hkv, h, d, ql = 2, 12, 2, 4, 64, 5
    kc = fm.KVCodec(d, 8, seed=5)
    k = kc.encode(randn(rng, (b, kl, hkv, d), F32), registry=registry)
    v = randn(rng, (b, kl, hkv, d), BF16)
    q = randn(rng, (b, ql, h, d), BF16)
    sl = slopes(rng, (b, h))
    o = fm.flash_attn_func(q, k, v, causal=True, alibi_slopes=sl, registry=registry)
    eo, _ = reference.flash_attn_kvcache(q, dequantized(k), v, causal=True, alibi_slopes=sl)
    check(o, eo, BF16, f"{registry.backend} flash_attn_func")


def test_bad_slopes_are_refused_before_the_append(rng):
    """A wrong shape or a non-finite slope is a ValueError naming the
    function and alibi_slopes; the caches are untouched (the append has not
    run)."""
    codec = fm.KVCodec(64, 8, seed=3)
    kc, vc = codec.empty((2, 16, 2)), codec.empty((2, 16, 2))
    before = kc.codes.copy()
    q = randn(rng, (2, 1, 2, 64), np.float32)
    new = randn(rng, (2, 1, 2, 64), np.float32)
    lens = np.array([3, 5], np.int32)
    with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: alibi_slopes must have shape \[2\] or \[2, 2\]"):
        fm.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=lens, alibi_slopes=np.ones(3, np.float32),
                                   registry="cpu")
    with pytest.raises(ValueError, match=r"^flash_attn_with_kvcache: alibi_slopes\[1\] must be finite, got nan"):
        fm.flash_attn_with_kvcache(q, kc, vc, new, new, cache_seqlens=lens,
                                   alibi_slopes=np.array([0.5, np.nan], np.float32), registry="cpu")
    assert np.array_equal(kc.codes, before)
