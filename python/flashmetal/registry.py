"""Registry: one backend and its pipeline cache, shared by threads."""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from . import _loader
from ._errors import raise_for_status

_ERRLEN = 1024


class Registry:
    """A handle on a backend ("auto", "cpu", "sim" or "metal").

    "auto" is metal on macOS and cpu elsewhere; the FLASHMETAL_BACKEND
    environment variable overrides it. Calls release the GIL while kernels run.
    """

    def __init__(self, backend: str = "auto") -> None:
        if not isinstance(backend, str):
            raise TypeError(f"create_registry: backend must be a str, got {type(backend).__name__}")
        self._ffi, self._lib = _loader.load()
        handle = self._ffi.new("FMRegistry **")
        err = self._ffi.new("char[]", _ERRLEN)
        status = self._lib.fm_create_registry(backend.encode(), handle, err, _ERRLEN)
        raise_for_status(status, self._ffi.string(err).decode(errors="replace"))
        self._handle = handle[0]
        name = self._ffi.new("char[]", 64)
        raise_for_status(self._lib.fm_registry_backend(self._handle, name, 64), "registry_backend failed")
        self.backend: str = self._ffi.string(name).decode()

    def close(self) -> None:
        """Frees the registry; further calls raise ValueError."""
        h = getattr(self, "_handle", None)
        if h is not None:
            self._handle = None
            self._lib.fm_destroy_registry(h)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Registry(backend={self.backend!r})"

    def _call(self, fn_name: str, *args: Any) -> None:
        """Calls an fm_* entry point that ends in (err, errlen)."""
        op = fn_name.removeprefix("fm_")
        if self._handle is None:
            raise ValueError(f"{op}: registry is closed")
        err = self._ffi.new("char[]", _ERRLEN)
        status = getattr(self._lib, fn_name)(self._handle, *args, err, _ERRLEN)
        raise_for_status(status, self._ffi.string(err).decode(errors="replace"))

    @contextlib.contextmanager
    def batch(self) -> Iterator["Registry"]:
        """A batch scope: the backend may defer work until the scope closes
        (Metal: one command buffer). Read outputs after the ``with`` block."""
        self._call("fm_begin_batch")
        try:
            yield self
        finally:
            self._call("fm_end_batch")

    def dispatch_prefill(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        """Same as flashmetal.flash_attn_prefill on this registry."""
        from .prefill import flash_attn_prefill
        return flash_attn_prefill(q, k, v, registry=self, **kwargs)


_defaults: dict[str, Registry] = {}
_defaults_lock = threading.Lock()


def _new_defaults_lock_in_child() -> None:
    # A lock held by another thread at fork() stays held in the child.
    global _defaults_lock
    _defaults_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_defaults_lock_in_child)


def default_registry(backend: str = "auto") -> Registry:
    """A process-wide registry per backend name, created on first use."""
    with _defaults_lock:
        r = _defaults.get(backend)
        if r is None:
            r = _defaults[backend] = Registry(backend)
        return r
