"""Bad inputs to the serving API: the exact error type, a message
naming the public function, the argument and the bad value, and the
caller's arrays (caches, tables, lengths) left exactly as they were."""
from __future__ import annotations

import re

import numpy as np
import pytest

import flashmetal as fm
from serving_cases import BF16, F16, F32, cu, randn

KV = "flash_attn_with_kvcache"
VARLEN = "flash_attn_varlen_func"
FUNC = "flash_attn_func"


def snapshot(*arrays):
    return [np.array(a, copy=True) for a in arrays]


def unchanged(arrays, before):
    for a, b in zip(arrays, before):
        assert np.asarray(a).tobytes() == b.tobytes(), "a caller's array was modified"


def raises(cls, op: str, pattern: str, fn, *watched):
    """fn() raises cls (a flashmetal error with .op == op) matching
    '^op: .*pattern', and leaves the watched arrays untouched."""
    before = snapshot(*watched)
    with pytest.raises(cls, match=rf"^{op}: .*{pattern}") as e:
        fn()
    assert isinstance(e.value, fm.Error) and e.value.op == op
    unchanged(watched, before)


@pytest.fixture
def cache(rng):
    """q [2, 1, 4, 64], caches [2, 32, 2, 64] f16, lengths [5, 9], new k/v of one row."""
    return dict(q=randn(rng, (2, 1, 4, 64), F16), kc=randn(rng, (2, 32, 2, 64), F16),
                vc=randn(rng, (2, 32, 2, 64), F16), k=randn(rng, (2, 1, 2, 64), F16),
                v=randn(rng, (2, 1, 2, 64), F16), seqlens=np.array([5, 9], np.int32))


@pytest.fixture
def pages(rng):
    """A paged cache: 6 pages of 16, table [2, 3], lengths [20, 33]."""
    return dict(q=randn(rng, (2, 3, 4, 64), BF16), kc=randn(rng, (6, 16, 2, 64), BF16),
                vc=randn(rng, (6, 16, 2, 64), BF16), k=randn(rng, (2, 2, 2, 64), BF16),
                v=randn(rng, (2, 2, 2, 64), BF16), table=np.array([[4, 1, -1], [0, 5, 2]], np.int32),
                seqlens=np.array([20, 33], np.int32))


@pytest.mark.parametrize("ql", [1, 3])
@pytest.mark.parametrize("append", [False, True])
def test_bad_block_table_entries(pages, ql, append):
    p = pages
    q = p["q"][:, :ql]
    extra = (p["k"], p["v"]) if append else ()
    for bad, where in ((6, r"block_table\[1, 1\] = 6"), (-1, r"block_table\[1, 1\] = -1")):
        table = p["table"].copy()
        table[1, 1] = bad
        raises(ValueError, KV, where,
               lambda: fm.flash_attn_with_kvcache(q, p["kc"], p["vc"], *extra, cache_seqlens=p["seqlens"],
                                                  block_table=table, registry="cpu"),
               p["kc"], p["vc"], table, p["seqlens"])


@pytest.mark.parametrize("ql", [1, 3])
def test_block_table_too_short_for_a_length(pages, ql):
    p = pages
    lens = np.array([20, 49], np.int32)  # 49 keys need 4 pages of 16; the table row has 3
    raises(ValueError, KV, "49",
           lambda: fm.flash_attn_with_kvcache(p["q"][:, :ql], p["kc"], p["vc"], cache_seqlens=lens,
                                              block_table=p["table"], registry="cpu"), lens, p["table"])


def test_append_past_the_pages_is_refused_before_writing(pages):
    p = pages
    lens = np.array([20, 47], np.int32)  # 47 + 2 new rows need a 4th page
    raises(ValueError, KV, "",
           lambda: fm.flash_attn_with_kvcache(p["q"], p["kc"], p["vc"], p["k"], p["v"], cache_seqlens=lens,
                                              block_table=p["table"], registry="cpu"), p["kc"], p["vc"], lens)


