"""The cpu prefill's serving extension (flashmetal_kernels.h AttnSeqParams) through the
public serving functions, against the float64 serving reference: varlen q/k,
per-sequence cache lengths, paged K/V (shuffled block tables, page sizes),
bottom-right causal, window (left/right), softcap, sinks, LSE (and merging two
KV halves with it), empty rows, head dims 64..512 including 80, 96 and 192,
GQA, and the in-kernel window of flash_attn_prefill.

Every test here is named *cpu* and also runs once per ISA path below the
native one (test_cpu_isa.SUITES), so each path meets the same expectations,
non-finite inputs included. Lengths straddle the kernels' tiles: 64-key
blocks and 32/48-row items of the fast path, 16-key and 32-row tiles of the
portable one."""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
import head_dim_tables
from flashmetal import reference
from numerics import BF16, F16, F32, assert_bits_equal, assert_close, randn
from serving_cases import check_sink_limits

H, HKV = 4, 2
# (q, k) lengths of a ragged batch: one row, tile - 1, tile, tile + 1, longer,
# and a sequence with fewer keys than queries (its first rows see nothing
# under causal).
Q_LENS = [1, 63, 64, 65, 40]
K_LENS = [1, 70, 64, 129, 20]
LSE_TOL = (1e-4, 1e-5)


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _sinks(rng):
    return rng.uniform(-1.0, 2.0, H).astype(np.float32)


def _assert_lse(actual, expected, what):
    ok, ratio = reference.close(actual, expected, *LSE_TOL)
    assert ok, f"{what}: lse error {ratio:.3g}x tolerance {LSE_TOL}"


def _varlen(q, k, v, lens_q, lens_k, registry, **kw):
    cq, ck = _cu(lens_q), _cu(lens_k)
    out, lse, _ = fm.flash_attn_varlen_func(q, k, v, cq, ck, max(lens_q), max(lens_k), return_attn_probs=True,
                                            registry=registry, **kw)
    ref_o, ref_lse = reference.flash_attn_varlen(q, k, v, cq, ck, **kw)
    return out, lse, ref_o, ref_lse


FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window_left": {"window_size": (17, -1)},
    "window_right": {"window_size": (-1, 9)},
    "causal_window_softcap_sinks": {"causal": True, "window_size": (40, 3), "softcap": 8.0, "sinks": True},
}


# Every feature at every head dim, but the windows alone not at 256/512 (the
# combined case covers them there): the cost of the largest tiles.
FEATURE_CASES = [(f, d) for d in head_dim_tables.PREFILL for f in FEATURES
                 if not (d >= 256 and f.startswith("window"))]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("feature,d", FEATURE_CASES)
def test_varlen_features_cpu(cpu, dtype, d, feature):
    rng = np.random.default_rng(d * 7 + len(feature))
    kw = dict(FEATURES[feature])
    if kw.pop("sinks", False):
        kw["sinks"] = _sinks(rng)
    q = randn(rng, (sum(Q_LENS), H, d), dtype)
    k, v = randn(rng, (sum(K_LENS), HKV, d), dtype), randn(rng, (sum(K_LENS), HKV, d), dtype)
    out, lse, ref_o, ref_lse = _varlen(q, k, v, Q_LENS, K_LENS, cpu, **kw)
    assert_close(out, ref_o, dtype, f"varlen {feature} d={d}")
    _assert_lse(lse, ref_lse, f"varlen {feature} d={d}")


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_kvcache_paged_equals_contiguous_cpu(cpu, page_size, dtype):
    """Chunked prefill into a paged cache (shuffled pages, per-sequence
    lengths): the reference's result, and bit for bit the result over the
    same cache laid out contiguously (the kernel gathers the same rows)."""
    rng = np.random.default_rng(page_size)
    d, ql, lens = 80 if dtype == BF16 else 96, 33, np.array([33, 200, 64, 97], np.int32)
    b = len(lens)
    max_pages = -(-int(lens.max()) // page_size) + 1
    num_pages = b * max_pages + 3
    kc, vc = randn(rng, (num_pages, page_size, HKV, d), dtype), randn(rng, (num_pages, page_size, HKV, d), dtype)
    table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    q = randn(rng, (b, ql, H, d), dtype)
    sinks = _sinks(rng)
    kw = dict(causal=True, window_size=(70, -1), softcap=20.0, sinks=sinks)
    out, lse = fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table,
                                         return_softmax_lse=True, registry=cpu, **kw)
    ref_o, ref_lse = reference.flash_attn_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, **kw)
    assert_close(out, ref_o, dtype, f"paged page_size={page_size}")
    _assert_lse(lse, ref_lse, f"paged page_size={page_size}")
    # the same keys, contiguous [B, cap, Hkv, D]
    cap = max_pages * page_size
    kd = kc[table].reshape(b, cap, HKV, d)
    vd = vc[table].reshape(b, cap, HKV, d)
    out2, lse2 = fm.flash_attn_with_kvcache(q, kd, vd, cache_seqlens=lens, return_softmax_lse=True,
                                           registry=cpu, **kw)
    assert_bits_equal(out, out2, "paged vs contiguous")
    assert_bits_equal(lse, lse2, "paged vs contiguous lse")


