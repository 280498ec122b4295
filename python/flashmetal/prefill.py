"""Tiled flash-attention prefill (seed 000's op)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._arrays import BF16, BOOL, F16, as_input, check_out, tensor
from .registry import Registry, default_registry

_OP = "flash_attn_prefill"
_LAYOUTS = {"bhld": "FM_LAYOUT_BHLD", "blhd": "FM_LAYOUT_BLHD"}  # FMLayout of flashmetal.h


def flash_attn_prefill(
    q: Any,
    k: Any,
    v: Any,
    *,
    mask: Any = None,
    causal: bool = False,
    q_offset: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    layout: str = "bhld",
    kv_len: int | None = None,
    out: np.ndarray | None = None,
    blk: Any = None,
    registry: Registry | None = None,
) -> np.ndarray:
    """Flash attention over a block of query rows.

    Args:
        q: ``[B, H, qL, D]`` (layout "bhld") or ``[B, qL, H, D]`` ("blhd"),
            bfloat16 or float16. D is 64, 128, 256 or 512.
        k, v: ``[B, Hkv, cap, D]`` or ``[B, cap, Hkv, D]``, Q's dtype; H must
            be a multiple of Hkv (GQA).
        mask: additive (Q's dtype: 0 attend, -inf masked, any finite bias) or
            bool (True = attend); ``[qL, kL]`` broadcast or ``[B, H, qL, kL]``.
        causal: query row i sits at ``q_offset + i`` and sees keys ``<= q_offset + i``.
        q_offset: absolute position of query row 0 (a resumed chunk).
        scale: score scale; default ``1/sqrt(D)``.
        softcap: logit softcap c > 0 (``c*tanh(s/c)``); 0 disables it.
        layout: "bhld" (head-major) or "blhd" (seq-major).
        kv_len: valid K/V length kL when k/v hold more slots (kv_capacity =
            their length); default all of them.
        out: optional C-contiguous output array of Q's shape and dtype.
        blk: optional tile classes from ``build_blk`` (needs a rank-2 mask).
        registry: the backend to run on; default ``Registry("auto")``.

    Returns:
        The attention output, shaped and typed like q (``out`` when given).
    """
    reg = registry or default_registry()
    qa = as_input(q, _OP, "Q")
    ka = as_input(k, _OP, "K")
    va = as_input(v, _OP, "V")
    ma = None if mask is None else as_input(mask, _OP, "mask")
    ba = None if blk is None else as_input(blk, _OP, "blk")
    if qa.dtype not in (BF16, F16):
        raise TypeError(f"{_OP}: Q must be bfloat16 or float16, got {qa.dtype}")
    if ma is not None and ma.dtype not in (qa.dtype, BOOL):
        raise TypeError(f"{_OP}: mask must be {qa.dtype} (additive) or bool, got {ma.dtype}")
    if layout not in _LAYOUTS:
        raise ValueError(f"{_OP}: layout must be 'bhld' or 'blhd', got {layout!r}")
    if qa.ndim != 4:
        raise ValueError(f"{_OP}: Q must have rank 4, got shape {qa.shape}")
    if scale is None:
        scale = 1.0 / math.sqrt(qa.shape[3]) if qa.shape[3] > 0 else 1.0
    for name, val in (("q_offset", q_offset), ("kv_len", kv_len)):
        if val is not None and not -2**31 <= int(val) < 2**31:
            raise ValueError(f"{_OP}: {name} ({val}) is out of the int32 range")
    if kv_len is not None and int(kv_len) <= 0:
        raise ValueError(f"{_OP}: kv_len must be > 0, got {kv_len}")
    if out is None:
        out = np.empty(qa.shape, dtype=qa.dtype)
    else:
        check_out(out, _OP, qa.shape, qa.dtype, [qa, ka, va, ma, ba])

    ffi = reg._ffi
    opts = ffi.new("FMPrefillOptions *")
    opts.scale = float(scale)
    opts.softcap = float(softcap)
    opts.causal = 1 if causal else 0
    opts.q_offset = int(q_offset)
    opts.kv_len = 0 if kv_len is None else int(kv_len)
    opts.layout = getattr(reg._lib, _LAYOUTS[layout])
    reg._call("fm_dispatch_prefill", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va),
              tensor(ffi, ma), tensor(ffi, ba), tensor(ffi, out), opts)
    return out
