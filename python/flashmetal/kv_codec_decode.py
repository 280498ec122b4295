"""flash_attn_decode over quantized caches (QuantizedKV for k_cache and
v_cache): the attention reads the codes; no cache row is dequantized."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _native
from ._arrays import F32, as_input, check_out, tensor
from ._errors import InvalidTypeError, InvalidValueError
from .kv_codec import QuantizedKV
from .registry import RegistryLike, resolve

_OP = "flash_attn_decode"


def decode_over_codes(q: Any, k_cache: Any, v_cache: Any, kv_len: int, *, scale: float | None,
                      window: int | None, softcap: float, fwht: bool, fwht_signs: Any, out: Any,
                      registry: RegistryLike) -> Any:
    """flash_attn_decode's route when a cache is a QuantizedKV (see there).

    q float32 ``[H, D]`` or ``[B, H, D]``; k_cache and v_cache QuantizedKV of
    leading shape ``[Hkv, cap]`` or ``[B, Hkv, cap]`` whose codecs have head
    dim D (their widths and seeds may differ). The query is rotated with K's
    signs and Hadamard blocks, scores are taken against the codes, and the
    output accumulated in V's rotated basis is rotated back once.
    """
    for cache, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if not isinstance(cache, QuantizedKV):
            raise InvalidTypeError(_OP, f"{name} must be a QuantizedKV when the other cache is one (a dense cache "
                                        f"beside a quantized one is not supported), got {type(cache).__name__}")
    if fwht or fwht_signs is not None:
        raise InvalidValueError(_OP, "fwht and fwht_signs do not apply to QuantizedKV caches: their codecs' "
                                     "rotation is undone by the decode itself")
    reg = resolve(registry, _OP)
    qa = as_input(q, _OP, "q")
    kc, kn = as_input(k_cache.codes, _OP, "k_cache codes"), as_input(k_cache.norms, _OP, "k_cache norms")
    vc, vn = as_input(v_cache.codes, _OP, "v_cache codes"), as_input(v_cache.norms, _OP, "v_cache norms")
    if out is None:
        out = dst = np.empty(qa.shape, dtype=F32)
    else:
        dst = check_out(out, _OP, qa.shape, F32, [qa, kc, kn, vc, vn])
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
