"""numpy arrays <-> borrowed FMTensor descriptors, without copies."""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from . import _loader
from ._errors import InvalidTypeError, InvalidValueError
from ._hints import unsupported_dtype
from ._interop import is_torch_tensor, refuse_grad_write, to_numpy

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
BOOL = np.dtype(np.bool_)
U8 = np.dtype(np.uint8)
I32 = np.dtype(np.int32)

# The FMDType constant of flashmetal.h for each supported dtype.
DTYPE_NAMES = {F32: "FM_DTYPE_F32", F16: "FM_DTYPE_F16", BF16: "FM_DTYPE_BF16", BOOL: "FM_DTYPE_BOOL",
               U8: "FM_DTYPE_U8"}
# Index tensors (cu_seqlens, seqlens, block_table) are int32; they enter
# through as_index only, so the data inputs' message above stays as it is.
_CODE_NAMES = {**DTYPE_NAMES, I32: "FM_DTYPE_I32"}
MAX_RANK = 8


def as_input(x: Any, op: str, name: str) -> np.ndarray:
    """An input as a C-contiguous array: passed as is when it already is one
    (numpy arrays, torch CPU tensors and other DLPack / buffer-protocol
    objects are viewed, not copied), otherwise copied once (the caller's
    array is never modified)."""
    a = to_numpy(x, op, name)
    if a.dtype not in DTYPE_NAMES:
        raise unsupported_dtype(op, name, a.dtype)
    if a.ndim > MAX_RANK:
        raise InvalidValueError(op, f"{name} has rank {a.ndim}; at most {MAX_RANK} is supported")
    return np.ascontiguousarray(a)


def as_index(x: Any, op: str, name: str) -> np.ndarray:
    """An integer index input (an int, a sequence of ints, an integer array
    or tensor) as a C-contiguous int32 array: viewed when it already is one,
    else converted once (the caller's array is never modified). Values outside
    int32 are a ValueError, non-integer dtypes a TypeError."""
    a = np.asarray(x) if isinstance(x, (int, np.integer, list, tuple)) else to_numpy(x, op, name)
    if a.dtype == BOOL or a.dtype.kind not in "iu":
        raise InvalidTypeError(op, f"{name} must hold integers (int32), got dtype {a.dtype}")
    if a.dtype != I32 and a.size:
        lo, hi = int(a.min()), int(a.max())
        if lo < -(2**31) or hi > 2**31 - 1:
            bad = lo if lo < -(2**31) else hi
            raise InvalidValueError(op, f"{name} holds {bad}, outside the int32 range")
    if a.ndim > MAX_RANK:
        raise InvalidValueError(op, f"{name} has rank {a.ndim}; at most {MAX_RANK} is supported")
    # ascontiguousarray would make a scalar [1]; a scalar stays a scalar.
    return np.ascontiguousarray(a, dtype=I32) if a.ndim else np.asarray(a, dtype=I32)


def empty_batch(a: np.ndarray, rank: int, axes: tuple[int, ...]) -> bool:
    """Whether `a` (of `rank`) has a batch, head or query axis of 0: the
    result is then empty and no kernel runs (as torch and flash-attn)."""
    return a.ndim == rank and any(a.shape[i] == 0 for i in axes)


def out_array(out: Any, op: str) -> np.ndarray:
    """A caller-provided output (a numpy array or a torch CPU tensor) as the
    numpy view of its memory the library writes in place: what the library
    cannot see from its descriptor (the object's type, C-contiguity,
    writeability, a dtype it has a code for). The library checks the rest
    against the call: the shape, the dtype the op writes, and that no input
    shares its bytes."""
    if is_torch_tensor(out):
        refuse_grad_write(out, op, "out")
        out = to_numpy(out, op, "out")
    if not isinstance(out, np.ndarray):
        raise InvalidTypeError(op, f"out must be a numpy.ndarray or a torch CPU tensor, got {type(out).__name__}",
                               argument="out")
    if out.dtype not in DTYPE_NAMES:
        raise InvalidTypeError(op, f"out dtype {out.dtype} is not supported: outputs are float32, float16 or "
                               "bfloat16", argument="out")
    if not out.flags.c_contiguous:
        raise InvalidValueError(op, "out must be C-contiguous", argument="out")
    if not out.flags.writeable:
        raise InvalidValueError(op, "out is read-only", argument="out")
    return out


def check_out(out: Any, op: str, shape: tuple[int, ...], dtype: np.dtype | tuple[np.dtype, ...],
              inputs: Sequence[np.ndarray | None]) -> np.ndarray:
    """out_array plus the checks the library would make, for an output that
    Python writes or reshapes itself (a result converted or copied into it)
    or that no kernel writes (an empty result): its dtype (or one of
    several), its shape, and no overlap with `inputs`."""
    arr = out_array(out, op)
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if arr.dtype not in allowed:
        raise InvalidTypeError(op, f"out dtype {arr.dtype} must be {' or '.join(str(d) for d in allowed)}",
                               argument="out")
    if tuple(arr.shape) != tuple(shape):
        raise InvalidValueError(op, f"out shape {tuple(arr.shape)} must be {tuple(shape)}", argument="out")
    for a in inputs:
        if a is not None and np.may_share_memory(arr, a):
            raise InvalidValueError(op, "out must not overlap an input array", argument="out")
    return arr


@functools.cache
def dtype_code(dtype: np.dtype) -> int:
    """The library's FMDType code of a supported numpy dtype."""
    return int(getattr(_loader.load()[1], _CODE_NAMES[dtype]))


@functools.cache
def _tensor_type(ffi: Any) -> Any:
    return ffi.typeof("FMTensor *")


def tensor(ffi: Any, a: np.ndarray | None) -> Any:
    """A FMTensor* describing `a` (NULL for None). The caller keeps `a` alive."""
    if a is None:
        return ffi.NULL
    # One initializer (filled in C) and ffi.from_buffer for the address: the
    # per-field setattr and __array_interface__ (a dict per call) were a
    # third of a small decode's per-call cost.
    return ffi.new(_tensor_type(ffi), (_address(ffi, a), a.nbytes, dtype_code(a.dtype), a.ndim, a.shape))


def _address(ffi: Any, a: np.ndarray) -> Any:
    try:
        return ffi.from_buffer(a)
    except (TypeError, ValueError, BufferError):  # a dtype the buffer protocol cannot export
        return ffi.cast("void *", a.__array_interface__["data"][0])


def out_shape(qa: np.ndarray, va: np.ndarray) -> tuple[int, ...]:
    """The output's shape: q's with v's head dim last (flash-attn's head_dim_v;
    q's own shape when either has no dims, for the library to refuse)."""
    if qa.ndim == 0 or va.ndim == 0:
        return tuple(qa.shape)
    return tuple(qa.shape[:-1]) + (int(va.shape[-1]),)
