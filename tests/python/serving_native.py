"""Calls of the serving decode and kv_append C entry points (fm_dispatch_vec_seq,
fm_dispatch_kv_append) through flashmetal._native, for what the public serving
API never passes them (e.g. cu_seqlens to decode) and for the library's own op
names in messages; and the paged-cache builder the decode tests share."""
from __future__ import annotations

from typing import Any

import numpy as np

import flashmetal as fm
from flashmetal import _native
from numerics import randn

VEC_SEQ_OP = "flash_attn_vec_seq"
KV_APPEND_OP = "kv_append"
_CODES = {np.dtype(np.float32): "FM_DTYPE_F32", np.dtype(np.float16): "FM_DTYPE_F16",
          np.dtype(np.int32): "FM_DTYPE_I32", np.dtype(np.uint8): "FM_DTYPE_U8"}


def tensor(a: np.ndarray | None) -> Any:
    """An FMTensor* over `a` (int32 included), NULL for None; the caller keeps `a` alive."""
    ffi = _native.ffi()
    if a is None:
        return ffi.NULL
    t = ffi.new("FMTensor *")
    t.data = ffi.cast("void *", a.__array_interface__["data"][0])
    t.nbytes = a.nbytes
    name = "FM_DTYPE_BF16" if a.dtype.name == "bfloat16" else _CODES[a.dtype]
    t.dtype = _native.constant(name)
    t.ndim = a.ndim
    t.shape[0:a.ndim] = a.shape
    return t


def vec_seq(reg: fm.Registry, q: np.ndarray, k: np.ndarray, v: np.ndarray, *, seqlens: np.ndarray | None = None,
            block_table: np.ndarray | None = None, sinks: np.ndarray | None = None, lse: bool = False,
            causal: bool = True, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            scale: float | None = None, cu_seqlens: np.ndarray | None = None,
            lse_out: np.ndarray | None = None, alibi: np.ndarray | None = None,
            head_major: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
    """Serving decode: q [B, H, D] (or [B, L, H, D]; head-major [B, H, L, D])
    -> (out float32 shaped as q, lse float32 q.shape[:-1] or None)."""
    ffi = _native.ffi()
    out = np.full(q.shape, np.nan, dtype=np.float32)
    if lse and lse_out is None:
        lse_out = np.full(q.shape[:-1], np.nan, dtype=np.float32)
    keep = [q, k, v, seqlens, block_table, sinks, lse_out, out, cu_seqlens, alibi]
    ts = [tensor(a) for a in (q, k, v, seqlens, block_table, sinks, lse_out, out, cu_seqlens, alibi)]
    seq = ffi.new("FMSeqTensors *")
    seq.seqlens_k, seq.block_table, seq.sinks, seq.lse, seq.cu_seqlens_k = ts[3], ts[4], ts[5], ts[6], ts[8]
    seq.alibi_slopes = ts[9]
    opts = _native.options(
        "FMAttnOptions", scale=_native.scale_arg(VEC_SEQ_OP, scale, q.shape[-1]), softcap=softcap,
        causal=int(causal), window_left=window[0], window_right=window[1], max_seqlen_q=0, max_seqlen_k=0,
        head_major=head_major)
    _native.call(reg, "fm_dispatch_vec_seq", ts[0], ts[1], ts[2], seq, ffi.NULL, ts[7], opts,
                 op=VEC_SEQ_OP, keep=tuple(keep))
    return out, lse_out


def kv_append(reg: fm.Registry, k_new: np.ndarray, v_new: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
              seqlens: np.ndarray, block_table: np.ndarray | None = None) -> None:
    """Writes k_new/v_new [B, n_new, Hkv, D] into the caches in place at rows seqlens[b] + i."""
    ts = [tensor(a) for a in (k_new, v_new, k_cache, v_cache, seqlens, block_table)]
    _native.call(reg, "fm_dispatch_kv_append", *ts, op=KV_APPEND_OP,
                 keep=(k_new, v_new, k_cache, v_cache, seqlens, block_table))


def make_cache(rng, b, cap, hkv, d, dtype, page_size=None, spare_pages=2):
    """Contiguous caches [B, cap, Hkv, D], or the same rows scattered over
    shuffled pages [num_pages, page_size, Hkv, D] with a block table whose
    unused entries are -1 (never read)."""
    k = randn(rng, (b, cap, hkv, d), dtype)
    v = randn(rng, (b, cap, hkv, d), dtype)
    if page_size is None:
        return k, v, None
    per_seq = -(-cap // page_size)
    num = b * per_seq + spare_pages
    order = rng.permutation(num)
    table = order[:b * per_seq].reshape(b, per_seq).astype(np.int32)
    kp = randn(rng, (num, page_size, hkv, d), dtype)
    vp = randn(rng, (num, page_size, hkv, d), dtype)
    for bb in range(b):
        for j in range(per_seq):
            rows = slice(j * page_size, min((j + 1) * page_size, cap))
            n = rows.stop - rows.start
            kp[table[bb, j], :n] = k[bb, rows]
            vp[table[bb, j], :n] = v[bb, rows]
    return kp, vp, table
