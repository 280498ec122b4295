"""flash_attn_with_kvcache's rotary embedding (rotary_cos, rotary_sin,
rotary_interleaved) on every backend, against flash-attn's definition in
float64 (reference.apply_rotary_emb, as flash-attn's test_flash_attn_kvcache
builds its expected output): the appended keys rotated at cache_seqlens[b] +
i, q at the same positions when causal or local, else every row at
cache_seqlens[b]; full and partial rotary dims, GPT-NeoX and GPT-J pairs,
GQA, paged caches, cache_leftpad and cache_batch_idx, the decode and prefill
routes, every dtype; the caller's q and k never modified; and every bad
argument refused, naming the function and the argument."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from flashmetal._native import constant
from numerics import BF16, F16, F32, randn
from serving_cases import BACKENDS, SIMULATED, assert_out_lse, paged
from serving_cases import registry as registry_for

SHORT_QUERY_ROWS = constant("FM_SHORT_QUERY_ROWS")  # the most rows of a short query (flashmetal.h)

B, H, HKV, D, CAP = 2, 4, 2, 64, 48
LENS = np.array([5, 29], dtype=np.int32)
OP = "flash_attn_with_kvcache"


def tables(rng, seqlen_ro: int, rotary_dim: int, dtype):
    """flash-attn's test tables: random angles, cos/sin in the tables' dtype."""
    angle = rng.random((seqlen_ro, rotary_dim // 2)) * 2 * np.pi
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def expected_rotated(q, k, cos, sin, lens, *, interleaved: bool, per_row: bool):
    """(q_ro, k_ro) as flash-attn's test makes them: the float64 rotation
    rounded once to the rows' dtype (the prefill kernel attends q_ro in q's
    dtype); the decode route (up to SHORT_QUERY_ROWS query rows) attends q as
    float32, so there q_ro is rounded to float32."""
    k_ro = reference.apply_rotary_emb(k, cos, sin, lens, interleaved=interleaved).astype(k.dtype)
    if per_row:
        q_ro = reference.apply_rotary_emb(q, cos, sin, lens, interleaved=interleaved)
    else:
        b, s, h, d = q.shape
        q_ro = reference.apply_rotary_emb(q.reshape(b, 1, s * h, d), cos, sin, lens,
                                          interleaved=interleaved).reshape(b, s, h, d)
    return q_ro.astype(F32 if q.shape[1] <= SHORT_QUERY_ROWS else q.dtype), k_ro


FEATURES = {
    "plain": ({}, False),
    "causal": (dict(causal=True), True),
    "window": (dict(window_size=(7, 2)), True),
    "chunk": (dict(attention_chunk=8), True),
}


def grid(simulated: bool):
    full = [(ql, n_new, rd, inter, feat, dt)
            for ql, n_new in [(1, 1), (3, 2)]
            for rd in (D, 32)
            for inter in (False, True)
            for feat in FEATURES
            for dt in (BF16, F16)]
    if not simulated:
        return full
    # The simulators: each axis covered, not their product.
    return [(1, 1, D, False, "causal", BF16), (1, 1, 32, True, "plain", F16), (3, 2, D, True, "causal", BF16),
            (3, 2, 32, False, "plain", BF16), (3, 2, 16, True, "window", F16), (3, 3, D, False, "chunk", BF16)]


CELLS = [(backend, cell) for backend in BACKENDS for cell in grid(backend in SIMULATED)]


@pytest.mark.parametrize("backend,cell", CELLS)
def test_rotary_contiguous(rng, backend, cell):
    reg = registry_for(backend)
    ql, n_new, rd, inter, feat, dtype = cell
    kw, per_row = FEATURES[feat]
    k_cache, v_cache = randn(rng, (B, CAP, HKV, D), dtype), randn(rng, (B, CAP, HKV, D), dtype)
    q, k, v = randn(rng, (B, ql, H, D), dtype), randn(rng, (B, n_new, HKV, D), dtype), randn(rng, (B, n_new, HKV, D), dtype)
    cos, sin = tables(rng, CAP, rd, dtype)
    q0, k0, kc0 = q.copy(), k.copy(), k_cache.copy()
    out, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=LENS, rotary_interleaved=inter, return_softmax_lse=True,
                                          registry=reg, **kw)
    q_ro, k_ro = expected_rotated(q, k, cos, sin, LENS, interleaved=inter, per_row=per_row)
    e_out, e_lse = reference.flash_attn_kvcache(q_ro, kc0, v_cache, k=k_ro, v=v, cache_seqlens=LENS, **kw)
    what = f"{backend} qL={ql} new={n_new} rd={rd} interleaved={inter} {feat} {dtype}"
    assert_out_lse(out, lse, e_out, e_lse, dtype, what)
    # The caller's q and k are untouched; the cache holds the rotated keys (one rounding).
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    for b in range(B):
        rows = k_cache[b, LENS[b]:LENS[b] + n_new].astype(np.float64)
        np.testing.assert_allclose(rows, k_ro[b], rtol=2 ** -7, atol=1e-6, err_msg=what)
        np.testing.assert_array_equal(k_cache[b, :LENS[b]], kc0[b, :LENS[b]])
        np.testing.assert_array_equal(k_cache[b, LENS[b]:LENS[b] + n_new, :, rd:], k[b, :, :, rd:])


@pytest.mark.parametrize("mode", ["paged", "leftpad", "batch_idx", "paged_batch_idx"])
@pytest.mark.parametrize("ql,causal", [(1, False), (3, True), (3, False)])
def test_rotary_composes(registry, rng, mode, ql, causal):
    """Paged caches (flash-attn's tables cover num_pages * page_size
    positions), cache_leftpad (positions stay cache rows: the rotation
    does not move with the left padding) and cache_batch_idx, with GQA."""
    dtype, n_new, rd = BF16, 2, 32
    q, k, v = randn(rng, (B, ql, H, D), dtype), randn(rng, (B, n_new, HKV, D), dtype), randn(rng, (B, n_new, HKV, D), dtype)
    cos, sin = tables(rng, 64, rd, dtype)
    q_ro, k_ro = expected_rotated(q, k, cos, sin, LENS, interleaved=False, per_row=causal)
    kw = dict(causal=causal)
    if mode == "paged":
        k_rows = [randn(rng, (n, HKV, D), dtype) for n in LENS]
        v_rows = [randn(rng, (n, HKV, D), dtype) for n in LENS]
        (k_cache, v_cache), table = paged(rng, [k_rows, v_rows], 16, room=n_new)
        out, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                              cache_seqlens=LENS, block_table=table, rotary_interleaved=False,
                                              return_softmax_lse=True, registry=registry, **kw)
        k_all = [np.concatenate([r.astype(np.float64), k_ro[b]]) for b, r in enumerate(k_rows)]
        v_all = [np.concatenate([r, v[b]]) for b, r in enumerate(v_rows)]
        outs = [reference.attend_sequence(q_ro[b], k_all[b], v_all[b], **kw) for b in range(B)]
        e_out, e_lse = np.stack([o for o, _ in outs]), np.stack([s for _, s in outs])
    else:
        rows = 2 * B if mode.endswith("batch_idx") else B
        table = None
        if mode == "paged_batch_idx":  # block-table row cache_batch_idx[b] of 2B rows of CAP keys
            noise = [[randn(rng, (CAP, HKV, D), dtype) for _ in range(rows)] for _ in range(2)]
            (k_cache, v_cache), table = paged(rng, noise, 16)
        else:
            k_cache, v_cache = randn(rng, (rows, CAP, HKV, D), dtype), randn(rng, (rows, CAP, HKV, D), dtype)
        idx = rng.permutation(rows)[:B].astype(np.int32) if mode.endswith("batch_idx") else None
        lp = np.array([2, 11], dtype=np.int32) if mode == "leftpad" else None
        e_out, e_lse = reference.flash_attn_kvcache(q_ro, k_cache, v_cache, k=k_ro, v=v, cache_seqlens=LENS,
                                                    block_table=table, cache_batch_idx=idx, cache_leftpad=lp, **kw)
        out, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                              cache_seqlens=LENS, block_table=table, cache_batch_idx=idx,
                                              cache_leftpad=lp, rotary_interleaved=False, return_softmax_lse=True,
                                              registry=registry, **kw)
    assert_out_lse(out, lse, e_out, e_lse, dtype, f"{registry.backend} {mode} qL={ql} causal={causal}")


@pytest.mark.parametrize("q_dtype,table_dtype", [(F32, BF16), (F32, F32), (BF16, F32), (F16, BF16)])
def test_rotary_dtypes(registry, rng, q_dtype, table_dtype):
    """float32 q on the decode route over a bfloat16 cache, and tables of
    another dtype than the rows: the rotation is float32 either way."""
    if q_dtype == F32:
        cache_dtype = BF16
    else:
        cache_dtype = q_dtype
    k_cache, v_cache = randn(rng, (B, CAP, HKV, D), cache_dtype), randn(rng, (B, CAP, HKV, D), cache_dtype)
    q = randn(rng, (B, 1, H, D), q_dtype)
    k, v = randn(rng, (B, 1, HKV, D), cache_dtype), randn(rng, (B, 1, HKV, D), cache_dtype)
    cos, sin = tables(rng, CAP, 48, table_dtype)
    kc0 = k_cache.copy()
    out = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=LENS,
                                     causal=True, rotary_interleaved=True, registry=registry)
    q_ro, k_ro = expected_rotated(q, k, cos, sin, LENS, interleaved=True, per_row=True)
    e_out, _ = reference.flash_attn_kvcache(q_ro, kc0, v_cache, k=k_ro, v=v, cache_seqlens=LENS, causal=True)
    assert np.asarray(out).dtype == q_dtype
    assert_out_lse(out, None, e_out, None, cache_dtype, f"{registry.backend} q {q_dtype} tables {table_dtype}")


def test_rotary_rows_match_the_reference_tightly(cpu, rng):
    """The rotation alone (rotary_dim < D, both pair layouts, float32 rows
    and tables): the appended float32 keys equal the float64 rotation to
    float32 rounding, and the dims past rotary_dim are copied bit for bit."""
    for inter in (False, True):
        k_cache, v_cache = randn(rng, (B, CAP, HKV, D), F32), randn(rng, (B, CAP, HKV, D), F32)
        q, k, v = randn(rng, (B, 1, H, D), F32), randn(rng, (B, 3, HKV, D), F32), randn(rng, (B, 3, HKV, D), F32)
        cos, sin = tables(rng, 40, 48, F32)
        fm.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=LENS,
                                   rotary_interleaved=inter, registry=cpu)
        k_ro = reference.apply_rotary_emb(k, cos, sin, LENS, interleaved=inter)
        for b in range(B):
            got = k_cache[b, LENS[b]:LENS[b] + 3]
            np.testing.assert_allclose(got, k_ro[b], rtol=0, atol=4e-7 * np.abs(k).max() * 4)
            np.testing.assert_array_equal(got[..., 48:], k[b, ..., 48:])


def _call(rng, **over):
    k_cache, v_cache = randn(rng, (B, CAP, HKV, D), BF16), randn(rng, (B, CAP, HKV, D), BF16)
    cos, sin = tables(rng, CAP, 32, BF16)
    args = dict(q=randn(rng, (B, 2, H, D), BF16), k_cache=k_cache, v_cache=v_cache,
                k=randn(rng, (B, 2, HKV, D), BF16), v=randn(rng, (B, 2, HKV, D), BF16),
                rotary_cos=cos, rotary_sin=sin, cache_seqlens=LENS, causal=True)
    args.update(over)
    before = (args["k_cache"].copy(), args["v_cache"].copy())
    return args, before


@pytest.mark.parametrize("over,error,argument,words", [
    (dict(rotary_sin=None), fm.InvalidValueError, "rotary_sin", "without rotary_sin"),
    (dict(rotary_cos=None), fm.InvalidValueError, "rotary_cos", "without rotary_cos"),
    (dict(k=None, v=None), fm.InvalidValueError, "rotary_cos", "need k and v"),
    (dict(rotary_cos=np.ones((CAP, 40), BF16), rotary_sin=np.ones((CAP, 40), BF16)), fm.InvalidValueError,
     "rotary_cos", "rotary_dim 80"),
    (dict(rotary_cos=np.ones((CAP, 0), BF16), rotary_sin=np.ones((CAP, 0), BF16)), fm.InvalidValueError,
     "rotary_cos", "rotary_dim 0"),
    (dict(rotary_sin=np.ones((CAP, 8), BF16)), fm.InvalidValueError, "rotary_sin", "must equal rotary_cos shape"),
    (dict(rotary_cos=np.ones((30, 16), BF16), rotary_sin=np.ones((30, 16), BF16)), fm.InvalidValueError,
     "rotary_cos", "cache_seqlens[1] + 2 rows of q - 1 = 30"),
    (dict(rotary_cos=np.ones((CAP,), BF16), rotary_sin=np.ones((CAP,), BF16)), fm.InvalidValueError,
     "rotary_cos", "rank"),
    (dict(rotary_sin=np.ones((CAP, 16), F16)), fm.InvalidTypeError, "rotary_sin", "does not match rotary_cos"),
    (dict(rotary_cos=np.ones((CAP, 16), np.int32), rotary_sin=np.ones((CAP, 16), np.int32)), fm.InvalidTypeError,
     "rotary_cos", "int32"),
])
def test_rotary_errors(registry, rng, over, error, argument, words):
    args, (kc0, vc0) = _call(rng, **over)
    with pytest.raises(error) as e:
        fm.flash_attn_with_kvcache(registry=registry, **args)
    msg = str(e.value)
    assert OP in msg and words in msg, msg
    assert e.value.argument == argument, (e.value.argument, msg)
    np.testing.assert_array_equal(args["k_cache"], kc0)  # nothing appended
    np.testing.assert_array_equal(args["v_cache"], vc0)


@pytest.mark.parametrize("ql,causal", [(1, False), (3, False), (3, True)])
def test_rotary_over_quantized_caches(registry, rng, ql, causal):
    """QuantizedKV caches (K 8-bit codes, V 4-bit): the appended keys are
    rotated before they are encoded (each stored row decodes to within the
    codec's error of flash-attn's rotated key, far from the unrotated one),
    and the output is float64 attention of the rotated q over what the
    caches hold; the caller's q and k are not modified."""
    kc, vc = fm.KVCodec(D, 8, seed=1).empty((B, CAP, HKV)), fm.KVCodec(D, 4, seed=2).empty((B, CAP, HKV))
    past_k, past_v = randn(rng, (B, CAP, HKV, D), F32), randn(rng, (B, CAP, HKV, D), F32)
    kc.codes[:], kc.norms[:] = (lambda c: (c.codes, c.norms))(kc.codec.encode(past_k, registry=registry))
    vc.codes[:], vc.norms[:] = (lambda c: (c.codes, c.norms))(vc.codec.encode(past_v, registry=registry))
    q, k, v = randn(rng, (B, ql, H, D), F32), randn(rng, (B, ql, HKV, D), F32), randn(rng, (B, ql, HKV, D), F32)
    q0, k0 = q.copy(), k.copy()
    cos, sin = tables(rng, CAP, 32, F32)
    out = fm.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=LENS,
                                     causal=causal, rotary_interleaved=False, registry=registry)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    q_ro, k_ro = expected_rotated(q, k, cos, sin, LENS, interleaved=False, per_row=causal)
    kd, vd = kc.dequantize(registry=registry), vc.dequantize(registry=registry)
    for b in range(B):
        stored = kd[b, LENS[b]:LENS[b] + ql].astype(np.float64)
        err = np.linalg.norm(stored - k_ro[b], axis=-1) / np.linalg.norm(k_ro[b], axis=-1)
        far = np.linalg.norm(stored - k[b], axis=-1) / np.linalg.norm(k[b], axis=-1)
        assert err.max() < 0.02 and far.min() > 0.05, (b, err.max(), far.min())
        n = LENS[b] + ql
        want = reference.attention(q_ro[b:b + 1].astype(np.float64).transpose(0, 2, 1, 3),
                                   kd[b:b + 1, :n].transpose(0, 2, 1, 3), vd[b:b + 1, :n].transpose(0, 2, 1, 3),
                                   causal=causal, q_offset=n - ql).transpose(0, 2, 1, 3)
        ok, ratio = reference.close(out[b:b + 1].astype(np.float64), want, 1e-5, 1e-4)
        assert ok, f"sequence {b}: {ratio:.3g}x the tolerance"


