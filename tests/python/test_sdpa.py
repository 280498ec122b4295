"""Simple SDPA (float32 / float16 / bfloat16) against the float64 reference, and its errors."""
from __future__ import annotations

import math

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F32, assert_bits_equal, assert_close, randn, wide_bool_bytes
from cabi import err_text


def run(registry, rng, *, b=1, h=2, hkv=2, ql=5, cap=40, kv_len=None, d=64, dtype=F32, causal=True,
        scale=None):
    q = randn(rng, (b, h, ql, d), dtype)
    k = randn(rng, (b, hkv, cap, d), dtype)
    v = randn(rng, (b, hkv, cap, d), dtype)
    out = fm.sdpa(q, k, v, causal=causal, scale=scale, kv_len=kv_len, registry=registry)
    assert out.dtype == dtype and out.shape == q.shape
    kl = cap if kv_len is None else kv_len
    exp = reference.attention(q, k[:, :, :kl], v[:, :, :kl], scale=scale, causal=causal, q_offset=kl - ql)
    assert_close(out, exp, dtype, f"{registry.backend} {dtype} d={d} ql={ql} kl={kl} causal={causal}")
    return q, k, v, out


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [8, 64, 100, 512])
def test_matrix(registry, rng, dtype, causal, d):
    run(registry, rng, dtype=dtype, causal=causal, d=d)


@pytest.mark.parametrize("ql,cap", [(1, 1), (1, 33), (7, 40), (33, 70), (40, 40), (64, 64)])
def test_qL_lt_kL_causal_bottom_right(registry, rng, ql, cap):
    run(registry, rng, ql=ql, cap=cap, causal=True)


def test_qL_gt_kL_causal_rows_before_key0_are_zero(registry, rng):
    q, k, v, out = run(registry, rng, ql=10, cap=6, causal=True)
    assert np.all(out[:, :, :4] == 0)


def test_gqa_and_batch(registry, rng):
    run(registry, rng, b=2, h=8, hkv=2, ql=9, cap=30, dtype=BF16)


def test_kv_capacity(registry, rng):
    q, k, v, out = run(registry, rng, ql=4, cap=50, kv_len=20)
    k2 = k.copy()
    k2[:, :, 20:] = np.nan
    assert_bits_equal(out, fm.sdpa(q, k2, v, kv_len=20, causal=True, registry=registry), "slots past kv_len are never read")


def test_scales(registry, rng):
    run(registry, rng, d=64, scale=4 / math.sqrt(64))
    run(registry, rng, d=64, scale=0.01, dtype=BF16)


def test_determinism(registry, rng):
    q, k, v, out = run(registry, rng, ql=40, cap=60)
    assert_bits_equal(out, fm.sdpa(q, k, v, causal=True, registry=registry), "two runs")


def z(shape, dt=F32):
    return np.zeros(shape, dt)


