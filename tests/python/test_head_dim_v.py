"""A value head dim of its own (flash-attn's head_dim_v): q and k of head dim
D, v and the output of Dv, on prefill (flash_attn_func, varlen, the KV-cache
call, flash_attn_prefill) and decode (flash_attn_decode, the one-row serving
route), every backend, against the float64 references. The kernels run the
tile of max(D, Dv) with both dims in their params: Q/K loads stop at D, V
loads and the output at Dv; the default scale is 1/sqrt(D) (q's). Pairs
192/128 (MLA prefill), 128/192 and odd ones up to 256 everywhere; 576/512
(MLA: q/k of the 512-wide latent plus 64 rotary dims over the latent v) on
the decode's 576 tile, the tiled prefill's bfloat16/float16 d576 kernel (the
D=512 body with V and O 512 wide) and the general sdpa kernel. Float32 at
576/512, q/k 576 over v 576, and other unequal pairs past 256 are refused
by name."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from conftest import BACKENDS
from flashmetal import reference
from flashmetal._native import constant
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, qkv_of_shapes, randn
from serving_cases import assert_out_lse, cu, paged

SHORT_QUERY_ROWS = constant("FM_SHORT_QUERY_ROWS")  # the most rows of a short query (flashmetal.h)

# (D, Dv): MLA's prefill pair, its mirror, odd dims on padded tiles, a pair on the 512 tile, MLA's latent pair.
PAIRS = [(192, 128), (128, 192), (40, 59), (111, 32), (64, 300), (576, 512)]


def qkv(rng, q_shape, k_shape, dv, dtype):
    """q [.., D], k [.., D] and v of k's shape with head dim dv."""
    return qkv_of_shapes(rng, q_shape, k_shape, dtype, dv=dv)


@pytest.mark.parametrize("d,dv", PAIRS)
@pytest.mark.parametrize("ql", [5, 1], ids=["prefill", "one_row"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_func(registry, rng, d, dv, ql, causal):
    """flash_attn_func: out [.., Dv] and LSE, GQA 4:1, keys off the key tile
    (two of the d576 kernel's 64-key tiles): five rows run the tiled prefill,
    one the split-KV decode, each on the tile of max(D, Dv)."""
    q, k, v = qkv(rng, (2, ql, 4, d), (2, 70 if d > 256 else 23, 1, d), dv, BF16)
    out, lse, _ = fm.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn(q, k, v, causal=causal)
    assert out.shape == (2, ql, 4, dv)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} D={d} Dv={dv} qL={ql} causal={causal}")


@pytest.mark.parametrize("d,dv", [(192, 128), (59, 40), (576, 512)])
def test_func_features(registry, rng, d, dv):
    """Window, softcap, sinks, ALiBi and GQA 4:1 together, float16; the
    window leaves the rows only keys of the last key tile."""
    q, k, v = qkv(rng, (2, 6, 4, d), (2, 80, 1, d), dv, F16)
    sinks = rng.standard_normal(4).astype(np.float32)
    slopes = (rng.random((2, 4)) * 0.3).astype(np.float32)
    kw = dict(causal=True, window_size=(5, 0), softcap=2.0, sinks=sinks, alibi_slopes=slopes)
    out, lse, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, **kw)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} D={d} Dv={dv} features")


@pytest.mark.parametrize("d,dv", [(192, 128), (40, 59), (576, 512)])
def test_varlen_paged(registry, rng, d, dv):
    """flash_attn_varlen_func over paged caches of their own widths, causal
    window: pages of 16 and 3 keys (3 splits every key tile across pages;
    the d576 kernel's 64-key tiles are split by 16 too, and whole in 64)."""
    ql, kl = [3, 1, 5], [7, 70, 9]
    q = randn(rng, (sum(ql), 2, d), F16)
    k_rows = [randn(rng, (n, 1, d), F16) for n in kl]
    v_rows = [randn(rng, (n, 1, dv), F16) for n in kl]
    cq, ck = cu(ql), cu(kl)
    kw = dict(causal=True, window_size=(6, -1))
    for page in (16, 3) + ((64,) if d > 256 else ()):
        (kc,), table = paged(rng, [k_rows], page)
        vc = np.zeros(kc.shape[:-1] + (dv,), F16)
        for b, rows in enumerate(v_rows):
            for p in range(rows.shape[0]):
                vc[table[b, p // page], p % page] = rows[p]
        out, lse, _ = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, max(ql), max(kl), block_table=table,
                                                return_attn_probs=True, registry=registry, **kw)
        e_out, e_lse = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, **kw)
        assert out.shape == (sum(ql), 2, dv)
        assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} D={d} Dv={dv} varlen page {page}")


