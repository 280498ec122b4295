"""flash_attn_with_kvcache with ragged queries and new keys (flash-attn 3's
cu_seqlens_q, max_seqlen_q, cu_seqlens_k_new) on every backend, against the
float64 serving reference applied to each sequence on its own: sequence b's
new keys k[cu_seqlens_k_new[b]:...[b+1]] land at its cache rows
cache_seqlens[b]..., then its queries q[cu_seqlens_q[b]:...[b+1]] attend to
its cache rows [cache_leftpad[b], cache_seqlens[b] + new_b), bottom-right
aligned per sequence, with causal, windows, chunks, softcap, sinks, ALiBi,
the LSE ([H, total_q], as flash-attn's varlen), rotary, paged caches and
cache_batch_idx; sequences with no query or no new key; flash-attn's own test
layout (ragged q over dense new keys); and every bad table refused before
anything is appended (the caches unchanged)."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, randn
from serving_cases import assert_out_lse, cu, feature_kw, paged, ragged_features

OP = "flash_attn_with_kvcache"
H, HKV, D = 4, 2, 64
Q_LENS, NEW_LENS = [3, 0, 5, 1], [2, 0, 5, 1]
CACHE_LENS = np.array([10, 4, 0, 20], dtype=np.int32)
LEFTPAD = np.array([3, 0, 0, 7], dtype=np.int32)
CAP = 32
FEATURES = ragged_features(window=(4, 1))


def _expected(q, cq, k_rows, v_rows, ends, starts, kw):
    """(out [total_q, H, D], lse [H, total_q]) of each sequence over its keys
    k_rows[b][starts[b]:ends[b]] (k_rows[b]: its cache after the append)."""
    out = np.zeros(q.shape, np.float64)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cq) - 1):
        s, e = int(cq[b]), int(cq[b + 1])
        kwb = dict(kw)
        if "alibi_slopes" in kw and np.ndim(kw["alibi_slopes"]) == 2:
            kwb["alibi_slopes"] = kw["alibi_slopes"][b]
        out[s:e], lse[:, s:e] = reference.attend_sequence(q[s:e], k_rows[b][starts[b]:ends[b]],
                                                          v_rows[b][starts[b]:ends[b]], **kwb)
    return out, lse


def _appended(k_rows, lens, k_new, ck):
    """Each sequence's rows (copies) with its new keys written at lens[b]."""
    rows = [r.copy() for r in k_rows]
    for b in range(len(rows)):
        rows[b][lens[b]:lens[b] + ck[b + 1] - ck[b]] = k_new[ck[b]:ck[b + 1]]
    return rows


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("cache", ["contiguous", "paged16", "batch_idx", "paged_batch_idx", "leftpad"])
def test_ragged_append_and_attend(registry, rng, cache, feature):
    dtype = BF16 if feature != "plain" else F16
    batch = len(Q_LENS)
    cq, ck = cu(Q_LENS), cu(NEW_LENS)
    q = randn(rng, (int(cq[-1]), H, D), dtype)
    k_new, v_new = randn(rng, (int(ck[-1]), HKV, D), dtype), randn(rng, (int(ck[-1]), HKV, D), dtype)
    rows_k = [randn(rng, (CAP, HKV, D), dtype) for _ in range(batch)]
    rows_v = [randn(rng, (CAP, HKV, D), dtype) for _ in range(batch)]
    kw = feature_kw(rng, FEATURES[feature], len(Q_LENS), H)
    extra: dict = {}
    seq_table = None  # sequence b's pages: its block-table row
    if cache == "paged16":
        (kc, vc), table = paged(rng, [rows_k, rows_v], 16)
        extra["block_table"] = seq_table = table
    elif cache == "paged_batch_idx":  # block-table row cache_batch_idx[b] of 8
        idx = np.array([5, 1, 6, 2], dtype=np.int32)
        all_k = [randn(rng, (CAP, HKV, D), dtype) for _ in range(8)]
        all_v = [randn(rng, (CAP, HKV, D), dtype) for _ in range(8)]
        for b, r in enumerate(idx):
            all_k[r], all_v[r] = rows_k[b], rows_v[b]
        (kc, vc), table = paged(rng, [all_k, all_v], 16)
        extra["block_table"], extra["cache_batch_idx"], seq_table = table, idx, table[idx]
    elif cache == "batch_idx":
        idx = np.array([5, 1, 6, 2], dtype=np.int32)
        kc, vc = randn(rng, (8, CAP, HKV, D), dtype), randn(rng, (8, CAP, HKV, D), dtype)
        kc[idx], vc[idx] = np.stack(rows_k), np.stack(rows_v)
        extra["cache_batch_idx"] = idx
    else:
        kc, vc = np.stack(rows_k), np.stack(rows_v)
    starts = LEFTPAD if cache == "leftpad" else np.zeros(batch, np.int32)
    if cache == "leftpad":
        extra["cache_leftpad"] = LEFTPAD
    before_k, before_v = kc.copy(), vc.copy()
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=CACHE_LENS, cu_seqlens_q=cq,
                                          cu_seqlens_k_new=ck, max_seqlen_q=max(Q_LENS), return_softmax_lse=True,
                                          registry=registry, **extra, **kw)
    assert np.asarray(out).shape == q.shape and np.asarray(lse).shape == (H, q.shape[0])
    exp_k, exp_v = _appended(rows_k, CACHE_LENS, k_new, ck), _appended(rows_v, CACHE_LENS, v_new, ck)
    ends = CACHE_LENS + np.diff(ck)
    e_out, e_lse = _expected(q, cq, exp_k, exp_v, ends, starts, kw)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{registry.backend} {cache} {feature}")
    # The new keys landed in each sequence's own rows, bit for bit; nothing else changed.
    for b in range(batch):
        if seq_table is not None:
            got_k = reference.paged_rows(kc, seq_table[b], CAP)
            got_v = reference.paged_rows(vc, seq_table[b], CAP)
        else:
            r = extra["cache_batch_idx"][b] if cache == "batch_idx" else b
            got_k, got_v = kc[r], vc[r]
        np.testing.assert_array_equal(got_k[:ends[b]], exp_k[b][:ends[b]])
        np.testing.assert_array_equal(got_v[:ends[b]], exp_v[b][:ends[b]])
    # Every other slot of the caches (spare pages, other rows) is untouched.
    for cache_now, before, new in ((kc, before_k, k_new), (vc, before_v, v_new)):
        want = before.copy()
        for b in range(batch):
            for i in range(int(ck[b]), int(ck[b + 1])):
                t = int(CACHE_LENS[b]) + i - int(ck[b])
                if seq_table is not None:
                    want[seq_table[b, t // 16], t % 16] = new[i]
                else:
                    want[extra["cache_batch_idx"][b] if cache == "batch_idx" else b, t] = new[i]
        np.testing.assert_array_equal(cache_now, want)


def test_ragged_queries_over_dense_new_keys(registry, rng):
    """flash-attn's test layout: q ragged, k/v [B, seqlen_new, Hkv, D]."""
    batch, n_new = 3, 2
    q_lens = [2, 4, 1]
    cq = cu(q_lens)
    lens = np.array([5, 0, 17], np.int32)
    q = randn(rng, (int(cq[-1]), H, D), BF16)
    kc, vc = randn(rng, (batch, 24, HKV, D), BF16), randn(rng, (batch, 24, HKV, D), BF16)
    k, v = randn(rng, (batch, n_new, HKV, D), BF16), randn(rng, (batch, n_new, HKV, D), BF16)
    exp_k, exp_v = reference.kv_append(kc, vc, k, v, lens)
    out = fm.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cu_seqlens_q=cq, max_seqlen_q=4,
                                     causal=True, registry=registry)
    np.testing.assert_array_equal(kc, exp_k)
    e_out, _ = _expected(q, cq, list(exp_k), list(exp_v), lens + n_new, np.zeros(batch, int), dict(causal=True))
    assert_out_lse(out, None, e_out, None, BF16, f"{registry.backend} ragged q, dense k")


def test_dense_queries_over_ragged_new_keys(registry, rng):
    """q [B, qL, H, D] with cu_seqlens_k_new: out [B, qL, H, D], lse [B, H, qL]."""
    batch, ql = 3, 2
    new = [1, 3, 0]
    ck = cu(new)
    lens = np.array([4, 9, 2], np.int32)
    q = randn(rng, (batch, ql, H, D), F16)
    kc, vc = randn(rng, (batch, 16, HKV, D), F16), randn(rng, (batch, 16, HKV, D), F16)
    k, v = randn(rng, (int(ck[-1]), HKV, D), F16), randn(rng, (int(ck[-1]), HKV, D), F16)
    exp_k, exp_v = _appended(list(kc), lens, k, ck), _appended(list(vc), lens, v, ck)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cu_seqlens_k_new=ck, causal=True,
                                          return_softmax_lse=True, registry=registry)
    assert np.asarray(out).shape == q.shape and np.asarray(lse).shape == (batch, H, ql)
    e_out, e_lse = _expected(q.reshape(-1, H, D), cu([ql] * batch), exp_k, exp_v, lens + np.array(new),
                             np.zeros(batch, int), dict(causal=True))
    assert_out_lse(out, lse, e_out.reshape(q.shape), e_lse.reshape(H, batch, ql).transpose(1, 0, 2), F16,
                   f"{registry.backend} dense q, ragged k")


