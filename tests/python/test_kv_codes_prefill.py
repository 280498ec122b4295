"""The tiled prefill over quantized caches (kv_codes_prefill): attention of
many query rows per sequence over QuantizedKV caches, each key tile decoded
from its codes once for every query row and head of a kv head.

Outputs and LSE equal float64 attention over the dequantized caches K̂, V̂
(reference.flash_attn_kvcache / flash_attn_varlen) within the output dtype's
tolerance, for every feature of flash_attn_with_kvcache and
flash_attn_varlen_func. Each row agrees with the one-row decode for the same
keys within the float32 tolerance on every backend (another kernel: the
split decode on sim and metal-sim, the cpu's decode loop beside its
register-blocked prefill), as in test_rows_equal_the_one_row_decode."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
import head_dim_tables
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, randn
from test_kv_codec_kvcache import check, check_lse, dequantized


def caches(rng, registry, *, b, cap, hkv, d, kbits, vbits, page=None, dtype=F32):
    """K and V code caches [B, cap, Hkv] of random rows (encoded by the
    library), or the same rows scattered over shuffled pages of `page` keys
    with their block table."""
    kc, vc = fm.KVCodec(d, kbits, seed=11), fm.KVCodec(d, vbits, seed=12)
    k = kc.encode(randn(rng, (b, cap, hkv, d), dtype), registry=registry)
    v = vc.encode(randn(rng, (b, cap, hkv, d), dtype), registry=registry)
    if page is None:
        return k, v, None
    per = cap // page
    table = rng.permutation(b * per + 1)[:b * per].reshape(b, per).astype(np.int32)
    kp, vp = kc.empty((b * per + 1, page, hkv)), vc.empty((b * per + 1, page, hkv))
    for src, dst in ((k, kp), (v, vp)):
        dst.codes[table.reshape(-1)] = src.codes.reshape(b * per, page, hkv, -1)
        dst.norms[table.reshape(-1)] = src.norms.reshape(b * per, page, hkv, -1)
    return kp, vp, table


CASES = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=True, window_size=(3, -1)),
    "window_both": dict(causal=False, window_size=(2, 1)),
    "softcap_scale": dict(causal=True, softcap=2.0, softmax_scale=0.3),
    "chunk": dict(causal=True, attention_chunk=4),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("paged", [False, True])
def test_features_against_float64(registry, rng, case, paged):
    """GQA 8:2 (two query rows per threadgroup), 6 query rows (the last
    threadgroup of a kv head half full), one sequence with fewer keys than
    query rows (its first rows see nothing when causal), sinks and LSE."""
    kw = CASES[case]
    b, cap, hkv, h, d, ql = 2, 16, 2, 8, 64, 6
    k, v, table = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=8, vbits=4, page=4 if paged else None)
    lens = np.array([4, 13], np.int32)
    q = randn(rng, (b, ql, h, d), F32)
    sinks = rng.standard_normal(h).astype(np.float32)
    o, lse = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, sinks=sinks,
                                        return_softmax_lse=True, registry=registry, **kw)
    ref_kw = {("scale" if name == "softmax_scale" else name): val for name, val in kw.items()}
    eo, el = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens, block_table=table,
                                          sinks=sinks, **ref_kw)
    check(o, eo, F32, f"{registry.backend} {case} paged={paged}")
    check_lse(lse, el, f"{registry.backend} {case} paged={paged} lse")


@pytest.mark.parametrize("d", head_dim_tables.CODEC)
def test_every_head_dim(registry, rng, d):
    """Every head dim (one rotation block, or blocks of 16/32/64), so every
    key tile height (FM_KVQ_PREFILL_TILE_FLOATS / 2 / D keys), MHA with 3
    query rows, bf16 q appended through the cache."""
    b, cap, hkv, h, ql = 1, 24, 2, 2, 3
    k, v, _ = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=5, vbits=3)
    lens = np.array([21], np.int32)
    q = randn(rng, (b, ql, h, d), BF16)
    o = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, registry=registry)
    eo, _ = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens, causal=True)
    assert o.dtype == BF16
    check(o, eo, BF16, f"{registry.backend} D={d}")


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_chunked_prefill_appends_then_attends(registry, rng, dtype):
    """A chunk of 5 new tokens appended into 4-bit K / 2-bit V codes and
    attended causally in the same call (GQA 6:2, 3 heads per kv head, so
    items straddle query rows within a threadgroup)."""
    b, cap, hkv, h, d, ql = 2, 16, 2, 6, 128, 5
    k, v, _ = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=4, vbits=2, dtype=dtype)
    lens = np.array([3, 8], np.int32)
    kn, vn = randn(rng, (b, ql, hkv, d), dtype), randn(rng, (b, ql, hkv, d), dtype)
    q = randn(rng, (b, ql, h, d), dtype)
    o = fm.flash_attn_with_kvcache(q, k, v, k=kn, v=vn, cache_seqlens=lens, causal=True, registry=registry)
    enc = k.codec.encode(kn, registry=registry)
    assert_bits_equal(k.codes[1, 8:13], enc.codes[1], "appended K codes")
    eo, _ = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens + ql, causal=True)
    check(o, eo, dtype, f"{registry.backend} chunked {dtype}")


@pytest.mark.parametrize("dense_side", ["k", "v"])
def test_one_side_dense(registry, rng, dense_side):
    """8-bit K codes beside a bf16 V cache, or a bf16 K beside 4-bit V
    codes: the tile holds the dense side's rows as they are stored."""
    b, cap, hkv, h, d, ql = 1, 16, 1, 4, 64, 4
    k, v, _ = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=8, vbits=4)
    dense = dequantized(v if dense_side == "v" else k).astype(BF16)
    kk, vv = (k, dense) if dense_side == "v" else (dense, v)
    lens = np.array([11], np.int32)
    q = randn(rng, (b, ql, h, d), F32)
    o = fm.flash_attn_with_kvcache(q, kk, vv, cache_seqlens=lens, causal=True, registry=registry)
    k64 = dequantized(k) if dense_side == "v" else dense.astype(np.float64)
    v64 = dense.astype(np.float64) if dense_side == "v" else dequantized(v)
    eo, _ = reference.flash_attn_kvcache(q, k64, v64, cache_seqlens=lens, causal=True)
    check(o, eo, F32, f"{registry.backend} dense {dense_side}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_varlen_many_rows(registry, rng, causal, paged):
    """flash_attn_varlen_func over quantized page pools with 11, 0, 1 and 9
    query rows per sequence, GQA 8:1 (one query row per threadgroup), D 128,
    LSE in [H, total_q]."""
    d, hkv, h, page = 128, 1, 8, 4
    k, v, table = caches(rng, registry, b=4, cap=16, hkv=hkv, d=d, kbits=6, vbits=8, page=page)
    cq = np.array([0, 11, 11, 12, 21], np.int32)
    ck = np.array([0, 14, 17, 18, 27], np.int32)          # 14, 3, 1 and 9 keys
    q = randn(rng, (21, h, d), F32)
    o, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, 11, 14, block_table=table, causal=causal,
                                          return_attn_probs=True, registry=registry)
    eo, el = reference.flash_attn_varlen(q, dequantized(k), dequantized(v), cq, ck, block_table=table, causal=causal)
    check(o, eo, F32, f"{registry.backend} varlen causal={causal}")
    check_lse(lse, el, f"{registry.backend} varlen lse")