@pytest.mark.parametrize("ql", [1, 3])
def test_page_size_zero(rng, ql):
    """Any positive page size is a page size (24, 3, 1...); 0 is refused."""
    kc, vc = randn(rng, (4, 0, 2, 64), BF16), randn(rng, (4, 0, 2, 64), BF16)
    table = np.array([[0, 1], [2, 3]], np.int32)
    raises(ValueError, KV, "page size.*must be positive",
           lambda: fm.flash_attn_with_kvcache(randn(rng, (2, ql, 4, 64), BF16), kc, vc, cache_seqlens=[0, 0],
                                              block_table=table, registry="cpu"), kc, vc, table)


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("bad", [33, -1, 2**31 - 1])
def test_cache_seqlens_out_of_range(cache, append, bad):
    c = cache
    lens = np.array([5, bad], np.int32)
    extra = (c["k"], c["v"]) if append else ()
    raises(ValueError, KV, rf"cache_seqlens.*{bad}",
           lambda: fm.flash_attn_with_kvcache(c["q"], c["kc"], c["vc"], *extra, cache_seqlens=lens,
                                              registry="cpu"), c["kc"], c["vc"], lens)


def test_append_past_the_capacity_is_refused_before_writing(cache):
    c = cache
    lens = np.array([5, 32], np.int32)  # 32 fits the cache, 32 + 1 does not
    raises(ValueError, KV, "",
           lambda: fm.flash_attn_with_kvcache(c["q"], c["kc"], c["vc"], c["k"], c["v"], cache_seqlens=lens,
                                              registry="cpu"), c["kc"], c["vc"], lens)


def test_cache_seqlens_types(cache):
    c = cache
    run = lambda lens: fm.flash_attn_with_kvcache(c["q"], c["kc"], c["vc"], cache_seqlens=lens, registry="cpu")  # noqa: E731
    raises(TypeError, KV, "cache_seqlens must hold integers", lambda: run(np.array([5.0, 9.0])))
    raises(TypeError, KV, "cache_seqlens must hold integers", lambda: run(np.array([True, False])))
    raises(ValueError, KV, "cache_seqlens holds 4294967296, outside the int32 range",
           lambda: run(np.array([5, 2**32], np.int64)))
    raises(ValueError, KV, "cache_seqlens", lambda: run(np.array([5, 9, 1], np.int32)))  # wrong length


def test_non_contiguous_or_read_only_caches_when_appending(cache):
    c = cache
    wide_k = np.zeros((2, 32, 2, 128), F16)
    strided = wide_k[..., ::2]
    raises(ValueError, KV, "k_cache must be C-contiguous",
           lambda: fm.flash_attn_with_kvcache(c["q"], strided, c["vc"], c["k"], c["v"], cache_seqlens=c["seqlens"],
                                              registry="cpu"), wide_k, c["vc"])
    ro = c["vc"].copy()
    ro.flags.writeable = False
    raises(ValueError, KV, "v_cache is read-only",
           lambda: fm.flash_attn_with_kvcache(c["q"], c["kc"], ro, c["k"], c["v"], cache_seqlens=c["seqlens"],
                                              registry="cpu"), c["kc"], ro)
    # Without an append a strided cache is only read: accepted.
    fm.flash_attn_with_kvcache(c["q"], np.ascontiguousarray(strided), c["vc"], cache_seqlens=c["seqlens"],
                               registry="cpu")


@pytest.mark.parametrize("what,cls", [("head_dim", ValueError), ("heads", ValueError), ("dtype", TypeError),
                                      ("sinks", ValueError), ("float32_prefill_d600", ValueError),
                                      ("decode_head_dim", ValueError)])
