"""Simple fused SDPA: float32, float16 or bfloat16, any head dim (<= 65536)."""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _native
from ._hints import layout_hint
from ._arrays import BF16, F16, F32, as_input, check_out, empty_batch, out_array, out_shape, tensor
from .registry import RegistryLike, resolve

_OP = "sdpa"


@layout_hint(_OP, q="q", k="k", v="v", mask="mask")
def sdpa(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    causal: bool = False,
    scale: float | None = None,
    kv_len: int | None = None,
    q_offset: int | None = None,
    window: int | None = None,
    softcap: float = 0.0,
    out: Any = None,
    registry: RegistryLike = None,
) -> Any:
    """``softmax(scale * Q K^T) V`` with one thread per query row.

    Args:
        q: ``[B, H, qL, D]``, float32, float16 or bfloat16; any D <= 65536.
        k: ``[B, Hkv, cap, D]``, v: ``[B, Hkv, cap, Dv]`` (v's own head dim,
            the output's; any Dv <= 65536), q's dtype (a mismatch is a
            TypeError naming both dtypes); H must be a multiple of Hkv.
        mask: optional additive mask in q's dtype (0 attend, -inf hidden, any
            finite bias) or bool (True = attend), ``[qL, kv_len]``,
            ``[H, qL, kv_len]`` or ``[B, H, qL, kv_len]``, each of B, H, qL
            possibly 1 (broadcast in place); added to the scaled scores.
        causal: bottom-right aligned, as every op: query i sits at
            ``kv_len - qL + i`` and sees keys up to that position (rows
            before key 0 give zeros). Default False, as every op.
        scale: score scale; default ``1/sqrt(D)``.
        kv_len: valid K/V length (default all ``cap`` slots).
        q_offset: position of query row 0, t = q_offset + i (causal keeps
            keys <= t); None is the default bottom-right ``kv_len - qL``, 0
            is torch's top-left.
        window: sliding window w > 0: keys p with t - p < w; None = none.
        softcap: logit softcap c > 0 (``c*tanh(s/c)``); 0 disables it.
        out: optional C-contiguous output of q's shape with Dv last and q's dtype (a numpy array
            or a torch CPU tensor), filled in place and returned.
        registry: a Registry or a backend name; default ``Registry("auto")``.
    """
    op = _native.public_op(_OP)
    reg = resolve(registry, op)
    qa = as_input(q, op, "q")
    ka = as_input(k, op, "k")
    va = as_input(v, op, "v")
    ma = None if mask is None else as_input(mask, op, "mask")
    if empty_batch(qa, 4, (0, 1, 2)) and qa.dtype in (F32, BF16, F16):  # no kernel sees out
        if out is None:
            return np.empty(out_shape(qa, va), dtype=qa.dtype)
        check_out(out, op, out_shape(qa, va), qa.dtype, [qa, ka, va, ma])
        return out
    # A given out is the library's to check (its shape, dtype and overlaps).
    if out is None:
        out = dst = np.empty(out_shape(qa, va), dtype=qa.dtype)
    else:
        dst = out_array(out, op)
    opts = _native.options(
        "FMSdpaOptions",
        scale=_native.scale_arg(op, scale, qa.shape[-1] if qa.ndim else 0),
        causal=1 if causal else 0,
        kv_len=0 if kv_len is None else _native.index_arg(op, "kv_len", kv_len, 1),
        has_q_offset=0 if q_offset is None else 1,
        q_offset=0 if q_offset is None else _native.index_arg(op, "q_offset", q_offset),
        window=0 if window is None else _native.index_arg(op, "window", window, 1),
        softcap=_native.float32_arg(op, "softcap", softcap))
    ffi = _native.ffi()
    _native.call(reg, "fm_dispatch_sdpa", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va), tensor(ffi, ma),
                 tensor(ffi, dst), opts, op=op, keep=(qa, ka, va, ma, dst))
    return out
