"""The Metal kernels of blk, mask, decode (vec + reduce + FWHT undo) and sdpa
under the simulator: the same inputs as the cpu backend (sim vs cpu), the
decode tmp layout, and independence from the simulated schedule (a scrambled
schedule gives the same bits)."""
from __future__ import annotations


import numpy as np
import pytest

import flashmetal as fm
from conftest import BACKENDS
from flashmetal import reference
from flashmetal._arrays import tensor
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn

pytestmark = pytest.mark.skipif("sim" not in BACKENDS, reason="this build has no sim backend")

GEOMETRY = {64: (32, 16), 128: (32, 16), 256: (32, 16), 512: (8, 8)}


@pytest.fixture(scope="module")
def sim():
    r = fm.Registry("sim")
    yield r
    r.close()


@pytest.fixture
def scrambled(monkeypatch):
    """Runs `f` once normally and once under a scrambled schedule; returns both."""
    def run(f):
        monkeypatch.delenv("FLASHMETAL_SIM_SCRAMBLE", raising=False)
        a = f()
        monkeypatch.setenv("FLASHMETAL_SIM_SCRAMBLE", "7")
        b = f()
        monkeypatch.delenv("FLASHMETAL_SIM_SCRAMBLE")
        return a, b
    return run


# ---- mask and blk ------------------------------------------------------------

@pytest.mark.parametrize("ql,kl,causal,window,q_offset", [(1, 1, True, None, 0), (37, 300, True, 16, 263),
                                                         (64, 40, False, 7, 3), (5, 257, False, None, 0)])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_mask_sim_equals_cpu(cpu, sim, ql, kl, causal, window, q_offset, dtype):
    kw = dict(causal=causal, window=window, q_offset=q_offset, dtype=dtype)
    a = fm.build_mask(ql, kl, registry=cpu, **kw)
    b = fm.build_mask(ql, kl, registry=sim, **kw)
    assert_bits_equal(b, a, f"mask {ql}x{kl} {kw}")


def test_mask_large_offset(sim):
    # t = q_offset + i near INT32_MAX: positions are 64-bit in the kernel
    q_off = 2**31 - 40
    m = fm.build_mask(48, 33, causal=True, q_offset=q_off, window=30, registry=sim)
    t = q_off + np.arange(48)[:, None]
    p = np.arange(33)[None, :]
    want = np.where((p <= t) & (t - p < 30), 0.0, -np.inf)
    assert np.array_equal(m.astype(np.float32), want)


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_blk_sim_equals_cpu_random_biases(cpu, sim, rng, d, dtype):
    # Tiles of every class plus NaN, -0.0 and very negative finite cells, on
    # an unaligned mask (partial last Q tile, partial right-edge K tile).
    bq, bk = GEOMETRY[d]
    ql, kl = 3 * bq + 5, 5 * bk + 3
    m = np.zeros((ql, kl), np.float32)
    for qt in range(4):
        for kt in range(6):
            kind = rng.integers(0, 4)
            tile = m[qt * bq:(qt + 1) * bq, kt * bk:(kt + 1) * bk]
            if kind == 0:
                tile[:] = -np.inf
            elif kind == 1:
                tile[:] = -0.0
            elif kind == 2:
                tile[:] = rng.standard_normal(tile.shape)
            else:
                tile[:] = -3e38 if dtype == BF16 else -np.inf
                tile[rng.integers(0, tile.shape[0]), 0] = np.nan
    m = m.astype(dtype)
    a = fm.build_blk(m, d, registry=cpu)
    b = fm.build_blk(m, d, registry=sim)
    assert np.array_equal(b, a), f"\n{b}\n!=\n{a}"
    assert np.array_equal(b, reference.blk_classes(m, bq, bk))


def test_blk_scrambled_same_bits(sim, scrambled):
    m = fm.build_mask(70, 90, causal=True, window=20, q_offset=20, registry=sim)
    a, b = scrambled(lambda: fm.build_blk(m, 128, registry=sim))
    assert np.array_equal(a, b)


# ---- decode ----------------------------------------------------------------

def decode_inputs(rng, h, hkv, cap, d, kv):
    return randn(rng, (h, d), F32), randn(rng, (hkv, cap, d), kv), randn(rng, (hkv, cap, d), kv)


@pytest.mark.parametrize("d,kv,kw", [(64, F32, dict(window=9)), (128, F16, dict(softcap=4.0)),
                                     (256, BF16, dict(causal=False)), (512, F16, dict(fwht=True))])
