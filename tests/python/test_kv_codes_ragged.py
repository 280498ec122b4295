"""flash_attn_with_kvcache's ragged arguments (flash-attn 3's cu_seqlens_q,
max_seqlen_q, cu_seqlens_k_new) over QuantizedKV caches, every backend:
sequence b's new keys k[cu_seqlens_k_new[b]:...[b+1]] are encoded into its
cache rows cache_seqlens[b]... (bit-identical to KVCodec.encode of those
rows, every other code row untouched), then its queries
q[cu_seqlens_q[b]:...[b+1]] attend to its keys [cache_leftpad[b],
cache_seqlens[b] + new_b) bottom-right per sequence. Outputs and LSE equal
float64 attention over the dequantized caches after the append, with causal,
windows, chunks, softcap, sinks, ALiBi, contiguous and paged caches,
cache_batch_idx, cache_leftpad, rotary, ragged q over dense new keys and
dense q over ragged new keys; a bad table is refused before any code row is
written."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F32, randn
from serving_cases import cu, feature_kw, ragged_features
from test_kv_codec_kvcache import check, check_lse, dequantized
from test_kv_codes_prefill import caches

H, HKV, D, CAP, PAGE = 4, 2, 64, 24, 4
Q_LENS, NEW_LENS = [3, 0, 5, 1], [2, 0, 4, 1]
CACHE_LENS = np.array([10, 4, 0, 17], np.int32)
LEFTPAD = np.array([3, 0, 0, 7], np.int32)
FEATURES = ragged_features(window=(4, 1))


def expected(q, cq, k_rows, v_rows, ends, starts, kw):
    """(out [total_q, H, D], lse [H, total_q]) of each sequence over its
    dequantized rows k_rows[b][starts[b]:ends[b]]."""
    out = np.zeros(q.shape, np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cq) - 1):
        s, e = int(cq[b]), int(cq[b + 1])
        kwb = dict(kw)
        if np.ndim(kw.get("alibi_slopes")) == 2:
            kwb["alibi_slopes"] = kw["alibi_slopes"][b]
        out[s:e], lse[:, s:e] = reference.attend_sequence(q[s:e], k_rows[b][starts[b]:ends[b]],
                                                          v_rows[b][starts[b]:ends[b]], **kwb)
    return out, lse


def sequence_rows(cache: fm.QuantizedKV, b: int, table, idx) -> tuple[np.ndarray, np.ndarray]:
    """Sequence b's storage (codes, norms) rows in key order: its cache row
    (idx[b] with cache_batch_idx) or its block-table pages."""
    if table is not None:
        pages = table[b if idx is None else idx[b]]
        return (np.concatenate([cache.codes[p] for p in pages]), np.concatenate([cache.norms[p] for p in pages]))
    r = b if idx is None else idx[b]
    return cache.codes[r], cache.norms[r]


def dequantized_rows(cache, b, table, idx):
    codes, norms = sequence_rows(cache, b, table, idx)
    part = fm.QuantizedKV(cache.codec, codes, norms)
    return dequantized(part)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("layout", ["contiguous", "paged", "batch_idx", "leftpad"])
def test_ragged_append_and_attend(registry, rng, layout, feature):
    batch = len(Q_LENS)
    cq, ck = cu(Q_LENS), cu(NEW_LENS)
    q = randn(rng, (int(cq[-1]), H, D), F32)
    k_new, v_new = randn(rng, (int(ck[-1]), HKV, D), F32), randn(rng, (int(ck[-1]), HKV, D), F32)
    kw = feature_kw(rng, FEATURES[feature], batch, H)
    extra: dict = {}
    table = idx = None
    if layout == "paged":
        k, v, table = caches(rng, registry, b=batch, cap=CAP, hkv=HKV, d=D, kbits=8, vbits=4, page=PAGE)
        extra["block_table"] = table
    elif layout == "batch_idx":
        k, v, _ = caches(rng, registry, b=6, cap=CAP, hkv=HKV, d=D, kbits=8, vbits=4)
        idx = np.array([4, 1, 5, 0], np.int32)
        extra["cache_batch_idx"] = idx
    else:
        k, v, _ = caches(rng, registry, b=batch, cap=CAP, hkv=HKV, d=D, kbits=8, vbits=4)
    starts = LEFTPAD if layout == "leftpad" else np.zeros(batch, np.int32)
    if layout == "leftpad":
        extra["cache_leftpad"] = LEFTPAD
    before = [(c.codes.copy(), c.norms.copy()) for c in (k, v)]
    out, lse = fm.flash_attn_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=CACHE_LENS, cu_seqlens_q=cq,
                                          cu_seqlens_k_new=ck, max_seqlen_q=max(Q_LENS), return_softmax_lse=True,
                                          registry=registry, **extra, **kw)
    assert np.asarray(out).shape == q.shape and np.asarray(lse).shape == (H, q.shape[0])
    ends = CACHE_LENS + np.diff(ck)
    # The new rows' codes are KVCodec.encode's, at each sequence's rows; no other code row changed.
    for cache, (codes0, norms0), new in ((k, before[0], k_new), (v, before[1], v_new)):
        want_codes, want_norms = codes0.copy(), norms0.copy()
        enc = cache.codec.encode(new, registry="cpu")
        for b in range(batch):
            for i in range(int(ck[b]), int(ck[b + 1])):
                t = int(CACHE_LENS[b]) + i - int(ck[b])
                at = (table[b, t // PAGE], t % PAGE) if table is not None else (b if idx is None else idx[b], t)
                want_codes[at], want_norms[at] = enc.codes[i], enc.norms[i]
        np.testing.assert_array_equal(cache.codes, want_codes)
        np.testing.assert_array_equal(cache.norms, want_norms)
    k_rows = [dequantized_rows(k, b, table, idx) for b in range(batch)]
    v_rows = [dequantized_rows(v, b, table, idx) for b in range(batch)]
    e_out, e_lse = expected(q, cq, k_rows, v_rows, ends, starts, kw)
    what = f"{registry.backend} {layout} {feature}"
    check(out, e_out, F32, what)
    check_lse(lse, e_lse, what + " lse")


def test_ragged_queries_over_dense_new_keys(registry, rng):
    """flash-attn's test layout: q ragged (bf16), k/v [B, seqlen_new, Hkv, D]."""
    batch, n_new = 3, 2
    cq = cu([2, 4, 1])
    lens = np.array([5, 0, 17], np.int32)
    k, v, _ = caches(rng, registry, b=batch, cap=CAP, hkv=HKV, d=D, kbits=6, vbits=8)
    q = randn(rng, (int(cq[-1]), H, D), BF16)
    kn, vn = randn(rng, (batch, n_new, HKV, D), F32), randn(rng, (batch, n_new, HKV, D), F32)
    out = fm.flash_attn_with_kvcache(q, k, v, kn, vn, cache_seqlens=lens, cu_seqlens_q=cq, max_seqlen_q=4,
                                     causal=True, registry=registry)
    assert out.dtype == BF16
    e_out, _ = expected(q, cq, list(dequantized(k)), list(dequantized(v)), lens + n_new, np.zeros(batch, int),
                        dict(causal=True))
    check(out, e_out, BF16, f"{registry.backend} ragged q, dense k")


