"""kv_append (fm_dispatch_kv_append) on every backend: bit-identical copies
into contiguous and paged caches, nothing else in the caches changes, and a
bad length or table raises before anything is written."""
from __future__ import annotations

import re

import numpy as np
import pytest

import flashmetal as fm
from numerics import BF16, F16, F32, assert_bits_equal
from serving_native import KV_APPEND_OP, kv_append

DTYPES = [F32, F16, BF16]


def random_bits(rng, shape, dtype):
    """Every bit pattern of the dtype, NaN payloads and subnormals included:
    a copy that converted would change some of them."""
    width = np.dtype(dtype).itemsize
    raw = rng.integers(0, 2 ** (8 * width), size=shape, dtype=np.uint32 if width == 4 else np.uint16)
    return raw.view(dtype)


def expected(cache, new, lens, table=None):
    """The cache with row i of sequence b of `new` at row lens[b] + i (float64-free: raw bits)."""
    out = cache.copy()
    for b, start in enumerate(lens.tolist()):
        for i in range(new.shape[1]):
            t = start + i
            if table is None:
                out[b, t] = new[b, i]
            else:
                out[table[b, t // cache.shape[1]], t % cache.shape[1]] = new[b, i]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 80, 128, 512])
def test_contiguous(registry, rng, dtype, d):
    b, cap, hkv, n_new = 3, 12, 2, 3
    kc, vc = random_bits(rng, (b, cap, hkv, d), dtype), random_bits(rng, (b, cap, hkv, d), dtype)
    kn, vn = random_bits(rng, (b, n_new, hkv, d), dtype), random_bits(rng, (b, n_new, hkv, d), dtype)
    lens = np.array([0, 5, cap - n_new], np.int32)
    ek, ev = expected(kc, kn, lens), expected(vc, vn, lens)
    kn0, vn0, lens0 = kn.copy(), vn.copy(), lens.copy()
    kv_append(registry, kn, vn, kc, vc, lens)
    assert_bits_equal(kc, ek, f"{registry.backend} k_cache {dtype} D={d}")
    assert_bits_equal(vc, ev, f"{registry.backend} v_cache {dtype} D={d}")
    for a, a0, n in ((kn, kn0, "k_new"), (vn, vn0, "v_new"), (lens, lens0, "cache_seqlens")):
        assert_bits_equal(a, a0, f"{n} is not changed")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 8, 16])
def test_paged_shuffled(registry, rng, dtype, page_size):
    """Rows cross page boundaries; a table row may repeat no page of another."""
    b, hkv, d, n_new = 3, 2, 64, 5
    max_pages = 8 if page_size == 1 else 4
    num_pages = b * max_pages + 3
    table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    cap = max_pages * page_size
    lens = np.array([0, page_size - 1 if page_size > 1 else 2, cap - n_new], np.int32)
    # Entries past the rows written are never touched: -1 proves it.
    for bb in range(b):
        last = (int(lens[bb]) + n_new - 1) // page_size
        table[bb, last + 1:] = -1
    kc, vc = random_bits(rng, (num_pages, page_size, hkv, d), dtype), random_bits(rng, (num_pages, page_size, hkv, d), dtype)
    kn, vn = random_bits(rng, (b, n_new, hkv, d), dtype), random_bits(rng, (b, n_new, hkv, d), dtype)
    ek, ev = expected(kc, kn, lens, table), expected(vc, vn, lens, table)
    kv_append(registry, kn, vn, kc, vc, lens, table)
    assert_bits_equal(kc, ek, f"{registry.backend} paged k_cache {dtype} page={page_size}")
    assert_bits_equal(vc, ev, f"{registry.backend} paged v_cache {dtype} page={page_size}")


def test_zero_new_rows_writes_nothing(registry, rng):
    kc, vc = random_bits(rng, (2, 8, 2, 64), F16), random_bits(rng, (2, 8, 2, 64), F16)
    k0, v0 = kc.copy(), vc.copy()
    kv_append(registry, np.zeros((2, 0, 2, 64), F16), np.zeros((2, 0, 2, 64), F16), kc, vc,
              np.array([8, 3], np.int32))
    assert_bits_equal(kc, k0, "k_cache")
    assert_bits_equal(vc, v0, "v_cache")


