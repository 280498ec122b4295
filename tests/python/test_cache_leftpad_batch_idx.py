"""flash-attn's cache_leftpad and cache_batch_idx in flash_attn_with_kvcache,
every backend, against the float64 serving reference applied to each
sequence's own keys: sequence b reads cache row cache_batch_idx[b] (b without
it), rows [cache_leftpad[b], cache_seqlens[b] + seqlen_new) after k/v were
appended at cache_seqlens[b], its positions counted from cache_leftpad[b]
(flash-attn's attention_ref with key_leftpad), through the decode
(seqlen_q == 1) and prefill kernels, with GQA, causal, windows, chunks,
softcap, sinks, the LSE and paged caches (there cache_batch_idx picks sequence b's block-table row,
flash-attn 3's page_table[cache_batch_idx]); and every bad table refused
before any kernel runs."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _native, reference
from numerics import BF16, F16, randn
from serving_cases import assert_out_lse, paged, with_sinks

FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, window_size=(6, -1)),
    "window_both": dict(window_size=(4, 3)),
    "chunk": dict(causal=True, attention_chunk=5),
    "softcap_sinks": dict(causal=True, softcap=2.0, sinks=True),
}
B, H, HKV, D, CAP = 3, 4, 2, 64, 48


def _expected(q, k_rows, v_rows, lens, leftpad, kw):
    """(out [B, qL, H, D], lse [B, H, qL]) of each sequence over its own keys."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, lse = reference.attend_sequence(q[b], k_rows[b][leftpad[b]:lens[b]], v_rows[b][leftpad[b]:lens[b]], **kw)
        outs.append(o)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


def _case(rng, dtype, q_len, n_new, *, batch_idx: bool, leftpad: bool):
    rows = 2 * B if batch_idx else B
    k_cache, v_cache = randn(rng, (rows, CAP, HKV, D), dtype), randn(rng, (rows, CAP, HKV, D), dtype)
    idx = rng.permutation(rows)[:B].astype(np.int32) if batch_idx else np.arange(B, dtype=np.int32)
    seqlens = np.array([30, 0, 41][:B], dtype=np.int32) if n_new else np.array([30, 1, 47], dtype=np.int32)
    seqlens = np.minimum(seqlens, CAP - n_new).astype(np.int32)
    lp = np.array([7, 0, 19], dtype=np.int32) if leftpad else np.zeros(B, dtype=np.int32)
    lp = np.minimum(lp, seqlens).astype(np.int32)
    q = randn(rng, (B, q_len, H, D), dtype)
    k_new = randn(rng, (B, n_new, HKV, D), dtype) if n_new else None
    v_new = randn(rng, (B, n_new, HKV, D), dtype) if n_new else None
    return k_cache, v_cache, idx, seqlens, lp, q, k_new, v_new


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("q_len,n_new", [(1, 0), (1, 1), (5, 0), (5, 5)])
@pytest.mark.parametrize("mode", ["leftpad", "batch_idx", "both"])
def test_kvcache(registry, rng, mode, q_len, n_new, feature):
    batch_idx, leftpad = mode in ("batch_idx", "both"), mode in ("leftpad", "both")
    dtype = BF16 if q_len > 1 or feature != "plain" else F16
    k_cache, v_cache, idx, seqlens, lp, q, k_new, v_new = _case(rng, dtype, q_len, n_new, batch_idx=batch_idx,
                                                                leftpad=leftpad)
    kw = with_sinks(rng, FEATURES[feature], H)
    k_ref, v_ref = k_cache[idx].copy(), v_cache[idx].copy()
    for b in range(B):
        if n_new:
            k_ref[b, seqlens[b]:seqlens[b] + n_new] = k_new[b]
            v_ref[b, seqlens[b]:seqlens[b] + n_new] = v_new[b]
    before_k = k_cache.copy()
    out, lse = fm.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
        cache_batch_idx=idx if batch_idx else None, cache_leftpad=lp if leftpad else None,
        return_softmax_lse=True, registry=registry, **kw)
    e_out, e_lse = _expected(q, k_ref, v_ref, seqlens + n_new, lp, kw)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{registry.backend} {mode} qL={q_len} new={n_new} {feature}")
    # The appended rows landed in each sequence's own cache row; the other rows are untouched.
    np.testing.assert_array_equal(k_cache[idx], k_ref)
    others = np.setdiff1d(np.arange(k_cache.shape[0]), idx)
    np.testing.assert_array_equal(k_cache[others], before_k[others])


