"""flash-attn 3's seqused_q / seqused_k in flash_attn_varlen_func over
QuantizedKV page pools, every backend: only sequence b's first seqused_q[b]
query rows attend, to its first seqused_k[b] keys, causal and windows
aligned on those used lengths bottom-right; its other rows read 0 with LSE
-inf (with sinks: the sink logit). Against float64 attention over the
dequantized pages (reference.flash_attn_varlen), decode-like and prefill
rows in one call, beside ALiBi and sinks; bad entries are ValueErrors
naming the argument, the index and the value."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F32, randn
from test_kv_codec_kvcache import check, check_lse, dequantized
from test_kv_codes_prefill import caches

CU_Q = np.array([0, 1, 6, 9, 13], np.int32)
CU_K = np.array([0, 7, 23, 35, 45], np.int32)


def pool(rng, registry, kbits=8, vbits=4):
    """Four sequences' pages of 4 keys (16 keys each at most)."""
    return caches(rng, registry, b=4, cap=16, hkv=2, d=64, kbits=kbits, vbits=vbits, page=4)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=False, window_size=(3, 1)),
                                dict(causal=True, softcap=2.0)], ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("which", ["q", "k", "both"])
def test_against_float64(registry, rng, kw, which):
    """Used rows 1 of 1, 3 of 5, 0 of 3, 4 of 4; used keys 7 of 7, 10 of 16,
    5 of 12, 0 of 10; sinks and LSE."""
    k, v, table = pool(rng, registry)
    h = 4
    q = randn(rng, (int(CU_Q[-1]), h, 64), F32)
    used_q = np.array([1, 3, 0, 4], np.int32) if which in ("q", "both") else None
    used_k = np.array([7, 10, 5, 0], np.int32) if which in ("k", "both") else None
    sinks = rng.standard_normal(h).astype(np.float32)
    o, lse, _ = fm.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 5, 16, block_table=table, seqused_q=used_q,
                                          seqused_k=used_k, sinks=sinks, return_attn_probs=True, registry=registry,
                                          **kw)
    ref_kw = {("scale" if n == "softmax_scale" else n): x for n, x in kw.items()}
    eo, el = reference.flash_attn_varlen(q, dequantized(k), dequantized(v), CU_Q, CU_K, block_table=table,
                                         seqused_q=used_q, seqused_k=used_k, sinks=sinks, **ref_kw)
    check(o, eo, F32, f"{registry.backend} {which}")
    check_lse(lse, el, f"{registry.backend} {which} lse")
    if used_q is not None:  # unused rows read 0
        assert not np.asarray(o, np.float64)[CU_Q[1] + 3:CU_Q[2]].any()


def test_with_alibi_and_bf16(registry, rng):
    """bf16 q over a dense bf16 V beside K codes, [H] ALiBi slopes: the
    bias counts positions among the used keys and rows."""
    kc = fm.KVCodec(64, 8, seed=9)
    k = kc.encode(randn(rng, (12, 4, 2, 64), F32), registry=registry)
    v = randn(rng, (12, 4, 2, 64), BF16)
    table = rng.permutation(12)[:12].reshape(4, 3).astype(np.int32)
    cu_k = np.array([0, 7, 19, 31, 41], np.int32)
    q = randn(rng, (int(CU_Q[-1]), 4, 64), BF16)
    used_q, used_k = np.array([1, 4, 2, 3], np.int32), np.array([6, 12, 9, 1], np.int32)
    sl = rng.uniform(0.05, 0.6, 4).astype(np.float32)
    o = fm.flash_attn_varlen_func(q, k, v, CU_Q, cu_k, 5, 12, causal=True, block_table=table, seqused_q=used_q,
                                  seqused_k=used_k, alibi_slopes=sl, registry=registry)
    eo, _ = reference.flash_attn_varlen(q, dequantized(k), v, CU_Q, cu_k, block_table=table, seqused_q=used_q,
                                        seqused_k=used_k, causal=True, alibi_slopes=np.broadcast_to(sl, (4, 4)))
    check(o, eo, BF16, f"{registry.backend} alibi bf16")


@pytest.mark.parametrize("name, value, words", [
    ("seqused_q", [1, 6, 0, 4], "seqused_q[1] = 6 is out of range [0, 5] (cu_seqlens_q)"),
    ("seqused_q", [1, 3, -1, 4], "seqused_q[2] = -1 is out of range [0, 3] (cu_seqlens_q)"),
    ("seqused_k", [7, 17, 5, 0], "seqused_k[1] = 17 is out of range [0, 16] (cu_seqlens_k)"),
    ("seqused_q", [1, 3, 0], "seqused_q"),
])
def test_bad_entries(rng, name, value, words):
    k, v, table = pool(rng, "cpu")
    q = randn(rng, (int(CU_Q[-1]), 4, 64), F32)
    with pytest.raises(ValueError) as info:
        fm.flash_attn_varlen_func(q, k, v, CU_Q, CU_K, 5, 16, block_table=table,
                                  **{name: np.array(value, np.int32)}, registry="cpu")
    assert isinstance(info.value, fm.Error) and info.value.op == "flash_attn_varlen_func", info.value
    assert info.value.argument == name and words in str(info.value), str(info.value)


def test_library_clears_rows_no_sequence_owns(registry, rng):
    """fm_dispatch_kv_codes_attn over packed rows longer than the sequences
    (a padded batch) and rows past seqused_q: the library makes them read 0
    with LSE -inf whatever out and lse held (no caller fills them first)."""
    from flashmetal import _native
    from flashmetal._arrays import tensor
    k, v, table = pool(rng, registry)
    total = int(CU_Q[-1])
    q = randn(rng, (total + 3, 4, 64), F32)
    out = np.full(q.shape, 7.0, np.float32)
    lse = np.full((4, total + 3), 7.0, np.float32)
    used_q = np.array([1, 5, 2, 4], np.int32)
    ffi = _native.ffi()
    opts = _native.options("FMAttnOptions", scale=0.125, window_left=-1, window_right=-1, causal=1, max_seqlen_q=5,
                           max_seqlen_k=16)
    seq = ffi.new("FMSeqTensors *")
    keep = [tensor(ffi, a) for a in (CU_Q, CU_K, table, lse, used_q)]
    seq.cu_seqlens_q, seq.cu_seqlens_k, seq.block_table, seq.lse, seq.seqused_q = keep
    _native.call(registry, "fm_dispatch_kv_codes_attn", tensor(ffi, q), k.codec._c, tensor(ffi, k.codes),
                 tensor(ffi, k.norms), v.codec._c, tensor(ffi, v.codes), tensor(ffi, v.norms), seq, tensor(ffi, out),
                 opts, op="test", keep=(q, k, v, out, lse, used_q, keep))
    eo, el = reference.flash_attn_varlen(q[:total], dequantized(k), dequantized(v), CU_Q, CU_K, block_table=table,
                                         seqused_q=used_q, causal=True, scale=0.125)
    check(out[:total], eo, F32, f"{registry.backend} owned rows")
    check_lse(lse[:, :total], el, f"{registry.backend} owned rows lse")
    assert not out[total:].any() and (lse[:, total:] == -np.inf).all()
    assert not out[CU_Q[2] + 2:CU_Q[3]].any() and (lse[:, CU_Q[2] + 2:CU_Q[3]] == -np.inf).all()