def test_dense_queries_over_ragged_new_keys(registry, rng):
    """q [B, qL, H, D] with cu_seqlens_k_new: out [B, qL, H, D], lse [B, H, qL]."""
    batch, ql = 3, 2
    ck = cu([1, 3, 0])
    lens = np.array([4, 9, 2], np.int32)
    k, v, _ = caches(rng, registry, b=batch, cap=16, hkv=HKV, d=D, kbits=4, vbits=4)
    q = randn(rng, (batch, ql, H, D), F32)
    kn, vn = randn(rng, (int(ck[-1]), HKV, D), F32), randn(rng, (int(ck[-1]), HKV, D), F32)
    out, lse = fm.flash_attn_with_kvcache(q, k, v, kn, vn, cache_seqlens=lens, cu_seqlens_k_new=ck, causal=True,
                                          return_softmax_lse=True, registry=registry)
    assert np.asarray(out).shape == q.shape and np.asarray(lse).shape == (batch, H, ql)
    e_out, e_lse = expected(q.reshape(-1, H, D), cu([ql] * batch), list(dequantized(k)), list(dequantized(v)),
                            lens + np.diff(ck), np.zeros(batch, int), dict(causal=True))
    check(out, e_out.reshape(q.shape), F32, f"{registry.backend} dense q, ragged k")
    check_lse(lse, e_lse.reshape(H, batch, ql).transpose(1, 0, 2), f"{registry.backend} dense q, ragged k lse")