@pytest.mark.parametrize("q_len,n_new", [(1, 0), (1, 2), (4, 4)])
@pytest.mark.parametrize("feature", ["plain", "causal_window", "chunk"])
def test_leftpad_paged(registry, rng, q_len, n_new, feature):
    """cache_leftpad over a paged cache: the first key is a logical position."""
    dtype = BF16
    lens = [21, 3, 36]
    lp = np.array([5, 3, 17], dtype=np.int32)
    k_rows = [randn(rng, (n, HKV, D), dtype) for n in lens]
    v_rows = [randn(rng, (n, HKV, D), dtype) for n in lens]
    (k_cache, v_cache), table = paged(rng, [k_rows, v_rows], 16, room=n_new)
    q = randn(rng, (B, q_len, H, D), dtype)
    k_new = randn(rng, (B, n_new, HKV, D), dtype) if n_new else None
    v_new = randn(rng, (B, n_new, HKV, D), dtype) if n_new else None
    kw = FEATURES[feature]
    out, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=np.array(lens, np.int32),
                                          cache_leftpad=lp, block_table=table, return_softmax_lse=True,
                                          registry=registry, **kw)
    k_all = [np.concatenate([r, k_new[b]]) if n_new else r for b, r in enumerate(k_rows)]
    v_all = [np.concatenate([r, v_new[b]]) if n_new else r for b, r in enumerate(v_rows)]
    e_out, e_lse = _expected(q, k_all, v_all, [n + n_new for n in lens], lp, kw)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{registry.backend} paged leftpad qL={q_len} {feature}")


@pytest.mark.parametrize("page_size", [16, 5])
@pytest.mark.parametrize("q_len,n_new", [(1, 0), (1, 2), (4, 4)])
@pytest.mark.parametrize("feature", ["plain", "causal_window", "chunk", "softcap_sinks"])
def test_batch_idx_paged(registry, rng, page_size, q_len, n_new, feature):
    """cache_batch_idx with a paged cache (flash-attn 3's test_flash_attn_kvcache
    with has_batch_idx and page_size): sequence b reads and appends through
    block-table row cache_batch_idx[b]; the rows and pages of the cache rows
    no sequence names are untouched."""
    rows = 2 * B
    lens_all = [21, 3, 36, 9, 30, 0][:rows]
    k_rows = [randn(rng, (n, HKV, D), BF16) for n in lens_all]
    v_rows = [randn(rng, (n, HKV, D), BF16) for n in lens_all]
    (k_cache, v_cache), table = paged(rng, [k_rows, v_rows], page_size, room=n_new)
    idx = rng.permutation(rows)[:B].astype(np.int32)
    lens = np.array([lens_all[r] for r in idx], np.int32)
    lp = np.minimum(np.array([2, 0, 5], np.int32), lens)
    q = randn(rng, (B, q_len, H, D), BF16)
    k_new = randn(rng, (B, n_new, HKV, D), BF16) if n_new else None
    v_new = randn(rng, (B, n_new, HKV, D), BF16) if n_new else None
    kw = with_sinks(rng, FEATURES[feature], H)
    before_k, before_v = k_cache.copy(), v_cache.copy()
    out, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, cache_batch_idx=idx,
                                          cache_leftpad=lp, block_table=table, return_softmax_lse=True,
                                          registry=registry, **kw)
    k_all = [np.concatenate([k_rows[r], k_new[b]]) if n_new else k_rows[r] for b, r in enumerate(idx)]
    v_all = [np.concatenate([v_rows[r], v_new[b]]) if n_new else v_rows[r] for b, r in enumerate(idx)]
    e_out, e_lse = _expected(q, k_all, v_all, lens + n_new, lp, kw)
    what = f"{registry.backend} paged batch_idx page {page_size} qL={q_len} new={n_new} {feature}"
    assert_out_lse(out, lse, e_out, e_lse, BF16, what)
    r_out, r_lse = reference.flash_attn_kvcache(q, before_k, before_v, k=k_new, v=v_new, cache_seqlens=lens,
                                                block_table=table, cache_batch_idx=idx, cache_leftpad=lp, **kw)
    assert_out_lse(out, lse, r_out, r_lse, BF16, what + " (reference.flash_attn_kvcache)")
    if n_new:
        k_ref, v_ref = reference.kv_append(before_k, before_v, k_new, v_new, lens, table[idx])
        np.testing.assert_array_equal(k_cache, k_ref)
        np.testing.assert_array_equal(v_cache, v_ref)
    else:
        np.testing.assert_array_equal(k_cache, before_k)


