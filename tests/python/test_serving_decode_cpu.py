"""The cpu serving decode at lengths that cross the kernel's structure: many
32-key chunks per workgroup, several 32-key tiles per item, pages of 16 and
48 keys, windows that start inside a page, GQA groups of 1, 2 and 8 rows.
Through the public flash_attn_with_kvcache against the float64 reference,
on every head dim with a decode kernel; test_cpu_isa runs this file on every
ISA path. On the cpu a paged cache gives the bits of a contiguous one."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn

# 0: sees nothing; a chunk + 1; one tile per workgroup; several tiles per
# workgroup (more keys than 32 workgroups x 32). Short lengths: test_serving_decode_sim.
LENGTHS = (0, 33, 700, 2100)


def paged_copy(k: np.ndarray, v: np.ndarray, page_size: int,
               rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[B, cap, Hkv, D] caches -> (k pages, v pages [num_pages, page_size, Hkv, D],
    block_table): the same rows behind a shuffled table, unused slots -1 (never read)."""
    b, cap = k.shape[:2]
    per = -(-cap // page_size)
    order = rng.permutation(b * per + 3)
    pages = [np.zeros((len(order), page_size) + k.shape[2:], k.dtype) for _ in range(2)]
    table = np.full((b, per + 1), -1, np.int32)
    for s in range(b):
        for j in range(per):
            table[s, j] = order[s * per + j]
            for src, dst in zip((k, v), pages):
                rows = src[s, j * page_size:(j + 1) * page_size]
                dst[table[s, j], :len(rows)] = rows
    return pages[0], pages[1], table


def decode(q, kc, vc, lens, **kw):
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, return_softmax_lse=True,
                                          registry="cpu", **kw)
    return out, lse


@pytest.mark.parametrize("d", fm.supported_head_dims("flash_attn_vec"))
@pytest.mark.parametrize("kv", [F32, F16, BF16])
def test_cpu_long_ragged_paged(rng, d, kv):
    hq, hkv, cap = 4, 2, max(LENGTHS)
    lens = np.array(LENGTHS, np.int32)
    q = randn(rng, (len(lens), 1, hq, d), F32)
    kc, vc = randn(rng, (len(lens), cap, hkv, d), kv), randn(rng, (len(lens), cap, hkv, d), kv)
    sinks = rng.normal(size=hq).astype(np.float32)
    kw = dict(window_size=(300, -1), softcap=8.0, sinks=sinks)
    out, lse = decode(q, kc, vc, lens, **kw)
    want, want_lse = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, **kw)
    assert_close(out, want, F32, f"d={d} kv={kv}")
    assert_close(lse, want_lse, F32, f"lse d={d} kv={kv}")
    for page_size in (16, 48):
        kp, vp, table = paged_copy(kc, vc, page_size, rng)
        paged, paged_lse = decode(q, kp, vp, lens, block_table=table, **kw)
        assert_bits_equal(paged, out, f"paged {page_size} vs contiguous d={d} kv={kv}")
        assert_bits_equal(paged_lse, lse, f"paged {page_size} lse d={d} kv={kv}")


@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 2)])
def test_cpu_gqa_groups(rng, hq, hkv):
    """Groups of 1 and 8 query rows per kv head (8: two blocks of 4 rows share each tile)."""
    d, cap = 128, 1500
    lens = np.array([1500, 999, 64], np.int32)
    q = randn(rng, (3, 1, hq, d), F32)
    kc, vc = randn(rng, (3, cap, hkv, d), F16), randn(rng, (3, cap, hkv, d), F16)
    out, lse = decode(q, kc, vc, lens, causal=True)
    want, want_lse = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, causal=True)
    assert_close(out, want, F32, f"gqa {hq}/{hkv}")
    assert_close(lse, want_lse, F32, f"gqa {hq}/{hkv} lse")


def test_cpu_empty_rows_and_sink_only(rng):
    """kv length 0: output exactly 0 and lse -inf without a sink; with a sink,
    output 0 and lse = the sink."""
    q = randn(rng, (2, 1, 4, 64), F32)
    kc = randn(rng, (2, 32, 2, 64), BF16)
    lens = np.array([0, 0], np.int32)
    out, lse = decode(q, kc, kc, lens)
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    out, lse = decode(q, kc, kc, lens, sinks=sinks)
    assert np.all(out == 0)
    assert np.array_equal(lse[..., 0], np.broadcast_to(sinks, (2, 4)))  # lse [B, H, qL]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kv", [F32, F16, BF16])
def test_cpu_flash_attn_layout_gives_the_seeds_layout_bits(rng, d, kv):
    """flash-attn's [B, cap, Hkv, D] cache is decoded a tile of keys at a time
    with every head inside (the heads of one key are adjacent), the plain
    [Hkv, cap, D] head by head: the same keys give the same bits either way."""
    h, hkv, n = 8, 4, 1000  # several 32-key tiles per workgroup, GQA 2
    q = randn(rng, (h, d), F32)
    k, v = randn(rng, (hkv, n, d), kv), randn(rng, (hkv, n, d), kv)
    plain = fm.flash_attn_decode(q, k, v, n, registry="cpu")
    serving = fm.flash_attn_with_kvcache(q[None, None], np.ascontiguousarray(k.transpose(1, 0, 2))[None],
                                         np.ascontiguousarray(v.transpose(1, 0, 2))[None],
                                         cache_seqlens=np.array([n], np.int32), registry="cpu")
    assert_bits_equal(serving[0, 0], plain, f"D={d} {np.dtype(kv).name}")
