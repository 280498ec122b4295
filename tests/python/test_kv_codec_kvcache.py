"""flash_attn_with_kvcache over QuantizedKV caches on every backend.

The appended rows' codes and norms equal KVCodec.encode of the same rows
(bits); the output and LSE equal float64 attention (reference.flash_attn_kvcache)
over the dequantized caches K̂, V̂ (the float64 codec reference's decode of
the library's codes) within the output dtype's tolerance, so the kernels add
no error beyond the codec, with every feature of the dense path."""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

import flashmetal as fm
import head_dim_tables
from flashmetal import quant_reference as qr
from flashmetal import reference
from numerics import BF16, F16, F32, TOLERANCE, assert_bits_equal, randn, worst_element

OP = "flash_attn_with_kvcache"
HEAD_DIMS = head_dim_tables.CODEC


def dequantized(c: fm.QuantizedKV) -> np.ndarray:
    """K̂ or V̂ in float64, from the codes by the reference decoder."""
    return qr.decode(qr.unpack(c.codes, c.codec.bits, c.codec.head_dim), c.norms, c.codec.bits, c.codec.seed)


def check(actual, expected, dtype, what):
    atol, rtol = TOLERANCE[np.dtype(dtype)]
    ok, ratio = reference.close(np.asarray(actual, np.float64), expected, atol, rtol)
    assert ok, f"{what}: {ratio:.3g}x the tolerance; " + worst_element(actual, expected, atol, rtol)


def check_lse(actual, expected, what):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.array_equal(np.isinf(a), np.isinf(e)) and np.array_equal(a[np.isinf(a)], e[np.isinf(e)]), what
    fin = np.isfinite(e)
    assert np.allclose(a[fin], e[fin], atol=1e-4, rtol=1e-4), f"{what}: lse off by {np.abs(a[fin] - e[fin]).max()}"


