"""Additive attention-mask builder (causal, sliding window, query offset)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import BF16, F16, tensor
from .registry import Registry, default_registry

_OP = "flash_attn_prefill_mask"


def build_mask(q_len: int, k_len: int, *, causal: bool = True, window: int | None = None,
               q_offset: int = 0, dtype: Any = BF16, registry: Registry | None = None) -> np.ndarray:
    """An additive ``[q_len, k_len]`` mask: 0 where a key is visible, -inf elsewhere.

    Query row i sits at ``t = q_offset + i`` and sees key p iff
    ``(not causal or p <= t) and (window is None or t - p < window)``.

    Args:
        q_len, k_len: mask shape, both > 0.
        causal: hide keys after the query's position.
        window: sliding window w > 0 (llama.cpp SWA: ``t - p < w``), or None.
        q_offset: absolute position of query row 0, >= 0.
        dtype: bfloat16 (-inf = 0xFF80) or float16 (-inf = 0xFC00).
        registry: the backend to run on; default ``Registry("auto")``.
    """
    reg = registry or default_registry()
    dt = np.dtype(dtype)
    if dt not in (BF16, F16):
        raise TypeError(f"{_OP}: dtype must be bfloat16 or float16, got {dt}")
    for name, val in (("q_len", q_len), ("k_len", k_len)):
        if int(val) <= 0:
            raise ValueError(f"{_OP}: {name} must be > 0, got {val}")
    for name, val in (("q_len", q_len), ("k_len", k_len), ("q_offset", q_offset), ("window", window or 0)):
        if not -2**31 <= int(val) < 2**31:
            raise ValueError(f"{_OP}: {name} ({val}) is out of the int32 range")
    if window is not None and int(window) <= 0:
        raise ValueError(f"{_OP}: window must be > 0 (or None), got {window}")
    out = np.empty((int(q_len), int(k_len)), dtype=dt)
    ffi = reg._ffi
    opts = ffi.new("FMMaskOptions *")
    opts.causal = 1 if causal else 0
    opts.window = 0 if window is None else int(window)
    opts.q_offset = int(q_offset)
    reg._call("fm_build_mask", tensor(ffi, out), opts)
    return out
