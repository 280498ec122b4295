"""flash_attn_decode over QuantizedKV caches on every backend: the output
equals float64 attention over the dequantized caches K̂, V̂ (computed by the
float64 codec reference from the library's codes and norms) within the
float32 tolerance, so the kernel adds no error beyond the codec."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
import head_dim_tables
from flashmetal import quant_reference as qr
from flashmetal import reference
from numerics import BF16, F32, TOLERANCE, assert_bits_equal, worst_element

HEAD_DIMS = head_dim_tables.CODEC


def cache(rng, shape, d, bits, seed, registry):
    codec = fm.KVCodec(d, bits, seed=seed)
    return codec.encode(rng.standard_normal(shape + (d,)).astype(np.float32), registry=registry)


def dequantized(c):
    """K̂ or V̂ in float64, from the codes by the reference decoder."""
    return qr.decode(qr.unpack(c.codes, c.codec.bits, c.codec.head_dim), c.norms, c.codec.bits, c.codec.seed)


def check(actual, expected, what):
    atol, rtol = TOLERANCE[F32]
    ok, ratio = reference.close(actual, expected, atol, rtol)
    assert ok, f"{what}: {ratio:.3g}x the tolerance; " + worst_element(actual, expected, atol, rtol)


@pytest.mark.parametrize("kbits,vbits", [(8, 4), (4, 4), (2, 3), (5, 6)])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_matches_float64_attention_over_the_dequantized_caches(registry, rng, d, kbits, vbits):
    b, h, hkv, cap, kv_len = 2, 4, 2, 24, 19
    k = cache(rng, (b, hkv, cap), d, kbits, 5, registry)
    v = cache(rng, (b, hkv, cap), d, vbits, 6, registry)
    q = (rng.standard_normal((b, h, d)) * 2.0).astype(np.float32)
    q0, kc0, vc0 = q.copy(), k.codes.copy(), v.codes.copy()
    o = fm.flash_attn_decode(q, k, v, kv_len, registry=registry)
    assert o.shape == q.shape and o.dtype == np.float32
    check(o, reference.decode(q, dequantized(k), dequantized(v), kv_len), f"{registry.backend} D={d} K{kbits}/V{vbits}")
    for a, a0, n in ((q, q0, "q"), (k.codes, kc0, "k codes"), (v.codes, vc0, "v codes")):
        assert_bits_equal(a, a0, f"{n} is not changed")


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("d", [128, 256])
def test_four_bit_sides_every_head_group(registry, rng, d, group):
    """4-bit K and V at head dims the AVX-512 cpu loop reads 128 codes at a
    time (its query and accumulators kept in that read's coordinate order),
    1, 2, 4 and 8 query heads per kv head, keys past one 16-key tile with a
    partial last one: still float64 attention over K̂, V̂."""
    b, hkv, cap, kv_len = 2, 2, 48, 45
    k = cache(rng, (b, hkv, cap), d, 4, 3, registry)
    v = cache(rng, (b, hkv, cap), d, 4, 4, registry)
    q = (rng.standard_normal((b, hkv * group, d)) * 2.0).astype(np.float32)
    o = fm.flash_attn_decode(q, k, v, kv_len, registry=registry)
    check(o, reference.decode(q, dequantized(k), dequantized(v), kv_len), f"{registry.backend} D={d} group {group}")


@pytest.mark.parametrize("case", ["window", "softcap_scale", "unbatched_mqa", "one_key", "same_codec", "wide_group"])
def test_features(registry, rng, case):
    d, kv_len, kw = 80, 21, {}
    b, h, hkv = 2, 6, 3
    if case == "window":
        kw = {"window": 5}
    elif case == "softcap_scale":
        kw = {"softcap": 2.0, "scale": 4 / np.sqrt(d)}
    elif case == "unbatched_mqa":
        h, hkv = 4, 1
    elif case == "one_key":
        kv_len = 1
    elif case == "wide_group":  # 10 query heads per kv head: the cpu's 8-head chunks and a partial one
        h, hkv = 20, 2
    k = cache(rng, (b, hkv, 32), d, 4, 1, registry)
    v = k if case == "same_codec" else cache(rng, (b, hkv, 32), d, 8, 2, registry)
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    if case == "unbatched_mqa":
        k, v, q = (fm.QuantizedKV(k.codec, k.codes[0], k.norms[0]), fm.QuantizedKV(v.codec, v.codes[0], v.norms[0]),
                   q[0])
    o = fm.flash_attn_decode(q, k, v, kv_len, registry=registry, **kw)
    check(o, reference.decode(q, dequantized(k), dequantized(v), kv_len, **kw), f"{registry.backend} {case}")


@pytest.mark.parametrize("kbits,vbits,kw", [(8, 4, {}), (4, 2, {"window": 1700}), (3, 8, {"softcap": 3.0})])
def test_long_caches_split_over_keys(registry, rng, kbits, vbits, kw):
    """Thousands of keys for one kv head: the cpu splits each row's keys
    across workers and merges the shares (a share's length is not a multiple
    of its key tile); the output is still float64 attention over K̂, V̂."""
    b, h, hkv, cap, kv_len, d = 1, 3, 1, 3100, 3001, 64
    k = cache(rng, (b, hkv, cap), d, kbits, 7, registry)
    v = cache(rng, (b, hkv, cap), d, vbits, 8, registry)
    q = (rng.standard_normal((b, h, d)) * 2.0).astype(np.float32)
    o = fm.flash_attn_decode(q, k, v, kv_len, registry=registry, **kw)
    check(o, reference.decode(q, dequantized(k), dequantized(v), kv_len, **kw),
          f"{registry.backend} K{kbits}/V{vbits} {kw}")


def test_out_and_codes_close_to_the_dense_decode(registry, rng):
    """out= is filled in place; 8-bit caches give nearly the dense answer."""
    d, kv_len = 128, 30
    kx = rng.standard_normal((1, 2, 32, d)).astype(np.float32)
    vx = rng.standard_normal((1, 2, 32, d)).astype(np.float32)
    codec = fm.KVCodec(d, 8, seed=11)
    q = rng.standard_normal((1, 4, d)).astype(np.float32)
    out = np.empty_like(q)
    got = fm.flash_attn_decode(q, codec.encode(kx, registry=registry), codec.encode(vx, registry=registry), kv_len,
                               out=out, registry=registry)
    assert got is out
    dense = reference.decode(q, kx, vx, kv_len)
    cos = np.sum(out * dense, -1) / (np.linalg.norm(out, axis=-1) * np.linalg.norm(dense, axis=-1))
    assert cos.min() > 0.999


@pytest.mark.parametrize("coded", ["k", "v"])
@pytest.mark.parametrize("batched", [False, True])
def test_one_side_dense(registry, rng, coded, batched):
    """K codes beside a dense float16 V, or dense K beside V codes: float64
    attention over the dequantized side and the dense one, window and
    softcap included; inputs unchanged, ``out`` filled."""
    d, h, hkv, cap, kv_len = 64, 4, 2, 12, 9
    lead = (2, hkv, cap) if batched else (hkv, cap)
    codes = cache(rng, lead, d, 4 if coded == "k" else 5, 3, registry)
    dense = rng.standard_normal(lead + (d,)).astype(np.float16)
    k, v = (codes, dense) if coded == "k" else (dense, codes)
    kd, vd = (dequantized(codes), dense.astype(np.float64))[:: 1 if coded == "k" else -1]
    q = rng.standard_normal(lead[:-2] + (h, d)).astype(np.float32)
    q0, d0, c0 = q.copy(), dense.copy(), codes.codes.copy()
    for kw in ({}, {"window": 4, "softcap": 3.0, "scale": 0.2}):
        out = np.full(q.shape, np.nan, np.float32)
        o = fm.flash_attn_decode(q, k, v, kv_len, out=out, registry=registry, **kw)
        assert o is out
        check(o, reference.decode(q, kd, vd, kv_len, **kw), f"{registry.backend} {coded} codes {kw}")
    for a, a0, n in ((q, q0, "q"), (dense, d0, "dense cache"), (codes.codes, c0, "codes")):
        assert_bits_equal(a, a0, f"{n} is not changed")


def test_errors(registry, rng):
    d = 64
    k = cache(rng, (1, 2, 8), d, 4, 0, registry)
    dense = np.zeros((1, 2, 8, d), np.float32)
    q = np.zeros((1, 2, d), np.float32)
    cases = [
        ((q, k, dense[:, :, :7], 4), {}, fm.InvalidValueError, r"v_cache shape \[1, 2, 7, 64\] must be \[1, 2, 8, 64\]"),
        ((q, dense.astype(np.float64), k, 4), {}, fm.InvalidTypeError, "k_cache is float64"),
        ((q, k, dense, 9), {}, fm.InvalidValueError, r"kv_len \(9\) must be <= the cache capacity \(8\)"),
        ((np.zeros((1, 3, d), np.float32), dense, k, 4), {}, fm.InvalidValueError, "multiple of the cache heads"),
        ((q, k, k, 4), {"fwht": True}, fm.InvalidValueError, "fwht"),
        ((q, k, k, 9), {}, fm.InvalidValueError, r"kv_len \(9\) must be <= the cache capacity \(8\)"),
        ((q, k, k, 0), {}, fm.InvalidValueError, "kv_len"),
        ((q, k, k, 4), {"window": 0}, fm.InvalidValueError, "window"),
        ((q.astype(np.float16), k, dense.astype(BF16), 4), {}, fm.InvalidTypeError,
         r"q must be float32 or v_cache's dtype \(bfloat16\), got float16"),
        ((q.astype(np.int32), k, k, 4), {}, fm.InvalidTypeError, "q dtype int32 is not supported"),
        ((np.zeros((1, 3, d), np.float32), k, k, 4), {}, fm.InvalidValueError, "multiple of the k_cache heads"),
        ((np.zeros((1, 2, 128), np.float32), k, k, 4), {}, fm.InvalidValueError, "head_dim 64 must equal q's head dim 128"),
        ((q, k, cache(rng, (1, 2, 9), d, 4, 0, registry), 4), {}, fm.InvalidValueError, "v_cache codes shape"),
        ((q, k, k, 4), {"softcap": -1.0}, fm.InvalidValueError, "softcap"),
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg) as e:
            fm.flash_attn_decode(*args, registry=registry, **kw)
        assert e.value.op == "flash_attn_decode", e.value
