"""flash_attn_with_kvcache's cache_leftpad over QuantizedKV caches, as a
view the codes attention already reads: the storage ``[num_pages, page_size,
Hkv, ...]`` (contiguous ``[B, cap, Hkv, ...]`` is B pages of cap keys) seen
as ``[num_pages * page_size, 1, Hkv, ...]`` pages of one key, and a block
table whose row b lists the physical rows of sequence b's keys ``[leftpad[b],
end[b])`` in order. Sequence b is then those ``end[b] - leftpad[b]`` keys
(none when leftpad[b] >= end[b]) with positions counted from its first key,
which is flash-attn's cache_leftpad."""
from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import I32
from ._errors import InvalidValueError, UnsupportedFeatureError

_OP = "flash_attn_with_kvcache"
Side = tuple[Any, np.ndarray, np.ndarray | None]


def rows_view(sides: tuple[Side, Side], bt: np.ndarray | None, ends: np.ndarray, starts: np.ndarray,
              batch: int) -> tuple[tuple[Side, Side], np.ndarray, np.ndarray]:
    """(the (codec, codes or dense, norms) sides as one-key pages, the
    [B, width] int32 table of physical rows, int32 [B] key counts) for
    sequences of keys [starts[b], ends[b]) through `bt` (None: contiguous).
    `starts` were checked by the leftpad table; `ends` are checked here
    against the capacity, as the dense path's kernels check them. The
    storage holds at least one row per page (page_size > 0)."""
    (_, kc, _), (_, vc, _) = sides
    if kc.ndim != 4 or vc.ndim != 4 or kc.shape[:3] != vc.shape[:3]:
        raise InvalidValueError(_OP, f"k_cache and v_cache must have one leading shape [B, cap, Hkv] or "
                                f"[num_pages, page_size, Hkv], got {list(kc.shape[:-1])} and {list(vc.shape[:-1])}",
                                argument="v_cache")
    pages, page = kc.shape[0], kc.shape[1]
    if bt is not None and (bt.ndim != 2 or bt.shape[0] != batch):
        raise InvalidValueError(_OP, f"block_table must be int32 [{batch}, max_pages], got shape {list(bt.shape)}",
                                argument="block_table")
    if bt is None and pages != batch:
        raise InvalidValueError(_OP, f"k_cache batch ({pages}) must equal q batch ({batch})", argument="k_cache")
    if pages * page > 2**31 - 1:
        raise UnsupportedFeatureError(_OP, f"cache_leftpad over QuantizedKV caches of more than 2**31 - 1 rows "
                                      f"({pages} x {page})", argument="cache_leftpad")
    capacity = min(page * (1 if bt is None else bt.shape[1]), 2**31 - 1)
    holds = "the cache capacity, k_cache's dim 1" if bt is None else \
        f"block_table's {bt.shape[1]} pages (its dim 1) of {page} keys (k_cache's dim 1)"
    for b, n in enumerate(ends.tolist()):
        if not 0 <= n <= capacity:
            raise InvalidValueError(_OP, f"cache_seqlens[{b}] = {n} is out of range [0, {capacity}] ({holds})",
                                    argument="cache_seqlens")
    if bt is not None:  # the pages holding rows [0, end[b]), as the dense path's kernels check them
        held = np.arange(bt.shape[1])[None, :] < -(-ends.astype(np.int64)[:, None] // page)
        bad = np.argwhere(held & ((bt < 0) | (bt >= pages)))
        if len(bad):
            b, c = (int(i) for i in bad[0])
            raise InvalidValueError(_OP, f"block_table[{b}, {c}] = {bt[b, c]} is out of range [0, {pages}) (the "
                                    "pages of k_cache)", argument="block_table")
    lengths = np.maximum(ends.astype(np.int64) - starts.astype(np.int64), 0)
    j = np.arange(max(1, int(lengths.max(initial=0))), dtype=np.int64)
    valid = j[None, :] < lengths[:, None]
    pos = np.where(valid, starts.astype(np.int64)[:, None] + j[None, :], 0)  # each key's row in its sequence's cache
    seq = np.arange(batch, dtype=np.int64)[:, None]
    first = seq if bt is None else bt.astype(np.int64)[seq, pos // page]
    rows = np.where(valid, first * page + pos % page, 0).astype(I32)

    def one_key_pages(side: Side) -> Side:
        codec, data, norms = side
        flat = (pages * page, 1) + data.shape[2:]
        return codec, data.reshape(flat), None if norms is None else norms.reshape(flat[:2] + norms.shape[2:])

    return (one_key_pages(sides[0]), one_key_pages(sides[1])), np.ascontiguousarray(rows), lengths.astype(I32)
