"""flash-attn 2's packed entry points: ``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func``, ``flash_attn_varlen_qkvpacked_func`` and
``flash_attn_varlen_kvpacked_func``, with flash-attn's argument names, order,
defaults and return values.

Each takes q, k and v stacked along one axis of a single tensor, views them
apart and runs ``flash_attn_func`` / ``flash_attn_varlen_func``. The library's
tensors are dense (a data pointer and a shape, no strides), so each view that
is not contiguous in the caller's layout (all of them, for an interleaved
``[..., 3, H, D]`` tensor) is copied once into its own array; the caller's
tensor is never modified. Errors name the packed function, and their
argument field the packed argument (``qkv[:, :, 1]`` for the keys of a
qkv-packed batch). Keyword-only, as on
the unpacked functions: ``sinks``, ``attention_chunk`` (flash-attn 3's) and
``registry``. A packed tensor gives k and v one head dim: a value head dim of
its own (flash-attn's head_dim_v) needs the unpacked functions.
"""
from __future__ import annotations

import contextlib
from typing import Any
from collections.abc import Iterator

import numpy as np
from numpy.typing import ArrayLike

from . import _native
from ._errors import Error, InvalidValueError
from ._interop import to_numpy, wrapper_like
from .registry import RegistryLike
from .serving import flash_attn_func, flash_attn_varlen_func

_QKV = "flash_attn_qkvpacked_func"
_KV = "flash_attn_kvpacked_func"
_VARLEN_QKV = "flash_attn_varlen_qkvpacked_func"
_VARLEN_KV = "flash_attn_varlen_kvpacked_func"


def flash_attn_qkvpacked_func(
    qkv: ArrayLike,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: ArrayLike | None = None,
    attention_chunk: int = 0,
    registry: RegistryLike = None,
) -> Any:
    """``flash_attn_func`` on ``qkv [B, L, 3, H, D]``: q, k and v are
    ``qkv[:, :, 0]``, ``qkv[:, :, 1]`` and ``qkv[:, :, 2]`` (H heads each).

    Returns out ``[B, L, H, D]`` like qkv, or ``(out, softmax_lse [B, H, L]
    float32, S_dmask)`` with return_attn_probs (S_dmask empty, as flash-attn's
    without dropout); the caller's array type. The other arguments as
    ``flash_attn_func``.
    """
    a = _packed(qkv, _QKV, "qkv", axis=2, count=3, layout="[B, L, 3, H, D]")
    names = {"q": "qkv[:, :, 0]", "k": "qkv[:, :, 1]", "v": "qkv[:, :, 2]"}
    with _as_packed(_QKV, names):
        result = flash_attn_func(a[:, :, 0], a[:, :, 1], a[:, :, 2], dropout_p, softmax_scale, causal,
                                 window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                 sinks=sinks, attention_chunk=attention_chunk, registry=registry)
    return _like(qkv, result)