class Setup:
    """Quantized caches holding `lens` encoded keys per sequence (written
    by the library's own encode), contiguous [B, cap, Hkv] or paged through a
    shuffled block table, plus the new rows to append."""

    def __init__(self, rng, registry, *, d=64, b=2, hkv=2, cap=16, page=4, paged=False, kbits=8, vbits=4,
                 lens=(5, 9), n_new=2, dtype=F32):
        self.kcodec, self.vcodec = fm.KVCodec(d, kbits, seed=3), fm.KVCodec(d, vbits, seed=4)
        self.table = None
        if paged:
            per = cap // page
            self.table = rng.permutation(b * per + 1)[:b * per].reshape(b, per).astype(np.int32)
            lead = (b * per + 1, page, hkv)
        else:
            lead = (b, cap, hkv)
        self.k, self.v = self.kcodec.empty(lead), self.vcodec.empty(lead)
        self.lens = np.array(lens, np.int32)
        # The past: encoded rows written where the kernel will look for them.
        for bi, n in enumerate(lens):
            for t in range(n):
                idx = (bi, t) if not paged else (self.table[bi, t // page], t % page)
                for cache, seed_rows in ((self.k, rng), (self.v, rng)):
                    enc = cache.codec.encode(randn(seed_rows, (hkv, d), dtype), registry=registry)
                    cache.codes[idx], cache.norms[idx] = enc.codes, enc.norms
        self.k_new = randn(rng, (b, n_new, hkv, d), dtype) if n_new else None
        self.v_new = randn(rng, (b, n_new, hkv, d), dtype) if n_new else None
        self.registry = registry

    def slot(self, bi, t):
        if self.table is None:
            return bi, t
        page = self.k.codes.shape[1]
        return self.table[bi, t // page], t % page

    def run(self, q, **kw):
        return fm.flash_attn_with_kvcache(q, self.k, self.v, k=self.k_new, v=self.v_new, cache_seqlens=self.lens,
                                          block_table=self.table, registry=self.registry, **kw)

    def expected(self, q, **kw):
        """float64 attention over K̂, V̂ of the caches as they are now (after
        the call appended), lengths grown by the new rows."""
        grown = self.lens + (0 if self.k_new is None else self.k_new.shape[1])
        if "softmax_scale" in kw:
            kw = dict(kw, scale=kw.pop("softmax_scale"))
        return reference.flash_attn_kvcache(q, dequantized(self.k), dequantized(self.v), cache_seqlens=grown,
                                            block_table=self.table, **kw)

    def check_appended(self):
        if self.k_new is None:
            return
        for cache, new, name in ((self.k, self.k_new, "k"), (self.v, self.v_new, "v")):
            enc = cache.codec.encode(new, registry=self.registry)
            for bi, start in enumerate(self.lens.tolist()):
                for i in range(new.shape[1]):
                    idx = self.slot(bi, start + i)
                    assert_bits_equal(cache.codes[idx], enc.codes[bi, i], f"{name} codes of new row {bi},{i}")
                    assert_bits_equal(cache.norms[idx], enc.norms[bi, i], f"{name} norms of new row {bi},{i}")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
@pytest.mark.parametrize("ql", [1, 3])
def test_append_then_attend(registry, rng, paged, dtype, ql):
    s = Setup(rng, registry, paged=paged, dtype=dtype, d=80 if paged else 64)
    q = randn(rng, (2, ql, 4, s.kcodec.head_dim), dtype)
    q0, lens0 = q.copy(), s.lens.copy()
    o, lse = s.run(q, causal=True, return_softmax_lse=True)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (2, 4, ql) and lse.dtype == np.float32
    s.check_appended()
    eo, el = s.expected(q, causal=True)
    check(o, eo, dtype, f"{registry.backend} paged={paged} {dtype} ql={ql}")
    check_lse(lse, el, f"{registry.backend} lse")
    assert_bits_equal(q, q0, "q is not changed")
    assert_bits_equal(s.lens, lens0, "cache_seqlens is not changed")


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_every_head_dim(registry, rng, d):
    s = Setup(rng, registry, d=d, b=1, hkv=1, cap=8, lens=(4,), n_new=1, kbits=4, vbits=8)
    q = randn(rng, (1, 1, 2, d), BF16)
    o = s.run(q)
    s.check_appended()
    check(o, s.expected(q)[0], BF16, f"{registry.backend} D={d}")


@pytest.mark.parametrize("case", ["window", "window_right", "softcap_scale", "sinks", "inf_sink", "chunk",
                                  "mqa_wide_group", "no_append", "no_lengths", "rows_see_nothing", "k2v3"])
def test_features(registry, rng, case):
    setup_kw = {}
    kw = {}
    h, ql = 4, 2
    if case == "window":
        kw = {"causal": True, "window_size": (3, 0)}
    elif case == "window_right":
        kw = {"window_size": (2, 1)}
    elif case == "softcap_scale":
        kw = {"softcap": 1.5, "softmax_scale": 0.4}
    elif case in ("sinks", "inf_sink"):
        sinks = rng.standard_normal(h).astype(np.float32)
        if case == "inf_sink":
            sinks[1] = np.inf
        kw = {"sinks": sinks, "causal": True}
    elif case == "chunk":
        kw = {"attention_chunk": 4, "causal": True}
    elif case == "mqa_wide_group":  # 10 query heads on one kv head: the cpu's 8-head chunks and a partial one
        h, setup_kw = 10, {"hkv": 1}
    elif case == "no_append":
        setup_kw = {"n_new": 0}
    elif case == "no_lengths":
        setup_kw = {"n_new": 0, "lens": (16, 16)}
    elif case == "rows_see_nothing":  # more query rows than keys: the first rows see no key
        ql, setup_kw, kw = 6, {"lens": (0, 3), "n_new": 1}, {"causal": True}
    elif case == "k2v3":
        setup_kw = {"kbits": 2, "vbits": 3}
    s = Setup(rng, registry, **setup_kw)
    if case == "no_append":
        s.k_new = s.v_new = None
    if case == "no_lengths":
        s.k_new = s.v_new = None
    q = randn(rng, (2, ql, h, 64), F32)
    if case == "no_lengths":
        o, lse = fm.flash_attn_with_kvcache(q, s.k, s.v, return_softmax_lse=True, registry=registry, **kw)
    else:
        o, lse = s.run(q, return_softmax_lse=True, **kw)
    eo, el = s.expected(q, **kw)
    check(o, eo, F32, f"{registry.backend} {case}")
    check_lse(lse, el, f"{registry.backend} {case} lse")
    s.check_appended()


def test_out_and_torch_style_return(registry, rng):
    s = Setup(rng, registry)
    q = randn(rng, (2, 1, 4, 64), BF16)
    out = np.empty_like(q)
    r = s.run(q, out=out)
    assert r is out
    check(out, s.expected(q)[0], BF16, registry.backend)


def test_errors_name_the_function_argument_and_value(registry, rng):
    s = Setup(rng, registry, paged=True)
    q = randn(rng, (2, 1, 4, 64), F32)
    dense = np.zeros(s.k.shape + (32,), np.float16)
    with pytest.raises(ValueError, match=rf"^{OP}: .*v_cache shape \[9, 4, 2, 32\] must be \[9, 4, 2, 64\]"):
        fm.flash_attn_with_kvcache(q, s.k, dense, cache_seqlens=s.lens, block_table=s.table, registry=registry)
    with pytest.raises(TypeError, match=rf"^{OP}: .*v_cache dtype float16 does not match k dtype float32"):
        fm.flash_attn_with_kvcache(q, s.k, np.zeros(s.k.shape + (64,), np.float16), k=s.k_new, v=s.v_new,
                                   cache_seqlens=s.lens, block_table=s.table, registry=registry)
    bad = s.table.copy()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match=rf"^{OP}: .*block_table\[0, 0\] = 99 is out of range"):
        fm.flash_attn_with_kvcache(q, s.k, s.v, k=s.k_new, v=s.v_new, cache_seqlens=s.lens, block_table=bad,
                                   registry=registry)
    with pytest.raises(ValueError, match=rf"^{OP}: .*cache_seqlens\[1\] \+ the new rows of k .* = 15 \+ 2 = 17 exceeds"):
        fm.flash_attn_with_kvcache(q, s.k, s.v, k=s.k_new, v=s.v_new, cache_seqlens=np.array([1, 15], np.int32),
                                   block_table=s.table, registry=registry)
    with pytest.raises(ValueError, match=rf"^{OP}: .*cache_seqlens\[0\] = 17 is out of range \[0, 16\]"):
        fm.flash_attn_with_kvcache(q, s.k, s.v, cache_seqlens=np.array([17, 1], np.int32), block_table=s.table,
                                   registry=registry)
    with pytest.raises(ValueError, match=rf"^{OP}: .*the q heads \(3\) must be a multiple of the k_cache heads \(2\)"):
        fm.flash_attn_with_kvcache(q[:, :, :3], s.k, s.v, cache_seqlens=s.lens, block_table=s.table,
                                   registry=registry)
    other = fm.KVCodec(128, 8).empty(s.k.shape)
    with pytest.raises(ValueError, match=rf"^{OP}: .*v_cache's codec head_dim 128 must equal q's head dim 64"):
        fm.flash_attn_with_kvcache(q, s.k, other, cache_seqlens=s.lens, block_table=s.table, registry=registry)
    with pytest.raises(ValueError, match=rf"^{OP}: .*window"):
        fm.flash_attn_with_kvcache(q, s.k, s.v, cache_seqlens=s.lens, block_table=s.table, window_size=(-3, 0),
                                   registry=registry)
    ro = fm.QuantizedKV(s.k.codec, s.k.codes.copy(), s.k.norms.copy())
    ro.codes.flags.writeable = False
    with pytest.raises(ValueError, match=f"^{OP}: k_cache codes must be a C-contiguous, writeable numpy array"):
        fm.flash_attn_with_kvcache(q, ro, s.v, k=s.k_new, v=s.v_new, cache_seqlens=s.lens, block_table=s.table,
                                   registry=registry)


def test_a_failed_attention_leaves_the_caches_as_they_were(registry, rng):
    """The library validates the append and the attention before either
    runs: when the attention refuses its arguments (sinks of the wrong
    shape), no code row was written."""
    s = Setup(rng, registry)
    before = [a.copy() for a in (s.k.codes, s.k.norms, s.v.codes, s.v.norms)]
    q = randn(rng, (2, 1, 4, 64), F32)
    with pytest.raises(ValueError, match=re.escape("sinks must have shape [4] (num_heads), got [3]")):
        s.run(q, sinks=np.zeros(3, np.float32))
    for a, b0, n in zip((s.k.codes, s.k.norms, s.v.codes, s.v.norms), before, ("kc", "kn", "vc", "vn")):
        assert_bits_equal(a, b0, f"{n} unchanged")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_a_refused_leftpad_call_writes_nothing(registry, rng, layout):
    """cache_leftpad with k/v appended, refused after the append's own
    checks passed (sinks of the wrong shape), inside a batch scope: no code
    row was written."""
    s = Setup(rng, registry, paged=layout == "paged")
    before = [a.copy() for a in (s.k.codes, s.k.norms, s.v.codes, s.v.norms)]
    q = randn(rng, (2, 3, 4, 64), F32)
    lp = np.array([1, 4], np.int32)
    with pytest.raises(ValueError, match=re.escape("sinks must have shape [4] (num_heads), got [3]")):
        with registry.batch():
            fm.flash_attn_with_kvcache(q, s.k, s.v, s.k_new, s.v_new, cache_seqlens=s.lens, cache_leftpad=lp,
                                       block_table=s.table, causal=True, sinks=np.zeros(3, np.float32),
                                       registry=registry)
    for a, b0, n in zip((s.k.codes, s.k.norms, s.v.codes, s.v.norms), before, ("kc", "kn", "vc", "vn")):
        assert_bits_equal(a, b0, f"{n} unchanged")


@pytest.mark.parametrize("rows", [1, 3])
def test_windows_and_chunks_near_int32_max_do_not_wrap(registry, rng, rows):
    """A window or attention chunk of 2**31 - 1 keys hides nothing: the key
    range is computed in 64 bits (in 32 the row's position plus the window
    wrapped negative and the row saw no key)."""
    s = Setup(rng, registry, n_new=0)
    q = randn(rng, (2, rows, 4, 64), F32)
    big = 2**31 - 1
    for kw in (dict(window_size=(big, big)), dict(window_size=(-1, big)), dict(causal=True, attention_chunk=big)):
        got = fm.flash_attn_with_kvcache(q, s.k, s.v, cache_seqlens=s.lens, registry=registry, **kw)
        check(got, s.expected(q, causal=bool(kw.get("causal")))[0], F32, f"{registry.backend} rows={rows} {kw}")


@pytest.mark.parametrize("dense_side", ["k", "v"])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("paged", [False, True])
def test_one_side_dense(registry, rng, dense_side, dtype, paged):
    """K8 codes beside a dense V (or a dense K beside 4-bit V codes), in the
    new rows' dtype: the append copies the dense side's rows bit for bit and
    encodes the other; attention reads each side as it is stored."""
    s = Setup(rng, registry, paged=paged, dtype=dtype, kbits=8, vbits=4)
    lead = s.k.shape
    dense = np.zeros(lead + (64,), dtype)
    quantized = s.k if dense_side == "v" else s.v
    # The dense side's past rows: the values its quantized twin decodes to.
    dense[...] = dequantized(s.v if dense_side == "v" else s.k).astype(dtype)
    k_cache, v_cache = (quantized, dense) if dense_side == "v" else (dense, quantized)
    q = randn(rng, (2, 2, 4, 64), dtype)
    sinks = rng.standard_normal(4).astype(np.float32)
    o, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k=s.k_new, v=s.v_new, cache_seqlens=s.lens,
                                        block_table=s.table, causal=True, sinks=sinks, return_softmax_lse=True,
                                        registry=registry)
    new = s.v_new if dense_side == "v" else s.k_new
    for bi, start in enumerate(s.lens.tolist()):
        for i in range(new.shape[1]):
            assert_bits_equal(dense[s.slot(bi, start + i)], new[bi, i], f"dense {dense_side} row {bi},{i}")
    enc = quantized.codec.encode(s.k_new if dense_side == "v" else s.v_new, registry=registry)
    idx = s.slot(1, int(s.lens[1]))
    assert_bits_equal(quantized.codes[idx], enc.codes[1, 0], "the quantized side's appended codes")
    kk = dequantized(s.k) if dense_side == "v" else dense.astype(np.float64)
    vv = dense.astype(np.float64) if dense_side == "v" else dequantized(s.v)
    eo, el = reference.flash_attn_kvcache(q, kk, vv, cache_seqlens=s.lens + 2, block_table=s.table, causal=True,
                                          sinks=sinks)
    check(o, eo, dtype, f"{registry.backend} dense {dense_side} {dtype} paged={paged}")
    check_lse(lse, el, f"{registry.backend} dense {dense_side} lse")


@pytest.mark.parametrize("dense_v", [False, True])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_varlen_over_quantized_pages(registry, rng, dense_v, dtype):
    """flash_attn_varlen_func over QuantizedKV page pools: ragged query and
    key lengths (one sequence with no queries, one with more queries than
    keys), q padded past the last sequence, causal + window + sinks + LSE."""
    d, hkv, h, page = 64, 2, 4, 4
    kcodec, vcodec = fm.KVCodec(d, 8, seed=5), fm.KVCodec(d, 4, seed=6)
    k = kcodec.encode(randn(rng, (7, page, hkv, d), dtype), registry=registry)
    v_rows = randn(rng, (7, page, hkv, d), dtype)
    v = v_rows if dense_v else vcodec.encode(v_rows, registry=registry)
    cq = np.array([0, 3, 3, 8], np.int32)        # 3, 0 and 5 queries
    ck = np.array([0, 6, 8, 12], np.int32)       # 6, 2 and 4 keys
    table = np.array([[5, 2], [0, 6], [3, 1]], np.int32)
    q = randn(rng, (10, h, d), dtype)            # 2 rows past cu_seqlens_q[-1]
    sinks = rng.standard_normal(h).astype(np.float32)
    kw = dict(causal=True, window_size=(3, -1))
    o, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, block_table=table, sinks=sinks,
                                          return_attn_probs=True, registry=registry, **kw)
    vv = v_rows.astype(np.float64) if dense_v else dequantized(v)
    eo, el = reference.flash_attn_varlen(q, dequantized(k), vv, cq, ck, block_table=table, sinks=sinks, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (h, 10)
    check(o, eo, dtype, f"{registry.backend} varlen dense_v={dense_v} {dtype}")
    check_lse(lse, el, f"{registry.backend} varlen lse")
    assert not np.any(np.asarray(o[8:], np.float64)), "rows past the last sequence are zero"
    # Page pools without their table are neither pages nor packed keys [total_k, Hkv].
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: .*leading shape \[1, total_k, Hkv\]"):
        fm.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, registry=registry)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: .*sequence 2 has length 5 .* > max_seqlen_q = 4"):
        fm.flash_attn_varlen_func(q, k, v, cq, ck, 4, 6, block_table=table, registry=registry)
    with pytest.raises(ValueError, match=r"^flash_attn_varlen_func: .*block_table\[2, 0\] = 9 is out of range \[0, 7\)"):
        fm.flash_attn_varlen_func(q, k, v, cq, ck, 5, 6, block_table=np.array([[5, 2], [0, 6], [9, 1]], np.int32),
                                  registry=registry)