@pytest.mark.parametrize("d,dv", [(192, 128), (59, 111), (576, 512)])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kvcache_append(registry, rng, d, dv, seqlen_q):
    """flash_attn_with_kvcache: k [.., D] and v [.., Dv] appended into caches of
    those widths, then attended (one row: decode; three: prefill), with LSE."""
    lens = np.array([5, 30], np.int32)
    cap = 40
    q = randn(rng, (2, seqlen_q, 4, d), BF16)
    kn = randn(rng, (2, seqlen_q, 2, d), BF16)
    vn = randn(rng, (2, seqlen_q, 2, dv), BF16)
    kc = randn(rng, (2, cap, 2, d), BF16)
    vc = randn(rng, (2, cap, 2, dv), BF16)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc.copy(), vc.copy(), k=kn, v=vn, cache_seqlens=lens, causal=True)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=True,
                                          return_softmax_lse=True, registry=registry)
    assert out.shape == (2, seqlen_q, 4, dv)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} D={d} Dv={dv} kvcache qL={seqlen_q}")
    for b, n in enumerate(lens):
        assert (kc[b, n:n + seqlen_q] == kn[b]).all() and (vc[b, n:n + seqlen_q] == vn[b]).all()


@pytest.mark.parametrize("d,dv", [(192, 128), (576, 512), (64, 111), (512, 64)])
def test_decode(registry, rng, d, dv):
    """flash_attn_decode over [B, Hkv, cap, D] / [.., Dv] caches, GQA 2:1 (two
    heads share a threadgroup's staged K/V): 576/512 on the 576 tile."""
    q = randn(rng, (2, 4, d), F32)
    kc = randn(rng, (2, 2, 40, d), F16)
    vc = randn(rng, (2, 2, 40, dv), F16)
    out = fm.flash_attn_decode(q, kc, vc, 33, registry=registry)
    assert out.shape == (2, 4, dv)
    assert_close(out, reference.decode(q, kc, vc, 33), F16, f"{registry.backend} decode D={d} Dv={dv}")


@pytest.mark.parametrize("page", [16, 5, 64])
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kvcache_mla_paged(registry, rng, page, seqlen_q):
    """MLA's q/k 576 over v 512 in paged caches (page sizes 16, 5 and 64),
    appending seqlen_q rows, sinks, softcap and LSE, GQA 8:1: one row runs
    the decode, three the serving prefill's d576 kernel."""
    lens = np.array([9, 70], np.int32)
    q = randn(rng, (2, seqlen_q, 8, 576), BF16)
    kn, vn = randn(rng, (2, seqlen_q, 1, 576), BF16), randn(rng, (2, seqlen_q, 1, 512), BF16)
    k_rows = [randn(rng, (int(n), 1, 576), BF16) for n in lens]
    (kc,), table = paged(rng, [k_rows], page, room=seqlen_q)
    vc = randn(rng, kc.shape[:-1] + (512,), BF16)
    sinks = rng.standard_normal(8).astype(np.float32)
    kw = dict(causal=True, softcap=20.0, sinks=sinks)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc.copy(), vc.copy(), k=kn, v=vn, cache_seqlens=lens,
                                                block_table=table, **kw)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                          return_softmax_lse=True, registry=registry, **kw)
    assert out.shape == (2, seqlen_q, 8, 512)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} MLA page {page} qL={seqlen_q}")