def test_varlen_over_paged_cache_cpu(cpu):
    """flash_attn_varlen_func with a block table: packed queries, keys read
    through each sequence's pages (lengths from cu_seqlens_k)."""
    rng = np.random.default_rng(5)
    d, page_size, lens_q, lens_k = 192, 32, [3, 65, 1, 30], [100, 65, 33, 0]
    b, max_pages = len(lens_q), 4
    num_pages = b * max_pages
    kc, vc = randn(rng, (num_pages, page_size, HKV, d), BF16), randn(rng, (num_pages, page_size, HKV, d), BF16)
    table = rng.permutation(num_pages).reshape(b, max_pages).astype(np.int32)
    q = randn(rng, (sum(lens_q), H, d), BF16)
    out, lse, ref_o, ref_lse = _varlen(q, kc, vc, lens_q, lens_k, cpu, causal=True, block_table=table,
                                       sinks=_sinks(rng))
    assert_close(out, ref_o, BF16, "varlen paged")
    _assert_lse(lse, ref_lse, "varlen paged")


def test_empty_rows_cpu(cpu):
    """Rows that see no key output exact zeros with LSE -inf; with a sink the
    LSE is the sink and the output still 0 (the sink has no value)."""
    rng = np.random.default_rng(2)
    d, lens_q, lens_k = 64, [5, 3, 70], [0, 2, 70]
    q = randn(rng, (sum(lens_q), H, d), F16)
    k, v = randn(rng, (sum(lens_k), HKV, d), F16), randn(rng, (sum(lens_k), HKV, d), F16)
    # window (0, 0) with causal: each row sees at most its own position
    out, lse, ref_o, ref_lse = _varlen(q, k, v, lens_q, lens_k, cpu, causal=True, window_size=(0, 0))
    assert np.all(out[:5] == 0) and np.all(np.isneginf(lse[:, :5]))
    assert np.all(out[5] == 0) and np.all(np.isneginf(lse[:, 5]))  # t = -1: nothing
    assert_close(out, ref_o, F16, "empty rows")
    _assert_lse(lse, ref_lse, "empty rows")
    sinks = _sinks(rng)
    out, lse, ref_o, ref_lse = _varlen(q, k, v, lens_q, lens_k, cpu, causal=True, sinks=sinks)
    assert np.all(out[:5] == 0)
    np.testing.assert_array_equal(lse[:, :5], np.repeat(sinks[:, None], 5, axis=1))
    _assert_lse(lse, ref_lse, "empty rows with sinks")
    # no sequence has a key: nothing to pack (the portable kernel writes the zeros)
    none = np.zeros((0, HKV, d), F16)
    out, lse, _ = fm.flash_attn_varlen_func(q, none, none, _cu(lens_q), _cu([0, 0, 0]), 70, 0, sinks=sinks,
                                            return_attn_probs=True, registry=cpu)
    assert np.all(out == 0)
    np.testing.assert_array_equal(lse, np.repeat(sinks[:, None], sum(lens_q), axis=1))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_lse_merge_of_two_halves_cpu(cpu, dtype):
    """Attention over keys [0, s) and [s, kL) separately, merged with their
    LSEs, reproduces the one-shot result (prefix caching / ring attention)."""
    rng = np.random.default_rng(9)
    b, ql, kl, split, d = 2, 50, 190, 77, 128
    q = randn(rng, (b, ql, H, d), dtype)
    k, v = randn(rng, (b, kl, HKV, d), dtype), randn(rng, (b, kl, HKV, d), dtype)
    one, lse = fm.flash_attn_func(q, k, v, softcap=15.0, return_attn_probs=True, registry=cpu)[:2]
    o1, l1 = fm.flash_attn_func(q, k[:, :split], v[:, :split], softcap=15.0, return_attn_probs=True,
                                registry=cpu)[:2]
    o2, l2 = fm.flash_attn_func(q, k[:, split:], v[:, split:], softcap=15.0, return_attn_probs=True,
                                registry=cpu)[:2]
    merged, merged_lse = reference.merge_lse(o1, l1, o2, l2)
    ref_o, ref_lse = reference.flash_attn(q, k, v, softcap=15.0)
    assert_close(merged, ref_o, dtype, "merged halves")
    assert_close(merged, one.astype(np.float64), dtype, "merged vs one-shot")
    _assert_lse(merged_lse, lse, "merged lse vs one-shot")
    _assert_lse(lse, ref_lse, "one-shot lse")


