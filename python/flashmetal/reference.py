"""float64 numpy reference, written from the math (docs/ARCHITECTURE.md, numeric contract), not from a kernel.

Inputs are taken as given (already rounded to their dtype); everything is
computed in float64.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def visible(q_len: int, k_len: int, *, causal: bool, q_offset: int = 0,
            window: int | None = None) -> np.ndarray:
    """[qL, kL] bool: query i (at q_offset + i) sees key j."""
    t = q_offset + np.arange(q_len)[:, None]
    p = np.arange(k_len)[None, :]
    vis = np.ones((q_len, k_len), dtype=bool)
    if causal:
        vis &= p <= t
    if window is not None:
        vis &= (t - p) < window
    return vis


def _scale(scale: float | None, d: int) -> float:
    """The score scale: `scale`, or attention's default 1/sqrt(D) of q's head dim."""
    return 1.0 / math.sqrt(d) if scale is None else scale


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float | None = None,
              causal: bool = False, q_offset: int = 0, mask: np.ndarray | None = None,
              softcap: float = 0.0, window: int | None = None) -> np.ndarray:
    """Head-major attention: q [B, H, qL, D], k [B, Hkv, kL, D], v [B, Hkv, kL, Dv]
    -> [B, H, qL, Dv] float64 (Dv may differ from D; the default scale is 1/sqrt(D)).

    mask: additive float or bool (True = attend), broadcastable to [B, H, qL, kL].
    A row that sees no key gives zeros.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, H, qL, D = q.shape
    hkv, kL = k.shape[1], k.shape[2]
    scale = _scale(scale, D)
    g = H // hkv
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    s = scale * (q @ k.swapaxes(-1, -2))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if mask is not None:
        m = np.asarray(mask)
        s = s + (np.where(m, 0.0, -np.inf) if m.dtype == np.bool_ else _f64(m))
    if causal or window is not None:
        s = np.where(visible(qL, kL, causal=causal, q_offset=q_offset, window=window), s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - mx)
    denom = p.sum(axis=-1, keepdims=True)
    o = p @ v
    return np.where(denom > 0, o / np.where(denom > 0, denom, 1.0), 0.0)


