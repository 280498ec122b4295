"""Short queries (1 < seqlen_q <= 8: speculative decoding, small chunks) run
the split-KV decode kernel with each query row's own causal/window keys
(fm_dispatch_vec_seq with q [B, L, H, D]) on every backend, against the
float64 serving reference. Sim shapes are tiny: B*H*L*kL*D stays small."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _native, reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, qkv_of_shapes, randn
from serving_native import make_cache


@pytest.fixture
def calls(monkeypatch):
    """The library entry points the public functions call, in order."""
    seen: list[str] = []
    real = _native.call

    def spy(reg, fn_name, *args, **kw):
        seen.append(fn_name)
        return real(reg, fn_name, *args, **kw)
    monkeypatch.setattr(_native, "call", spy)
    return seen


def _qkv(rng, b, ql, kl, h, hkv, d, dtype, dv=None):
    """flash-attn's q [b, ql, h, d] and k/v [b, kl, hkv, d] (v's head dim dv)."""
    return qkv_of_shapes(rng, (b, ql, h, d), (b, kl, hkv, d), dtype, dv=dv)


# (qL, kL, H, Hkv, D, dtype, keywords): causal bottom-right, windows on both
# sides, GQA 1/2/4/8, fewer keys than query rows, softcap, chunks, ALiBi.
FUNC_CASES = [
    (2, 40, 2, 2, 64, BF16, dict(causal=True)),
    (4, 70, 4, 1, 64, F16, dict(causal=True)),
    (8, 45, 4, 2, 128, BF16, dict(causal=True)),
    (3, 37, 2, 1, 64, F32, dict(causal=False)),
    (5, 66, 4, 2, 64, BF16, dict(causal=False, window_size=(9, 2))),
    (6, 50, 2, 1, 80, F16, dict(causal=True, window_size=(20, -1))),
    (8, 5, 4, 4, 64, BF16, dict(causal=True)),
    (4, 64, 4, 2, 64, F32, dict(causal=True, softcap=5.0, attention_chunk=24)),
    (7, 44, 2, 2, 64, BF16, dict(causal=False, attention_chunk=16)),
    (3, 2, 2, 1, 64, BF16, dict(causal=False, attention_chunk=1)),  # a row before the first key sees none
    # Threadgroups of L * G rows: 12 (not a power of two); 20 at D = 256 (two of 10);
    # 64 (two of 32, each with its own union of keys).
    (3, 41, 8, 2, 64, F16, dict(causal=True)),
    (5, 40, 4, 1, 256, BF16, dict(causal=True)),
    (8, 70, 8, 1, 64, BF16, dict(causal=False, window_size=(20, 1))),
]


@pytest.mark.parametrize("case", FUNC_CASES, ids=lambda c: f"q{c[0]}k{c[1]}h{c[2]}/{c[3]}d{c[4]}-{c[6]}")
def test_flash_attn_func_short_query(registry, calls, case):
    ql, kl, h, hkv, d, dtype, kw = case
    rng = np.random.default_rng(ql * 1000 + kl)
    q, k, v = _qkv(rng, 2, ql, kl, h, hkv, d, dtype)
    out, lse, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, **kw)
    assert calls == ["fm_dispatch_vec_seq"], calls
    what = f"{registry.backend} {case}"
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, e_out, dtype, what)
    assert_close(lse, e_lse, F32, what + " lse")
    again = fm.flash_attn_func(q, k, v, registry=registry, **kw)
    assert_bits_equal(out, again, what + " determinism")


def test_alibi_sinks_and_gqa8(registry):
    """ALiBi scores -slope * |t - p| (keys right of a row too, non-causal),
    sinks join every row's denominator once, GQA 8 groups 8 heads x 4 rows."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 4, 52, 8, 1, 64, BF16)
    slopes = (rng.random((1, 8)) * 0.3).astype(np.float32)
    sinks = rng.standard_normal(8).astype(np.float32)
    for causal in (False, True):
        out, lse, _ = fm.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, sinks=sinks,
                                         return_attn_probs=True, registry=registry)
        e_out, e_lse = reference.flash_attn(q, k, v, causal=causal, alibi_slopes=slopes, sinks=sinks)
        assert_close(out, e_out, BF16, f"{registry.backend} causal={causal}")
        assert_close(lse, e_lse, F32, f"{registry.backend} causal={causal} lse")


