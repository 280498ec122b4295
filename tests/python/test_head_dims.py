"""Any head dim from 1 to 512 on every serving entry point and decode, every
backend, against the float64 references: the head dims of flash-attn's grid
that have no tile of their own (32, 40, 59, 111, 160, 224) and dims between
256 and 512 (300, 301: the wide body's tile) run the kernel of the next
tiled dim up with the true D (odd D included),
combined with causal, the window, GQA, paging and the split-KV decode. The
scale defaults to 1/sqrt(D) of the true D."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
import head_dim_tables
from flashmetal import reference
from numerics import BF16, F16, F32, assert_close, randn
from numerics import qkv_of_shapes as qkv
from serving_cases import assert_out_lse, cu, paged

# flash-attn's head dims with no tile of their own here, and one of the 512 tile.
PADDED = [32, 40, 59, 111, 160, 224, 300]
ODD = [59, 111, 301]


def test_supported_head_dims_stay_the_tiles():
    """The query answers only natively tiled dims, ascending; the padded dims
    here are not among them and each has a tile above it; decode has every
    prefill tile."""
    prefill, decode = head_dim_tables.PREFILL, head_dim_tables.DECODE
    assert list(prefill) == sorted(set(prefill)) and list(decode) == sorted(set(decode))
    assert set(prefill) <= set(decode)
    assert not set(PADDED) & set(prefill)
    assert all(any(t >= d for t in head_dim_tables.PADDED_TILES) for d in PADDED)


@pytest.mark.parametrize("d", PADDED)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_func(registry, rng, d, causal):
    """flash_attn_func: qL < kL, GQA 2:1, key length off the key tile; out and LSE."""
    q, k, v = qkv(rng, (1, 5, 2, d), (1, 19, 1, d), BF16)
    out, lse, _ = fm.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn(q, k, v, causal=causal)
    assert out.shape == q.shape
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} D={d} causal={causal}")


@pytest.mark.parametrize("d", ODD + [40])
def test_func_window_softcap_f16(registry, rng, d):
    """The window and softcap on a padded tile, float16."""
    q, k, v = qkv(rng, (2, 6, 2, d), (2, 17, 2, d), F16)
    kw = dict(causal=True, window_size=(5, 0), softcap=2.0)
    out, lse, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, **kw)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} D={d} window softcap")


@pytest.mark.parametrize("d", PADDED)
def test_func_one_row(registry, rng, d):
    """seqlen_q == 1: the split-KV decode kernel over a padded tile, GQA 4:1."""
    q, k, v = qkv(rng, (2, 1, 4, d), (2, 45, 1, d), BF16)
    out, lse, _ = fm.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn(q, k, v, causal=True)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} D={d} one row")


@pytest.mark.parametrize("d", [59, 160])
def test_varlen_paged_window(registry, rng, d):
    """flash_attn_varlen_func over a paged cache, causal with a window, GQA 2:1."""
    ql, kl = [3, 1, 5], [7, 20, 9]
    q = randn(rng, (sum(ql), 2, d), F16)
    k_rows = [randn(rng, (n, 1, d), F16) for n in kl]
    v_rows = [randn(rng, (n, 1, d), F16) for n in kl]
    (kc, vc), table = paged(rng, [k_rows, v_rows], 16)
    cq, ck = cu(ql), cu(kl)
    kw = dict(causal=True, window_size=(6, -1))
    out, lse, _ = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, max(ql), max(kl), block_table=table,
                                            return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, **kw)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} D={d} varlen paged window")


@pytest.mark.parametrize("d", PADDED)
@pytest.mark.parametrize("seqlen_q", [1, 3])
def test_kvcache_paged_append(registry, rng, d, seqlen_q):
    """flash_attn_with_kvcache: appends new rows into a paged cache (strides of
    the true D), then attends; one row takes the split-KV decode, three the prefill."""
    lens = [5, 30]
    q = randn(rng, (2, seqlen_q, 4, d), BF16)
    kn = randn(rng, (2, seqlen_q, 2, d), BF16)
    vn = randn(rng, (2, seqlen_q, 2, d), BF16)
    k_rows = [randn(rng, (n, 2, d), BF16) for n in lens]
    v_rows = [randn(rng, (n, 2, d), BF16) for n in lens]
    (kc, vc), table = paged(rng, [k_rows, v_rows], 16, room=seqlen_q)
    seqlens = np.array(lens, np.int32)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc.copy(), vc.copy(), k=kn, v=vn, cache_seqlens=seqlens,
                                                block_table=table, causal=True)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, block_table=table, causal=True,
                                          return_softmax_lse=True, registry=registry)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} D={d} kvcache seqlen_q={seqlen_q}")
    for b, n in enumerate(lens):  # the appended rows landed at the sequence's end
        for i in range(seqlen_q):
            p = n + i
            assert (kc[table[b, p // 16], p % 16] == kn[b, i]).all()


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("d", PADDED)
def test_decode(registry, rng, d, dtype):
    """flash_attn_decode over [B, Hkv, cap, D] caches of every dtype: kv_len
    below the capacity, GQA 4:2 (two heads share a threadgroup's K/V staging)."""
    q = randn(rng, (2, 4, d), F32)
    kc = randn(rng, (2, 2, 40, d), dtype)
    vc = randn(rng, (2, 2, 40, d), dtype)
    out = fm.flash_attn_decode(q, kc, vc, 33, registry=registry)
    want = reference.decode(q, kc, vc, 33)
    assert_close(out, want, F32 if dtype == F32 else F16, f"{registry.backend} decode D={d} {dtype}")


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", head_dim_tables.DECODE)
def test_decode_in_cache_dtype(registry, rng, d, dtype):
    """flash_attn_decode with q in the caches' 16-bit dtype at every decode
    tile (576 included): the reduce rounds the float32 row into q's dtype."""
    q = randn(rng, (1, 4, d), dtype)
    kc = randn(rng, (1, 2, 24, d), dtype)
    vc = randn(rng, (1, 2, 24, d), dtype)
    out = fm.flash_attn_decode(q, kc, vc, 21, registry=registry)
    assert out.dtype == dtype
    want = reference.decode(q, kc, vc, 21)
    assert_close(out, want, dtype, f"{registry.backend} decode D={d} q {dtype}")


@pytest.mark.parametrize("d", ODD)
def test_decode_window_unaligned_rows(registry, rng, d):
    """A sliding window with q rows off any vector boundary (odd D, one head per group)."""
    q = randn(rng, (3, d), F32)
    kc = randn(rng, (3, 70, d), F16)
    vc = randn(rng, (3, 70, d), F16)
    out = fm.flash_attn_decode(q, kc, vc, 70, window=20, registry=registry)
    assert_close(out, reference.decode(q, kc, vc, 70, window=20), F16, f"{registry.backend} decode D={d} window")


@pytest.mark.parametrize("d", ODD + [32, 224])
def test_prefill(registry, rng, d):
    """flash_attn_prefill ([B, H, L, D]), causal with q_offset, GQA 2:1; the default scale is 1/sqrt(D)."""
    q, k, v = qkv(rng, (1, 2, 7, d), (1, 1, 23, d), BF16)
    out = fm.flash_attn_prefill(q, k, v, causal=True, q_offset=10, registry=registry)
    want = reference.attention(q, k, v, causal=True, q_offset=10, scale=1 / np.sqrt(d))
    assert_close(out, want, BF16, f"{registry.backend} prefill D={d}")


@pytest.mark.parametrize("d", [59, 224])
def test_packed(registry, rng, d):
    """flash_attn_qkvpacked_func: q, k and v as views of one packed array."""
    qkv_ = randn(rng, (1, 9, 3, 2, d), F16)
    out = fm.flash_attn_qkvpacked_func(qkv_, causal=True, registry=registry)
    want, _ = reference.flash_attn(qkv_[:, :, 0], qkv_[:, :, 1], qkv_[:, :, 2], causal=True)
    assert_close(out, want, F16, f"{registry.backend} packed D={d}")


@pytest.mark.parametrize("d", [59, 111, 300])
@pytest.mark.parametrize("ql", [1, 40])
def test_dropin(registry, rng, d, ql):
    """scaled_dot_product_attention runs a padded head dim on its kernel (no copy to a wider one)."""
    q, k, v = qkv(rng, (1, 2, ql, d), (1, 2, 45, d), BF16)
    route = fm.explain(q, k, v, is_causal=ql > 1, align="bottom_right")
    assert route.kernel == ("flash_attn_decode" if ql == 1 else "flash_attn_prefill")
    assert "padded" not in route.reason
    out = fm.scaled_dot_product_attention(q, k, v, is_causal=ql > 1, align="bottom_right", registry=registry)
    want = reference.attention(q, k, v, causal=ql > 1, q_offset=45 - ql)
    assert_close(out, want, BF16, f"{registry.backend} drop-in D={d} qL={ql}")


@pytest.mark.parametrize("d", [0, 513, 575, 600, 1024])
def test_refused_head_dims_name_function_argument_value(d):
    """D = 0 and D > 512 (other than the decode's 576) are refused by name, before any kernel runs."""
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, (1, 2, 1, d), (1, 4, 1, d), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_func(q, k, v, registry="cpu")
    msg = str(e.value)
    assert "flash_attn_func" in msg and f"got {d}" in msg and "1...512" in msg, msg
    qd = randn(rng, (2, d), F32)
    kc = randn(rng, (1, 4, d), F16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_decode(qd, kc, kc, 4, registry="cpu")
    msg = str(e.value)
    assert "flash_attn_decode" in msg and f"got {d}" in msg and "512" in msg, msg