@pytest.mark.parametrize("paged", [False, True])
def test_long_caches_split_over_keys(registry, rng, paged):
    """Thousands of keys per sequence, one empty, kv heads side by side: the
    cpu reads every kv head of a share of keys in one work item, splits each row's
    keys across workers and merges the shares' softmax states (sinks and LSE
    applied after the merge); equal to float64 attention over K̂, V̂."""
    b, cap, hkv, h, d, page = 2, 2560, 2, 4, 64, 256
    kcodec, vcodec = fm.KVCodec(d, 4, seed=3), fm.KVCodec(d, 8, seed=4)
    k = kcodec.encode(randn(rng, (b, cap, hkv, d), F32), registry=registry)
    v = vcodec.encode(randn(rng, (b, cap, hkv, d), F32), registry=registry)
    table = None
    if paged:  # the same rows, scattered over shuffled pages
        per = cap // page
        table = rng.permutation(b * per).reshape(b, per).astype(np.int32)
        kp, vp = kcodec.empty((b * per, page, hkv)), vcodec.empty((b * per, page, hkv))
        for src, dst in ((k, kp), (v, vp)):
            dst.codes[table.reshape(-1)] = src.codes.reshape(b * per, page, hkv, -1)
            dst.norms[table.reshape(-1)] = src.norms.reshape(b * per, page, hkv, -1)
        k, v = kp, vp
    lens = np.array([2333, 0], np.int32)
    sinks = rng.standard_normal(h).astype(np.float32)
    q = randn(rng, (b, 1, h, d), F32)
    o, lse = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, sinks=sinks,
                                        return_softmax_lse=True, registry=registry)
    eo, el = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens, block_table=table,
                                          sinks=sinks)
    check(o, eo, F32, f"{registry.backend} paged={paged}")
    check_lse(lse, el, f"{registry.backend} paged={paged} lse")


