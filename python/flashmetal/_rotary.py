"""flash_attn_with_kvcache's rotary embedding (rotary_cos, rotary_sin,
rotary_interleaved): the arguments' checks and the library's rotary kernel
(``fm_dispatch_rotary``), which writes rotated copies of q and k; the
caller's arrays are never modified.

flash-attn's semantics: the new keys' row i of sequence b is rotated at
position ``cache_seqlens[b] + i`` (the cache row it is appended to, whatever
cache_leftpad says); q's row i at the same position when the attention is
causal or local (a window or attention_chunk), else every row of q at
``cache_seqlens[b]``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _native
from ._arrays import as_input, tensor
from ._errors import InvalidValueError
from .registry import Registry


def rotary_tables(op: str, rotary_cos: Any, rotary_sin: Any, *, appending: bool
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """(cos, sin) as C-contiguous arrays, or None without rotary. The library
    checks their shapes, dtypes and the positions read."""
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        given, missing = ("rotary_cos", "rotary_sin") if rotary_sin is None else ("rotary_sin", "rotary_cos")
        raise InvalidValueError(op, f"{given} was given without {missing}: pass both or neither", argument=missing)
    if not appending:
        raise InvalidValueError(op, "rotary_cos/rotary_sin rotate the appended keys (and q): they need k and v "
                                    "(as flash-attn)", argument="rotary_cos")
    return as_input(rotary_cos, op, "rotary_cos"), as_input(rotary_sin, op, "rotary_sin")


def per_row_positions(causal: bool, window: tuple[int, int], attention_chunk: int) -> bool:
    """Whether q's rows get successive positions (causal or local attention,
    as flash-attn), rather than all sitting at the sequence's cache_seqlens."""
    return bool(causal) or window != (-1, -1) or attention_chunk > 0


def rotate(reg: Registry, op: str, x: np.ndarray, tables: tuple[np.ndarray, np.ndarray], offsets: np.ndarray,
           *, interleaved: bool, per_row: bool, name: str) -> np.ndarray:
    """Dispatches the rotation of x [B, L, H, D] into a new array of x's
    dtype (inside the caller's batch scope: it is filled when the work runs)."""
    out = np.empty_like(x)
    ffi = _native.ffi()
    cos, sin = tables
    label = ffi.new("char[]", name.encode())
    _native.call(reg, "fm_dispatch_rotary", tensor(ffi, x), tensor(ffi, cos), tensor(ffi, sin), tensor(ffi, offsets),
                 tensor(ffi, out), int(interleaved), int(per_row), label, op=op,
                 keep=(x, cos, sin, offsets, out, label))
    return out