@pytest.mark.parametrize("page_size", [None, 16, 5])
def test_kvcache_short_query(registry, calls, page_size):
    """flash_attn_with_kvcache with 4 new tokens appended and attended
    (speculative verification): per-sequence lengths, paged caches,
    cache_leftpad, a sequence with fewer keys than query rows."""
    rng = np.random.default_rng(page_size or 3)
    b, ql, h, hkv, d, cap = 3, 4, 4, 2, 64, 48
    kc, vc, table = make_cache(rng, b, cap, hkv, d, F16, page_size)
    lens = np.array([0, 17, 40], dtype=np.int32)
    q = randn(rng, (b, ql, h, d), F16)
    kn, vn = randn(rng, (b, ql, hkv, d), F16), randn(rng, (b, ql, hkv, d), F16)
    args = dict(cache_seqlens=lens, block_table=table, causal=True)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, k=kn, v=vn, **args)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, return_softmax_lse=True, registry=registry, **args)
    assert "fm_dispatch_vec_seq" in calls and "fm_dispatch_attn" not in calls, calls
    assert_close(out, e_out, F16, f"{registry.backend} paged={page_size}")
    assert_close(lse, e_lse, F32, f"{registry.backend} paged={page_size} lse")
    if page_size is None:
        pad = np.array([0, 5, 30], dtype=np.int32)
        kl = lens + ql
        e_out, _ = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=kl, cache_leftpad=pad, causal=True,
                                                window_size=(6, -1))
        out = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=kl, cache_leftpad=pad, causal=True,
                                         window_size=(6, -1), registry=registry)
        assert_close(out, e_out, F16, f"{registry.backend} leftpad")


# (B, qL, H, Hkv, D, cache dtype, cap, page size, keywords): a kv head's
# L * G rows in one threadgroup (32 over a paged float32 cache; 64 of D = 64
# on pages of 5) or spread over several (32 at D = 256: 2 x 16; 24 at
# D = 512: 3 x 8, with a window).
GROUP_CASES = [
    (2, 4, 8, 1, 128, F32, 48, 16, dict(causal=True)),
    (2, 8, 8, 2, 64, F16, 48, 5, dict(causal=True)),
    (1, 8, 4, 1, 256, BF16, 40, None, dict(causal=True)),
    (1, 3, 8, 1, 512, BF16, 36, None, dict(causal=True, window_size=(7, -1))),
]


@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: f"q{c[1]}h{c[2]}/{c[3]}d{c[4]}-page{c[7]}")
def test_kvcache_rows_per_threadgroup(registry, calls, case):
    b, ql, h, hkv, d, dtype, cap, page, kw = case
    rng = np.random.default_rng(ql * 100 + d)
    kc, vc, table = make_cache(rng, b, cap, hkv, d, dtype, page)
    lens = np.array([cap - 3 - i for i in range(b)], dtype=np.int32)
    q = randn(rng, (b, ql, h, d), dtype)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, **kw)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                         return_softmax_lse=True, registry=registry, **kw)
    assert calls == ["fm_dispatch_vec_seq"], calls
    assert_close(out, e_out, dtype, f"{registry.backend} {case}")
    assert_close(lse, e_lse, F32, f"{registry.backend} {case} lse")


def test_longer_queries_keep_the_prefill(registry, calls):
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, 1, 9, 20, 2, 2, 64, BF16)
    out = fm.flash_attn_func(q, k, v, causal=True, registry=registry)
    assert calls == ["fm_dispatch_attn"], calls
    assert_close(out, reference.flash_attn(q, k, v, causal=True)[0], BF16, registry.backend)


