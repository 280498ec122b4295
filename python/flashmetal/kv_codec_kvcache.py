"""flash_attn_with_kvcache over quantized caches (a QuantizedKV for k_cache
and/or v_cache, the other side possibly a dense cache): appended k/v are
encoded into the code caches (copied into a dense one) by one dispatch, then
the attention reads the codes; no cache row is dequantized."""
from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np

from . import _native
from ._arrays import BF16, F16, F32, as_input, check_out, tensor
from ._errors import InvalidTypeError, InvalidValueError, UnsupportedFeatureError
from ._interop import wrapper_like
from ._serving_args import attn_options, seq_tensors, sinks_arg
from .kv_codec import KVCodec, QuantizedKV
from .registry import Registry

_OP = "flash_attn_with_kvcache"


def _storage(cache: Any, name: str, appending: bool,
             in_place: Callable[[Any, str], np.ndarray]) -> tuple[Any, np.ndarray, np.ndarray | None]:
    """(codec or NULL, codes or the dense cache, norms or None) of one cache
    argument; the caller's own arrays when the append writes them (a dense
    one checked by serving's `in_place`)."""
    ffi = _native.ffi()
    if isinstance(cache, QuantizedKV):
        return (cache.codec._c,) + _codes(cache, name, appending)
    if isinstance(cache, KVCodec):
        raise InvalidTypeError(_OP, f"{name} must be a QuantizedKV or a dense cache array, got a KVCodec")
    dense = in_place(cache, name) if appending else as_input(cache, _OP, name)
    return ffi.NULL, dense, None


def _codes(cache: QuantizedKV, name: str, appending: bool) -> tuple[np.ndarray, np.ndarray]:
    if not appending:
        return as_input(cache.codes, _OP, f"{name} codes"), as_input(cache.norms, _OP, f"{name} norms")
    arrays = []
    for a, part in ((cache.codes, "codes"), (cache.norms, "norms")):
        if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or not a.flags.writeable:
            raise InvalidValueError(_OP, f"{name} {part} must be a C-contiguous, writeable numpy array to append "
                                         f"k/v into it in place")
        arrays.append(as_input(a, _OP, f"{name} {part}"))
    return arrays[0], arrays[1]


def _io(reg: Registry, op: str, qa: np.ndarray, sides: tuple[tuple[Any, Any, Any], ...]) -> np.dtype:
    """The dtype the kernel reads q and writes the output in: q's own when
    the library has a kernel for it over these sides (float32, or a 16-bit
    dtype every dense side also has), else float32, q converted for the
    kernel and the output back after it. Inside a caller's batch scope on a
    deferring backend (Metal) the work runs when the scope ends, after that
    conversion would have read it: such a call is refused there."""
    dense = [c.dtype for _, c, norms in sides if norms is None]
    if qa.dtype == F32 or (qa.dtype in (F16, BF16) and all(d == qa.dtype for d in dense)):
        return qa.dtype
    if reg._work_deferred:
        raise InvalidValueError(op, f"q ({qa.dtype}) differs from the dense cache's dtype, so the result is "
                                    f"converted after the work ran: inside a batch scope on metal pass q as float32 "
                                    f"or in the dense cache's dtype, or call outside the scope", argument="q")
    return F32


