"""Serving decode (the split-KV decode with per-sequence kv lengths, paged
K/V, window, softcap, sinks and LSE; fm_dispatch_vec_seq) on every backend
against the float64 serving reference, through flash_attn_with_kvcache's
decode route (seqlen_q == 1). Sim shapes are tiny: one decode is B*H*32
SIMD groups."""
from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest

import flashmetal as fm
import head_dim_tables
from conftest import SIMULATED
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn
from serving_cases import check_sink_limits
from serving_native import VEC_SEQ_OP, make_cache, vec_seq

# The decode tiles with v as wide as q/k (576 is MLA's, over a 512-wide v: test_head_dim_v).
HEAD_DIMS = [d for d in head_dim_tables.DECODE if d in head_dim_tables.PREFILL]
KV_DTYPES = [F32, F16, BF16]
OP = "flash_attn_with_kvcache"


def decode(registry, q, k, v, **kw):
    """flash_attn_with_kvcache for q [B, H, D] float32 -> (out [B, H, D], lse [B, H])."""
    out, lse = fm.flash_attn_with_kvcache(q[:, None], k, v, return_softmax_lse=True, registry=registry, **kw)
    return out[:, 0], lse[..., 0]


def expected(q, k, v, *, softmax_scale=None, **kw):
    out, lse = reference.flash_attn_kvcache(q[:, None], k, v, scale=softmax_scale, **kw)
    return out[:, 0], lse[..., 0]


def check(registry, rng, *, b=3, h=4, hkv=2, d=64, cap=48, kv=F16, lengths=(0, 17, 48), page_size=None,
          sinks=False, **kw):
    k, v, table = make_cache(rng, b, cap, hkv, d, kv, page_size)
    lens = np.array(lengths, dtype=np.int32)
    if table is not None:
        # Entries past a sequence's pages are never read: -1 proves it.
        used = -(-lens // page_size)
        for bb in range(b):
            table[bb, used[bb]:] = -1
    q = randn(rng, (b, h, d), F32)
    snk = (rng.standard_normal(h) * 2).astype(np.float32) if sinks else None
    args = dict(cache_seqlens=lens, block_table=table, sinks=snk, **kw)
    out, lse = decode(registry, q, k, v, **args)
    e_out, e_lse = expected(q, k, v, **args)
    what = f"{registry.backend} D={d} kv={kv} paged={page_size} sinks={sinks} {kw}"
    assert_close(out, e_out, F32, what)
    assert_close(lse, e_lse, F32, what + " lse")
    return q, k, v, table, lens, out


@pytest.mark.parametrize("d,kv", list(itertools.product(HEAD_DIMS, KV_DTYPES)))
def test_ragged_lengths(registry, rng, d, kv):
    # 0 (sees nothing: out 0, lse -inf), 1, a chunk + 1, the capacity.
    small = registry.backend in SIMULATED and d >= 192
    check(registry, rng, d=d, kv=kv, b=2 if small else 4, cap=40, lengths=(0, 33) if small else (0, 1, 33, 40))


@pytest.mark.parametrize("page_size", [16, 32, 1, 3, 24])
def test_paged_shuffled_table(registry, rng, page_size):
    """Any page size: pages of 1, 3 or 24 keys split the kernel's half
    chunks, whose keys then read their own table entries (entries past a
    sequence's pages are -1: never read)."""
    check(registry, rng, page_size=page_size, cap=64, lengths=(64, 1, 31), kv=BF16)


def test_paged_equals_contiguous(registry, rng):
    """The same keys through a block table give the same output bits."""
    b, cap, d = 2, 48, 64
    k, v, table = make_cache(rng, b, cap, 2, d, F16, page_size=16)
    kc = np.stack([np.concatenate([k[table[bb, j]] for j in range(table.shape[1])])[:cap] for bb in range(b)])
    vc = np.stack([np.concatenate([v[table[bb, j]] for j in range(table.shape[1])])[:cap] for bb in range(b)])
    q = randn(rng, (b, 4, d), F32)
    lens = np.array([45, 20], dtype=np.int32)
    paged, lp = decode(registry, q, k, v, cache_seqlens=lens, block_table=table)
    contig, lc = decode(registry, q, kc, vc, cache_seqlens=lens)
    assert_bits_equal(paged, contig, "paged vs contiguous")
    assert_bits_equal(lp, lc, "paged vs contiguous lse")


@pytest.mark.parametrize("left", [0, 4, 31, 100])
def test_window_per_sequence(registry, rng, left):
    # The query is the newest key: window_size's right bound hides nothing.
    check(registry, rng, window_size=(left, 3 if left == 31 else -1), lengths=(3, 48, 40),
          page_size=16 if left == 4 else None)


def test_softcap_and_scale(registry, rng):
    check(registry, rng, softcap=3.0, softmax_scale=4 / math.sqrt(64), kv=F32, causal=True)


@pytest.mark.parametrize("lengths", [(0, 20, 48), (48, 0, 0)])
def test_sinks(registry, rng, lengths):
    # A row without keys but with a sink: out 0, lse = the sink.
    _, _, _, _, lens, out = check(registry, rng, sinks=True, lengths=lengths)
    assert not np.any(out[lens == 0])


def test_sinks_paged_without_lse(registry, rng):
    k, v, table = make_cache(rng, 3, 48, 2, 64, F16, page_size=16)
    q = randn(rng, (3, 4, 64), F32)
    snk = np.array([0.5, -2.0, 3.0, 1.0], np.float32)
    lens = np.array([5, 48, 16], np.int32)
    out = fm.flash_attn_with_kvcache(q[:, None], k, v, cache_seqlens=lens, block_table=table, sinks=snk,
                                     registry=registry)[:, 0]
    assert_close(out, expected(q, k, v, cache_seqlens=lens, block_table=table, sinks=snk)[0], F32, "sinks, no lse")


@pytest.mark.parametrize("ql", [1, 4])
@pytest.mark.parametrize("paged", [False, True])
def test_cache_with_room_for_no_key(registry, rng, paged, ql):
    """A cache of capacity 0 (k_cache's dim 1, or block_table's dim 1 when
    paged) attends to nothing on the decode route as on the prefill route,
    as flash-attn does for seqlen_k == 0: every output element written 0, lse
    -inf, or the sink with sinks."""
    b, h, hkv, d = 2, 4, 2, 64
    kc = randn(rng, (3, 16, hkv, d), F16) if paged else np.zeros((b, 0, hkv, d), F16)
    table = np.zeros((b, 0), np.int32) if paged else None
    q = randn(rng, (b, ql, h, d), F16)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    for lens, sk in ((np.zeros(b, np.int32), None), (None, None), (np.zeros(b, np.int32), sinks)):
        out = np.full(q.shape, np.nan, F16)
        got, lse = fm.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, block_table=table, sinks=sk,
                                              out=out, return_softmax_lse=True, registry=registry)
        assert got is out and np.all(out == 0), f"lens {lens} sinks {sk}"
        want = np.full((b, h, ql), -np.inf, np.float32) if sk is None else np.broadcast_to(sk[:, None], (b, h, ql))
        assert np.array_equal(lse, want), lse


