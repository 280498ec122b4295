"""scaled_dot_product_attention with align="bottom_right" (the KV-cache convention): each route,
the same semantics whichever kernel runs. torch's own conventions: test_dropin.py."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from flashmetal._native import constant
import numerics
from numerics import BF16, F16, F32, assert_close, randn

SHORT_QUERY_ROWS = constant("FM_SHORT_QUERY_ROWS")  # the most rows of a short query (flashmetal.h)


def SDPA(*args, return_kernel=False, **kwargs):
    """The front door with the KV-cache alignment, and the route that ran."""
    kwargs.setdefault("align", "bottom_right")
    kwargs.setdefault("enable_gqa", True)
    out = fm.scaled_dot_product_attention(*args, **kwargs)
    return (out, fm.last_route().kernel) if return_kernel else out


qkv = functools.partial(numerics.qkv, h=4, kl=40)


def expect(q, k, v, kl, *, causal, window=None, mask=None, softcap=0.0, scale=None):
    ql = q.shape[2]
    return reference.attention(q, k[:, :, :kl], v[:, :, :kl], causal=causal, q_offset=kl - ql, window=window,
                               mask=mask, softcap=softcap, scale=scale)


def tol(dtype, route):
    return F16 if route == "flash_attn_decode" and dtype == F32 else dtype


@pytest.mark.parametrize("dtype,ql,route", [
    (BF16, 6, "flash_attn_prefill"), (F16, 6, "flash_attn_prefill"), (F32, 6, "flash_attn_prefill"),
    (F32, 1, "flash_attn_decode"), (BF16, 1, "flash_attn_decode"), (F16, 1, "flash_attn_decode"),
])
@pytest.mark.parametrize("causal", [False, True])
def test_routes(registry, rng, dtype, ql, route, causal):
    if ql <= SHORT_QUERY_ROWS:
        route = "flash_attn_decode"  # rows at the newest positions (bottom-right): the short-query decode
    q, k, v = qkv(rng, dtype, ql=ql)
    out, ran = SDPA(q, k, v, is_causal=causal, return_kernel=True, registry=registry)
    assert ran == route and ran in fm.attention.ROUTES
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, expect(q, k, v, 40, causal=causal), tol(dtype, route), f"{route} causal={causal}")
    assert isinstance(SDPA(q, k, v, is_causal=causal, registry=registry), np.ndarray)


@pytest.mark.parametrize("dtype,ql", [(BF16, 6), (F16, 40), (F32, 1), (BF16, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_window(registry, rng, dtype, ql, causal):
    q, k, v = qkv(rng, dtype, ql=ql, kl=70, d=128)
    out, ran = SDPA(q, k, v, is_causal=causal, window=9, kv_len=60, return_kernel=True, registry=registry)
    assert ran == ("flash_attn_decode" if ql <= SHORT_QUERY_ROWS else "flash_attn_prefill")
    assert_close(out, expect(q, k, v, 60, causal=causal, window=9), tol(dtype, ran), ran)


def test_same_semantics_across_routes(registry, rng):
    """The one-row decode route and the prefill route agree for the same problem."""
    q, k, v = qkv(rng, BF16, ql=3, kl=50, d=64)
    full = SDPA(q, k, v, is_causal=True, window=7, kv_len=45, softcap=3.0, registry=registry)
    last, ran = SDPA(q[:, :, 2:3], k, v, is_causal=True, window=7, kv_len=45, softcap=3.0,
                     return_kernel=True, registry=registry)
    assert ran == "flash_attn_decode"
    exp = expect(q, k, v, 45, causal=True, window=7, softcap=3.0)
    assert_close(full, exp, BF16, "prefill")
    assert_close(last, exp[:, :, 2:3], BF16, "vec")


@pytest.mark.parametrize("kind", ["additive2", "bool2", "additive4", "bool4"])
@pytest.mark.parametrize("causal", [False, True])
def test_f32_mask_and_window_take_prefill(registry, rng, kind, causal):
    """float32 with several rows: the tiled prefill applies attn_mask and window."""
    q, k, v = qkv(rng, F32, ql=8, kl=30)
    shape = (8, 24) if kind.endswith("2") else (1, 4, 8, 24)
    keep = rng.random(shape) < 0.7
    keep[..., 0] = True
    mask = keep if kind.startswith("bool") else np.where(keep, rng.uniform(-1, 1, shape), -np.inf).astype(F32)
    out, ran = SDPA(q, k, v, attn_mask=mask, is_causal=causal, window=11, kv_len=24, return_kernel=True,
                    registry=registry)
    assert ran == "flash_attn_prefill"
    assert_close(out, expect(q, k, v, 24, causal=causal, window=11, mask=mask), F32, f"prefill {kind}")


@pytest.mark.parametrize("kind", ["additive2", "bool4"])
def test_attn_mask_prefill(registry, rng, kind):
    q, k, v = qkv(rng, BF16, ql=8, kl=24)
    shape = (8, 24) if kind == "additive2" else (1, 4, 8, 24)
    keep = rng.random(shape) < 0.6
    keep[..., 0] = True
    m = keep if kind == "bool4" else np.where(keep, rng.uniform(-1, 1, shape), -np.inf).astype(BF16)
    for window in (None, 5):
        out, ran = SDPA(q, k, v, attn_mask=m, window=window, return_kernel=True, registry=registry)
        assert ran == "flash_attn_prefill"
        assert_close(out, expect(q, k, v, 24, causal=False, window=window, mask=m), BF16, f"{kind} w={window}")


def test_one_row_with_mask_takes_prefill(registry, rng):
    q, k, v = qkv(rng, F16, ql=1, kl=24)
    m = np.zeros((1, 24), F16)
    m[0, 3:9] = -np.inf
    out, ran = SDPA(q, k, v, attn_mask=m, return_kernel=True, registry=registry)
    assert ran == "flash_attn_prefill"
    assert_close(out, expect(q, k, v, 24, causal=False, mask=m), F16)


def test_scale_softcap_prefill(registry, rng):
    q, k, v = qkv(rng, BF16, ql=5, kl=30, d=128)
    s = 4 / math.sqrt(128)
    out = SDPA(q, k, v, is_causal=True, scale=s, softcap=2.0, registry=registry)
    assert_close(out, expect(q, k, v, 30, causal=True, scale=s, softcap=2.0), BF16)


@pytest.mark.parametrize("d,kernel", [(300, "flash_attn_decode"), (520, "sdpa")])
def test_f32_one_row_decodes_up_to_512_and_takes_sdpa_above(registry, rng, d, kernel):
    """D = 300 runs the decode kernel's 512 tile with the true D; D = 520 is
    above every decode tile but MLA's 576 (which needs v of 512): sdpa."""
    q, k, v = qkv(rng, F32, ql=1, kl=20, d=d)
    out, ran = SDPA(q, k, v, is_causal=True, return_kernel=True, registry=registry)
    assert ran == kernel
    assert_close(out, expect(q, k, v, 20, causal=True), F32)