LEFTPAD_CASES = {
    "causal_decode": (1, dict(causal=True)),
    "causal_rows": (3, dict(causal=True, sinks=True)),
    "window": (3, dict(causal=True, window_size=(2, 0))),
    "window_both": (1, dict(window_size=(2, 1), softcap=1.5)),
    "chunk": (3, dict(causal=True, attention_chunk=4)),
}


def leftpad_caches(rng, registry, sides, layout):
    """A Setup (K8, V4, GQA 4 on 2, two new rows per sequence) whose caches
    are QuantizedKV on the `sides` given ("kv", "k" or "v") and dense (the
    values the quantized twin decodes to) on the other; with the cache_batch_idx
    of `layout` "batch_idx" (three cache rows, two sequences)."""
    s = Setup(rng, registry, paged=layout == "paged", b=3 if layout == "batch_idx" else 2,
              lens=(5, 9, 2) if layout == "batch_idx" else (5, 9))
    idx = np.array([2, 0], np.int32) if layout == "batch_idx" else None
    if idx is not None:
        s.k_new, s.v_new = s.k_new[:2], s.v_new[:2]
    k_cache = s.k if "k" in sides else dequantized(s.k).astype(F32)
    v_cache = s.v if "v" in sides else dequantized(s.v).astype(F32)
    return s, idx, k_cache, v_cache


