"""Prefill numerics against the float64 reference, on every backend."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, qkv, randn, wide_bool_bytes

HEAD_DIMS = [64, 128, 256, 512]
DTYPES = [BF16, F16]
MASKS = ["none", "additive2", "additive4", "bool"]


def make_mask(rng, kind, b, h, ql, kl, dtype):
    """A mask with some -inf / False cells and finite biases; every row keeps key 0."""
    if kind == "none":
        return None
    shape = (ql, kl) if kind in ("additive2", "bool") else (b, h, ql, kl)
    keep = rng.random(shape) < 0.7
    keep[..., 0] = True
    if kind == "bool":
        return keep
    bias = rng.uniform(-2, 1, shape)
    return np.where(keep, bias, -np.inf).astype(dtype)


def check(registry, rng, *, b=1, h=2, hkv=2, ql=50, kl=64, d=64, dtype=BF16, mask="none",
          causal=False, scale=None, q_offset=None, softcap=0.0):
    q, k, v = qkv(rng, dtype, b=b, h=h, hkv=hkv, ql=ql, kl=kl, d=d)
    m = make_mask(rng, mask, b, h, ql, kl, dtype)
    off = (kl - ql) if q_offset is None else q_offset
    out = fm.flash_attn_prefill(q, k, v, mask=m, causal=causal, q_offset=off, scale=scale,
                                softcap=softcap, registry=registry)
    assert out.dtype == dtype and out.shape == q.shape
    exp = reference.attention(q, k, v, scale=scale, causal=causal, q_offset=off, mask=m, softcap=softcap)
    assert_close(out, exp, dtype, f"{registry.backend} d={d} {dtype} mask={mask} causal={causal}")
    return out


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("shared", [True, False])
def test_bool_mask_reads_any_nonzero_byte_as_true(registry, rng, d, shared):
    """A bool mask whose bytes are 0, 1, 2, 7, 128, 255 (through the C ABI a
    `bool` buffer may hold any byte): every kernel that reads it, the prefill
    and (for a mask shared by all heads, 3x2 key tiles) the auto-blk pass,
    reads nonzero as true: bit-identical to the 0/1 mask, and the reference."""
    b, h, ql, kl = 1, 2, 40, 48
    q, k, v = qkv(rng, F16, b=b, h=h, hkv=h, ql=ql, kl=kl, d=d)
    keep = rng.random((ql, kl) if shared else (b, h, ql, kl)) < 0.6
    keep[..., 0] = True
    wide = wide_bool_bytes(rng, keep)
    out = fm.flash_attn_prefill(q, k, v, mask=wide, registry=registry)
    assert_bits_equal(out, fm.flash_attn_prefill(q, k, v, mask=keep, registry=registry), "bytes > 1 vs 0/1")
    assert_close(out, reference.attention(q, k, v, mask=keep), F16, f"{registry.backend} wide bool mask d={d}")


@pytest.mark.parametrize("d,dtype,mask,causal",
                         list(itertools.product(HEAD_DIMS, DTYPES, MASKS, [False, True])))
def test_matrix(registry, rng, d, dtype, mask, causal):
    check(registry, rng, d=d, dtype=dtype, mask=mask, causal=causal)


@pytest.mark.parametrize("d,dtype,mask,causal",
                         list(itertools.product([80, 96, 192], DTYPES, ["none", "bool"], [False, True])))
def test_serving_head_dims(registry, rng, d, dtype, mask, causal):
    """Head dims 80, 96 and 192 : the D <= 256 tile, D/8 fragments."""
    check(registry, rng, d=d, dtype=dtype, mask=mask, causal=causal)


@pytest.mark.parametrize("ql,kl", [(50, 64), (32, 50), (64, 64), (1, 17), (33, 33)])
@pytest.mark.parametrize("d", [128, 512])
def test_aligned_and_unaligned(registry, rng, ql, kl, d):
    check(registry, rng, ql=ql, kl=kl, d=d, causal=True)
    check(registry, rng, ql=ql, kl=kl, d=d, causal=False, mask="additive2")


@pytest.mark.parametrize("ql,kl,d,dtype,mask", [(50, 17, 64, BF16, "none"), (40, 3, 128, F16, "bool"),
                                                 (33, 32, 512, BF16, "additive4"), (70, 9, 59, F32, "additive2")])
def test_more_rows_than_keys(registry, rng, ql, kl, d, dtype, mask):
    """Without causal and a window no position matters: q may have more rows
    than there are keys (cross-attention), each row over every key the mask
    keeps, whatever q_offset says."""
    q, k, v = qkv(rng, dtype, b=2, h=4, hkv=2, ql=ql, kl=kl, d=d)
    m = make_mask(rng, mask, 2, 4, ql, kl, dtype)
    out = fm.flash_attn_prefill(q, k, v, mask=m, registry=registry)
    assert_close(out, reference.attention(q, k, v, mask=m), dtype, f"{registry.backend} qL {ql} > kL {kl}")
    assert_bits_equal(out, fm.flash_attn_prefill(q, k, v, mask=m, q_offset=7, registry=registry), "q_offset 7")


def test_gqa_8_2_batch(registry, rng):
    check(registry, rng, b=2, h=8, hkv=2, ql=40, kl=48, d=128, causal=True)


@pytest.mark.parametrize("d", [64, 256])
def test_scales(registry, rng, d):
    check(registry, rng, d=d, scale=0.25)
    check(registry, rng, d=d, scale=4.0 / np.sqrt(d), dtype=F16)


def test_softcap(registry, rng):
    check(registry, rng, d=128, softcap=5.0, scale=1.0, causal=True)


def test_all_neg_inf_mask_gives_exact_zeros(registry, rng):
    q, k, v = qkv(rng, BF16, b=1, h=2, hkv=2, ql=20, kl=24, d=64)
    m = np.full((20, 24), -np.inf, dtype=BF16)
    m[:10, 3] = 0  # rows 0..9 see one key, rows 10.. see nothing
    out = fm.flash_attn_prefill(q, k, v, mask=m, registry=registry)
    assert np.all(out[:, :, 10:].astype(np.float32) == 0)
    assert not np.any(np.signbit(out[:, :, 10:].astype(np.float32)))
    exp = reference.attention(q, k, v, mask=m)
    assert_close(out, exp, BF16, "single visible key")
    bool_out = fm.flash_attn_prefill(q, k, v, mask=np.zeros((20, 24), bool), registry=registry)
    assert np.all(bool_out.astype(np.float32) == 0)


@pytest.mark.parametrize("d", [59, 128, 256, 512])
def test_resume_matches_one_shot_bitwise(registry, rng, d):
    """A chunk at q_offset over a slot with spare capacity equals those rows of the one-shot run."""
    total, cap, split = 70, 96, 37
    q, k, v = qkv(rng, BF16, b=1, h=4, hkv=2, ql=total, kl=cap, d=d)
    full = fm.flash_attn_prefill(q, k[:, :, :total], v[:, :, :total], causal=True, registry=registry)
    chunk = fm.flash_attn_prefill(q[:, :, split:], k, v, causal=True, q_offset=split, kv_len=total,
                                  registry=registry)
    assert_bits_equal(chunk, full[:, :, split:], f"resume d={d}")
    first = fm.flash_attn_prefill(q[:, :, :split], k, v, causal=True, q_offset=0, kv_len=split,
                                  registry=registry)
    assert_bits_equal(first, full[:, :, :split], f"first chunk d={d}")


@pytest.mark.parametrize("d", [59, 64, 128, 512])
def test_seq_major_equals_head_major(registry, rng, d):
    q, k, v = qkv(rng, F16, b=2, h=4, hkv=2, ql=24, kl=40, d=d)
    bh = fm.flash_attn_prefill(q, k, v, causal=True, q_offset=16, registry=registry)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    bl = fm.flash_attn_prefill(t(q), t(k), t(v), causal=True, q_offset=16, layout="blhd", registry=registry)
    assert_bits_equal(t(bh), bl, f"layouts d={d}")


def test_seq_major_with_capacity(registry, rng):
    q, k, v = qkv(rng, BF16, b=1, h=4, hkv=2, ql=8, kl=32, d=64)
    t = lambda x: np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    out = fm.flash_attn_prefill(t(q), t(k), t(v), causal=True, q_offset=12, kv_len=20, layout="blhd",
                                registry=registry)
    exp = reference.attention(q, k[:, :, :20], v[:, :, :20], causal=True, q_offset=12)
    assert_close(t(out), exp, BF16, "seq-major capacity")


@pytest.mark.parametrize("d,dtype,mask", [(40, BF16, "additive4"), (59, BF16, "bool"), (59, F16, "additive2"),
                                          (111, BF16, "none"), (111, np.dtype(np.float32), "none")])
def test_head_dim_off_the_vector(registry, rng, d, dtype, mask):
    """Head dims that are not a multiple of 16 over several key blocks (the last partial), query rows
    spanning several work items, GQA 2:1, causal with an offset; inputs untouched, two runs bit-equal."""
    q, k, v = qkv(rng, dtype, b=1, h=4, hkv=2, ql=70, kl=150, d=d)
    copies = [x.copy() for x in (q, k, v)]
    m = make_mask(rng, mask, 1, 4, 70, 150, dtype)
    out = fm.flash_attn_prefill(q, k, v, mask=m, causal=True, q_offset=80, registry=registry)
    exp = reference.attention(q, k, v, causal=True, q_offset=80, mask=m)
    assert_close(out, exp, dtype, f"{registry.backend} d={d} {dtype} mask={mask}")
    again = fm.flash_attn_prefill(q, k, v, mask=m, causal=True, q_offset=80, registry=registry)
    assert_bits_equal(again, out, f"two runs d={d}")
    for a, c in zip((q, k, v), copies):
        assert_bits_equal(a, c, "input modified")


def test_deterministic(registry, rng):
    q, k, v = qkv(rng, BF16, b=1, h=4, hkv=2, ql=45, kl=70, d=128)
    a = fm.flash_attn_prefill(q, k, v, causal=True, q_offset=25, registry=registry)
    b = fm.flash_attn_prefill(q, k, v, causal=True, q_offset=25, registry=registry)
    assert_bits_equal(a, b, "two runs")


def test_out_is_filled_in_place_and_inputs_untouched(registry, rng):
    q, k, v = qkv(rng, BF16, b=1, h=2, hkv=2, ql=16, kl=16, d=64)
    copies = [x.copy() for x in (q, k, v)]
    out = np.full(q.shape, 7, dtype=BF16)
    res = fm.flash_attn_prefill(q, k, v, out=out, registry=registry)
    assert res is out
    assert_close(out, reference.attention(q, k, v), BF16, "out=")
    for a, c in zip((q, k, v), copies):
        assert_bits_equal(a, c, "input modified")


def test_non_contiguous_inputs(registry, rng):
    q4 = randn(rng, (1, 2, 64, 16), BF16).transpose(0, 1, 3, 2)  # [1, 2, 16, 64] strided
    k4 = randn(rng, (1, 2, 64, 16), BF16).transpose(0, 1, 3, 2)
    v4 = randn(rng, (1, 2, 16, 64), BF16)
    assert not q4.flags.c_contiguous
    out = fm.flash_attn_prefill(q4, k4, v4, registry=registry)
    assert_close(out, reference.attention(q4, k4, v4), BF16, "strided inputs")
