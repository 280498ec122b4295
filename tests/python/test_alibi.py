"""ALiBi (flash-attn's alibi_slopes, float32 [H] or [B, H]) on
flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache and the
packed forms, every backend, against the float64 serving reference: key p of
the row at position t (bottom-right per sequence) scores -slope * |t - p|
more, after the softcap; on top of causal, the window, the attention chunk,
sinks, GQA, paging, cache_leftpad and appending, prefill and one-row calls."""
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
    "window": dict(window_size=(6, 3)),
    "causal_window": dict(causal=True, window_size=(9, -1)),
    "softcap": dict(softcap=1.5),
    "softcap_sinks_causal": dict(causal=True, softcap=2.0, sinks=True),
    "chunk": dict(causal=True, attention_chunk=7),
}


def slopes(rng, shape) -> np.ndarray:
    """Slopes large enough that the bias reorders the scores (a zero slope
    among them: that head is plain attention)."""
    s = rng.uniform(0.05, 0.8, shape).astype(np.float32)
    s.reshape(-1)[0] = 0.0
    return s


@pytest.mark.parametrize("per_batch", [False, True], ids=["H", "BH"])
@pytest.mark.parametrize("feature", FEATURES)
def test_func(registry, rng, feature, per_batch):
    """qL < kL, GQA 4:2, key lengths off the key tile."""
    q, k, v = qkv(rng, (2, 9, 4, 64), (2, 37, 2, 64), BF16)
    kw = with_sinks(rng, FEATURES[feature], 4)
    al = slopes(rng, (2, 4) if per_batch else (4,))
    out, lse, _ = fm.flash_attn_func(q, k, v, alibi_slopes=al, return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, alibi_slopes=al, **kw)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} alibi {feature} per_batch={per_batch}")


@pytest.mark.parametrize("shape", [((1, 40, 2, 64), (1, 12, 2, 64)), ((2, 33, 2, 128), (2, 33, 1, 128))],
                         ids=["qL>kL", "square_d128"])
def test_func_shapes(registry, rng, shape):
    """More queries than keys (rows before every key: |t - p| grows both
    ways), a square causal call at D = 128."""
    q, k, v = qkv(rng, *shape, F16)
    al = slopes(rng, (q.shape[0], q.shape[2]))
    for causal in (False, True):
        out, lse, _ = fm.flash_attn_func(q, k, v, causal=causal, alibi_slopes=al, return_attn_probs=True,
                                         registry=registry)
        e_out, e_lse = reference.flash_attn(q, k, v, causal=causal, alibi_slopes=al)
        assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} alibi {shape} causal={causal}")


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "softcap_sinks_causal", "chunk"])
def test_func_one_row(registry, rng, feature):
    """seqlen_q == 1: the split-KV decode kernel (the query at kL - 1), GQA 4:1."""
    q, k, v = qkv(rng, (3, 1, 4, 64), (3, 45, 1, 64), BF16)
    kw = with_sinks(rng, FEATURES[feature], 4)
    al = slopes(rng, (3, 4))
    out, lse, _ = fm.flash_attn_func(q, k, v, alibi_slopes=al, return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn(q, k, v, alibi_slopes=al, **kw)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} alibi one row {feature}")


@pytest.mark.parametrize("d", [80, 128])
def test_func_one_row_head_dims(registry, rng, d):
    """Decode head dims whose lanes own partial vectors (80) or 4-wide ones (128), GQA 2:1."""
    q, k, v = qkv(rng, (2, 1, 4, d), (2, 70, 2, d), F16)
    al = slopes(rng, (4,))
    out, lse, _ = fm.flash_attn_func(q, k, v, alibi_slopes=al, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn(q, k, v, alibi_slopes=al)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} alibi one row d={d}")


@pytest.mark.parametrize("ql", [11, 1])
def test_zero_slopes_are_bit_identical_to_none(registry, rng, ql):
    """A zero slope adds -0 to every score: the same bits as no ALiBi, prefill and decode."""
    q, k, v = qkv(rng, (2, ql, 2, 64), (2, 40, 2, 64), BF16)
    for kw in (dict(causal=True), dict(window_size=(6, 1), softcap=3.0)):
        a, la, _ = fm.flash_attn_func(q, k, v, alibi_slopes=np.zeros(2, np.float32), return_attn_probs=True,
                                      registry=registry, **kw)
        b, lb, _ = fm.flash_attn_func(q, k, v, return_attn_probs=True, registry=registry, **kw)
        assert_bits_equal(a, b, f"{registry.backend} {kw}")
        assert_bits_equal(la, lb, f"{registry.backend} {kw} lse")


