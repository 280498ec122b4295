"""Serving decode (fm_dispatch_vec_seq: per-sequence kv lengths, paged K/V,
window, softcap, sinks, LSE) on every backend against the float64 reference.
Sim shapes are tiny: one split-KV decode is B*H*32 SIMD groups."""
from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest

import flashmetal as fm
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn
from serving_native import VEC_SEQ_OP, vec_seq

HEAD_DIMS = [64, 128, 256, 512]
KV_DTYPES = [F32, F16, BF16]
# INTERIM: decode-cpu's cpu kernel for the serving constants (501-505) has not
# landed yet; remove this gate once `git merge main` brings it.
CPU_VEC_SEQ_PENDING = True


@pytest.fixture
def registry(registry):
    if registry.backend == "cpu" and CPU_VEC_SEQ_PENDING:
        pytest.skip("cpu serving decode kernel pending (decode-cpu)")
    return registry


def reference_decode(q, k, v, lengths, *, block_table=None, window_left=-1, softcap=0.0, sinks=None, scale=None):
    """float64: q [B, H, D] over caches [B, cap, Hkv, D] (or paged) holding
    lengths[b] keys; the query sits at lengths[b] - 1 -> (out [B, H, D], lse [B, H])."""
    q64 = q.astype(np.float64)
    b_, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((b_, h, d))
    lse = np.full((b_, h), -np.inf)
    for b in range(b_):
        n = int(lengths[b])
        if block_table is None:
            kb, vb = k[b, :n], v[b, :n]
        else:
            pos = np.arange(n)
            pages = block_table[b][pos // k.shape[1]]
            kb, vb = k[pages, pos % k.shape[1]], v[pages, pos % k.shape[1]]
        kb, vb = kb.astype(np.float64), vb.astype(np.float64)  # [n, Hkv, D]
        g = h // k.shape[2]
        for hh in range(h):
            s = scale * (kb[:, hh // g] @ q64[b, hh])
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if window_left >= 0:
                s = np.where(np.arange(n) >= n - 1 - window_left, s, -np.inf)
            logits = np.concatenate([s, [-np.inf if sinks is None else float(sinks[hh])]])
            m = logits.max()
            if not np.isfinite(m):
                continue  # sees nothing, no sink: out 0, lse -inf
            e = np.exp(logits - m)
            out[b, hh] = e[:-1] @ vb[:, hh // g] / e.sum()
            lse[b, hh] = m + math.log(e.sum())
    return out, lse


def make_cache(rng, b, cap, hkv, d, dtype, page_size=None, spare_pages=2):
    """Contiguous caches [B, cap, Hkv, D], or the same rows scattered over
    shuffled pages [num_pages, page_size, Hkv, D] with a block table whose
    unused entries are -1 (never read)."""
    k = randn(rng, (b, cap, hkv, d), dtype)
    v = randn(rng, (b, cap, hkv, d), dtype)
    if page_size is None:
        return k, v, None
    per_seq = -(-cap // page_size)
    num = b * per_seq + spare_pages
    order = rng.permutation(num)
    table = order[:b * per_seq].reshape(b, per_seq).astype(np.int32)
    kp = randn(rng, (num, page_size, hkv, d), dtype)
    vp = randn(rng, (num, page_size, hkv, d), dtype)
    for bb in range(b):
        for j in range(per_seq):
            rows = slice(j * page_size, min((j + 1) * page_size, cap))
            n = rows.stop - rows.start
            kp[table[bb, j], :n] = k[bb, rows]
            vp[table[bb, j], :n] = v[bb, rows]
    return kp, vp, table


def check(registry, rng, *, b=3, h=4, hkv=2, d=64, cap=48, kv=F16, lengths=(0, 17, 48), page_size=None,
          window_left=-1, softcap=0.0, sinks=False, lse=True, scale=None):
    k, v, table = make_cache(rng, b, cap, hkv, d, kv, page_size)
    lens = np.array(lengths, dtype=np.int32)
    if table is not None:
        # Entries past a sequence's pages are never read: -1 proves it.
        used = -(-lens // page_size)
        for bb in range(b):
            table[bb, used[bb]:] = -1
    q = randn(rng, (b, h, d), F32)
    snk = (rng.standard_normal(h) * 2).astype(np.float32) if sinks else None
    out, lse_out = vec_seq(registry, q, k, v, seqlens=lens, block_table=table, sinks=snk, lse=lse,
                           window=(window_left, -1), softcap=softcap, scale=scale)
    e_out, e_lse = reference_decode(q, k, v, lens, block_table=table, window_left=window_left, softcap=softcap,
                                    sinks=snk, scale=scale)
    what = f"{registry.backend} D={d} kv={kv} paged={page_size} window={window_left} sinks={sinks}"
    assert_close(out, e_out, F32, what)
    if lse:
        assert_close(lse_out, e_lse, F32, what + " lse")
    return q, k, v, table, lens, out


@pytest.mark.parametrize("d,kv", list(itertools.product(HEAD_DIMS, KV_DTYPES)))
def test_ragged_lengths(registry, rng, d, kv):
    # 0 (sees nothing: out 0, lse -inf), 1, a chunk + 1, the capacity.
    small = registry.backend == "sim" and d >= 256
    check(registry, rng, d=d, kv=kv, b=2 if small else 4, cap=40,
          lengths=(0, 33) if small else (0, 1, 33, 40))


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_shuffled_table(registry, rng, page_size):
    check(registry, rng, page_size=page_size, cap=64, lengths=(64, 1, 31), kv=BF16)


def test_paged_equals_contiguous(registry, rng):
    """The same keys through a block table give the same output bits."""
    b, cap, d = 2, 48, 64
    k, v, table = make_cache(rng, b, cap, 2, d, F16, page_size=16)
    kc = np.stack([np.concatenate([k[table[bb, j]] for j in range(table.shape[1])])[:cap] for bb in range(b)])
    vc = np.stack([np.concatenate([v[table[bb, j]] for j in range(table.shape[1])])[:cap] for bb in range(b)])
    q = randn(rng, (b, 4, d), F32)
    lens = np.array([45, 20], dtype=np.int32)
    paged, lp = vec_seq(registry, q, k, v, seqlens=lens, block_table=table, lse=True)
    contig, lc = vec_seq(registry, q, kc, vc, seqlens=lens, lse=True)
    assert_bits_equal(paged, contig, "paged vs contiguous")
    assert_bits_equal(lp, lc, "paged vs contiguous lse")


@pytest.mark.parametrize("window_left", [0, 4, 31, 100])
def test_window_per_sequence(registry, rng, window_left):
    check(registry, rng, window_left=window_left, lengths=(3, 48, 40), page_size=16 if window_left == 4 else None)


def test_softcap_and_scale(registry, rng):
    check(registry, rng, softcap=3.0, scale=4 / math.sqrt(64), kv=F32)


@pytest.mark.parametrize("lengths", [(0, 20, 48), (48, 0, 0)])
def test_sinks(registry, rng, lengths):
    # A row without keys but with a sink: out 0, lse = the sink.
    _, _, _, _, lens, out = check(registry, rng, sinks=True, lengths=lengths)
    assert not np.any(out[lens == 0])


def test_sinks_without_lse(registry, rng):
    check(registry, rng, sinks=True, lse=False, page_size=16, lengths=(5, 48, 16))


def test_gqa_8_2_full_capacity(registry, rng):
    """No seqlens: every sequence holds its whole capacity."""
    k, v, _ = make_cache(rng, 2, 40, 2, 64, BF16)
    q = randn(rng, (2, 8, 64), F32)
    out, lse = vec_seq(registry, q, k, v, lse=True, causal=False)
    e_out, e_lse = reference_decode(q, k, v, [40, 40])
    assert_close(out, e_out, F32, "full capacity")
    assert_close(lse, e_lse, F32, "full capacity lse")


def test_lse_merges_two_halves(registry, rng):
    """Attention over keys [0, n) equals the LSE merge of [0, m) and [m, n)."""
    k, v, _ = make_cache(rng, 2, 48, 2, 64, F32)
    q = randn(rng, (2, 4, 64), F32)
    n, m = np.array([48, 30], np.int32), np.array([20, 7], np.int32)
    whole, _ = vec_seq(registry, q, k, v, seqlens=n)
    first, l1 = vec_seq(registry, q, k, v, seqlens=m, lse=True)
    # The second half as its own cache (rows m..n-1 at the front).
    k2, v2 = np.zeros_like(k), np.zeros_like(v)
    for b in range(2):
        k2[b, :n[b] - m[b]], v2[b, :n[b] - m[b]] = k[b, m[b]:n[b]], v[b, m[b]:n[b]]
    second, l2 = vec_seq(registry, q, k2, v2, seqlens=(n - m).astype(np.int32), lse=True)
    mx = np.maximum(l1, l2)[..., None].astype(np.float64)
    w1, w2 = np.exp(l1[..., None] - mx), np.exp(l2[..., None] - mx)
    merged = (w1 * first + w2 * second) / (w1 + w2)
    assert_close(merged, whole, F32, "LSE merge")


def test_tail_and_unused_pages_never_read(registry, rng):
    q, k, v, table, lens, out = check(registry, rng, page_size=16, lengths=(20, 5, 48), lse=False)
    read = np.zeros(k.shape[:2], dtype=bool)  # [page, row]
    for b, n in enumerate(lens.tolist()):
        p = np.arange(n)
        read[table[b, p // 16], p % 16] = True
    k2, v2 = k.copy(), v.copy()
    k2[~read], v2[~read] = np.float16(np.nan), np.float16(np.nan)
    again, _ = vec_seq(registry, q, k2, v2, seqlens=lens, block_table=table)
    assert_bits_equal(out, again, "keys past kv_len and unused pages are never read")


def test_errors_name_the_op_and_value(registry, rng):
    k, v, table = make_cache(rng, 2, 32, 2, 64, F16, page_size=16)
    q = randn(rng, (2, 4, 64), F32)
    ok = np.array([20, 32], np.int32)
    cases = [
        (dict(seqlens=np.array([20, 33], np.int32), block_table=table), "seqlens_k[1] = 33 is out of range [0, 32]"),
        (dict(seqlens=np.array([-1, 3], np.int32), block_table=table), "seqlens_k[0] = -1"),
        (dict(seqlens=ok, block_table=np.array([[0, 1], [2, 99]], np.int32)), "block_table[1, 1] = 99 is out of range"),
        (dict(seqlens=ok, block_table=np.array([[0, -3], [2, 3]], np.int32)), "block_table[0, 1] = -3"),
        (dict(seqlens=ok, block_table=table, cu_seqlens=np.array([0, 1, 2], np.int32)), "cu_seqlens_q/cu_seqlens_k must be NULL"),
        (dict(seqlens=ok, block_table=table, sinks=np.zeros(3, np.float32)), "sinks must have shape [4]"),
        (dict(seqlens=ok, block_table=table, window=(-2, -1)), "window_left must be >= -1"),
        (dict(seqlens=ok, block_table=table, lse_out=np.zeros((4, 2), np.float32)), "lse must have shape [2, 4]"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=f"^{VEC_SEQ_OP}: .*{re.escape(msg)}"):
            vec_seq(registry, q, k, v, **kw)
    with pytest.raises(TypeError, match="seqlens_k must be int32, got float32"):
        vec_seq(registry, q, k, v, seqlens=ok.astype(np.float32), block_table=table)
    kc, vc = k[:2].copy(), v[:2].copy()  # [2, 16, 2, 64]: a contiguous cache of 16 rows
    with pytest.raises(ValueError, match=r"must be a positive multiple of 16, got 8"):
        vec_seq(registry, q, k[:, :8].copy(), v[:, :8].copy(), seqlens=ok, block_table=table)
    with pytest.raises(fm.InvalidValueError, match=VEC_SEQ_OP):
        vec_seq(registry, q, kc, vc, seqlens=ok)