def test_gqa_8_2_full_capacity(registry, rng):
    """No cache_seqlens: every sequence holds its whole capacity."""
    k, v, _ = make_cache(rng, 2, 40, 2, 64, BF16)
    q = randn(rng, (2, 8, 64), F32)
    out, lse = decode(registry, q, k, v)
    e_out, e_lse = expected(q, k, v)
    assert_close(out, e_out, F32, "full capacity")
    assert_close(lse, e_lse, F32, "full capacity lse")


def test_lse_merges_two_halves(registry, rng):
    """Attention over keys [0, n) equals the LSE merge of [0, m) and [m, n)."""
    k, v, _ = make_cache(rng, 2, 48, 2, 64, F32)
    q = randn(rng, (2, 4, 64), F32)
    n, m = np.array([48, 30], np.int32), np.array([20, 7], np.int32)
    whole, _ = decode(registry, q, k, v, cache_seqlens=n)
    first, l1 = decode(registry, q, k, v, cache_seqlens=m)
    k2, v2 = np.zeros_like(k), np.zeros_like(v)  # the second half as its own cache
    for b in range(2):
        k2[b, :n[b] - m[b]], v2[b, :n[b] - m[b]] = k[b, m[b]:n[b]], v[b, m[b]:n[b]]
    second, l2 = decode(registry, q, k2, v2, cache_seqlens=(n - m).astype(np.int32))
    # merge_lse takes o [..., qL, H, D] and lse [..., H, qL]: one query row.
    merged, _ = reference.merge_lse(first[:, None], l1[..., None], second[:, None], l2[..., None])
    assert_close(merged[:, 0], whole, F32, "LSE merge")


def test_append_then_attend(registry, rng):
    """Appending one token per step to a paged cache of 3 sequences of
    different lengths, then attending, tracks the reference at every step."""
    k, v, table = make_cache(rng, 3, 64, 2, 64, BF16, page_size=16)
    lens = np.array([0, 17, 40], np.int32)
    for step in range(3):
        q = randn(rng, (3, 4, 64), F32)
        kn, vn = randn(rng, (3, 1, 2, 64), BF16), randn(rng, (3, 1, 2, 64), BF16)
        ek, ev = reference.kv_append(k, v, kn, vn, lens, table)
        out, lse = fm.flash_attn_with_kvcache(q[:, None], k, v, kn, vn, cache_seqlens=lens, block_table=table,
                                              return_softmax_lse=True, registry=registry)
        assert_bits_equal(k, ek, f"step {step}: k_cache after the append")
        assert_bits_equal(v, ev, f"step {step}: v_cache after the append")
        lens = lens + 1
        e_out, e_lse = expected(q, k, v, cache_seqlens=lens, block_table=table)
        assert_close(out[:, 0], e_out, F32, f"step {step}")
        assert_close(lse[..., 0], e_lse, F32, f"step {step} lse")