def test_decode_sim_matches_cpu(cpu, sim, rng, d, kv, kw):
    q, k, v = decode_inputs(rng, 8, 2, 130, d, kv)
    a = fm.flash_attn_decode(q, k, v, 123, registry=cpu, **kw)
    b = fm.flash_attn_decode(q, k, v, 123, registry=sim, **kw)
    assert_close(b, a, F32, f"sim vs cpu d={d} kv={kv} {kw}")  # both keep q in float32


def vec_with_tmp(reg, q, k, v, kvl, scale):
    h, d = q.shape
    tmp = np.full(h * 32 * (d + 2), np.nan, np.float32)
    out = np.empty((h, d), np.float32)
    ffi = reg._ffi
    opts = ffi.new("FMVecOptions *")
    opts.scale, opts.kv_len = scale, kvl
    reg._call("fm_dispatch_vec", tensor(ffi, q), tensor(ffi, k), tensor(ffi, v), ffi.NULL, tensor(ffi, tmp),
              tensor(ffi, out), opts)
    return tmp, out


def test_decode_tmp_layout_matches_cpu(cpu, sim, rng):
    """The sim's tmp means what the cpu's does: partial O (unnormalised), then
    (S, M) with M in natural-log units, workgroup by workgroup: both deal the
    keys as flashmetal_kernels.h's split says (contiguous runs of FM_VEC_CHUNK = 32
    keys), so each workgroup's partials agree across backends and combine
    into the float64 softmax sums; workgroups without keys hold S = 0 (and
    on the sim O = 0)."""
    q, k, v = decode_inputs(rng, 2, 1, 70, 64, F32)
    s = (1 / 8) * (q.astype(np.float64) @ k[0].T.astype(np.float64))
    m = s.max(axis=1, keepdims=True)
    denom, num = np.exp(s - m).sum(axis=1), np.exp(s - m) @ v[0].astype(np.float64)
    n = 2 * 32 * 64
    busy = 3  # 70 keys: chunks [0, 32), [32, 64), [64, 70)
    sms = {}
    for reg in (cpu, sim):
        t, o = vec_with_tmp(reg, q, k, v, 70, 1 / 8)
        part, sm = t[:n].reshape(2, 32, 64), t[n:].reshape(2, 32, 2)
        assert np.all(sm[:, busy:, 0] == 0) and np.all(sm[:, :busy, 0] > 0), reg.backend
        if reg.backend == "sim":
            assert np.all(part[:, busy:] == 0)
        mw = sm[:, :busy, 1].astype(np.float64)
        assert np.allclose(mw.max(axis=1), m[:, 0], rtol=1e-5, atol=1e-5), reg.backend
        w = np.exp(mw - m)  # [rows, busy]
        assert np.allclose((sm[:, :busy, 0] * w).sum(axis=1), denom, rtol=1e-4), reg.backend
        assert np.allclose((part[:, :busy] * w[..., None]).sum(axis=1), num, rtol=1e-4, atol=1e-5), reg.backend
        assert_close(o, reference.decode(q, k, v, 70, scale=1 / 8), F32, f"{reg.backend} out")
        sms[reg.backend] = sm[:, :busy]
    assert np.allclose(sms["sim"], sms["cpu"], rtol=1e-5, atol=1e-5)


def test_decode_fully_masked_slices_and_one_key(sim, rng):
    # window 1: only key kv_len - 1 is visible, in one workgroup of 32; the
    # output is exactly that key's V row (one key gives probability 1).
    q, k, v = decode_inputs(rng, 4, 2, 1100, 128, F32)
    out = fm.flash_attn_decode(q, k, v, 1077, window=1, registry=sim)
    want = np.repeat(v[:, 1076], 2, axis=0)
    assert np.array_equal(out, want)


GPU_BACKENDS = [b for b in ("sim", "metal-sim") if b in BACKENDS]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("d,kv,hkv,kw", [(64, F16, 1, dict(window=40)), (80, BF16, 2, dict(softcap=5.0)),
                                         (96, F32, 1, {}), (192, F16, 4, dict(causal=False)),
                                         (512, BF16, 1, dict(fwht=True)), (128, F16, 2, dict(window=3))])
