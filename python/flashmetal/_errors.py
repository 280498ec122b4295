"""Maps the library's status codes to Python exceptions."""
from __future__ import annotations

FM_OK = 0
FM_ERROR_VALUE = 1
FM_ERROR_TYPE = 2
FM_ERROR_BACKEND = 3
FM_ERROR_INTERNAL = 4


class BackendError(RuntimeError):
    """A backend failed to run a kernel (e.g. a simulator diagnostic)."""


def raise_for_status(status: int, message: str) -> None:
    if status == FM_OK:
        return
    if status == FM_ERROR_VALUE:
        raise ValueError(message)
    if status == FM_ERROR_TYPE:
        raise TypeError(message)
    if status == FM_ERROR_BACKEND:
        raise BackendError(message)
    raise RuntimeError(message or f"flashmetal: status {status}")