@pytest.mark.parametrize("d,dv", [(192, 128), (59, 40), (576, 512)])
def test_prefill(registry, rng, d, dv):
    """flash_attn_prefill ([B, H, L, D]) causal with q_offset, GQA 2:1; default scale 1/sqrt(D)."""
    q, k, v = qkv(rng, (1, 2, 7, d), (1, 1, 23, d), dv, BF16)
    out = fm.flash_attn_prefill(q, k, v, causal=True, q_offset=10, registry=registry)
    want = reference.attention(q, k, v, causal=True, q_offset=10, scale=1 / np.sqrt(d))
    assert out.shape == (1, 2, 7, dv)
    assert_close(out, want, BF16, f"{registry.backend} prefill D={d} Dv={dv}")


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_prefill_mla_masks_and_blk(registry, rng, dtype):
    """flash_attn_prefill at 576/512 over several query and key tiles of the
    d576 kernel: an additive mask with -inf blocks and finite biases (the
    auto-blk tile skip runs), a blk built for head dim 576 (bit-identical to
    none), a bool mask with causal, and GQA 2:1."""
    q, k, v = qkv(rng, (1, 2, 20, 576), (1, 1, 90, 576), 512, dtype)
    add = np.where(rng.random((20, 90)) < 0.2, -np.inf, rng.choice([0.0, 0.5, -2.0], (20, 90)))
    add[:16, :64] = -np.inf
    add[16:, 64:] = 0.0
    mask = add.astype(dtype)
    out = fm.flash_attn_prefill(q, k, v, mask=mask, registry=registry)
    assert out.shape == (1, 2, 20, 512)
    assert_close(out, reference.attention(q, k, v, mask=mask), dtype, f"{registry.backend} MLA additive {dtype}")
    blk = fm.build_blk(mask, head_dim=576, registry=registry)
    assert_bits_equal(fm.flash_attn_prefill(q, k, v, mask=mask, blk=blk, registry=registry), out, "blk vs auto-blk")
    keep = rng.random((20, 90)) < 0.6
    out = fm.flash_attn_prefill(q, k, v, mask=keep, causal=True, q_offset=60, registry=registry)
    want = reference.attention(q, k, v, mask=keep, causal=True, q_offset=60)
    assert_close(out, want, dtype, f"{registry.backend} MLA bool causal {dtype}")


@pytest.mark.skipif(not {"sim", "metal-sim"} <= set(BACKENDS), reason="needs sim and metal-sim")
@pytest.mark.parametrize("d,dv", [(192, 128), (576, 512)])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_sim_matches_metal_sim_bits(rng, d, dv, seqlen_q):
    """The Metal kernels on the simulator and through metal-sim give the same bits (prefill and decode)."""
    q, k, v = qkv(rng, (1, seqlen_q, 2, d), (1, 19, 1, d), dv, BF16)
    a = fm.flash_attn_func(q, k, v, causal=True, registry="sim")
    b = fm.flash_attn_func(q, k, v, causal=True, registry="metal-sim")
    assert_bits_equal(a, b, f"sim vs metal-sim D={d} Dv={dv} seqlen_q={seqlen_q}")