@pytest.mark.parametrize("feature", ["plain", "causal", "window", "softcap_sinks_causal"])
def test_varlen(registry, rng, feature):
    """Ragged sequences (an empty one, one with more queries than keys):
    positions restart per sequence, the slope is the sequence's row."""
    ql, kl = [1, 12, 3, 6], [20, 30, 0, 4]
    q, k, v = qkv(rng, (sum(ql), 4, 64), (sum(kl), 2, 64), F16)
    cq, ck = cu(ql), cu(kl)
    kw = with_sinks(rng, FEATURES[feature], 4)
    for al in (slopes(rng, (4,)), slopes(rng, (4, 4))):
        out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(ql), max(kl), alibi_slopes=al,
                                                return_attn_probs=True, registry=registry, **kw)
        e_out, e_lse = reference.flash_attn_varlen(q, k, v, cq, ck, alibi_slopes=al, **kw)
        assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} alibi varlen {feature} {al.shape}")


def test_varlen_paged(registry, rng):
    ql, kl = [5, 2], [33, 17]
    q = randn(rng, (sum(ql), 2, 64), BF16)
    k_rows = [randn(rng, (n, 1, 64), BF16) for n in kl]
    v_rows = [randn(rng, (n, 1, 64), BF16) for n in kl]
    (kc, vc), table = paged(rng, [k_rows, v_rows], BK)
    cq, ck = cu(ql), cu(kl)
    al = slopes(rng, (2, 2))
    out, lse, _ = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, max(ql), max(kl), causal=True, block_table=table,
                                            alibi_slopes=al, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, causal=True, alibi_slopes=al)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} alibi varlen paged")


@pytest.mark.parametrize("seqlen_q", [1, 6])  # 1: one-row, 6: prefill
@pytest.mark.parametrize("paged_cache", [False, True])
def test_kvcache_append(registry, rng, seqlen_q, paged_cache):
    """Chunked prefill / decode into a cache: keys appended at
    cache_seqlens, then every row attends with the bias from its position."""
    b, h, hkv, cap = 3, 4, 2, 48
    lens = np.array([0, 13, 30], np.int32)
    q = randn(rng, (b, seqlen_q, h, 64), BF16)
    k_new, v_new = randn(rng, (b, seqlen_q, hkv, 64), BF16), randn(rng, (b, seqlen_q, hkv, 64), BF16)
    kc, vc = randn(rng, (b, cap, hkv, 64), BF16), randn(rng, (b, cap, hkv, 64), BF16)
    table = None
    if paged_cache:
        (kc, vc), table = paged(rng, [list(kc), list(vc)], BK)
    al = slopes(rng, (b, h))
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=lens, block_table=table,
                                                causal=True, window_size=(20, 0), alibi_slopes=al)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                         causal=True, window_size=(20, 0), alibi_slopes=al,
                                         return_softmax_lse=True, registry=registry)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} alibi kvcache qL={seqlen_q} paged={paged_cache}")


@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_kvcache_leftpad(registry, rng, seqlen_q):
    """cache_leftpad: positions count from the sequence's first key, so the
    bias is the one of the unpadded sequence."""
    b, h, cap = 2, 2, 40
    q = randn(rng, (b, seqlen_q, h, 64), F16)
    kc, vc = randn(rng, (b, cap, h, 64), F16), randn(rng, (b, cap, h, 64), F16)
    lens, pad = np.array([30, 17], np.int32), np.array([4, 0], np.int32)
    al = slopes(rng, (h,))
    e_out, e_lse = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pad, alibi_slopes=al)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pad, alibi_slopes=al,
                                         return_softmax_lse=True, registry=registry)
    assert_out_lse(out, lse, e_out, e_lse, F16, f"{registry.backend} alibi leftpad qL={seqlen_q}")


def test_packed_entry_points_pass_the_slopes(registry, rng):
    qkv_ = randn(rng, (1, 21, 3, 2, 64), BF16)
    al = slopes(rng, (2,))
    out, lse, _ = fm.flash_attn_qkvpacked_func(qkv_, causal=True, alibi_slopes=al, return_attn_probs=True,
                                               registry=registry)
    e_out, e_lse = reference.flash_attn(qkv_[:, :, 0], qkv_[:, :, 1], qkv_[:, :, 2], causal=True, alibi_slopes=al)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} qkvpacked alibi")
    cs = cu([8, 13])
    al2 = slopes(rng, (2, 2))
    out, lse, _ = fm.flash_attn_varlen_kvpacked_func(qkv_[0, :, 0], qkv_[0, :, 1:], cs, cs, 13, 13,
                                                     alibi_slopes=al2, return_attn_probs=True, registry=registry)
    e_out, e_lse = reference.flash_attn_varlen(qkv_[0, :, 0], qkv_[0, :, 1], qkv_[0, :, 2], cs, cs,
                                               alibi_slopes=al2)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} varlen kvpacked alibi")