@pytest.mark.parametrize("paging", [False, True])
def test_attention_errors_leave_the_caches_untouched_when_appending(rng, what, cls, paging):
    """The library validates the append and the attention before either
    runs: a call the attention refuses appends nothing."""
    dt = F32 if what == "float32_prefill_d600" else F16
    d = 600 if what == "float32_prefill_d600" else 64  # no prefill kernel runs D = 600 (> 512)
    kc = randn(rng, (6, 16, 2, d) if paging else (2, 32, 2, d), dt)
    vc = randn(rng, kc.shape, dt)
    table = np.array([[3, 0], [5, 1]], np.int32) if paging else None
    k_new, v_new = randn(rng, (2, 2, 2, d), dt), randn(rng, (2, 2, 2, d), dt)
    seqlens = np.array([5, 16], np.int32)
    q = {"head_dim": randn(rng, (2, 3, 4, 32), F16), "heads": randn(rng, (2, 3, 3, 64), F16),
         "dtype": randn(rng, (2, 3, 4, 64), BF16), "sinks": randn(rng, (2, 3, 4, 64), F16),
         "float32_prefill_d600": randn(rng, (2, 3, 4, 600), F32), "decode_head_dim": randn(rng, (2, 1, 4, 48), F16)}[what]
    sinks = np.zeros(3, np.float32) if what == "sinks" else None
    raises(cls, KV, "",
           lambda: fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                              sinks=sinks, registry="cpu"), kc, vc, seqlens, k_new)


@pytest.mark.parametrize("rows", [1, 3, 12])
def test_append_and_attention_are_one_library_call(rng, monkeypatch, registry, rows):
    """k/v ride in the attention's own call (FMSeqTensors.k_new/v_new) on
    every route (decode, short query, prefill): one library call, the caches
    holding the new rows after it, and a metal batch scope ordering nothing
    else."""
    from flashmetal import _native, reference
    seen = []
    real = _native.call
    monkeypatch.setattr(_native, "call", lambda reg, name, *a, **kw: (seen.append(name), real(reg, name, *a, **kw)))
    kc, vc = randn(rng, (2, 24, 2, 64), F16), randn(rng, (2, 24, 2, 64), F16)
    k0, v0 = kc.copy(), vc.copy()
    q, k_new, v_new = randn(rng, (2, rows, 4, 64), F16), randn(rng, (2, rows, 2, 64), F16), randn(rng, (2, rows, 2, 64), F16)
    lens = np.array([5, 9], np.int32)
    out = fm.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True, registry=registry)
    kernel = "fm_dispatch_attn" if rows > 8 else "fm_dispatch_vec_seq"
    assert [c for c in seen if c.startswith("fm_dispatch")] == [kernel], seen
    ek, ev = reference.kv_append(k0, v0, k_new, v_new, lens)
    assert np.array_equal(kc, ek) and np.array_equal(vc, ev)
    want = reference.flash_attn_kvcache(q, k0, v0, k=k_new, v=v_new, cache_seqlens=lens, causal=True)[0]
    np.testing.assert_allclose(out.astype(np.float64), want, atol=2e-3, rtol=2e-3)


def test_library_refuses_half_an_append():
    """fm_dispatch_vec_seq / fm_dispatch_attn take k_new and v_new together
    and with the lengths they are appended at; the attention over quantized
    caches takes neither (its rows go through fm_dispatch_kv_codes_append)."""
    from flashmetal import _native
    from flashmetal._arrays import tensor
    ffi, lib = _native.ffi(), _native.lib()
    reg = fm.Registry("cpu")
    q, kc = np.zeros((1, 4, 64), np.float32), np.zeros((1, 8, 2, 64), np.float32)
    k_new, lens = np.zeros((1, 1, 2, 64), np.float32), np.array([3], np.int32)
    out = np.zeros_like(q)
    opts = ffi.new("FMAttnOptions *", dict(scale=0.125))
    for fields, pattern in ((dict(k_new=k_new, seqlens_k=lens), b"k_new and v_new must be given together"),
                            (dict(k_new=k_new, v_new=k_new), b"cache_seqlens is required when appending")):
        seq = ffi.new("FMSeqTensors *")
        keep = [tensor(ffi, a) for a in fields.values()]
        for (name, _), t in zip(fields.items(), keep):
            setattr(seq, name, t)
        err = ffi.new("FMError *")
        status = lib.fm_dispatch_vec_seq(reg._live_handle("x"), tensor(ffi, q), tensor(ffi, kc), tensor(ffi, kc),
                                         seq, ffi.NULL, tensor(ffi, out), opts, err)
        assert status == lib.FM_ERROR_VALUE and pattern in ffi.string(err.message), ffi.string(err.message)
    assert not kc.any()
    reg.close()