@pytest.mark.parametrize("d,dv", [(576, 500), (512, 576), (600, 128), (520, 64)])
def test_prefill_pairs_without_a_tile_are_refused_by_name(d, dv):
    """Unequal dims need both in 1...512 on the prefill kernel, or MLA's
    576/512: refused naming the function, v and both dims."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, (1, 2, 1, d), (1, 4, 1, d), dv, BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_func(q, k, v, registry="cpu")
    msg = str(e.value)
    assert "flash_attn_func" in msg and f"v head dim {dv}" in msg and str(d) in msg, msg


def test_mla_prefill_in_float32_and_576_over_576_are_refused_by_name():
    """The d576 kernel is two-byte and runs v of 512 only: float32 at 576/512
    and q/k 576 over v 576 are ValueErrors naming the function and the dims
    (one float32 row still runs on the decode)."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, (1, 3, 2, 576), (1, 8, 1, 576), 512, F32)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_func(q, k, v, registry="cpu")
    msg = str(e.value)
    assert msg.startswith("flash_attn_func: ") and "576 with v head dim 512 runs on bfloat16 and float16 only" in msg
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_prefill(q.transpose(0, 2, 1, 3).copy(), k.transpose(0, 2, 1, 3).copy(),
                              v.transpose(0, 2, 1, 3).copy(), registry="cpu")
    assert str(e.value).startswith("flash_attn_prefill: ") and "float16 only" in str(e.value), str(e.value)
    out = fm.flash_attn_func(q[:, :1], k, v, causal=True, registry="cpu")
    assert_close(out, reference.flash_attn(q[:, :1], k, v, causal=True)[0], F32, "float32 one row")
    q, k, v = qkv(rng, (1, 3, 2, 576), (1, 8, 1, 576), 576, BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_func(q, k, v, registry="cpu")
    msg = str(e.value)
    assert msg.startswith("flash_attn_func: ") and "got 576 (q/k of 576 run only with a v head dim of 512)" in msg


def test_mismatched_v_and_out_are_refused_by_name():
    """v must be k's shape but for the head dim; a caller's out must have Dv."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, (1, 3, 2, 64), (1, 4, 2, 64), 32, BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_func(q, k, v[:, :3], registry="cpu")
    assert "flash_attn_func" in str(e.value) and "v shape" in str(e.value), str(e.value)
    kc = randn(rng, (1, 8, 2, 64), BF16)
    vc = randn(rng, (1, 8, 2, 32), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_with_kvcache(q, kc, vc, out=np.empty(q.shape, BF16), registry="cpu")
    assert "flash_attn_with_kvcache" in str(e.value) and "out" in str(e.value), str(e.value)


@pytest.mark.parametrize("d,dv,ql", [(192, 128, 1), (192, 128, 40), (40, 59, 33), (576, 512, 3), (576, 512, 1),
                                     (64, 300, 2), (64, 300, 40), (64, 520, 2)])
def test_dropin(registry, rng, d, dv, ql):
    """scaled_dot_product_attention with value's own head dim (torch's Ev != E):
    decode (up to 8 query rows) or prefill on the tile of max(D, Ev) (MLA's 576/512 on the d576
    kernel), the general kernel past it."""
    q, k, v = qkv(rng, (1, 2, ql, d), (1, 2, 45, d), dv, BF16)
    route = fm.explain(q, k, v, is_causal=True, align="bottom_right")
    tiled = max(d, dv) <= 512 or (d, dv) == (576, 512)
    assert route.kernel == ("sdpa" if not tiled else "flash_attn_decode" if ql <= SHORT_QUERY_ROWS else "flash_attn_prefill"), route
    out = fm.scaled_dot_product_attention(q, k, v, is_causal=True, align="bottom_right", registry=registry)
    want = reference.attention(q, k, v, causal=True, q_offset=45 - ql)
    assert out.shape == (1, 2, ql, dv)
    assert_close(out, want, BF16, f"{registry.backend} drop-in D={d} Ev={dv} qL={ql}")


def test_dropin_mla_float32_takes_the_general_kernel(registry, rng):
    """Float32 at 576/512 with several query rows: no tiled kernel, so the general one."""
    q, k, v = qkv(rng, (1, 2, 3, 576), (1, 1, 9, 576), 512, F32)
    out = fm.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, align="bottom_right",
                                          registry=registry)
    assert fm.last_route().kernel == "sdpa", fm.last_route()
    assert_close(out, reference.attention(q, k, v, causal=True, q_offset=6), F32, f"{registry.backend} f32 MLA")


def test_dropin_masked_decode_key_ranges(registry, rng):
    """One query row with a left-padding bool mask: the serving decode over each row's key range, Ev != E."""
    q, k, v = qkv(rng, (2, 4, 1, 192), (2, 2, 30, 192), 128, F16)
    keep = np.ones((2, 1, 1, 30), bool)
    keep[0, :, :, :7] = False
    out = fm.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True, registry=registry)
    assert fm.last_route().kernel == "flash_attn_decode"
    assert_close(out, reference.attention(q, k, v, mask=keep), F16, f"{registry.backend} masked decode")


@pytest.mark.parametrize("d,dv", [(576, 512), (96, 40)])
def test_sdpa_general_kernel(registry, rng, d, dv):
    """The general kernel: v and out of their own head dim, with the extension (window, softcap) and without."""
    q, k, v = qkv(rng, (1, 2, 3, d), (1, 1, 9, d), dv, F16)
    out = fm.sdpa(q, k, v, causal=True, registry=registry)
    assert_close(out, reference.attention(q, k, v, causal=True, q_offset=6), F16, f"{registry.backend} sdpa")
    out = fm.sdpa(q, k, v, causal=True, window=4, softcap=3.0, registry=registry)
    want = reference.attention(q, k, v, causal=True, q_offset=6, window=4, softcap=3.0)
    assert_close(out, want, F16, f"{registry.backend} sdpa window softcap")


