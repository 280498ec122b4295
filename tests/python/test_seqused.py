"""flash-attn 3's seqused_q / seqused_k in flash_attn_varlen_func, every
backend: sequence b keeps rows cu_seqlens[b]:cu_seqlens[b+1] of the packed
tensors, but only its first seqused_q[b] query rows attend, to its first
seqused_k[b] keys (bottom-right over those used lengths, as flash-attn 3's
test builds them with query/key padding masks); its other query rows read 0.
Checked against float64 attention of each sequence's used rows, with GQA,
causal, windows, chunks, softcap, sinks, ALiBi and paged caches; bad tables
refused before any kernel runs."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, randn
from numerics import qkv_of_shapes as qkv
from serving_cases import assert_out_lse, cu, feature_kw, paged, ragged_features

FEATURES = ragged_features(window=(3, 2))
QL, KL = [1, 12, 3, 6], [20, 30, 0, 4]
USED_Q, USED_K = [1, 7, 0, 6], [13, 30, 0, 2]
H, HKV, D = 4, 2, 64


def _expected(q, k, v, cq, ck, uq, uk, kw):
    """Each sequence's used rows over its used keys (float64); other rows 0,
    their LSE that of a row seeing no key."""
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cq) - 1):
        qs, ks = int(cq[b]), int(ck[b])
        one = {n: (a[b] if n == "alibi_slopes" else a) for n, a in kw.items()}
        o, s = reference.attend_sequence(q[qs:qs + uq[b]], k[ks:ks + uk[b]], v[ks:ks + uk[b]], **one)
        out[qs:qs + uq[b]], lse[:, qs:qs + uq[b]] = o, s
        _, lse[:, qs + uq[b]:int(cq[b + 1])] = reference.attend_sequence(q[qs + uq[b]:int(cq[b + 1])], k[:0],
                                                                          v[:0], **one)
    return out, lse


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("mode", ["q", "k", "both"])
def test_varlen(registry, rng, feature, mode):
    q, k, v = qkv(rng, (sum(QL), H, D), (sum(KL), HKV, D), F16)
    cq, ck = cu(QL), cu(KL)
    kw = feature_kw(rng, FEATURES[feature], len(QL), H)
    uq = np.array(USED_Q if mode != "k" else QL, np.int32)
    uk = np.array(USED_K if mode != "q" else KL, np.int32)
    out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(QL), max(KL), return_attn_probs=True,
                                            seqused_q=uq if mode != "k" else None,
                                            seqused_k=uk if mode != "q" else None, registry=registry, **kw)
    what = f"{registry.backend} seqused {mode} {feature}"
    e_out, e_lse = _expected(q, k, v, cq, ck, uq, uk, kw)
    assert_out_lse(out, lse, e_out, e_lse, F16, what)
    r_out, r_lse = reference.flash_attn_varlen(q, k, v, cq, ck, seqused_q=uq, seqused_k=uk, **kw)
    assert_out_lse(out, lse, r_out, r_lse, F16, what + " (reference.flash_attn_varlen)")
    unused = np.concatenate([np.arange(cq[b] + uq[b], cq[b + 1]) for b in range(len(QL))])
    assert not np.asarray(out)[unused].any(), what


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("feature", ["plain", "causal", "chunk"])
def test_varlen_paged(registry, rng, page_size, feature):
    """With block_table sequence b's keys are its cu_seqlens_k length in its
    pages; seqused_k keeps the first of them."""
    q = randn(rng, (sum(QL), H, D), BF16)
    k_rows = [randn(rng, (n, HKV, D), BF16) for n in KL]
    v_rows = [randn(rng, (n, HKV, D), BF16) for n in KL]
    (kc, vc), table = paged(rng, [k_rows, v_rows], page_size)
    table[table < 0] = 0  # every sequence holds at least one page's entry in range
    cq, ck = cu(QL), cu(KL)
    uq, uk = np.array(USED_Q, np.int32), np.array(USED_K, np.int32)
    kw = FEATURES[feature]
    out, lse, _ = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, max(QL), max(KL), block_table=table, seqused_q=uq,
                                            seqused_k=uk, return_attn_probs=True, registry=registry, **kw)
    e_out, e_lse = reference.flash_attn_varlen(q, kc, vc, cq, ck, block_table=table, seqused_q=uq, seqused_k=uk,
                                               **kw)
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} seqused paged {page_size} {feature}")


def test_full_lengths_are_bit_identical_to_none(registry, rng):
    q, k, v = qkv(rng, (sum(QL), H, D), (sum(KL), HKV, D), BF16)
    cq, ck = cu(QL), cu(KL)
    base = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(QL), max(KL), causal=True, registry=registry)
    for used in (dict(seqused_q=np.array(QL, np.int32)), dict(seqused_k=np.array(KL, np.int32)),
                 dict(seqused_q=np.array(QL, np.int32), seqused_k=np.array(KL, np.int32))):
        got = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(QL), max(KL), causal=True, registry=registry, **used)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(base).view(np.uint16))


@pytest.mark.parametrize("kw,exc,argument,text", [
    (dict(seqused_q=np.array([1, 13, 0, 6], np.int32)), fm.InvalidValueError, "seqused_q",
     "seqused_q[1] = 13 is out of range [0, 12] (cu_seqlens_q)"),
    (dict(seqused_q=np.array([-1, 0, 0, 0], np.int32)), fm.InvalidValueError, "seqused_q", "seqused_q[0] = -1"),
    (dict(seqused_q=np.array([1, 2, 3], np.int32)), fm.InvalidValueError, "seqused_q", "shape [4]"),
    (dict(seqused_q=np.array([1.0, 2, 3, 4])), fm.InvalidTypeError, None, "seqused_q must hold integers"),
    (dict(seqused_k=np.array([20, 31, 0, 4], np.int32)), fm.InvalidValueError, "seqused_k",
     "seqused_k[1] = 31 is out of range [0, 30] (cu_seqlens_k)"),
    (dict(seqused_k=np.array([20, 30, 0], np.int32)), fm.InvalidValueError, "seqused_k", "shape [4]"),
    (dict(seqused_k=np.array([KL, [0, 1, 0, 0]], np.int32)), fm.InvalidValueError, "seqused_k",
     "seqused_k must have rank 1, got shape [2, 4]"),
    (dict(seqused_q=np.array(QL, np.int32), seqused_k=np.array([0, 0, 1, 0], np.int32)), fm.InvalidValueError,
     "seqused_k", "seqused_k[2] = 1 is out of range [0, 0] (cu_seqlens_k)"),
    (dict(seqused_q=np.array(QL, np.int32), cu_seqlens_q=np.array([0, 1, 13, 12, 22], np.int32)),
     fm.InvalidValueError, "cu_seqlens_q", "cu_seqlens_q[3] = 12 < cu_seqlens_q[2] = 13"),
    (dict(seqused_q=np.array(QL, np.int32), cu_seqlens_k=np.array([0, 20, 50, 50, 55], np.int32)),
     fm.InvalidValueError, "cu_seqlens_k", "cu_seqlens_k[4] = 55 exceeds the 54 tokens of k"),
    (dict(seqused_q=np.array(QL, np.int32), max_seqlen_q=11), fm.InvalidValueError, "max_seqlen_q",
     "sequence 1 has length 12"),
])
def test_bad_tables(rng, kw, exc, argument, text):
    q, k, v = qkv(rng, (sum(QL), H, D), (sum(KL), HKV, D), BF16)
    args = dict(cu_seqlens_q=cu(QL), cu_seqlens_k=cu(KL), max_seqlen_q=max(QL), max_seqlen_k=max(KL))
    args.update(kw)
    with pytest.raises(exc) as e:
        fm.flash_attn_varlen_func(q, k, v, registry="cpu", **args)
    assert "flash_attn_varlen_func" in str(e.value) and text in str(e.value), str(e.value)
    if argument:
        assert e.value.argument == argument
