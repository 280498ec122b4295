"""Simple fused SDPA (seed 003's op): float32, float16 or bfloat16, any head dim <= 512."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._arrays import BOOL, as_input, check_out, tensor
from .registry import Registry, default_registry

_OP = "sdpa"


def sdpa(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: bool = True,
    scale: float | None = None,
    kv_len: int | None = None,
    q_offset: int | None = None,
    window: int | None = None,
    softcap: float = 0.0,
    out: np.ndarray | None = None,
    registry: Registry | None = None,
) -> np.ndarray:
    """``softmax(scale * Q K^T) V`` with one thread per query row.

    Args:
        q: ``[B, H, qL, D]``, float32, float16 or bfloat16; D <= 512.
        k, v: ``[B, Hkv, cap, D]``, q's dtype (a mismatch is a TypeError
            naming both dtypes); H must be a multiple of Hkv.
        mask: optional additive mask in q's dtype (0 attend, -inf hidden, any
            finite bias) or bool (True = attend), ``[qL, kv_len]`` broadcast
            or ``[B, H, qL, kv_len]``; added to the scaled scores.
        causal: bottom-right aligned: query i sits at ``kv_len - qL + i`` and
            sees keys up to that position (rows before key 0 give zeros).
        scale: score scale; default ``1/sqrt(D)``.
        kv_len: valid K/V length (default all ``cap`` slots).
        q_offset: position of query row 0, t = q_offset + i; None is
            bottom-right, ``kv_len - qL`` (0 is torch's top-left).
        window: sliding window w > 0: keys p with t - p < w; None = none.
        softcap: logit softcap c > 0 (``c*tanh(s/c)``); 0 disables it.
        out: optional output array of q's shape and dtype.
        registry: the backend to run on; default ``Registry("auto")``.
    """
    reg = registry or default_registry()
    qa = as_input(q, _OP, "Q")
    ka = as_input(k, _OP, "K")
    va = as_input(v, _OP, "V")
    ma = None if mask is None else as_input(mask, _OP, "mask")
    if ma is not None and ma.dtype not in (qa.dtype, BOOL):
        raise TypeError(f"{_OP}: mask must be {qa.dtype} (additive) or bool, got {ma.dtype}")
    if qa.ndim != 4:
        raise ValueError(f"{_OP}: Q must have rank 4, got shape {qa.shape}")
    if scale is None:
        scale = 1.0 / math.sqrt(qa.shape[3]) if qa.shape[3] > 0 else 1.0
    if kv_len is not None and not 0 < int(kv_len) < 2**31:
        raise ValueError(f"{_OP}: kv_len must be > 0 and fit in int32, got {kv_len}")
    if q_offset is not None and not -2**31 <= int(q_offset) < 2**31:
        raise ValueError(f"{_OP}: q_offset ({q_offset}) is out of the int32 range")
    if window is not None and not 0 < int(window) < 2**31:
        raise ValueError(f"{_OP}: window must be > 0 and fit in int32, got {window}")
    if out is None:
        out = np.empty(qa.shape, dtype=qa.dtype)
    else:
        check_out(out, _OP, qa.shape, qa.dtype, [qa, ka, va, ma])
    ffi = reg._ffi
    opts = ffi.new("FMSdpaOptions *")
    opts.scale = float(scale)
    opts.causal = 1 if causal else 0
    opts.kv_len = 0 if kv_len is None else int(kv_len)
    opts.has_q_offset = 0 if q_offset is None else 1
    opts.q_offset = 0 if q_offset is None else int(q_offset)
    opts.window = 0 if window is None else int(window)
    opts.softcap = float(softcap)
    reg._call("fm_dispatch_sdpa", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), tensor(ffi, ma),
              tensor(ffi, out), opts)
    return out