def test_packed_forms_say_k_and_v_share_a_head_dim():
    """A packed kv cannot hold v of another head dim; a malformed one's error says so."""
    rng = np.random.default_rng(0)
    q = randn(rng, (1, 4, 2, 64), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_kvpacked_func(q, randn(rng, (1, 4, 3, 2, 64), BF16), registry="cpu")
    msg = str(e.value)
    assert msg.startswith("flash_attn_kvpacked_func: ") and "k and v share its head dim" in msg, msg


@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("mode", ["leftpad", "batch_idx"])
def test_kvcache_rotary_leftpad_batch_idx(registry, rng, seqlen_q, mode):
    """Rotary in the append (q and k rotated over D, v of 128 untouched) with
    cache_leftpad or cache_batch_idx, D=192 over Dv=128, causal, GQA 2:1."""
    d, dv, cap, b = 192, 128, 24, 2
    lens = np.array([6, 11], np.int32)
    q = randn(rng, (b, seqlen_q, 4, d), BF16)
    kn, vn = randn(rng, (b, seqlen_q, 2, d), BF16), randn(rng, (b, seqlen_q, 2, dv), BF16)
    angle = rng.random((cap, 32)) * 2 * np.pi  # rotary_dim 64 < D: partial rotary
    cos, sin = np.cos(angle).astype(F32), np.sin(angle).astype(F32)
    extra: dict = {}
    if mode == "batch_idx":
        idx = np.array([2, 0], np.int32)
        kc, vc = randn(rng, (3, cap, 2, d), BF16), randn(rng, (3, cap, 2, dv), BF16)
        extra["cache_batch_idx"] = idx
        kr, vr = kc[idx].copy(), vc[idx].copy()
        first = None
    else:
        kc, vc = randn(rng, (b, cap, 2, d), BF16), randn(rng, (b, cap, 2, dv), BF16)
        first = np.array([2, 0], np.int32)
        extra["cache_leftpad"] = first
        kr, vr = kc.copy(), vc.copy()
    k_ro = reference.apply_rotary_emb(kn, cos, sin, lens, interleaved=False).astype(BF16)
    q_ro = reference.apply_rotary_emb(q, cos, sin, lens, interleaved=False)
    q_ro = q_ro.astype(F32 if seqlen_q <= SHORT_QUERY_ROWS else BF16)  # the decode route attends float32 q
    e_out, e_lse = reference.flash_attn_kvcache(q_ro, kr, vr, k=k_ro, v=vn, cache_seqlens=lens, causal=True,
                                                cache_leftpad=first)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                          rotary_interleaved=False, causal=True, return_softmax_lse=True,
                                          registry=registry, **extra)
    assert out.shape == (b, seqlen_q, 4, dv)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} rotary {mode} qL={seqlen_q}")


@pytest.mark.parametrize("d,dv", [(40, 59), (576, 512)])
def test_kvcache_ragged_queries_and_new_keys(registry, rng, d, dv):
    """cu_seqlens_q / cu_seqlens_k_new with v of its own head dim: each
    sequence's new rows appended into caches of their own widths, then the
    varlen prefill."""
    cap = 20
    q_lens, new = [2, 1, 3], [1, 2, 0]
    cq, ck = cu(q_lens), cu(new)
    lens = np.array([4, 0, 9], np.int32)
    q = randn(rng, (int(cq[-1]), 2, d), F16)
    kn, vn = randn(rng, (int(ck[-1]), 1, d), F16), randn(rng, (int(ck[-1]), 1, dv), F16)
    kc, vc = randn(rng, (3, cap, 1, d), F16), randn(rng, (3, cap, 1, dv), F16)
    e_k, e_v = kc.copy(), vc.copy()
    for s in range(3):
        e_k[s, lens[s]:lens[s] + new[s]] = kn[ck[s]:ck[s + 1]]
        e_v[s, lens[s]:lens[s] + new[s]] = vn[ck[s]:ck[s + 1]]
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, cu_seqlens_q=cq, cu_seqlens_k_new=ck,
                                          max_seqlen_q=3, causal=True, return_softmax_lse=True, registry=registry)
    np.testing.assert_array_equal(kc, e_k)
    np.testing.assert_array_equal(vc, e_v)
    n = lens + np.array(new)
    e_out, e_lse = reference.flash_attn_varlen(q, np.concatenate([e_k[s, :n[s]] for s in range(3)]),
                                               np.concatenate([e_v[s, :n[s]] for s in range(3)]), cq, cu(list(n)),
                                               causal=True)
    assert out.shape == (int(cq[-1]), 2, dv)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} ragged kvcache D={d} Dv={dv}")


