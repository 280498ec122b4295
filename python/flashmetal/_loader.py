"""Loads libflashmetal with cffi in ABI mode.

The declarations come from the library's own header (the text between the
FM_CDEF markers, preprocessor lines dropped), so the C ABI is defined once.
The library is looked up in $FLASHMETAL_LIB, then next to this package.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import cffi

_HERE = Path(__file__).resolve().parent
_LIBNAME = "libflashmetal.dylib" if sys.platform == "darwin" else "libflashmetal.so"
_lock = threading.Lock()
_state: dict[str, object] = {}


def _header_path(lib_path: Path) -> Path:
    env = os.environ.get("FLASHMETAL_HEADER")
    candidates = [Path(env)] if env else []
    candidates += [
        lib_path.parent / "flashmetal.h",
        _HERE / "flashmetal.h",
        _HERE.parent.parent / "Sources" / "CFlashMetal" / "include" / "flashmetal.h",
    ]
    for c in candidates:
        if c.is_file():
            return c
    raise ImportError("flashmetal: cannot find flashmetal.h (set FLASHMETAL_HEADER or run `make`)")


def _cdef_text(header: Path) -> str:
    text = header.read_text()
    try:
        body = text.split("/* FM_CDEF_BEGIN */", 1)[1].split("/* FM_CDEF_END */", 1)[0]
    except IndexError as e:
        raise ImportError(f"flashmetal: {header} has no FM_CDEF markers") from e
    return "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))


def library_path() -> Path:
    """The path of the shared library that will be (or was) loaded."""
    env = os.environ.get("FLASHMETAL_LIB")
    path = Path(env) if env else _HERE / _LIBNAME
    if not path.is_file():
        raise ImportError(f"flashmetal: shared library not found at {path} (run `make` or set FLASHMETAL_LIB)")
    return path


def _new_lock_in_child() -> None:
    # A fork while another thread held the lock would leave it held forever
    # in the child (that thread does not exist there).
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def load() -> tuple[cffi.FFI, object]:
    """Returns (ffi, lib), loading them once per process."""
    if "lib" in _state:  # loaded: no lock on the per-call path
        return _state["ffi"], _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            path = library_path()
            ffi = cffi.FFI()
            ffi.cdef(_cdef_text(_header_path(path)))
            _state["ffi"] = ffi
            _state["lib"] = ffi.dlopen(str(path))
        return _state["ffi"], _state["lib"]  # type: ignore[return-value]