def test_chunked_prefill_matches_one_shot_bitwise_cpu(cpu):
    """A row's result depends only on its position and keys: the last chunk
    of a prefill over a cache equals the same rows of the one-shot call."""
    rng = np.random.default_rng(4)
    d, total, chunk, cap = 96, 230, 70, 256
    q = randn(rng, (1, total, H, d), BF16)
    k, v = randn(rng, (1, cap, HKV, d), BF16), randn(rng, (1, cap, HKV, d), BF16)
    kw = dict(causal=True, window_size=(100, -1), sinks=_sinks(rng))
    full = fm.flash_attn_func(q, k[:, :total], v[:, :total], registry=cpu, **kw)
    part = fm.flash_attn_with_kvcache(q[:, total - chunk:], k, v, cache_seqlens=total, registry=cpu, **kw)
    assert_bits_equal(part, np.ascontiguousarray(full[:, total - chunk:]), "chunk vs one-shot")


@pytest.mark.parametrize("d", [64, 80, 128, 192, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_in_kernel_window_cpu(cpu, d, causal):
    """flash_attn_prefill(window=w) builds no mask: bit-identical to the same
    window given as a mask, and the reference's result."""
    rng = np.random.default_rng(d)
    ql, kl, w = 97, 230, 57
    off = kl - ql
    q = randn(rng, (1, H, ql, d), F16)
    k, v = randn(rng, (1, HKV, kl, d), F16), randn(rng, (1, HKV, kl, d), F16)
    got = fm.flash_attn_prefill(q, k, v, window=w, causal=causal, q_offset=off, registry=cpu)
    mask = reference.mask_additive(ql, kl, causal=causal, q_offset=off, window=w).astype(F16)
    assert_bits_equal(got, fm.flash_attn_prefill(q, k, v, mask=mask, q_offset=off, registry=cpu), "window vs mask")
    assert_close(got, reference.attention(q, k, v, mask=mask), F16, f"window d={d}")


def test_nonfinite_serving_cpu(cpu):
    """NaN/inf on every path alike: a NaN q row is a NaN row; a NaN key makes
    NaN exactly the rows that see it (window and sequence bounds respected);
    a huge q row or an infinite key under softcap stays finite; a NaN sink
    makes its head NaN."""
    rng = np.random.default_rng(8)
    d, lens_q, lens_k = 64, [20, 70], [40, 130]
    q = randn(rng, (sum(lens_q), H, d), BF16)
    k, v = randn(rng, (sum(lens_k), HKV, d), BF16), randn(rng, (sum(lens_k), HKV, d), BF16)
    q[3, 1, 5] = np.nan
    k[40 + 100, 0, 2] = np.nan  # key 100 of sequence 1, kv head 0
    q[20 + 69, 3, :] = 1e30     # softcap bounds its scores
    cq, ck = _cu(lens_q), _cu(lens_k)
    out = fm.flash_attn_varlen_func(q, k, v, cq, ck, 70, 130, causal=True, window_size=(10, -1), softcap=5.0,
                                    registry=cpu).astype(np.float32)
    nan_rows = np.isnan(out).any(axis=-1)
    expect = np.zeros_like(nan_rows)
    expect[3, 1] = True
    t = 130 - 70 + np.arange(70)  # positions of sequence 1's rows
    sees = (t >= 100) & (t - 10 <= 100)
    expect[20 + np.nonzero(sees)[0], 0:2] = True  # heads 0, 1 read kv head 0
    np.testing.assert_array_equal(nan_rows, expect)
    assert np.isfinite(out[20 + 69, 3]).all()
    # +inf in a key: its score is +-inf, which the softcap maps to +-5: finite
    # everywhere, and the reference's value
    ki = k.copy()
    ki[:] = np.where(np.isnan(ki.astype(np.float32)), 0, ki)
    ki[40 + 100, 1, 7] = np.inf
    qf = np.where(np.isnan(q.astype(np.float32)), 0, q).astype(BF16)
    qf[20 + 69] = q[20 + 68]
    out = fm.flash_attn_varlen_func(qf, ki, v, cq, ck, 70, 130, causal=True, softcap=5.0, registry=cpu)
    assert np.isfinite(out.astype(np.float32)).all()
    assert_close(out, reference.flash_attn_varlen(qf, ki, v, cq, ck, causal=True, softcap=5.0)[0], BF16, "inf key")
    sinks = _sinks(rng)
    sinks[2] = np.nan
    out = fm.flash_attn_varlen_func(q[:20], k[:40], v[:40], cq[:2], ck[:2], 20, 40, sinks=sinks,
                                    registry=cpu).astype(np.float32)
    assert np.isnan(out[:, 2]).all() and not np.isnan(np.delete(out, [2], axis=1)[np.arange(20) != 3]).any()


@pytest.mark.parametrize("dtype,d", [(BF16, 64), (F16, 96)])
def test_sink_limits_cpu(cpu, rng, dtype, d):
    """+inf / -inf / NaN sinks on the prefill (serving_cases.check_sink_limits)."""
    check_sink_limits(cpu, rng, 7, dtype, d)


@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("q_offset,window,softcap", [(0, None, 0.0), (-5, None, 0.0), (30, 17, 0.0),
                                                     (None, 40, 6.0), (-3, 9, 2.0)])
def test_float32_sdpa_ext_on_the_fast_path_cpu(cpu, d, q_offset, window, softcap):
    """float32 sdpa with SdpaExtParams (explicit q_offset: top-left causal is
    0, negative rows see nothing; window; softcap) runs the fast prefill with
    the in-kernel window, causal and not."""
    rng = np.random.default_rng(d + (window or 0))
    ql, kl = 50, 110
    q = randn(rng, (1, H, ql, d), F32)
    k, v = randn(rng, (1, HKV, kl, d), F32), randn(rng, (1, HKV, kl, d), F32)
    off = kl - ql if q_offset is None else q_offset
    for causal in (False, True):
        got = fm.sdpa(q, k, v, causal=causal, q_offset=q_offset, window=window, softcap=softcap, registry=cpu)
        exp = reference.attention(q, k, v, causal=causal, q_offset=off, window=window, softcap=softcap)
        assert_close(got, exp, F32, f"sdpa f32 causal={causal} q_offset={q_offset} window={window}")
