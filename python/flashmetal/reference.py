"""float64 numpy reference, written from the math (DESIGN §2), not from a kernel.

Inputs are taken as given (already rounded to their dtype); everything is
computed in float64.
"""
from __future__ import annotations

import math

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


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float | None = None,
              causal: bool = False, q_offset: int = 0, mask: np.ndarray | None = None,
              softcap: float = 0.0, window: int | None = None) -> np.ndarray:
    """Head-major attention: q [B, H, qL, D], k/v [B, Hkv, kL, D] -> [B, H, qL, D] float64.

    mask: additive float or bool (True = attend), broadcastable to [B, H, qL, kL].
    A row that sees no key gives zeros.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, H, qL, D = q.shape
    hkv, kL = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
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
    return sign_vector(bits, d) * (o @ hadamard(d).T) / math.sqrt(d)


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