def test_rotary_torch_tensors_equal_numpy(cpu, rng):
    """torch CPU tensors (bfloat16 rows, float32 tables) give the numpy
    call's result bit for bit, and the torch q and k stay as they were."""
    torch = pytest.importorskip("torch")
    k_cache, v_cache = randn(rng, (B, CAP, HKV, D), BF16), randn(rng, (B, CAP, HKV, D), BF16)
    q, k, v = randn(rng, (B, 2, H, D), BF16), randn(rng, (B, 2, HKV, D), BF16), randn(rng, (B, 2, HKV, D), BF16)
    cos, sin = tables(rng, CAP, 32, F32)
    kc_np = k_cache.copy()
    want = fm.flash_attn_with_kvcache(q, kc_np, v_cache.copy(), k, v, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=LENS, causal=True, registry=cpu)

    def t(a):
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16) if a.dtype == BF16 else \
            torch.from_numpy(a.copy())
    tq, tk, tkc = t(q), t(k), t(k_cache)
    got = fm.flash_attn_with_kvcache(tq, tkc, t(v_cache), tk, t(v), rotary_cos=t(cos), rotary_sin=t(sin),
                                     cache_seqlens=torch.from_numpy(LENS), causal=True, registry=cpu)
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.view(torch.uint16).numpy(), np.asarray(want).view(np.uint16))
    np.testing.assert_array_equal(tkc.view(torch.uint16).numpy(), kc_np.view(np.uint16))
    np.testing.assert_array_equal(tq.view(torch.uint16).numpy(), q.view(np.uint16))
    np.testing.assert_array_equal(tk.view(torch.uint16).numpy(), k.view(np.uint16))