def rows(cache):
    """float64 rows of a cache as the attention reads them."""
    return dequantized(cache) if isinstance(cache, fm.QuantizedKV) else cache.astype(np.float64)


@pytest.mark.parametrize("case", LEFTPAD_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "paged", "batch_idx"])
@pytest.mark.parametrize("sides", ["kv", "k", "v"])
def test_leftpad_over_codes(registry, rng, sides, layout, case):
    """cache_leftpad over quantized K and V, K only or V only: sequence b is
    its cache rows [leftpad[b], cache_seqlens[b] + 2) after k/v were appended
    at cache_seqlens[b] (one sequence's first key past its old keys: it sees
    one appended row), positions counted from its first key; equal to float64
    attention over the dequantized rows, the appended codes equal to
    KVCodec.encode of the new rows bit for bit."""
    s, idx, k_cache, v_cache = leftpad_caches(rng, registry, sides, layout)
    ql, kw = LEFTPAD_CASES[case]
    if kw.get("sinks"):
        kw = dict(kw, sinks=rng.standard_normal(4).astype(np.float32))
    lens = s.lens if idx is None else s.lens[idx]
    lp = np.array([3, 0], np.int32) if idx is None else np.array([3, 10], np.int32)  # 10 > cache_seqlens 9
    lp_given, lens_given = lp.copy(), lens.copy()
    q = randn(rng, (2, ql, 4, 64), F32)
    o, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, s.k_new, s.v_new, cache_seqlens=lens,
                                        cache_batch_idx=idx, cache_leftpad=lp, block_table=s.table,
                                        return_softmax_lse=True, registry=registry, **kw)
    for cache, new, name in ((k_cache, s.k_new, "k"), (v_cache, s.v_new, "v")):
        enc = cache.codec.encode(new, registry=registry) if isinstance(cache, fm.QuantizedKV) else None
        for b in range(2):
            for i in range(2):
                where = s.slot(b if idx is None else idx[b], lens[b] + i)
                if enc is None:
                    assert_bits_equal(cache[where], new[b, i], f"dense {name} row {b},{i}")
                else:
                    assert_bits_equal(cache.codes[where], enc.codes[b, i], f"{name} codes of new row {b},{i}")
                    assert_bits_equal(cache.norms[where], enc.norms[b, i], f"{name} norms of new row {b},{i}")
    eo, el = reference.flash_attn_kvcache(q, rows(k_cache), rows(v_cache), cache_seqlens=lens + 2,
                                          cache_batch_idx=idx, cache_leftpad=lp, block_table=s.table, **kw)
    what = f"{registry.backend} {sides} {layout} {case}"
    check(o, eo, F32, what)
    check_lse(lse, el, f"{what} lse")
    assert_bits_equal(lp, lp_given, "cache_leftpad is not changed")
    assert_bits_equal(lens, lens_given, "cache_seqlens is not changed")