# The torch drop-in: (qL, kv_len of a cap-48 cache, H, Hkv, dtype, keywords).
DROPIN_CASES = [
    (4, 40, 4, 2, BF16, dict(is_causal=True, align="bottom_right")),
    (3, 48, 2, 2, F32, dict()),
    (6, 33, 4, 1, F16, dict(is_causal=True, align="bottom_right", window=5, softcap=8.0)),
    (8, 8, 2, 1, BF16, dict(is_causal=True)),  # top-left with qL == kv_len is bottom-right
]


@pytest.mark.parametrize("case", DROPIN_CASES, ids=lambda c: f"q{c[0]}k{c[1]}h{c[2]}/{c[3]}-{c[5]}")
def test_dropin_short_query(registry, calls, case):
    ql, kl, h, hkv, dtype, kw = case
    rng = np.random.default_rng(ql + kl)
    q, k, v = randn(rng, (2, h, ql, 64), dtype), randn(rng, (2, hkv, 48, 64), dtype), randn(rng, (2, hkv, 48, 64), dtype)
    args = dict(enable_gqa=hkv < h, kv_len=kl, **kw)
    assert fm.explain(q, k, v, **args).kernel == "flash_attn_decode"
    out = fm.scaled_dot_product_attention(q, k, v, registry=registry, **args)
    assert calls == ["fm_dispatch_vec_seq"], calls
    causal = kw.get("is_causal", False)
    e = reference.attention(q, k[:, :, :kl], v[:, :, :kl], causal=causal, q_offset=kl - ql,
                            window=kw.get("window"), softcap=kw.get("softcap", 0.0))
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, e, dtype, f"{registry.backend} {case}")


@pytest.mark.skipif("metal-sim" not in fm.registry.backend_names(), reason="needs the metal-sim backend (Linux)")
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_dropin_short_query_inside_a_batch_scope(calls, hkv):
    """The drop-in inside a batch scope on a deferring backend takes the
    decode kernel, whose output is the result itself (right once the scope
    ended): with several query heads per kv head each query head reads its
    kv head's keys through a block table, so no reorder follows the work."""
    reg = fm.Registry("metal-sim")
    rng = np.random.default_rng(5 + hkv)
    q, k, v = randn(rng, (2, 4, 3, 64), BF16), randn(rng, (2, hkv, 20, 64), BF16), randn(rng, (2, hkv, 20, 64), BF16)
    e = reference.attention(q, k, v, causal=True, q_offset=20 - 3)
    with reg.batch():
        out = fm.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv < 4, align="bottom_right",
                                              registry=reg)
    assert [c for c in calls if c.startswith("fm_dispatch")] == ["fm_dispatch_vec_seq"], calls
    assert_close(out, e, BF16, f"hkv {hkv} inside a batch scope")
    reg.close()


def test_dropin_top_left_keeps_the_prefill():
    """torch's top-left causal rows (not the newest positions) stay on the prefill."""
    q, k = np.zeros((1, 2, 4, 64), BF16), np.zeros((1, 2, 40, 64), BF16)
    assert fm.explain(q, k, k, is_causal=True).kernel == "flash_attn_prefill"


@pytest.mark.skipif("metal-sim" not in fm.registry.backend_names(), reason="needs the metal-sim backend (Linux)")
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_short_queries_inside_a_batch_scope(calls, dtype):
    """On a deferring backend a call inside a batch scope runs when the scope
    ends: the decode kernel writes the short query's output in q's dtype in
    place (into `out` when given) and the LSE is read through its [B, H, qL]
    view, so both are right once the scope ended. Outside a scope: the same
    kernel and the same bits, the LSE a contiguous array."""
    reg = fm.Registry("metal-sim")
    rng = np.random.default_rng(21)
    q, k, v = _qkv(rng, 2, 4, 30, 4, 2, 64, dtype)
    expected, e_lse = reference.flash_attn(q, k, v, causal=True)
    given = np.full(q.shape, np.nan, dtype)
    with reg.batch():
        out, lse, _ = fm.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, registry=reg)
        kv_out, kv_lse = fm.flash_attn_with_kvcache(q, k, v, causal=True, out=given, return_softmax_lse=True,
                                                    registry=reg)
    assert [c for c in calls if c.startswith("fm_dispatch")] == ["fm_dispatch_vec_seq"] * 2, calls
    assert kv_out is given
    for o, name in ((out, "flash_attn_func"), (given, "flash_attn_with_kvcache")):
        assert_close(o, expected, dtype, f"{name} inside a batch scope")
    for x, name in ((lse, "flash_attn_func"), (kv_lse, "flash_attn_with_kvcache")):
        assert x.shape == (2, 4, 4)
        assert_close(x, e_lse, F32, f"{name}'s lse inside a batch scope")
    calls.clear()
    out2, lse2, _ = fm.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, registry=reg)
    assert [c for c in calls if c.startswith("fm_dispatch")] == ["fm_dispatch_vec_seq"], calls
    assert lse2.flags.c_contiguous
    assert_bits_equal(out2, out, "outside vs inside a batch scope")
    assert_bits_equal(lse2, np.ascontiguousarray(lse), "lse outside vs inside a batch scope")
    reg.close()