def test_batch_idx_paged_duplicates_refused_when_appending(rng):
    k_cache, v_cache = randn(rng, (4, 16, 1, D), BF16), randn(rng, (4, 16, 1, D), BF16)
    table = np.array([[0, 1], [2, 3]], np.int32)
    before = k_cache.copy()
    k = randn(rng, (2, 1, 1, D), BF16)
    with pytest.raises(fm.InvalidValueError, match=r"cache_batch_idx\[0\] and cache_batch_idx\[1\] both name cache "
                                                   r"row 1") as e:
        fm.flash_attn_with_kvcache(randn(rng, (2, 1, 2, D), BF16), k_cache, v_cache, k, k, block_table=table,
                                   cache_seqlens=np.array([3, 4], np.int32),
                                   cache_batch_idx=np.array([1, 1], np.int32), registry="cpu")
    assert e.value.argument == "cache_batch_idx"
    np.testing.assert_array_equal(k_cache, before)


def test_leftpad_past_the_keys_sees_nothing(registry, rng):
    """A first key at or past the sequence's end leaves it no key: output 0,
    LSE -inf (flash-attn's key_padding_mask is then all False)."""
    k_cache, v_cache = randn(rng, (2, 32, 1, D), BF16), randn(rng, (2, 32, 1, D), BF16)
    for q_len in (1, 3):
        q = randn(rng, (2, q_len, 2, D), BF16)
        out, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=np.array([10, 20], np.int32),
                                              cache_leftpad=np.array([10, 25], np.int32), return_softmax_lse=True,
                                              registry=registry)
        assert not np.asarray(out).any() and np.isneginf(np.asarray(lse)).all(), (registry.backend, q_len)


def test_leftpad_zero_is_bit_identical_to_none(registry, rng):
    k_cache, v_cache, _, seqlens, _, q, _, _ = _case(rng, BF16, 1, 0, batch_idx=False, leftpad=False)
    for q_len in (1, 5):
        q = randn(rng, (B, q_len, H, D), BF16)
        a = fm.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, registry=registry)
        b = fm.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                       cache_leftpad=np.zeros(B, np.int32), registry=registry)
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def _call(rng, **kw):
    k_cache, v_cache = randn(rng, (4, 32, 1, D), BF16), randn(rng, (4, 32, 1, D), BF16)
    args = dict(cache_seqlens=np.array([3, 4], np.int32))
    args.update(kw)
    return k_cache, v_cache, lambda q_len=1: fm.flash_attn_with_kvcache(
        randn(rng, (2, q_len, 2, D), BF16), k_cache, v_cache, registry="cpu", **args)


@pytest.mark.parametrize("kw,exc,argument,text", [
    (dict(cache_batch_idx=np.array([0, 4], np.int32)), fm.InvalidValueError, "cache_batch_idx",
     "cache_batch_idx[1] = 4 is out of range [0, 4)"),
    (dict(cache_batch_idx=np.array([-1, 0], np.int32)), fm.InvalidValueError, "cache_batch_idx",
     "cache_batch_idx[0] = -1"),
    (dict(cache_batch_idx=np.array([0, 1, 2], np.int32)), fm.InvalidValueError, "cache_batch_idx", "shape [2]"),
    (dict(cache_batch_idx=np.array([0.5, 1.0])), fm.InvalidTypeError, None, "cache_batch_idx must hold integers"),
    (dict(cache_batch_idx=np.array([0, 2], np.int32), block_table=np.array([[0], [1]], np.int32)),
     fm.InvalidValueError, "cache_batch_idx", "cache_batch_idx[1] = 2 is out of range [0, 2) (block_table's dim 0)"),
    (dict(cache_batch_idx=np.array([0, 1], np.int32), block_table=np.array([0, 1], np.int32)),
     fm.InvalidValueError, "block_table", "block_table must be int32 [batch_cache, max_pages]"),
    (dict(cache_batch_idx=np.array([0, 1], np.int32), cache_seqlens=np.array([3, 33], np.int32)),
     fm.InvalidValueError, "cache_seqlens", "cache_seqlens[1] = 33 is out of range [0, 32]"),
    (dict(cache_batch_idx=np.array([0, 1], np.int32), cache_leftpad=np.array([0, 33], np.int32)), fm.InvalidValueError, "cache_leftpad",
     "cache_leftpad[1] = 33 is out of range [0, 32]"),
    (dict(cache_batch_idx=np.array([0, 1], np.int32), cache_leftpad=np.array([-2, 0], np.int32)),
     fm.InvalidValueError, "cache_leftpad", "cache_leftpad[0] = -2"),
    (dict(cache_batch_idx=np.array([0, 1], np.int32), cache_leftpad=np.array([[0, 0]], np.int32)), fm.InvalidValueError, "cache_leftpad", "shape [2]"),
])
def test_bad_tables(rng, kw, exc, argument, text):
    k_cache, _, call = _call(rng, **kw)
    before = k_cache.copy()
    for q_len in (1, 3):
        with pytest.raises(exc) as e:
            call(q_len)
        assert "flash_attn_with_kvcache" in str(e.value) and text in str(e.value), str(e.value)
        if argument:
            assert e.value.argument == argument
    np.testing.assert_array_equal(k_cache, before)