def test_leftpad_over_codes_without_append(registry, rng):
    """No k/v: the caches are read as they are, every slot when cache_seqlens
    is None; a first key at or past the end leaves the sequence no key
    (output 0, LSE -inf), as over dense caches."""
    s = Setup(rng, registry, n_new=0)
    q = randn(rng, (2, 2, 4, 64), BF16)
    for lens, lp in ((s.lens, np.array([1, 9], np.int32)), (None, np.array([13, 4], np.int32))):
        o, lse = fm.flash_attn_with_kvcache(q, s.k, s.v, cache_seqlens=lens, cache_leftpad=lp, causal=True,
                                            return_softmax_lse=True, registry=registry)
        eo, el = reference.flash_attn_kvcache(q, dequantized(s.k), dequantized(s.v), cache_seqlens=lens,
                                              cache_leftpad=lp, causal=True)
        check(o, eo, BF16, f"{registry.backend} lens={lens}")
        check_lse(lse, el, f"{registry.backend} lens={lens} lse")
    o, lse = fm.flash_attn_with_kvcache(q, s.k, s.v, cache_seqlens=s.lens, cache_leftpad=s.lens,
                                        return_softmax_lse=True, registry=registry)
    assert not np.asarray(o, np.float64).any() and np.isneginf(lse).all()
    empty = s.kcodec.empty((2, 0, 2))  # a capacity of 0: no keys, as over a dense [2, 0, Hkv, D] cache
    o, lse = fm.flash_attn_with_kvcache(q, empty, empty, cache_leftpad=np.zeros(2, np.int32),
                                        return_softmax_lse=True, registry=registry)
    assert not np.asarray(o, np.float64).any() and np.isneginf(lse).all()


@pytest.mark.parametrize("sides", ["kv", "v"])
def test_leftpad_over_codes_with_rotary(registry, rng, sides):
    """Rotary positions stay cache rows (cache_seqlens[b] + i), whatever
    cache_leftpad says: the codes written are KVCodec.encode of k rotated
    there, and the output is attention of q rotated likewise."""
    s, _, k_cache, v_cache = leftpad_caches(rng, registry, sides, "contiguous")
    angle = rng.random((16, 16)) * 2 * np.pi
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    lp = np.array([4, 2], np.int32)
    q = randn(rng, (2, 3, 4, 64), F32)
    o, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, s.k_new, s.v_new, rotary_cos=cos, rotary_sin=sin,
                                        cache_seqlens=s.lens, cache_leftpad=lp, causal=True, return_softmax_lse=True,
                                        registry=registry)
    k_ro = reference.apply_rotary_emb(s.k_new, cos, sin, s.lens, interleaved=True).astype(F32)
    q_ro = reference.apply_rotary_emb(q, cos, sin, s.lens, interleaved=True).astype(F32)
    if sides == "kv":
        enc = s.kcodec.encode(k_ro, registry=registry)
        assert_bits_equal(s.k.codes[1, 9:11], enc.codes[1], "codes of the rotated new rows")
    eo, el = reference.flash_attn_kvcache(q_ro, rows(k_cache), rows(v_cache), cache_seqlens=s.lens + 2,
                                          cache_leftpad=lp, causal=True)
    check(o, eo, F32, f"{registry.backend} rotary {sides}")
    check_lse(lse, el, f"{registry.backend} rotary {sides} lse")