def test_reference_matches_flash_attns_bias(rng):
    """The reference's bias is flash-attn's attn_bias_from_alibi_slopes
    (non-causal: -slope * |i + kL - qL - j|), written out here for one
    sequence and compared on the output."""
    q, k, v = qkv(rng, (1, 5, 2, 64), (1, 9, 2, 64), F16)
    al = np.array([0.5, 0.25], np.float32)
    i, j = np.arange(5)[:, None], np.arange(9)[None, :]
    bias = -al.astype(np.float64)[:, None, None] * np.abs(i + 9 - 5 - j)
    e = reference.attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
                            mask=bias[None])
    out, _ = reference.flash_attn(q, k, v, alibi_slopes=al)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3), e, rtol=1e-12, atol=1e-12)


FUNCS = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _call(rng, fn, **kw):
    q, k, v = qkv(rng, (2, 4, 3, 64), (2, 4, 3, 64), BF16)
    if fn == "flash_attn_varlen_func":
        return fm.flash_attn_varlen_func(q.reshape(8, 3, 64), k.reshape(8, 3, 64), v.reshape(8, 3, 64), cu([4, 4]),
                                         cu([4, 4]), 4, 4, registry="cpu", **kw)
    return getattr(fm, fn)(q, k, v, registry="cpu", **kw)


@pytest.mark.parametrize("fn", FUNCS)
@pytest.mark.parametrize("value,exc,words", [
    (np.ones(2, np.float32), ValueError, "shape [3] or [2, 3]"),
    (np.ones((3, 3), np.float32), ValueError, "got [3, 3]"),
    (np.ones((2, 3, 1), np.float32), ValueError, "got [2, 3, 1]"),
    (np.ones(3, np.float64), TypeError, "float32, got dtype float64"),
    (np.ones(3, np.float16), TypeError, "float32, got dtype float16"),
    (np.array([0.5, np.nan, 0.1], np.float32), ValueError, "alibi_slopes[1] must be finite, got nan"),
    (np.array([[0.5, 1, 1], [1, 1, -np.inf]], np.float32), ValueError, "alibi_slopes[1, 2] must be finite, got -inf"),
])
def test_bad_slopes(rng, fn, value, exc, words):
    with pytest.raises(exc) as info:
        _call(rng, fn, alibi_slopes=value)
    assert isinstance(info.value, fm.Error) and info.value.op == fn, info.value
    assert info.value.argument == "alibi_slopes" and words in str(info.value), str(info.value)


@pytest.mark.parametrize("entry", ["fm_dispatch_attn", "fm_dispatch_kv_codes_attn"])
def test_library_checks_the_slopes_tensor(rng, entry):
    """The C ABI checks the field itself (a caller other than the Python
    package), over dense and quantized caches: [B, H] float32 only, refused
    before anything is written."""
    from flashmetal import _native
    from flashmetal._arrays import tensor
    ffi = _native.ffi()
    q, k, v = qkv(rng, (2, 4, 3, 64), (2, 4, 3, 64), BF16)
    if entry == "fm_dispatch_attn":
        caches = (tensor(ffi, k), tensor(ffi, v))
    else:
        codec = fm.KVCodec(64, 8, seed=3)
        c = codec.encode(k, registry="cpu")
        caches = (codec._c, tensor(ffi, c.codes), tensor(ffi, c.norms)) * 2
    out = np.full_like(q, 7.0)
    for bad, exc, words in ((np.ones(3, np.float32), ValueError, "alibi_slopes shape [3] must be [2, 3]"),
                            (np.ones((2, 3), np.float16), TypeError, "alibi_slopes")):
        opts = _native.options("FMAttnOptions", scale=0.125, window_left=-1, window_right=-1)
        seq = ffi.new("FMSeqTensors *")
        t = tensor(ffi, bad)
        seq.alibi_slopes = t
        with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]")):
            _native.call(fm.Registry("cpu"), entry, tensor(ffi, q), *caches, seq, tensor(ffi, out), opts, op="test",
                         keep=(q, k, v, out, bad, t, caches))
        assert (out.astype(np.float32) == 7.0).all()
