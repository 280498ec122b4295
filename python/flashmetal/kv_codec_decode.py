"""flash_attn_decode over quantized caches (QuantizedKV for k_cache and
v_cache): the attention reads the codes; no cache row is dequantized."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _native
from ._arrays import BF16, F16, F32, as_input, check_out, out_array, tensor
from ._errors import InvalidTypeError, InvalidValueError
from .kv_codec import QuantizedKV
from .registry import RegistryLike, resolve
from .serving import flash_attn_with_kvcache

_OP = "flash_attn_decode"


def decode_over_codes(q: Any, k_cache: Any, v_cache: Any, kv_len: int, *, scale: float | None,
                      window: int | None, softcap: float, fwht: bool, fwht_signs: Any, out: Any,
                      registry: RegistryLike) -> Any:
    """flash_attn_decode's route when a cache is a QuantizedKV (see there).

    q ``[H, D]`` or ``[B, H, D]``, float32, float16 or bfloat16 (the output
    in its dtype; a dense cache of q's dtype if q is 16-bit); k_cache and v_cache QuantizedKV of
    leading shape ``[Hkv, cap]`` or ``[B, Hkv, cap]`` whose codecs have head
    dim D (their widths and seeds may differ). The query is rotated with K's
    signs and Hadamard blocks, scores are taken against the codes, and the
    output accumulated in V's rotated basis is rotated back once.
    """
    if fwht or fwht_signs is not None:
        raise InvalidValueError(_OP, "fwht and fwht_signs do not apply to QuantizedKV caches: their codecs' "
                                     "rotation is undone by the decode itself")
    if not (isinstance(k_cache, QuantizedKV) and isinstance(v_cache, QuantizedKV)):
        return _one_side_dense(q, k_cache, v_cache, kv_len, scale=scale, window=window, softcap=softcap, out=out,
                               registry=registry)
    reg = resolve(registry, _OP)
    qa = as_input(q, _OP, "q")
    kc, kn = as_input(k_cache.codes, _OP, "k_cache codes"), as_input(k_cache.norms, _OP, "k_cache norms")
    vc, vn = as_input(v_cache.codes, _OP, "v_cache codes"), as_input(v_cache.norms, _OP, "v_cache norms")
    io = qa.dtype if qa.dtype in (F16, BF16) else F32  # the library refuses any other q
    if out is None:
        out = dst = np.empty(qa.shape, dtype=io)
    else:
        dst = out_array(out, _OP)  # the library checks its shape, dtype and overlaps
    opts = _native.options(
        "FMKVCodesDecodeOptions",
        scale=_native.scale_arg(_OP, scale, qa.shape[-1] if qa.ndim else 0),
        softcap=_native.float32_arg(_OP, "softcap", softcap),
        kv_len=_native.index_arg(_OP, "kv_len", kv_len, 1),
        window=0 if window is None else _native.index_arg(_OP, "window", window, 1))
    ffi = _native.ffi()
    _native.call(reg, "fm_dispatch_kv_codes_decode", tensor(ffi, qa), k_cache.codec._c, tensor(ffi, kc),
                 tensor(ffi, kn), v_cache.codec._c, tensor(ffi, vc), tensor(ffi, vn), tensor(ffi, dst), opts,
                 op=_OP, keep=(qa, kc, kn, vc, vn, dst))
    return out


def _one_side_dense(q: Any, k_cache: Any, v_cache: Any, kv_len: int, *, scale: float | None, window: int | None,
                    softcap: float, out: Any, registry: RegistryLike) -> Any:
    """One cache a QuantizedKV, the other dense (``[(B,) Hkv, cap, D]``):
    flash_attn_with_kvcache's decode over B * Hkv sequences of one kv head.
    ``[B, Hkv, cap]`` storage is ``[B * Hkv, cap, 1]`` (a view, no copy), and
    each sequence's queries are its kv head's H / Hkv query heads."""
    reg = resolve(registry, _OP)
    qa = as_input(q, _OP, "q")
    if qa.ndim not in (2, 3):
        raise InvalidValueError(_OP, f"q must be [H, D] or [B, H, D], got shape {list(qa.shape)}", argument="q")
    coded, dense_name = (k_cache, "v_cache") if isinstance(k_cache, QuantizedKV) else (v_cache, "k_cache")
    dense = as_input(v_cache if dense_name == "v_cache" else k_cache, _OP, dense_name)
    d = qa.shape[-1]
    lead = coded.shape
    if len(lead) != qa.ndim or lead[:-2] != qa.shape[:-2]:
        raise InvalidValueError(_OP, f"the QuantizedKV cache's leading shape {list(lead)} must be [Hkv, cap] or "
                                f"[B, Hkv, cap] with q's batch (q {list(qa.shape)})")
    if coded.codec.head_dim != d:
        raise InvalidValueError(_OP, f"the QuantizedKV cache's codec head_dim {coded.codec.head_dim} must equal q's "
                                f"head dim {d}")
    if dense.shape != tuple(lead) + (d,):
        raise InvalidValueError(_OP, f"{dense_name} shape {list(dense.shape)} must be {list(lead) + [d]} (the "
                                "QuantizedKV cache's leading shape and q's head dim)", argument=dense_name)
    h, (hkv, cap) = qa.shape[-2], lead[-2:]
    if hkv == 0 or h % hkv:
        raise InvalidValueError(_OP, f"the q heads ({h}) must be a multiple of the cache heads ({hkv})", argument="q")
    n = _native.index_arg(_OP, "kv_len", kv_len, 1)
    if n > cap:
        raise InvalidValueError(_OP, f"kv_len ({n}) must be <= the cache capacity ({cap})", argument="kv_len")
    sc = _native.scale_arg(_OP, scale, d)
    cap_ = _native.float32_arg(_OP, "softcap", softcap)
    left = -1 if window is None else _native.index_arg(_OP, "window", window, 1) - 1
    if qa.dtype != F32 and qa.dtype != dense.dtype:
        raise InvalidTypeError(_OP, f"q must be float32 or {dense_name}'s dtype ({dense.dtype}), got {qa.dtype}",
                               argument="q")
    dst = None if out is None else check_out(out, _OP, qa.shape, qa.dtype, [qa, dense, coded.codes, coded.norms])
    seqs = int(np.prod(lead[:-1]))
    g = h // hkv

    def one_head(c: Any) -> Any:
        if isinstance(c, QuantizedKV):
            return QuantizedKV(c.codec, np.reshape(c.codes, (seqs, cap, 1, -1)),
                               np.reshape(c.norms, (seqs, cap, 1, -1)))
        return np.reshape(dense, (seqs, cap, 1, d))

    result = flash_attn_with_kvcache(np.reshape(qa, (seqs, 1, g, d)), one_head(k_cache), one_head(v_cache),
                                     cache_seqlens=np.full(seqs, n, np.int32), softmax_scale=sc,
                                     window_size=(left, -1), softcap=cap_, registry=reg)
    if dst is None:
        return np.reshape(result, qa.shape)
    dst[...] = np.reshape(result, qa.shape)
    return out
