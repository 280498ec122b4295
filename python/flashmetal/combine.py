"""flash-attn 3's ``flash_attn_combine``: the merge of split-KV partial
attentions. It runs on the host (numpy), whatever the backend: the library's
own split reduce is internal to the decode kernel and takes no caller
partials."""
from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import BF16, F16, F32, check_out
from ._errors import InvalidTypeError, InvalidValueError
from ._interop import to_numpy, wrapper_like

_OP = "flash_attn_combine"
_OUT_DTYPES: dict[str, np.dtype] = {"float32": F32, "float16": F16, "bfloat16": BF16}


def _out_dtype(out_dtype: Any) -> np.dtype:
    """float32, float16 or bfloat16, as a numpy dtype, a torch dtype or a name."""
    name = str(out_dtype).removeprefix("torch.")
    if name not in _OUT_DTYPES:
        try:
            name = np.dtype(out_dtype).name
        except TypeError:
            pass
    if name not in _OUT_DTYPES:
        raise InvalidTypeError(_OP, f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}",
                               argument="out_dtype")
    return _OUT_DTYPES[name]


def flash_attn_combine(out_partial: Any, lse_partial: Any, out: Any = None, out_dtype: Any = None) -> Any:
    """Merges num_splits partial attentions over disjoint key sets into the
    attention over their union (flash-attn 3's combine).

    Args:
        out_partial: float32 ``[num_splits, ..., head_dim]`` (flash-attn's
            ``[num_splits, B, seqlen, H, D]``): each split's normalised output.
        lse_partial: float32 ``[num_splits, ...]`` (``[num_splits, B,
            seqlen, H]``): each split's natural-log softmax denominator; -inf
            for a split that saw no key.
        out: optional C-contiguous ``[..., head_dim]`` array of out_dtype (a
            numpy array or a torch CPU tensor), filled in place and returned.
        out_dtype: float32 (default), float16 or bfloat16.

    Returns:
        ``(out [..., head_dim], lse [...] float32)``: ``lse = log(sum_s
        exp(lse_s))`` and ``out = sum_s exp(lse_s - lse) * out_s`` (float64
        arithmetic, rounded once); a row whose every split has lse -inf
        reads 0 with lse -inf. The caller's array type.
    """
    o = to_numpy(out_partial, _OP, "out_partial")
    lse_in = to_numpy(lse_partial, _OP, "lse_partial")
    for name, a in (("out_partial", o), ("lse_partial", lse_in)):
        if a.dtype != F32:
            raise InvalidTypeError(_OP, f"{name} must be float32, got dtype {a.dtype}", argument=name)
    if o.ndim < 2 or o.shape[0] < 1:
        raise InvalidValueError(_OP, f"out_partial must be [num_splits >= 1, ..., head_dim], got shape "
                                f"{list(o.shape)}", argument="out_partial")
    if lse_in.shape != o.shape[:-1]:
        raise InvalidValueError(_OP, f"lse_partial shape {list(lse_in.shape)} must be {list(o.shape[:-1])} "
                                "(out_partial's without head_dim)", argument="lse_partial")
    dtype = F32 if out_dtype is None else _out_dtype(out_dtype)
    target = None if out is None else check_out(out, _OP, o.shape[1:], dtype, [o, lse_in])
    lse64 = lse_in.astype(np.float64)
    top = lse64.max(axis=0)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(lse64 - top)
    total = weights.sum(axis=0)
    with np.errstate(divide="ignore"):
        lse = top + np.log(total)
    empty = np.where(np.isnan(total), np.nan, 0.0)  # a NaN lse stays NaN; no key at all reads 0
    share = np.where(total > 0, weights / np.where(total > 0, total, 1.0), empty)
    merged = (share[..., None] * o.astype(np.float64)).sum(axis=0)
    result = merged.astype(dtype)
    if target is not None:
        target[...] = result
    wrap = wrapper_like(out_partial)
    return (wrap(result) if out is None else out), wrap(lse.astype(F32))
