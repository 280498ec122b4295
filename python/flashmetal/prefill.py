"""Tiled flash-attention prefill."""
from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _native
from ._arrays import BF16, F16, F32, as_input, check_out, empty_batch, out_array, out_shape, tensor
from ._serving_args import sinks_arg
from .blk import made_for, tile_counts
from .kv_codec import QuantizedKV
from .kv_codec_kvcache import prefill_over_codes
from ._errors import InvalidValueError
from ._hints import layout_hint
from .registry import RegistryLike, resolve

_OP = "flash_attn_prefill"
_LAYOUTS = {"bhld": "FM_LAYOUT_BHLD", "blhd": "FM_LAYOUT_BLHD"}  # FMLayout of flashmetal.h


@layout_hint(_OP, q="q", k="k", v="v", mask="mask", layout="layout", q_within_keys=True)
def flash_attn_prefill(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    mask: ArrayLike | None = None,
    causal: bool = False,
    q_offset: int | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    window: int | None = None,
    layout: str = "bhld",
    kv_len: int | None = None,
    out: Any = None,
    blk: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    registry: RegistryLike = None,
) -> Any:
    """Flash attention over a block of query rows.

    Args:
        q: ``[B, H, qL, D]`` (layout "bhld") or ``[B, qL, H, D]`` ("blhd"),
            bfloat16, float16 or float32. Any D from 1 to 512
            (``supported_head_dims("flash_attn_prefill")`` lists the tiled
            ones; float32: ``"flash_attn_prefill_f32"``).
            v may have a head dim Dv of its own (out then has Dv): unequal
            dims both in 1...512, or D 576 over Dv 512 (MLA) for
            bfloat16/float16.
        k, v: ``[B, Hkv, cap, D]`` or ``[B, cap, Hkv, D]``, q's dtype; H must
            be a multiple of Hkv (GQA). Or a QuantizedKV of leading shape
            ``[B, cap, Hkv]`` for either or both (layout "blhd"; the other
            side a dense cache): the tiled prefill over codes, q of any float
            dtype, the query rows the newest of kv_len keys, no mask or blk.
        mask: additive (q's dtype: 0 attend, -inf masked, any finite bias) or
            bool (True = attend); ``[qL, kv_len]`` broadcast or ``[B, H, qL, kv_len]``.
        causal: query row i sits at ``q_offset + i`` and sees keys ``<= q_offset + i``.
        q_offset: absolute position of query row 0. Default ``kv_len - qL``
            (bottom-right: the queries are the newest tokens, as in flash-attn
            and a KV cache); pass 0 for top-left alignment.
        scale: score scale; default ``1/sqrt(D)``.
        softcap: logit softcap c > 0 (``c*tanh(s/c)``); 0 disables it.
        window: sliding window w > 0: row i (at ``q_offset + i``) sees keys p
            with ``q_offset + i - p < w``, applied in the kernel (no mask is
            built; key tiles wholly outside every row's window are skipped).
            Combines with causal, mask and blk. None = no window.
        layout: "bhld" (head-major) or "blhd" (seq-major).
        kv_len: valid K/V length when k/v hold more slots (their length is
            the capacity); default all of them.
        out: optional C-contiguous output of q's shape and dtype (a numpy array
            or a torch CPU tensor), filled in place and returned.
        blk: optional tile classes from ``build_blk`` for this head dim and
            mask shape (needs a rank-2 mask).
        sinks: float32 ``[H]`` per-head sink logits (gpt-oss), or None: each
            joins its head's softmax denominators without a value, beside the
            mask, causal and window.
        registry: a Registry or a backend name; default ``Registry("auto")``.

    Returns:
        The attention output, shaped and typed like q (``out`` when given).
    """
    op = _native.public_op(_OP)
    reg = resolve(registry, op)
    if isinstance(k, QuantizedKV) or isinstance(v, QuantizedKV):
        return prefill_over_codes(reg, op, q, k, v, mask=mask, causal=causal, q_offset=q_offset, scale=scale,
                                  softcap=softcap, window=window, layout=layout, kv_len=kv_len, out=out, blk=blk,
                                  sinks=sinks)
    qa = as_input(q, op, "q")
    ka = as_input(k, op, "k")
    va = as_input(v, op, "v")
    ma = None if mask is None else as_input(mask, op, "mask")
    ba = None if blk is None else as_input(blk, op, "blk")
    sa = sinks_arg(op, sinks)
    built = made_for(blk)
    if built is not None and ma is not None and ma.ndim == 2 and qa.ndim == 4 and (qa.shape[-1], *ma.shape) != built:
        # A blk of the right [NQ, NK] shape built for another mask shape has
        # the wrong classes; a wrong shape is the library's error.
        if ba is not None and tile_counts(op, ma.shape[0], ma.shape[1], qa.shape[-1]) == tuple(ba.shape):
            raise InvalidValueError(op, f"blk was built for head_dim {built[0]} and a {list(built[1:])} mask, "
                                    f"not head_dim {qa.shape[-1]} and a {list(ma.shape)} mask")
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise InvalidValueError(op, f"layout must be 'bhld' or 'blhd', got {layout!r}")
    kl = None if kv_len is None else _native.index_arg(op, "kv_len", kv_len, 1)
    if empty_batch(qa, 4, (0, 1, 2)) and qa.dtype in (BF16, F16, F32):  # no kernel sees out
        if out is None:
            return np.empty(out_shape(qa, va), dtype=qa.dtype)
        check_out(out, op, out_shape(qa, va), qa.dtype, [qa, ka, va, ma, ba, sa])
        return out
    # A given out is the library's to check (its shape, dtype and overlaps).
    if out is None:
        out = dst = np.empty(out_shape(qa, va), dtype=qa.dtype)
    else:
        dst = out_array(out, op)
    if q_offset is None:
        # Bottom-right: the library checks the shapes; this only reads them.
        seq = 1 if layout == "blhd" else 2
        ql = qa.shape[seq] if qa.ndim == 4 else 0
        cap = ka.shape[seq] if ka.ndim == 4 else 0
        q_offset = max((cap if kl is None else kl) - ql, 0)
    opts = _native.options(
        "FMPrefillOptions",
        scale=_native.scale_arg(op, scale, qa.shape[-1] if qa.ndim else 0),
        softcap=_native.float32_arg(op, "softcap", softcap),
        causal=1 if causal else 0,
        q_offset=_native.index_arg(op, "q_offset", q_offset),
        kv_len=0 if kl is None else kl,
        window=0 if window is None else _native.index_arg(op, "window", window, 1),
        layout=_native.constant(_LAYOUTS[layout]))
    ffi = _native.ffi()
    if sa is None:
        _native.call(reg, "fm_dispatch_prefill", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va),
                     tensor(ffi, ma), tensor(ffi, ba), tensor(ffi, dst), opts, op=op, keep=(qa, ka, va, ma, ba, dst))
    else:
        _native.call(reg, "fm_dispatch_prefill_sinks", tensor(ffi, qa), tensor(ffi, ka), tensor(ffi, va),
                     tensor(ffi, ma), tensor(ffi, ba), tensor(ffi, sa), tensor(ffi, dst), opts, op=op,
                     keep=(qa, ka, va, ma, ba, sa, dst))
    return out
