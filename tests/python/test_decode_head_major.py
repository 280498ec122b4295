"""The serving decode (fm_dispatch_vec_seq) over torch's head-major layouts
(FMAttnOptions.head_major: q/out [B, H, L, D], lse [B, H, L], caches
[B, Hkv, cap, D] or pages [num_pages, Hkv, page_size, D]) on every backend:
the same bits as the same call in flash-attn's layouts, and the float64
serving reference; the combinations it refuses, by name."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _native, reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn
from serving_native import VEC_SEQ_OP, make_cache, tensor, vec_seq


def _head_major(x: np.ndarray) -> np.ndarray:
    """[B, L, H, D] (or pages [P, S, Hkv, D]) as [B, H, L, D], contiguous."""
    return np.ascontiguousarray(x.swapaxes(1, 2))


# (B, L, H, Hkv, D, cache dtype, cap, page size, keywords): GQA 1/2/4, one
# row (rank-3 q) and short queries, dense and paged caches (a page size off
# 16 too), sinks, ALiBi, cache_leftpad, windows, softcap.
CASES = [
    (2, 3, 8, 2, 64, BF16, 40, None, dict(causal=True, sinks=True, alibi=True)),
    (2, 4, 4, 4, 64, F16, 33, None, dict(causal=False, window=(6, 1), leftpad=True)),
    (3, 1, 4, 1, 128, F32, 30, 5, dict(causal=True, sinks=True)),
    (2, 5, 4, 2, 80, BF16, 48, 16, dict(causal=True, window=(9, -1), softcap=4.0)),
    (1, 8, 2, 1, 64, F16, 12, None, dict(causal=True, alibi=True)),  # fewer keys than rows for one sequence
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}l{c[1]}h{c[2]}/{c[3]}d{c[4]}-page{c[7]}")
def test_head_major_decode_matches_flash_attn_layout_and_reference(registry, case):
    b, ql, h, hkv, d, dtype, cap, page, kw = case
    rng = np.random.default_rng(ql * 100 + d + h)
    kc, vc, table = make_cache(rng, b, cap, hkv, d, dtype, page)
    q = randn(rng, (b, ql, h, d), F32)
    lens = rng.integers(ql, cap + 1, size=b).astype(np.int32)
    lens[0] = min(cap, 5)
    pad = rng.integers(0, 4, size=b).astype(np.int32) if kw.get("leftpad") else None
    seqlens = lens if pad is None else np.ascontiguousarray(np.stack([lens, pad]))
    sinks = rng.standard_normal(h).astype(np.float32) if kw.get("sinks") else None
    slopes = (rng.random((b, h)) * 0.3).astype(np.float32) if kw.get("alibi") else None
    window = kw.get("window", (-1, -1))
    args = dict(seqlens=seqlens, block_table=table, sinks=sinks, alibi=slopes, lse=True, causal=kw["causal"],
                window=window, softcap=kw.get("softcap", 0.0))
    q_flash = q[:, 0] if ql == 1 else q  # one row: rank-3 [B, H, D], the same in both layouts
    out_s, lse_s = vec_seq(registry, q_flash, kc, vc, **args)
    q_head = q[:, 0] if ql == 1 else _head_major(q)
    out_h, lse_h = vec_seq(registry, q_head, _head_major(kc), _head_major(vc), head_major=1, **args)
    what = f"{registry.backend} {case}"
    assert out_s is not None and lse_s is not None and lse_h is not None
    if ql == 1:
        assert_bits_equal(out_h, out_s, what)
        assert_bits_equal(lse_h, lse_s, what + " lse")
    else:
        assert_bits_equal(out_h, _head_major(out_s), what)
        assert_bits_equal(lse_h, np.ascontiguousarray(lse_s.swapaxes(1, 2)), what + " lse")
    ref_kw = dict(cache_seqlens=lens, block_table=table, cache_leftpad=pad, causal=kw["causal"], window_size=window,
                  softcap=kw.get("softcap", 0.0), sinks=sinks, alibi_slopes=slopes)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, **ref_kw)
    got = out_h[:, None] if ql == 1 else out_h.swapaxes(1, 2)  # as flash-attn's [B, L, H, D]
    assert_close(got, e_out, dtype, what)
    assert_close(lse_h.reshape(b, h, ql), e_lse, F32, what + " lse")


def test_head_major_values_and_combinations_refused(registry):
    rng = np.random.default_rng(5)
    kc, vc, _ = make_cache(rng, 2, 16, 2, 64, F16)
    q = randn(rng, (2, 4, 64), F32)
    with pytest.raises(fm.InvalidValueError, match=rf"^{VEC_SEQ_OP}: head_major must be 0 or 1, got 2") as e:
        vec_seq(registry, q, _head_major(kc), _head_major(vc), head_major=2)
    assert e.value.argument == "head_major"
    # Appending needs flash-attn's caches: k_new is refused before anything is written.
    kh, vh = _head_major(kc), _head_major(vc)
    kn, vn = randn(rng, (2, 1, 2, 64), F16), randn(rng, (2, 1, 2, 64), F16)
    before = kh.copy()
    ffi = _native.ffi()
    seq = ffi.new("FMSeqTensors *")
    kn_t, vn_t = tensor(kn), tensor(vn)
    seq.k_new, seq.v_new = kn_t, vn_t
    out = np.empty(q.shape, np.float32)
    opts = _native.options("FMAttnOptions", scale=0.125, softcap=0.0, causal=1, window_left=-1, window_right=-1,
                           max_seqlen_q=0, max_seqlen_k=0, head_major=1)
    with pytest.raises(fm.InvalidValueError, match=rf"^{VEC_SEQ_OP}: head_major takes neither k_new") as e:
        _native.call(registry, "fm_dispatch_vec_seq", tensor(q), tensor(kh), tensor(vh), seq, ffi.NULL, tensor(out),
                     opts, op=VEC_SEQ_OP, keep=(q, kh, vh, kn, vn, out, kn_t, vn_t))
    assert e.value.argument == "head_major"
    assert_bits_equal(kh, before, "cache untouched")
    # A head-major q whose L is past the short-query limit names its axis.
    q9 = randn(rng, (2, 4, 9, 64), F32)
    with pytest.raises(fm.InvalidValueError, match=r"q's query rows \(dim 2\) must be in 1\.\.\.8, got 9"):
        vec_seq(registry, q9, kh, vh, head_major=1)


def test_serving_prefill_refuses_head_major(registry):
    """fm_dispatch_attn reads flash-attn's layouts only: head_major is named."""
    rng = np.random.default_rng(6)
    q = randn(rng, (1, 16, 2, 64), F16)
    k, v = randn(rng, (1, 16, 2, 64), F16), randn(rng, (1, 16, 2, 64), F16)
    out = np.empty_like(q)
    ffi = _native.ffi()
    opts = _native.options("FMAttnOptions", scale=0.125, softcap=0.0, causal=1, window_left=-1, window_right=-1,
                           max_seqlen_q=0, max_seqlen_k=0, head_major=1)
    with pytest.raises(fm.InvalidValueError, match=r"head_major must be 0 \(flash-attn's \[B, L, H, D\] layouts\), got 1"):
        _native.call(registry, "fm_dispatch_attn", tensor(q), tensor(k), tensor(v), ffi.NULL, tensor(out), opts,
                     op="flash_attn_prefill", keep=(q, k, v, out))