def _in_dtype(o: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The kernel's result in q's dtype: itself when it already is."""
    return o if o.dtype == dtype else o.astype(dtype)


def kvcache_over_codes(reg: Registry, q: Any, qa: np.ndarray, k_cache: Any, v_cache: Any, ka: np.ndarray | None,
                       va: np.ndarray | None, lens: np.ndarray | None, bt: np.ndarray | None, opts: Any,
                       sinks: np.ndarray | None, want_lse: bool, out: Any,
                       in_place: Callable[[Any, str], np.ndarray], first_keys: np.ndarray | None = None,
                       alibi: np.ndarray | None = None, cache_batch_idx: np.ndarray | None = None) -> Any:
    """flash_attn_with_kvcache's route when a cache is a QuantizedKV (see
    there; arguments already read by it). The kernel reads q and writes the
    output in q's dtype (_io says when it cannot). first_keys: cache_leftpad's
    [2, B] table (each sequence's end before the append, then its first
    key), or None. alibi: float32 [B, H] ALiBi slopes, or None.
    cache_batch_idx: int32 [B] (each sequence's cache row), or None. One library
    call encodes k/v into the caches at `lens` through `bt` and attends; it
    validates both before either runs, so a refused call leaves the caches
    as they were."""
    appending = ka is not None
    kcodec, kc, kn = _storage(k_cache, "k_cache", appending, in_place)
    vcodec, vc, vn = _storage(v_cache, "v_cache", appending, in_place)
    sides = ((kcodec, kc, kn), (vcodec, vc, vn))
    io = _io(reg, _OP, qa, sides)
    if qa.ndim != 4:
        raise InvalidValueError(_OP, f"q must be [B, seqlen_q, H, D], got shape {qa.shape}")
    out_arr = None if out is None else check_out(out, _OP, qa.shape, qa.dtype,
                                                 [qa, kc, kn, vc, vn, bt, cache_batch_idx, sinks, lens, alibi])
    b, ql, h, _ = qa.shape
    lse = np.empty((b, h, ql), dtype=F32) if want_lse else None
    result = _attend(reg, _OP, qa, io, sides, opts, out_arr, seqlens_k=lens if first_keys is None else first_keys,
                     block_table=bt, cache_batch_idx=cache_batch_idx, sinks=sinks, lse=lse, k_new=ka, v_new=va,
                     alibi_slopes=alibi)
    wrap = wrapper_like(q)
    final = wrap(result) if out is None else out
    if not want_lse:
        return final
    assert lse is not None
    return final, wrap(lse)


def ragged_over_codes(reg: Registry, rag: Any, dtype: np.dtype, k_cache: Any, v_cache: Any,
                      seqlens: np.ndarray | None, bt: np.ndarray | None, batch_idx: np.ndarray | None, opts: Any,
                      *, sinks: np.ndarray | None,
                      alibi: np.ndarray | None, want_lse: bool, out: Any,
                      in_place: Callable[[Any, str], np.ndarray]
                      ) -> Callable[[np.ndarray, Any], tuple[np.ndarray, np.ndarray | None]]:
    """flash_attn_with_kvcache's ragged call (cu_seqlens_q / cu_seqlens_k_new;
    `rag` the packed layout, _kvcache_ragged.Ragged) over quantized caches:
    the call `(q, new)` that encodes `new`'s rows (k, v, cu_seqlens_k_new or
    None) into the caches and runs the varlen prefill of the packed q
    [total_q, H, D] over the codes, lengths `seqlens` ([B], or [2, B] with
    first keys) through `bt` (and cache rows `batch_idx`, cache_batch_idx), in one library call that validates both before
    either runs. It returns (out [total_q, H, D] in `dtype`, written into the
    caller's `out` when given; lse [H, total_q] or None); the library makes
    rows past cu_seqlens_q[B] read 0 and -inf."""
    appending = rag.k is not None
    kcodec, kc, kn = _storage(k_cache, "k_cache", appending, in_place)
    vcodec, vc, vn = _storage(v_cache, "v_cache", appending, in_place)
    sides = ((kcodec, kc, kn), (vcodec, vc, vn))
    shape = rag.q.shape
    out_flat = None
    if out is not None:
        out_flat = check_out(out, _OP, rag.dense_q or shape, dtype,
                             [rag.q, kc, kn, vc, vn, bt, batch_idx, sinks, seqlens, alibi])
        out_flat = out_flat.reshape(shape)

    def call(q: np.ndarray, new: Any) -> tuple[np.ndarray, np.ndarray | None]:
        lse = np.empty((shape[1], shape[0]), dtype=F32) if want_lse else None
        k_new, v_new, cu_k = (None, None, None) if new is None else new
        result = _attend(reg, _OP, q, _io(reg, _OP, q, sides), sides, opts, out_flat, dtype=dtype,
                         cu_seqlens_q=rag.cu_q, seqlens_k=seqlens, block_table=bt, cache_batch_idx=batch_idx,
                         sinks=sinks, lse=lse,
                         alibi_slopes=alibi, k_new=k_new, v_new=v_new, cu_seqlens_k_new=cu_k)
        return result, lse
    return call


def varlen_over_codes(reg: Registry, qa: np.ndarray, k: Any, v: Any, cq: np.ndarray, ck: np.ndarray,
                      bt: np.ndarray | None, opts: Any, sinks: np.ndarray | None,
                      want_lse: bool, alibi: np.ndarray | None = None, seqused_q: np.ndarray | None = None,
                      seqused_k: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """flash_attn_varlen_func's route when k or v is a QuantizedKV page pool
    (leading shape [num_pages, page_size, Hkv] with block_table) or packed
    keys (leading shape [total_k, Hkv], sequence b's keys its rows
    cu_seqlens_k[b] ..< [b+1]; the other side may be a dense [total_k, Hkv,
    D]): (out [total_q, H, D] in q's dtype, lse [H, total_q] or None). The
    library makes rows past the last sequence, and rows past seqused_q[b],
    read as rows that see nothing (0, lse -inf)."""
    op = "flash_attn_varlen_func"
    (kc, kx, kn), (vc, vx, vn) = _side(k, "k", op), _side(v, "v", op)
    if bt is None:  # packed k/v [total_k, Hkv]: the library reads them as storage [1, total_k, Hkv]
        kx, vx = _leading_one(kx, 4), _leading_one(vx, 4)
        kn, vn = (None if n is None else _leading_one(n, 4) for n in (kn, vn))
    sides = ((kc, kx, kn), (vc, vx, vn))
    if qa.ndim != 3:
        raise InvalidValueError(op, f"q must be [total_q, H, D], got shape {qa.shape}")
    io = _io(reg, op, qa, sides)
    lse = np.empty((qa.shape[1], qa.shape[0]), dtype=F32) if want_lse else None
    result = _attend(reg, op, qa, io, sides, opts, None, cu_seqlens_q=cq, cu_seqlens_k=ck, block_table=bt,
                     sinks=sinks, lse=lse, alibi_slopes=alibi, seqused_q=seqused_q, seqlens_k=seqused_k)
    return result, lse


def attend_codes(reg: Registry, op: str, qa: np.ndarray, k: Any, v: Any, lens: np.ndarray | None, opts: Any,
                 sinks: np.ndarray | None, want_lse: bool,
                 alibi: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """flash_attn_func's and flash_attn_prefill's route when k or v is a
    QuantizedKV of leading shape [B, seqlen_k, Hkv] (flash-attn's layout; the
    other side may be a dense [B, seqlen_k, Hkv, D] cache): (out [B, qL, H, D]
    in q's dtype, lse [B, H, qL] or None). lens: keys per sequence (int32
    [B]), or None for all seqlen_k."""
    sides = (_side(k, "k", op), _side(v, "v", op))
    io = _io(reg, op, qa, sides)
    if qa.ndim != 4:
        raise InvalidValueError(op, f"q must be [B, seqlen_q, H, D] over QuantizedKV k/v, got shape {qa.shape}")
    b, ql, h, _ = qa.shape
    lse = np.empty((b, h, ql), dtype=F32) if want_lse else None
    return _attend(reg, op, qa, io, sides, opts, None, seqlens_k=lens, sinks=sinks, lse=lse, alibi_slopes=alibi), lse


def prefill_over_codes(reg: Registry, op: str, q: Any, k: Any, v: Any, *, mask: Any, causal: bool, q_offset: Any,
                       scale: Any, softcap: Any, window: Any, layout: str, kv_len: Any, out: Any, blk: Any,
                       sinks: Any) -> Any:
    """flash_attn_prefill's route when k or v is a QuantizedKV (see there):
    layout "blhd" only (codes of leading shape [B, cap, Hkv]), the query rows
    the newest kv_len positions (q_offset kv_len - qL), causal and window,
    no mask or blk."""
    for name, value in (("mask", mask), ("blk", blk)):
        if value is not None:
            raise UnsupportedFeatureError(op, f"{name} is not supported over QuantizedKV k/v (causal and window "
                                              f"are)", argument=name)
    if layout != "blhd":
        raise InvalidValueError(op, f"QuantizedKV k/v take layout='blhd' (q [B, qL, H, D], codes of leading shape "
                                    f"[B, cap, Hkv]), got layout={layout!r}", argument="layout")
    qa = as_input(q, op, "q")
    if qa.ndim != 4:
        raise InvalidValueError(op, f"q must be [B, qL, H, D] (layout 'blhd'), got shape {qa.shape}")
    codes = k.codes if isinstance(k, QuantizedKV) else v.codes
    cap = codes.shape[1] if codes.ndim >= 2 else 0
    kl = cap if kv_len is None else _native.index_arg(op, "kv_len", kv_len, 1)
    if kl > cap:
        raise InvalidValueError(op, f"kv_len ({kl}) must be <= the cache capacity, k's dim 1 ({cap})",
                                argument="kv_len")
    ql = qa.shape[1]
    offset = max(kl - ql, 0) if q_offset is None else _native.index_arg(op, "q_offset", q_offset)
    if offset != kl - ql:
        raise UnsupportedFeatureError(op, f"over QuantizedKV k/v the query rows are the newest of the kv_len keys: "
                                          f"q_offset must be kv_len - qL = {kl - ql} (qL <= kv_len), got {offset}",
                                      argument="q_offset")
    d = qa.shape[3]
    left = -1 if window is None else _native.index_arg(op, "window", window, 1) - 1
    opts = attn_options(op, head_dim=d, softmax_scale=_native.scale_arg(op, scale, d), softcap=softcap,
                        causal=causal, window_size=(left, -1))
    lens = np.full(qa.shape[0], kl, dtype=np.int32)
    o, _ = attend_codes(reg, op, qa, k, v, lens, opts, sinks_arg(op, sinks), False)
    if out is None:
        return o
    dst = check_out(out, op, qa.shape, qa.dtype, [qa, codes])
    dst[...] = o
    return out


def _attend(reg: Registry, op: str, q: np.ndarray, io: np.dtype, sides: tuple[tuple[Any, Any, Any], ...], opts: Any,
            out: np.ndarray | None, *, dtype: np.dtype | None = None, **seq: np.ndarray | None) -> np.ndarray:
    """One _attn_dispatch of q over `sides`, the kernel reading q and
    writing its output in `io` (_io's choice): the result in `dtype` (q's
    when None), written into `out` (of q's shape) when given, which is then
    returned. In q's own dtype the kernel writes straight into out."""
    want = q.dtype if dtype is None else dtype
    o32 = out if out is not None and io == want else np.empty(q.shape, dtype=io)
    _attn_dispatch(reg, op, np.ascontiguousarray(q, dtype=io), sides, o32, opts, **seq)
    result = _in_dtype(o32, want)
    if out is None:
        return result
    if result is not out:
        out[...] = result
    return out


def _attn_dispatch(reg: Registry, op: str, q32: np.ndarray, sides: tuple[tuple[Any, Any, Any], ...],
                   o32: np.ndarray, opts: Any, **seq: np.ndarray | None) -> None:
    """One fm_dispatch_kv_codes_attn: q32 into o32 (both float32, or both
    of a 16-bit dtype any dense side has) over the
    (codec or NULL, codes or dense cache, norms or None) of k and v; `seq`
    the FMSeqTensors arrays (seqlens_k, block_table, cu_seqlens_q/_k, sinks,
    lse, alibi_slopes; None for absent)."""
    ffi = _native.ffi()
    (kcodec, kc, kn), (vcodec, vc, vn) = sides
    seq_ptr, keep = seq_tensors(ffi, **seq)
    _native.call(reg, "fm_dispatch_kv_codes_attn", tensor(ffi, q32), kcodec, tensor(ffi, kc), tensor(ffi, kn),
                 vcodec, tensor(ffi, vc), tensor(ffi, vn), seq_ptr, tensor(ffi, o32), opts, op=op,
                 keep=(q32, kc, kn, vc, vn, o32, tuple(seq.values()), keep))


def _leading_one(x: np.ndarray, rank: int) -> np.ndarray:
    """x [total_k, ...] as [1, total_k, ...] when it has rank - 1 dims (else
    as given: the library names a wrong shape)."""
    return x.reshape(1, *x.shape) if x.ndim == rank - 1 else x


def _side(cache: Any, name: str, op: str) -> tuple[Any, np.ndarray, np.ndarray | None]:
    """(codec or NULL, codes or the dense pool, norms or None), read only."""
    if isinstance(cache, QuantizedKV):
        return cache.codec._c, as_input(cache.codes, op, f"{name} codes"), as_input(cache.norms, op, f"{name} norms")
    return _native.ffi().NULL, as_input(cache, op, name), None