def test_k_without_v(cache):
    c = cache
    raises(ValueError, KV, "k and v must be given together",
           lambda: fm.flash_attn_with_kvcache(c["q"], c["kc"], c["vc"], c["k"], cache_seqlens=c["seqlens"],
                                              registry="cpu"), c["kc"])


def test_append_needs_cache_seqlens(cache):
    c = cache
    raises(ValueError, KV, "cache_seqlens is required",
           lambda: fm.flash_attn_with_kvcache(c["q"], c["kc"], c["vc"], c["k"], c["v"], registry="cpu"), c["kc"])


@pytest.mark.parametrize("fn,op", [(fm.flash_attn_func, FUNC), ("varlen", VARLEN)])
def test_dropout_alibi_and_argument_types(rng, fn, op):
    q = randn(rng, (1, 4, 2, 64), BF16)
    if fn == "varlen":
        def call(**kw):
            return fm.flash_attn_varlen_func(q[0], q[0], q[0], cu([4]), cu([4]), 4, 4, registry="cpu", **kw)
    else:
        def call(**kw):
            return fm.flash_attn_func(q, q, q, registry="cpu", **kw)
    raises(ValueError, op, "dropout_p must be 0.0", lambda: call(dropout_p=0.1))
    raises(TypeError, op, "alibi_slopes must be float32", lambda: call(alibi_slopes=np.zeros(2, np.float64)))
    raises(TypeError, op, "causal must be a bool", lambda: call(causal=1))
    raises(TypeError, op, "window_size must be a pair", lambda: call(window_size=4))
    raises(ValueError, op, r"window_size\[1\] must be -1 \(unbounded\) or >= 0, got -3",
           lambda: call(window_size=(2, -3)))
    raises(TypeError, op, r"window_size\[0\] must be an integer", lambda: call(window_size=(2.5, 0)))
    raises(TypeError, op, "sinks must be floating point", lambda: call(sinks=np.zeros(2, np.int32)))
    raises(ValueError, op, "sinks", lambda: call(sinks=np.zeros(3, np.float32)))
    raises(ValueError, op, "softcap", lambda: call(softcap=-1.0))


def test_varlen_bad_cu_seqlens(rng):
    q = randn(rng, (10, 2, 64), F16)
    run = lambda cq, ck, mq=10, mk=10: fm.flash_attn_varlen_func(q, q, q, cq, ck, mq, mk, registry="cpu")  # noqa: E731
    good = np.array([0, 4, 10], np.int32)
    for bad, pattern in (([1, 4, 10], r"cu_seqlens_q\[0\] must be 0, got 1"),
                         ([0, 6, 4], r"cu_seqlens_q.*non-decreasing"),
                         ([0, 4, 11], r"cu_seqlens_q\[2\] = 11")):
        arr = np.array(bad, np.int32)
        raises(ValueError, VARLEN, pattern, lambda: run(arr, good), arr, good, q)
    raises(ValueError, VARLEN, "max_seqlen_k", lambda: run(good, good, 10, 5))
    raises(ValueError, VARLEN, "max_seqlen_q", lambda: run(good, good, 3, 10))
    raises(ValueError, VARLEN, "cu_seqlens_k", lambda: run(good, np.array([0, 10], np.int32)))  # batch mismatch
    raises(TypeError, VARLEN, "cu_seqlens_q must hold integers", lambda: run(good.astype(np.float32), good))