def test_ragged_queries_without_append(registry, rng):
    """cu_seqlens_q alone: a chunk of each sequence's queries over its codes;
    rows past cu_seqlens_q[-1] read 0 (LSE -inf); out= filled in place."""
    cq = cu([3, 0, 2])
    lens = np.array([7, 3, 12], np.int32)
    k, v, table = caches(rng, registry, b=3, cap=16, hkv=HKV, d=D, kbits=8, vbits=8, page=PAGE)
    q = randn(rng, (int(cq[-1]) + 2, H, D), F32)
    out = np.full(q.shape, 7, np.float32)
    got, lse = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, cu_seqlens_q=cq,
                                          max_seqlen_q=3, window_size=(2, 0), out=out, return_softmax_lse=True,
                                          registry=registry)
    assert got is out
    rows = [(dequantized_rows(k, b, table, None), dequantized_rows(v, b, table, None)) for b in range(3)]
    e_out, e_lse = expected(q, cq, [r[0] for r in rows], [r[1] for r in rows], lens, np.zeros(3, int),
                            dict(window_size=(2, 0)))
    check(out, e_out, F32, f"{registry.backend} ragged q, no append")
    check_lse(lse, e_lse, f"{registry.backend} ragged q, no append lse")
    assert not out[int(cq[-1]):].any() and np.isneginf(lse[:, int(cq[-1]):]).all()


def test_ragged_rotary(registry, rng):
    """The new keys of sequence b rotated at cache_seqlens[b] + i before they
    are encoded, its q rows at cache_seqlens[b] + i (causal): the same as
    rotating by hand and calling without rotary."""
    cq, ck = cu([2, 3, 0]), cu([2, 1, 1])
    lens = np.array([3, 0, 8], np.int32)
    angle = rng.random((16, 16)) * 2 * np.pi
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    q = randn(rng, (int(cq[-1]), H, D), F32)
    kn, vn = randn(rng, (int(ck[-1]), HKV, D), F32), randn(rng, (int(ck[-1]), HKV, D), F32)
    k1, v1, _ = caches(rng, registry, b=3, cap=16, hkv=HKV, d=D, kbits=8, vbits=4)
    k2 = fm.QuantizedKV(k1.codec, k1.codes.copy(), k1.norms.copy())
    v2 = fm.QuantizedKV(v1.codec, v1.codes.copy(), v1.norms.copy())
    out = fm.flash_attn_with_kvcache(q, k1, v1, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                     cu_seqlens_q=cq, cu_seqlens_k_new=ck, max_seqlen_q=3, causal=True,
                                     rotary_interleaved=False, registry=registry)
    q_ro, k_ro = np.empty_like(q), np.empty_like(kn)
    for b in range(3):
        s, e = int(cq[b]), int(cq[b + 1])
        if e > s:
            q_ro[s:e] = reference.apply_rotary_emb(q[None, s:e], cos, sin, int(lens[b]), interleaved=False)[0]
        s, e = int(ck[b]), int(ck[b + 1])
        k_ro[s:e] = reference.apply_rotary_emb(kn[None, s:e], cos, sin, int(lens[b]), interleaved=False)[0]
    want = fm.flash_attn_with_kvcache(q_ro, k2, v2, k_ro, vn, cache_seqlens=lens, cu_seqlens_q=cq,
                                      cu_seqlens_k_new=ck, max_seqlen_q=3, causal=True, registry=registry)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(k1.codes, k2.codes)  # the rotated keys were encoded
    np.testing.assert_array_equal(k1.norms, k2.norms)


@pytest.mark.parametrize("case, words, argument", [
    ("overflow", "sequence 2's new keys overflow its cache", "cu_seqlens_k_new"),
    ("split", "cu_seqlens_k_new[3] = 6 must equal the rows of k (its dim 0, 7)", "cu_seqlens_k_new"),
    ("no_new", "cu_seqlens_k_new is given without k and v", "cu_seqlens_k_new"),
])
def test_bad_tables_write_nothing(rng, case, words, argument):
    """Refused by name before any code row is written."""
    k, v, _ = caches(rng, "cpu", b=3, cap=8, hkv=HKV, d=D, kbits=8, vbits=4)
    before = (k.codes.copy(), k.norms.copy(), v.codes.copy(), v.norms.copy())
    cq, ck = cu([1, 1, 1]), cu([2, 1, 3 if case != "split" else 3])
    lens = np.array([1, 2, 6 if case == "overflow" else 3], np.int32)
    n = int(ck[-1]) + (1 if case == "split" else 0)
    kn, vn = randn(rng, (n, HKV, D), F32), randn(rng, (n, HKV, D), F32)
    q = randn(rng, (3, H, D), F32)
    args = (None, None) if case == "no_new" else (kn, vn)
    with pytest.raises(ValueError) as info:
        fm.flash_attn_with_kvcache(q, k, v, *args, cache_seqlens=lens, cu_seqlens_q=cq, cu_seqlens_k_new=ck,
                                   max_seqlen_q=1, registry="cpu")
    assert isinstance(info.value, fm.Error) and info.value.op == "flash_attn_with_kvcache", info.value
    assert info.value.argument == argument and words in str(info.value), str(info.value)
    for a, b in zip(before, (k.codes, k.norms, v.codes, v.norms)):
        np.testing.assert_array_equal(a, b)


