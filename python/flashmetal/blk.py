"""Tile-skip pre-pass for the prefill kernels."""
from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from . import _native
from ._arrays import U8, as_input, tensor
from ._errors import InvalidValueError
from .registry import RegistryLike, resolve

_OP = "build_blk"
_I64 = (-(2**63), 2**63 - 1)


class BlkArray(np.ndarray):
    """build_blk's result: a uint8 [NQ, NK] array that remembers the head dim
    and mask shape it was built for (``made_for``), so flash_attn_prefill can
    reject it for another geometry or a mask of another shape with the same
    tile counts. Views and copies are plain caller memory (``made_for`` None)."""

    made_for: tuple[int, int, int] | None = None


def made_for(blk: object) -> tuple[int, int, int] | None:
    """(head_dim, q_len, kv_len) a build_blk result was built for; None for any other array."""
    return blk.made_for if type(blk) is BlkArray else None


def tile_counts(op: str, q_len: int, kv_len: int, head_dim: int) -> tuple[int, int]:
    """[NQ, NK] of a blk for a [q_len, kv_len] mask and head_dim (the library's geometry)."""
    ffi = _native.ffi()
    t = ffi.new("FMTensor *")
    _native.call_static("fm_alloc_blk", q_len, kv_len, head_dim, t, op=op)
    _native.lib().fm_free_blk(t, ffi.NULL)
    return int(t.shape[0]), int(t.shape[1])


def blk_byte_len(q_len: int, kv_len: int, head_dim: int, *, registry: RegistryLike = None) -> int:
    """Bytes of a blk buffer for a ``[q_len, kv_len]`` mask consumed by a prefill
    of ``head_dim``: ``ceil(qL/BQ) * ceil(kL/BK)`` rounded up to a multiple of
    32, at least 32 ((BQ, BK) is the prefill's tile geometry for that head dim).
    ``registry`` is accepted for symmetry; the size does not depend on it."""
    op = "blk_byte_len"
    out = _native.ffi().new("size_t *")
    _native.call_static("fm_blk_byte_len", _native.index_arg(op, "q_len", q_len, *_I64),
                        _native.index_arg(op, "kv_len", kv_len, *_I64),
                        _native.index_arg(op, "head_dim", head_dim), out, op=op)
    return int(out[0])


def build_blk(mask: ArrayLike, head_dim: int, *, registry: RegistryLike = None) -> np.ndarray:
    """Classifies each (BQ, BK) tile of a mask for ``flash_attn_prefill``.

    Args:
        mask: ``[qL, kL]`` additive mask, bfloat16, float16 or float32 (0 attend, -inf
            masked), or bool (True = attend, read as 0 / -inf).
        head_dim: head dim of the prefill that will consume the blk; it fixes
            (BQ, BK) and so the blk's shape, which prefill checks.
        registry: a Registry or a backend name; default ``Registry("auto")``.

    Returns:
        uint8 ``[NQ, NK]``: 0 = every cell -inf (tile skipped), 2 = every
        cell exactly 0 (mask add skipped), 1 = mixed (also every partial
        right-edge K tile).
    """
    reg = resolve(registry, _OP)
    m = as_input(mask, _OP, "mask")
    d = _native.index_arg(_OP, "head_dim", head_dim)
    if m.ndim != 2:  # the blk's shape below comes from the mask's
        raise InvalidValueError(_OP, f"mask must have rank 2, got shape {list(m.shape)}")
    ffi = _native.ffi()
    # The library owns the tile geometry: fm_alloc_blk gives the [NQ, NK]
    # shape and a buffer of blk_byte_len bytes; the result is copied out.
    t = ffi.new("FMTensor *")
    _native.call_static("fm_alloc_blk", m.shape[0], m.shape[1], d, t, op=_OP)
    try:
        _native.call(reg, "fm_dispatch_blk", tensor(ffi, m), t, d, op=_OP, keep=(m,))
        nq, nk = int(t.shape[0]), int(t.shape[1])
        buf = np.frombuffer(ffi.buffer(t.data, int(t.nbytes)), dtype=U8).copy()
    finally:
        _native.lib().fm_free_blk(t, ffi.NULL)
    result: BlkArray = buf[: nq * nk].reshape(nq, nk).view(BlkArray)
    result.made_for = (d, int(m.shape[0]), int(m.shape[1]))
    return result
