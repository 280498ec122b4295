"""The one module that talks to the C library: it owns the cffi handles, the
error buffers, the status-to-exception mapping and the building of option
structs. Everything else in the package calls through it.

Validation lives in the library; Python checks only what cffi cannot say
(an integer argument that is not an integer, a float that float32 cannot
hold) and renames the library's op to the public function in messages.
"""
from __future__ import annotations

import functools
import math
import operator
import re
import signal
import struct
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _loader
from ._errors import STATUS_ERRORS, Error, InternalError, InvalidTypeError, InvalidValueError

if TYPE_CHECKING:
    from .registry import Registry

ERRLEN = 1024
INT32 = (-(2**31), 2**31 - 1)
_F32 = struct.Struct("f")
# "<library op>: message" — the prefix every library message starts with.
_LIB_OP = re.compile(r"^([a-z_]+): ")


def ffi() -> Any:
    """The cffi FFI of the loaded library."""
    return _loader.load()[0]


def lib() -> Any:
    """The loaded library."""
    return _loader.load()[1]


def error_for(status: int, message: str, op: str | None) -> Error:
    """The exception for a library status. With ``op`` (the public function),
    the message's library op prefix is replaced by it."""
    name = ffi().string(lib().fm_status_string(status)).decode()
    cls = STATUS_ERRORS.get(name, InternalError)
    m = _LIB_OP.match(message)
    lib_op, rest = (m.group(1), message[m.end():]) if m else ("", message)
    return cls(op or lib_op, rest, status)


def check(status: int, err: Any, op: str | None) -> None:
    """Raises the exception of a non-OK status, with the message in ``err``."""
    if status == lib().FM_OK:
        return
    message = ffi().string(err).decode(errors="replace")
    if status == lib().FM_ERROR_INTERRUPTED:
        # A SIGINT cut the call short (outputs unspecified). Python's own
        # handler normally raised KeyboardInterrupt as the call returned; a
        # handler that does not raise still must not see a finished call.
        raise KeyboardInterrupt(message)
    raise error_for(status, message, op)


@functools.cache
def _entry(fn_name: str) -> Any:
    return getattr(lib(), fn_name)


@functools.cache
def ctype(name: str) -> Any:
    """The cffi type of a C type name, parsed once."""
    return ffi().typeof(name)


def call(reg: "Registry", fn_name: str, *args: Any, op: str | None = None, keep: tuple = ()) -> None:
    """Calls ``fn_name(handle, *args, err, errlen)`` on a registry.

    ``keep``: the arrays the call reads or writes. Inside a batch scope the
    registry holds them until the scope ends (a deferring backend reads them
    only then); outside one nothing is kept.
    """
    handle = reg._live_handle(op or fn_name.removeprefix("fm_"))
    err = ffi().new(ctype("char[]"), ERRLEN)
    status = _entry(fn_name)(handle, *args, err, ERRLEN)
    while status and status == lib().FM_ERROR_INTERRUPTED and not _sigint_raises():
        # The application's SIGINT handler does not raise: the call was cut
        # short for nothing, so it runs again (its outputs overlap none of
        # its inputs, so a second run gives the same result).
        status = _entry(fn_name)(handle, *args, err, ERRLEN)
    if keep:
        reg._keep_for_batch(keep)
    if status:
        check(status, err, op)


