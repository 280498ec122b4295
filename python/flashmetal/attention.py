"""The front door: one attention call that picks the kernel for the inputs."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._arrays import BF16, BOOL, F16, F32, as_input
from .blk import build_blk
from .decode import flash_attn_decode
from .mask import build_mask
from .prefill import flash_attn_prefill
from .registry import Registry, default_registry
from .sdpa import sdpa

_OP = "scaled_dot_product_attention"
_VEC_HEAD_DIMS = (64, 128, 256, 512)

#: Kernel families the front door reports with ``return_kernel=True``.
ROUTES = ("flash_attn_vec", "flash_attn_prefill", "sdpa")


def scaled_dot_product_attention(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    softcap: float = 0.0,
    window: int | None = None,
    kv_len: int | None = None,
    return_kernel: bool = False,
    registry: Registry | None = None,
) -> np.ndarray | tuple[np.ndarray, str]:
    """Attention with torch-like arguments on the best flashmetal kernel.

    Positions are bottom-right aligned, as in a KV cache: query row i sits at
    ``kv_len - qL + i``. ``is_causal`` hides keys after that position;
    ``window`` w keeps keys p with ``position - p < w``. The semantics are
    the same whichever kernel runs:

    - one query row (qL == 1), no ``attn_mask`` and D in {64, 128, 256, 512}
      → ``flash_attn_vec`` (split-KV decode; q is computed in float32 and the
      result rounded once to q's dtype);
    - bfloat16 / float16 → ``flash_attn_prefill`` (with a window, the window
      mask and its blk tile classes are built here);
    - float32 → ``sdpa`` (``attn_mask`` and ``window`` go in as its mask;
      ``softcap`` raises ValueError unless the call takes the vec route).

    Args:
        q: ``[B, H, qL, D]``.
        k, v: ``[B, Hkv, cap, D]``, q's dtype; H a multiple of Hkv.
        attn_mask: additive (q's dtype) or bool (True = attend) mask,
            ``[qL, kL]`` or ``[B, H, qL, kL]`` with kL = kv_len.
        is_causal: causal, bottom-right aligned (needs qL <= kv_len).
        scale: score scale; default ``1/sqrt(D)``.
        softcap: logit softcap c > 0; 0 disables it.
        window: sliding window w > 0, or None.
        kv_len: valid K/V length; default ``cap``.
        return_kernel: also return the kernel family that ran (one of ``ROUTES``).
        registry: the backend to run on; default ``Registry("auto")``.

    Returns:
        The output ``[B, H, qL, D]`` in q's dtype, or ``(output, kernel)``
        with ``return_kernel=True``.
    """
    reg = registry or default_registry()
    qa = as_input(q, _OP, "q")
    ka = as_input(k, _OP, "k")
    va = as_input(v, _OP, "v")
    if qa.dtype not in (F32, BF16, F16):
        raise TypeError(f"{_OP}: q must be float32, bfloat16 or float16, got {qa.dtype}")
    for name, a in (("k", ka), ("v", va)):
        if a.dtype != qa.dtype:
            raise TypeError(f"{_OP}: {name} dtype {a.dtype} does not match q dtype {qa.dtype}")
    for name, a in (("q", qa), ("k", ka), ("v", va)):
        if a.ndim != 4:
            raise ValueError(f"{_OP}: {name} must have rank 4 [B, H, L, D], got shape {a.shape}")
    B, H, qL, D = qa.shape
    cap = ka.shape[2]
    kl = cap if kv_len is None else int(kv_len)
    if not 0 < kl <= cap:
        raise ValueError(f"{_OP}: kv_len must be in 1..{cap} (k's sequence length), got {kv_len}")
    if qL == 0:
        raise ValueError(f"{_OP}: q has no query rows (shape {qa.shape})")
    if is_causal and qL > kl:
        raise ValueError(f"{_OP}: is_causal needs qL ({qL}) <= kv_len ({kl}) (bottom-right alignment)")
    if window is not None and not 0 < int(window) < 2**31:
        raise ValueError(f"{_OP}: window must be > 0 and fit in int32, got {window}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"{_OP}: softcap must be 0 (off) or a finite value > 0, got {softcap}")
    ma = None if attn_mask is None else as_input(attn_mask, _OP, "attn_mask")
    if ma is not None:
        if ma.dtype not in (qa.dtype, BOOL):
            raise TypeError(f"{_OP}: attn_mask must be {qa.dtype} (additive) or bool, got {ma.dtype}")
        if ma.shape not in ((qL, kl), (B, H, qL, kl)):
            raise ValueError(f"{_OP}: attn_mask shape {ma.shape} must be {(qL, kl)} or {(B, H, qL, kl)}")
    q_offset = kl - qL  # may be < 0 only without is_causal

    if qL == 1 and ma is None and D in _VEC_HEAD_DIMS and q_offset >= 0:
        o = flash_attn_decode(qa[:, :, 0, :].astype(F32), ka, va, kl, scale=scale, causal=is_causal,
                              window=window, softcap=softcap, registry=reg)
        out, route = o.astype(qa.dtype)[:, :, None, :], "flash_attn_vec"
    elif qa.dtype in (BF16, F16):
        if q_offset < 0:
            raise ValueError(f"{_OP}: qL ({qL}) > kv_len ({kl}) is not supported for {qa.dtype} inputs")
        blk = None
        if window is not None:
            wm = build_mask(qL, kl, causal=is_causal, window=int(window), q_offset=q_offset,
                            dtype=qa.dtype, registry=reg)
            if ma is not None:
                add = np.where(ma, 0.0, -np.inf) if ma.dtype == BOOL else ma.astype(np.float32)
                ma = (wm.astype(np.float32) + add).astype(qa.dtype)
            else:
                ma = wm
            ma = np.ascontiguousarray(ma)
            if ma.ndim == 2:
                blk = build_blk(ma, D, registry=reg)
        out = flash_attn_prefill(qa, ka, va, mask=ma, causal=is_causal, q_offset=q_offset, scale=scale,
                                 softcap=softcap, kv_len=kl, blk=blk, registry=reg)
        route = "flash_attn_prefill"
    else:
        if softcap != 0:
            raise ValueError(f"{_OP}: softcap with float32 inputs and qL = {qL} is not supported by the "
                             "sdpa kernel; use bfloat16/float16 inputs or one query row")
        if window is not None:
            # The sliding window as a bool mask, combined with the caller's.
            t = q_offset + np.arange(qL)[:, None]
            in_window = (t - np.arange(kl)[None, :]) < int(window)
            if ma is None:
                ma = in_window
            elif ma.dtype == BOOL:
                ma = np.ascontiguousarray(ma & in_window)
            else:
                ma = np.ascontiguousarray(np.where(in_window, ma, np.float32(-np.inf)).astype(F32))
        out = sdpa(qa, ka, va, mask=ma, causal=is_causal, scale=scale, kv_len=kl, registry=reg)
        route = "sdpa"
    return (out, route) if return_kernel else out