def Z(shape, dt=BF16):
    return np.zeros(shape, dt)


@pytest.mark.parametrize("args,kwargs,exc,msg", [
    ((Z((1, 2, 4, 64)), Z((1, 2, 8, 64), F16), Z((1, 2, 8, 64))), {}, TypeError,
     "key dtype float16 does not match query dtype bfloat16"),
    ((Z((1, 2, 4, 64), np.int32), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), {}, TypeError, "dtype int32 is not supported"),
    ((Z((64,)), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), {}, ValueError, r"query, key and value must all have rank 4"),
    ((Z((1, 2, 4, 64)), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), dict(kv_len=9), ValueError, r"kv_len must be in 1..8"),
    ((Z((1, 2, 4, 64)), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), dict(align="left"), ValueError,
     "align must be 'top_left' or 'bottom_right', got 'left'"),
    ((Z((1, 2, 4, 64)), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), dict(window=0), ValueError, "window must be > 0"),
    ((Z((1, 2, 4, 64)), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), dict(softcap=-1.0), ValueError, "softcap must be 0"),
    ((Z((1, 2, 4, 64)), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), dict(attn_mask=Z((4, 7))), ValueError,
     r"attn_mask shape \(4, 7\) does not broadcast to \[B, H, qL, kL\] = \[1, 2, 4, 8\]"),
    ((Z((1, 2, 4, 64)), Z((1, 2, 8, 64)), Z((1, 2, 8, 64))), dict(attn_mask=Z((4, 8), np.int32)), TypeError,
     "attn_mask must be bool .* or a float additive mask, got int32"),
    ((Z((1, 1, 1, 65537), F32), Z((1, 1, 2, 65537), F32), Z((1, 1, 2, 65537), F32)), {}, ValueError,
     "head dim 65537 is above 65536"),
])
def test_errors(registry, args, kwargs, exc, msg):
    with pytest.raises(exc, match=msg) as e:
        SDPA(*args, registry=registry, **kwargs)
    assert str(e.value).startswith("scaled_dot_product_attention: ")


def test_exports():
    from exports import exported_symbols
    from flashmetal import _loader
    syms = exported_symbols(_loader.library_path())
    mine = ["fm_blk_byte_len", "fm_alloc_blk", "fm_free_blk", "fm_dispatch_blk", "fm_build_mask",
            "fm_dispatch_vec", "fm_dispatch_sdpa"]
    assert not [s for s in mine if s not in syms]
    ffi, lib = _loader.load()
    for s in mine:
        assert getattr(lib, s) is not None


@pytest.mark.parametrize("dtype,d", [(F32, 640), (BF16, 1024), (F16, 520)])
def test_head_dims_above_512_take_the_general_kernel(registry, rng, dtype, d):
    """The front door finds a path for any head dim; above 512 the
    general kernel walks the output in column blocks."""
    q = randn(rng, (1, 2, 5, d), dtype)
    k = randn(rng, (1, 1, 7, d), dtype)
    v = randn(rng, (1, 1, 7, d), dtype)
    out = fm.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, registry=registry)
    assert fm.last_route().kernel == "sdpa"
    want = reference.attention(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), causal=True, q_offset=0)
    assert_close(out, want, dtype, f"D={d} {dtype}")