def _sigint_raises() -> bool:
    """Whether Python raises KeyboardInterrupt for a SIGINT in this thread."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


def set_interrupt(enabled: bool) -> bool:
    """Whether a SIGINT may cut a long flashmetal call short (with
    KeyboardInterrupt). Only calls of the main thread, where Python raises
    KeyboardInterrupt, are ever cut short; ``set_interrupt(False)`` (or
    FLASHMETAL_INTERRUPT=0 in the environment) lets every call run to
    completion. Returns the previous setting."""
    if not isinstance(enabled, (bool, np.bool_)):
        raise InvalidTypeError("set_interrupt", f"enabled must be a bool, got {type(enabled).__name__}")
    return bool(lib().fm_set_interrupt(1 if enabled else 0))


def call_static(fn_name: str, *args: Any, op: str | None = None) -> None:
    """Calls ``fn_name(*args, err, errlen)``, an entry point without a registry."""
    err = ffi().new("char[]", ERRLEN)
    check(getattr(lib(), fn_name)(*args, err, ERRLEN), err, op)


def index_arg(op: str, name: str, value: Any, lo: int = INT32[0], hi: int = INT32[1]) -> int:
    """An integer argument (``operator.index``: 7.9 is an error, not 7) in [lo, hi]."""
    if isinstance(value, (bool, np.bool_)):  # operator.index takes True as 1: `window=True` is a mistake, not 1
        raise InvalidTypeError(op, f"{name} must be an integer, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidTypeError(op, f"{name} must be an integer, got {value!r}") from None
    if not lo <= v <= hi:
        if INT32[0] <= v <= INT32[1] and lo in (0, 1):
            raise InvalidValueError(op, f"{name} must be {'> 0' if lo else '>= 0'}, got {v}")
        bits = "int32" if (lo, hi) == INT32 or hi == INT32[1] else "int64"
        raise InvalidValueError(op, f"{name} ({v}) is out of the {bits} range")
    return v


def float32_arg(op: str, name: str, value: Any) -> float:
    """A float argument as float32 holds it: a finite value that rounds to 0
    or to inf in float32 is an error, not a silent 0 or overflow; inf and
    NaN pass to the library, which validates the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidTypeError(op, f"{name} must be a real number, got {value!r}")
    f = float(value)
    if not math.isfinite(f):
        return f  # the library says what it accepts
    try:  # struct rounds as float32 does (np.errstate cost more than the rest of a small call)
        f32 = _F32.unpack(_F32.pack(f))[0]
    except OverflowError:
        f32 = math.inf
    if not math.isfinite(f32):
        raise InvalidValueError(op, f"{name} ({value!r}) overflows float32")
    if f != 0 and f32 == 0:
        raise InvalidValueError(op, f"{name} ({value!r}) rounds to 0 in float32")
    return f32


def scale_arg(op: str, scale: Any, head_dim: int) -> float:
    """The scale field of an options struct; None is the default 1/sqrt(D)."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return float32_arg(op, "scale", scale)


def options(type_name: str, **fields: Any) -> Any:
    """A new ``type_name *`` with the given fields set."""
    return ffi().new(ctype(type_name + " *"), fields)


@functools.cache
def constant(name: str) -> int:
    """An integer constant of flashmetal.h (e.g. "FM_LAYOUT_BHLD")."""
    return getattr(lib(), name)


def head_dims(op: str) -> tuple[int, ...]:
    """The head dims with a kernel for "flash_attn_prefill" or "flash_attn_vec",
    from the library's capability tables."""
    if not isinstance(op, str):
        raise InvalidTypeError("supported_head_dims", f"op must be a str, got {type(op).__name__}")
    return _head_dims(op)


@functools.cache
def _head_dims(op: str) -> tuple[int, ...]:
    f = ffi()
    count = f.new("size_t *")
    out = f.new("int32_t[]", 64)
    call_static("fm_supported_head_dims", op.encode(), out, 64, count, op="supported_head_dims")
    return tuple(int(out[i]) for i in range(min(int(count[0]), 64)))


@functools.cache
def max_head_dim(op: str) -> int:
    """The largest head dim of "flash_attn_prefill", "flash_attn_vec" or
    "sdpa" (any head dim up to it), from the library's capability tables."""
    out = ffi().new("int32_t *")
    call_static("fm_max_head_dim", op.encode(), out, op="max_head_dim")
    return int(out[0])


def abi_version() -> int:
    """The library's C ABI version (checked against the header at load)."""
    return int(lib().fm_abi_version())