@pytest.mark.parametrize("dtype", [F32, F16], ids=["f32", "f16"])
def test_prefill_masks_and_float32(registry, rng, dtype):
    """flash_attn_prefill at 192/128 with a [qL, kL] additive mask (-inf blocks,
    finite biases: the auto-blk tile skip runs) and a bool mask, float32 on its own tiles too."""
    q, k, v = qkv(rng, (1, 2, 40, 192), (1, 2, 48, 192), 128, dtype)
    add = np.where(rng.random((40, 48)) < 0.3, -np.inf, rng.choice([0.0, 0.5, -2.0], (40, 48)))
    add[:16, :32] = -np.inf
    mask = add.astype(dtype)
    out = fm.flash_attn_prefill(q, k, v, mask=mask, registry=registry)
    assert_close(out, reference.attention(q, k, v, mask=mask), dtype, f"{registry.backend} additive {dtype}")
    keep = rng.random((40, 48)) < 0.6
    out = fm.flash_attn_prefill(q, k, v, mask=keep, causal=True, q_offset=8, registry=registry)
    want = reference.attention(q, k, v, mask=keep, causal=True, q_offset=8)
    assert_close(out, want, dtype, f"{registry.backend} bool causal {dtype}")


def test_prefill_with_a_built_blk(registry, rng):
    """A blk built for q's head dim serves v of another (both tiles 32 x 16), bit-identical to no blk."""
    q, k, v = qkv(rng, (1, 2, 40, 128), (1, 2, 48, 128), 192, BF16)
    add = np.zeros((40, 48))
    add[:16, :32] = -np.inf
    mask = add.astype(BF16)
    blk = fm.build_blk(mask, head_dim=128, registry=registry)
    with_blk = fm.flash_attn_prefill(q, k, v, mask=mask, blk=blk, registry=registry)
    assert_bits_equal(with_blk, fm.flash_attn_prefill(q, k, v, mask=mask, registry=registry), "blk vs none")
    assert_close(with_blk, reference.attention(q, k, v, mask=mask), BF16, f"{registry.backend} blk")


def test_blk_of_a_pair_is_built_for_the_larger_dim(registry, rng):
    """q/k of 64 over v of 300 run the 512 tile: the tile-skip blk is built
    for the larger head dim (its grid is that tile's); one built for q's 64
    is refused by name, saying which head dim to build it with."""
    q, k, v = qkv(rng, (1, 2, 40, 64), (1, 2, 50, 64), 300, BF16)
    mask = np.zeros((40, 50), BF16)
    mask[:16, 24:] = -np.inf  # whole tiles of the 8 x 8 grid with no visible key
    blk = fm.build_blk(mask, 300, registry=registry)
    out = fm.flash_attn_prefill(q, k, v, mask=mask, blk=blk, registry=registry)
    want = reference.attention(q, k, v, mask=mask.astype(np.float64))
    assert_close(out, want, BF16, f"{registry.backend} blk of D=64 over Dv=300")
    with pytest.raises(fm.InvalidValueError, match=r"^flash_attn_prefill: blk shape .* for head_dim 300 and a "
                                                   r"\[40, 50\] mask \(build it with that head dim and mask\)"):
        fm.flash_attn_prefill(q, k, v, mask=mask, blk=fm.build_blk(mask, 64, registry=registry), registry=registry)