def test_decode_shared_kv_group_same_bits_as_one_head_each(backend, rng, d, kv, hkv, kw):
    """Query heads that share a kv head run in one threadgroup that reads K/V
    once (staged in threadgroup memory); repeating K/V per query head runs
    one head per threadgroup straight from device memory. Each lane sums the
    same floats in the same order either way: same bits. 8 query heads over
    1, 2 or 4 kv heads: groups of 8, 4 and 2 heads; 140 keys end mid-chunk."""
    reg = fm.Registry(backend)
    try:
        q, k, v = decode_inputs(rng, 8, hkv, 150, d, kv)
        shared = fm.flash_attn_decode(q, k, v, 140, registry=reg, **kw)
        rep = 8 // hkv
        one = fm.flash_attn_decode(q, np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0), 140, registry=reg, **kw)
        assert_bits_equal(shared, one, f"{backend} d={d} kv={kv} hkv={hkv} {kw}")
        if "fwht" not in kw:  # the FWHT-undo reduce's own tests check its transform
            ref_kw = {a: b for a, b in kw.items() if a in ("window", "softcap")}
            assert_close(shared, reference.decode(q, k, v, 140, **ref_kw), F32, f"{backend} d={d} vs reference")
    finally:
        reg.close()


def _misaligned(a, shift):
    """A copy of `a` whose data starts `shift` bytes past a 64-byte boundary."""
    buf = np.zeros(a.nbytes + 64 + shift, np.uint8)
    start = (-buf.ctypes.data) % 64 + shift
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 64 == shift
    return out


@pytest.mark.parametrize("d,kv", [(128, F16), (64, BF16), (256, F32)])
def test_decode_unaligned_inputs_same_bits(sim, rng, d, kv):
    """K, V or q off a vector boundary (one element past it): the kernel loads
    scalars instead of vectors and gives the same bits."""
    q, k, v = decode_inputs(rng, 4, 2, 100, d, kv)
    want = fm.flash_attn_decode(q, k, v, 90, registry=sim)
    es = np.dtype(kv).itemsize
    for qs, ks in [(0, es), (4, 0), (4, es)]:
        got = fm.flash_attn_decode(_misaligned(q, qs), _misaligned(k, ks), _misaligned(v, ks), 90, registry=sim)
        assert_bits_equal(got, want, f"d={d} kv={kv} q +{qs} B, k/v +{ks} B")


@pytest.mark.parametrize("fwht", [False, True])
def test_decode_scrambled_same_bits(sim, rng, scrambled, fwht):
    q, k, v = decode_inputs(rng, 4, 2, 200, 256, BF16)
    signs = rng.integers(0, 256, 32, dtype=np.uint8) if fwht else None
    a, b = scrambled(lambda: fm.flash_attn_decode(q, k, v, 190, window=100, fwht_signs=signs, registry=sim))
    assert_bits_equal(a, b, "scrambled schedule")


# ---- sdpa ------------------------------------------------------------------

@pytest.mark.parametrize("dtype,d,causal", [(F32, 8, True), (F32, 100, False), (BF16, 64, True),
                                            (BF16, 130, True)])
def test_sdpa_sim_matches_cpu(cpu, sim, rng, dtype, d, causal):
    # qL = 40 spans two threadgroups (the second one mostly past qL); GQA 4/2;
    # kv_len < capacity.
    q = randn(rng, (2, 4, 40, d), dtype)
    k = randn(rng, (2, 2, 60, d), dtype)
    v = randn(rng, (2, 2, 60, d), dtype)
    a = fm.sdpa(q, k, v, causal=causal, kv_len=52, registry=cpu)
    b = fm.sdpa(q, k, v, causal=causal, kv_len=52, registry=sim)
    assert_close(b, a, dtype, f"sim vs cpu {dtype} d={d} causal={causal}")


def test_sdpa_rows_before_first_key_are_zero(sim, rng):
    # causal bottom-right with qL > kv_len: the first qL - kv_len rows see nothing
    q = randn(rng, (1, 2, 12, 64), F32)
    k = randn(rng, (1, 1, 16, 64), F32)
    out = fm.sdpa(q, k, k, causal=True, kv_len=5, registry=sim)
    assert np.all(out[:, :, :7] == 0)
    exp = reference.attention(q[:, :, 7:], k[:, :, :5], k[:, :, :5], causal=True, q_offset=0)
    assert_close(out[:, :, 7:], exp, F32)


def test_sdpa_scrambled_same_bits(sim, rng, scrambled):
    q = randn(rng, (1, 2, 33, 96), BF16)
    k = randn(rng, (1, 1, 40, 96), BF16)
    a, b = scrambled(lambda: fm.sdpa(q, k, k, registry=sim))
    assert_bits_equal(a, b, "scrambled schedule")
