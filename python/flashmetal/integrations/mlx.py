"""MLX: ``mx.fast.scaled_dot_product_attention`` on flashmetal's kernels, and
``patch()``, which makes mlx-lm's models attend through it.

``scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None)``
takes and returns MLX arrays with MLX's semantics:

- q ``[B, N_q, T_q, D]``, k/v ``[B, N_kv, T_kv, D]``; N_q a multiple of N_kv
  (grouped-query attention needs no flag); float32, float16 or bfloat16, mixed
  dtypes promoted as MLX promotes them (``mx.result_type``).
- ``mask``: None; ``"causal"``, bottom-right aligned (query i sits at
  ``T_kv - T_q + i``: the queries are the newest tokens); or an array of rank
  <= 4 broadcast to ``[B, N_q, T_q, T_kv]`` as MLX broadcasts it, bool (True =
  attend) or additive (a dtype that promotes to the output's).
- ``sinks``: ``[N_q]`` logits, one per query head, that join every row's
  softmax denominator without a value (gpt-oss); with or without a mask.

Arrays are read in place (MLX exports them through the buffer protocol,
bfloat16 as its uint16 bits), and so are the buffers of an mlx-lm KV cache
passed as ``cache`` (``patch()`` does) when k and v are their first rows; any
other strided array (a transposed or sliced view) is copied once, and the result is copied once into a new MLX array (MLX
cannot wrap foreign memory). The call evaluates its inputs (``mx.eval``), so
it runs eagerly, inside neither ``mx.compile`` nor a gradient.

Where MLX leaves a result undefined (a row that sees no key: every key
masked, or a causal row before key 0 when T_q > T_kv), the row is zeros
here.

Sinks with a mask: no flashmetal kernel takes both, so the sinks enter as one
more key, exactly: key 0 of k and v is zeros, so its score is 0 and its value
adds nothing, and the additive mask holds the sink logit in that key's column
(rounded to the output dtype first, as MLX rounds it). Its softmax weight is
then ``exp(sink)`` over the denominator, which is the definition of a sink.
This copies k and v once (one row longer) and builds a mask of
``[B or 1, N_q, T_q or 1, T_kv + 1]``.
"""
from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from .._arrays import BF16
from .._errors import InvalidTypeError, InvalidValueError
from ..attention import scaled_dot_product_attention as _front_door
from ..registry import RegistryLike

_OP = "mlx.scaled_dot_product_attention"
_IO_DTYPES = ("float32", "float16", "bfloat16")


class DtypeError(InvalidTypeError, ValueError):
    """A dtype this function refuses: a TypeError, as every flashmetal dtype
    error is, and a ValueError, which ``mx.fast.scaled_dot_product_attention``
    raises for the same inputs (a mask or sinks dtype that does not promote
    to the output's, q/k/v that promote to an unsupported type)."""


def _mx() -> Any:
    try:
        import mlx.core as mx
    except ImportError as e:  # pragma: no cover - exercised only without mlx
        raise ImportError("flashmetal.integrations.mlx needs MLX: pip install mlx (Linux: pip install 'mlx[cpu]')") \
            from e
    return mx


def _dtype_name(dt: Any) -> str:
    return str(dt).rsplit(".", 1)[-1]


def _as_numpy(a: Any) -> np.ndarray:
    """A numpy view of an MLX array (evaluated): bfloat16 through its uint16
    bits, which MLX's buffer protocol and DLPack cannot describe."""
    mx = _mx()
    if a.dtype == mx.bfloat16:
        return np.asarray(a.view(mx.uint16)).view(BF16)
    return np.asarray(a)


def _to_mlx(a: np.ndarray) -> Any:
    mx = _mx()
    if a.dtype == BF16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    return mx.array(a)


def _check_array(mx: Any, x: Any, name: str) -> None:
    if not isinstance(x, mx.array):
        raise InvalidTypeError(_OP, f"{name} must be an mlx.core.array, got {type(x).__name__}")


def _promotes_to(mx: Any, dtype: Any, final: Any) -> bool:
    return bool(mx.result_type(dtype, final) == final)


