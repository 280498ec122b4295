#!/usr/bin/env python3
"""gpu_model.py — a GPU cost model of the Metal kernels, from counts the
simulator takes while it runs them (`make gpu-model`; writes bench/GPU_MODEL.md).

How the counts are taken. With FLASHMETAL_SIM_COUNTS=<file> the sim backend
runs every dispatch on the counted copy of its kernel (the same shader
compiled with load/store tracing; outputs bit-identical) and appends one JSON
line per dispatch: device bytes read and written, distinct bytes and 128-byte
lines, load/store events, threadgroup-memory traffic, barriers, SIMD-group
collectives, MMAs by element type, special functions, threads and
threadgroup memory per group (Sources/FlashMetalSim/counters.h).

How small runs stand for large ones. Simulating L = 16k is out of reach
(~B*H*L*L*D*11 ns), so every case runs at a few small sizes s1 < s2 < s3
of one shape family and each count of each dispatch is fitted exactly by a
polynomial in the size through those points (degree 2 for prefill and sdpa:
query tiles times key tiles; degree 1 for decode: keys), then evaluated at
the real size. The family keeps every size in one regime: sizes are
multiples of the tile sizes, the window is a fixed fraction of L (L/4), the
varlen lengths and the paged chunk are fixed fractions of L, so a count that
is a sum over tiles is a polynomial in the size. Heads and batch scale
analytically: threadgroups of different (batch, kv head) pairs are
independent and touch disjoint memory, so every count, distinct bytes and
lines included, is multiplied by B * Hkv (one kv head and its G query heads
are simulated). `--validate` (on in `make gpu-model`) also runs a fourth,
larger size of some cases and reports the fitted prediction's error there,
and checks the B * Hkv scaling on decode against a run with B = Hkv = 2.

The roofline (per named GPU, constants and sources in GPUS below). A core
issues SCHEDULERS = 4 SIMD-group instructions per cycle (128 ALUs / 32 lanes),
sustained at ETA_MMA of that; everything a SIMD group executes takes slots:
  issue slots = 16 per 8x8x8 MMA (1024 FLOPs = 32 lanes x 16 FMAs)
              + device and threadgroup load/store events / 32
              + special functions / 32 * SPECIAL_SLOTS
              + shuffles + votes + simd barriers + REDUCTION_SLOTS * reductions
              + scalar FLOPs / 64 (FMAs per SIMD group)
  Scalar FLOPs are not observable in the simulator: an op without MMAs is
  charged the attention's own 4*D FLOPs per (query, key) pair it computes,
  an op with MMAs nothing (index math and softmax scalars are not counted).
  t_issue   = slots / (SCHEDULERS * cores * clock * ETA_MMA)
  t_dram    = compulsory bytes / (bandwidth * ETA_BW)
              compulsory = distinct bytes read + distinct bytes written
  t_reread  = (coalesced bytes read - distinct bytes read) / (REREAD_BW_X * bandwidth)
              coalesced: per SIMD-group load instruction, the distinct bytes of each
              line its lanes touch (lanes reading one address cost it once);
              re-reads are served by the GPU's L2/system cache, not DRAM
  t_sync    = threadgroup barriers * BARRIER_CYCLES / (cores * resident * clock)
              a barrier stalls one threadgroup; `resident` groups per core overlap
  estimate  = sum over dispatches of max(t_dram + t_reread, t_issue / busy) + t_sync + LAUNCH_S
  minimum   = max(compulsory bytes / bandwidth, attention FLOPs / fp32 peak)
  efficiency = minimum / estimate
resident = min(MAX_THREADS_PER_CORE // threads, TG_MEMORY_PER_CORE // tg memory),
at least 1; a grid of fewer threadgroups than cores * resident leaves cores
idle: busy = min(1, threadgroups / (cores * resident)) divides the issue term
(a per-core resource), not the memory terms (the memory system is shared by
the chip; the model assumes the busy cores keep it saturated).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import flashmetal as fm  # noqa: E402
from ml_dtypes import bfloat16  # noqa: E402


# ---- the GPUs -----------------------------------------------------------------
# fp32 peak = cores * 128 ALUs * 2 FLOPs * clock; Apple GPUs run fp16 (and the
# simdgroup MMAs) at the fp32 rate (FP16/FP32 ratio 1).
# Sources:
#  [PT]  philipturner/metal-benchmarks README: M1 Max 32 cores, 1296 MHz,
#        10620 GFLOPS F32 = F16; 128 ALUs per core; occupancy 768-3072 threads
#        per core (register-bound); 64 KB threadgroup ("shared") memory per core.
#  [HMC] hmc-tech.com/gpu/apple-32-core-m4-max-vs-apple-40-core-m3-max: 40-core
#        M3 Max 1398 MHz, 14.32 TFLOPS FP32; M4 Max cores at 1678 MHz
#        (32-core part 13.74 TFLOPS, so 17.18 for the 40-core part).
#  [AM1] apple.com/newsroom/2021/10 (M1 Max): 400 GB/s memory bandwidth.
#  [AM3] apple.com/newsroom/2023/10 (M3 Max): up to 400 GB/s (16-core CPU / 40-core GPU part).
#  [AM4] apple.com/newsroom/2024/10 (M4 Max): 546 GB/s.
@dataclass(frozen=True)
class GPU:
    name: str
    cores: int
    clock_hz: float
    bandwidth: float  # bytes/s
    sources: str

    @property
    def fp32_peak(self) -> float:
        return self.cores * 128 * 2 * self.clock_hz


GPUS = [
    GPU("M1 Max", 32, 1.296e9, 400e9, "[PT] cores, clock, 10.6 TFLOPS; [AM1] 400 GB/s"),
    GPU("M3 Max", 40, 1.398e9, 400e9, "[HMC] 40 cores, 1398 MHz, 14.3 TFLOPS; [AM3] 400 GB/s"),
    GPU("M4 Max", 40, 1.678e9, 546e9, "[HMC] 1678 MHz (17.2 TFLOPS at 40 cores); [AM4] 546 GB/s"),
]

# ---- model constants (calibrated or assumed; see GPU_MODEL.md) -------------------
ETA_MMA = 0.88        # sustained MMA fraction of peak: metal-flash-attention 83-94% of ALU (M1, M3)
ETA_BW = 0.85         # sustained DRAM fraction of the nominal bandwidth (assumed, +-10%)
REREAD_BW_X = 2.0     # cache bandwidth for re-reads, times DRAM (assumed, +-50%)
BARRIER_CYCLES = 64   # one threadgroup barrier's stall (assumed, +-100%)
SCHEDULERS = 4        # SIMD-group instructions issued per core per cycle: 128 ALUs / 32 lanes [PT]
SPECIAL_SLOTS = 4     # exp2, log2, rsqrt...: quarter rate (assumed, +-50%)
REDUCTION_SLOTS = 10  # simd_sum/max: 5 butterfly steps of shuffle + op (assumed, +-50%)
LAUNCH_S = 5e-6       # one dispatch's fixed cost (assumed, +-100%)
MAX_THREADS_PER_CORE = 1024  # [PT] 768-3072 by register use; attention kernels sit low
TG_MEMORY_PER_CORE = 65536   # [PT]

ADDITIVE = ["threadgroups", "constant_bytes_read", "constant_load_events", "tg_bytes_read", "tg_bytes_written",
            "tg_load_events", "tg_store_events", "threadgroup_barriers", "simd_barriers", "simd_shuffles",
            "simd_reductions", "simd_votes", "mma_f16", "mma_bf16", "mma_f32", "special"]
DEVICE = ["bytes_read", "bytes_written", "load_events", "store_events", "unique_bytes_read",
          "unique_bytes_written", "unique_lines", "load_requests", "load_request_bytes", "store_requests"]


def flatten(rec: dict) -> dict:
    """The additive counts of one dispatch record, as one flat dict."""
    out = {k: rec[k] for k in ADDITIVE}
    for k in DEVICE:
        out["device." + k] = rec["device"][k]
    for b, bc in rec["binding"].items():
        for k in DEVICE:
            out[f"b{b}.{k}"] = bc[k]
    return out


def counted(fn) -> list[dict]:
    """Runs fn() with counting on; returns the records of its dispatches."""
    fd, path = tempfile.mkstemp(prefix="fm-counts-", suffix=".jsonl")
    os.close(fd)
    os.environ["FLASHMETAL_SIM_COUNTS"] = path
    try:
        fn()
    finally:
        del os.environ["FLASHMETAL_SIM_COUNTS"]
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    os.unlink(path)
    return recs


# ---- the cases ------------------------------------------------------------------
DT = {"bf16": bfloat16, "f16": np.float16, "f32": np.float32}


def randn(rng, shape, dt):
    return rng.standard_normal(shape).astype(np.float32).astype(DT[dt])


@dataclass
class Case:
    group: str       # table section
    label: str       # row label
    kernel_note: str
    run: object      # run(size, batch, kv_heads) -> None, on the sim
    sizes: list      # fit sizes
    degree: int
    real_size: int
    batch: int
    kv_heads: int
    flops: object    # flops(size) for B = Hkv = 1: attention FLOPs (4*D per visited pair)
    validate_size: int | None = None
    min_bytes: object = None  # min_bytes(size) for B = Hkv = 1: the bytes a bandwidth-bound op must move, if stated
    # Simulated with every kv head and batch (no B * Hkv scaling): a kernel
    # whose grid depends on the whole shape (the split decode over codes
    # picks its key splits from the key count and the number of heads) is in
    # another regime with one kv head.
    exact: bool = False
    result: dict = field(default_factory=dict)


def pairs_visible(ql: int, kl: int, causal: bool, window: int | None) -> int:
    """(query, key) pairs a row sees, bottom-right aligned."""
    off = kl - ql
    n = 0
    for i in range(ql):
        hi = off + i if causal or window else kl - 1
        lo = max(0, off + i - window + 1) if window else 0
        n += max(0, min(hi, kl - 1) - lo + 1)
    return n


def prefill_cases(reg, dims, dtypes, lengths, heads=32):
    cases = []
    f32_dims = fm.supported_head_dims("flash_attn_prefill_f32")
    for dt in dtypes:
        for d in dims:
            # float32 at a head dim without a tiled float32 kernel runs on sdpa.
            tiled = dt != "f32" or d in f32_dims
            for mask in ("full", "causal", "window"):
                def run(size, batch, hkv, dt=dt, d=d, mask=mask, tiled=tiled):
                    rng = np.random.default_rng(size)
                    q = randn(rng, (batch, hkv, size, d), dt)
                    k = randn(rng, (batch, hkv, size, d), dt)
                    v = randn(rng, (batch, hkv, size, d), dt)
                    causal = mask != "full"
                    window = size // 4 if mask == "window" else None
                    if tiled:
                        fm.flash_attn_prefill(q, k, v, causal=causal, window=window, registry=reg)
                    else:
                        fm.sdpa(q, k, v, causal=causal, window=window, registry=reg)

                def flops(size, d=d, mask=mask):
                    return 4 * d * pairs_visible(size, size, mask != "full", size // 4 if mask == "window" else None)
                # Multiples of 4 key tiles, so the window (L / 4) is whole key tiles: 16 keys below
                # D = 512, 64 at D = 512.
                small = ([256, 512, 768] if d == 512 else [128, 256, 384]) if tiled else [64, 128, 192]
                for L in lengths:
                    cases.append(Case("prefill", f"{dt} D={d} {mask} L={L}",
                                      "flash_attn_prefill" if tiled else "sdpa", run, small, 2, L, 1, heads,
                                      flops))
    return cases


def decode_cases(reg, keys, groups=(1, 4, 8), batches=(1, 16), d=128, heads=32, dtypes=("f16", "bf16")):
    cases = []
    for dt in dtypes:
        for g in groups:
            for b in batches:
                for kl in keys:
                    def run(size, batch, hkv, g=g, dt=dt):
                        rng = np.random.default_rng(size)
                        q = rng.standard_normal((batch, hkv * g, d)).astype(np.float32)
                        kc = randn(rng, (batch, hkv, size, d), dt)
                        vc = randn(rng, (batch, hkv, size, d), dt)
                        fm.flash_attn_decode(q, kc, vc, size, registry=reg)

                    def flops(size, g=g):
                        return 4 * d * size * g
                    name = "MHA" if g == 1 else f"GQA{g}"
                    cases.append(Case("decode", f"{dt} D={d} {name} B={b} keys={kl}", "flash_attn_vec + reduce",
                                      run, [1024, 2048], 1, kl, b, heads // g, flops))
    return cases


def short_query_cases(reg, keys, rows=(4, 8), groups=(1, 4, 8), d=128, heads=32, dt="bf16"):
    """Short queries (qL <= 8, causal bottom-right: speculative decoding, small
    chunks): flash_attn_func's route (the split-KV decode kernel over the qL
    rows of each kv head) against the prefill's 32-row tile on the same call."""
    cases = []
    for ql in rows:
        for g in groups:
            for route in ("prefill", "short"):
                for kl in keys:
                    def run(size, batch, hkv, g=g, ql=ql, route=route):
                        rng = np.random.default_rng(size)
                        q = randn(rng, (batch, ql, hkv * g, d), dt)
                        k = randn(rng, (batch, size, hkv, d), dt)
                        v = randn(rng, (batch, size, hkv, d), dt)
                        if route == "short":
                            fm.flash_attn_func(q, k, v, causal=True, registry=reg)
                        else:
                            fm.flash_attn_prefill(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3),
                                                  v.transpose(0, 2, 1, 3), causal=True, registry=reg)

                    def flops(size, g=g, ql=ql):
                        return 4 * d * g * pairs_visible(ql, size, True, None)
                    name = "MHA" if g == 1 else f"GQA{g}"
                    cases.append(Case("short query", f"{dt} D={d} {name} qL={ql} {route} keys={kl}",
                                      "flash_attn_prefill" if route == "prefill" else "flash_attn_vec + reduce",
                                      run, [1024, 2048], 1, kl, 1, heads // g, flops))
    return cases


def code_caches(rng, shape, d, kbits, vbits):
    """K and V QuantizedKV caches of leading shape `shape`, filled with random
    codes and norms directly (no encode dispatch is run, so none is counted)."""
    out = []
    for bits, seed in ((kbits, 11), (vbits, 12)):
        c = fm.KVCodec(d, bits, seed=seed).empty(shape)
        c.codes[...] = rng.integers(0, 256, c.codes.shape, dtype=np.uint8)
        c.norms[...] = rng.uniform(0.5, 2.0, c.norms.shape).astype(np.float32) * np.sqrt(d)
        out.append(c)
    return out


def kv_row_bytes(d, kbits, vbits):
    """Bytes of one key's K and V rows of one kv head: codes and norms, or bf16 (bits 0)."""
    return sum(fm.KVCodec(d, b).bytes_per_row() if b else 2 * d for b in (kbits, vbits))


# The split decode's choices (KVCodesDecodeDispatcher.headsPerGroup and
# .splits, B = 1): the model fits in the real size's split regime, and
# codes_split_check confirms each run's grid agrees.
def codes_heads_per_group(gqa, d):
    per, hg = (d + 31) // 32, 1
    while gqa % (2 * hg) == 0 and 2 * hg * per <= 16:
        hg *= 2
    return hg


CODES_MIN_SPLIT_KEYS = 128


def codes_split_cap(threadgroups):
    # The split count the grid allows (keys // CODES_MIN_SPLIT_KEYS caps it too).
    return min(-(-960 // threadgroups), 128)


def codes_split_check(case, size, recs):
    # The run's kv_codes_decode grid is the one the model assumed.
    g = int(case.label.split("GQA")[1].split()[0]) if "GQA" in case.label else 1
    units = 32 // codes_heads_per_group(g, 128)
    want = units * max(1, min(codes_split_cap(units), size // CODES_MIN_SPLIT_KEYS))
    got = [r["threadgroups"] for r in recs if r["kernel"].startswith("kv_codes_decode")]
    if got != [want]:
        raise RuntimeError(f"{case.label} at {size} keys: kv_codes_decode ran {got} threadgroups, the model "
                           f"assumed {want}: update codes_heads_per_group / codes_split_cap")


CODE_FORMATS = (("tq8", 8, 8), ("tq4", 4, 4), ("K8/V4", 8, 4), ("bf16", 0, 0))


def codes_cases(reg, keys, groups=(1, 4), d=128, heads=32, prefill_rows=128, prefill_keys=(2048,)):
    """Attention over QuantizedKV caches: decode over codes (kv_codes_decode and
    its reduce) and chunked prefill over codes (kv_codes_prefill), each beside
    the same call on bf16 caches. min_bytes is the caches' bytes (codes and
    norms) plus the query read and the output written: the bandwidth-bound
    minimum the target is stated against."""
    cases = []
    for g in groups:
        name = "MHA" if g == 1 else f"GQA{g}"
        for fmt, kb, vb in CODE_FORMATS:
            def run(size, batch, hkv, g=g, kb=kb, vb=vb):
                rng = np.random.default_rng(size)
                q = rng.standard_normal((batch, hkv * g, d)).astype(np.float32)
                if kb:
                    kc, vc = code_caches(rng, (batch, hkv, size), d, kb, vb)
                else:
                    kc = randn(rng, (batch, hkv, size, d), "bf16")
                    vc = randn(rng, (batch, hkv, size, d), "bf16")
                fm.flash_attn_decode(q, kc, vc, size, registry=reg)

            def flops(size, g=g):
                return 4 * d * size * g

            def min_bytes(size, g=g, kb=kb, vb=vb):
                return size * kv_row_bytes(d, kb, vb) + 2 * 4 * g * d
            for kl in keys:
                sizes, degree = [1024, 2048], 1
                if kb:
                    # The split decode over codes runs at the real shape; its counts are linear in the keys
                    # while the split count stays that of the real size: fitted at two sizes of that count
                    # when the grid caps it, else simulated at the real size.
                    cap = codes_split_cap(heads // codes_heads_per_group(g, d))
                    m = CODES_MIN_SPLIT_KEYS
                    sizes, degree = ([cap * m, cap * m + 512], 1) if kl // m >= cap else ([kl], 0)
                cases.append(Case("codes decode", f"{fmt} D={d} {name} B=1 keys={kl}",
                                  "kv_codes_decode + reduce" if kb else "flash_attn_vec + reduce",
                                  run, sizes, degree, kl, 1, heads // g, flops, min_bytes=min_bytes, exact=bool(kb)))
    # Chunked prefill: `prefill_rows` new query rows (the newest keys, causal)
    # over a cache of `size` keys: every count is linear in the keys at a
    # fixed row count.
    for g in groups:
        name = "MHA" if g == 1 else f"GQA{g}"
        for fmt, kb, vb in CODE_FORMATS:
            def prun(size, batch, hkv, g=g, kb=kb, vb=vb):
                rng = np.random.default_rng(size)
                q = randn(rng, (batch, prefill_rows, hkv * g, d), "bf16")
                if kb:
                    kc, vc = code_caches(rng, (batch, size, hkv), d, kb, vb)
                else:
                    kc = randn(rng, (batch, size, hkv, d), "bf16")
                    vc = randn(rng, (batch, size, hkv, d), "bf16")
                fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.full(batch, size, np.int32), causal=True,
                                           registry=reg)

            def pflops(size, g=g):
                return 4 * d * g * pairs_visible(prefill_rows, size, True, None)

            def pmin_bytes(size, g=g, kb=kb, vb=vb):
                return size * kv_row_bytes(d, kb, vb) + 2 * 2 * prefill_rows * g * d
            for kl in prefill_keys:
                cases.append(Case("codes prefill", f"{fmt} D={d} {name} {prefill_rows} rows causal over keys={kl}",
                                  "kv_codes_prefill" if kb else "flash_attn_prefill", prun, [512, 1024], 1, kl, 1,
                                  heads // g, pflops, min_bytes=pmin_bytes))
    return cases


def serving_cases(reg, lengths, d=128, heads=32, dt="f16"):
    cases = []

    def varlen(size, batch, hkv):
        rng = np.random.default_rng(size)
        lens = [size // 2, size // 4, size // 8, size // 8] * batch
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q = randn(rng, (int(cu[-1]), hkv, d), dt)
        k = randn(rng, (int(cu[-1]), hkv, d), dt)
        v = randn(rng, (int(cu[-1]), hkv, d), dt)
        fm.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True, registry=reg)

    def varlen_flops(size):
        return sum(4 * d * pairs_visible(n, n, True, None) for n in (size // 2, size // 4, size // 8, size // 8))

    page = 16

    def paged(size, batch, hkv):
        rng = np.random.default_rng(size)
        pages = size // page
        table = np.stack([rng.permutation(pages * batch)[:pages] for _ in range(batch)]).astype(np.int32)
        kc = randn(rng, (pages * batch, page, hkv, d), dt)
        vc = randn(rng, (pages * batch, page, hkv, d), dt)
        q = randn(rng, (batch, size // 4, hkv, d), dt)
        fm.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=np.full(batch, size, np.int32), block_table=table,
                                   causal=True, registry=reg)

    def paged_flops(size):
        return 4 * d * pairs_visible(size // 4, size, True, None)
    for L in lengths:
        cases.append(Case("serving", f"{dt} D={d} varlen causal 4 seqs total L={L} (L/2,L/4,L/8,L/8)",
                          "flash_attn_prefill (varlen)", varlen, [256, 512, 768], 2, L, 1, heads, varlen_flops))
        cases.append(Case("serving", f"{dt} D={d} paged causal chunk L/4 over L={L} keys, page {page}",
                          "flash_attn_prefill (paged)", paged, [256, 512, 768], 2, L, 1, heads, paged_flops))
    return cases


def sdpa_cases(reg, lengths, dims=(72, 128), heads=32, dt="f16"):
    cases = []
    for d in dims:
        def run(size, batch, hkv, d=d):
            rng = np.random.default_rng(size)
            q = randn(rng, (batch, hkv, size, d), dt)
            k = randn(rng, (batch, hkv, size, d), dt)
            v = randn(rng, (batch, hkv, size, d), dt)
            fm.sdpa(q, k, v, causal=True, registry=reg)

        def flops(size, d=d):
            return 4 * d * pairs_visible(size, size, True, None)
        for L in lengths:
            cases.append(Case("sdpa", f"{dt} D={d} causal L={L}", "sdpa", run, [64, 128, 192], 2, L, 1, heads, flops))
    return cases


# ---- fitting ----------------------------------------------------------------------
def lagrange(xs, ys, x):
    """The polynomial through (xs, ys) at x, exactly (fractions)."""
    total = Fraction(0)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = Fraction(yi)
        for j, xj in enumerate(xs):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


_RUNS: dict = {}


def measure(case: Case, size: int, batch: int = 1, hkv: int = 1) -> list[dict]:
    key = (case.group, case.kernel_note, case.label.rsplit(" L=", 1)[0].rsplit(" keys=", 1)[0], size, batch, hkv)
    if key not in _RUNS:
        _RUNS[key] = counted(lambda: case.run(size, batch, hkv))
        if case.exact:
            codes_split_check(case, size, _RUNS[key])
    return _RUNS[key]


def fit(case: Case, at: int) -> list[dict]:
    """Per dispatch: each count at size `at`, from the case's fit sizes."""
    shape = (case.batch, case.kv_heads) if case.exact else (1, 1)
    runs = [measure(case, s, *shape) for s in case.sizes[:case.degree + 1]]
    kinds = [[r["kernel"] for r in rs] for rs in runs]
    if any(k != kinds[0] for k in kinds):
        raise RuntimeError(f"{case.label}: the dispatches differ between fit sizes: {kinds}")
    out = []
    for i, rec in enumerate(runs[0]):
        flats = [flatten(rs[i]) for rs in runs]
        pred = {k: lagrange(case.sizes[:case.degree + 1], [f.get(k, 0) for f in flats], at) for k in flats[-1]}
        pred = {k: float(v) for k, v in pred.items()}
        out.append({"kernel": rec["kernel"], "threads": math.prod(rec["threads"]),
                    "threadgroup_memory": rec["threadgroup_memory"], "counts": pred})
    return out


def scaled(dispatches: list[dict], factor: int) -> list[dict]:
    return [{**d, "counts": {k: v * factor for k, v in d["counts"].items()}} for d in dispatches]


# ---- the roofline -------------------------------------------------------------------
def issue_slots(c: dict, scalar_flops: float) -> float:
    """SIMD-group instruction issue slots of one dispatch's counts."""
    return (16 * (c["mma_f16"] + c["mma_bf16"] + c["mma_f32"])
            + scalar_flops / 2 / 32
            + SPECIAL_SLOTS * c["special"] / 32
            + (c["device.load_events"] + c["device.store_events"] + c["tg_load_events"] + c["tg_store_events"]) / 32
            + c["simd_shuffles"] + c["simd_votes"] + c["simd_barriers"]
            + REDUCTION_SLOTS * c["simd_reductions"])


def estimate(gpu: GPU, dispatches: list[dict], useful_flops: float) -> dict:
    tot = {}
    for d in dispatches:
        for k, v in d["counts"].items():
            tot[k] = tot.get(k, 0.0) + v
    compulsory = tot["device.unique_bytes_read"] + tot["device.unique_bytes_written"]
    mma = tot["mma_f16"] + tot["mma_bf16"] + tot["mma_f32"]
    issue_rate = SCHEDULERS * gpu.cores * gpu.clock_hz * ETA_MMA  # slots per second, sustained
    t_total = 0.0
    parts = {"dram": 0.0, "reread": 0.0, "issue": 0.0, "mma": 0.0, "sync": 0.0, "launch": 0.0, "issue_busy": 0.0}
    for i, d in enumerate(dispatches):
        c = d["counts"]
        groups = max(1.0, c["threadgroups"])
        resident = max(1, min(MAX_THREADS_PER_CORE // max(1, d["threads"]),
                              TG_MEMORY_PER_CORE // max(16, d["threadgroup_memory"])))
        busy = min(1.0, groups / (gpu.cores * resident))
        t_dram = (c["device.unique_bytes_read"] + c["device.unique_bytes_written"]) / (gpu.bandwidth * ETA_BW)
        t_reread = max(0.0, c["device.load_request_bytes"] - c["device.unique_bytes_read"]) \
            / (REREAD_BW_X * gpu.bandwidth)
        # The attention's scalar FLOPs of an MMA-less op belong to its first dispatch.
        scalar = useful_flops if (mma == 0 and i == 0) else 0.0
        t_issue = issue_slots(c, scalar) / issue_rate
        t_mma = 16 * (c["mma_f16"] + c["mma_bf16"] + c["mma_f32"]) / issue_rate
        t_sync = c["threadgroup_barriers"] * BARRIER_CYCLES / (gpu.cores * gpu.clock_hz * resident)
        t_total += max(t_dram + t_reread, t_issue / busy) + t_sync + LAUNCH_S
        parts["issue_busy"] += t_issue / busy
        for k, v in (("dram", t_dram), ("reread", t_reread), ("issue", t_issue), ("mma", t_mma), ("sync", t_sync),
                     ("launch", LAUNCH_S)):
            parts[k] += v
    t_min = max(compulsory / gpu.bandwidth, useful_flops / gpu.fp32_peak)
    bound = max(("memory", parts["dram"] + parts["reread"]), ("issue", parts["issue"]),
                ("sync", parts["sync"]), ("launch", parts["launch"]), key=lambda x: x[1])[0]
    return {"estimate": t_total, "minimum": t_min, "efficiency": t_min / t_total if t_total else 0.0,
            "bound": bound, "tflops": useful_flops / t_total / 1e12 if t_total else 0.0, **parts}


def summarize(dispatches: list[dict]) -> dict:
    tot = {}
    for d in dispatches:
        for k, v in d["counts"].items():
            tot[k] = tot.get(k, 0.0) + v
    rd, urd = tot["device.bytes_read"], tot["device.unique_bytes_read"]
    loads, stores = tot["device.load_events"], tot["device.store_events"]
    first = dispatches[0]
    groups = max(1.0, first["counts"]["threadgroups"])
    return {
        "read": rd, "written": tot["device.bytes_written"], "unique_read": urd,
        "reread": rd / urd if urd else 0.0, "lines": tot["device.unique_lines"],
        "reread_simd": tot["device.load_request_bytes"] / urd if urd else 0.0,
        "req_b": tot["device.load_request_bytes"] / tot["device.load_requests"] if tot["device.load_requests"] else 0.0,
        "load_b": rd / loads if loads else 0.0, "store_b": tot["device.bytes_written"] / stores if stores else 0.0,
        "tg_bytes": tot["tg_bytes_read"] + tot["tg_bytes_written"],
        "mma": tot["mma_f16"] + tot["mma_bf16"] + tot["mma_f32"],
        "shuffles": tot["simd_shuffles"], "reductions": tot["simd_reductions"],
        "barriers_per_group": first["counts"]["threadgroup_barriers"] / groups,
        "threads": first["threads"], "tg_memory": first["threadgroup_memory"],
        "groups": first["counts"]["threadgroups"],
        "resident": max(1, min(MAX_THREADS_PER_CORE // max(1, first["threads"]),
                               TG_MEMORY_PER_CORE // max(16, first["threadgroup_memory"]))),
        "kernels": "+".join(d["kernel"] for d in dispatches),
    }


# ---- calibration ----------------------------------------------------------------------
# Published peer figures, and what the model says of a kernel that does only
# the attention's MMAs and reads everything once (the roofline's best case).
PEERS = [
    ("MLX fused SDPA, f16, D=64, L=4096, M3 Max", "M3 Max", 11.7e12,
     "ml-explore/mlx (steel attention) as cited in the project brief: ~11.7 TFLOP/s"),
    ("metal-flash-attention, M1 Max, best case", "M1 Max", 0.94 * 10.62e12,
     "philipturner/metal-flash-attention: 83-94% of ALU on M1/M3 (upper end)"),
    ("metal-flash-attention, M1 Max, worst case", "M1 Max", 0.83 * 10.62e12,
     "philipturner/metal-flash-attention: 83-94% of ALU on M1/M3 (lower end)"),
]


CODES_TARGET = "decode over codes 8k-128k keys: >= 80% of the bandwidth-bound minimum of its bytes"


def codes_eff(c):
    return c.result["gpus"]["M3 Max"]["bw_efficiency"]


def codes_target_rows(rows):
    return [c for c in rows if c.group == "codes decode" and not c.label.startswith("bf16")
            and 8192 <= c.real_size <= 131072]


def target_rows(rows):
    """The issue's targets (M3 Max constants): (target, rows it covers, rows meeting it, worst row)."""
    def eff(c):
        return c.result["gpus"]["M3 Max"]["efficiency"]

    def dim(c):
        return int(c.label.split("D=")[1].split()[0])

    def length(c):
        return c.real_size
    pre = [c for c in rows if c.group == "prefill"]
    dec = [c for c in rows if c.group == "decode" and c.real_size >= 8192]
    codes = codes_target_rows(rows)
    out = []

    def add(name, sel, ok, value, higher_is_better=True):
        sel = list(sel)
        met = [c for c in sel if ok(c)]
        worst = (min if higher_is_better else max)(sel, key=value) if sel else None
        out.append((name, len(sel), len(met), f"{worst.label}: {value(worst):.3g}" if worst else "-"))
    add("prefill bf16/f16 L>=4096 D 64/128/256 full+causal: efficiency >= 70%",
        (c for c in pre if not c.label.startswith("f32") and length(c) >= 4096 and dim(c) in (64, 128, 256)
         and " window " not in c.label), lambda c: eff(c) >= 0.70, eff)
    add("prefill bf16/f16 L>=4096 D 80/96/192: efficiency >= 60%",
        (c for c in pre if not c.label.startswith("f32") and length(c) >= 4096 and dim(c) in (80, 96, 192)),
        lambda c: eff(c) >= 0.60, eff)
    add("prefill bf16/f16 L>=4096 D 512: efficiency >= 60%",
        (c for c in pre if not c.label.startswith("f32") and length(c) >= 4096 and dim(c) == 512),
        lambda c: eff(c) >= 0.60, eff)
    add("prefill float32 L>=4096: efficiency >= 50%",
        (c for c in pre if c.label.startswith("f32") and length(c) >= 4096), lambda c: eff(c) >= 0.50, eff)
    add("decode 8k-128k keys: efficiency >= 85%", dec, lambda c: eff(c) >= 0.85, eff)
    if codes:
        add(CODES_TARGET, codes, lambda c: codes_eff(c) >= 0.80, codes_eff)
    add("decode: K/V read once per kv head (SIMD re-read <= 1.05)", dec,
        lambda c: c.result["summary"]["reread_simd"] <= 1.05, lambda c: c.result["summary"]["reread_simd"], False)
    add("decode: mean device load >= 8 bytes", dec, lambda c: c.result["summary"]["load_b"] >= 8,
        lambda c: c.result["summary"]["load_b"])
    add("prefill (tiled kernels): mean device load >= 8 bytes", (c for c in pre if not c.label.startswith("f32")),
        lambda c: c.result["summary"]["load_b"] >= 8, lambda c: c.result["summary"]["load_b"])
    return out


def fmt_bytes(b: float) -> str:
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= s:
            return f"{b / s:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_time(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} µs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "GPU_MODEL.md"))
    ap.add_argument("--quick", action="store_true", help="D 64/128 only, f16, fewer lengths")
    ap.add_argument("--validate", action="store_true", help="also run a larger size of some cases and compare")
    ap.add_argument("--json", help="also write every row's numbers here")
    ap.add_argument("--only", metavar="REGEX",
                    help="model only the cases whose 'group label' matches (re.search), e.g. '^prefill '; "
                         "pair with --out elsewhere (the report then holds only those rows) or with --merge")
    ap.add_argument("--merge", action="store_true",
                    help="replace only the sections of the modelled groups (and their validation rows) in the "
                         "existing --out, keeping the rest of it")
    args = ap.parse_args()

    t0 = time.time()
    reg = fm.Registry("sim")
    dims = [64, 128] if args.quick else [64, 80, 96, 128, 192, 256, 512]
    dtypes = ["f16"] if args.quick else ["bf16", "f16", "f32"]
    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384]
    keys = [4096, 131072] if args.quick else [4096, 16384, 32768, 131072]
    codes_keys = [8192, 131072] if args.quick else [8192, 32768, 131072]
    cases = (prefill_cases(reg, dims, dtypes, lengths) + decode_cases(reg, keys)
             + serving_cases(reg, lengths) + sdpa_cases(reg, lengths) + codes_cases(reg, codes_keys)
             + short_query_cases(reg, [4096, 16384]))
    if args.only:
        pattern = re.compile(args.only)
        cases = [c for c in cases if pattern.search(f"{c.group} {c.label}")]
    validations = []
    if args.validate:
        for c in cases:
            if c.group == "prefill" and c.real_size == lengths[0] and c.label.startswith(("f16 D=64 ", "f16 D=128 ",
                                                                                         "f32 D=64 ", "f16 D=512 ")):
                c.validate_size = 2 * c.sizes[1]
            if c.group == "decode" and c.real_size == keys[0] and c.batch == 1:
                c.validate_size = 4096
            if c.group in ("serving", "sdpa") and c.real_size == lengths[0] and "D=72" not in c.label:
                c.validate_size = 256 if c.group == "sdpa" else 1024
            if c.group == "codes decode" and c.real_size == codes_keys[0] and not c.exact:
                c.validate_size = 4096
            if c.group == "codes prefill":
                c.validate_size = 2048
    rows = []
    for i, c in enumerate(cases):
        disp = scaled(fit(c, c.real_size), 1 if c.exact else c.batch * c.kv_heads)
        flops = c.flops(c.real_size) * c.batch * c.kv_heads
        c.result = {"summary": summarize(disp), "gpus": {g.name: estimate(g, disp, flops) for g in GPUS},
                    "flops": flops}
        if c.min_bytes:
            nbytes = c.min_bytes(c.real_size) * c.batch * c.kv_heads
            c.result["min_bytes"] = nbytes
            for g in GPUS:
                r = c.result["gpus"][g.name]
                r["bw_minimum"] = max(nbytes / g.bandwidth, flops / g.fp32_peak)
                r["bw_efficiency"] = r["bw_minimum"] / r["estimate"]
        rows.append(c)
        if c.validate_size:
            pred = fit(c, c.validate_size)
            got = measure(c, c.validate_size)
            worst = 0.0
            for p, g in zip(pred, got):
                gf = flatten(g)
                for k, v in gf.items():
                    # Per binding counts are in the totals (a table's lines are a ceiling, not a polynomial).
                    if k.startswith("b"):
                        continue
                    err = abs(p["counts"].get(k, 0.0) - v) / max(1.0, abs(v))
                    worst = max(worst, err)
            validations.append((c.label.rsplit(" L=", 1)[0].rsplit(" keys=", 1)[0], c.sizes[:c.degree + 1],
                                c.validate_size, worst))
        print(f"[{i + 1}/{len(cases)}] {c.group} {c.label}: "
              f"{c.result['gpus']['M3 Max']['efficiency'] * 100:.1f}% on M3 Max ({time.time() - t0:.0f} s)",
              flush=True)
    scaling = None
    if args.validate:
        for c in cases:
            if c.group == "decode" and "GQA4" in c.label:
                one = [flatten(r) for r in measure(c, 1024, 1, 1)]
                four = [flatten(r) for r in measure(c, 1024, 2, 2)]
                worst = max(abs(4 * a.get(k, 0) - v) / max(1.0, v) for a, b in zip(one, four) for k, v in b.items()
                            if not k.startswith("b"))
                scaling = (c.label, worst)
                break
    if args.merge:
        merge_report(args.out, rows, validations)
    else:
        write_report(args.out, rows, validations, scaling, time.time() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"group": c.group, "label": c.label, **c.result} for c in rows], f, indent=1)
    print(f"wrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


# Sections of the report written by hand (measured before/after tables of a
# kernel change): kept across regenerations, from their heading to the end.
KEPT_HEADING = "## Before and after"


def kept_sections(path) -> str:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    at = text.find("\n" + KEPT_HEADING)
    return text[at + 1:].rstrip("\n") if at >= 0 else ""


GROUPS = ("prefill", "decode", "serving", "sdpa", "codes decode", "codes prefill", "short query")
MAC_HEADING = "## What only a Mac can measure"


# The columns every group's table starts with (counts, residency, the M3 Max estimate).
COMMON_HEADER = ("| case | kernels | dev read | dev written | re-read | re-read SIMD | lines | load B | B/req | "
                 "store B | TG bytes | MMAs | shuf | red | barriers/TG | thr | TG mem | res | M3 Max est. | bound |")
COMMON_SEPARATOR = "|---|---|" + "---:|" * 17 + "---|"


def common_cells(c):
    """A row's cells of COMMON_HEADER."""
    s, m3 = c.result["summary"], c.result["gpus"]["M3 Max"]
    return (f"| {c.label} | {s['kernels']} | {fmt_bytes(s['read'])} | {fmt_bytes(s['written'])} | "
            f"{s['reread']:.1f} | {s['reread_simd']:.1f} | {s['lines']:.3g} | {s['load_b']:.2f} | "
            f"{s['req_b']:.1f} | {s['store_b']:.2f} | "
            f"{fmt_bytes(s['tg_bytes'])} | {s['mma']:.3g} | {s['shuffles']:.3g} | {s['reductions']:.3g} | "
            f"{s['barriers_per_group']:.0f} | {s['threads']} | {s['tg_memory']} | {s['resident']} | "
            f"{fmt_time(m3['estimate'])} | {m3['bound']} |")


def group_lines(group, rs):
    """One group's section of the report: its heading and its table."""
    if group.startswith("codes "):
        return codes_lines(group, rs)
    L = [f"### {group}", ""]
    w = L.append
    w(COMMON_HEADER + " M1 Max eff. | M3 Max eff. | M4 Max eff. |")
    w(COMMON_SEPARATOR + "---:|" * 3)
    for c in rs:
        g = c.result["gpus"]
        w(common_cells(c) + f" {g['M1 Max']['efficiency'] * 100:.0f}% | {g['M3 Max']['efficiency'] * 100:.0f}% | "
          f"{g['M4 Max']['efficiency'] * 100:.0f}% |")
    return L


def codes_lines(group, rs):
    """A quantized-KV section: the common columns, then the bytes the op must
    move (codes and norms of K and V, q, out; bf16 rows: the bf16 caches),
    the minimum they set (or the FLOPs, if larger), the efficiency against it
    per GPU, and the M3 Max roofline terms."""
    L = [f"### {group}", ""]
    w = L.append
    if group == "codes decode":
        w("QuantizedKV caches [B, Hkv, keys] (random codes and norms; D = 128, H = 32, B = 1): tq8 = 8-bit K and V")
        w("(132 B per row), tq4 = 4-bit (68 B), K8/V4; bf16 = the dense decode on bf16 caches (256 B per row).")
    else:
        w("flash_attn_with_kvcache with 128 new query rows (bf16, causal: the newest rows) over caches of")
        w("[B, keys, Hkv] QuantizedKV (D = 128, H = 32, B = 1), beside the same call on bf16 caches.")
    w("min bytes = the caches' bytes (codes + norms, or bf16) + q read + out written; BW min = min bytes /")
    w("bandwidth (or the attention FLOPs / fp32 peak if larger); eff. = BW min / estimate. Roofline terms on")
    w("M3 Max: DRAM (distinct bytes, split partials included) / re-read / issue (scalar FLOPs charged 4*D per")
    w("pair; the unpacking of codes and centroid lookups are not observable) / sync / launch.")
    w("")
    w(COMMON_HEADER + " min bytes | M3 BW min | M1 Max eff. | M3 Max eff. | M4 Max eff. | DRAM | re-read | issue | "
      "issue / busy | sync | launch | decides |")
    w(COMMON_SEPARATOR + "---:|" * 11 + "---|")
    for c in rs:
        g = c.result["gpus"]
        m3 = g["M3 Max"]
        w(common_cells(c) + f" {fmt_bytes(c.result['min_bytes'])} | {fmt_time(m3['bw_minimum'])} | "
          f"{g['M1 Max']['bw_efficiency'] * 100:.0f}% | {m3['bw_efficiency'] * 100:.0f}% | "
          f"{g['M4 Max']['bw_efficiency'] * 100:.0f}% | {fmt_time(m3['dram'])} | {fmt_time(m3['reread'])} | "
          f"{fmt_time(m3['issue'])} | {fmt_time(m3['issue_busy'])} | {fmt_time(m3['sync'])} | "
          f"{fmt_time(m3['launch'])} | {deciding_term(m3)} |")
    sel = codes_target_rows(rs)
    if sel:
        met = [c for c in sel if codes_eff(c) >= 0.80]
        worst = min(sel, key=codes_eff)
        w("")
        w(f"Target ({CODES_TARGET}, M3 Max): {len(met)} of {len(sel)} rows meet it; worst "
          f"{worst.label}: {codes_eff(worst) * 100:.0f}%.")
    coded = [c for c in rs if not c.label.startswith("bf16")]
    if coded:
        L.extend(codes_findings(group, coded))
    return L


def span(values, fmt):
    """'a' or 'a-b' of the smallest and largest of values."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def pct(x):
    return f"{x * 100:.0f}%"


def codes_findings(group, rs):
    """Where the time of the quantized rows goes (M3 Max), from their numbers."""
    s = rs[0].result["summary"]
    m3 = [c.result["gpus"]["M3 Max"] for c in rs]
    decides = " / ".join(sorted({deciding_term(r) for r in m3}))
    share = span([r["issue_busy"] / r["estimate"] for r in m3], pct)
    if group == "codes decode":
        gqa = [c.result["summary"]["reread_simd"] for c in rs if "GQA" in c.label]
        eff = [r["bw_efficiency"] for r in m3]
        # The launch cost of the dispatches and DRAM at ETA_BW bound any kernel's efficiency here.
        ceiling = [r["bw_minimum"] / (r["bw_minimum"] / ETA_BW + r["launch"]) for r in m3]
        short = [i for i, x in enumerate(ceiling) if x < 0.80]
        rest = [eff[i] for i in range(len(rs)) if i not in short]
        words = [
            f"Where the time goes: {s['kernels']} splits each token's keys over NWG threadgroups of one SIMD group",
            f"(NWG from the key count and the grid: about 960 threadgroups, at least {CODES_MIN_SPLIT_KEYS} keys each), each serving",
            "the query heads of one kv head that fit its lanes (4 at D = 128), so every code row is read and",
            "unpacked once per kv head" + (f" (re-read SIMD {span(gqa, lambda v: f'{v:.2f}')} on GQA)" if gqa else ""),
            "; kv_codes_reduce merges the splits and undoes V's rotation. The estimate is set by",
            f"{decides} (issue / busy = {share} of it). Launch costs {LAUNCH_S * 1e6:.0f} µs per dispatch and DRAM",
            f"runs at {ETA_BW} of nominal, so no kernel gets a row past BW min / (BW min / {ETA_BW} + launch):"]
        if short:
            names = ", ".join(rs[i].label.replace(" D=128", "").replace(" B=1", "") for i in short)
            words += [f"{len(short)} rows cannot reach 80% under the model's launch cost ({names}: their bytes take",
                      f"{span([m3[i]['bw_minimum'] for i in short], fmt_time)}); they reach",
                      f"{span([eff[i] for i in short], pct)} of their ceilings' "
                      f"{span([ceiling[i] for i in short], pct)}."]
        if rest:
            words.append(f"The other {len(rest)} rows reach {span(rest, pct)}.")
        return ["", " ".join(words).replace(" ; ", "; ")]
    return ["", " ".join([
        f"Where the time goes: set by {decides} (issue / busy = {share} of the estimate). {s['kernels']} has",
        "no MMAs: every (row, key) pair's 4*D scalar FLOPs, one SIMD reduction per key per item",
        f"({s['reductions']:.3g} in all) and the decoded tiles' threadgroup reads ({fmt_bytes(s['tg_bytes'])})",
        "issue on the SIMD groups; the dense prefill's MMAs do the same FLOPs in a fraction of the slots.",
        "The codes' DRAM bytes are small beside that; the minimum here is the FLOPs at fp32 peak."])]


def deciding_term(r):
    """The roofline term that sets an estimate: memory (DRAM + re-read), issue
    (at full occupancy), or occupancy (issue over the busy fraction of the GPU,
    when a small grid leaves cores idle), beside sync and launch."""
    if r["issue_busy"] > r["dram"] + r["reread"]:
        return "occupancy" if r["issue_busy"] > 1.5 * r["issue"] else "issue"
    return "memory"


def split_sections(text):
    """The report's lines cut at every heading: [(heading line or '', lines)]."""
    out = [("", [])]
    for line in text.split("\n"):
        if line.startswith("#"):
            out.append((line, [line]))
        else:
            out[-1][1].append(line)
    return out


def upsert_row(lines, key, row):
    """Replaces the table row of `lines` whose first cell is `key`, or adds it
    after the table's last row before any 'batch x kv-head' row."""
    prefix = f"| {key} |"
    for i, line in enumerate(lines):
        if line.startswith(prefix):
            lines[i] = row
            return
    rows = [i for i, line in enumerate(lines) if line.startswith("| ") and not line.startswith("| batch x")]
    lines.insert(rows[-1] + 1 if rows else len(lines), row)


def merge_report(path, rows, validations):
    """Rewrites only the sections of the modelled groups in the report at
    `path` (a missing one goes before the Mac section), their validation rows
    and the targets they decide; everything else is kept as it is."""
    with open(path) as f:
        sections = split_sections(f.read().rstrip("\n"))
    for group in GROUPS:
        rs = [c for c in rows if c.group == group]
        if not rs:
            continue
        new = group_lines(group, rs) + [""]
        at = next((i for i, (h, _) in enumerate(sections) if h == f"### {group}"), None)
        if at is not None:
            sections[at] = (sections[at][0], new)
        else:
            mac = next(i for i, (h, _) in enumerate(sections) if h == MAC_HEADING)
            sections.insert(mac, (f"### {group}", new))
    for h, lines in sections:
        if h == "## Scaling from simulated sizes (validation)":
            for label, sizes, at, err in validations:
                upsert_row(lines, label, f"| {label} | {', '.join(map(str, sizes))} | {at} | {err:.2e} |")
        if h == "## Targets (M3 Max constants)":
            for name, n, met, worst in target_rows(rows):
                if name == CODES_TARGET:
                    upsert_row(lines, name, f"| {name} | {n} | {met} | {worst} |")
    with open(path, "w") as f:
        f.write("\n".join(line for _, lines in sections for line in lines) + "\n")


def write_report(path, rows, validations, scaling, seconds):
    L = []
    w = L.append
    w("# GPU cost model of the Metal kernels")
    w("")
    w("Written by `make gpu-model` (bench/gpu_model.py); the method, the constants and their sources are in")
    w("that file's header and below. Counts come from the simulator running the kernels' counted copies;")
    w("times are a roofline estimate, not a measurement: no Apple GPU has run these kernels.")
    w("")
    w("## GPUs")
    w("")
    w("| GPU | cores | clock | fp32 = fp16 = MMA peak | bandwidth | sources |")
    w("|---|---:|---:|---:|---:|---|")
    for g in GPUS:
        w(f"| {g.name} | {g.cores} | {g.clock_hz / 1e6:.0f} MHz | {g.fp32_peak / 1e12:.2f} TFLOP/s | "
          f"{g.bandwidth / 1e9:.0f} GB/s | {g.sources} |")
    w("")
    w("[PT] github.com/philipturner/metal-benchmarks (README: per-GPU table, per-core resources). "
      "[HMC] hmc-tech.com/gpu/apple-32-core-m4-max-vs-apple-40-core-m3-max. "
      "[AM1]/[AM3]/[AM4] Apple newsroom announcements of M1 Max (2021-10), M3 Max (2023-10), M4 Max (2024-10).")
    w("")
    w("## Calibration and error bars")
    w("")
    w(f"- MMA ceiling: peak x {ETA_MMA} (ETA_MMA). metal-flash-attention reports 83-94% of ALU on M1/M3; MLX's")
    w("  fused SDPA ~11.7 TFLOP/s at D=64 L=4096 f16 on M3 Max, i.e. "
      f"{11.7e12 / GPUS[1].fp32_peak * 100:.0f}% of its {GPUS[1].fp32_peak / 1e12:.1f} TFLOP/s.")
    w("  A kernel doing only the attention's MMAs, reading everything once, is estimated at:")
    w("")
    w("| peer figure | GPU | published | model's best case | model / published |")
    w("|---|---|---:|---:|---:|")
    for name, gname, tf, src in PEERS:
        g = next(x for x in GPUS if x.name == gname)
        best = g.fp32_peak * ETA_MMA
        w(f"| {name} ({src}) | {gname} | {tf / 1e12:.2f} TFLOP/s | {best / 1e12:.2f} TFLOP/s | {best / tf:.2f} |")
    w("")
    w("  So the model's best case sits within -6% / +8% of the published figures: the error bar of an")
    w("  estimate whose largest term is MMA issue.")
    w(f"- Memory: DRAM at {ETA_BW} of nominal (assumed; +-10%); re-reads from the L2/system cache at "
      f"{REREAD_BW_X}x DRAM (assumed; +-50%: Apple publishes no cache bandwidth).")
    w(f"- Issue: {SCHEDULERS} SIMD-group instructions per core per cycle ([PT]: 128 ALUs, 32 lanes); "
      f"special functions {SPECIAL_SLOTS} slots, SIMD reductions {REDUCTION_SLOTS} slots (assumed, +-50%).")
    w(f"- Assumed, not calibrated: barrier stall {BARRIER_CYCLES} cycles (+-100%), dispatch cost "
      f"{LAUNCH_S * 1e6:.0f} µs (+-100%),")
    w(f"  {MAX_THREADS_PER_CORE} threads and {TG_MEMORY_PER_CORE // 1024} KiB threadgroup memory per core for "
      "residency ([PT]: 768-3072 threads by register use, 64 KB).")
    w("- Not observable: scalar ALU work. Index arithmetic, bounds checks and softmax scalars of MMA kernels")
    w("  cost nothing here, so their estimates are optimistic (the prefill tile loaders' index math and the")
    w("  unpacking of two elements from each threadgroup word are invisible); kernels without MMAs are charged")
    w("  the attention's own FLOPs,")
    w("  so one that recomputes (sdpa) is estimated too fast. Efficiencies are upper bounds.")
    w("- Overall: issue-bound rows about +-15% plus the unobserved scalar work, memory-bound rows about")
    w("  +-25%, rows whose largest term is barriers or launch cost a factor of 2 either way.")
    w("")
    w("## Scaling from simulated sizes (validation)")
    w("")
    w("Each count of each dispatch is the polynomial through the fit sizes (exact rational interpolation),")
    w("evaluated at the real size; batch and kv heads multiply. Where a fourth size was also simulated:")
    w("")
    w("| case | fit sizes | checked at | largest relative error of any dispatch total |")
    w("|---|---|---:|---:|")
    for label, sizes, at, err in validations:
        w(f"| {label} | {', '.join(map(str, sizes))} | {at} | {err:.2e} |")
    if scaling:
        w(f"| batch x kv-head scaling: {scaling[0]} (B=Hkv=2 vs 4 x B=Hkv=1, keys 1024) | | | {scaling[1]:.2e} |")
    w("")
    w("## Targets (M3 Max constants)")
    w("")
    w("| target | rows | met | worst row |")
    w("|---|---:|---:|---|")
    for name, n, met, worst in target_rows(rows):
        w(f"| {name} | {n} | {met} | {worst} |")
    w("")
    w("## Where the time goes (M3 Max)")
    w("")
    w("The roofline's terms for one row per kernel family (the largest of memory and issue counts,")
    w("sync and launch add):")
    w("")
    w("| case | estimate | DRAM | re-read | issue (of it MMA) | sync | launch | efficiency |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|")
    picks = ["f16 D=128 causal L=4096", "f16 D=512 causal L=4096", "f32 D=128 causal L=4096",
             "f16 D=128 MHA B=1 keys=32768", "f16 D=128 GQA8 B=1 keys=32768", "f16 D=128 causal L=4096"]
    seen = set()
    for c in rows:
        if c.label in picks and (c.group, c.label) not in seen:
            seen.add((c.group, c.label))
            g = c.result["gpus"]["M3 Max"]
            w(f"| {c.group}: {c.label} | {fmt_time(g['estimate'])} | {fmt_time(g['dram'])} | "
              f"{fmt_time(g['reread'])} | {fmt_time(g['issue'])} ({fmt_time(g['mma'])}) | {fmt_time(g['sync'])} | "
              f"{fmt_time(g['launch'])} | {g['efficiency'] * 100:.0f}% |")
    w("")
    w("## Today's kernels (before)")
    w("")
    w("Per case, summed over the op's dispatches at the real shape (B=1, H=32 unless stated; decode H=32 with")
    w("Hkv=32/G). re-read = device bytes read by threads / distinct bytes read; re-read SIMD = the same with")
    w("lanes of a SIMD group that read one address counted once (coalesced bytes / distinct bytes); load B =")
    w("mean bytes per thread's device load; B/req = mean distinct bytes per coalesced request (one line of one")
    w("SIMD-group load instruction); barriers are per threadgroup of the first dispatch; res = threadgroups")
    w("resident per core.")
    w("Efficiency = physical minimum / estimate on each GPU.")
    for group in GROUPS:
        rs = [c for c in rows if c.group == group]
        if rs:
            w("")
            L.extend(group_lines(group, rs))
    w("")
    w("## What only a Mac can measure")
    w("")
    w("Actual occupancy (register allocation decides threads per core; the model assumes "
      f"{MAX_THREADS_PER_CORE}), register spills, the cache hit rates behind the re-read term,")
    w("the clock under sustained load, barrier and launch costs, and whether Apple's compiler merges or")
    w("splits the loads counted here (counts are the source's access widths).")
    w("")
    w(f"_Generated in {seconds:.0f} s of simulation._")
    kept = kept_sections(path)
    if kept:
        w("")
        w(kept)
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    sys.exit(main())
