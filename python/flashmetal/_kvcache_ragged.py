"""flash_attn_with_kvcache with ragged queries and new keys (flash-attn 3's
``cu_seqlens_q``, ``max_seqlen_q`` and ``cu_seqlens_k_new``).

Sequence b owns q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q
``[total_q, H, D]`` and new key rows ``cu_seqlens_k_new[b]:...[b+1]`` of k/v
``[total_k_new, Hkv, D]`` (or ``[B, seqlen_new, Hkv, D]``: the same count for
every sequence). Its new keys are appended at its cache rows
``cache_seqlens[b] ...``, then its queries attend to its cache prefix plus
those keys, bottom-right aligned per sequence (the varlen prefill over the
cache, with the grown lengths as the cache lengths).

The library appends and attends in one call (FMSeqTensors.cu_seqlens_k_new),
validating both before either runs; this module packs the caller's
arguments, checks what it reads itself (the offsets it packs and rotates
by), and rotates each row at its own position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _native
from ._arrays import F32, I32, as_index, tensor
from ._errors import InvalidValueError

_KVCACHE = "flash_attn_with_kvcache"
# Rows appended before the attention: k, v and cu_seqlens_k_new (None: k/v
# [B, n_new, Hkv, D], the same count for every sequence).
NewRows = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _error(message: str, argument: str) -> InvalidValueError:
    return InvalidValueError(_KVCACHE, message, argument=argument)


def cu_seqlens(x: Any, name: str, *, batch: int | None, total: int, total_name: str, exact: bool) -> np.ndarray:
    """A cumulative offsets table int32 [B+1] (a private copy, so the values
    checked are the values read): starting at 0, non-decreasing, ending at
    the rows of its tensor (at most that many when not `exact`)."""
    a = np.array(as_index(x, _KVCACHE, name), dtype=I32, copy=True)
    if a.ndim != 1 or a.shape[0] == 0:
        raise _error(f"{name} must be int32 [B+1] (cumulative lengths), got shape {list(a.shape)}", name)
    if batch is not None and a.shape[0] != batch + 1:
        raise _error(f"{name} has {a.shape[0]} entries; it must have B+1 = {batch + 1} (B = {batch} sequences)", name)
    if a[0] != 0:
        raise _error(f"{name}[0] = {int(a[0])} must be 0", name)
    drops = np.flatnonzero(a[1:] < a[:-1])
    if drops.size:
        b = int(drops[0])
        raise _error(f"{name}[{b + 1}] = {int(a[b + 1])} is less than {name}[{b}] = {int(a[b])} (the offsets must "
                     "be non-decreasing)", name)
    end = int(a[-1])
    if end > total or (exact and end != total):
        rule = "equal" if exact else "be at most"
        raise _error(f"{name}[{a.shape[0] - 1}] = {end} must {rule} the rows of {total_name} (its dim 0, {total})",
                     name)
    return a


@dataclass
class Ragged:
    """The packed layout of a ragged call. q is [total_q, H, D]; k/v (when
    appending) [total_k_new, Hkv, D]; dense_q is q's own [B, qL, H, D] shape
    when the caller's q was dense (only the new keys ragged)."""
    batch: int
    cu_q: np.ndarray
    cu_k: np.ndarray | None
    q: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    max_seqlen_q: int
    dense_q: tuple[int, ...] | None

    @property
    def q_lens(self) -> np.ndarray:
        return np.diff(self.cu_q.astype(np.int64))

    @property
    def new_lens(self) -> np.ndarray:
        return np.zeros(self.batch, np.int64) if self.cu_k is None else np.diff(self.cu_k.astype(np.int64))


