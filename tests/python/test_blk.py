"""blk tile-skip pre-pass: classes cell-exact, sizing, alloc/free, bit identity."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from flashmetal._arrays import tensor
from numerics import BF16, F16, assert_bits_equal, assert_close, randn
from cabi import err_text

GEOMETRY = {64: (32, 16), 128: (32, 16), 256: (32, 16), 512: (8, 8)}


@pytest.mark.parametrize("d", [128, 512])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_causal_64x64(registry, d, dtype):
    m = fm.build_mask(64, 64, causal=True, dtype=dtype, registry=registry)
    blk = fm.build_blk(m, d, registry=registry)
    want = reference.blk_classes(m, *GEOMETRY[d])
    assert blk.dtype == np.uint8 and blk.shape == want.shape
    assert np.array_equal(blk, want), f"\n{blk}\n!=\n{want}"
    assert set(np.unique(blk)) == {0, 1, 2}


@pytest.mark.parametrize("d", [256, 512])
def test_window_64_256x256(registry, d):
    m = fm.build_mask(256, 256, causal=True, window=64, registry=registry)
    blk = fm.build_blk(m, d, registry=registry)
    assert np.array_equal(blk, reference.blk_classes(m, *GEOMETRY[d]))


def test_edges_and_values(registry, rng):
    # unaligned qL and kL: partial right-edge K tiles are 1; the last Q tile has 3 rows
    m = fm.build_mask(35, 40, causal=True, q_offset=5, registry=registry)
    blk = fm.build_blk(m, 128, registry=registry)
    assert np.array_equal(blk, reference.blk_classes(m, 32, 16))
    assert np.all(blk[:, -1] == 1)
    # finite biases, -0.0 (== 0), very negative finite values and NaN
    a = np.zeros((32, 64), np.float32)
    a[:, 16:32] = -np.inf                    # all -inf: class 0 (a finite -1e31 tile is 1:
                                             # test_cpu_nonfinite, the rule that only -inf cells are skipped)
    a[:, 32:48] = -0.0                       # exactly 0: class 2
    a[5, 48] = 0.5                           # a finite bias: class 1
    a[0:16, 0:16] = -np.inf
    a[16, 3] = np.nan                        # NaN: mixed, never skipped
    m = a.astype(BF16)
    blk = fm.build_blk(m, 64, registry=registry)
    assert np.array_equal(blk, [[1, 0, 2, 1]])
    assert np.array_equal(blk, reference.blk_classes(m, 32, 16))


def test_last_q_tile_reads_only_existing_rows(registry):
    # qL = 33 with BQ = 32: tile row 1 has one row; it is all zero -> 2
    m = np.zeros((33, 32), BF16)
    m[:32, :] = -np.inf
    blk = fm.build_blk(m, 128, registry=registry)
    assert np.array_equal(blk, [[0, 0], [2, 2]])


@pytest.mark.parametrize("ql,kl,d,want", [
    (1, 1, 256, 32), (64, 64, 128, 32), (2455, 2455, 256, 11872), (2455, 2455, 512, 94272),
    (33, 17, 512, 32), (256, 256, 64, 128), (1000, 1000, 512, 15648), (1000, 1000, 576, 15648),
])
def test_byte_len(cpu, ql, kl, d, want):
    assert fm.blk_byte_len(ql, kl, d, registry=cpu) == want


@pytest.mark.parametrize("args,msg", [
    ((0, 8, 128), "q_len must be > 0"), ((8, 0, 128), "kv_len must be > 0"),
    ((8, 8, 600), "head_dim must be in 1...512 or 576, got 600"),
    ((2**31, 8, 128), "must fit in int32"),
])
def test_byte_len_errors(cpu, args, msg):
    with pytest.raises(ValueError, match=msg) as e:
        fm.blk_byte_len(*args, registry=cpu)
    assert str(e.value).startswith("blk_byte_len: ")


def test_alloc_and_free(cpu):
    ffi, lib = cpu._ffi, cpu._lib
    err = ffi.new("FMError *")
    t = ffi.new("FMTensor *")
    assert lib.fm_alloc_blk(100, 70, 512, t, err) == 0, err_text(err)
    assert (t.ndim, t.shape[0], t.shape[1], t.dtype, t.nbytes) == (2, 13, 9, 4, 128)
    assert bytes(ffi.buffer(t.data, t.nbytes)) == bytes(128)
    m = fm.build_mask(100, 70, causal=True, q_offset=0, registry=cpu)
    cpu._call("fm_dispatch_blk", tensor(ffi, m), t, 512)
    got = np.frombuffer(ffi.buffer(t.data, 13 * 9), np.uint8).reshape(13, 9)
    assert np.array_equal(got, reference.blk_classes(m, 8, 8))
    data = t.data
    assert lib.fm_free_blk(t, err) == 0
    assert t.data == ffi.NULL and t.nbytes == 0
    assert lib.fm_free_blk(t, err) == 0  # NULL data: nothing to free
    t.data = data  # double free is refused, not performed
    assert lib.fm_free_blk(t, err) == 1
    assert b"free_blk: " in err_text(err) and b"is not a live buffer from fm_alloc_blk" in err_text(err)
    own = np.zeros(32, np.uint8)
    t.data = ffi.cast("void *", own.ctypes.data)
    assert lib.fm_free_blk(t, err) == 1
    assert lib.fm_free_blk(ffi.NULL, err) == 1 and b"free_blk: blk is null" in err_text(err)
    assert lib.fm_alloc_blk(0, 70, 512, t, err) == 1 and b"q_len must be > 0" in err_text(err)
    assert lib.fm_alloc_blk(4, 4, 512, ffi.NULL, err) == 1 and b"alloc_blk: out is null" in err_text(err)
    assert lib.fm_blk_byte_len(4, 4, 512, ffi.NULL, err) == 1


def test_dispatch_errors(registry):
    m = fm.build_mask(64, 64, causal=True, registry=registry)
    with pytest.raises(TypeError, match="build_blk: mask dtype int32 is not supported"):
        fm.build_blk(m.astype(np.int32), 128, registry=registry)
    with pytest.raises(ValueError, match="build_blk: mask must have rank 2"):
        fm.build_blk(m[None], 128, registry=registry)
    with pytest.raises(ValueError, match=r"head_dim must be in 1\.\.\.512 or 576, got 600"):
        fm.build_blk(m, 600, registry=registry)
    ffi = registry._ffi
    small = np.zeros(7, np.uint8)
    with pytest.raises(ValueError, match=r"flash_attn_prefill_blk: blk_out buffer too small: expected at least 8 bytes"):
        registry._call("fm_dispatch_blk", tensor(ffi, m), tensor(ffi, small), 128)
    with pytest.raises(TypeError, match="flash_attn_prefill_blk: blk_out must be uint8"):
        registry._call("fm_dispatch_blk", tensor(ffi, m), tensor(ffi, np.zeros(8, np.float32)), 128)
    with pytest.raises(ValueError, match="flash_attn_prefill_blk: mask is null"):
        registry._call("fm_dispatch_blk", ffi.NULL, tensor(ffi, small), 128)
    with pytest.raises(ValueError, match="flash_attn_prefill_blk: blk_out is null"):
        registry._call("fm_dispatch_blk", tensor(ffi, m), ffi.NULL, 128)


@pytest.mark.parametrize("d", [128, 256, 512])
@pytest.mark.parametrize("kind", ["causal", "window", "random"])
def test_blk_bit_identical_to_no_blk(registry, rng, d, kind):
    dtype = BF16 if d != 256 else F16
    ql, kl, h = 40, 72, 2
    q = randn(rng, (1, h, ql, d), dtype)
    k = randn(rng, (1, 1, kl, d), dtype)
    v = randn(rng, (1, 1, kl, d), dtype)
    off = kl - ql
    if kind == "causal":
        m = fm.build_mask(ql, kl, causal=True, q_offset=off, dtype=dtype, registry=registry)
    elif kind == "window":
        m = fm.build_mask(ql, kl, causal=True, q_offset=off, window=20, dtype=dtype, registry=registry)
    else:
        keep = rng.random((ql, kl)) < 0.5
        keep[:, 16:32] = True
        keep[:, 48:64] = False
        keep[:, 0] = True
        m = np.where(keep, 0.0, -np.inf).astype(dtype)
    blk = fm.build_blk(m, d, registry=registry)
    assert np.array_equal(blk, reference.blk_classes(m, *GEOMETRY[d]))
    a = fm.flash_attn_prefill(q, k, v, mask=m, q_offset=off, registry=registry)
    b = fm.flash_attn_prefill(q, k, v, mask=m, q_offset=off, blk=blk, registry=registry)
    assert_bits_equal(a, b, f"{kind} d={d}")
    assert_close(b, reference.attention(q, k, v, mask=m), dtype, f"{kind} d={d}")
