"""Outputs checked against every input and table, in the library: an output
(out, lse, decode's tmp, the append's caches) sharing a byte with anything
else the call binds is a ValueError naming the op and both arguments, and
nothing is written. Before, out over cache_seqlens had the kernel overwrite
the lengths it had checked and walk past the cache (SIGSEGV)."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import _native
from numerics import F16, F32, assert_bits_equal, randn
from subprocess_run import run_python
from serving_native import VEC_SEQ_OP, tensor


_KEEP = []  # cffi frees an FMTensor when its owner dies: the seq structs' fields stay alive here


def _seq(**tables):
    ffi = _native.ffi()
    seq = ffi.new("FMSeqTensors *")
    for name, a in tables.items():
        t = tensor(a)
        _KEEP.append(t)
        setattr(seq, name, t)
    return seq


def _attn_options(d, **kw):
    return _native.options("FMAttnOptions", scale=d ** -0.5, softcap=0.0, causal=kw.get("causal", 0),
                           window_left=-1, window_right=-1, max_seqlen_q=kw.get("max_q", 0),
                           max_seqlen_k=kw.get("max_k", 0))


def _refused(reg, fn, args, keep, op, names, arena):
    before = arena.copy()
    with pytest.raises(fm.InvalidValueError, match=rf"^{op}: {names} overlap in memory"):
        _native.call(reg, fn, *args, op=op, keep=keep)
    assert_bits_equal(arena, before, f"{names}: nothing written")


def test_decode_outputs_over_tables_and_inputs_are_refused(registry, rng):
    """fm_dispatch_vec_seq: out over cache_seqlens, lse over block_table, a
    caller tmp over q."""
    ffi = _native.ffi()
    b, h, d, page = 2, 2, 64, 16
    q = randn(rng, (b, h, d), F32)
    k, v = randn(rng, (4, page, 1, d), F16), randn(rng, (4, page, 1, d), F16)
    arena = np.zeros(4096, np.float32)
    out = arena[:b * h * d].reshape(b, h, d)
    lens = arena[:b].view(np.int32)
    lens[:] = [5, 16]
    table = np.array([[0, 1], [2, 3]], np.int32)
    opts = _attn_options(d)
    seq = _seq(seqlens_k=lens, block_table=table)
    _refused(registry, "fm_dispatch_vec_seq", (tensor(q), tensor(k), tensor(v), seq, ffi.NULL, tensor(out), opts),
             (q, k, v, lens, table, out), VEC_SEQ_OP, "out and cache_seqlens", arena)

    lens2 = np.array([5, 16], np.int32)
    tarena = np.zeros(64, np.int32)
    tarena[:4] = [0, 1, 2, 3]
    table2 = tarena[:4].reshape(2, 2)
    lse = tarena[2:6].view(np.float32).reshape(2, 2)  # over table2's second row
    out2 = np.zeros((b, h, d), np.float32)
    seq = _seq(seqlens_k=lens2, block_table=table2, lse=lse)
    _refused(registry, "fm_dispatch_vec_seq", (tensor(q), tensor(k), tensor(v), seq, ffi.NULL, tensor(out2), opts),
             (q, k, v, lens2, table2, lse, out2), VEC_SEQ_OP, "lse and block_table", tarena)

    qarena = np.zeros(1 << 16, np.float32)
    q3 = qarena[:q.size].reshape(q.shape)
    q3[...] = q
    tmp = qarena[:9000]
    seq = _seq(seqlens_k=lens2, block_table=table)
    _refused(registry, "fm_dispatch_vec_seq", (tensor(q3), tensor(k), tensor(v), seq, tensor(tmp), tensor(out2), opts),
             (q3, k, v, lens2, table, tmp, out2), VEC_SEQ_OP, "tmp and q", qarena)


def test_prefill_outputs_over_tables_are_refused(registry, rng):
    """fm_dispatch_attn: out over cache_seqlens (with_kvcache), softmax_lse
    over cu_seqlens_k (varlen)."""
    b, ql, h, d, cap = 2, 3, 2, 64, 32
    q = randn(rng, (b, ql, h, d), F16)
    k, v = randn(rng, (b, cap, h, d), F16), randn(rng, (b, cap, h, d), F16)
    arena = np.zeros(b * ql * h * d, F16)
    out = arena.reshape(q.shape)
    lens = arena[:4].view(np.int32)
    lens[:] = [7, 30]
    seq = _seq(seqlens_k=lens)
    _refused(registry, "fm_dispatch_attn", (tensor(q), tensor(k), tensor(v), seq, tensor(out), _attn_options(d)),
             (q, k, v, lens, out), "flash_attn_with_kvcache", "out and cache_seqlens", arena)

    qv, kv = randn(rng, (5, h, d), F16), randn(rng, (9, h, d), F16)
    cu_q = np.array([0, 2, 5], np.int32)
    larena = np.zeros(64, np.float32)
    cu_k = larena[:3].view(np.int32)
    cu_k[:] = [0, 4, 9]
    lse = larena[:h * 5].reshape(h, 5)
    out = np.zeros(qv.shape, F16)
    seq = _seq(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, lse=lse)
    _refused(registry, "fm_dispatch_attn",
             (tensor(qv), tensor(kv), tensor(kv), seq, tensor(out), _attn_options(d, max_q=3, max_k=5)),
             (qv, kv, cu_q, cu_k, lse, out), "flash_attn_varlen_func", "softmax_lse and cu_seqlens_k", larena)


def test_appending_calls_check_outputs_against_the_callers_tables(registry, rng):
    """With k/v appended the kernels read the library's grown lengths, the
    ragged append its own per-row tables and the quantized leftpad view its
    own block table: an output over the caller's cache_seqlens,
    cu_seqlens_k_new or cache_seqlens is still refused, and nothing (no
    cache row either) is written."""
    b, ql, h, d, cap = 2, 2, 2, 64, 16
    q = randn(rng, (b, ql, h, d), F16)
    k, v = randn(rng, (b, cap, h, d), F16), randn(rng, (b, cap, h, d), F16)
    k_new, v_new = randn(rng, (b, 1, h, d), F16), randn(rng, (b, 1, h, d), F16)
    out = np.zeros(q.shape, F16)
    arena = np.zeros(64, np.float32)
    lse = arena[:b * h * ql].reshape(b, h, ql)
    lens = arena[:b].view(np.int32)
    lens[:] = [3, 9]
    before = k.copy()
    seq = _seq(seqlens_k=lens, lse=lse, k_new=k_new, v_new=v_new)
    _refused(registry, "fm_dispatch_attn", (tensor(q), tensor(k), tensor(v), seq, tensor(out), _attn_options(d)),
             (q, k, v, lens, lse, k_new, v_new, out), "flash_attn_with_kvcache", "softmax_lse and cache_seqlens",
             arena)
    assert_bits_equal(k, before, "k_cache unchanged")

    # Ragged new rows: v_cache (written by the append) over cu_seqlens_k_new.
    q_packed, kn = randn(rng, (3, h, d), F16), randn(rng, (3, h, d), F16)
    varena = np.zeros((b, cap, h, d), F16)
    cu_new = varena.reshape(-1)[:6].view(np.int32)
    cu_new[:] = [0, 1, 3]
    seq = _seq(cu_seqlens_q=np.array([0, 1, 3], np.int32), seqlens_k=np.array([3, 9], np.int32), k_new=kn,
               v_new=kn.copy(), cu_seqlens_k_new=cu_new)
    _refused(registry, "fm_dispatch_attn",
             (tensor(q_packed), tensor(k), tensor(varena), seq, tensor(np.zeros(q_packed.shape, F16)),
              _attn_options(d, max_q=2)),
             (q_packed, k, varena, kn, cu_new), "flash_attn_with_kvcache", "v_cache and cu_seqlens_k_new", varena)
    assert_bits_equal(k, before, "k_cache unchanged")

    # Quantized caches read through cache_leftpad's view: out over cache_seqlens.
    codec = fm.KVCodec(d, 4, seed=1)
    kq, vq = codec.empty((b, cap, h)), codec.empty((b, cap, h))
    q32 = randn(rng, (b, 1, h, d), F32)
    oarena = np.zeros(q32.size, np.float32)
    table = oarena[:2 * b].view(np.int32).reshape(2, b)
    table[:] = [[3, 9], [1, 0]]
    seq = _seq(seqlens_k=table)
    _refused(registry, "fm_dispatch_kv_codes_attn",
             (tensor(q32), codec._c, tensor(kq.codes), tensor(kq.norms), codec._c, tensor(vq.codes),
              tensor(vq.norms), seq, tensor(oarena.reshape(q32.shape)), _attn_options(d)),
             (q32, kq, vq, table, oarena), "flash_attn_with_kvcache", "out and cache_seqlens", oarena)


def test_packed_rows_past_the_last_sequence_are_cleared_only_once_the_call_is_accepted(registry, rng):
    """The library zeroes out's rows after cu_seqlens_q[B] itself (no kernel
    writes them): an out over q is still refused with nothing written."""
    h, d = 2, 64
    arena = np.ones(8 * h * d, F16)
    q = arena[:5 * h * d].reshape(5, h, d)  # 5 packed rows; the sequences own 3
    out = arena[2 * h * d:7 * h * d].reshape(5, h, d)
    k = randn(rng, (6, h, d), F16)
    cu_q, cu_k = np.array([0, 1, 3], np.int32), np.array([0, 2, 6], np.int32)
    seq = _seq(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    _refused(registry, "fm_dispatch_attn",
             (tensor(q), tensor(k), tensor(k), seq, tensor(out), _attn_options(d, max_q=2, max_k=4)),
             (q, k, cu_q, cu_k, out), "flash_attn_varlen_func", "out and q", arena)


def test_mask_key_ranges_out_over_its_mask_is_refused():
    """fm_mask_key_ranges writes out after reading the whole mask, yet an out
    sharing the mask's bytes is refused like every other output."""
    ffi, lib = _native.ffi(), _native.lib()
    arena = np.zeros(64, np.float32)
    mask = arena[:16].reshape(1, 1, 1, 16)
    out = arena[14:16].view(np.int32).reshape(2, 1)
    found, err = ffi.new("int32_t *", -1), ffi.new("FMError *")
    assert lib.fm_mask_key_ranges(tensor(mask), 0, 15, 0, tensor(out), found, err) == lib.FM_ERROR_VALUE
    assert ffi.string(err.message).decode().startswith("out and mask overlap in memory"), ffi.string(err.message)
    assert found[0] == -1 and not arena.any()


