"""Decode over quantized caches split over keys (kv_codes_decode's grid of
NWG key splits, then kv_codes_reduce): every split count, from one split
(keys shorter than a split) to the most (FM_KVQ_MAX_SPLITS), GQA 1, 4 and 8,
sequences whose keys leave most splits empty, sinks and LSE, against float64
attention over the dequantized caches K̂, V̂. On sim the dispatches are
counted: one kv_codes_decode without a reduce below a split's keys, the
decode and its reduce with NWG threadgroups per head group above."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import flashmetal as fm
from flashmetal import reference
from numerics import F32, randn
from sim_counting import run_counted
from test_kv_codec_kvcache import check, check_lse, dequantized
from test_kv_codes_prefill import caches

# (keys, H, Hkv, D, NWG on sim/metal-sim): NWG = min(ceil(960 / threadgroups
# per split), keys // 128, 128), threadgroups per split = B x H / HG, HG the
# heads one SIMD group serves (H / Hkv here: 1, 4 or 8 within 16 lane floats).
SPLITS = [
    (100, 4, 4, 64, 1),      # MHA, fewer keys than one split: no reduce
    (255, 8, 1, 64, 1),      # GQA 8, one key short of two splits
    (2100, 4, 4, 64, 16),    # MHA, 16 splits of ~131 keys
    (5000, 4, 1, 64, 39),    # GQA 4, a split count that does not divide the chunks
    (17000, 8, 1, 64, 128),  # GQA 8, the most splits
    (3000, 8, 2, 128, 23),   # GQA 4 at D 128 (HG 4, one SIMD group per kv head)
]


def counted(fn):
    """fn() run with the sim's dispatch counting on: its result and the
    (kernel, threadgroups) of each dispatch."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"fm-split-counts-{os.getpid()}.jsonl"
    out, recs = run_counted(path, fn)
    path.unlink()
    return out, [(r["kernel"], r["threadgroups"]) for r in recs]


@pytest.mark.parametrize("keys,h,hkv,d,nwg", SPLITS)
def test_split_counts_against_float64(registry, rng, keys, h, hkv, d, nwg):
    """flash_attn_decode over [B, Hkv, keys] caches, 8-bit K and 4-bit V."""
    b = 1
    kc, vc = fm.KVCodec(d, 8, seed=3), fm.KVCodec(d, 4, seed=4)
    k = kc.encode(randn(rng, (b, hkv, keys, d), F32), registry=registry)
    v = vc.encode(randn(rng, (b, hkv, keys, d), F32), registry=registry)
    q = (rng.standard_normal((b, h, d)) * 2.0).astype(np.float32)

    def run():
        return fm.flash_attn_decode(q, k, v, keys, registry=registry)
    if registry.backend == "sim":
        o, dispatches = counted(run)
        hg = min(h // hkv, 16 // ((d + 31) // 32))
        want = [("kv_codes_decode_f32", b * h // hg * nwg)] + ([("kv_codes_reduce_f32", b * h)] if nwg > 1 else [])
        assert dispatches == want
    else:
        o = run()
    check(o, reference.decode(q, dequantized(k), dequantized(v), keys), F32, f"{registry.backend} keys={keys} H={h}")


@pytest.mark.parametrize("group", [1, 4, 8])
def test_uneven_sequences_sinks_lse(registry, rng, group):
    """flash_attn_with_kvcache, one query row per sequence over 0, 37 and
    1500 keys (the longest sets NWG = 11, so the short sequences leave most
    splits without keys), a window on the longest, sinks (one +inf) and LSE."""
    d, hkv, cap = 64, 2, 1504
    h = hkv * group
    k, v, _ = caches(rng, registry, b=3, cap=cap, hkv=hkv, d=d, kbits=6, vbits=5)
    lens = np.array([0, 37, 1500], np.int32)
    q = randn(rng, (3, 1, h, d), F32)
    sinks = rng.standard_normal(h).astype(np.float32)
    sinks[-1] = np.inf
    for window in ((-1, -1), (300, 0)):
        o, lse = fm.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, sinks=sinks, window_size=window,
                                            causal=True, return_softmax_lse=True, registry=registry)
        eo, el = reference.flash_attn_kvcache(q, dequantized(k), dequantized(v), cache_seqlens=lens, sinks=sinks,
                                              window_size=window, causal=True)
        check(o, eo, F32, f"{registry.backend} GQA{group} window={window}")
        check_lse(lse, el, f"{registry.backend} GQA{group} window={window} lse")
