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


def close(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> tuple[bool, float]:
    """|a - e| <= atol + rtol*|e| elementwise; returns (ok, worst excess ratio)."""
    a = _f64(actual)
    e = _f64(expected)
    err = np.abs(a - e)
    bound = atol + rtol * np.abs(e)
    ratio = float(np.max(err / bound)) if err.size else 0.0
    return bool(np.all(err <= bound)), ratio
