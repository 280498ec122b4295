"""The tiled prefill kernel with float32 I/O, on every backend (sim and
metal-sim run the Metal kernel; cpu its twin), against the float64 reference
at float32's tolerance: every head dim it has (its threadgroup tiles differ
from the two-byte kernel's at D 192; D 256 and 512 run the kernel that splits
the head dim between simdgroups), padded head dims and v of its own head dim,
each feature of the bf16 path
(causal with an offset, window, softcap, additive and bool masks, GQA, blk,
sinks, LSE, ALiBi, varlen, paged), and the routes that now take it (the
drop-in, the serving API). Shapes are small and leave partial query and key
tiles: the sim costs milliseconds per tile."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import F32, assert_bits_equal, assert_close, randn

DIMS = fm.supported_head_dims("flash_attn_prefill_f32")


def test_head_dims():
    """Every two-byte head dim (D 256 and 512 on the kernel that splits the head dim)."""
    assert DIMS == fm.supported_head_dims("flash_attn_prefill")
    assert DIMS == (64, 80, 96, 128, 192, 256, 512)


def check_lse(lse, exp_lse, what):
    finite = np.isfinite(exp_lse)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: lse -inf rows differ"
    assert np.allclose(lse[finite], exp_lse[finite], atol=1e-5, rtol=1e-5), f"{what}: lse"


FEATURES = ["plain", "causal_offset", "softcap", "additive_mask", "bool_mask", "gqa", "window", "kv_len"]


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("d", DIMS)
def test_prefill(registry, rng, d, feature):
    """flash_attn_prefill, 37 query rows over 45 keys (partial tiles)."""
    b, h, hkv, ql, kl = 1, 2, 2, 37, 45
    if feature == "gqa":
        h, hkv = 4, 1
    cap = 48 if feature == "kv_len" else kl
    q = randn(rng, (b, h, ql, d), F32)
    k, v = randn(rng, (b, hkv, cap, d), F32), randn(rng, (b, hkv, cap, d), F32)
    kw: dict = {}
    ref: dict = {}
    if feature == "causal_offset":
        kw = {"causal": True, "q_offset": 5}
        ref = {"causal": True, "q_offset": 5}
    elif feature == "softcap":
        kw = {"softcap": 3.0}
        ref = {"softcap": 3.0}
    elif feature == "additive_mask":
        m = (rng.standard_normal((ql, kl)) * 2).astype(F32)
        m[rng.random((ql, kl)) < 0.3] = -np.inf
        m[3] = -np.inf  # a row that sees nothing: zeros
        kw = {"mask": m}
        ref = {"mask": m}
    elif feature == "bool_mask":
        keep = rng.random((b, h, ql, kl)) < 0.6
        kw = {"mask": keep}
        ref = {"mask": keep}
    elif feature == "window":
        kw = {"causal": True, "window": 9, "q_offset": kl - ql}
        ref = {"causal": True, "window": 9, "q_offset": kl - ql}
    elif feature == "kv_len":
        kw = {"kv_len": kl, "causal": True}
        ref = {"causal": True, "q_offset": kl - ql}
    out = fm.flash_attn_prefill(q, k, v, registry=registry, **kw)
    assert out.dtype == F32
    exp = reference.attention(q, k[:, :, :kl], v[:, :, :kl], **ref)
    assert_close(out, exp, F32, f"{registry.backend} f32 prefill D={d} {feature}")


@pytest.mark.parametrize("d", [64, 192, 256, 512])
def test_blk(registry, rng, d):
    """A float32 mask's blk (explicit, and the automatic pre-pass) leaves the
    output bit-identical: at D 192 each kernel tile lies inside one blk tile
    of the head dim's tile-skip geometry, at 256 it is one, at 512 it covers
    four (their classes combine)."""
    h, ql, kl = 2, 70, 80
    q = randn(rng, (1, h, ql, d), F32)
    k, v = randn(rng, (1, h, kl, d), F32), randn(rng, (1, h, kl, d), F32)
    m = np.zeros((ql, kl), F32)
    m[:, 40:] = -np.inf           # whole masked key tiles: skipped
    m[20:40, :16] = -np.inf
    m[50:, 10:20] = 0.5           # a finite bias: mixed tiles
    blk = fm.build_blk(m, d, registry=registry)
    assert set(np.unique(blk).tolist()) == {0, 1, 2}
    full = np.ascontiguousarray(np.broadcast_to(m, (1, h, ql, kl)))  # no auto-blk for a per-head mask
    plain = fm.flash_attn_prefill(q, k, v, mask=full, registry=registry)
    explicit = fm.flash_attn_prefill(q, k, v, mask=m, blk=blk, registry=registry)
    auto = fm.flash_attn_prefill(q, k, v, mask=m, registry=registry)
    assert_close(plain, reference.attention(q, k, v, mask=m), F32, f"{registry.backend} D={d} mask")
    assert_bits_equal(explicit, plain, f"{registry.backend} D={d} explicit blk")
    assert_bits_equal(auto, plain, f"{registry.backend} D={d} auto blk")


@pytest.mark.parametrize("d", [64, 256, 512])
def test_sinks(registry, rng, d):
    h, ql, kl = 2, 19, 30
    q = randn(rng, (1, h, ql, d), F32)
    k, v = randn(rng, (1, h, kl, d), F32), randn(rng, (1, h, kl, d), F32)
    sinks = rng.standard_normal(h).astype(F32)
    out = fm.flash_attn_prefill(q, k, v, causal=True, sinks=sinks, registry=registry)
    exp, _ = reference.flash_attn(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                                  causal=True, sinks=sinks)
    assert_close(out, exp.transpose(0, 2, 1, 3), F32, f"{registry.backend} f32 sinks D={d}")


@pytest.mark.parametrize("d", [64, 192, 256, 512])
@pytest.mark.parametrize("feature", ["causal_sinks_softcap", "window", "alibi"])
def test_flash_attn_func(registry, rng, d, feature):
    """The serving prefill (per-sequence mode) with float32 q/k/v, LSE on."""
    b, ql, kl, h, hkv = 2, 21, 33, 4, 2
    q = randn(rng, (b, ql, h, d), F32)
    k, v = randn(rng, (b, kl, hkv, d), F32), randn(rng, (b, kl, hkv, d), F32)
    kw: dict = {}
    if feature == "causal_sinks_softcap":
        kw = {"causal": True, "softcap": 2.5, "sinks": rng.standard_normal(h).astype(F32)}
    elif feature == "window":
        kw = {"window_size": (6, 2)}
    else:
        kw = {"causal": True, "alibi_slopes": rng.random(h).astype(F32)}
    out, lse, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry, **kw)
    eo, el = reference.flash_attn(q, k, v, **kw)
    assert out.dtype == F32
    assert_close(out, eo, F32, f"{registry.backend} f32 flash_attn_func D={d} {feature}")
    check_lse(lse, el, f"{registry.backend} D={d} {feature}")


@pytest.mark.parametrize("d", [64, 256, 512])
def test_varlen(registry, rng, d):
    h, hkv = 2, 1
    cu_q, cu_k = np.array([0, 3, 20]), np.array([0, 17, 57])
    q = randn(rng, (20, h, d), F32)
    k, v = randn(rng, (57, hkv, d), F32), randn(rng, (57, hkv, d), F32)
    out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 40, causal=True, window_size=(7, -1),
                                            return_attn_probs=True, registry=registry)
    eo, el = reference.flash_attn_varlen(q, k, v, cu_q, cu_k, causal=True, window_size=(7, -1))
    assert_close(out, eo, F32, f"{registry.backend} f32 varlen D={d}")
    check_lse(lse, el, f"{registry.backend} varlen D={d}")


@pytest.mark.parametrize("d,page", [(96, 16), (256, 16), (512, 16), (256, 12), (512, 12)])
def test_paged_kvcache(registry, rng, d, page):
    """K/V through a shuffled block table, per-sequence cache lengths: pages
    of 16 hold whole key tiles (16 keys at D 256, 8 at 512), pages of 12
    split them (each key through its own page)."""
    h, hkv, ql = 2, 1, 5
    lens = np.array([17, 40]) if page == 16 else np.array([17, 30])
    table = np.array([[4, 0, -1], [2, 5, 1]])
    kc, vc = randn(rng, (6, page, hkv, d), F32), randn(rng, (6, page, hkv, d), F32)
    q = randn(rng, (2, ql, h, d), F32)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True,
                                          return_softmax_lse=True, registry=registry)
    eo, el = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, causal=True)
    assert_close(out, eo, F32, f"{registry.backend} f32 paged D={d}")
    check_lse(lse, el, f"{registry.backend} paged D={d}")


@pytest.mark.parametrize("d,qlen,kernel", [(128, 24, "flash_attn_prefill"), (48, 40, "flash_attn_prefill"),
                                           (48, 8, "flash_attn_prefill"), (512, 9, "flash_attn_prefill"),
                                           (300, 40, "flash_attn_prefill"), (300, 8, "flash_attn_prefill"),
                                           (520, 8, "sdpa")])
def test_dropin_route(registry, rng, d, qlen, kernel):
    """The drop-in takes the tiled kernel for float32 at any D up to 512 (48
    on the 64 tile, 300 on the 512 one, whatever the row count); above it
    the general kernel."""
    q = randn(rng, (1, 2, qlen, d), F32)
    k, v = randn(rng, (1, 2, 40, d), F32), randn(rng, (1, 2, 40, d), F32)
    keep = rng.random((1, 1, qlen, 40)) < 0.8
    assert fm.explain(q, k, v, keep, is_causal=False).kernel == kernel
    out = fm.scaled_dot_product_attention(q, k, v, keep, registry=registry)
    assert fm.last_route().kernel == kernel
    assert_close(out, reference.attention(q, k, v, mask=keep), F32, f"{registry.backend} drop-in D={d}")


@pytest.mark.parametrize("d,dv", [(200, 200), (250, 250), (256, 192), (160, 256), (254, 250), (252, 251)])
def test_padded_and_value_head_dims(registry, rng, d, dv):
    """Head dims below the 256 tile (columns past D read as zeros and are not
    stored, runs cut at D: 250 is whole 8-byte runs, not 16), and v of its
    own head dim (Q/K stop at D, V and the output at Dv), causal with
    partial tiles."""
    q = randn(rng, (1, 2, 37, d), F32)
    k, v = randn(rng, (1, 2, 45, d), F32), randn(rng, (1, 2, 45, dv), F32)
    out = fm.flash_attn_prefill(q, k, v, causal=True, q_offset=8, registry=registry)
    assert out.shape == (1, 2, 37, dv)
    exp = reference.attention(q, k, v, causal=True, q_offset=8)
    assert_close(out, exp, F32, f"{registry.backend} f32 prefill D={d} Dv={dv}")


def test_d600_refused_by_prefill(rng):
    q = randn(rng, (1, 1, 8, 600), F32)
    with pytest.raises(ValueError, match=r"flash_attn_prefill.*head_dim of float32 I/O must be in 1\.\.\.512, "
                                         r"got 600"):
        fm.flash_attn_prefill(q, q, q, registry="cpu")
