"""Additive attention-mask builder (causal, sliding window, query offset)."""
from __future__ import annotations

import numpy as np
from numpy.typing import DTypeLike

from . import _native
from ._arrays import BF16, F16, tensor
from ._errors import InvalidTypeError
from .registry import RegistryLike, resolve

_OP = "build_mask"


def build_mask(q_len: int, kv_len: int, *, causal: bool = False, window: int | None = None,
               q_offset: int | None = None, dtype: DTypeLike = BF16,
               registry: RegistryLike = None) -> np.ndarray:
    """An additive ``[q_len, kv_len]`` mask: 0 where a key is visible, -inf elsewhere.

    Query row i sits at ``t = q_offset + i`` and sees key p iff
    ``(not causal or p <= t) and (window is None or t - p < window)``.

    Args:
        q_len, kv_len: mask shape, both > 0.
        causal: hide keys after the query's position. Default False, as
            every op: pass ``causal=True`` for a causal mask.
        window: sliding window w > 0 (llama.cpp SWA: ``t - p < w``), or None.
        q_offset: absolute position of query row 0, >= 0. Default
            ``max(kv_len - q_len, 0)`` (bottom-right, as every op).
        dtype: bfloat16 (-inf = 0xFF80) or float16 (-inf = 0xFC00).
        registry: a Registry or a backend name; default ``Registry("auto")``.
    """
    reg = resolve(registry, _OP)
    ql = _native.index_arg(_OP, "q_len", q_len, 1)
    kl = _native.index_arg(_OP, "kv_len", kv_len, 1)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (BF16, F16):  # np.empty needs it before the library sees anything
        raise InvalidTypeError(_OP, f"dtype must be bfloat16 or float16, got {dtype!r}")
    off = max(kl - ql, 0) if q_offset is None else _native.index_arg(_OP, "q_offset", q_offset)
    opts = _native.options(
        "FMMaskOptions", causal=1 if causal else 0,
        window=0 if window is None else _native.index_arg(_OP, "window", window, 1), q_offset=off)
    out = np.empty((ql, kl), dtype=dt)
    _native.call(reg, "fm_build_mask", tensor(_native.ffi(), out), opts, op=_OP, keep=(out,))
    return out
