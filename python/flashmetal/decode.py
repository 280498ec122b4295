"""Split-KV decode (the `vec` kernels), with the fused FWHT sign undo."""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _native
from ._hints import layout_hint
from ._arrays import BF16, F16, F32, as_input, check_out, empty_batch, out_array, out_shape, tensor
from .kv_codec import QuantizedKV
from .kv_codec_decode import decode_over_codes
from .registry import Registry, RegistryLike, resolve

_OP = "flash_attn_decode"


@layout_hint(_OP, q="q", k="k_cache", v="v_cache", decode=True)
def flash_attn_decode(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    kv_len: int,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: int | None = None,
    softcap: float = 0.0,
    fwht: bool = False,
    fwht_signs: ArrayLike | None = None,
    out: Any = None,
    registry: RegistryLike = None,
) -> Any:
    """Attention of one query row per head over a KV cache (decode).

    The KV range is split over 32 workgroups whose partial (O, S, M) results
    are combined by a second (reduce) dispatch.

    Args:
        q: ``[H, D]`` or ``[B, H, D]``, float32 or the caches' dtype (read
            exactly as float32); any D from 1 to 256, or 512
            (``supported_head_dims("flash_attn_decode")`` lists the tiled ones).
        k_cache, v_cache: ``[Hkv, cap, D]`` or ``[B, Hkv, cap, D]``, float32,
            float16 or bfloat16 (both the same); H must be a multiple of Hkv.
            Or QuantizedKV (KVCodec.encode / KVCodec.empty) of leading
            shape ``[Hkv, cap]`` or ``[B, Hkv, cap]`` for either or both
            (the other then a dense ``[(B,) Hkv, cap, D]`` cache): the
            attention reads the codes (q rotated like the keys, the output
            rotated back).
        kv_len: valid cache length, ``1 <= kv_len <= cap``. The query sits at
            position ``kv_len - 1`` (bottom-right, as every op).
        scale: score scale; default ``1/sqrt(D)``.
        causal: the query sees keys up to its own position, i.e. all kv_len
            keys, so this equals no mask; ignored when a window is given.
            Default False, as every op.
        window: sliding window w > 0: keys p with ``(kv_len - 1) - p < w``.
        softcap: logit softcap c > 0 (``c*tanh(s/c)``); 0 disables it.
        fwht: fuse the inverse FWHT sign undo into the reduce:
            ``out = s * (H_D @ o) / sqrt(D)``, H_D the natural-order Sylvester
            Hadamard matrix. Implied by ``fwht_signs``.
        fwht_signs: uint8 ``[D/8]`` bitmask, bit j = ``(b[j>>3] >> (j&7)) & 1``,
            bit 1 = -1; None = all +1.
        out: optional C-contiguous output shaped like q, float32 or the
            caches' dtype (a numpy array or a torch CPU tensor), filled in
            place and returned.
        registry: a Registry or a backend name; default ``Registry("auto")``.

    Returns:
        shaped like q, in q's dtype: the float32 result, rounded once to
        nearest even for a float16/bfloat16 q.
    """
    if isinstance(k_cache, QuantizedKV) or isinstance(v_cache, QuantizedKV):
        return decode_over_codes(q, k_cache, v_cache, kv_len, scale=scale, window=window, softcap=softcap,
                                 fwht=fwht, fwht_signs=fwht_signs, out=out, registry=registry)
    op = _native.public_op(_OP)
    reg = resolve(registry, op)
    qa = as_input(q, op, "q")
    ka = as_input(k_cache, op, "k_cache")
    va = as_input(v_cache, op, "v_cache")
    sa = None if fwht_signs is None else as_input(fwht_signs, op, "fwht_signs")
    # The result in q's dtype (float32, or the caches' 16-bit one); out may
    # be float32 or the caches' dtype either way (the library checks the rest).
    io = (F32, ka.dtype) if ka.dtype in (F16, BF16) else (F32,)
    if empty_batch(qa, qa.ndim, tuple(range(qa.ndim - 1))) and qa.ndim in (2, 3) and qa.dtype in io:
        # [H, D] or [B, H, D] with no head or no sequence: no kernel sees out
        if out is None:
            return np.empty(out_shape(qa, va), dtype=qa.dtype)
        check_out(out, op, out_shape(qa, va), io, [qa, ka, va, sa])
        return out
    # A given out is the library's to check (its shape, dtype and overlaps).
    if out is None:
        out = dst = np.empty(out_shape(qa, va), dtype=qa.dtype if qa.dtype in io else F32)
    else:
        dst = out_array(out, op)
    _run_decode(reg, op, qa, ka, va, kv_len, dst, scale=scale, causal=causal, window=window, softcap=softcap,
                fwht=fwht or sa is not None, signs=sa)
    return out


def _run_decode(reg: Registry, op: str, qa: np.ndarray, ka: np.ndarray, va: np.ndarray, kv_len: Any,
                dst: np.ndarray, *, scale: float | None = None, causal: bool = False, window: int | None = None,
                softcap: float = 0.0, fwht: bool = False, signs: np.ndarray | None = None) -> None:
    """The decode kernel over arrays already read (q ``[(B,) H, D]``, the
    caches, ``dst`` shaped like the output; q and dst each float32 or the
    caches' dtype) into dst; the library checks the rest (errors name ``op``)."""
    mask_type = "FM_VEC_MASK_WINDOW" if window is not None else (
        "FM_VEC_MASK_CAUSAL" if causal else "FM_VEC_MASK_NONE")
    opts = _native.options(
        "FMVecOptions",
        scale=_native.scale_arg(op, scale, qa.shape[-1] if qa.ndim else 0),
        softcap=_native.float32_arg(op, "softcap", softcap),
        mask_type=_native.constant(mask_type),
        window=0 if window is None else _native.index_arg(op, "window", window),
        kv_len=_native.index_arg(op, "kv_len", kv_len, 1),
        fwht=1 if fwht else 0)
    ffi = _native.ffi()
    _native.call(reg, "fm_dispatch_vec", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), tensor(ffi, signs),
                 ffi.NULL, tensor(ffi, dst), opts, op=op, keep=(qa, ka, va, signs, dst))