@pytest.mark.parametrize("paged", [False, True])
def test_leftpad_over_codes_errors(rng, paged):
    """Bad leftpad tables, lengths and block tables are refused by name, as
    over dense caches, before anything is written."""
    s = Setup(rng, "cpu", paged=paged)
    q = randn(rng, (2, 1, 4, 64), F32)
    before = [a.copy() for a in (s.k.codes, s.k.norms, s.v.codes, s.v.norms)]
    bad_table = None if s.table is None else s.table.copy()
    if bad_table is not None:
        bad_table[1, 0] = 99
    cases = [
        (dict(cache_leftpad=np.array([0, 17], np.int32)), "cache_leftpad", r"cache_leftpad\[1\] = 17 is out of range "
         r"\[0, 16\]"),
        (dict(cache_leftpad=np.array([-1, 0], np.int32)), "cache_leftpad", r"cache_leftpad\[0\] = -1 is out of range"),
        (dict(cache_leftpad=np.zeros(3, np.int32)), "cache_leftpad", r"cache_leftpad must have shape \[2\]"),
        (dict(cache_leftpad=np.zeros(2, np.int32), cache_seqlens=np.array([3, 17], np.int32), k=None, v=None),
         "cache_seqlens", r"cache_seqlens\[1\] = 17 is out of range \[0, 16\] \(" + (
             r"block_table's 4 pages \(its dim 1\) of 4 keys" if paged else r"the cache capacity, k_cache's dim 1")),
    ]
    if bad_table is not None:
        cases.append((dict(cache_leftpad=np.array([0, 5], np.int32), block_table=bad_table, k=None, v=None),
                      "block_table", r"block_table\[1, 0\] = 99 is out of range \[0, 9\) \(the pages of k_cache\)"))
    for kw, argument, words in cases:
        args = dict(k=s.k_new, v=s.v_new, cache_seqlens=s.lens, block_table=s.table)
        args.update(kw)
        with pytest.raises(fm.InvalidValueError, match=rf"^{OP}: .*{words}") as e:
            fm.flash_attn_with_kvcache(q, s.k, s.v, registry="cpu", **args)
        assert e.value.argument == argument, (kw, e.value.argument)
    for a, b0, n in zip((s.k.codes, s.k.norms, s.v.codes, s.v.norms), before, ("kc", "kn", "vc", "vn")):
        assert_bits_equal(a, b0, f"{n} not written by a refused call")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("ql", [1, 3])
def test_cache_batch_idx_over_codes(registry, rng, paged, ql):
    """cache_batch_idx: sequence b reads and appends cache row idx[b] (of the
    block table when paged, flash-attn 3's page_table[cache_batch_idx]); the
    appended codes equal KVCodec.encode of the new rows bit for bit, the
    output is float64 attention over the caches' contents; bad indices are
    refused before anything is written."""
    s = Setup(rng, registry, paged=paged, b=3, lens=(5, 9, 2))  # three cache rows, two sequences
    idx = np.array([2, 0], np.int32)
    s.k_new, s.v_new = s.k_new[:2], s.v_new[:2]
    q = randn(rng, (2, ql, 4, 64), F32)
    lens = s.lens[idx]
    o, lse = fm.flash_attn_with_kvcache(q, s.k, s.v, s.k_new, s.v_new, cache_seqlens=lens, cache_batch_idx=idx,
                                        block_table=s.table, causal=True, return_softmax_lse=True, registry=registry)
    for cache, new in ((s.k, s.k_new), (s.v, s.v_new)):
        enc = cache.codec.encode(new, registry=registry)
        for b, row in enumerate(idx.tolist()):
            for i in range(new.shape[1]):
                where = s.slot(row, lens[b] + i)
                assert_bits_equal(cache.codes[where], enc.codes[b, i], f"codes of new row {b},{i}")
    eo, el = reference.flash_attn_kvcache(q, dequantized(s.k), dequantized(s.v), cache_seqlens=lens + 2,
                                          cache_batch_idx=idx, block_table=s.table, causal=True)
    check(o, eo, F32, f"{registry.backend} paged={paged}")
    check_lse(lse, el, f"{registry.backend} paged={paged} lse")
    before = s.k.codes.copy()
    for bad, words in ((np.array([3, 0], np.int32), r"cache_batch_idx\[0\] = 3 is out of range \[0, 3\)"),
                       (np.array([1, 1], np.int32), "both name cache row 1")):
        with pytest.raises(fm.InvalidValueError, match=words) as e:
            fm.flash_attn_with_kvcache(q, s.k, s.v, s.k_new, s.v_new, cache_seqlens=lens, cache_batch_idx=bad,
                                       block_table=s.table, registry=registry)
        assert e.value.argument == "cache_batch_idx"
    assert_bits_equal(s.k.codes, before, "nothing written by a refused call")


