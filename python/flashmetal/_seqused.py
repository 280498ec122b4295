"""flash-attn 3's seqused_q / seqused_k in flash_attn_varlen_func: sequence b
keeps its rows cu_seqlens[b]:cu_seqlens[b+1] in the packed tensors but only
the first seqused_q[b] query rows and seqused_k[b] keys take part.

seqused_k is the library's per-sequence key count beside cu_seqlens_k's
start offsets (FMSeqTensors.seqlens_k), passed as it is. seqused_q has no
table of its own: sequence b becomes two sequences of the same call, its
used rows (over its used keys) and its unused rows (over no key: they read
0, their LSE -inf, or the sink logit with sinks). The tables are checked here
in the caller's terms before they are rewritten, so an error names the
caller's index and value."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._arrays import I32, as_index
from ._errors import InvalidValueError


@dataclass
class Tables:
    """The tables one fm_dispatch_attn call takes for a seqused call."""
    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    seqlens_k: np.ndarray | None
    block_table: np.ndarray | None
    alibi: np.ndarray | None


def _cu(op: str, cu: np.ndarray, name: str, batch: int | None, tokens: int, tokens_name: str, max_seqlen: int,
        max_name: str) -> np.ndarray:
    """cu_seqlens int32 [B+1] from 0, non-decreasing, within `tokens`, each
    length <= max_seqlen. Returns the B lengths (int64)."""
    if cu.ndim != 1 or cu.shape[0] < 2 or (batch is not None and cu.shape[0] != batch + 1):
        want = "B+1] with B >= 1" if batch is None else f"{batch + 1}]"
        raise InvalidValueError(op, f"{name} must have shape [{want}, got {list(cu.shape)}", argument=name)
    c = cu.astype(np.int64)
    if c[0] != 0:
        raise InvalidValueError(op, f"{name}[0] must be 0, got {c[0]}", argument=name)
    for b in range(1, c.shape[0]):
        if c[b] < c[b - 1]:
            raise InvalidValueError(op, f"{name} must be non-decreasing: {name}[{b}] = {c[b]} < {name}[{b - 1}] = "
                                    f"{c[b - 1]}", argument=name)
        if c[b] > tokens:
            raise InvalidValueError(op, f"{name}[{b}] = {c[b]} exceeds the {tokens} tokens of {tokens_name}",
                                    argument=name)
        if c[b] - c[b - 1] > max_seqlen:
            raise InvalidValueError(op, f"sequence {b - 1} has length {c[b] - c[b - 1]} ({name}[{b}] - "
                                    f"{name}[{b - 1}]) > {max_name} = {max_seqlen}", argument=max_name)
    return np.diff(c)


def _used(op: str, x: Any, name: str, lengths: np.ndarray, of: str) -> np.ndarray:
    """seqused int32 [B] as a private copy, each entry in [0, lengths[b]]."""
    a = np.array(as_index(x, op, name), dtype=I32, copy=True)
    if a.shape != lengths.shape:
        raise InvalidValueError(op, f"{name} must have shape [{lengths.shape[0]}] (the sequences of {of}), got "
                                f"{list(a.shape)}", argument=name)
    for b, (n, cap) in enumerate(zip(a.tolist(), lengths.tolist())):
        if not 0 <= n <= cap:
            raise InvalidValueError(op, f"{name}[{b}] = {n} is out of range [0, {cap}] ({of})", argument=name)
    return a


def tables(op: str, q: np.ndarray, k: np.ndarray, cq: np.ndarray, ck: np.ndarray, seqused_q: Any,
           seqused_k: Any, block_table: np.ndarray | None, alibi: np.ndarray | None, max_seqlen_q: int,
           max_seqlen_k: int) -> Tables:
    """The tables of a call with seqused_q and/or seqused_k (at least one
    given). Without seqused_q the caller's tables stay and seqused_k is the
    library's seqlens_k (which it checks, naming seqused_k)."""
    if seqused_q is None:
        used_k = np.array(as_index(seqused_k, op, "seqused_k"), dtype=I32, copy=True)
        return Tables(cq, ck, used_k, block_table, alibi)
    q_lens = _cu(op, cq, "cu_seqlens_q", None, q.shape[0] if q.ndim else 0, "q", max_seqlen_q, "max_seqlen_q")
    batch = q_lens.shape[0]
    if block_table is None:
        k_tokens, k_name = (k.shape[0] if k.ndim else 0), "k"
    elif block_table.ndim != 2 or block_table.shape[0] != batch or k.ndim != 4:
        raise InvalidValueError(op, f"block_table must be int32 [{batch}, max_pages] over a cache [num_pages, "
                                f"page_size, Hkv, D], got shape {list(block_table.shape)}", argument="block_table")
    else:
        k_tokens, k_name = block_table.shape[1] * k.shape[1] * batch, "block_table"
    k_lens = _cu(op, ck, "cu_seqlens_k", batch, k_tokens, k_name, max_seqlen_k, "max_seqlen_k")
    used_q = _used(op, seqused_q, "seqused_q", q_lens, "cu_seqlens_q")
    used_k = k_lens.astype(I32) if seqused_k is None else _used(op, seqused_k, "seqused_k", k_lens, "cu_seqlens_k")
    # Sequence b is sequences 2b (its used rows) and 2b+1 (the rest, over no key).
    c_q, c_k = cq.astype(np.int64), ck.astype(np.int64)
    cu_q = np.empty(2 * batch + 1, dtype=I32)
    cu_q[0], cu_q[1::2], cu_q[2::2] = 0, c_q[:-1] + used_q, c_q[1:]
    cu_k = np.empty(2 * batch + 1, dtype=I32)
    cu_k[0], cu_k[1::2], cu_k[2::2] = 0, c_k[1:], c_k[1:]
    seqlens = np.zeros(2 * batch, dtype=I32)
    seqlens[0::2] = used_k
    table = None if block_table is None else np.ascontiguousarray(np.repeat(block_table, 2, axis=0))
    slopes = None if alibi is None else np.ascontiguousarray(np.repeat(alibi, 2, axis=0))
    return Tables(cu_q, cu_k, seqlens, table, slopes)
