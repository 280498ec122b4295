"""attention_chunk (flash-attn 3's argument; Llama 4's chunked local
attention) on flash_attn_func, flash_attn_varlen_func and
flash_attn_with_kvcache, every backend, against the float64 serving
reference: the row at position t sees only keys p with p // c == t // c, on
top of causal, the window, softcap and sinks, through the prefill and the
decode kernels, ragged, paged and appending."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, assert_bits_equal, randn
from numerics import qkv_of_shapes as qkv
from serving_cases import BK, assert_out_lse, cu, paged, with_sinks

FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, window_size=(5, -1)),
    "window_both": dict(window_size=(3, 2)),
    "softcap_sinks": dict(causal=True, softcap=2.0, sinks=True),
}
# 1: every key its own chunk; BK - 1, BK, BK + 1 around the key tile; 7: chunks
# that cut tiles; larger than any length: one chunk.
CHUNKS = [1, 7, BK - 1, BK, BK + 1, 100]


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("feature", FEATURES)
def test_func(registry, rng, chunk, feature):
    """qL < kL (rows at t = kL - qL + i), GQA 4:2."""
    q, k, v = qkv(rng, (2, 9, 4, 64), (2, 37, 2, 64), BF16)
    kw = with_sinks(rng, FEATURES[feature], 4)
    out, lse, _ = fm.flash_attn_func(q, k, v, attention_chunk=chunk, return_attn_probs=True, registry=registry,
                                     **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, attention_chunk=chunk, **kw)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} chunk={chunk} {feature}")


@pytest.mark.parametrize("chunk", [1, 3, BK])
def test_func_more_queries_than_keys(registry, rng, chunk):
    """qL > kL: the first rows sit at negative positions, their chunk is
    floor(t / c) (below every key): they see nothing, output 0, LSE -inf."""
    q, k, v = qkv(rng, (1, 20, 2, 64), (1, 6, 2, 64), F16)
    out, lse, _ = fm.flash_attn_func(q, k, v, attention_chunk=chunk, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn(q, k, v, attention_chunk=chunk)
    assert np.isneginf(e_lse[:, :, :14]).all()
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} qL>kL chunk={chunk}")


@pytest.mark.parametrize("chunk", [1, 5, BK, BK + 3])
@pytest.mark.parametrize("feature", ["plain", "causal_window", "softcap_sinks"])
def test_func_decode_route(registry, rng, chunk, feature):
    """seqlen_q == 1: the decode kernel; the query at kL - 1 sees keys from
    its chunk's start, (kL - 1) // c * c."""
    q, k, v = qkv(rng, (3, 1, 4, 64), (3, 45, 1, 64), BF16)
    kw = with_sinks(rng, FEATURES[feature], 4)
    out, lse, _ = fm.flash_attn_func(q, k, v, attention_chunk=chunk, return_attn_probs=True, registry=registry,
                                     **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, attention_chunk=chunk, **kw)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} decode chunk={chunk} {feature}")


def test_one_chunk_is_bit_identical_to_none(registry, rng):
    """A chunk holding every position changes nothing: the same bits as
    attention_chunk=0, prefill and decode."""
    for ql in (11, 1):
        q, k, v = qkv(rng, (2, ql, 2, 64), (2, 40, 2, 64), BF16)
        for kw in (dict(causal=True), dict(window_size=(6, 1))):
            a, la, _ = fm.flash_attn_func(q, k, v, attention_chunk=64, return_attn_probs=True, registry=registry,
                                          **kw)
            b, lb, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry, **kw)
            assert_bits_equal(a, b, f"{registry.backend} qL={ql} {kw}")
            assert_bits_equal(la, lb, f"{registry.backend} qL={ql} {kw} lse")


@pytest.mark.parametrize("chunk", [2, 7, BK])
@pytest.mark.parametrize("feature", ["plain", "causal", "causal_window", "softcap_sinks"])
def test_varlen(registry, rng, chunk, feature):
    """Ragged sequences (an empty one, one with more queries than keys):
    positions, hence chunks, restart in every sequence."""
    ql, kl = [1, 12, 3, 6], [20, 30, 0, 4]
    q, k, v = qkv(rng, (sum(ql), 4, 64), (sum(kl), 2, 64), F16)
    cq, ck = cu(ql), cu(kl)
    kw = with_sinks(rng, FEATURES[feature], 4)
    out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(ql), max(kl), attention_chunk=chunk,
                                            return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn_varlen(q, k, v, cq, ck, attention_chunk=chunk, **kw)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} varlen chunk={chunk} {feature}")