def test_wrong_dtypes_and_shapes(rng):
    q = randn(rng, (1, 4, 2, 64), BF16)
    raises(TypeError, FUNC, "int32", lambda: fm.flash_attn_func(q.astype(np.int32), q, q, registry="cpu"))
    raises(TypeError, FUNC, "k dtype bfloat16 does not match q dtype float32",
           lambda: fm.flash_attn_func(q.astype(F32), q, q, registry="cpu"))
    raises(TypeError, FUNC, "", lambda: fm.flash_attn_func(q, q.astype(F16), q.astype(F16), registry="cpu"))
    raises(ValueError, FUNC, "", lambda: fm.flash_attn_func(q, q[:, :, :1].repeat(3, axis=2),
                                                            q[:, :, :1].repeat(3, axis=2), registry="cpu"))
    raises(ValueError, FUNC, "", lambda: fm.flash_attn_func(q[0], q[0], q[0], registry="cpu"))
    out = np.zeros((1, 4, 2, 32), BF16)
    raises(ValueError, KV, "out shape", lambda: fm.flash_attn_with_kvcache(q, q, q, out=out, registry="cpu"), out)


def _kv_call(rng, ql, append, *, q_heads=4, cache=(2, 32, 2, 64), table=None, seqlens=(5, 9), new_rows=2):
    """flash_attn_with_kvcache on cpu with f16 tensors of the given shapes."""
    q = randn(rng, (2, ql, q_heads, 64), F16)
    kc, vc = randn(rng, cache, F16), randn(rng, cache, F16)
    extra = (randn(rng, (2, new_rows, cache[2], cache[3]), F16),) * 2 if append else ()
    lens = np.array(seqlens, np.int32)
    return (lambda: fm.flash_attn_with_kvcache(q, kc, vc, *extra, cache_seqlens=lens, block_table=table,
                                               registry="cpu")), (kc, vc, lens)


@pytest.mark.parametrize("ql", [1, 3])
@pytest.mark.parametrize("append", [False, True])
def test_decode_and_append_errors_use_the_callers_names(rng, ql, append):
    """Every table and shape error of the decode (ql 1) and append routes names
    flash_attn_with_kvcache, the argument as the caller spelled it (k_cache,
    block_table, cache_seqlens, k), the index and the value; never the
    library's internal names (n_new, max_pages, num_kv_heads)."""
    table = np.array([[0, 1], [2, 3]], np.int32)
    paged = dict(cache=(4, 16, 2, 64), table=table)
    cases = [
        (dict(paged, seqlens=(5, 40)),
         r"cache_seqlens\[1\] = 40 is out of range \[0, 32\] \(block_table's 2 pages \(its dim 1\) of 16 keys "
         r"\(k_cache's dim 1\)\)"),
        (dict(paged, table=np.array([[0, 1], [2, 7]], np.int32), seqlens=(5, 20)),
         r"block_table\[1, 1\] = 7 is out of range \[0, 4\) \(the pages of k_cache\)"),
        (dict(seqlens=(5, 33)), r"cache_seqlens\[1\] = 33 is out of range \[0, 32\]"),
        (dict(q_heads=3), r"the q heads \(3\) must be a multiple of the k_cache heads \(2\)"),
    ]
    if append:
        cases.append((dict(seqlens=(5, 31)), r"cache_seqlens\[1\] \+ the new rows of k \(its dim 1\) = 31 \+ 2 = 33 "
                                             r"exceeds the cache capacity, k_cache's dim 1 \(32\)"))
        cases.append((dict(paged, seqlens=(5, 31)), r"cache_seqlens\[1\] \+ the new rows of k \(its dim 1\) = 31 \+ 2 "
                                                    r"= 33 exceeds block_table's 2 pages"))
    for kw, pattern in cases:
        call, watched = _kv_call(rng, ql, append, **kw)
        raises(ValueError, KV, pattern, call, *watched)
        with pytest.raises(ValueError) as e:
            call()
        assert not re.search(r"\b(n_new|max_pages|page_size|num_kv_heads|k_new|seqlens_k)\b", str(e.value)), str(e.value)