def _mask_rank4(mx: Any, mask: Any, shape: tuple[int, int, int, int], final: Any) -> np.ndarray:
    """The array mask checked as MLX checks it, as numpy of rank 4 (1s
    prepended; broadcast axes left at 1), bool or in the output dtype."""
    if mask.ndim > 4:
        raise InvalidValueError(_OP, f"mask has shape {tuple(mask.shape)}; it must have rank <= 4")
    if mask.dtype != mx.bool_:
        if not _promotes_to(mx, mask.dtype, final):
            raise DtypeError(_OP, f"mask dtype {_dtype_name(mask.dtype)} must be bool or promote to the "
                             f"output dtype {_dtype_name(final)}", argument="mask")
        if mask.dtype != final:
            mask = mask.astype(final)
    m = _as_numpy(mask)
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)
    given: tuple[int, ...] = m.shape
    if any(n not in (1, want) for n, want in zip(given, shape, strict=True)):
        raise InvalidValueError(_OP, f"mask shape {tuple(mask.shape)} does not broadcast to [B, N_q, T_q, T_kv] "
                                f"= {list(shape)}")
    return m


def _with_sink_key(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, sinks: np.ndarray,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k and v with a zero key 0 in front, and the additive mask whose column 0
    holds each query head's sink logit (see the module docstring)."""
    B, H, qL, _ = q.shape
    zero = np.zeros(k.shape[:2] + (1, k.shape[3]), k.dtype)
    k1 = np.concatenate([zero, k], axis=2)
    v1 = np.concatenate([zero, v], axis=2)
    kL = k.shape[2]
    if mask is None:
        lead = (1, H, 1)
        body = np.zeros(lead + (kL,), q.dtype)
    else:
        lead = (mask.shape[0], H, mask.shape[2])
        m = np.broadcast_to(mask, lead + (kL,))
        body = np.where(m, 0.0, -np.inf).astype(q.dtype) if m.dtype == np.bool_ else m
    m1 = np.empty(lead + (kL + 1,), q.dtype)
    m1[..., 1:] = body
    m1[..., 0] = sinks.astype(q.dtype)[None, :, None]
    return k1, v1, m1


def _cache_buffers(cache: Any, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The whole K and V buffers of an mlx-lm KV cache when k and v are their
    first rows (``cache.keys[..., :offset, :]``, as KVCache hands them over):
    read in place with kv_len = offset instead of copying the strided prefix.
    None when they are anything else (a rotating or quantized cache's)."""
    full = [getattr(cache, "keys", None), getattr(cache, "values", None)]
    mx = _mx()
    if not all(isinstance(a, mx.array) and a.ndim == 4 for a in full):
        return None
    fk, fv = (_as_numpy(a) for a in full)
    for whole, part in ((fk, k), (fv, v)):
        if (whole.dtype != part.dtype or not whole.flags.c_contiguous or whole.shape[:2] != part.shape[:2]
                or whole.shape[3] != part.shape[3] or whole.shape[2] < part.shape[2]
                or whole.ctypes.data != part.ctypes.data or whole.strides != part.strides):
            return None
    return fk, fv


def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, sinks: Any = None,
                                 stream: Any = None, cache: Any = None, registry: RegistryLike = None) -> Any:
    """``mx.fast.scaled_dot_product_attention`` on flashmetal (see the module
    docstring for the semantics).

    Args:
        q: ``[B, N_q, T_q, D]`` mlx array, float32, float16 or bfloat16.
        k, v: ``[B, N_kv, T_kv, D]``; N_q a multiple of N_kv.
        scale: score scale (MLX requires it; typically ``D ** -0.5``).
        mask: None, ``"causal"`` (bottom-right) or a bool / additive array
            broadcastable to ``[B, N_q, T_q, T_kv]``.
        sinks: optional ``[N_q]`` sink logits.
        stream: accepted for MLX's signature and ignored: flashmetal runs on
            ``registry``'s backend.
        cache: optional mlx-lm KV cache that k and v came from: when they are
            the first rows of its buffers, the buffers are read in place
            (no copy of the strided prefix); otherwise ignored.
        registry: a flashmetal Registry or backend name; default ``Registry("auto")``.

    Returns:
        ``[B, N_q, T_q, D]`` mlx array in the promoted dtype.
    """
    mx = _mx()
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(mx, x, name)
        if x.ndim != 4:
            raise InvalidValueError(_OP, f"{name} has shape {tuple(x.shape)}; q, k and v must have rank 4")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise InvalidTypeError(_OP, f"scale must be a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise InvalidValueError(_OP, f"scale must be finite, got {scale}", argument="scale")
    B, H, qL, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise InvalidValueError(_OP, f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise InvalidValueError(_OP, f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same heads and length")
    if k.shape[3] != D:
        raise InvalidValueError(_OP, f"q's head dim {D} must equal k's ({k.shape[3]})")
    if k.shape[1] == 0 or H % k.shape[1]:
        raise InvalidValueError(_OP, f"N_q ({H}) must be a multiple of N_kv ({k.shape[1]})")
    final = mx.result_type(q, k, v)
    if _dtype_name(final) not in _IO_DTYPES:
        raise DtypeError(_OP, f"q, k and v promote to {_dtype_name(final)}; flashmetal takes float32, "
                         "float16 or bfloat16 (cast with .astype(mx.float32))", argument="q")
    q, k, v = (x if x.dtype == final else x.astype(final) for x in (q, k, v))
    kL = k.shape[2]
    causal = False
    mask_np = None
    if isinstance(mask, str):
        if mask != "causal":
            raise InvalidValueError(_OP, f"mask must be None, 'causal' or an array, got {mask!r}")
        causal = True
    elif mask is not None:
        _check_array(mx, mask, "mask")
        mask_np = _mask_rank4(mx, mask, (B, H, qL, kL), final)
    sinks_np = None
    if sinks is not None:
        _check_array(mx, sinks, "sinks")
        if sinks.ndim != 1 or sinks.shape[0] != H:
            raise InvalidValueError(_OP, f"sinks has shape {tuple(sinks.shape)}; it must be [N_q] = [{H}]")
        if not _promotes_to(mx, sinks.dtype, final):
            raise DtypeError(_OP, f"sinks dtype {_dtype_name(sinks.dtype)} must promote to the output dtype "
                             f"{_dtype_name(final)}", argument="sinks")
        sinks_np = _as_numpy(sinks.astype(final))
    qn, kn, vn = _as_numpy(q), _as_numpy(k), _as_numpy(v)
    kv_len = None
    whole = None if cache is None or sinks_np is not None else _cache_buffers(cache, kn, vn)
    if whole is not None:
        kn, vn = whole
        kv_len = kL
    if sinks_np is not None:
        kn, vn, mask_np = _with_sink_key(qn, kn, vn, mask_np, sinks_np)
    out = _front_door(qn, kn, vn, attn_mask=mask_np, is_causal=causal, scale=float(scale), enable_gqa=True,
                      kv_len=kv_len, align="bottom_right", registry=registry)
    return _to_mlx(out)


_original: list[Any] = []  # mlx-lm's own function while patch() is in force


def _mlx_lm_modules() -> list[Any]:
    return [m for n, m in list(sys.modules.items()) if (n == "mlx_lm" or n.startswith("mlx_lm.")) and m is not None]


def patch(registry: RegistryLike = None) -> None:
    """Makes mlx-lm's models attend through flashmetal: replaces
    ``mlx_lm.models.base.scaled_dot_product_attention`` and the copy every
    loaded ``mlx_lm.models.*`` module imported (modules imported later take
    the replaced one from base), so models loaded before or after this call
    use it. Quantized KV caches keep mlx-lm's own path. ``unpatch()``
    restores mlx-lm; calling ``patch()`` again only changes the registry."""
    import mlx_lm.models.base as base

    if not _original:
        _original.append(base.scaled_dot_product_attention)
    original = _original[0]

    def flashmetal_sdpa(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
                        sinks: Any = None) -> Any:
        if hasattr(cache, "bits"):  # a quantized cache holds (packed, scales, biases) tuples
            return original(queries, keys, values, cache, scale, mask, sinks)
        return scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks,
                                            cache=cache, registry=registry)

    flashmetal_sdpa.__wrapped__ = original  # type: ignore[attr-defined]
    flashmetal_sdpa._flashmetal_patch = True  # type: ignore[attr-defined]
    for module in _mlx_lm_modules():
        held = getattr(module, "scaled_dot_product_attention", None)
        if held is original or getattr(held, "_flashmetal_patch", False):
            module.scaled_dot_product_attention = flashmetal_sdpa


def unpatch() -> None:
    """Undoes ``patch()``: every mlx-lm module holding the patched function
    gets mlx-lm's own back."""
    if not _original:
        return
    for module in _mlx_lm_modules():
        if getattr(getattr(module, "scaled_dot_product_attention", None), "_flashmetal_patch", False):
            module.scaled_dot_product_attention = _original[0]
    _original.clear()


def is_patched() -> bool:
    """True while ``patch()`` is in force."""
    return bool(_original)