def excess(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """|a - e| / (atol + rtol*|e|) elementwise, broadcast to a's shape: <= 1 is
    within tolerance. A non-finite expected value must be matched exactly (NaN
    by NaN, inf by the same inf): 0 when it is, inf when it is not; NaN on one
    side only is inf."""
    a = _f64(actual)
    e = np.broadcast_to(_f64(expected), a.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = np.abs(a - e) / (atol + rtol * np.abs(e))
        same_nonfinite = (np.isnan(a) & np.isnan(e)) | ((a == e) & ~np.isfinite(e))
    ratio = np.where(a == e, 0.0, ratio)  # exact, even where the bound is 0
    ratio = np.where(np.isfinite(e), ratio, np.where(same_nonfinite, 0.0, np.inf))
    return np.where(np.isnan(ratio), np.inf, ratio)


def close(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> tuple[bool, float]:
    """|a - e| <= atol + rtol*|e| elementwise (non-finite expected values
    matched exactly, see `excess`); returns (ok, worst excess ratio)."""
    r = excess(actual, expected, atol, rtol)
    ratio = float(np.max(r)) if r.size else 0.0
    return ratio <= 1.0, ratio


def mask_additive(q_len: int, k_len: int, *, causal: bool, q_offset: int = 0,
                  window: int | None = None) -> np.ndarray:
    """[qL, kL] float64 additive mask: 0 where visible, -inf elsewhere."""
    return np.where(visible(q_len, k_len, causal=causal, q_offset=q_offset, window=window), 0.0, -np.inf)


def blk_classes(mask: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """[ceil(qL/bq), ceil(kL/bk)] uint8 tile classes of an additive mask:
    0 when every cell of the tile is -inf (a finite bias, however negative,
    still has weight), 2 when every cell is exactly 0, else 1 (NaN included); a tile that runs past the right edge (kL % bk != 0) is 1; the
    last row tile covers only the rows that exist."""
    m = _f64(mask)
    ql, kl = m.shape
    nq, nk = -(-ql // bq), -(-kl // bk)
    out = np.empty((nq, nk), dtype=np.uint8)
    for i in range(nq):
        for j in range(nk):
            if (j + 1) * bk > kl:
                out[i, j] = 1
                continue
            t = m[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            out[i, j] = 0 if np.all(t == -np.inf) else (2 if np.all(t == 0) else 1)
    return out


def hadamard(d: int) -> np.ndarray:
    """The natural-order (Sylvester) Hadamard matrix H_d, d a power of two."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), h)
    assert h.shape[0] == d, "d must be a power of two"
    return h


def sign_vector(bits: np.ndarray | None, d: int) -> np.ndarray:
    """The ±1 signs of a bitmask: bit j = (bits[j >> 3] >> (j & 7)) & 1, 1 means -1."""
    if bits is None:
        return np.ones(d)
    b = np.asarray(bits, dtype=np.uint8)
    j = np.arange(d)
    return np.where((b[j >> 3] >> (j & 7)) & 1, -1.0, 1.0)


def fwht_undo(o: np.ndarray, bits: np.ndarray | None = None) -> np.ndarray:
    """y = s ⊙ (H_D o) / sqrt(D) along the last axis."""
    o = _f64(o)
    d = o.shape[-1]
    y: np.ndarray = sign_vector(bits, d) * (o @ hadamard(d).T) / math.sqrt(d)
    return y


def decode(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_len: int, *, scale: float | None = None,
           window: int | None = None, softcap: float = 0.0) -> np.ndarray:
    """One query row per head at position kv_len - 1: q [(B,) H, D], k/v [(B,) Hkv, cap, D]."""
    batched = np.ndim(q) == 3
    q4 = _f64(q)[:, :, None, :] if batched else _f64(q)[None, :, None, :]
    k4 = _f64(k) if batched else _f64(k)[None]
    v4 = _f64(v) if batched else _f64(v)[None]
    o = attention(q4, k4[:, :, :kv_len], v4[:, :, :kv_len], scale=scale, causal=True,
                  q_offset=kv_len - 1, window=window, softcap=softcap)[:, :, 0, :]
    return o if batched else o[0]


# ---- serving semantics (flash-attn's API) ----------------------------------
# Token-major tensors as flash-attn lays them out: one sequence is [L, H, D].
# Row i of a sequence with qL queries and kL keys sits at t = kL - qL + i
# (bottom-right); window_size=(left, right) keeps keys t - left <= p <= t + right
# (-1 = unbounded); causal keeps p <= t; attention_chunk c > 0 keeps only keys
# in t's chunk, p // c == t // c (floor division; 0 = off). softcap c:
# c*tanh(s/c) on the scaled score. A sink is a per-head logit in the
# denominator with no value (-inf: no sink; +inf: it takes all the mass, the
# limit: output 0, LSE +inf; NaN: NaN).
# LSE is the natural log of the denominator, -inf for a row that sees nothing
# and has no sink (its output is 0).


def serving_visible(q_len: int, k_len: int, *, causal: bool = False,
                    window_size: tuple[int, int] = (-1, -1), attention_chunk: int = 0) -> np.ndarray:
    """[qL, kL] bool: row i (at kL - qL + i) sees key p."""
    t = k_len - q_len + np.arange(q_len)[:, None]
    p = np.arange(k_len)[None, :]
    left, right = window_size
    vis = np.ones((q_len, k_len), dtype=bool)
    if causal:
        vis &= p <= t
    if left >= 0:
        vis &= p >= t - left
    if right >= 0:
        vis &= p <= t + right
    if attention_chunk > 0:
        vis &= p // attention_chunk == t // attention_chunk
    return vis


def attend_sequence(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    sinks: np.ndarray | None = None, attention_chunk: int = 0,
                    alibi_slopes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: q [qL, H, D], k [kL, Hkv, D], v [kL, Hkv, Dv] (H % Hkv == 0;
    query head h reads kv head h // (H / Hkv)) -> (out [qL, H, Dv], lse [H, qL]),
    float64; the default scale is 1/sqrt(D).
    alibi_slopes [H]: the score of key p for row i (at t = kL - qL + i) gains
    -slope[h] * |t - p| after the softcap (ALiBi, flash-attn's convention)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    q_len, heads, d = q.shape
    k_len, kv_heads = k.shape[0], k.shape[1]
    scale = _scale(scale, d)
    g = heads // kv_heads
    kh = np.repeat(k.transpose(1, 0, 2), g, axis=0)  # [H, kL, D]
    vh = np.repeat(v.transpose(1, 0, 2), g, axis=0)
    s = scale * (q.transpose(1, 0, 2) @ kh.transpose(0, 2, 1))  # [H, qL, kL]
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        t = k_len - q_len + np.arange(q_len)[:, None]
        distance = np.abs(t - np.arange(k_len)[None, :]).astype(np.float64)
        s = s - _f64(alibi_slopes).reshape(heads, 1, 1) * distance
    vis = serving_visible(q_len, k_len, causal=causal, window_size=window_size, attention_chunk=attention_chunk)
    s = np.where(vis, s, -np.inf)
    sink = np.full((heads, 1, 1), -np.inf) if sinks is None else _f64(sinks).reshape(heads, 1, 1)
    m = np.maximum(s.max(axis=-1, keepdims=True, initial=-np.inf), sink)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True) + np.exp(sink - m)
    with np.errstate(divide="ignore"):
        lse = (m + np.log(denom))[..., 0]
    o = np.where(denom == 0, 0.0, (p @ vh) / np.where(denom == 0, 1.0, denom))  # a NaN denominator stays NaN
    taken = np.isposinf(sink)  # [H, 1, 1]
    o, lse = np.where(taken, 0.0, o), np.where(taken[..., 0], np.inf, lse)
    return o.transpose(1, 0, 2), lse


def flash_attn(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """flash_attn_func: q [B, qL, H, D], k/v [B, kL, Hkv, D] -> (out [B, qL, H, D], lse [B, H, qL]).
    Keywords as `attend_sequence`; alibi_slopes [H] or [B, H]."""
    pairs = [attend_sequence(q[b], k[b], v[b], **_sequence_kw(kw, b)) for b in range(np.shape(q)[0])]
    return np.stack([o for o, _ in pairs]), np.stack([lse for _, lse in pairs])


def _sequence_kw(kw: dict[str, Any], b: int) -> dict[str, Any]:
    """attend_sequence's keywords for sequence b: alibi_slopes [B, H] -> its row."""
    slopes = kw.get("alibi_slopes")
    if slopes is None or np.ndim(slopes) == 1:
        return kw
    return {**kw, "alibi_slopes": np.asarray(slopes)[b]}


def paged_rows(cache: np.ndarray, pages: np.ndarray, length: int) -> np.ndarray:
    """The first `length` rows of one sequence of a paged cache
    [num_pages, page_size, Hkv, D] whose pages are `pages` (its block_table row)."""
    page_size = cache.shape[1]
    p = np.arange(length)
    rows: np.ndarray = cache[np.asarray(pages)[p // page_size], p % page_size]
    return rows


def flash_attn_varlen(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens_q: np.ndarray,
                      cu_seqlens_k: np.ndarray, *, block_table: np.ndarray | None = None,
                      seqused_q: np.ndarray | None = None, seqused_k: np.ndarray | None = None,
                      **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """flash_attn_varlen_func: q [total_q, H, D]; k/v [total_k, Hkv, D], or paged
    [num_pages, page_size, Hkv, D] with block_table (sequence b then has
    cu_seqlens_k[b+1] - cu_seqlens_k[b] keys read through its table row)
    -> (out [total_q, H, D], lse [H, total_q]). seqused_q / seqused_k
    (flash-attn 3's): only sequence b's first seqused_q[b] rows attend, to
    its first seqused_k[b] keys; its other rows attend to no key."""
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    out = np.zeros(np.shape(q)[:-1] + np.shape(v)[-1:], dtype=np.float64)
    lse = np.full((np.shape(q)[1], np.shape(q)[0]), -np.inf)
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if seqused_k is not None:
            ke = ks + int(seqused_k[b])
        if block_table is None:
            kb, vb = k[ks:ke], v[ks:ke]
        else:
            kb, vb = paged_rows(k, block_table[b], ke - ks), paged_rows(v, block_table[b], ke - ks)
        qu = qe if seqused_q is None else qs + int(seqused_q[b])
        out[qs:qu], lse[:, qs:qu] = attend_sequence(q[qs:qu], kb, vb, **_sequence_kw(kw, b))
        out[qu:qe], lse[:, qu:qe] = attend_sequence(q[qu:qe], kb[:0], vb[:0], **_sequence_kw(kw, b))
    return out, lse


def kv_append(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
              cache_seqlens: np.ndarray, block_table: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """New caches (copies) with row i of k/v [B, n_new, Hkv, D] of sequence b
    written at position cache_seqlens[b] + i (through block_table when paged)."""
    kc, vc = np.array(k_cache), np.array(v_cache)
    for b, start in enumerate(np.asarray(cache_seqlens).tolist()):
        for i in range(np.shape(k)[1]):
            t = start + i
            if block_table is None:
                kc[b, t], vc[b, t] = k[b, i], v[b, i]
            else:
                page, row = block_table[b][t // kc.shape[1]], t % kc.shape[1]
                kc[page, row], vc[page, row] = k[b, i], v[b, i]
    return kc, vc


def flash_attn_kvcache(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, *,
                       k: np.ndarray | None = None, v: np.ndarray | None = None,
                       cache_seqlens: np.ndarray | int | None = None, block_table: np.ndarray | None = None,
                       cache_batch_idx: np.ndarray | None = None, cache_leftpad: np.ndarray | None = None,
                       **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    """flash_attn_with_kvcache: q [B, qL, H, D] over caches [B, cap, Hkv, D] (or
    paged with block_table) holding cache_seqlens[b] keys (None: all of them),
    after appending k/v [B, n_new, Hkv, D] at cache_seqlens (on copies: the
    arguments are not modified) -> (out [B, qL, H, D], lse [B, H, qL]).
    cache_batch_idx: sequence b's cache is row cache_batch_idx[b] (of the
    block table when paged);
    cache_leftpad: sequence b's keys start at row cache_leftpad[b] and its
    positions count from there (flash-attn's key_leftpad)."""
    batch = np.shape(q)[0]
    if cache_batch_idx is not None and block_table is not None:
        block_table = np.asarray(block_table)[np.asarray(cache_batch_idx, dtype=np.int64)]
    elif cache_batch_idx is not None:
        rows = np.asarray(cache_batch_idx, dtype=np.int64)
        k_cache, v_cache = np.asarray(k_cache)[rows], np.asarray(v_cache)[rows]
    first = np.zeros(batch, dtype=np.int64) if cache_leftpad is None else np.asarray(cache_leftpad, dtype=np.int64)
    if cache_seqlens is None:
        full = np.shape(k_cache)[1] * (1 if block_table is None else np.shape(block_table)[1])
        cache_seqlens = np.full(batch, full)
    lens = np.broadcast_to(np.asarray(cache_seqlens), (batch,))
    if k is not None:
        assert v is not None, "k and v are appended together"
        k_cache, v_cache = kv_append(k_cache, v_cache, k, v, lens, block_table)
        lens = lens + np.shape(k)[1]
    outs, lses = [], []
    for b in range(batch):
        n = int(lens[b])
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            kb, vb = paged_rows(k_cache, block_table[b], n), paged_rows(v_cache, block_table[b], n)
        o, lse = attend_sequence(q[b], kb[first[b]:], vb[first[b]:], **_sequence_kw(kw, b))
        outs.append(o)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


def apply_rotary_emb(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, offsets: np.ndarray | int = 0, *,
                     interleaved: bool = False) -> np.ndarray:
    """flash-attn's apply_rotary_emb in float64: x [B, L, H, D], cos/sin
    [seqlen_ro, rotary_dim / 2]; row i of sequence b at position offsets[b] + i.
    The pair (j, j + rotary_dim/2) (interleaved: (2j, 2j+1)) of the first
    rotary_dim dims is rotated by the angle whose cos/sin the tables hold;
    the other dims are unchanged."""
    x64, c64, s64 = _f64(x), _f64(cos), _f64(sin)
    batch, rows = x64.shape[0], x64.shape[1]
    half = c64.shape[1]
    pos = np.broadcast_to(np.asarray(offsets, dtype=np.int64), (batch,))[:, None] + np.arange(rows)
    c, s = c64[pos][:, :, None, :], s64[pos][:, :, None, :]  # [B, L, 1, half]
    out: np.ndarray = x64.copy()
    if interleaved:
        x1, x2 = x64[..., 0:2 * half:2], x64[..., 1:2 * half:2]
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x64[..., :half], x64[..., half:2 * half]
        out[..., :half], out[..., half:2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


def merge_lse(o_a: np.ndarray, lse_a: np.ndarray, o_b: np.ndarray,
              lse_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Combines two partial attentions over disjoint key sets: o [..., qL, H, D]
    with lse [..., H, qL] -> the attention over the union and its lse."""
    la, lb = _f64(lse_a), _f64(lse_b)
    m = np.maximum(la, lb)
    m = np.where(np.isfinite(m), m, 0.0)
    wa, wb = np.exp(la - m), np.exp(lb - m)
    total = wa + wb
    with np.errstate(divide="ignore"):
        lse = m + np.log(total)
    # weights per row, moved from [..., H, qL] to o's [..., qL, H, 1]
    fa = np.swapaxes(np.where(total > 0, wa / np.where(total > 0, total, 1.0), 0.0), -1, -2)[..., None]
    fb = np.swapaxes(np.where(total > 0, wb / np.where(total > 0, total, 1.0), 0.0), -1, -2)[..., None]
    return fa * _f64(o_a) + fb * _f64(o_b), lse
