"""Finite biases are not masks, on every backend (the Metal kernels under the sim, the
cpu kernels): a finite mask value, however negative, is a bias and not a mask.

(a) blk skips only tiles whose every cell is -inf: a tile of -1e30 or
    finfo(bfloat16).min is computed, so blk stays bit-identical.
(b) prefill and sdpa floor an unmasked score at the running max's start
    (-FLT_MAX/2), so a row whose keys all carry finfo(bfloat16).min returns
    their uniform average (as the float64 reference and torch do), not zeros;
    -inf still masks, and a row with nothing visible is exact zeros.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F32, assert_bits_equal, assert_close, randn

BF16_MIN = float(ml_dtypes.finfo(ml_dtypes.bfloat16).min)  # -3.39e38, below -FLT_MAX/2
F32_MIN = float(np.finfo(np.float32).min)                  # its score overflows to -inf in the exp2 domain
GEOMETRY = {64: (32, 16), 512: (8, 8)}


def bias_rows(ql, kl, bias):
    """Rows: 0 every key at `bias`; 1 half at `bias`, half -inf; 2 `bias`
    mixed with 0; 3 all -inf; 4 every key at -1e30; the rest 0."""
    m = np.zeros((ql, kl), np.float32)
    m[0] = bias
    m[1, : kl // 2], m[1, kl // 2:] = bias, -np.inf
    m[2, ::2] = bias
    m[3] = -np.inf
    m[4] = -1e30
    return m


@pytest.mark.parametrize("d", [64, 512])
def test_prefill_rows_of_bf16_min(registry, rng, d):
    q, k, v = (randn(rng, (1, 2, n, d), BF16) for n in (20, 24, 24))
    m = bias_rows(20, 24, BF16_MIN).astype(BF16)
    out = fm.flash_attn_prefill(q, k, v, mask=m, registry=registry)
    assert_close(out, reference.attention(q, k, v, mask=m), BF16, f"{registry.backend} prefill d={d}")
    v64 = v.astype(np.float64)
    assert_close(out[:, :, 0], v64.mean(axis=2), BF16, "all-finfo.min row: uniform average")
    assert_close(out[:, :, 1], v64[:, :, :12].mean(axis=2), BF16, "finfo.min beside -inf: average of the finite")
    assert_close(out[:, :, 4], v64.mean(axis=2), BF16, "all -1e30 row: uniform average")
    o3 = out[:, :, 3].astype(np.float32)
    assert np.all(o3 == 0) and not np.any(np.signbit(o3)), "all -inf row: exact zeros"


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("bias", [-1e30, BF16_MIN])
def test_blk_computes_very_negative_finite_tiles(registry, rng, d, bias):
    # Rows of the first Q tile see only the first K tile, all at `bias`: skipping
    # it (the old <= -1e30 rule) would turn their uniform average into zeros.
    bq, bk = GEOMETRY[d]
    ql, kl = 2 * bq, 4 * bk  # kL >= qL
    m = np.full((ql, kl), -np.inf, np.float32)
    m[:, :bk] = bias
    m[bq:, bk:2 * bk] = 0.0
    m = m.astype(BF16)
    blk = fm.build_blk(m, d, registry=registry)
    assert np.array_equal(blk, [[1, 0, 0, 0], [1, 2, 0, 0]]), blk
    q = randn(rng, (1, 2, ql, d), BF16)
    k, v = (randn(rng, (1, 2, kl, d), BF16) for _ in range(2))
    a = fm.flash_attn_prefill(q, k, v, mask=m, registry=registry)
    b = fm.flash_attn_prefill(q, k, v, mask=m, blk=blk, registry=registry)
    assert_bits_equal(a, b, f"{registry.backend} blk vs none, bias {bias:g}")
    assert_close(a, reference.attention(q, k, v, mask=m), BF16, f"bias {bias:g}")


@pytest.mark.parametrize("dtype,bias", [(F32, F32_MIN), (BF16, BF16_MIN)])
def test_sdpa_rows_of_finite_min(registry, rng, dtype, bias):
    q = randn(rng, (1, 2, 6, 64), dtype)
    k, v = (randn(rng, (1, 2, 24, 64), dtype) for _ in range(2))
    m = bias_rows(6, 24, bias).astype(dtype)
    out = fm.sdpa(q, k, v, mask=m, causal=False, registry=registry)
    assert_close(out, reference.attention(q, k, v, mask=m), dtype, f"{registry.backend} sdpa {dtype}")
    assert_close(out[:, :, 0], v.astype(np.float64).mean(axis=2), dtype, "all-finite-min row: uniform average")
    assert np.all(out[:, :, 3].astype(np.float32) == 0), "all -inf row: zeros"