def layout(qa: np.ndarray, ka: np.ndarray | None, va: np.ndarray | None, cu_seqlens_q: Any,
           cu_seqlens_k_new: Any, max_seqlen_q: Any) -> Ragged:
    """Checks the ragged arguments against q and k/v and packs them."""
    if cu_seqlens_q is None and max_seqlen_q is not None:
        raise _error("max_seqlen_q is given without cu_seqlens_q (it bounds the ragged query counts)",
                     "max_seqlen_q")
    if cu_seqlens_k_new is not None and ka is None:
        raise _error("cu_seqlens_k_new is given without k and v (it splits the new keys between the sequences)",
                     "cu_seqlens_k_new")
    dense_q = None
    if cu_seqlens_q is None:
        if qa.ndim != 4:
            raise _error(f"q must be [B, seqlen_q, H, D] without cu_seqlens_q, got shape {list(qa.shape)}", "q")
        batch, rows = qa.shape[0], qa.shape[1]
        dense_q = tuple(qa.shape)
        cu_q = (np.arange(batch + 1, dtype=np.int64) * rows).astype(I32)
        q, max_q = qa.reshape(batch * rows, *qa.shape[2:]), rows
    else:
        if qa.ndim != 3:
            raise _error(f"q must be [total_q, H, D] with cu_seqlens_q, got shape {list(qa.shape)}", "q")
        if max_seqlen_q is None:
            raise _error("max_seqlen_q is required with cu_seqlens_q (as flash-attn)", "max_seqlen_q")
        max_q = _native.index_arg(_KVCACHE, "max_seqlen_q", max_seqlen_q, 0)
        cu_q = cu_seqlens(cu_seqlens_q, "cu_seqlens_q", batch=None, total=qa.shape[0], total_name="q", exact=False)
        batch, q = cu_q.shape[0] - 1, qa
        lens = np.diff(cu_q.astype(np.int64))
        over = np.flatnonzero(lens > max_q)
        if over.size:
            b = int(over[0])
            raise _error(f"max_seqlen_q = {max_q} is less than sequence {b}'s query rows (cu_seqlens_q[{b + 1}] - "
                         f"cu_seqlens_q[{b}] = {int(lens[b])})", "max_seqlen_q")
    cu_k = k = v = None
    if ka is not None and va is not None:
        if cu_seqlens_k_new is None:
            if ka.ndim != 4 or ka.shape[0] != batch:
                raise _error(f"k must be [B, seqlen_new, Hkv, D] with B = {batch} without cu_seqlens_k_new, got shape "
                             f"{list(ka.shape)}", "k")
            cu_k = (np.arange(batch + 1, dtype=np.int64) * ka.shape[1]).astype(I32)
            k, v = ka.reshape(-1, *ka.shape[2:]), va.reshape(-1, *va.shape[2:]) if va.ndim == 4 else va
        else:
            if ka.ndim != 3:
                raise _error(f"k must be [total_k_new, Hkv, D] with cu_seqlens_k_new, got shape {list(ka.shape)}", "k")
            cu_k = cu_seqlens(cu_seqlens_k_new, "cu_seqlens_k_new", batch=batch, total=ka.shape[0], total_name="k",
                              exact=True)
            k, v = ka, va
        if v.shape[:-1] != k.shape[:-1] or v.ndim != k.ndim:  # v may have a head dim of its own
            raise _error(f"v shape {list(va.shape)} must equal k shape {list(ka.shape)} but for the head dim", "v")
    return Ragged(batch, cu_q, cu_k, q, k, v, max_q, dense_q)


def positions(r: Ragged, lens: np.ndarray, *, rows: np.ndarray, cu: np.ndarray, per_row: bool) -> np.ndarray:
    """The rotary position of every packed row: its sequence's
    cache_seqlens, plus its index in the sequence when `per_row`."""
    seq = np.repeat(np.arange(r.batch), rows)
    pos = np.repeat(lens.astype(np.int64), rows)
    if per_row:
        pos = pos + (np.arange(seq.shape[0]) - np.repeat(cu[:-1].astype(np.int64), rows))
    return pos