def test_ragged_queries_without_append(registry, rng):
    """cu_seqlens_q alone: a chunk of each sequence's queries over its cache;
    rows past cu_seqlens_q[-1] read 0 (LSE -inf); out= filled in place."""
    q_lens = [3, 0, 2]
    cq = cu(q_lens)
    lens = np.array([7, 3, 12], np.int32)
    q = randn(rng, (int(cq[-1]) + 2, H, D), BF16)
    kc, vc = randn(rng, (3, 16, HKV, D), BF16), randn(rng, (3, 16, HKV, D), BF16)
    out = np.full(q.shape, 7, BF16)
    got, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cu_seqlens_q=cq, max_seqlen_q=3,
                                          window_size=(2, 0), out=out, return_softmax_lse=True, registry=registry)
    assert got is out
    e_out, e_lse = _expected(q, cq, list(kc), list(vc), lens, np.zeros(3, int), dict(window_size=(2, 0)))
    assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} ragged q, no append")
    assert (out[int(cq[-1]):].astype(np.float32) == 0).all() and np.isneginf(lse[:, int(cq[-1]):]).all()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_ragged_rotary(registry, rng, causal, interleaved):
    """The new keys of sequence b rotated at cache_seqlens[b] + i; its q rows
    at cache_seqlens[b] + i when causal, else all at cache_seqlens[b]."""
    q_lens, new = [2, 3, 0], [2, 1, 1]
    cq, ck = cu(q_lens), cu(new)
    lens = np.array([3, 0, 8], np.int32)
    rot = 32
    angle = rng.random((16, rot // 2)) * 2 * np.pi
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    q = randn(rng, (int(cq[-1]), H, D), BF16)
    k, v = randn(rng, (int(ck[-1]), HKV, D), BF16), randn(rng, (int(ck[-1]), HKV, D), BF16)
    kc, vc = randn(rng, (3, 16, HKV, D), BF16), randn(rng, (3, 16, HKV, D), BF16)
    q0, k0 = q.copy(), k.copy()
    out = fm.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                     cu_seqlens_q=cq, cu_seqlens_k_new=ck, max_seqlen_q=3, causal=causal,
                                     rotary_interleaved=interleaved, registry=registry)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    q_ro, k_ro = np.empty_like(q), np.empty_like(k)
    for b in range(3):
        s, e = int(cq[b]), int(cq[b + 1])
        if e > s:
            x = q[None, s:e] if causal else q[s:e].reshape(1, 1, (e - s) * H, D)
            q_ro[s:e] = reference.apply_rotary_emb(x, cos, sin, int(lens[b]), interleaved=interleaved) \
                .reshape(e - s, H, D).astype(BF16)
        s, e = int(ck[b]), int(ck[b + 1])
        k_ro[s:e] = reference.apply_rotary_emb(k[None, s:e], cos, sin, int(lens[b]), interleaved=interleaved)[0] \
            .astype(BF16)
    exp_k, exp_v = _appended(list(kc), lens, k_ro, ck), _appended(list(vc), lens, v, ck)
    # The rotated keys in the cache: the kernel's float32 rotation rounded once (one bf16 ulp of the reference's).
    for b in range(3):
        e = lens[b] + new[b]
        np.testing.assert_allclose(kc[b, :e].astype(np.float64), exp_k[b][:e].astype(np.float64), rtol=1e-2, atol=1e-2)
    e_out, _ = _expected(q_ro, cq, exp_k, exp_v, lens + np.array(new), np.zeros(3, int), dict(causal=causal))
    assert_out_lse(out, None, e_out, None, BF16, f"{registry.backend} ragged rotary causal={causal}")


# ---- errors: each before anything is appended -------------------------------------------------

def _error_case(rng):
    cq, ck = cu([2, 1]), cu([1, 2])
    q = randn(rng, (3, H, D), BF16)
    k, v = randn(rng, (3, HKV, D), BF16), randn(rng, (3, HKV, D), BF16)
    kc, vc = randn(rng, (2, 8, HKV, D), BF16), randn(rng, (2, 8, HKV, D), BF16)
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=np.array([2, 5], np.int32),
                cu_seqlens_q=cq, cu_seqlens_k_new=ck, max_seqlen_q=2)