@pytest.mark.skipif("metal-sim" not in fm.registry.backend_names(), reason="needs the metal-sim backend (Linux)")
def test_decode_steps_inside_a_batch_scope(rng):
    """Decode steps over QuantizedKV caches in one batch scope on a deferring
    backend (one command buffer): the kernel writes the output in q's dtype
    in place, each step appending its rows and reading those of the steps
    before; a bfloat16 q gives the bits it gives outside a scope; a q whose
    result would be converted on the host (float16 q over a bfloat16 dense
    side) is refused by name."""
    reg = fm.Registry("metal-sim")
    s = Setup(rng, reg, n_new=1)
    steps = 3
    qs = [randn(rng, (2, 1, 4, 64), F32) for _ in range(steps)]
    news = [(randn(rng, (2, 1, 2, 64), F32), randn(rng, (2, 1, 2, 64), F32)) for _ in range(steps)]
    outs = [np.zeros((2, 1, 4, 64), F32) for _ in range(steps)]
    with reg.batch():
        for i in range(steps):
            fm.flash_attn_with_kvcache(qs[i], s.k, s.v, *news[i], cache_seqlens=s.lens + i, causal=True, out=outs[i],
                                       registry=reg)
    k_hat, v_hat = dequantized(s.k), dequantized(s.v)
    for i in range(steps):
        eo, _ = reference.flash_attn_kvcache(qs[i], k_hat, v_hat, cache_seqlens=s.lens + i + 1, causal=True)
        check(outs[i], eo, F32, f"step {i}")
    for i, (kn, vn) in enumerate(news):
        for cache, new in ((s.k, kn), (s.v, vn)):
            enc = cache.codec.encode(new, registry=reg)
            for bi, start in enumerate((s.lens + i).tolist()):
                assert_bits_equal(cache.codes[bi, start], enc.codes[bi, 0], f"codes of step {i}, sequence {bi}")
    q16 = qs[0].astype(BF16)
    with reg.batch():
        inside = fm.flash_attn_with_kvcache(q16, s.k, s.v, cache_seqlens=s.lens, registry=reg)
    assert inside.dtype == BF16
    assert_bits_equal(inside, fm.flash_attn_with_kvcache(q16, s.k, s.v, cache_seqlens=s.lens, registry=reg),
                      "a bfloat16 step inside a batch scope")
    dense_v = np.zeros(s.k.shape + (64,), BF16)
    with reg.batch():
        with pytest.raises(fm.InvalidValueError, match="inside a batch scope on metal pass q as float32 or in the "
                                                       "dense cache's dtype") as e:
            fm.flash_attn_with_kvcache(qs[0].astype(np.float16), s.k, dense_v, cache_seqlens=s.lens, registry=reg)
    assert e.value.argument == "q"
    reg.close()


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("dense", [None, "v"])
def test_q_and_out_in_their_16_bit_dtype(registry, rng, dtype, q_len, dense):
    """A 16-bit q (the decode and the chunked prefill over codes, both
    caches codes or V a dense cache of q's dtype): the kernel reads q exactly
    and writes the float32 result rounded once in q's dtype: the bits of a
    float32 q's result rounded, and the float64 reference over the
    dequantized past within q's dtype's tolerance."""
    s = Setup(rng, registry, n_new=0)
    v: Any = s.v
    if dense == "v":  # V as a dense cache of q's dtype holding the same keys
        v = dequantized(s.v).astype(dtype)
    q = randn(rng, (2, q_len, 4, 64), dtype)
    kw = dict(cache_seqlens=s.lens, causal=True, registry=registry)
    out = fm.flash_attn_with_kvcache(q, s.k, v, **kw)
    wide = fm.flash_attn_with_kvcache(q.astype(F32), s.k, v, **kw)
    assert out.dtype == dtype
    assert_bits_equal(out, wide.astype(dtype), f"{registry.backend} q_len {q_len}: one rounding")
    v_hat = dequantized(s.v) if dense is None else v.astype(np.float64)
    eo, _ = reference.flash_attn_kvcache(q, dequantized(s.k), v_hat, cache_seqlens=s.lens, causal=True)
    check(out, eo, dtype, f"{registry.backend} {dtype} q_len {q_len} dense {dense}")
