"""flash_attn_varlen_func over packed QuantizedKV k/v (leading shape
[total_k, Hkv], no block table): sequence b's keys are rows
cu_seqlens_k[b] ..< cu_seqlens_k[b+1], read in place by the decode over codes
(sequences of one query row) and the tiled prefill over codes, every
backend. Outputs and LSE equal float64 attention over the dequantized rows
(reference.flash_attn_varlen over packed K̂, V̂), with causal, windows,
softcap, chunks, sinks, ALiBi, seqused_q / seqused_k, GQA and a dense side;
a leading shape that is neither packed nor paged is a ValueError."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F32, randn
from test_kv_codec_kvcache import check, check_lse, dequantized

CU_Q = np.array([0, 1, 6, 9, 10], np.int32)
CU_K = np.array([0, 7, 23, 35, 35], np.int32)  # the last sequence has no key
H, HKV, D = 4, 2, 64

FEATURES = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "window": dict(causal=False, window_size=(3, 1)),
    "softcap_chunk": dict(causal=True, softcap=2.0, attention_chunk=5),
}


def packed(rng, registry, total, kbits=8, vbits=4):
    kc, vc = fm.KVCodec(D, kbits, seed=21), fm.KVCodec(D, vbits, seed=22)
    return (kc.encode(randn(rng, (total, HKV, D), F32), registry=registry),
            vc.encode(randn(rng, (total, HKV, D), F32), registry=registry))


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_against_float64(registry, rng, feature):
    """Sinks, LSE and [H] ALiBi slopes on top of each feature."""
    kw = FEATURES[feature]
    k, v = packed(rng, registry, int(CU_K[-1]))
    q = randn(rng, (int(CU_Q[-1]), H, D), F32)
    sinks = rng.standard_normal(H).astype(np.float32)
    sl = rng.uniform(0.05, 0.5, H).astype(np.float32)
    o, lse, _ = fm.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 5, 16, sinks=sinks, alibi_slopes=sl,
                                          return_attn_probs=True, registry=registry, **kw)
    ref_kw = {("scale" if n == "softmax_scale" else n): x for n, x in kw.items()}
    eo, el = reference.flash_attn_varlen(q, dequantized(k), dequantized(v), CU_Q, CU_K, sinks=sinks,
                                         alibi_slopes=np.broadcast_to(sl, (4, H)), **ref_kw)
    check(o, eo, F32, f"{registry.backend} {feature}")
    check_lse(lse, el, f"{registry.backend} {feature} lse")


def test_seqused_and_a_dense_side(registry, rng):
    """bf16 q over K codes beside a dense bf16 V, seqused_q / seqused_k."""
    total = int(CU_K[-1])
    k = fm.KVCodec(D, 6, seed=3).encode(randn(rng, (total, HKV, D), F32), registry=registry)
    v = randn(rng, (total, HKV, D), BF16)
    q = randn(rng, (int(CU_Q[-1]), H, D), BF16)
    used_q, used_k = np.array([1, 3, 2, 1], np.int32), np.array([7, 9, 12, 0], np.int32)
    o = fm.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 5, 16, causal=True, seqused_q=used_q, seqused_k=used_k,
                                  registry=registry)
    eo, _ = reference.flash_attn_varlen(q, dequantized(k), v, CU_Q, CU_K, seqused_q=used_q, seqused_k=used_k,
                                        causal=True)
    check(o, eo, BF16, f"{registry.backend} seqused dense V")


def test_long_sequences_split_the_decode(registry, rng):
    """One query row per sequence over 700 and 1100 packed keys: the decode
    splits each sequence's keys (threadgroups on sim, shares on the cpu)."""
    cq, ck = np.array([0, 1, 2], np.int32), np.array([0, 700, 1800], np.int32)
    k, v = packed(rng, registry, 1800, kbits=4, vbits=8)
    q = randn(rng, (2, H, D), F32)
    o, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, 1, 1100, return_attn_probs=True, registry=registry)
    eo, el = reference.flash_attn_varlen(q, dequantized(k), dequantized(v), cq, ck)
    check(o, eo, F32, f"{registry.backend} long")
    check_lse(lse, el, f"{registry.backend} long lse")


def test_keys_past_the_rows_are_refused(rng):
    """cu_seqlens_k ending past the packed rows names cu_seqlens_k."""
    k, v = packed(rng, "cpu", 30)
    q = randn(rng, (int(CU_Q[-1]), H, D), F32)
    with pytest.raises(ValueError) as info:
        fm.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 5, 16, registry="cpu")
    assert isinstance(info.value, fm.Error) and info.value.argument == "cu_seqlens_k", info.value
    assert "35" in str(info.value) and "30" in str(info.value), str(info.value)


def test_a_batched_cache_without_pages_is_refused(rng):
    """Storage of leading shape [B, cap, Hkv] with cu_seqlens_k and no block
    table is neither packed nor paged: a ValueError naming k_cache."""
    codec = fm.KVCodec(D, 8)
    k = codec.encode(randn(rng, (4, 16, HKV, D), F32), registry="cpu")
    q = randn(rng, (int(CU_Q[-1]), H, D), F32)
    with pytest.raises(ValueError, match=r"leading shape \[1, total_k, Hkv\]"):
        fm.flash_attn_varlen_func(q, k, k, CU_Q, CU_K, 5, 16, registry="cpu")