@pytest.mark.parametrize("chunk", [3, BK])
def test_varlen_paged(registry, rng, chunk):
    ql, kl = [5, 2], [33, 17]
    h, hkv = 2, 1
    q = randn(rng, (sum(ql), h, 64), BF16)
    k_rows = [randn(rng, (n, hkv, 64), BF16) for n in kl]
    v_rows = [randn(rng, (n, hkv, 64), BF16) for n in kl]
    (kc, vc), table = paged(rng, [k_rows, v_rows], BK)
    cq, ck = cu(ql), cu(kl)
    out, lse, _ = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, max(ql), max(kl), causal=True, block_table=table,
                                            attention_chunk=chunk, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, causal=True,
                                               attention_chunk=chunk)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} varlen paged chunk={chunk}")


@pytest.mark.parametrize("chunk", [4, BK, 9])
@pytest.mark.parametrize("seqlen_q", [1, 6])  # 1: decode, 6: prefill
@pytest.mark.parametrize("paged_cache", [False, True])
def test_kvcache_append(registry, rng, chunk, seqlen_q, paged_cache):
    """Chunked prefill / decode into a cache: keys appended at cache_seqlens,
    then every row attends within its chunk (lengths put rows on both sides
    of a chunk boundary)."""
    b, h, hkv, cap = 3, 4, 2, 48
    lens = np.array([0, 13, 30], np.int32)
    q = randn(rng, (b, seqlen_q, h, 64), BF16)
    k_new, v_new = randn(rng, (b, seqlen_q, hkv, 64), BF16), randn(rng, (b, seqlen_q, hkv, 64), BF16)
    kc, vc = randn(rng, (b, cap, hkv, 64), BF16), randn(rng, (b, cap, hkv, 64), BF16)
    table = None
    if paged_cache:
        (kc, vc), table = paged(rng, [list(kc), list(vc)], BK)
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, block_table=table,
                                                causal=True, attention_chunk=chunk)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                         causal=True, attention_chunk=chunk, return_softmax_lse=True,
                                         registry=registry)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} kvcache chunk={chunk} qL={seqlen_q}")


@pytest.mark.parametrize("fn", ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"])
@pytest.mark.parametrize("value,exc,words", [(-1, ValueError, ">= 0, got -1"), (True, TypeError, "integer"),
                                             (2.5, TypeError, "integer"), (2**31, ValueError, "int32")])
def test_bad_chunk(rng, fn, value, exc, words):
    q, k, v = qkv(rng, (1, 4, 2, 64), (1, 4, 2, 64), BF16)
    args = {"flash_attn_func": (q, k, v), "flash_attn_with_kvcache": (q, k, v),
            "flash_attn_varlen_func": (q[0], k[0], v[0], cu([4]), cu([4]), 4, 4)}[fn]
    with pytest.raises(exc) as info:
        getattr(fm, fn)(*args, attention_chunk=value, registry="cpu")
    assert isinstance(info.value, fm.Error) and info.value.op == fn
    assert "attention_chunk" in str(info.value) and words in str(info.value), str(info.value)


def test_library_rejects_a_negative_chunk(rng):
    """The C ABI checks the field itself (a caller other than the Python
    package): FM_ERROR_VALUE naming attention_chunk."""
    from flashmetal import _native
    from flashmetal._arrays import tensor
    q, k, v = qkv(rng, (1, 4, 2, 64), (1, 4, 2, 64), BF16)
    out = np.empty_like(q)
    for fn, qq, oo in (("fm_dispatch_attn", q, out),
                       ("fm_dispatch_vec_seq", np.zeros((1, 2, 64), np.float32), np.zeros((1, 2, 64), np.float32))):
        ffi = _native.ffi()
        opts = _native.options("FMAttnOptions", scale=0.125, window_left=-1, window_right=-1, attention_chunk=-3)
        seq = ffi.new("FMSeqTensors *")
        args = [tensor(ffi, qq), tensor(ffi, k), tensor(ffi, v), seq]
        if fn == "fm_dispatch_vec_seq":
            args.append(ffi.NULL)
        with pytest.raises(ValueError, match="attention_chunk"):
            _native.call(fm.Registry("cpu"), fn, *args, tensor(ffi, oo), opts, op="test",
                         keep=(qq, k, v, oo))


def test_packed_entry_points_pass_the_chunk(registry, rng):
    qkv_ = randn(rng, (1, 21, 3, 2, 64), BF16)
    out, lse, _ = fm.flash_attn_qkvpacked_func(qkv_, causal=True, attention_chunk=6, return_attn_probs=True,
                                               registry=registry)
    e_out, e_lse = reference.flash_attn(qkv_[:, :, 0], qkv_[:, :, 1], qkv_[:, :, 2], causal=True, attention_chunk=6)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} qkvpacked chunk")
    cs = cu([8, 13])
    out, lse, _ = fm.flash_attn_varlen_kvpacked_func(qkv_[0, :, 0], qkv_[0, :, 1:], cs, cs, 13, 13,
                                                     attention_chunk=5, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn_varlen(qkv_[0, :, 0], qkv_[0, :, 1], qkv_[0, :, 2], cs, cs,
                                               attention_chunk=5)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} varlen kvpacked chunk")
