"""Registry: one backend and its pipeline cache, shared by threads."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _native
from ._errors import InvalidTypeError, InvalidValueError


@functools.cache
def backend_names() -> tuple[str, ...]:
    """The backends the loaded library can create ("auto" aside), as the
    library lists them; whether one opens also depends on the machine."""
    buf = _native.ffi().new("char[]", 256)
    _native.lib().fm_backend_names(buf, 256)
    return tuple(n for n in _native.ffi().string(buf).decode().split(",") if n)


# The metal-sim runtime's counters, in the order of FMMetalSimCounter.
METAL_SIM_COUNTERS = ("command_buffers", "commits", "encoders", "dispatches", "barriers", "bytes_wrapped",
                      "bytes_copied_in", "bytes_copied_out", "violations", "live_command_buffers",
                      "no_copy_refused", "wraps", "copy_buffers")


class Registry:
    """A handle on a backend ("auto", "cpu", "sim", "metal", or on Linux
    "metal-sim": the Metal backend on a Metal runtime whose GPU is the
    simulator).

    "auto" is metal on macOS and cpu elsewhere; the FLASHMETAL_BACKEND
    environment variable overrides it. Calls release the GIL while kernels run.
    """

    def __init__(self, backend: str = "auto") -> None:
        if not isinstance(backend, str):
            raise InvalidTypeError("create_registry", f"backend must be a str, got {type(backend).__name__}")
        if "\0" in backend:  # C would read only the part before it
            raise InvalidValueError("create_registry", f"backend name contains a NUL character: {backend!r}")
        ffi = _native.ffi()
        out = ffi.new("FMRegistry **")
        _native.call_static("fm_create_registry", backend.encode(), out, op="create_registry")
        self._handle: Any = out[0]
        self._batch_lock = threading.Lock()
        self._batch_depth = 0
        self._batch_keep: list[tuple[Any, ...]] = []
        name = ffi.new("char[]", 64)
        status = _native.lib().fm_registry_backend(self._handle, name, 64)
        if status != _native.lib().FM_OK:
            raise _native.error_for(status, "registry_backend", "the new registry is not live")
        self.backend: str = ffi.string(name).decode()
        # A backend that defers work to the end of a batch scope (Metal)
        # reads the call's arrays after the call returns: batch() keeps them.
        defers = ffi.new("int32_t *")
        _native.call(self, "fm_registry_defers_work", defers, op="registry_defers_work")
        self._defers_work = bool(defers[0])

    # Kept for tests and benchmarks that drive entry points directly.
    @property
    def _ffi(self) -> Any:
        return _native.ffi()

    @property
    def _lib(self) -> Any:
        return _native.lib()

    def _call(self, fn_name: str, *args: Any) -> None:
        """Calls an fm_* entry point that ends in an FMError *; errors name the library's op."""
        _native.call(self, fn_name, *args)

    def dispatch_prefill(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        """Same as ``flashmetal.flash_attn_prefill(q, k, v, registry=self, ...)``."""
        import flashmetal  # the package, loaded by now: registry.py imports no op module

        return flashmetal.flash_attn_prefill(q, k, v, registry=self, **kwargs)

    def empty(self, shape: Any, dtype: Any) -> np.ndarray:
        """A zero-filled C-contiguous array in library-owned host memory,
        aligned to and padded to 16 KiB (Apple silicon's page), freed when
        the array and every view of it are gone. For long-lived tensors such
        as a KV cache: the metal backend wraps such memory in one Metal
        buffer once, instead of wrapping (or copying) it on every call. Any
        backend accepts it as ordinary memory; ``torch.from_numpy`` shares it.
        """
        op = "empty"
        self._live_handle(op)
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise InvalidTypeError(op, f"dtype must be a numpy dtype, got {dtype!r}") from None
        dims = (shape,) if not isinstance(shape, (tuple, list)) else tuple(shape)
        dims = tuple(_native.index_arg(op, "shape", d, 0, 2**62) for d in dims)
        count = 1
        for d in dims:
            count *= d
        nbytes = count * dt.itemsize
        if nbytes > 2**62:
            raise InvalidValueError(op, f"shape {dims} of {dt} needs {nbytes} bytes, more than any allocation")
        ffi, _lib = _native.ffi(), _native.lib()
        out = ffi.new("void **")
        _native.call_static("fm_alloc_host", max(nbytes, 1), out, op=op)
        ptr = ffi.gc(out[0], _free_host)
        arr: np.ndarray = np.frombuffer(ffi.buffer(ptr, max(nbytes, 1)), dtype=np.uint8)[:nbytes].view(dt).reshape(dims)
        return arr

    def metal_counters(self) -> dict[str, int]:
        """The metal-sim runtime's counters (process-wide, since the library
        loaded): command buffers, commits, encoders, dispatches, barriers,
        bytes wrapped without a copy, bytes copied in and out, broken Metal
        rules (violations), live command buffers, refused no-copy wraps,
        buffers made over host memory without a copy (wraps) and by a copy.
        Take the difference of two readings for one call. ValueError where
        the library has no metal-sim runtime (macOS)."""
        return metal_sim_counters()

    def _live_handle(self, op: str) -> Any:
        h = self._handle
        if h is None:
            raise InvalidValueError(op, "registry is closed")
        return h

    @property
    def _work_deferred(self) -> bool:
        """Whether a call made now runs only when the outermost batch scope
        ends: inside a scope on a backend that defers work (Metal). A result
        the host would convert after the call returns is not there yet."""
        return self._defers_work and self._batch_depth > 0

    def _keep_for_batch(self, arrays: tuple[Any, ...]) -> None:
        """Holds the arrays of a call made inside a batch scope until it ends,
        on a backend that reads them only then; elsewhere nothing is kept
        (a batch must not hoard memory it does not need)."""
        if self._work_deferred:
            with self._batch_lock:
                if self._batch_depth:
                    self._batch_keep.append(arrays)

    def close(self) -> None:
        """Frees the registry; further calls raise ValueError. Inside a batch
        scope, close() first ends every open scope, so deferred work runs and
        its outputs are valid: nothing is lost; the scope's own end is then a
        no-op."""
        h = getattr(self, "_handle", None)
        if h is not None:
            self._handle = None
            _native.lib().fm_destroy_registry(h)
            with self._batch_lock:
                self._batch_depth = 0
                self._batch_keep.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Registry(backend={self.backend!r})"

    @contextlib.contextmanager
    def batch(self) -> Iterator[Registry]:
        """A batch scope: the backend may defer work until the scope closes
        (Metal: one command buffer). Read outputs after the ``with`` block.
        On a deferring backend (Metal) the arrays of calls made inside
        (including temporary contiguous copies of inputs) are kept alive until
        the outermost scope ends; cpu and sim finish each call as it returns
        and keep nothing."""
        _native.call(self, "fm_begin_batch", op="begin_batch")
        with self._batch_lock:
            self._batch_depth += 1
        try:
            yield self
        finally:
            if self._handle is not None:  # close() inside the scope already ended it
                try:
                    _native.call(self, "fm_end_batch", op="end_batch")
                finally:
                    with self._batch_lock:
                        self._batch_depth -= 1
                        if self._batch_depth == 0:
                            self._batch_keep.clear()


def _free_host(ptr: Any) -> None:
    _native.lib().fm_free_host(ptr, _native.ffi().NULL)


def metal_sim_counters() -> dict[str, int]:
    """The metal-sim runtime's counters; see ``Registry.metal_counters``."""
    ffi = _native.ffi()
    out = ffi.new("int64_t[]", len(METAL_SIM_COUNTERS))
    _native.call_static("fm_metal_sim_counters", out, len(METAL_SIM_COUNTERS), op="metal_counters")
    return dict(zip(METAL_SIM_COUNTERS, (int(v) for v in out)))


def metal_sim_last_violation() -> str:
    """The last Metal rule the metal-sim runtime saw broken, with its Apple
    documentation page ("" for none)."""
    ffi = _native.ffi()
    buf = ffi.new("char[]", 2048)
    _native.lib().fm_metal_sim_last_violation(buf, 2048)
    text: str = ffi.string(buf).decode(errors="replace")
    return text


_defaults: dict[str, Registry] = {}
_defaults_lock = threading.Lock()


def _new_defaults_lock_in_child() -> None:
    # A lock held by another thread at fork() stays held in the child.
    global _defaults_lock
    _defaults_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_defaults_lock_in_child)


def default_registry(backend: str = "auto") -> Registry:
    """A process-wide registry per backend name, created on first use (and
    again after a caller closed it, which would otherwise poison every later
    ``registry=`` name lookup)."""
    with _defaults_lock:
        r = _defaults.get(backend)
        if r is None or r._handle is None:
            r = _defaults[backend] = Registry(backend)
        return r


#: What a ``registry=`` argument accepts: a Registry, a backend name, or None (auto).
RegistryLike = Registry | str | None


def resolve(registry: RegistryLike, op: str) -> Registry:
    """The registry a ``registry=`` argument names, for a call of ``op``
    about to run on it: on the cpu backend the worker pool's sleeping
    threads are woken now, so their wake-up overlaps the argument handling
    that comes before the call instead of the call."""
    if registry is None:
        reg = default_registry()
    elif isinstance(registry, Registry):
        reg = registry
    elif isinstance(registry, str):
        reg = default_registry(registry)
    else:
        raise InvalidTypeError(op, f"registry must be a Registry or a backend name, got {type(registry).__name__}")
    if reg.backend == "cpu":  # the backend that runs calls on the worker pool
        _native.lib().fm_prepare_workers()
    return reg
