"""Paged KV caches of any page size (flash-attn's page_block_size: 1, 3, 4,
8, 24... as well as the multiples of 16) on every backend, against the
float64 reference: flash_attn_varlen_func over paged caches (the prefill
kernel, a key tile split across pages: each key's page looked up on its
own), flash_attn_with_kvcache appending and attending through the block
table on the decode route (a 32-key chunk spans many pages) and the prefill
route, GQA with one and several query heads per kv head (the decode kernel's
staged rows), D = 512's chunked tiles, and ragged queries over small pages."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, randn
from serving_cases import SIMULATED, assert_out_lse, cu, paged

PAGE_SIZES = [1, 3, 4, 8, 24]


def _seq_rows(rng, lengths, hkv, d, dtype):
    return [randn(rng, (n, hkv, d), dtype) for n in lengths]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged(registry, rng, page_size, causal):
    q_lens, k_lens = [5, 1, 9], [37, 3, 20]
    h, hkv, d = 4, 2, 64
    cq, ck = cu(q_lens), cu(k_lens)
    q = randn(rng, (int(cq[-1]), h, d), BF16)
    k_rows, v_rows = _seq_rows(rng, k_lens, hkv, d, BF16), _seq_rows(rng, k_lens, hkv, d, BF16)
    (kc, vc), table = paged(rng, [k_rows, v_rows], page_size)
    out, lse, _ = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, max(q_lens), max(k_lens), causal=causal,
                                            block_table=table, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, causal=causal)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} varlen paged ps={page_size} causal={causal}")


@pytest.mark.parametrize("page_size", [3, 8])
def test_varlen_paged_head_dim_512(registry, rng, page_size):
    """D = 512: the kernel streams K and V in column chunks, each chunk's keys through their pages."""
    q_lens, k_lens = [3, 2], [19, 7] if registry.backend in SIMULATED else [45, 7]
    cq, ck = cu(q_lens), cu(k_lens)
    q = randn(rng, (int(cq[-1]), 2, 512), F16)
    k_rows, v_rows = _seq_rows(rng, k_lens, 1, 512, F16), _seq_rows(rng, k_lens, 1, 512, F16)
    (kc, vc), table = paged(rng, [k_rows, v_rows], page_size)
    out = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, 3, max(k_lens), causal=True, block_table=table,
                                    registry=registry)
    e_out, _ = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, causal=True)
    assert_out_lse(out, None, e_out, None, F16, f"{registry.backend} D=512 ps={page_size}")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("heads", [(2, 2), (8, 2)])
def test_kvcache_paged_append(registry, rng, page_size, q_len, heads):
    """Append through the block table, then attend: decode (q_len 1, q
    float32 in the kernel; H = Hkv reads rows directly, H = 4 Hkv stages
    them) and prefill (q_len 5), cache lengths spanning several 32-key
    chunks and pages, one of them 0."""
    h, hkv = heads
    d, b, n_new = 64, 3, q_len
    lens = np.array([0, 45, 70], np.int32)
    dtype = F16 if q_len == 1 else BF16
    k_rows = _seq_rows(rng, [int(n) + n_new for n in lens], hkv, d, dtype)
    v_rows = _seq_rows(rng, [int(n) + n_new for n in lens], hkv, d, dtype)
    (kc, vc), table = paged(rng, [k_rows, v_rows], page_size, room=page_size)
    q = randn(rng, (b, q_len, h, d), dtype)
    k_new, v_new = randn(rng, (b, n_new, hkv, d), dtype), randn(rng, (b, n_new, hkv, d), dtype)
    e_kc, e_vc = reference.kv_append(kc, vc, k_new, v_new, lens, table)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, block_table=table,
                                                causal=True, window_size=(50, -1))
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table, causal=True,
                                          window_size=(50, -1), return_softmax_lse=True, registry=registry)
    np.testing.assert_array_equal(kc, e_kc)
    np.testing.assert_array_equal(vc, e_vc)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{registry.backend} kvcache ps={page_size} qL={q_len} {heads}")


@pytest.mark.parametrize("page_size", [1, 3])
def test_decode_entry_point_small_pages(registry, rng, page_size):
    """flash_attn_with_kvcache's decode route without an append, leftpad and
    sinks over pages of 1 and 3 keys."""
    h, hkv, d = 4, 1, 64
    lens = np.array([33, 9], np.int32)
    k_rows, v_rows = _seq_rows(rng, lens.tolist(), hkv, d, BF16), _seq_rows(rng, lens.tolist(), hkv, d, BF16)
    (kc, vc), table = paged(rng, [k_rows, v_rows], page_size)
    q = randn(rng, (2, 1, h, d), BF16)
    leftpad = np.array([4, 0], np.int32)
    sinks = rng.uniform(-1, 1, h).astype(np.float32)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, cache_leftpad=leftpad,
                                          sinks=sinks, return_softmax_lse=True, registry=registry)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                                cache_leftpad=leftpad, sinks=sinks)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} decode ps={page_size}")


@pytest.mark.parametrize("page_size", [1, 4])
def test_ragged_kvcache_small_pages(registry, rng, page_size):
    """Ragged queries and new keys appended through pages of 1 and 4 keys."""
    h, hkv, d = 4, 2, 64
    q_lens, new = [2, 0, 4], [3, 1, 4]
    lens = np.array([6, 11, 0], np.int32)
    cq, ck = cu(q_lens), cu(new)
    k_rows = _seq_rows(rng, (lens + np.array(new)).tolist(), hkv, d, BF16)
    v_rows = _seq_rows(rng, (lens + np.array(new)).tolist(), hkv, d, BF16)
    (kc, vc), table = paged(rng, [k_rows, v_rows], page_size, room=3)
    q = randn(rng, (int(cq[-1]), h, d), BF16)
    k, v = randn(rng, (int(ck[-1]), hkv, d), BF16), randn(rng, (int(ck[-1]), hkv, d), BF16)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, cu_seqlens_q=cq,
                                          cu_seqlens_k_new=ck, max_seqlen_q=4, causal=True, return_softmax_lse=True,
                                          registry=registry)
    e_out = np.zeros(q.shape)
    e_lse = np.full((h, q.shape[0]), -np.inf)
    for b in range(3):
        n = int(lens[b]) + new[b]
        rows_k = reference.paged_rows(kc, table[b], n)
        rows_v = reference.paged_rows(vc, table[b], n)
        np.testing.assert_array_equal(rows_k[lens[b]:], k[ck[b]:ck[b + 1]])
        np.testing.assert_array_equal(rows_v[lens[b]:], v[ck[b]:ck[b + 1]])
        s, e = int(cq[b]), int(cq[b + 1])
        e_out[s:e], e_lse[:, s:e] = reference.attend_sequence(q[s:e], rows_k, rows_v, causal=True)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} ragged ps={page_size}")