@pytest.mark.parametrize("window,softcap", [(None, 0.0), (7, 0.0), (None, 3.0)])
def test_front_door_decode_matches_flash_attn_decode_bits(registry, window, softcap):
    """The front door's one-row decode (the head-major serving decode over
    the caches as given) gives flash_attn_decode's bits, and the float64
    reference's values, with GQA, a cache longer than kv_len, a window and a softcap."""
    rng = np.random.default_rng(11 + (window or 0))
    b, h, hkv, cap, kl, d = 2, 8, 2, 40, 29, 64
    q = randn(rng, (b, h, 1, d), BF16)
    k, v = randn(rng, (b, hkv, cap, d), BF16), randn(rng, (b, hkv, cap, d), BF16)
    got = fm.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, window=window, softcap=softcap,
                                          kv_len=kl, align="bottom_right", registry=registry)
    assert fm.last_route().kernel == "flash_attn_decode"
    want = fm.flash_attn_decode(q[:, :, 0], k, v, kl, causal=True, window=window, softcap=softcap, registry=registry)
    assert_bits_equal(got[:, :, 0], want, f"{registry.backend} window={window} softcap={softcap}")
    e = reference.attention(q, np.repeat(k[:, :, :kl], 4, axis=1), np.repeat(v[:, :, :kl], 4, axis=1), causal=True,
                            q_offset=kl - 1, window=window, softcap=softcap)
    assert_close(got, e, BF16, f"{registry.backend} window={window} softcap={softcap}")
