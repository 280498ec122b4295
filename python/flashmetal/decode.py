"""Split-KV decode (seed 002's vec op), with the fused FWHT sign undo (seed 004)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._arrays import F32, U8, as_input, check_out, tensor
from .registry import Registry, default_registry

_OP = "flash_attn_vec"


def flash_attn_decode(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    kv_len: int,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int | None = None,
    softcap: float = 0.0,
    fwht: bool = False,
    fwht_signs: Any = None,
    out: np.ndarray | None = None,
    registry: Registry | None = None,
) -> np.ndarray:
    """Attention of one query row per head over a KV cache (decode).

    The KV range is split over 32 workgroups whose partial (O, S, M) results
    are combined by a second (reduce) dispatch.

    Args:
        q: float32 ``[H, D]`` or ``[B, H, D]``; D is 64, 128, 256 or 512.
        k_cache, v_cache: ``[Hkv, cap, D]`` or ``[B, Hkv, cap, D]``, float32,
            float16 or bfloat16 (both the same); H must be a multiple of Hkv.
        kv_len: valid cache length, ``1 <= kv_len <= cap``. The query sits at
            position ``kv_len - 1``.
        scale: score scale; default ``1/sqrt(D)``.
        causal: mask type 1 (the query sees all kv_len keys, so this equals no
            mask); ignored when a window is given.
        window: sliding window w > 0: keys p with ``(kv_len - 1) - p < w``.
        softcap: logit softcap c > 0 (``c*tanh(s/c)``); 0 disables it.
        fwht: fuse the inverse FWHT sign undo into the reduce:
            ``out = s * (H_D @ o) / sqrt(D)``, H_D the natural-order Sylvester
            Hadamard matrix. Implied by ``fwht_signs``.
        fwht_signs: uint8 ``[D/8]`` bitmask, bit j = ``(b[j>>3] >> (j&7)) & 1``,
            bit 1 = -1; None = all +1.
        out: optional float32 output array shaped like q.
        registry: the backend to run on; default ``Registry("auto")``.

    Returns:
        float32, shaped like q.
    """
    reg = registry or default_registry()
    qa = as_input(q, _OP, "q")
    ka = as_input(k_cache, _OP, "k")
    va = as_input(v_cache, _OP, "v")
    sa = None if fwht_signs is None else as_input(fwht_signs, _OP, "fwht_signs")
    if qa.dtype != F32:
        raise TypeError(f"{_OP}: q must be float32, got {qa.dtype}")
    if sa is not None and sa.dtype != U8:
        raise TypeError(f"flash_attn_vec_reduce_tq_hb_undo: fwht_signs must be uint8, got {sa.dtype}")
    if qa.ndim not in (2, 3):
        raise ValueError(f"{_OP}: q must have rank 2 or 3, got shape {qa.shape}")
    if scale is None:
        scale = 1.0 / math.sqrt(qa.shape[-1]) if qa.shape[-1] > 0 else 1.0
    if not 0 < int(kv_len) < 2**31:
        raise ValueError(f"{_OP}: kv_len must be > 0 and fit in int32, got {kv_len}")
    if window is not None and not 0 < int(window) < 2**31:
        raise ValueError(f"{_OP}: window must be > 0 and fit in int32, got {window}")
    if out is None:
        out = np.empty(qa.shape, dtype=F32)
    else:
        check_out(out, _OP, qa.shape, F32, [qa, ka, va, sa])

    ffi = reg._ffi
    opts = ffi.new("FMVecOptions *")
    opts.scale = float(scale)
    opts.softcap = float(softcap)
    opts.mask_type = 2 if window is not None else (1 if causal else 0)
    opts.window = 0 if window is None else int(window)
    opts.kv_len = int(kv_len)
    opts.fwht = 1 if (fwht or sa is not None) else 0
    reg._call("fm_dispatch_vec", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), tensor(ffi, sa),
              ffi.NULL, tensor(ffi, out), opts)
    return out
