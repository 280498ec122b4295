"""Shared test helpers: dtypes, random inputs, tolerances."""
from __future__ import annotations

import ml_dtypes
import numpy as np

from flashmetal import reference
from flashmetal.reference import close

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

# (atol, rtol) per output dtype
TOLERANCE = {BF16: (5e-3, 2e-2), F16: (1e-3, 5e-3), F32: (1e-5, 1e-4)}


def randn(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Standard normal values rounded to dtype."""
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def qkv_of_shapes(rng: np.random.Generator, q_shape: tuple[int, ...], kv_shape: tuple[int, ...],
                  dtype: np.dtype, *, dv: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q of q_shape, then k of kv_shape and v of kv_shape (with head dim dv
    when given): standard normal values in dtype."""
    v_shape = kv_shape if dv is None else tuple(kv_shape[:-1]) + (dv,)
    return randn(rng, q_shape, dtype), randn(rng, kv_shape, dtype), randn(rng, v_shape, dtype)


def qkv(rng: np.random.Generator, dtype: np.dtype, *, b: int = 1, h: int = 2, hkv: int = 2, ql: int = 6,
        kl: int = 20, d: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Head-major q [b, h, ql, d] and k, v [b, hkv, kl, d] (qkv_of_shapes)."""
    return qkv_of_shapes(rng, (b, h, ql, d), (b, hkv, kl, d), dtype)


def worst_element(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> str:
    """The element furthest outside |a - e| <= atol + rtol*|e|: index and both values."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.broadcast_to(np.asarray(expected, dtype=np.float64), a.shape)
    if not a.size:
        return "empty"
    idx = np.unravel_index(int(np.argmax(reference.excess(a, e, atol, rtol))), a.shape)
    return (f"worst at index {tuple(int(i) for i in idx)}: actual {float(a[idx])!r}, expected {float(e[idx])!r}, "
            f"|diff| {abs(a[idx] - e[idx]):.3g}")


def assert_close(actual: np.ndarray, expected: np.ndarray, dtype: np.dtype, what: str = "") -> None:
    atol, rtol = TOLERANCE[np.dtype(dtype)]
    ok, ratio = close(actual, expected, atol, rtol)
    assert ok, (f"{what}: error exceeds tolerance by {ratio:.3g}x (atol={atol}, rtol={rtol}); "
                + worst_element(actual, expected, atol, rtol))


def assert_bits_equal(a: np.ndarray, b: np.ndarray, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, what
    av = a.view(np.uint8)
    bv = b.view(np.uint8)
    n = int(np.count_nonzero(av != bv))
    assert n == 0, f"{what}: {n} bytes differ"


def wide_bool_bytes(rng: np.random.Generator, keep: np.ndarray) -> np.ndarray:
    """A bool array whose true cells hold bytes other than 1 (2, 7, 128, 255:
    a C caller's `bool` buffer may), as numpy's bool view of those bytes: the
    library must read any nonzero byte as true."""
    raw = np.where(keep, rng.choice(np.array([1, 2, 7, 128, 255], np.uint8), keep.shape), 0).astype(np.uint8)
    assert set(np.unique(raw[keep]).tolist()) > {1}, "the mask must hold bytes other than 0/1"
    return raw.view(np.bool_)
