"""Helpers for tests that drive the C ABI directly."""
from __future__ import annotations

from typing import Any

from flashmetal import _native


def err_text(err: Any) -> bytes:
    """An FMError as "op: message" (as the Python exceptions print it)."""
    ffi = _native.ffi()
    return ffi.string(err.op) + b": " + ffi.string(err.message)