@pytest.mark.parametrize("case", ["causal", "full", "softcap_scale", "long_window"])
def test_rows_equal_the_one_row_decode(registry, rng, case):
    """Each row of a 7-row call agrees with a one-row call (kv_codes_decode)
    that sees the same keys: cache_seqlens cut to the row's causal horizon,
    or the whole cache without causal. Outputs and LSE, with sinks, GQA
    4:2, 77 keys (more than one cpu key tile), and a window that starts the
    rows' keys at different keys. The one-row call runs another kernel with
    another order of sums (the split decode on sim and metal-sim, the
    decode loop on the cpu), so rows agree within the float32 tolerance,
    and both equal float64 attention over K̂, V̂. On the cpu a row's bits
    depend only on the keys it sees (key tiles at absolute positions,
    per-item softmax), not on the other rows of its call: the last 3 rows
    of the 7-row call equal a 3-row call's bit for bit."""
    kw = dict(causal=True, window_size=(66, -1)) if case == "long_window" else CASES[case]
    b, cap, hkv, h, d, ql = 2, 80, 2, 4, 64, 7
    k, v, _ = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=4, vbits=8)
    lens = np.array([9, 77], np.int32)
    q = randn(rng, (b, ql, h, d), F32)
    sinks = rng.standard_normal(h).astype(np.float32)
    o, lse = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, sinks=sinks, return_softmax_lse=True,
                                        registry=registry, **kw)
    for i in range(ql):
        row_lens = lens - ql + 1 + i if kw["causal"] else lens
        oi, li = fm.flash_attn_with_kvcache(q[:, i:i + 1], k, v, cache_seqlens=row_lens.astype(np.int32),
                                            sinks=sinks, return_softmax_lse=True, registry=registry, **kw)
        check(oi, o[:, i:i + 1], F32, f"{registry.backend} {case} row {i}")
        check_lse(li, lse[:, :, i:i + 1], f"{registry.backend} {case} lse of row {i}")
    if registry.backend == "cpu":
        o3, lse3 = fm.flash_attn_with_kvcache(q[:, ql - 3:], k, v, cache_seqlens=lens, sinks=sinks,
                                              return_softmax_lse=True, registry=registry, **kw)
        assert_bits_equal(o[:, ql - 3:], o3, f"{case}: the last 3 rows alone")
        assert_bits_equal(lse[:, :, ql - 3:], lse3, f"{case}: the LSE of the last 3 rows alone")
    eo, el = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens, sinks=sinks,
                                          **{("scale" if n == "softmax_scale" else n): x for n, x in kw.items()})
    check(o, eo, F32, f"{registry.backend} {case}")
    check_lse(lse, el, f"{registry.backend} {case} lse")