def _codes_attn(q, k, v, out, opts, **seq_arrays):
    """One fm_dispatch_kv_codes_attn on the cpu with the given FMSeqTensors arrays."""
    from flashmetal import _native
    from flashmetal._arrays import tensor
    ffi = _native.ffi()
    seq = ffi.new("FMSeqTensors *")
    keep = []
    for name, a in seq_arrays.items():
        keep.append(tensor(ffi, a))
        setattr(seq, name, keep[-1])
    _native.call(fm.Registry("cpu"), "fm_dispatch_kv_codes_attn", tensor(ffi, q), k.codec._c, tensor(ffi, k.codes),
                 tensor(ffi, k.norms), v.codec._c, tensor(ffi, v.codes), tensor(ffi, v.norms), seq, tensor(ffi, out),
                 _native.options("FMAttnOptions", scale=0.125, window_left=-1, window_right=-1, **opts),
                 op="test", keep=(q, k, v, out, seq_arrays, keep))


def test_a_table_sharing_the_appended_cache_is_refused(rng):
    """The ragged append writes the norms; a block table read only through
    cache_leftpad's view (no kernel binds the caller's table) that shares
    their bytes is refused before anything is written."""
    k, v, _ = caches(rng, "cpu", b=4, cap=4, hkv=1, d=D, kbits=8, vbits=8)
    k.norms.reshape(-1)[:4].view(np.int32)[:] = [0, 1, 2, 3]  # valid page indices in the norms' bytes
    table = k.norms.reshape(-1)[:4].view(np.int32).reshape(2, 2)
    before = (k.codes.copy(), k.norms.copy())
    q, out = randn(rng, (2, 1, 64), F32), np.zeros((2, 1, 64), np.float32)
    kn = randn(rng, (2, 1, 64), F32)
    with pytest.raises(ValueError, match="overlap in memory"):
        _codes_attn(q, k, v, out, dict(max_seqlen_q=1), block_table=table, cu_seqlens_q=cu([1, 1]),
                    seqlens_k=np.array([[1, 2], [0, 1]], np.int32), k_new=kn, v_new=kn.copy(),
                    cu_seqlens_k_new=cu([1, 1]))
    np.testing.assert_array_equal(k.codes, before[0])
    np.testing.assert_array_equal(k.norms, before[1])


def test_no_query_row_still_checks_what_the_append_writes(rng):
    """No packed query row: no attention kernel binds the ALiBi slopes, yet
    slopes sharing the appended norms' bytes are refused, nothing written."""
    k, v, _ = caches(rng, "cpu", b=2, cap=8, hkv=1, d=D, kbits=8, vbits=8)
    slopes = k.norms.reshape(-1)[:2].reshape(2, 1)
    before = (k.codes.copy(), k.norms.copy())
    q, out = np.zeros((0, 1, 64), np.float32), np.zeros((0, 1, 64), np.float32)
    kn = randn(rng, (2, 1, 64), F32)
    with pytest.raises(ValueError, match="overlap in memory"):
        _codes_attn(q, k, v, out, {}, cu_seqlens_q=cu([0, 0]), seqlens_k=np.array([1, 2], np.int32), k_new=kn,
                    v_new=kn.copy(), cu_seqlens_k_new=cu([1, 1]), alibi_slopes=slopes)
    np.testing.assert_array_equal(k.codes, before[0])
    np.testing.assert_array_equal(k.norms, before[1])


def test_seqused_q_without_packed_rows_is_a_value_error(rng):
    """seqused_q without cu_seqlens_q (or cu_seqlens_k) names seqused_q."""
    k, v, table = caches(rng, "cpu", b=2, cap=8, hkv=1, d=D, kbits=8, vbits=8, page=4)
    q, out = randn(rng, (2, 1, 1, 64), F32), np.zeros((2, 1, 1, 64), np.float32)
    with pytest.raises(ValueError, match="seqused_q needs cu_seqlens_q"):
        _codes_attn(q, k, v, out, {}, seqused_q=np.array([1, 1], np.int32), block_table=table)
    q, out = randn(rng, (2, 1, 64), F32), np.zeros((2, 1, 64), np.float32)
    with pytest.raises(ValueError, match="seqused_q needs cu_seqlens_k"):
        _codes_attn(q, k, v, out, dict(max_seqlen_q=1), seqused_q=np.array([1, 1], np.int32), block_table=table,
                    cu_seqlens_q=cu([1, 1]), seqlens_k=np.array([3, 5], np.int32))