def check_rotary(r: Ragged, lens: np.ndarray, seqlen_ro: int, per_row_q: bool) -> None:
    """Every position a rotation reads lies in rotary_cos's rows."""
    for name, rows, cu, per_row in (("q", r.q_lens, r.cu_q, per_row_q), ("k", r.new_lens, r.cu_k, True)):
        if cu is None:
            continue
        pos = positions(r, lens, rows=rows, cu=cu, per_row=per_row)
        bad = np.flatnonzero(pos >= seqlen_ro)
        if bad.size:
            at = int(bad[0])
            b = int(np.searchsorted(cu.astype(np.int64), at, side="right") - 1)
            raise _error(f"the position of {name}'s row {at - int(cu[b])} of sequence {b} (cache_seqlens[{b}] = "
                         f"{int(lens[b])}{' + its row' if per_row else ''}) is {int(pos[at])}, outside rotary_cos's "
                         f"positions [0, {seqlen_ro}) (its dim 0, seqlen_ro)", "rotary_cos")


def rotate_rows(reg: Any, x: np.ndarray, tables: tuple[np.ndarray, np.ndarray], pos: np.ndarray,
                interleaved: bool, name: str) -> np.ndarray:
    """x [T, heads, D] rotated row by row at `pos` [T] (one dispatch: each
    row a one-row sequence at its own position); empty x is returned as is."""
    from ._rotary import rotate
    if x.shape[0] == 0:
        return x
    offsets = np.ascontiguousarray(pos.astype(I32))
    out = rotate(reg, _KVCACHE, x.reshape(x.shape[0], 1, *x.shape[1:]), tables, offsets, interleaved=interleaved,
                 per_row=True, name=name)
    return out.reshape(x.shape)


def attend(reg: Any, r: Ragged, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, seqlens: np.ndarray | None,
           table: np.ndarray | None, opts: Any, *, sinks: np.ndarray | None, alibi: np.ndarray | None,
           want_lse: bool, out: np.ndarray | None, new: NewRows | None,
           cache_batch_idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The varlen prefill of the packed q [total_q, H, D] over the cache
    (lengths `seqlens`, [B] or [2, B] with key starts; pages through
    `table` and cache rows `cache_batch_idx` when given), after `new`'s rows
    are appended (the library validates both before either runs). Returns
    (out, lse [H, total_q]); the library makes rows after cu_seqlens_q[-1]
    read 0 and -inf."""
    from ._serving_args import seq_tensors
    result = np.empty(q.shape[:-1] + vc.shape[-1:], dtype=q.dtype) if out is None else out
    lse = np.empty((q.shape[1], q.shape[0]), dtype=F32) if want_lse else None
    k_new, v_new, cu_k = (None, None, None) if new is None else new
    ffi = _native.ffi()
    seq, keep = seq_tensors(ffi, cu_seqlens_q=r.cu_q, seqlens_k=seqlens, block_table=table, sinks=sinks, lse=lse,
                            alibi_slopes=alibi, k_new=k_new, v_new=v_new, cu_seqlens_k_new=cu_k,
                            cache_batch_idx=cache_batch_idx)
    _native.call(reg, "fm_dispatch_attn", tensor(ffi, q), tensor(ffi, kc), tensor(ffi, vc), seq, tensor(ffi, result),
                 opts, op=_KVCACHE, keep=(q, kc, vc, r.cu_q, seqlens, table, cache_batch_idx, sinks, lse, alibi,
                                          result, new, keep))
    return result, lse


def unpack(r: Ragged, out: np.ndarray, lse: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The caller's shapes: a dense q's out [B, qL, H, D] and lse [B, H,
    qL]; a ragged q's out [total_q, H, D] and lse [H, total_q] as they are."""
    if r.dense_q is None:
        return out, lse
    b, ql, h, _ = r.dense_q
    # Views, not copies: on a deferring backend the arrays fill when the work runs.
    return out.reshape(r.dense_q[:-1] + out.shape[-1:]), None if lse is None else lse.reshape(h, b, ql).transpose(1, 0, 2)
