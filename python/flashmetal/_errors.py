"""Maps the library's status codes (FMStatus of flashmetal.h) to Python exceptions."""
from __future__ import annotations

import functools

from . import _loader


@functools.cache
def _codes() -> tuple[int, int, int, int]:
    lib = _loader.load()[1]
    return lib.FM_OK, lib.FM_ERROR_VALUE, lib.FM_ERROR_TYPE, lib.FM_ERROR_BACKEND


class BackendError(RuntimeError):
    """A backend failed to run a kernel (e.g. a simulator diagnostic)."""


def raise_for_status(status: int, message: str) -> None:
    ok, value, type_, backend = _codes()
    if status == ok:
        return
    if status == value:
        raise ValueError(message)
    if status == type_:
        raise TypeError(message)
    if status == backend:
        raise BackendError(message)
    if status == _loader.load()[1].FM_ERROR_INTERRUPTED:
        # A SIGINT cut the call short (outputs unspecified). Python's own
        # handler normally raised KeyboardInterrupt as the call returned; a
        # handler that does not raise still must not see a finished call.
        raise KeyboardInterrupt(message)
    raise RuntimeError(message or f"flashmetal: status {status}")
