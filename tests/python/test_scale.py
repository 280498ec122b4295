"""64-bit indexing: products of dims past 2^31 elements on the cpu
backend, within ~4.5 GiB and a few seconds.

- a [46341, 46341] bfloat16 window mask (2^31 + 4633 cells, 4 GiB) built by
  build_mask, classified by build_blk and consumed by prefill: rows near the
  end sit at element offsets past 2^31 (row * kL);
- a decode KV cache of 2^25 + 64 slots x D = 64 (2^31 + 4096 elements per
  head): the visible keys (a 16-key window at the end) sit past 2^31.
A 32-bit product anywhere on these paths reads or writes the wrong rows.
"""
from __future__ import annotations

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import BF16, F16, F32, assert_close, randn

N = 46341  # N * N > 2^31


@pytest.mark.slow
def test_long_window_mask_prefill(cpu, rng):
    w, d = 16, 64
    mask = fm.build_mask(N, N, causal=True, window=w, q_offset=0, dtype=BF16, registry=cpu)
    assert mask.size > 2**31
    tail = 70
    exp_tail = reference.mask_additive(tail, N, causal=True, q_offset=N - tail, window=w)
    assert np.array_equal(mask[-tail:].astype(np.float64), exp_tail), "mask rows past 2^31 cells"
    blk = fm.build_blk(mask, d, registry=cpu)
    bq, bk = 32, 16
    nq, nk = blk.shape
    # the last row tile: only the tiles around the diagonal are not skipped
    last = blk[-1]
    r0 = (nq - 1) * bq
    want = reference.blk_classes(mask[r0:].astype(np.float64)[:, :], bq, bk)[0]
    assert np.array_equal(last, want), "blk classes of the last row tile"
    q = randn(rng, (1, 1, N, d), BF16)
    k = randn(rng, (1, 1, N, d), BF16)
    v = randn(rng, (1, 1, N, d), BF16)
    out = fm.flash_attn_prefill(q, k, v, mask=mask, blk=blk, registry=cpu)
    del mask
    lo = N - tail - w
    e = reference.attention(q[:, :, -tail:], k[:, :, lo:], v[:, :, lo:], causal=True, q_offset=tail + w - tail,
                            window=w)
    assert_close(out[:, :, -tail:], e, BF16, "prefill rows whose mask offset is past 2^31")


def test_decode_cache_past_2_31_elements(cpu, rng):
    d, w = 64, 16
    cap = 2**25 + 64  # cap * d > 2^31
    # calloc'd zeros: untouched pages cost no memory; only the tail is written
    k = np.zeros((1, cap, d), F16)
    v = np.zeros((1, cap, d), F16)
    k[:, -w:] = randn(rng, (1, w, d), F16)
    v[:, -w:] = randn(rng, (1, w, d), F16)
    q = randn(rng, (2, d), F32)
    out = fm.flash_attn_decode(q, k, v, cap, window=w, registry=cpu)
    e = reference.decode(q, k[:, -w:], v[:, -w:], w)
    assert_close(out, e, F16, "decode keys past 2^31 elements")