def test_duplicate_rows_refused_when_appending(rng):
    k_cache, v_cache = randn(rng, (4, 32, 1, D), BF16), randn(rng, (4, 32, 1, D), BF16)
    before = k_cache.copy()
    k = randn(rng, (2, 1, 1, D), BF16)
    with pytest.raises(fm.InvalidValueError, match=r"cache_batch_idx\[0\] and cache_batch_idx\[1\] both name cache "
                                                   r"row 3") as e:
        fm.flash_attn_with_kvcache(randn(rng, (2, 1, 2, D), BF16), k_cache, v_cache, k, k,
                                   cache_seqlens=np.array([3, 4], np.int32),
                                   cache_batch_idx=np.array([3, 3], np.int32), registry="cpu")
    assert e.value.argument == "cache_batch_idx"
    np.testing.assert_array_equal(k_cache, before)
    # Reading (no append) through one row twice is fine.
    fm.flash_attn_with_kvcache(randn(rng, (2, 1, 2, D), BF16), k_cache, v_cache,
                               cache_seqlens=np.array([3, 4], np.int32), cache_batch_idx=np.array([3, 3], np.int32),
                               registry="cpu")


def test_batch_idx_any_capacity(registry, rng):
    """Cache rows of any length (20: not a multiple of the kernels' key
    tile) are read and appended to as one page each; a capacity of 0 is refused."""
    k_cache, v_cache = randn(rng, (3, 20, HKV, D), BF16), randn(rng, (3, 20, HKV, D), BF16)
    idx, lens = np.array([2, 0], np.int32), np.array([3, 17], np.int32)
    for q_len in (1, 4):
        kc, vc = k_cache.copy(), v_cache.copy()
        q = randn(rng, (2, q_len, H, D), BF16)
        k_new, v_new = randn(rng, (2, 2, HKV, D), BF16), randn(rng, (2, 2, HKV, D), BF16)
        out, lse = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, cache_batch_idx=idx,
                                              causal=True, return_softmax_lse=True, registry=registry)
        k_ref, v_ref = reference.kv_append(k_cache[idx], v_cache[idx], k_new, v_new, lens)
        np.testing.assert_array_equal(kc[idx], k_ref)
        e_out, e_lse = _expected(q, k_ref, v_ref, lens + 2, np.zeros(2, np.int64), dict(causal=True))
        assert_out_lse(out, lse, e_out, e_lse, BF16, f"{registry.backend} batch_idx cap 20 qL={q_len}")
    empty = randn(rng, (3, 0, HKV, D), BF16)
    with pytest.raises(fm.InvalidValueError, match="capacity .* of at least one key, got 0") as e:
        fm.flash_attn_with_kvcache(randn(rng, (2, 1, H, D), BF16), empty, empty, cache_seqlens=np.zeros(2, np.int32),
                                   cache_batch_idx=idx, registry="cpu")
    assert e.value.argument == "cache_batch_idx"


def test_c_abi_checks_the_starts_row(rng):
    """The library itself checks a [2, B] seqlens table's second row (the
    first keys) before any kernel reads through it, naming cache_leftpad."""
    q = randn(rng, (2, 1, 2, D), BF16)
    k_cache = randn(rng, (2, 32, 1, D), BF16)
    table = np.array([[3, 4], [0, 40]], np.int32)
    for q_len in (1, 3):
        q = randn(rng, (2, q_len, 2, D), BF16)
        with pytest.raises(fm.InvalidValueError, match=r"cache_leftpad\[1\] = 40 is out of range") as e:
            fm.serving._attend(fm.Registry("cpu"), "flash_attn_with_kvcache", q, k_cache, k_cache,
                               fm.serving.attn_options("flash_attn_with_kvcache", head_dim=D, softmax_scale=None,
                                                       softcap=0.0, causal=False, window_size=(-1, -1)),
                               sinks=None, want_lse=False, seqlens_k=table)()
        assert e.value.argument == "cache_leftpad"


