#!/usr/bin/env python3
"""Creates every pipeline the dispatchers can ask for, and checks each result.

Function-constant specialisation errors appear only when a pipeline is made,
so the macOS CI job runs every kernel under every function-constant
combination the Python API can produce (small shapes, each output checked
against the float64 reference):
  prefill  dtype {bf16, f16} x D {64, 80, 96, 128, 192, 256, 512, 576 over v 512} x mask {none,
           additive (auto-blk where it pays), additive + blk, bool} x causal x
           Q aligned x K aligned (constants align_Q, align_K, has_mask,
           do_causal, has_blk)
  serving  prefill dtype x D x {func + lse, func + window + sinks, varlen +
           window + sinks + lse, cache lengths, paged + lse, varlen q over
           paged k, prefill window + mask + blk} (constants 302, 304-310)
  decode   K/V {f32, f16, bf16} x D {64, 80, 96, 128, 192, 256, 512} x reduce
           {plain, FWHT undo, FWHT undo with signs} (constant has_signs; the
           FWHT undo at the power-of-two D only); plain also with K/V off a
           vector boundary (constant 506)
  serving decode  K/V {f32, f16, bf16} x D with every serving constant on,
           and on one (dtype, D) kv_lens x paged x {no ext, sinks, lse, both}
           (constants 501-505)
  kv_append {f32, f16, bf16} x {contiguous, paged} (constant 700)
  rotary   rows {f32, f16, bf16} x tables {f32, f16, bf16} (flash_attn_with_kvcache's
           rotary_cos/rotary_sin on the appended keys)
  kv codec encode {f32, f16, bf16} x D {80, 128}, dequantize, decode over
           codes; with_kvcache over codes: new-row dtype x paged x {dense K,
           dense V, neither} x {sinks + lse, neither} x query rows {1 (the
           one-row decode), 2 (the tiled prefill)} (constants 800-808); varlen
           over code pages x {dense V, neither} (constants 809, 810)
  sdpa     {f32, f16, bf16} x mask {none, additive, bool} x extension {none,
           q_offset + window, + softcap} (constants 600, 601, 602, 603)
  mask     {bf16, f16};  blk  mask {bf16, f16, bool} x D (tile constants 400, 401)

  create_pipelines.py [--backend metal]   (sim runs it anywhere, slowly)
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import flashmetal as fm  # noqa: E402
from flashmetal import _native, quant_reference, reference  # noqa: E402
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn  # noqa: E402
from serving_native import kv_append, make_cache, vec_seq  # noqa: E402

PREFILL_HEAD_DIMS = fm.supported_head_dims("flash_attn_prefill")
# (q/k, v) head dims: each tiled dim over itself, and MLA's pair, whose kernel runs only with v of 512.
PREFILL_PAIRS = [(d, d) for d in PREFILL_HEAD_DIMS] + [(576, 512)]
assert all(_native.runs_head_dims("flash_attn_prefill", d, dv) for d, dv in PREFILL_PAIRS)
# The FWHT reduce runs only at the power-of-two ones.
VEC_HEAD_DIMS = fm.supported_head_dims("flash_attn_vec")
# 32 and 48 are multiples of every prefill tile (BQ 32/8, BK 16/8), 33 of
# none; kL >= qL (Q may not overshoot K). (qL, kL): both aligned, K not, Q
# not, neither.
ALIGNED, UNALIGNED = 32, 33
LENGTHS = ((32, 32), (32, 33), (33, 48), (33, 33))


def prefill_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    n = 0
    for dtype, (d, dv), mask_kind, causal, (q_len, k_len) in itertools.product(
            (BF16, F16), PREFILL_PAIRS, ("none", "additive", "additive+blk", "bool"), (False, True), LENGTHS):
        q = randn(rng, (1, 2, q_len, d), dtype)
        k = randn(rng, (1, 1, k_len, d), dtype)
        v = randn(rng, (1, 1, k_len, dv), dtype)
        mask = blk = None
        if mask_kind.startswith("additive"):
            mask = np.where(rng.random((q_len, k_len)) < 0.3, -np.inf, 0.0).astype(dtype)
            if mask_kind == "additive+blk":
                blk = fm.build_blk(mask, d, registry=reg)
        elif mask_kind == "bool":
            mask = rng.random((q_len, k_len)) >= 0.3
        offset = k_len - q_len
        out = fm.flash_attn_prefill(q, k, v, mask=mask, causal=causal, q_offset=offset, blk=blk, registry=reg)
        e = reference.attention(q, k, v, causal=causal, q_offset=offset, mask=mask)
        assert_close(out, e, dtype, f"prefill {dtype} D={d} Dv={dv} mask={mask_kind} causal={causal} "
                                    f"qL={q_len} kL={k_len}")
        n += 1
    return n


def serving_prefill_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    """One call per serving constant combination, each checked against the reference."""
    n = 0
    for dtype, (d, dv) in itertools.product((BF16, F16), PREFILL_PAIRS):
        h, hkv, page = 2, 1, 16
        q4, k4, v4 = (randn(rng, (2, L, hh, w), dtype) for L, hh, w in ((5, h, d), (33, hkv, d), (33, hkv, dv)))
        sinks = rng.standard_normal(h).astype(F32)
        what = f"serving {dtype} D={d} Dv={dv}"
        o, lse, _ = fm.flash_attn_func(q4, k4, v4, causal=True, return_attn_probs=True, registry=reg)
        eo, el = reference.flash_attn(q4, k4, v4, causal=True)
        assert_close(o, eo, dtype, what + " func + lse")
        assert_lse(lse, el, what)
        o = fm.flash_attn_func(q4, k4, v4, window_size=(6, 2), sinks=sinks, registry=reg)
        assert_close(o, reference.flash_attn(q4, k4, v4, window_size=(6, 2), sinks=sinks)[0], dtype,
                     what + " window + sinks")
        cu_q, cu_k = np.array([0, 3, 12], np.int32), np.array([0, 17, 50], np.int32)
        q3, k3, v3 = randn(rng, (12, h, d), dtype), randn(rng, (50, hkv, d), dtype), randn(rng, (50, hkv, dv), dtype)
        o, lse, _ = fm.flash_attn_varlen_func(q3, k3, v3, cu_q, cu_k, 9, 33, causal=True, window_size=(7, -1),
                                              return_attn_probs=True, sinks=sinks, registry=reg)
        eo, el = reference.flash_attn_varlen(q3, k3, v3, cu_q, cu_k, causal=True, window_size=(7, -1), sinks=sinks)
        assert_close(o, eo, dtype, what + " varlen")
        assert_lse(lse, el, what)
        lens = np.array([20, 33], np.int32)
        o = fm.flash_attn_with_kvcache(q4, k4, v4, cache_seqlens=lens, causal=True, registry=reg)
        assert_close(o, reference.flash_attn_kvcache(q4, k4, v4, cache_seqlens=lens, causal=True)[0], dtype,
                     what + " cache lengths")
        kp, vp = randn(rng, (5, page, hkv, d), dtype), randn(rng, (5, page, hkv, dv), dtype)
        table = np.array([[3, 0, -1], [1, 4, 2]], np.int32)
        o, lse = fm.flash_attn_with_kvcache(q4, kp, vp, cache_seqlens=lens, block_table=table, causal=True,
                                            return_softmax_lse=True, registry=reg)
        eo, el = reference.flash_attn_kvcache(q4, kp, vp, cache_seqlens=lens, block_table=table, causal=True)
        assert_close(o, eo, dtype, what + " paged")
        assert_lse(lse, el, what)
        cu_kp = np.array([0, 20, 53], np.int32)
        o = fm.flash_attn_varlen_func(q3, kp, vp, cu_q, cu_kp, 9, 33, causal=True, block_table=table, registry=reg)
        assert_close(o, reference.flash_attn_varlen(q3, kp, vp, cu_q, cu_kp, block_table=table, causal=True)[0],
                     dtype, what + " varlen over pages")
        qh, kh, vh = randn(rng, (1, h, 33, d), dtype), randn(rng, (1, hkv, 48, d), dtype), randn(rng, (1, hkv, 48, dv), dtype)
        m = np.where(rng.random((33, 48)) < 0.3, -np.inf, 0.0).astype(dtype)
        o = fm.flash_attn_prefill(qh, kh, vh, mask=m, blk=fm.build_blk(m, d, registry=reg), causal=True, window=9,
                                  registry=reg)
        assert_close(o, reference.attention(qh, kh, vh, mask=m, causal=True, q_offset=15, window=9), dtype,
                     what + " prefill window + mask + blk")
        n += 7
    return n


def assert_lse(lse: np.ndarray, expected: np.ndarray, what: str) -> None:
    finite = np.isfinite(expected)
    assert np.array_equal(np.isfinite(lse), finite), f"{what}: lse -inf rows"
    assert np.allclose(lse[finite], expected[finite], atol=1e-4, rtol=1e-4), f"{what}: lse"


def decode_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    n = 0
    for dtype, d, reduce_kind in itertools.product((F32, F16, BF16), VEC_HEAD_DIMS, ("plain", "fwht", "fwht+signs")):
        if reduce_kind != "plain" and d & (d - 1):
            continue
        q = randn(rng, (2, d), F32)
        k = randn(rng, (1, 40, d), dtype)
        v = randn(rng, (1, 40, d), dtype)
        signs = rng.integers(0, 256, d // 8, dtype=np.uint8) if reduce_kind == "fwht+signs" else None
        fwht = reduce_kind != "plain"
        out = fm.flash_attn_decode(q, k, v, 37, fwht=fwht, fwht_signs=signs, registry=reg)
        e = reference.decode(q, k, v, 37)
        if fwht:
            e = reference.fwht_undo(e, signs)
        assert_close(out, e, F32, f"decode K/V {dtype} D={d} {reduce_kind}")
        n += 1
        if reduce_kind == "plain":  # K/V off a vector boundary: constant 506, scalar loads, same bits
            shifted = fm.flash_attn_decode(q, _off_vector(k), _off_vector(v), 37, registry=reg)
            assert_bits_equal(shifted, out, f"decode K/V {dtype} D={d} unaligned")
            n += 1
    return n


def _off_vector(a: np.ndarray) -> np.ndarray:
    """A copy of `a` starting one element past a 64-byte boundary."""
    buf = np.zeros(a.nbytes + 64 + a.itemsize, np.uint8)
    start = (-buf.ctypes.data) % 64 + a.itemsize
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def serving_decode_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    n = 0
    combos = [(dtype, d, True, True, True, True) for dtype in (F32, F16, BF16) for d in VEC_HEAD_DIMS]
    combos += [(F16, 64, lens, paged, sinks, lse) for lens, paged, sinks, lse in
               itertools.product((False, True), repeat=4) if not (lens and paged and sinks and lse)]
    for dtype, d, lens, paged, sinks, lse in combos:
        k, v, table = make_cache(rng, 2, 48, 1, d, dtype, page_size=16 if paged else None)
        q = randn(rng, (2, 2, d), F32)
        lengths = np.array([37, 0], np.int32) if lens else None
        snk = np.array([0.5, -1.0], np.float32) if sinks else None
        out, lse_out = vec_seq(reg, q, k, v, seqlens=lengths, block_table=table, sinks=snk, lse=lse,
                               window=(20, -1))
        e_out, e_lse = reference.flash_attn_kvcache(q[:, None], k, v, cache_seqlens=lengths, block_table=table,
                                                    window_size=(20, -1), sinks=snk)
        e_out, e_lse = e_out[:, 0], e_lse[..., 0]
        what = f"serving decode K/V {dtype} D={d} lens={lens} paged={paged} sinks={sinks} lse={lse}"
        assert_close(out, e_out, F32, what)
        if lse:
            assert_close(lse_out, e_lse, F32, what + " lse")
        n += 1
    return n


def kv_append_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    n = 0
    for dtype, paged in itertools.product((F32, F16, BF16), (False, True)):
        shape = (6, 16, 2, 64) if paged else (2, 17, 2, 64)
        kc, vc = randn(rng, shape, dtype), randn(rng, shape, dtype)
        kn, vn = randn(rng, (2, 3, 2, 64), dtype), randn(rng, (2, 3, 2, 64), dtype)
        lens = np.array([14, 0], np.int32)  # rows 14..16: across two pages when paged
        table = np.array([[4, 1], [0, 5]], np.int32) if paged else None
        ek, ev = reference.kv_append(kc, vc, kn, vn, lens, table)
        kv_append(reg, kn, vn, kc, vc, lens, table)
        assert_bits_equal(kc, ek, f"kv_append {dtype} paged={paged} k")
        assert_bits_equal(vc, ev, f"kv_append {dtype} paged={paged} v")
        n += 1
    return n


def rotary_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    """Every rotary pipeline: the appended keys' dtype x the tables' dtype
    (decode route, causal, half the dims rotated, both pair layouts)."""
    n = 0
    lens = np.array([3, 0], np.int32)
    for dtype, tables in itertools.product((F32, F16, BF16), (F32, F16, BF16)):
        kc, vc = randn(rng, (2, 16, 2, 64), dtype), randn(rng, (2, 16, 2, 64), dtype)
        kn, vn = randn(rng, (2, 1, 2, 64), dtype), randn(rng, (2, 1, 2, 64), dtype)
        q = randn(rng, (2, 1, 4, 64), dtype)
        angle = rng.random((16, 16)) * 2 * np.pi
        cos, sin = np.cos(angle).astype(tables), np.sin(angle).astype(tables)
        interleaved = bool(n % 2)
        kc0 = kc.copy()
        o = fm.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                       causal=True, rotary_interleaved=interleaved, registry=reg)
        q_ro = reference.apply_rotary_emb(q, cos, sin, lens, interleaved=interleaved).astype(F32)
        k_ro = reference.apply_rotary_emb(kn, cos, sin, lens, interleaved=interleaved).astype(dtype)
        eo, _ = reference.flash_attn_kvcache(q_ro, kc0, vc, k=k_ro, v=vn, cache_seqlens=lens, causal=True)
        assert_close(o, eo, np.dtype(dtype), f"rotary {dtype} tables {tables}")
        n += 1
    return n


def kv_codec_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    n = 0
    for dtype, d in itertools.product((F32, F16, BF16), (80, 128)):
        codec = fm.KVCodec(d, 4, seed=3)
        x = randn(rng, (2, 8, d), dtype)
        q = codec.encode(x, registry=reg)
        _, norms, _ = quant_reference.encode(x.astype(np.float64), 4, 3)
        assert np.allclose(q.norms, norms, rtol=1e-6, atol=0), f"kv_encode {dtype} D={d} norms"
        deq = quant_reference.decode(quant_reference.unpack(q.codes, 4, d), q.norms, 4, 3)
        assert_close(q.dequantize(registry=reg), deq, F32, f"kv_dequantize D={d}")
        qr = randn(rng, (4, d), F32)  # [H, D] over caches [Hkv, cap] = [2, 8]
        out = fm.flash_attn_decode(qr, q, q, 7, registry=reg)
        assert_close(out, reference.decode(qr, deq, deq, 7), F32, f"kv_codes_decode D={d}")
        n += 1
    n += kv_codes_kvcache_cases(reg, rng)
    return n


def kv_codes_kvcache_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    """flash_attn_with_kvcache over codes: append x paged x {both quantized,
    dense K, dense V} x {sinks + lse, neither} x {one query row
    (kv_codes_decode), two (kv_codes_prefill)} (constants 800-808), then
    varlen over code pages."""
    n = 0
    codec = fm.KVCodec(64, 4, seed=1)
    for dtype, paged, dense, ext, ql in itertools.product((F32, F16, BF16), (False, True), (None, "k", "v"),
                                                          (False, True), (1, 2)):
        lead = (5, 4, 2) if paged else (2, 8, 2)
        table = np.array([[3, 0], [1, 4]], np.int32) if paged else None
        kq, vq = codec.empty(lead), codec.empty(lead)
        kd, vd = np.zeros(lead + (64,), dtype), np.zeros(lead + (64,), dtype)
        k_cache = kd if dense == "k" else kq
        v_cache = vd if dense == "v" else vq
        kn, vn = randn(rng, (2, 3, 2, 64), dtype), randn(rng, (2, 3, 2, 64), dtype)
        q = randn(rng, (2, ql, 4, 64), dtype)
        lens = np.array([2, 0], np.int32)
        sinks = randn(rng, (4,), F32) if ext else None
        o, lse = fm.flash_attn_with_kvcache(q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=lens, block_table=table,
                                            causal=True, sinks=sinks, return_softmax_lse=True, registry=reg)

        def rows(c: object, d: np.ndarray) -> np.ndarray:
            if isinstance(c, fm.QuantizedKV):
                return quant_reference.decode(quant_reference.unpack(c.codes, 4, 64), c.norms, 4, 1)
            return d.astype(np.float64)
        eo, el = reference.flash_attn_kvcache(q, rows(k_cache, kd), rows(v_cache, vd), cache_seqlens=lens + 3,
                                              block_table=table, causal=True, sinks=sinks)
        what = f"kv_codes kvcache {dtype} paged={paged} dense={dense} ext={ext} seqlen_q={ql}"
        assert_close(o, eo, np.dtype(dtype), what)
        assert_close(lse, el, F32, what + " lse")
        n += 1
    for dense_v in (False, True):
        kc = codec.encode(randn(rng, (4, 4, 2, 64), F32), registry=reg)
        v_rows = randn(rng, (4, 4, 2, 64), F32)
        vc = v_rows if dense_v else codec.encode(v_rows, registry=reg)
        cq, ck = np.array([0, 3, 5], np.int32), np.array([0, 6, 8], np.int32)
        table = np.array([[2, 0], [3, 1]], np.int32)
        q = randn(rng, (5, 4, 64), F32)
        o = fm.flash_attn_varlen_func(q, kc, vc, cq, ck, 3, 6, block_table=table, causal=True, registry=reg)

        def deq(c: fm.QuantizedKV) -> np.ndarray:
            return quant_reference.decode(quant_reference.unpack(c.codes, 4, 64), c.norms, 4, 1)
        vv = v_rows.astype(np.float64) if dense_v else deq(vc)
        eo, _ = reference.flash_attn_varlen(q, deq(kc), vv, cq, ck, block_table=table, causal=True)
        assert_close(o, eo, F32, f"kv_codes varlen dense_v={dense_v}")
        n += 1
    # One row per sequence over 600 keys: the split decode (constant 811) and
    # kv_codes_reduce, with and without sinks and LSE, dense V or codes.
    for dense_v, ext in itertools.product((False, True), (False, True)):
        kc = codec.encode(randn(rng, (2, 600, 2, 64), F32), registry=reg)
        v_rows = randn(rng, (2, 600, 2, 64), F32)
        vc = v_rows if dense_v else codec.encode(v_rows, registry=reg)
        lens = np.array([600, 37], np.int32)
        q = randn(rng, (2, 1, 8, 64), F32)
        sinks = randn(rng, (8,), F32) if ext else None
        o, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, sinks=sinks, return_softmax_lse=True,
                                            registry=reg)
        kk = quant_reference.decode(quant_reference.unpack(kc.codes, 4, 64), kc.norms, 4, 1)
        vv = v_rows.astype(np.float64) if dense_v else quant_reference.decode(
            quant_reference.unpack(vc.codes, 4, 64), vc.norms, 4, 1)
        eo, el = reference.flash_attn_kvcache(q, kk, vv, cache_seqlens=lens, sinks=sinks)
        assert_close(o, eo, F32, f"kv_codes split decode dense_v={dense_v} ext={ext}")
        assert_close(lse, el, F32, f"kv_codes split decode dense_v={dense_v} ext={ext} lse")
        n += 1
    return n


def sdpa_cases(reg: fm.Registry, rng: np.random.Generator) -> int:
    n = 0
    ext_kinds = {"none": {}, "ext": dict(q_offset=0, window=3), "ext+softcap": dict(q_offset=2, window=4, softcap=2.0)}
    for dtype, mask_kind, ext in itertools.product((F32, F16, BF16), ("none", "additive", "bool"), ext_kinds):
        q = randn(rng, (1, 2, 5, 64), dtype)
        k = randn(rng, (1, 2, 9, 64), dtype)
        v = randn(rng, (1, 2, 9, 64), dtype)
        mask = None
        if mask_kind == "additive":
            mask = np.where(rng.random((5, 9)) < 0.3, -np.inf, 0.0).astype(dtype)
        elif mask_kind == "bool":
            mask = rng.random((5, 9)) >= 0.3
        kw = ext_kinds[ext]
        out = fm.sdpa(q, k, v, mask=mask, causal=False, registry=reg, **kw)
        e = reference.attention(q, k, v, mask=mask, q_offset=kw.get("q_offset", 0), window=kw.get("window"),
                                softcap=kw.get("softcap", 0.0))
        assert_close(out, e, dtype, f"sdpa {dtype} mask={mask_kind} {ext}")
        n += 1
    return n


def mask_and_blk_cases(reg: fm.Registry) -> int:
    n = 0
    for dtype in (BF16, F16):
        m = fm.build_mask(ALIGNED, UNALIGNED, causal=True, window=7, q_offset=0, dtype=dtype, registry=reg)
        e = reference.mask_additive(ALIGNED, UNALIGNED, causal=True, window=7)
        assert np.array_equal(m.astype(np.float32), e.astype(np.float32)), f"build_mask {dtype}"
        n += 1
        for d in PREFILL_HEAD_DIMS + (576,):
            blk = fm.build_blk(m, d, registry=reg)
            bq, bk = (8, 8) if d >= 512 else (32, 16)
            assert np.array_equal(blk, reference.blk_classes(m, bq, bk)), f"build_blk {dtype} D={d}"
            assert np.array_equal(fm.build_blk(m == 0, d, registry=reg), blk), f"build_blk bool D={d}"
            n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="metal")
    args = ap.parse_args()
    rng = np.random.default_rng(10)
    t0 = time.time()
    with fm.Registry(args.backend) as reg:
        counts = {"prefill": prefill_cases(reg, rng), "serving prefill": serving_prefill_cases(reg, rng),
                  "decode": decode_cases(reg, rng),
                  "serving decode": serving_decode_cases(reg, rng), "kv_append": kv_append_cases(reg, rng),
                  "rotary": rotary_cases(reg, rng),
                  "kv codec": kv_codec_cases(reg, rng),
                  "sdpa": sdpa_cases(reg, rng), "mask+blk": mask_and_blk_cases(reg)}
    print(f"create_pipelines ({args.backend}): every case matched the reference: {counts} "
          f"in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
