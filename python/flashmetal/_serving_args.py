"""Argument handling shared by the serving functions (serving.py) and, for
dropout and bool flags, the front door (attention.py): argument types checked
strictly, the features flashmetal does not implement refused by name, and the
FMAttnOptions / FMSeqTensors structs built once."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from . import _native
from ._arrays import BF16, F16, F32, tensor
from ._errors import InvalidTypeError, InvalidValueError, UnsupportedFeatureError
from ._interop import to_numpy


def flag(op: str, name: str, value: Any) -> bool:
    """A bool argument (numpy's bool too); 1 or "yes" is a TypeError."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidTypeError(op, f"{name} must be a bool, got {type(value).__name__}", argument=name)
    return bool(value)


def no_dropout(op: str, dropout_p: Any) -> None:
    """flashmetal is inference-only: dropout_p must be 0."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise InvalidTypeError(op, f"dropout_p must be a float, got {type(dropout_p).__name__}", argument="dropout_p")
    if dropout_p != 0:
        raise InvalidValueError(op, f"dropout_p must be 0.0 (flashmetal is for inference; no dropout), "
                                f"got {dropout_p}", argument="dropout_p")


def training_arguments(op: str, dropout_p: Any, deterministic: Any, return_attn_probs: Any) -> bool:
    """flash_attn_func's and flash_attn_varlen_func's training-era arguments:
    no dropout, deterministic a bool (the forward always is).
    Returns return_attn_probs (whether the LSE is returned)."""
    no_dropout(op, dropout_p)
    flag(op, "deterministic", deterministic)
    return flag(op, "return_attn_probs", return_attn_probs)


def unsupported(op: str, **given: Any) -> None:
    """Refuses each feature passed with a value other than None."""
    for name, value in given.items():
        if value is not None:
            raise UnsupportedFeatureError(op, f"{name} is not supported by flashmetal (pass None)")


def window(op: str, window_size: Any) -> tuple[int, int]:
    """flash-attn's (left, right): each -1 (unbounded) or >= 0."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise InvalidTypeError(op, f"window_size must be a pair (left, right), got {window_size!r}")
    left, right = (_native.index_arg(op, f"window_size[{i}]", w) for i, w in enumerate(window_size))
    for i, w in enumerate((left, right)):
        if w < -1:
            raise InvalidValueError(op, f"window_size[{i}] must be -1 (unbounded) or >= 0, got {w}")
    return left, right


def attn_options(op: str, *, head_dim: int, softmax_scale: Any, softcap: Any, causal: Any, window_size: Any,
                 attention_chunk: Any = 0, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                 head_major: bool = False) -> Any:
    """The FMAttnOptions of a call (the library checks the ranges);
    `head_major`: torch's [B, H, L, D] q/out and [B, Hkv, cap, D] caches
    (fm_dispatch_vec_seq only)."""
    left, right = window(op, window_size)
    chunk = _native.index_arg(op, "attention_chunk", attention_chunk, 0)
    scale = _native.scale_arg(op, softmax_scale, head_dim, "softmax_scale")
    if not math.isfinite(scale):  # the library would name its own field, `scale`
        raise InvalidValueError(op, f"softmax_scale must be finite, got {softmax_scale!r}", argument="softmax_scale")
    return _native.options("FMAttnOptions", scale=scale, softcap=_native.float32_arg(op, "softcap", softcap),
                           causal=1 if flag(op, "causal", causal) else 0, window_left=left, window_right=right,
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, attention_chunk=chunk,
                           head_major=1 if head_major else 0)


def sinks_arg(op: str, sinks: Any) -> np.ndarray | None:
    """Per-head sink logits as float32 (converted once: [H] is tiny)."""
    if sinks is None:
        return None
    a = to_numpy(sinks, op, "sinks")
    if a.dtype not in (F32, F16, BF16) and a.dtype.kind != "f":
        raise InvalidTypeError(op, f"sinks must be floating point (float32 [H]), got dtype {a.dtype}",
                               argument="sinks")
    return np.ascontiguousarray(a, dtype=F32)


def seq_tensors(ffi: Any, **arrays: np.ndarray | None) -> tuple[Any, list[Any]]:
    """An FMSeqTensors* whose fields point at the given arrays (NULL for None),
    and the FMTensor descriptors it points at: keep both until the call returns
    (cffi frees an owned descriptor with its last Python reference)."""
    seq = ffi.new("FMSeqTensors *")
    descriptors = []
    for name, a in arrays.items():
        t = tensor(ffi, a)
        setattr(seq, name, t)
        descriptors.append(t)
    return seq, descriptors


def alibi_arg(op: str, alibi_slopes: Any, batch: int, heads: int) -> np.ndarray | None:
    """flash-attn's ALiBi slopes, float32 ``[H]`` or ``[B, H]``, as the
    float32 ``[B, H]`` the kernels read (``[H]`` repeated per sequence: B*H
    floats, no bias matrix). Each must be finite."""
    if alibi_slopes is None:
        return None
    a = to_numpy(alibi_slopes, op, "alibi_slopes")
    if a.dtype != F32:
        raise InvalidTypeError(op, f"alibi_slopes must be float32, got dtype {a.dtype}", argument="alibi_slopes")
    if a.shape not in ((heads,), (batch, heads)):
        raise InvalidValueError(op, f"alibi_slopes must have shape [{heads}] or [{batch}, {heads}] "
                                f"([num_heads] or [batch_size, num_heads]), got {list(a.shape)}",
                                argument="alibi_slopes")
    bad = np.flatnonzero(~np.isfinite(a.reshape(-1)))
    if bad.size:
        index = np.unravel_index(int(bad[0]), a.shape)
        where = ", ".join(str(int(i)) for i in index)
        raise InvalidValueError(op, f"alibi_slopes[{where}] must be finite, got {a[index]}", argument="alibi_slopes")
    return np.ascontiguousarray(np.broadcast_to(a, (batch, heads)), dtype=F32)