def test_leftpad_with_bad_cache_or_lengths_shape(rng):
    q = randn(rng, (2, 1, 2, D), BF16)
    k3 = randn(rng, (2, 32, D), BF16)
    with pytest.raises(fm.InvalidValueError, match="k_cache must have rank 4") as e:
        fm.flash_attn_with_kvcache(q, k3, k3, cache_leftpad=np.zeros(2, np.int32), registry="cpu")
    assert e.value.argument == "k_cache"
    k4 = randn(rng, (2, 32, 1, D), BF16)
    with pytest.raises(fm.InvalidValueError, match=r"cache_seqlens must have shape \[2\]") as e:
        fm.flash_attn_with_kvcache(q, k4, k4, cache_seqlens=np.array([1, 2, 3], np.int32),
                                   cache_leftpad=np.zeros(2, np.int32), registry="cpu")
    assert e.value.argument == "cache_seqlens"


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "codes"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["lens", "leftpad"])
def test_batch_idx_row_room_with_appends(registry, rng, quantized, leftpad):
    """With cache_batch_idx over a cache's rows, each sequence's keys and the
    rows it appends stay in its own row: the library names cache_seqlens
    (cache_leftpad beside it or not) and writes no row."""
    k_cache = randn(rng, (3, 16, HKV, D), BF16)
    cache = fm.KVCodec(D, 4).encode(k_cache, registry=registry) if quantized else k_cache
    before = (cache.codes if quantized else cache).copy()
    q, k_new = randn(rng, (2, 1, H, D), BF16), randn(rng, (2, 2, HKV, D), BF16)
    with pytest.raises(fm.InvalidValueError) as e:
        fm.flash_attn_with_kvcache(q, cache, cache, k=k_new, v=k_new, cache_seqlens=np.array([3, 15], np.int32),
                                   cache_batch_idx=np.array([2, 0], np.int32),
                                   cache_leftpad=np.array([0, 1], np.int32) if leftpad else None, registry=registry)
    assert str(e.value) == ("flash_attn_with_kvcache: cache_seqlens[1] = 15 is out of range [0, 14] (k_cache's "
                            "dim 1, 16, less the 2 appended rows)")
    assert e.value.argument == "cache_seqlens"
    assert np.array_equal(cache.codes if quantized else cache, before)


def test_c_abi_batch_idx_refusals(rng):
    """The library's own cache_batch_idx rules where the public API cannot
    reach them: not beside packed keys (cu_seqlens_k), and no output
    sharing its memory."""
    from flashmetal._serving_args import seq_tensors
    from flashmetal._arrays import tensor
    ffi = _native.ffi()
    q = randn(rng, (2, 1, 2, D), BF16)
    k_cache = randn(rng, (3, 8, 1, D), BF16)
    opts = fm.serving.attn_options("flash_attn_with_kvcache", head_dim=D, softmax_scale=None, softcap=0.0,
                                   causal=False, window_size=(-1, -1))
    idx = np.array([2, 0], np.int32)
    seq, keep = seq_tensors(ffi, cache_batch_idx=idx, cu_seqlens_k=np.array([0, 4, 8], np.int32),
                            seqlens_k=np.array([4, 4], np.int32))
    out = np.zeros_like(q)
    with pytest.raises(fm.InvalidValueError, match="cu_seqlens_k must be NULL") as e:
        _native.call(fm.Registry("cpu"), "fm_dispatch_attn", tensor(ffi, q), tensor(ffi, k_cache),
                     tensor(ffi, k_cache), seq, tensor(ffi, out), opts, op="flash_attn_with_kvcache")
    assert e.value.argument == "cache_batch_idx"
    # out [2, 1, 2, D] bf16 over the bytes of cache_batch_idx: refused, nothing written.
    shared = np.zeros(q.size, np.uint16)
    alias = shared[:4].view(np.int32)
    alias[:] = [2, 0]
    seq, keep = seq_tensors(ffi, cache_batch_idx=alias, seqlens_k=np.array([4, 4], np.int32))
    with pytest.raises(fm.InvalidValueError, match="overlap|share") as e:
        _native.call(fm.Registry("cpu"), "fm_dispatch_vec_seq", tensor(ffi, q.reshape(2, 2, D)), tensor(ffi, k_cache),
                     tensor(ffi, k_cache), seq, ffi.NULL, tensor(ffi, shared.view(BF16).reshape(2, 2, D)), opts,
                     op="flash_attn_with_kvcache")
    assert list(alias) == [2, 0]
