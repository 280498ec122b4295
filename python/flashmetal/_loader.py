"""Loads libflashmetal with cffi in ABI mode and checks it against its header.

The declarations come from the header the package ships next to the library
(the text between the FM_CDEF markers, preprocessor lines dropped), so the C
ABI is defined once. ``FLASHMETAL_LIB`` / ``FLASHMETAL_HEADER`` override the
two paths. The library's fm_abi_version() must equal the header's
FM_ABI_VERSION, or the import fails naming both.
"""
from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

import cffi

_HERE = Path(__file__).resolve().parent
_LIBNAME = "libflashmetal.dylib" if sys.platform == "darwin" else "libflashmetal.so"
_lock = threading.Lock()
_state: dict[str, object] = {}


def header_path() -> Path:
    """The header that describes the loaded library: the one shipped with it."""
    env = os.environ.get("FLASHMETAL_HEADER")
    path = Path(env) if env else library_path().parent / "flashmetal.h"
    if not path.is_file():
        raise ImportError(f"flashmetal: header not found at {path} (run `make` or set FLASHMETAL_HEADER)")
    return path


def _cdef_text(header: Path) -> str:
    text = header.read_text()
    try:
        body = text.split("/* FM_CDEF_BEGIN */", 1)[1].split("/* FM_CDEF_END */", 1)[0]
    except IndexError as e:
        raise ImportError(f"flashmetal: {header} has no FM_CDEF markers") from e
    return "\n".join(line for line in body.splitlines() if not line.lstrip().startswith("#"))


def header_version(header: Path | None = None) -> str:
    """FM_VERSION of the header: the one version of the library and package."""
    text = (header or header_path()).read_text()
    m = re.search(r'#define\s+FM_VERSION\s+"([^"]+)"', text)
    if not m:
        raise ImportError("flashmetal: the header defines no FM_VERSION")
    return m.group(1)


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
    """Returns (ffi, lib), loading and checking them once per process."""
    if "lib" in _state:  # loaded: no lock on the per-call path
        return _state["ffi"], _state["lib"]
    with _lock:
        if "lib" not in _state:
            path, header = library_path(), header_path()
            ffi = cffi.FFI()
            ffi.cdef(_cdef_text(header))
            lib = ffi.dlopen(str(path))
            try:
                found = lib.fm_abi_version()
            except AttributeError as e:
                raise ImportError(f"flashmetal: {path} has no fm_abi_version(): it predates {header}") from e
            if found != lib.FM_ABI_VERSION:
                raise ImportError(f"flashmetal: {path} implements ABI version {found} but {header} "
                                  f"declares {lib.FM_ABI_VERSION}: rebuild (`make`) so they match")
            _state["ffi"], _state["lib"] = ffi, lib
        return _state["ffi"], _state["lib"]
