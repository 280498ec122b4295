"""Mask builder: cell by cell against the definition, bit patterns, errors."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16
from cabi import err_text

NEG_INF_BITS = {BF16: 0xFF80, F16: 0xFC00}


def check(registry, ql, kl, dtype=BF16, **kw):
    kw.setdefault("causal", True)
    m = fm.build_mask(ql, kl, dtype=dtype, registry=registry, **kw)
    assert m.shape == (ql, kl) and m.dtype == dtype
    vis = reference.visible(ql, kl, causal=kw["causal"], q_offset=kw.get("q_offset", 0),
                            window=kw.get("window"))
    bits = m.view(np.uint16)
    want = np.where(vis, 0, NEG_INF_BITS[np.dtype(dtype)]).astype(np.uint16)
    bad = np.argwhere(bits != want)
    assert bad.size == 0, f"cells differ at {bad[:5].tolist()}"
    return m


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_causal_8x8(registry, dtype):
    m = check(registry, 8, 8, dtype)
    assert np.array_equal(np.isfinite(m.astype(np.float32)), np.tril(np.ones((8, 8), bool)))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_window_4_on_16x16(registry, dtype):
    m = check(registry, 16, 16, dtype, window=4)
    vis = np.isfinite(m.astype(np.float32))
    for i in range(16):
        for p in range(16):
            assert vis[i, p] == (p <= i and i - p < 4), (i, p)


def test_q_offset(registry):
    check(registry, 5, 12, q_offset=7)
    check(registry, 5, 12, q_offset=3, window=3)
    check(registry, 4, 9, causal=False, window=2, q_offset=5)
    check(registry, 3, 7, causal=False)  # all zeros


def test_unaligned_and_wide(registry):
    check(registry, 3, 300, q_offset=290, window=100)
    check(registry, 33, 257, F16, q_offset=224)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(q_len=0, kv_len=4), ValueError, "q_len must be > 0"),
    (dict(q_len=4, kv_len=0), ValueError, "kv_len must be > 0"),
    (dict(q_len=4, kv_len=4, window=0), ValueError, "window must be > 0"),
    (dict(q_len=4, kv_len=4, window=-3), ValueError, "window must be > 0"),
    (dict(q_len=4, kv_len=4, q_offset=-1), ValueError, "q_offset must be in"),
    (dict(q_len=4, kv_len=4, q_offset=2**40), ValueError, "int32"),
    (dict(q_len=4, kv_len=4, dtype=np.float32), TypeError, "dtype must be bfloat16 or float16"),
])
def test_errors(registry, kwargs, exc, msg):
    with pytest.raises(exc, match=msg) as e:
        fm.build_mask(registry=registry, **kwargs)
    assert str(e.value).startswith("build_mask: ") and e.value.op == "build_mask"


def test_abi_errors(cpu):
    ffi, lib = cpu._ffi, cpu._lib
    err = ffi.new("FMError *")
    opts = ffi.new("FMMaskOptions *")
    assert lib.fm_build_mask(cpu._handle, ffi.NULL, opts, err) == 1
    assert b"flash_attn_prefill_mask: out is null" in err_text(err)
    out = np.empty((4, 4), np.float32)
    from flashmetal._arrays import tensor
    assert lib.fm_build_mask(cpu._handle, tensor(ffi, out), opts, err) == 2
    assert b"out must be bfloat16 or float16" in err_text(err)
    out = np.empty((4, 4), BF16)
    opts.causal = 2
    assert lib.fm_build_mask(cpu._handle, tensor(ffi, out), opts, err) == 1
    assert b"causal must be 0 or 1" in err_text(err)
    assert lib.fm_build_mask(cpu._handle, tensor(ffi, out), ffi.NULL, err) == 1
    assert b"options is null" in err_text(err)
    out3 = np.empty((2, 4, 4), BF16)
    opts.causal = 1
    assert lib.fm_build_mask(cpu._handle, tensor(ffi, out3), opts, err) == 1
    assert b"out must have rank 2" in err_text(err)