def test_bad_tables_raise_and_write_nothing(registry, rng):
    b, hkv, d, n_new = 2, 2, 64, 3
    kc, vc = random_bits(rng, (2, 10, hkv, d), BF16), random_bits(rng, (2, 10, hkv, d), BF16)
    pc, pv = random_bits(rng, (5, 4, hkv, d), BF16), random_bits(rng, (5, 4, hkv, d), BF16)
    kn, vn = random_bits(rng, (b, n_new, hkv, d), BF16), random_bits(rng, (b, n_new, hkv, d), BF16)
    before = [a.copy() for a in (kc, vc, pc, pv)]
    table = np.array([[0, 1, 2], [3, 4, -1]], np.int32)
    cases = [
        ((kc, vc, np.array([0, 8], np.int32), None),
         "cache_seqlens[1] + the new rows of k_new (its dim 1) = 8 + 3 = 11 exceeds the cache capacity, "
         "k_cache's dim 1 (10)"),
        ((kc, vc, np.array([-1, 0], np.int32), None), "cache_seqlens[0] = -1 is out of range [0, 10]"),
        ((kc, vc, np.array([11, 0], np.int32), None), "cache_seqlens[0] = 11 is out of range"),
        ((pc, pv, np.array([0, 6], np.int32), table), "block_table[1, 2] = -1 is out of range [0, 5)"),
        # Rows 2..4 of sequence 0 span its pages 0 and 1: entry [0, 1] is used.
        ((pc, pv, np.array([2, 0], np.int32), np.array([[0, 7, 2], [3, 4, 0]], np.int32)),
         "block_table[0, 1] = 7 is out of range [0, 5)"),
        ((pc, pv, np.array([10, 0], np.int32), table), "exceeds block_table's 3 pages (its dim 1) of 4 keys (k_cache's dim 1) (12)"),
        ((pc, pv, np.array([0, 0], np.int32), np.array([[0, 1, 2]], np.int32)), "block_table must have shape"),
    ]
    for (c_k, c_v, lens, tbl), msg in cases:
        with pytest.raises(ValueError, match=f"^{KV_APPEND_OP}: .*{re.escape(msg)}"):
            kv_append(registry, kn, vn, c_k, c_v, lens, tbl)
    with pytest.raises(TypeError, match="cache_seqlens must be int32, got float32"):
        kv_append(registry, kn, vn, kc, vc, np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="v_new dtype float16 does not match k_cache dtype bfloat16"):
        kv_append(registry, kn, vn.astype(F16), kc, vc, np.zeros(2, np.int32))
    for a, a0 in zip((kc, vc, pc, pv), before):
        assert_bits_equal(a, a0, "a refused call writes nothing")


def test_public_api_append_errors_write_nothing(registry, rng):
    """Through flash_attn_with_kvcache(k=, v=): the message names the public
    function and the value; the caller's caches are untouched."""
    kc, vc = random_bits(rng, (2, 10, 2, 64), F16), random_bits(rng, (2, 10, 2, 64), F16)
    before = (kc.copy(), vc.copy())
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    kn, vn = random_bits(rng, (2, 3, 2, 64), F16), random_bits(rng, (2, 3, 2, 64), F16)
    for lens, msg in (([0, 8], "cache_seqlens[1] + the new rows of k (its dim 1) = 8 + 3 = 11 exceeds"),
                      ([-2, 0], "cache_seqlens[0] = -2 is out of range")):
        with pytest.raises(ValueError, match="^flash_attn_with_kvcache: .*" + re.escape(msg)):
            fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=np.array(lens, np.int32), registry=registry)
        assert_bits_equal(kc, before[0], "k_cache untouched")
        assert_bits_equal(vc, before[1], "v_cache untouched")
