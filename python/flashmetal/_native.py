"""The one module that talks to the C library: it owns the cffi handles, the
error buffers, the status-to-exception mapping and the building of option
structs. Everything else in the package calls through it.

Validation lives in the library; Python checks only what cffi cannot say
(an integer argument that is not an integer, a float that float32 cannot
hold). Every call names its public function in FMError.public_op, and the
library's errors come back as fields (status, op, argument, message): no
message is parsed.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
import signal
import struct
import threading
from typing import TYPE_CHECKING, Any
from collections.abc import Iterator

import numpy as np

from . import _loader
from ._errors import STATUS_ERRORS, Error, InternalError, InvalidTypeError, InvalidValueError

if TYPE_CHECKING:
    from .registry import Registry

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
_F32 = struct.Struct("f")


# The public function the running call was made through, when one public
# function runs another (scaled_dot_product_attention runs flash_attn_prefill,
# flash_attn_decode or sdpa): every error names the outer one.
_PUBLIC_OP: contextvars.ContextVar[str | None] = contextvars.ContextVar("flashmetal_public_op", default=None)


@contextlib.contextmanager
def running(op: str) -> Iterator[None]:
    """Within it, every public function's errors name ``op``."""
    token = _PUBLIC_OP.set(op)
    try:
        yield
    finally:
        _PUBLIC_OP.reset(token)


def public_op(own: str) -> str:
    """The name a public function's errors carry: ``own``, or the public
    function running it (``running``)."""
    return _PUBLIC_OP.get() or own


def ffi() -> Any:
    """The cffi FFI of the loaded library."""
    return _loader.load()[0]


def lib() -> Any:
    """The loaded library."""
    return _loader.load()[1]


def error_for(status: int, op: str, message: str, argument: str = "") -> Error:
    """The exception of a library status, from the error's fields."""
    name = ffi().string(lib().fm_status_string(status)).decode()
    cls = STATUS_ERRORS.get(name, InternalError)
    return cls(op, message, status, argument or None)


@functools.cache
def _op_name(op: str) -> Any:
    """``op`` as a C string that lives as long as the process (FMError.public_op)."""
    return ffi().new("char[]", op.encode())


def new_error(op: str | None) -> Any:
    """A new ``FMError *`` naming the public function ``op`` (None: the
    library names its entry point's own op)."""
    err = ffi().new(ctype("FMError *"))
    if op:
        err.public_op = _op_name(op)
    return err


def check(status: int, err: Any) -> None:
    """Raises the exception of a non-OK status, built from the fields of ``err``."""
    if status == lib().FM_OK:
        return
    f = ffi()
    message = f.string(err.message).decode(errors="replace")
    if status == lib().FM_ERROR_INTERRUPTED:
        # A SIGINT cut the call short (outputs unspecified). Python's own
        # handler normally raised KeyboardInterrupt as the call returned; a
        # handler that does not raise still must not see a finished call.
        raise KeyboardInterrupt(message)
    raise error_for(status, f.string(err.op).decode(errors="replace"), message,
                    f.string(err.argument).decode(errors="replace"))


@functools.cache
def _entry(fn_name: str) -> Any:
    return getattr(lib(), fn_name)


@functools.cache
def ctype(name: str) -> Any:
    """The cffi type of a C type name, parsed once."""
    return ffi().typeof(name)


def call(reg: Registry, fn_name: str, *args: Any, op: str | None = None, keep: tuple[Any, ...] = ()) -> None:
    """Calls ``fn_name(handle, *args, err)`` on a registry; errors name ``op``,
    the public function (None: the entry point's own op).

    ``keep``: the arrays the call reads or writes. Inside a batch scope the
    registry holds them until the scope ends (a deferring backend reads them
    only then); outside one nothing is kept.
    """
    handle = reg._live_handle(op or fn_name.removeprefix("fm_"))
    err = new_error(op)
    status = _entry(fn_name)(handle, *args, err)
    while status and status == lib().FM_ERROR_INTERRUPTED and not _sigint_raises():
        # The application's SIGINT handler does not raise: the call was cut
        # short for nothing, so it runs again (its outputs overlap none of
        # its inputs, so a second run gives the same result).
        status = _entry(fn_name)(handle, *args, err)
    if keep:
        reg._keep_for_batch(keep)
    if status:
        check(status, err)


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
    """Calls ``fn_name(*args, err)``, an entry point without a registry."""
    err = new_error(op)
    check(getattr(lib(), fn_name)(*args, err), err)