@pytest.mark.parametrize("args,kwargs,exc,msg", [
    ((z((1, 2, 4, 8)), z((1, 2, 4, 8), BF16), z((1, 2, 4, 8))), {}, TypeError,
     "sdpa: k dtype bfloat16 does not match q dtype float32"),
    ((z((1, 2, 4, 8), BF16), z((1, 2, 4, 8), BF16), z((1, 2, 4, 8))), {}, TypeError,
     "sdpa: v dtype float32 does not match q dtype bfloat16"),
    ((z((1, 2, 4, 8)), z((1, 2, 4, 8)), z((1, 2, 4, 8))), dict(out=z((1, 2, 4, 8), BF16)), TypeError,
     "sdpa: out dtype"),
    ((z((1, 2, 4, 8), np.int32), z((1, 2, 4, 8), np.int32), z((1, 2, 4, 8), np.int32)), {}, TypeError,
     "dtype int32 is not supported"),
    ((z((1, 1, 1, 65537)), z((1, 1, 1, 65537)), z((1, 1, 1, 65537))), {}, ValueError,
     "sdpa: head_dim must be <= 65536, got 65537"),
    ((z((1, 2, 4, 0)), z((1, 2, 4, 0)), z((1, 2, 4, 0))), {}, ValueError, "sdpa: head_dim must be > 0"),
    ((z((1, 3, 4, 8)), z((1, 2, 4, 8)), z((1, 2, 4, 8))), {}, ValueError,
     r"sdpa: the q heads \(3\) must be a multiple of the k heads \(2\)"),
    ((z((1, 2, 4, 8)), z((1, 2, 4, 8)), z((1, 2, 4, 8))), dict(kv_len=5), ValueError,
     r"sdpa: kv_len \(5\) must be <= the cache capacity \(4\)"),
    ((z((1, 2, 4, 8)), z((1, 2, 4, 8)), z((1, 2, 4, 8))), dict(kv_len=0), ValueError, "sdpa: kv_len must be > 0"),
    ((z((1, 2, 4, 8)), z((1, 2, 4, 8)), z((1, 2, 3, 8))), {}, ValueError, "sdpa: v shape"),
    ((z((1, 2, 4, 8)), z((2, 2, 4, 8)), z((2, 2, 4, 8))), {}, ValueError, r"sdpa: k batch \(2\) must equal q batch \(1\)"),
    ((z((1, 2, 4, 8)), z((1, 2, 4, 4)), z((1, 2, 4, 4))), {}, ValueError, r"sdpa: k head_dim \(4\) must equal q head_dim \(8\)"),
    ((z((2, 4, 8)), z((1, 2, 4, 8)), z((1, 2, 4, 8))), {}, ValueError, "sdpa: q must have rank 4"),
    ((z((1, 2, 4, 8)), z((2, 4, 8)), z((2, 4, 8))), {}, ValueError, "sdpa: k must have rank 4"),
    ((z((1, 2, 4, 8)), z((1, 2, 4, 8)), z((1, 2, 4, 8))), dict(scale=float("inf")), ValueError,
     "sdpa: scale must be finite"),
])
def test_errors(registry, args, kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        fm.sdpa(*args, registry=registry, **kwargs)


def test_abi_errors(cpu):
    from flashmetal._arrays import tensor
    ffi, lib = cpu._ffi, cpu._lib
    err = ffi.new("FMError *")
    a = z((1, 1, 4, 8))
    t = tensor(ffi, a)
    o = tensor(ffi, z((1, 1, 4, 8)))
    opts = ffi.new("FMSdpaOptions *")
    opts.scale, opts.causal = 1.0, 3
    assert lib.fm_dispatch_sdpa(cpu._handle, t, t, t, ffi.NULL, o, opts, err) == 1
    assert b"sdpa: causal must be 0 or 1, got 3" in err_text(err)
    opts.causal, opts.kv_len = 1, -2
    assert lib.fm_dispatch_sdpa(cpu._handle, t, t, t, ffi.NULL, o, opts, err) == 1
    assert b"sdpa: kv_len must be >= 0" in err_text(err)
    assert lib.fm_dispatch_sdpa(cpu._handle, t, t, t, ffi.NULL, ffi.NULL, opts, err) == 1
    assert b"sdpa: out is null" in err_text(err)
    assert lib.fm_dispatch_sdpa(ffi.NULL, t, t, t, ffi.NULL, o, opts, err) == 1
    assert b"sdpa: registry is null" in err_text(err)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("kind", ["additive2", "additive4", "bool2", "bool4"])
def test_mask(registry, rng, dtype, kind):
    """An optional mask, on a GQA batch with spare capacity."""
    b, h, hkv, ql, cap, kl, d = 2, 4, 2, 37, 50, 45, 64
    q, k, v = randn(rng, (b, h, ql, d), dtype), randn(rng, (b, hkv, cap, d), dtype), randn(rng, (b, hkv, cap, d), dtype)
    shape = (ql, kl) if kind.endswith("2") else (b, h, ql, kl)
    keep = rng.random(shape) < 0.6
    keep[..., :3] = True
    keep[..., 5, :] = False  # one row sees nothing: exact zeros
    mask = keep if kind.startswith("bool") else np.where(keep, rng.uniform(-2, 1, shape), -np.inf).astype(dtype)
    out = fm.sdpa(q, k, v, mask=mask, causal=True, kv_len=kl, registry=registry)
    exp = reference.attention(q, k[:, :, :kl], v[:, :, :kl], causal=True, q_offset=kl - ql, mask=mask)
    assert_close(out, exp, dtype, f"sdpa mask {kind}")
    assert np.all(out[:, :, 5].astype(np.float32) == 0)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_bool_mask_reads_any_nonzero_byte_as_true(registry, rng, dtype):
    """Bool mask bytes 2, 7, 128, 255 attend like 1 (a C caller's buffer may
    hold them): bit-identical to the 0/1 mask, and the reference."""
    b, h, ql, kl, d = 2, 2, 9, 21, 48
    q, k, v = randn(rng, (b, h, ql, d), dtype), randn(rng, (b, h, kl, d), dtype), randn(rng, (b, h, kl, d), dtype)
    keep = rng.random((b, h, ql, kl)) < 0.6
    keep[..., 0] = True
    out = fm.sdpa(q, k, v, mask=wide_bool_bytes(rng, keep), registry=registry)
    assert_bits_equal(out, fm.sdpa(q, k, v, mask=keep, registry=registry), "bytes > 1 vs 0/1")
    assert_close(out, reference.attention(q, k, v, mask=keep), dtype, f"{registry.backend} sdpa wide bool mask")


def test_mask_errors(cpu, rng):
    q = randn(rng, (1, 2, 4, 8), F32)
    with pytest.raises(TypeError, match="^sdpa: mask must be float32 \\(additive\\) or bool, got float16"):
        fm.sdpa(q, q, q, mask=np.zeros((4, 4), np.float16), registry=cpu)
    with pytest.raises(ValueError, match="^sdpa: mask shape \\[4, 3\\] must be \\[4, 4\\]"):
        fm.sdpa(q, q, q, mask=np.zeros((4, 3), np.float32), registry=cpu)
    with pytest.raises(ValueError, match="^sdpa: mask must have rank 2 or 3 or 4"):
        fm.sdpa(q, q, q, mask=np.zeros((4,), np.float32), registry=cpu)