ERRORS = {
    "k rows short of cu_seqlens_k_new": (dict(cu_seqlens_k_new=np.array([0, 1, 4], np.int32)), "cu_seqlens_k_new",
                                        "cu_seqlens_k_new[2] = 4 must equal the rows of k (its dim 0, 3)"),
    "cu_seqlens_k_new length": (dict(cu_seqlens_k_new=np.array([0, 3], np.int32)), "cu_seqlens_k_new",
                                "cu_seqlens_k_new has 2 entries; it must have B+1 = 3 (B = 2 sequences)"),
    "non-monotone q": (dict(cu_seqlens_q=np.array([0, 3, 2], np.int32)), "cu_seqlens_q",
                       "cu_seqlens_q[2] = 2 is less than cu_seqlens_q[1] = 3 (the offsets must be non-decreasing)"),
    "non-monotone k": (dict(cu_seqlens_k_new=np.array([0, 2, 1], np.int32)), "cu_seqlens_k_new",
                       "cu_seqlens_k_new[2] = 1 is less than cu_seqlens_k_new[1] = 2"),
    "q start": (dict(cu_seqlens_q=np.array([1, 2, 3], np.int32)), "cu_seqlens_q", "cu_seqlens_q[0] = 1 must be 0"),
    "q past total": (dict(cu_seqlens_q=np.array([0, 2, 4], np.int32)), "cu_seqlens_q",
                     "cu_seqlens_q[2] = 4 must be at most the rows of q (its dim 0, 3)"),
    "max_seqlen_q small": (dict(max_seqlen_q=1), "max_seqlen_q",
                           "max_seqlen_q = 1 is less than sequence 0's query rows (cu_seqlens_q[1] - cu_seqlens_q[0] = 2)"),
    "max_seqlen_q missing": (dict(max_seqlen_q=None), "max_seqlen_q", "max_seqlen_q is required with cu_seqlens_q"),
    "overflow": (dict(cache_seqlens=np.array([2, 7], np.int32)), "cu_seqlens_k_new",
                 "sequence 1's new keys overflow its cache: cache_seqlens[1] + 2 new keys (cu_seqlens_k_new) = 9 "
                 "exceeds the 8 keys a sequence's cache holds"),
    "cache_seqlens range": (dict(cache_seqlens=np.array([-1, 0], np.int32)), "cache_seqlens",
                            "cache_seqlens[0] = -1 is out of range [0, 8]"),
    "cache_seqlens shape": (dict(cache_seqlens=np.array([1, 1, 1], np.int32)), "cache_seqlens",
                            "cache_seqlens must have shape [2]"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_ragged_errors_append_nothing(rng, case):
    args = _error_case(rng)
    change, argument, message = ERRORS[case]
    args.update(change)
    kc0, vc0 = args["k_cache"].copy(), args["v_cache"].copy()
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_with_kvcache(registry="cpu", **args)
    assert type(e.value) is fm.InvalidValueError
    assert e.value.op == OP and e.value.argument == argument, (e.value.op, e.value.argument)
    assert str(e.value).startswith(f"{OP}: ") and message in str(e.value), str(e.value)
    np.testing.assert_array_equal(args["k_cache"], kc0)
    np.testing.assert_array_equal(args["v_cache"], vc0)


def test_ragged_bad_pages_append_nothing(registry, rng):
    """A block-table entry out of range, or two sequences whose new keys
    would land on one slot, is refused before any key is written."""
    args = _error_case(rng)
    kc, vc = randn(rng, (4, 16, HKV, D), BF16), randn(rng, (4, 16, HKV, D), BF16)
    args.update(k_cache=kc, v_cache=vc)
    kc0 = kc.copy()
    for table, message in ((np.array([[0], [9]], np.int32), "block_table[1, 0] = 9 is out of range [0, 4)"),
                           (np.array([[2], [2]], np.int32), "block_table[0, 0] and block_table[1, 0] both name page 2")):
        args["cache_seqlens"] = np.array([5, 5], np.int32)
        with pytest.raises(fm.InvalidValueError) as e:
            fm.flash_attn_with_kvcache(block_table=table, registry=registry, **args)
        assert e.value.argument == "block_table" and message in str(e.value), str(e.value)
        np.testing.assert_array_equal(kc, kc0)


def test_ragged_page_size_zero(rng):
    args = _error_case(rng)
    empty = randn(rng, (2, 0, HKV, D), BF16)
    with pytest.raises(fm.InvalidValueError, match="k_cache page size 0 .* must be positive") as e:
        fm.flash_attn_with_kvcache(**dict(args, k_cache=empty, v_cache=empty.copy(), cache_seqlens=[0, 0]),
                                   block_table=np.array([[0], [1]], np.int32), registry="cpu")
    assert e.value.argument == "k_cache"


def test_ragged_refusals(rng):
    args = _error_case(rng)
    with pytest.raises(fm.InvalidValueError, match="cu_seqlens_k_new is given without k and v") as e:
        fm.flash_attn_with_kvcache(**{**args, "k": None, "v": None}, registry="cpu")
    assert e.value.argument == "cu_seqlens_k_new"
    dense = dict(args, q=randn(rng, (2, 1, H, D), BF16), cu_seqlens_q=None, cu_seqlens_k_new=None)
    with pytest.raises(fm.InvalidValueError, match="max_seqlen_q is given without cu_seqlens_q"):
        fm.flash_attn_with_kvcache(**dense, registry="cpu")
    with pytest.raises(fm.InvalidValueError, match=r"q must be \[total_q, H, D\] with cu_seqlens_q"):
        fm.flash_attn_with_kvcache(**dict(args, q=randn(rng, (1, 3, H, D), BF16)), registry="cpu")


def test_a_refused_attention_appends_nothing(registry, rng):
    """The library validates the append and the attention before either
    runs: an error only the attention finds (sinks of the wrong length)
    leaves the caches as they were, in a batch scope too."""
    args = _error_case(rng)
    kc0, vc0 = args["k_cache"].copy(), args["v_cache"].copy()
    with pytest.raises(fm.InvalidValueError, match="sinks"):
        with registry.batch():
            fm.flash_attn_with_kvcache(sinks=np.zeros(H + 1, np.float32), registry=registry, **args)
    np.testing.assert_array_equal(args["k_cache"], kc0)
    np.testing.assert_array_equal(args["v_cache"], vc0)