def index_arg(op: str, name: str, value: Any, lo: int = INT32[0], hi: int = INT32[1]) -> int:
    """An integer argument (``operator.index``: 7.9 is an error, not 7) in [lo, hi]."""
    if isinstance(value, (bool, np.bool_)):  # operator.index takes True as 1: `window=True` is a mistake, not 1
        raise InvalidTypeError(op, f"{name} must be an integer, got {value!r}", argument=name)
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidTypeError(op, f"{name} must be an integer, got {value!r}", argument=name) from None
    if not lo <= v <= hi:
        if INT32[0] <= v <= INT32[1] and lo in (0, 1):
            raise InvalidValueError(op, f"{name} must be {'> 0' if lo else '>= 0'}, got {v}", argument=name)
        bits = "int32" if (lo, hi) == INT32 or hi == INT32[1] else "int64"
        raise InvalidValueError(op, f"{name} ({v}) is out of the {bits} range", argument=name)
    return v


def float32_arg(op: str, name: str, value: Any) -> float:
    """A float argument as float32 holds it: a finite value that rounds to 0
    or to inf in float32 is an error, not a silent 0 or overflow; inf and
    NaN pass to the library, which validates the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidTypeError(op, f"{name} must be a real number, got {value!r}", argument=name)
    f = float(value)
    if not math.isfinite(f):
        return f  # the library says what it accepts
    try:  # struct rounds as float32 does (np.errstate cost more than the rest of a small call)
        f32 = _F32.unpack(_F32.pack(f))[0]
    except OverflowError:
        f32 = math.inf
    if not math.isfinite(f32):
        raise InvalidValueError(op, f"{name} ({value!r}) overflows float32", argument=name)
    if f != 0 and f32 == 0:
        raise InvalidValueError(op, f"{name} ({value!r}) rounds to 0 in float32", argument=name)
    return float(f32)


def default_scale(head_dim: int) -> float:
    """The score scale every op defaults to: 1/sqrt(D) (1 for a D the
    library will reject anyway)."""
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def scale_arg(op: str, scale: Any, head_dim: int, name: str = "scale") -> float:
    """The scale field of an options struct; None is ``default_scale``."""
    if scale is None:
        return default_scale(head_dim)
    return float32_arg(op, name, scale)


def options(type_name: str, **fields: Any) -> Any:
    """A new ``type_name *`` with the given fields set."""
    return ffi().new(ctype(type_name + " *"), fields)


@functools.cache
def constant(name: str) -> int:
    """An integer constant of flashmetal.h (e.g. "FM_LAYOUT_BHLD")."""
    return int(getattr(lib(), name))


def head_dims(op: str) -> tuple[int, ...]:
    """The natively tiled head dims of "flash_attn_prefill",
    "flash_attn_prefill_f32" (its float32 I/O) or "flash_attn_decode" (alias
    "flash_attn_vec"), from the library's capability tables. Any head dim
    from 1 to 256 runs too (on the kernel of the next tiled dim up); above
    256 only these. "kv_codec" gives the head dims ``KVCodec`` encodes
    (those only)."""
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
def runs_head_dims(op: str, d: int, dv: int) -> bool:
    """Whether `op`'s kernels ("flash_attn_prefill", "flash_attn_prefill_f32",
    "flash_attn_decode" or "flash_attn_vec") run q/k of head dim `d` with v of
    `dv`, by the library's own rules (fm_runs_head_dims)."""
    if not (INT32[0] <= d <= INT32[1] and INT32[0] <= dv <= INT32[1]):
        return False
    out = ffi().new("int32_t *")
    call_static("fm_runs_head_dims", op.encode(), d, dv, out, op="runs_head_dims")
    return bool(out[0])


@functools.cache
def max_head_dim(op: str) -> int:
    """The largest head dim of "flash_attn_prefill", "flash_attn_decode" or
    "sdpa" (any head dim up to it), from the library's capability tables."""
    out = ffi().new("int32_t *")
    call_static("fm_max_head_dim", op.encode(), out, op="max_head_dim")
    return int(out[0])


def abi_version() -> int:
    """The library's C ABI version (checked against the header at load)."""
    return int(lib().fm_abi_version())
