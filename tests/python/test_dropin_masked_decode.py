"""A single-query (decode) step with an attn_mask on the drop-in: when the
mask keeps one contiguous key range per batch row, the same for every head
(left padding, a sliding window, causal), it runs the split-KV decode kernel
over per-row key ranges; a mask with a hole, a finite bias or heads that
differ takes the general route. Numerics against the float64 reference on
every backend, and the route taken (last_route / explain)."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from flashmetal.attention import explain, key_ranges, last_route
from numerics import BF16, F16, F32, assert_close, randn

B, H, HKV, CAP, D = 3, 4, 2, 40, 64


def _qkv(rng, dtype, hkv=HKV, cap=CAP):
    return randn(rng, (B, H, 1, D), dtype), randn(rng, (B, hkv, cap, D), dtype), randn(rng, (B, hkv, cap, D), dtype)


def _padding(kl, pads, *, window=None):
    """bool [B, 1, 1, kl]: row b sees keys pads[b] .. kl - 1 (left padding),
    the last `window` of them with a window."""
    m = np.zeros((len(pads), 1, 1, kl), dtype=bool)
    for b, p in enumerate(pads):
        lo = p if window is None else max(p, kl - window)
        m[b, 0, 0, lo:] = True
    return m


MASKS = {
    "left_padding": lambda kl: _padding(kl, [0, 5, 17]),
    "sliding_window": lambda kl: _padding(kl, [0, 0, 0], window=9),
    "padding_and_window": lambda kl: _padding(kl, [3, 30, 12], window=11),
    "additive": lambda kl: np.where(_padding(kl, [2, 0, 9]), 0.0, -np.inf).astype(np.float32),
    "every_head": lambda kl: np.repeat(_padding(kl, [4, 1, 0]), H, axis=1),
    "one_for_the_batch": lambda kl: _padding(kl, [6])[:1],
    "row_sees_nothing": lambda kl: _padding(kl, [0, kl, 3]),
}


@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("mask", MASKS)
def test_masked_decode_takes_the_decode_kernel(registry, rng, mask, dtype):
    q, k, v = _qkv(rng, dtype)
    kl = 37
    m = MASKS[mask](kl)
    if m.dtype != bool:
        m = m.astype(dtype)
    assert explain(q, k, v, m, enable_gqa=True, kv_len=kl).kernel == "flash_attn_decode"
    out = fm.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, kv_len=kl, registry=registry)
    assert last_route().kernel == "flash_attn_decode", last_route()
    expected = reference.attention(q, k[:, :, :kl], v[:, :, :kl], mask=m)
    assert_close(out, expected, dtype, f"{registry.backend} {mask} {dtype}")


@pytest.mark.parametrize("align,causal,window", [("top_left", True, None), ("bottom_right", True, None),
                                                 ("bottom_right", True, 6), ("bottom_right", False, 4)])
def test_mask_with_causal_and_window(registry, rng, align, causal, window):
    """is_causal and window fold into each row's range at the query's position."""
    q, k, v = _qkv(rng, BF16)
    kl = 29
    m = _padding(kl, [2, 0, 20])
    out = fm.scaled_dot_product_attention(q, k, v, m, is_causal=causal, enable_gqa=True, kv_len=kl, window=window,
                                          align=align, registry=registry)
    assert last_route().kernel == "flash_attn_decode", last_route()
    q_offset = 0 if align == "top_left" else kl - 1
    expected = reference.attention(q, k[:, :, :kl], v[:, :, :kl], mask=m, causal=causal, q_offset=q_offset,
                                   window=window)
    assert_close(out, expected, BF16, f"{registry.backend} {align} causal={causal} window={window}")


def test_softcap_scale_and_mqa(registry, rng):
    q, k, v = _qkv(rng, F16, hkv=1)
    m = _padding(CAP, [1, 7, 0])
    out = fm.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, scale=0.3, softcap=5.0, registry=registry)
    assert last_route().kernel == "flash_attn_decode"
    expected = reference.attention(q, k, v, mask=m, scale=0.3, softcap=5.0)
    assert_close(out, expected, F16, f"{registry.backend} softcap mqa")


def _holed(kl):
    m = _padding(kl, [0, 3, 9])
    m[1, 0, 0, 20] = False
    return m


GENERAL = {
    "hole": _holed,
    "finite_bias": lambda kl: np.where(_padding(kl, [0, 3, 9]), 0.0, -np.inf).astype(np.float32)
    + np.linspace(0, 1, kl, dtype=np.float32),
    "heads_differ": lambda kl: np.concatenate([_padding(kl, [0, 3, 9]), _padding(kl, [1, 3, 9])] * 2, axis=1),
}


@pytest.mark.parametrize("mask", GENERAL)
def test_other_masks_take_the_general_route(registry, rng, mask):
    q, k, v = _qkv(rng, BF16)
    kl = 33
    m = GENERAL[mask](kl)
    if m.dtype != bool:
        m = m.astype(BF16)
    out = fm.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, kv_len=kl, registry=registry)
    assert last_route().kernel != "flash_attn_decode", last_route()
    expected = reference.attention(q, k[:, :, :kl], v[:, :, :kl], mask=m)
    assert_close(out, expected, BF16, f"{registry.backend} {mask}")


def test_sinks_keep_the_prefill_route(rng):
    """Sinks are per query head; the per-row decode shares one set per kv head
    group, so a masked call with sinks stays on the prefill kernel."""
    q, k, v = _qkv(rng, BF16)
    m = _padding(CAP, [0, 3, 9])
    sinks = np.linspace(-1, 1, H).astype(np.float32)
    assert explain(q, k, v, m, enable_gqa=True, sinks=sinks).kernel == "flash_attn_prefill"


def test_key_ranges():
    m = _padding(10, [0, 4, 10])
    np.testing.assert_array_equal(key_ranges(m), [[10, 10, 0], [0, 4, 0]])
    np.testing.assert_array_equal(key_ranges(m, causal=True, q_pos=6), [[7, 7, 0], [0, 4, 0]])
    np.testing.assert_array_equal(key_ranges(m, window=3, q_pos=9), [[10, 10, 0], [7, 7, 0]])
    holed = m.copy()
    holed[0, 0, 0, 5] = False
    assert key_ranges(holed) is None
    assert key_ranges(np.zeros((1, 1, 2, 10), dtype=bool)) is None  # two query rows


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_inside_a_batch_scope_on_metal(rng, dtype, masked):
    """On a deferring backend the work of a batch scope runs when it ends:
    the decode kernel writes the output in q's dtype itself (no conversion
    after the work), so a call inside a scope takes it too, and its output,
    read after the scope, holds the bits of the same call outside one."""
    reg = fm.Registry("metal-sim")
    q, k, v = _qkv(rng, dtype)
    m = _padding(CAP, [0, 5, 17]) if masked else None
    with reg.batch():
        out = fm.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, registry=reg)
        assert last_route().kernel == "flash_attn_decode", last_route()
    expected = reference.attention(q, k, v, mask=m)
    assert_close(out, expected, dtype, f"batch scope masked={masked} {dtype}")
    outside = fm.scaled_dot_product_attention(q, k, v, m, enable_gqa=True, registry=reg)
    assert last_route().kernel == "flash_attn_decode"
    assert outside.dtype == out.dtype == dtype
    np.testing.assert_array_equal(outside.view(np.uint8), out.view(np.uint8))
