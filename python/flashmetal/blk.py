"""Tile-skip pre-pass (seed 001's op) for the prefill kernels."""
from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import BF16, F16, U8, as_input, tensor
from ._errors import raise_for_status
from .registry import Registry, default_registry

_OP = "flash_attn_prefill_blk"


def blk_byte_len(q_len: int, k_len: int, head_dim: int, *, registry: Registry | None = None) -> int:
    """Bytes of a blk buffer for a ``[q_len, k_len]`` mask consumed by a prefill
    of ``head_dim``: ``ceil(qL/BQ) * ceil(kL/BK)`` rounded up to a multiple of
    32, at least 32 ((BQ, BK) is the prefill's tile geometry for that head dim)."""
    reg = registry or default_registry()
    for name, val in (("q_len", q_len), ("k_len", k_len)):
        if not -2**63 <= int(val) < 2**63:
            raise ValueError(f"blk_byte_len: {name} ({val}) is out of range")
    if not -2**31 <= int(head_dim) < 2**31:
        raise ValueError(f"blk_byte_len: head_dim ({head_dim}) is out of range")
    ffi, lib = reg._ffi, reg._lib
    out = ffi.new("size_t *")
    err = ffi.new("char[]", 1024)
    raise_for_status(lib.fm_blk_byte_len(int(q_len), int(k_len), int(head_dim), out, err, 1024),
                     ffi.string(err).decode(errors="replace"))
    return int(out[0])


def build_blk(mask: Any, head_dim: int, *, registry: Registry | None = None) -> np.ndarray:
    """Classifies each (BQ, BK) tile of an additive mask for ``flash_attn_prefill``.

    Args:
        mask: ``[qL, kL]`` additive mask, bfloat16 or float16 (0 attend, -inf masked).
        head_dim: head dim of the prefill that will consume the blk; it fixes (BQ, BK).
        registry: the backend to run on; default ``Registry("auto")``.

    Returns:
        uint8 ``[NQ, NK]``: 0 = every cell -inf (tile skipped), 2 = every
        cell exactly 0 (mask add skipped), 1 = mixed (also every partial
        right-edge K tile). The array views a buffer of ``blk_byte_len`` bytes.
    """
    reg = registry or default_registry()
    m = as_input(mask, _OP, "mask")
    if m.dtype not in (BF16, F16):
        raise TypeError(f"{_OP}: mask must be bfloat16 or float16, got {m.dtype}")
    if m.ndim != 2:
        raise ValueError(f"{_OP}: mask must have rank 2, got shape {m.shape}")
    if not -2**31 <= int(head_dim) < 2**31:
        raise ValueError(f"{_OP}: head_dim ({head_dim}) is out of range")
    ql, kl = m.shape
    ffi, lib = reg._ffi, reg._lib
    # The library owns the tile geometry: fm_alloc_blk gives the [NQ, NK]
    # shape and a buffer of blk_byte_len bytes; the result is copied out.
    t = ffi.new("FMTensor *")
    err = ffi.new("char[]", 1024)
    raise_for_status(lib.fm_alloc_blk(int(ql), int(kl), int(head_dim), t, err, 1024),
                     ffi.string(err).decode(errors="replace"))
    try:
        reg._call("fm_dispatch_blk", tensor(ffi, m), t, int(head_dim))
        nq, nk = int(t.shape[0]), int(t.shape[1])
        buf = np.frombuffer(ffi.buffer(t.data, int(t.nbytes)), dtype=U8).copy()
    finally:
        lib.fm_free_blk(t, ffi.NULL, 0)
    return buf[: nq * nk].reshape(nq, nk)
