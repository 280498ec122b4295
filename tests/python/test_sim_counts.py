"""The simulator's counted dispatches (FLASHMETAL_SIM_COUNTS), the input of the
GPU cost model (bench/gpu_model.py): counting never changes an output bit, and
the counts of a tiny prefill are pinned, so a kernel change that adds device
traffic, barriers or MMAs shows up here and must update the pin on purpose."""
from __future__ import annotations

import os

import numpy as np
import pytest

import flashmetal as fm
from numerics import BF16, F16, randn
from sim_counting import run_counted


@pytest.fixture(scope="module")
def sim():
    with fm.Registry("sim") as reg:
        yield reg


def same_bits(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def ops(sim, rng):
    """One call per kernel family, small."""
    q16, k16, v16 = (randn(rng, (1, 2, 40, 64), F16) for _ in range(3))
    qb, kb, vb = (randn(rng, (1, 1, 16, 512), BF16) for _ in range(3))
    qd = rng.standard_normal((1, 4, 128)).astype(np.float32)
    kc, vc = (randn(rng, (1, 1, 300, 128), BF16) for _ in range(2))
    q32, k32, v32 = (rng.standard_normal((1, 2, 9, 24)).astype(np.float32) for _ in range(3))
    cu = np.array([0, 5, 37], dtype=np.int32)
    qv, kv, vv = (randn(rng, (37, 2, 128), F16) for _ in range(3))
    return {
        "prefill f16 causal window": lambda: fm.flash_attn_prefill(q16, k16, v16, causal=True, window=23,
                                                                    registry=sim),
        "prefill bf16 D=512": lambda: fm.flash_attn_prefill(qb, kb, vb, registry=sim),
        "decode GQA": lambda: fm.flash_attn_decode(qd, kc, vc, 300, window=200, registry=sim),
        "sdpa f32": lambda: fm.sdpa(q32, k32, v32, causal=True, registry=sim),
        "varlen": lambda: fm.flash_attn_varlen_func(qv, kv, vv, cu, cu, 32, 32, causal=True, registry=sim),
    }


def test_counting_leaves_outputs_bit_identical(sim, rng, tmp_path):
    for name, fn in ops(sim, rng).items():
        plain = fn()
        got, recs = run_counted(tmp_path / "counts.jsonl", fn)
        assert same_bits(plain, got), f"{name}: counting changed the output"
        assert recs, f"{name}: no dispatch was counted"
        for r in recs:
            assert r["threadgroups"] == int(np.prod(r["grid"])), f"{name}: {r['kernel']} ran part of its grid"
            assert r["device"]["bytes_read"] > 0 and r["device"]["bytes_written"] > 0, name
        # Off again: nothing more is written.
        n = len(recs)
        fn()
        with open(tmp_path / "counts.jsonl") as f:
            assert len(f.readlines()) == n, f"{name}: counted with FLASHMETAL_SIM_COUNTS unset"


def test_unwritable_counts_file_is_an_error(sim, rng, tmp_path):
    q = randn(rng, (1, 1, 8, 64), F16)
    os.environ["FLASHMETAL_SIM_COUNTS"] = str(tmp_path / "missing-dir" / "counts.jsonl")
    try:
        with pytest.raises(fm.BackendError, match="FLASHMETAL_SIM_COUNTS"):
            fm.flash_attn_prefill(q, q, q, registry=sim)
    finally:
        del os.environ["FLASHMETAL_SIM_COUNTS"]


# f16, D=64, B=1, H=1, qL=kL=64, no mask: 2 query tiles of BQ=32, 4 key tiles
# of BK=16, 4 simdgroups of 32 threads. Buffers: 0 Q, 1 K, 2 V, 3 O, each
# 64 x 64 x 2 bytes.
TILE_BYTES = 64 * 64 * 2
PINNED = {
    "threadgroups": 2, "threads_per_threadgroup": 128, "threadgroup_memory": 6916,
    "tg_bytes_read": 196608, "tg_bytes_written": 40960, "tg_load_events": 49152, "tg_store_events": 10240,
    "threadgroup_barriers": 32, "simd_barriers": 0, "simd_shuffles": 128, "simd_reductions": 0, "simd_votes": 0,
    "mma_f16": 0, "mma_bf16": 0, "mma_f32": 1024, "special": 5120,
}
PINNED_DEVICE = {"bytes_read": 40960, "bytes_written": 8192, "load_events": 2560, "store_events": 4096,
                 "unique_bytes_read": 24576, "unique_bytes_written": 8192, "unique_lines": 256,
                 "load_requests": 320, "load_request_bytes": 40960, "store_requests": 1024}


def aligned64(a: np.ndarray) -> np.ndarray:
    """A copy of `a` starting on a 64-byte boundary (the pin must not depend on the allocator)."""
    buf = np.zeros(a.nbytes + 64, np.uint8)
    start = (-buf.ctypes.data) % 64
    out = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_tiny_prefill_counts_pinned(sim, rng, tmp_path):
    q, k, v = (aligned64(randn(rng, (1, 1, 64, 64), F16)) for _ in range(3))
    _, recs = run_counted(tmp_path / "counts.jsonl", lambda: fm.flash_attn_prefill(q, k, v, registry=sim))
    assert [r["kernel"] for r in recs] == ["flash_attn_prefill_f16_d64"]
    r = recs[0]
    # What follows from the algorithm, independently of the pin: Q read once,
    # K and V once per query tile, O written once; every byte of each; the
    # MMAs of S = Q K^T and O += P V: per simdgroup (8 rows) and key tile
    # (16 keys), 2 x 8 for S plus 8 x 2 for PV, over 4 key tiles, 4
    # simdgroups, 2 query tiles.
    b = r["binding"]
    assert b["0"]["bytes_read"] == b["0"]["unique_bytes_read"] == TILE_BYTES
    for kv in ("1", "2"):
        assert b[kv]["unique_bytes_read"] == TILE_BYTES and b[kv]["bytes_read"] == 2 * TILE_BYTES
    assert b["3"]["bytes_written"] == b["3"]["unique_bytes_written"] == TILE_BYTES and b["3"]["bytes_read"] == 0
    assert all(b[i]["unique_lines"] == TILE_BYTES // 128 for i in "0123")
    assert r["mma_f32"] == (2 * 8 + 8 * 2) * 4 * 4 * 2
    # The pin: q, k and v start on 16-byte boundaries with 128-byte rows, so
    # the tile loaders copy a 16-byte run per thread (one uint4 load: 512
    # bytes, 4 whole lines, per SIMD-group load) into 32-bit threadgroup
    # words, and every MMA fragment load is one word; the output's stores
    # follow the MMA fragment layout, a few bytes on each of 8 lines per
    # SIMD-group store.
    for key, want in PINNED.items():
        assert r[key] == want, f"{key}: {r[key]} counted, {want} pinned"
    for key, want in PINNED_DEVICE.items():
        assert r["device"][key] == want, f"device {key}: {r['device'][key]} counted, {want} pinned"


def test_counts_scale_with_heads(sim, rng, tmp_path):
    """Threadgroups of different heads are independent and touch disjoint
    memory: every count of 2 heads is twice that of 1 (the model's scaling)."""
    q, k, v = (randn(rng, (1, 2, 64, 64), F16) for _ in range(3))
    _, two = run_counted(tmp_path / "counts.jsonl", lambda: fm.flash_attn_prefill(q, k, v, registry=sim))
    _, one = run_counted(tmp_path / "counts.jsonl", lambda: fm.flash_attn_prefill(q[:, :1].copy(), k[:, :1].copy(), v[:, :1].copy(),
                                                                  registry=sim))
    for key in PINNED:
        if key not in ("threads_per_threadgroup", "threadgroup_memory"):
            assert two[0][key] == 2 * one[0][key], key
    for key in PINNED_DEVICE:
        assert two[0]["device"][key] == 2 * one[0]["device"][key], key


@pytest.mark.parametrize("kv", [F16, BF16])
def test_decode_gqa_reads_kv_once_in_vectors(sim, rng, tmp_path, kv):
    """The decode main kernel serves a kv head's query heads (here 8) in one
    threadgroup: K and V are read once (bytes read == distinct bytes, every
    visible key row once), in 8-byte loads (half4: 4 elements per lane)."""
    d, keys, window = 128, 300, 200
    q = rng.standard_normal((1, 8, d)).astype(np.float32)
    kc, vc = (randn(rng, (1, 1, 320, d), kv) for _ in range(2))
    _, recs = run_counted(tmp_path / "counts.jsonl", lambda: fm.flash_attn_decode(q, kc, vc, keys, window=window, registry=sim))
    main = recs[0]
    assert main["kernel"].startswith("flash_attn_vec_") and main["threads_per_threadgroup"] == 8 * 32
    # Visible keys [100, 300) sit in the 32-key chunks from 96; rows < 100 are never read.
    for binding in ("2", "3"):
        b = main["binding"][binding]
        assert b["bytes_read"] == b["unique_bytes_read"] == window * d * 2, (binding, b)
        assert b["bytes_read"] == 8 * b["load_events"], (binding, b)


def test_short_query_gqa_reads_kv_once(sim, rng, tmp_path):
    """Short queries: the 4 x 8 query rows of one kv head (GQA 8, qL = 4,
    D = 128) share one threadgroup of 32 SIMD groups, so K and V are read
    once (bytes read == distinct bytes == every key row once)."""
    d, keys = 128, 96
    q = randn(rng, (1, 4, 8, d), BF16)
    k, v = (randn(rng, (1, keys, 1, d), BF16) for _ in range(2))
    _, recs = run_counted(tmp_path / "counts.jsonl", lambda: fm.flash_attn_func(q, k, v, causal=True, registry=sim))
    main = recs[0]
    assert main["kernel"].startswith("flash_attn_vec_") and main["threads_per_threadgroup"] == 32 * 32, main["kernel"]
    for binding in ("2", "3"):
        b = main["binding"][binding]
        assert b["bytes_read"] == b["unique_bytes_read"] == keys * d * 2, (binding, b)