@pytest.mark.skipif("metal-sim" not in fm.registry.backend_names(), reason="needs the metal-sim backend (Linux)")
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("rotary", [False, True])
def test_decode_steps_inside_a_batch_scope(calls, dtype, rotary):
    """A decode loop in one batch scope on a deferring backend (one command
    buffer): each step appends its token and attends over it on the decode
    kernel, which writes the output in q's dtype in place (nothing is
    converted after the work). Outputs and LSEs read after the scope match
    the float64 reference of every step, and the caches hold every appended
    row."""
    reg = fm.Registry("metal-sim")
    rng = np.random.default_rng(31)
    b, h, hkv, d, cap, steps = 2, 4, 2, 64, 24, 3
    kc, vc = randn(rng, (b, cap, hkv, d), dtype), randn(rng, (b, cap, hkv, d), dtype)
    k0, v0 = kc.copy(), vc.copy()
    lens = np.array([5, 11], np.int32)
    qs = [randn(rng, (b, 1, h, d), dtype) for _ in range(steps)]
    kn = [randn(rng, (b, 1, hkv, d), dtype) for _ in range(steps)]
    vn = [randn(rng, (b, 1, hkv, d), dtype) for _ in range(steps)]
    rot = {}
    if rotary:
        angles = rng.uniform(0, 2 * np.pi, (cap, d // 2))
        rot = dict(rotary_cos=np.cos(angles).astype(F32), rotary_sin=np.sin(angles).astype(F32))
    outs = [np.zeros((b, 1, h, d), dtype) for _ in range(steps)]
    lses = []
    with reg.batch():
        for s in range(steps):
            _, lse = fm.flash_attn_with_kvcache(qs[s], kc, vc, kn[s], vn[s], cache_seqlens=lens + s, causal=True,
                                                out=outs[s], return_softmax_lse=True, registry=reg, **rot)
            lses.append(lse)
    kernels = {c for c in calls if c in ("fm_dispatch_vec_seq", "fm_dispatch_attn")}
    assert kernels == {"fm_dispatch_vec_seq"}, calls
    ek, ev = k0, v0
    for s in range(steps):
        q, k = qs[s], kn[s]
        if rotary:  # flash-attn's default rotary_interleaved; k stored in the cache's dtype, the
            # decode route's rotated q kept in float32 (never rounded to q's dtype)
            q, k = (reference.apply_rotary_emb(x, rot["rotary_cos"], rot["rotary_sin"], lens + s,
                                               interleaved=True).astype(dt)
                    for x, dt in ((q, F32), (k, dtype)))
        e_out, e_lse = reference.flash_attn_kvcache(q, ek, ev, k=k, v=vn[s], cache_seqlens=lens + s, causal=True)
        ek, ev = reference.kv_append(ek, ev, k, vn[s], lens + s)
        assert_close(outs[s], e_out, dtype, f"step {s}")
        assert_close(lses[s], e_lse, F32, f"step {s} lse")
    if rotary:
        assert_close(kc, ek, dtype, "k_cache after the scope")
    else:
        assert_bits_equal(kc, ek, "k_cache after the scope")
    assert_bits_equal(vc, ev, "v_cache after the scope")
    reg.close()