def test_flash_attn_func_over_codes(registry, rng):
    """flash_attn_func with QuantizedKV k and v ([B, seqlen_k, Hkv]):
    bottom-right causal over every key, window, softcap, sinks, LSE and
    S_dmask as over dense k/v; ALiBi refused by name."""
    b, sk, hkv, h, d, ql = 2, 12, 2, 4, 64, 5
    k, v, _ = caches(rng, registry, b=b, cap=sk, hkv=hkv, d=d, kbits=8, vbits=6)
    q = randn(rng, (b, ql, h, d), BF16)
    sinks = rng.standard_normal(h).astype(np.float32)
    o, lse, s_dmask = fm.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=3.0, sinks=sinks,
                                         return_attn_probs=True, registry=registry)
    eo, el = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), causal=True, window_size=(4, -1),
                                          softcap=3.0, sinks=sinks)
    assert o.dtype == BF16 and lse.shape == (b, h, ql) and s_dmask.size == 0
    check(o, eo, BF16, f"{registry.backend} flash_attn_func")
    check_lse(lse, el, f"{registry.backend} flash_attn_func lse")


def test_flash_attn_prefill_over_codes(registry, rng):
    """flash_attn_prefill with QuantizedKV k/v (layout 'blhd'): kv_len of the
    capacity, the rows bottom-right, window w as flash_attn_prefill's (keys
    p with pos - p < w), scale, sinks, out; mask, blk, 'bhld' and a top-left
    q_offset refused by name."""
    b, cap, hkv, h, d, ql = 1, 16, 2, 4, 96, 4
    k, v, _ = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=4, vbits=4)
    q = randn(rng, (b, ql, h, d), F16)
    sinks = rng.standard_normal(h).astype(np.float32)
    out = np.empty_like(q)
    got = fm.flash_attn_prefill(q, k, v, causal=True, window=3, scale=0.2, kv_len=10, layout="blhd", sinks=sinks,
                                out=out, registry=registry)
    assert got is out
    eo, _ = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=np.array([10], np.int32),
                                         causal=True, window_size=(2, -1), scale=0.2, sinks=sinks)
    check(out, eo, F16, f"{registry.backend} flash_attn_prefill")
    full = fm.flash_attn_prefill(q, k, v, layout="blhd", q_offset=cap - ql, registry=registry)
    ef, _ = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v))
    check(full, ef, F16, f"{registry.backend} flash_attn_prefill without causal")
    with pytest.raises(ValueError, match="^flash_attn_prefill: QuantizedKV k/v take layout='blhd'"):
        fm.flash_attn_prefill(q, k, v, registry=registry)
    with pytest.raises(NotImplementedError, match="^flash_attn_prefill: mask is not supported over QuantizedKV"):
        fm.flash_attn_prefill(q, k, v, layout="blhd", mask=np.zeros((ql, cap), F16), registry=registry)
    with pytest.raises(NotImplementedError, match=r"^flash_attn_prefill: .*q_offset must be kv_len - qL = 12 "
                                                  r"\(qL <= kv_len\), got 0"):
        fm.flash_attn_prefill(q, k, v, layout="blhd", q_offset=0, registry=registry)
    with pytest.raises(ValueError, match=r"^flash_attn_prefill: kv_len \(17\) must be <= the cache capacity"):
        fm.flash_attn_prefill(q, k, v, layout="blhd", kv_len=17, registry=registry)


def test_rows_never_read_keys_they_do_not_see(registry, rng):
    """window_size (0, 0): each of 6 query rows sees exactly its own key, so
    a tile holds keys each row must skip. A NaN in the dense V row (or in
    the dense K row) of the key only row 2 sees reaches row 2's output and
    no other row's."""
    b, cap, hkv, h, d, ql, kl = 1, 16, 1, 2, 64, 6, 11
    k, v, _ = caches(rng, registry, b=b, cap=cap, hkv=hkv, d=d, kbits=8, vbits=8)
    kd, vd = dequantized(k).astype(F32), dequantized(v).astype(F32)
    key = kl - ql + 2
    kd[0, key, 0, 0], vd[0, key, 0, :] = np.nan, np.nan
    q = randn(rng, (b, ql, h, d), F32)
    lens = np.array([kl], np.int32)
    for kk, vv, what in ((k, vd, "dense V"), (kd, v, "dense K")):
        o = fm.flash_attn_with_kvcache(q, kk, vv, cache_seqlens=lens, window_size=(0, 0), registry=registry)
        bad = ~np.isfinite(o).all(axis=(0, 2, 3))
        assert bad.tolist() == [i == 2 for i in range(ql)], f"{registry.backend} {what}: non-finite rows {bad}"