def flash_attn_kvpacked_func(
    q: ArrayLike,
    kv: ArrayLike,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: ArrayLike | None = None,
    attention_chunk: int = 0,
    registry: RegistryLike = None,
) -> Any:
    """``flash_attn_func`` on q ``[B, seqlen_q, H, D]`` and ``kv [B,
    seqlen_k, 2, Hkv, D]``: k and v are ``kv[:, :, 0]`` and ``kv[:, :, 1]``
    (H a multiple of Hkv: GQA).

    Returns as ``flash_attn_func``, in q's array type.
    """
    a = _packed(kv, _KV, "kv", axis=2, count=2, layout="[B, seqlen_k, 2, Hkv, D]")
    with _as_packed(_KV, {"k": "kv[:, :, 0]", "v": "kv[:, :, 1]"}):
        return flash_attn_func(q, a[:, :, 0], a[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                               softcap, alibi_slopes, deterministic, return_attn_probs, sinks=sinks,
                               attention_chunk=attention_chunk, registry=registry)


def flash_attn_varlen_qkvpacked_func(
    qkv: ArrayLike,
    cu_seqlens: ArrayLike,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: ArrayLike | None = None,
    attention_chunk: int = 0,
    registry: RegistryLike = None,
) -> Any:
    """``flash_attn_varlen_func`` on ``qkv [total, 3, H, D]``: q, k and v are
    ``qkv[:, 0]``, ``qkv[:, 1]`` and ``qkv[:, 2]``; sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]`` of each (int32 ``[B+1]``), at most
    max_seqlen long.

    Returns out ``[total, H, D]`` like qkv, or ``(out, softmax_lse [H, total]
    float32, S_dmask)`` with return_attn_probs; the caller's array type.
    """
    a = _packed(qkv, _VARLEN_QKV, "qkv", axis=1, count=3, layout="[total, 3, H, D]")
    names = {"q": "qkv[:, 0]", "k": "qkv[:, 1]", "v": "qkv[:, 2]", "cu_seqlens_q": "cu_seqlens",
             "cu_seqlens_k": "cu_seqlens", "max_seqlen_q": "max_seqlen", "max_seqlen_k": "max_seqlen"}
    with _as_packed(_VARLEN_QKV, names):
        result = flash_attn_varlen_func(a[:, 0], a[:, 1], a[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        deterministic, return_attn_probs, sinks=sinks,
                                        attention_chunk=attention_chunk, registry=registry)
    return _like(qkv, result)


def flash_attn_varlen_kvpacked_func(
    q: ArrayLike,
    kv: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: ArrayLike | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    sinks: ArrayLike | None = None,
    attention_chunk: int = 0,
    registry: RegistryLike = None,
) -> Any:
    """``flash_attn_varlen_func`` on q ``[total_q, H, D]`` and ``kv [total_k,
    2, Hkv, D]``: k and v are ``kv[:, 0]`` and ``kv[:, 1]``.

    Returns as ``flash_attn_varlen_func``, in q's array type.
    """
    a = _packed(kv, _VARLEN_KV, "kv", axis=1, count=2, layout="[total_k, 2, Hkv, D]")
    with _as_packed(_VARLEN_KV, {"k": "kv[:, 0]", "v": "kv[:, 1]"}):
        return flash_attn_varlen_func(q, a[:, 0], a[:, 1], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                      deterministic, return_attn_probs, sinks=sinks,
                                      attention_chunk=attention_chunk, registry=registry)


def _packed(x: Any, op: str, name: str, *, axis: int, count: int, layout: str) -> np.ndarray:
    """A numpy view of a packed tensor whose dim `axis` holds `count` tensors."""
    a = to_numpy(x, op, name)
    rank = axis + 3
    # k and v share the packed tensor's head dim: one of its own for v needs them apart.
    apart = " (k and v share its head dim D: a v of another head dim needs q, k and v apart, unpacked)"
    if a.ndim != rank:
        raise InvalidValueError(op, f"{name} must be {layout} (rank {rank}), got shape {tuple(a.shape)}{apart}")
    if a.shape[axis] != count:
        raise InvalidValueError(op, f"{name} must be {layout}: dim {axis} must be {count}, got {a.shape[axis]} "
                                f"(shape {tuple(a.shape)}){apart}")
    return a


@contextlib.contextmanager
def _as_packed(op: str, names: dict[str, str]) -> Iterator[None]:
    """Runs the unpacked function as `op`: its errors name `op` (the library
    and Python alike, through the public-op context), their argument field
    names the packed argument (``qkv[:, :, 1]`` for k), and the message,
    written with the unpacked function's names, says what they are here."""
    try:
        with _native.running(op):
            yield
    except Error as e:
        if not e.argument or e.argument not in names:
            raise
        message = f"{e.message} ({e.argument} is {names[e.argument]})"
        raise type(e)(e.op, message, e.status, names[e.argument]) from e


def _like(x: Any, result: Any) -> Any:
    """The unpacked function's result (numpy: it was given numpy views) in
    x's array type."""
    wrap = wrapper_like(x)
    return tuple(wrap(r) for r in result) if isinstance(result, tuple) else wrap(result)