def test_tail_and_unused_pages_never_read(registry, rng):
    q, k, v, table, lens, out = check(registry, rng, page_size=16, lengths=(20, 5, 48))
    read = np.zeros(k.shape[:2], dtype=bool)  # [page, row]
    for b, n in enumerate(lens.tolist()):
        p = np.arange(n)
        read[table[b, p // 16], p % 16] = True
    k2, v2 = k.copy(), v.copy()
    k2[~read], v2[~read] = np.float16(np.nan), np.float16(np.nan)
    again, _ = decode(registry, q, k2, v2, cache_seqlens=lens, block_table=table)
    assert_bits_equal(out, again, "keys past kv_len and unused pages are never read")


def test_errors_name_the_function_and_value(registry, rng):
    k, v, table = make_cache(rng, 2, 32, 2, 64, F16, page_size=16)
    q = randn(rng, (2, 4, 64), F32)
    ok = np.array([20, 32], np.int32)
    cases = [
        (dict(cache_seqlens=np.array([20, 33], np.int32), block_table=table), "cache_seqlens[1] = 33"),
        (dict(cache_seqlens=np.array([-1, 3], np.int32), block_table=table), "cache_seqlens[0] = -1"),
        (dict(cache_seqlens=ok, block_table=np.array([[0, 1], [2, 99]], np.int32)), "block_table[1, 1] = 99"),
        (dict(cache_seqlens=ok, block_table=np.array([[0, -3], [2, 3]], np.int32)), "block_table[0, 1] = -3"),
        (dict(cache_seqlens=ok, block_table=table, window_size=(-2, -1)), "-2"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=f"^{OP}: .*{re.escape(msg)}"):
            decode(registry, q, k, v, **kw)
    with pytest.raises(ValueError, match=f"^{OP}: .*page size 0 \\(its dim 1\\) must be positive"):
        decode(registry, q, k[:, :0].copy(), v[:, :0].copy(), cache_seqlens=np.zeros(2, np.int32), block_table=table)


def test_entry_point_errors(registry, rng):
    """What the public API never passes, and the library's own op name."""
    k, v, table = make_cache(rng, 2, 32, 2, 64, F16, page_size=16)
    q = randn(rng, (2, 4, 64), F32)
    ok = np.array([20, 32], np.int32)
    cases = [
        (dict(cu_seqlens=np.array([0, 1, 2], np.int32)), "cu_seqlens_q/cu_seqlens_k must be NULL"),
        (dict(sinks=np.zeros(3, np.float32)), "sinks must have shape [4]"),
        (dict(lse_out=np.zeros((4, 2), np.float32)), "lse must have shape [2, 4]"),
        (dict(seqlens=np.array([20, 33], np.int32)), "cache_seqlens[1] = 33 is out of range [0, 32]"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=f"^{VEC_SEQ_OP}: .*{re.escape(msg)}"):
            vec_seq(registry, q, k, v, **{"seqlens": ok, "block_table": table, **kw})
    with pytest.raises(TypeError, match="cache_seqlens must be int32, got float32"):
        vec_seq(registry, q, k, v, seqlens=ok.astype(np.float32), block_table=table)


@pytest.mark.parametrize("d", [80, 96, 192])
def test_seed_decode_new_head_dims(registry, rng, d):
    """flash_attn_decode (the plain decode) at the head dims that are
    not powers of two: lanes own dims l, l + 32, ... with a partial last step
    at D = 80; the FWHT undo stays power-of-two only."""
    q = randn(rng, (2, 4, d), F32)
    k, v = randn(rng, (2, 2, 45, d), F16), randn(rng, (2, 2, 45, d), F16)
    out = fm.flash_attn_decode(q, k, v, 40, window=30, registry=registry)
    assert_close(out, reference.decode(q, k, v, 40, window=30), F32, f"{registry.backend} plain decode D={d}")
    with pytest.raises(ValueError, match=f"power-of-two head_dim .*got {d}"):
        fm.flash_attn_decode(q, k, v, 40, fwht=True, registry=registry)


@pytest.mark.parametrize("kv", [F32, BF16])
def test_sink_limits(registry, rng, kv):
    """+inf / -inf / NaN sinks in the decode reduce (serving_cases.check_sink_limits)."""
    check_sink_limits(registry, rng, 1, kv, 64)
