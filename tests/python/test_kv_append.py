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


def _kv_buffer(rng, lead=2):
    """`lead` caches [2, 16, 2, 64] f16 back to back in one array."""
    return random_bits(rng, (lead, 2, 16, 2, 64), F16)


def test_overlapping_caches_and_rows_are_refused_cpu(rng):
    """The append writes k_cache and v_cache while reading k/v: the same array,
    two overlapping views of one buffer, or new rows that live inside a cache
    are a ValueError naming flash_attn_with_kvcache and both arguments (the
    library's check), and nothing is written. Adjacent, disjoint views of one
    buffer are fine, and so is a strided k/v view into a cache: it is copied
    before the append, which then writes the values it held before the call."""
    buf = _kv_buffer(rng, 3)
    flat = buf.reshape(-1)
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    kn, vn = random_bits(rng, (2, 1, 2, 64), F16), random_bits(rng, (2, 1, 2, 64), F16)
    lens = np.array([3, 7], np.int32)
    inside = flat[5 * 64: 5 * 64 + kn.size].reshape(kn.shape)  # rows of buf[0] (a strided-free view)
    cases = [
        ((buf[0], buf[0], kn, vn), "k_cache and v_cache"),
        ((buf[0], buf[0][:, :, :], kn, vn), "k_cache and v_cache"),  # another view of the same memory
        ((flat[:buf[0].size].reshape(buf[0].shape), flat[64:64 + buf[0].size].reshape(buf[0].shape), kn, vn),
         "k_cache and v_cache"),
        ((buf[0], buf[1], inside, vn), "k_cache and k"),
    ]
    for (kc, vc, k, v), names in cases:
        before = buf.copy()
        with pytest.raises(ValueError, match=rf"^flash_attn_with_kvcache: {names} overlap in memory"):
            fm.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, registry="cpu")
        assert_bits_equal(buf, before, f"{names}: nothing written")
    kc, vc = buf[0], buf[1]
    want_k, want_v = expected(kc, kn, lens), expected(vc, vn, lens)
    fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, registry="cpu")
    assert_bits_equal(buf[0], want_k, "adjacent caches of one buffer: k_cache")
    assert_bits_equal(buf[1], want_v, "adjacent caches of one buffer: v_cache")
    for v_view in (buf[1][:, 4:5], buf[0][:, ::16]):  # strided views into a cache: copied first
        before_v = v_view.copy()
        want_k, want_v = expected(buf[0], kn, lens), expected(buf[1], before_v, lens)
        fm.flash_attn_with_kvcache(q, buf[0], buf[1], kn, v_view, cache_seqlens=lens, registry="cpu")
        assert_bits_equal(buf[0], want_k, "strided v view: k_cache")
        assert_bits_equal(buf[1], want_v, "strided v view: v_cache holds the view's values from before the call")


def test_overlapping_torch_caches_are_refused_cpu(rng):
    torch = pytest.importorskip("torch")
    buf = torch.from_numpy(_kv_buffer(rng).view(np.int16)).view(torch.float16)
    q = torch.randn(2, 1, 4, 64)
    kn, vn = torch.randn(2, 1, 2, 64).half(), torch.randn(2, 1, 2, 64).half()
    lens = torch.tensor([3, 7], dtype=torch.int32)
    for args, names in (((buf[0], buf[0], kn, vn), "k_cache and v_cache"),
                        ((buf[0], buf[1], buf[0].view(-1)[:kn.numel()].view(kn.shape), vn), "k_cache and k"),
                        ((buf[0], buf[1], kn, buf[1].view(-1)[:kn.numel()].view(kn.shape)), "v_cache and v")):
        before = buf.clone()
        with pytest.raises(ValueError, match=rf"^flash_attn_with_kvcache: {names} overlap in memory"):
            fm.flash_attn_with_kvcache(q, *args, cache_seqlens=lens, registry="cpu")
        assert torch.equal(buf.view(torch.int16), before.view(torch.int16)), f"{names}: nothing written"
    want_k = expected(buf[0].numpy(), kn.numpy(), lens.numpy())
    fm.flash_attn_with_kvcache(q, buf[0], buf[1], kn, vn, cache_seqlens=lens, registry="cpu")
    assert_bits_equal(buf[0].numpy(), want_k, "torch views of one buffer: k_cache written in place")


def test_c_abi_refuses_overlap(registry, rng):
    """fm_dispatch_kv_append itself compares the tensors' address ranges, so a
    C caller gets FM_ERROR_VALUE naming kv_append and both arguments."""
    buf = _kv_buffer(rng)
    flat = buf.reshape(-1)
    kn, vn = random_bits(rng, (2, 1, 2, 64), F16), random_bits(rng, (2, 1, 2, 64), F16)
    lens = np.array([3, 7], np.int32)
    rows_in_v = flat[buf[0].size + 64: buf[0].size + 64 + kn.size].reshape(kn.shape)
    lens_in_k = flat[: 4].view(np.int32)  # two int32 over k_cache's first bytes
    lens_in_k[:] = lens  # valid lengths: only the overlap is wrong
    before = buf.copy()
    for (k, v, kc, vc, sl), names in (((kn, vn, buf[0], buf[0], lens), "k_cache and v_cache"),
                                      ((rows_in_v, vn, buf[0], buf[1], lens), "v_cache and k_new"),
                                      ((kn, vn, buf[0], buf[1], lens_in_k), "k_cache and cache_seqlens")):
        with pytest.raises(ValueError, match=rf"^{KV_APPEND_OP}: {names} overlap in memory"):
            kv_append(registry, k, v, kc, vc, sl)
        assert_bits_equal(buf, before, f"{names}: nothing written")


def test_appended_lengths_beyond_int32_are_refused():
    """A paged cache's capacity may exceed int32 (2**20 pages of 4096 keys in
    the table); the lengths the attention reads after an append may not:
    cache_seqlens 2**31 - 1 plus a new row is a ValueError naming it, dense
    and quantized. In a subprocess: before, the int32 sum trapped the process."""
    from subprocess_run import run_python
    run_python("""
        import ml_dtypes
        bf16 = np.dtype(ml_dtypes.bfloat16)
        q, kn = np.zeros((1, 1, 1, 64), bf16), np.ones((1, 1, 1, 64), bf16)
        table, lens = np.zeros((1, 2**20), np.int32), np.array([2**31 - 1], np.int32)
        codec = fm.KVCodec(64, 4)
        for backend in ("cpu", "sim"):
            for caches in ((np.zeros((1, 4096, 1, 64), bf16), np.zeros((1, 4096, 1, 64), bf16)),
                           (codec.empty((1, 4096, 1)), codec.empty((1, 4096, 1)))):
                try:
                    fm.flash_attn_with_kvcache(q, *caches, kn, kn, cache_seqlens=lens, block_table=table,
                                               registry=backend)
                    raise SystemExit("accepted")
                except fm.InvalidValueError as e:
                    assert e.argument == "cache_seqlens" and "2147483648 exceeds the int32 lengths" in str(e), e
    """)