def test_sdpa_out_over_its_mask_is_refused(registry, rng):
    ffi = _native.ffi()
    q = randn(rng, (1, 1, 4, 32), F32)
    k, v = randn(rng, (1, 1, 8, 32), F32), randn(rng, (1, 1, 8, 32), F32)
    arena = np.zeros(256, np.float32)
    out = arena[:128].reshape(q.shape)
    mask = arena[96:128].reshape(1, 1, 4, 8)
    opts = ffi.new("FMSdpaOptions *", {"scale": 0.2, "causal": 0, "kv_len": 0})
    _refused(registry, "fm_dispatch_sdpa", (tensor(q), tensor(k), tensor(v), tensor(mask), tensor(out), opts),
             (q, k, v, mask, out), "sdpa", "out and mask", arena)


def test_public_out_over_cache_seqlens_is_refused():
    """flash_attn_with_kvcache(out=...) whose memory holds cache_seqlens:
    before, the prefill kernel wrote out over the lengths and re-read them
    (SIGSEGV); now a ValueError naming the public function, on every backend."""
    p = run_python("""
        from conftest import BACKENDS
        rng = np.random.default_rng(3)
        for backend in BACKENDS:
            q = rng.standard_normal((2, 3, 2, 64)).astype(np.float16)
            k = rng.standard_normal((2, 32, 2, 64)).astype(np.float16)
            out = np.zeros(q.shape, np.float16)
            lens = out.reshape(-1)[:4].view(np.int32)
            lens[:] = [7, 30]
            try:
                fm.flash_attn_with_kvcache(q, k, k, cache_seqlens=lens, out=out, registry=backend)
            except ValueError as e:
                assert str(e).startswith("flash_attn_with_kvcache: "), e
                print(backend, "refused")
            else:
                raise AssertionError(f"{backend}: out over cache_seqlens was accepted")
    """, env={"PYTHONPATH": __import__("os").path.dirname(__file__)}, timeout=300)
    assert "cpu refused" in p.stdout, p.stdout
